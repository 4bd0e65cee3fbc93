"""``losses.InfCLLoss`` and ``losses.InfCLGISTLoss`` trained by ``SentenceTransformerTrainer`` on a
sharded model, two processes on CPU over gloo (``tests/helpers/sentence_transformers_sharded_workers.py``).

Under FSDP2, two SGD steps with dropout on, without and with ``mini_batch_size``, move every
parameter as the Trainer's DDP does on the same data, and a cached step gathers each FSDP2 unit
once and reduce-scatters its gradients once (sentence-transformers' own replays would do both for
every mini-batch). Under DeepSpeed ZeRO-2 and ZeRO-3 (its CPU accelerator) the uncached losses
match DDP the same way, and ``mini_batch_size`` is refused at the first step.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers.offline import run_two_processes
from tests.test_fsdp import assert_same_grads

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "helpers" / "sentence_transformers_sharded_workers.py"
LOSSES = ("mnrl", "gist")
RUNS = [f"{loss}{suffix}" for loss in LOSSES for suffix in ("", "-cached")]
STAGES = ("zero2", "zero3")


def load_runs(out: Path, engines, extra_runs=()) -> dict[str, dict]:
    runs = {f"{engine}-{run}": torch.load(out / f"{engine}-{run}.pt") for engine in ("ddp", *engines)
            for run in (*RUNS, *extra_runs)}
    runs["start"] = torch.load(out / "start.pt")
    return runs


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("torch.distributed.fsdp")
    out = tmp_path_factory.mktemp("st_fsdp")
    run_two_processes(WORKER, out, "fsdp")
    runs = load_runs(out, ["fsdp"], ["mnrl-cached-accumulate"])
    runs["abandoned_forward"] = torch.load(out / "abandoned_forward.pt")
    return runs


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("st_deepspeed")
    run_two_processes(WORKER, out, "deepspeed", env={"DS_ACCELERATOR": "cpu"})
    return load_runs(out, STAGES)


def check_matches_ddp(runs: dict[str, dict], name: str, run: str) -> None:
    reference, sharded = runs[f"ddp-{run}"], runs[f"{name}-{run}"]
    assert_same_grads(sharded["parameters"], reference["parameters"], tolerance=1e-5)
    assert len(reference["losses"]) == 2
    for got, want in zip(sharded["losses"], reference["losses"], strict=True):
        assert math.isclose(got, want, rel_tol=1e-5), run
    # the steps moved the encoder, so agreeing above says something
    start = runs["start"]
    moved = max(float((reference["parameters"][name] - value).norm() / value.norm())
                for name, value in start.items() if "encoder" in name)
    assert moved > 1e-3


@pytest.mark.parametrize("run", RUNS)
def test_sentence_transformers_under_fsdp2_matches_ddp(fsdp_runs, run):
    assert fsdp_runs[f"fsdp-{run}"]["units"] == 3  # the two BertLayers and the root: the model is sharded
    check_matches_ddp(fsdp_runs, "fsdp", run)


@pytest.mark.parametrize("loss", LOSSES)
def test_sentence_transformers_cached_loss_under_fsdp2_gathers_and_reduces_once_per_step(fsdp_runs, loss):
    """Three mini-batches per column and rank: without the loss's FSDP2 handling each of the six
    replays would reduce-scatter (18 per step) and gather again (30)."""
    cached = fsdp_runs[f"fsdp-{loss}-cached"]
    units = cached["units"]
    assert cached["steps"] == [{"all_gather": units, "reduce_scatter": units}] * 2
    # without caching, one backward: FSDP2 itself reduces once
    assert [step["reduce_scatter"] for step in fsdp_runs[f"fsdp-{loss}"]["steps"]] == [units] * 2


def test_sentence_transformers_cached_loss_under_fsdp2_with_gradient_accumulation(fsdp_runs):
    """Two micro-batches per optimizer step: the Trainer's no_sync holds the first one's replays
    unreduced too, so the step still reduce-scatters once (each micro-batch gathers once)."""
    sharded = fsdp_runs["fsdp-mnrl-cached-accumulate"]
    check_matches_ddp(fsdp_runs, "fsdp", "mnrl-cached-accumulate")
    units = sharded["units"]
    assert sharded["steps"] == [{"all_gather": 2 * units, "reduce_scatter": units}] * 2


def test_sentence_transformers_cached_loss_under_fsdp2_after_a_forward_without_backward(fsdp_runs):
    """The abandoned forward left gradient sync off and the units gathered; the next cached step
    puts both back first, so it reduce-scatters once per unit (three units: layers and root)."""
    assert fsdp_runs["abandoned_forward"] == {"all_gather": 3, "reduce_scatter": 3}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("stage", STAGES)
def test_sentence_transformers_under_deepspeed_matches_ddp_without_caching(deepspeed_runs, stage, loss):
    check_matches_ddp(deepspeed_runs, stage, loss)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("stage", STAGES)
def test_sentence_transformers_cached_loss_under_deepspeed_is_refused_at_the_first_step(deepspeed_runs, stage,
                                                                                       loss):
    run = deepspeed_runs[f"{stage}-{loss}-cached"]
    loss_class = {"mnrl": "InfCLLoss", "gist": "InfCLGISTLoss"}[loss]
    assert run["refused"] is not None, "trained under DeepSpeed with mini_batch_size"
    assert run["refused"].startswith(f"{loss_class} with mini_batch_size or mini_batch_num_tokens")
    assert "fsdp_config" in run["refused"] and run["steps"] == []  # before any step ended


class EngineStandIn(torch.nn.Module):
    """What sentence-transformers' Trainer puts in the loss under ``deepspeed=...``: a module with
    DeepSpeed's accumulation-boundary API (the engine itself needs DeepSpeed's initialisation)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        raise AssertionError("the refusal comes before any use of the engine")

    def forward(self, features):
        raise AssertionError("the refusal comes before any embedding")


@pytest.mark.parametrize("loss_class", ["InfCLLoss", "InfCLGISTLoss"])
def test_sentence_transformers_cached_loss_refuses_deepspeed(tmp_path, loss_class):
    from hf_infcl import losses
    from tests.helpers.sentence_transformers_fixtures import (
        build_tiny_model_dir,
        features,
        load_tiny_model,
        text_columns,
    )

    model = load_tiny_model(build_tiny_model_dir(tmp_path / "model"))
    guide = (model,) if loss_class == "InfCLGISTLoss" else ()
    loss = getattr(losses, loss_class)(model, *guide, mini_batch_size=2)
    batch = features(model, text_columns(4, 2, seed=5))
    loss.model = EngineStandIn(model)  # what the Trainer does at its first step under DeepSpeed
    with pytest.raises(ValueError, match=rf"{loss_class} with mini_batch_size.*DeepSpeed.*fsdp_config"):
        loss(batch, None)
    # without caching the loss does not refuse (it calls the engine's forward)
    loss.mini_batch_size = None
    loss.uses_gradient_cache = False
    with pytest.raises(AssertionError, match="before any embedding"):
        loss(batch, None)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_sentence_transformers_sharded_matches_ddp_on_two_gpus(tmp_path, engine):
    """The Trainer's own FSDP2 (and DeepSpeed with NCCL) on two CUDA devices, the losses in exact
    fp32: the CPU tests' checks at 1e-4."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    run_two_processes(WORKER, tmp_path, engine, cuda=True)
    if engine == "fsdp":
        runs = load_runs(tmp_path, ["fsdp"], ["mnrl-cached-accumulate"])
        matched = [("fsdp", run) for run in (*RUNS, "mnrl-cached-accumulate")]
        refused = []
    else:
        runs = load_runs(tmp_path, STAGES)
        matched = [(stage, loss) for stage in STAGES for loss in LOSSES]
        refused = [f"{stage}-{loss}-cached" for stage in STAGES for loss in LOSSES]
    for name, run in matched:
        sharded, reference = runs[f"{name}-{run}"], runs[f"ddp-{run}"]
        assert_same_grads(sharded["parameters"], reference["parameters"], tolerance=1e-4)
    for loss in LOSSES if engine == "fsdp" else ():
        cached = runs[f"fsdp-{loss}-cached"]
        assert cached["steps"] == [{"all_gather": cached["units"], "reduce_scatter": cached["units"]}] * 2
    assert all(runs[name]["refused"] for name in refused)
