"""``losses.InfCLLoss``, ``losses.InfCLGISTLoss`` and ``losses.InfCLDistillLoss`` trained by
``SentenceTransformerTrainer`` on a sharded model, two processes on CPU over gloo
(``tests/helpers/sentence_transformers_sharded_workers.py``).

Under FSDP2, two SGD steps with dropout on, without and with ``mini_batch_size``, move every
parameter as the Trainer's DDP does on the same data, and a cached step gathers each FSDP2 unit
once and reduce-scatters its gradients once (sentence-transformers' own replays would do both for
every mini-batch). Under DeepSpeed ZeRO-2 and ZeRO-3 (its CPU accelerator) the losses match DDP
the same way, and a cached step reduces what one uncached backward reduces (ZeRO-2 alone would stop
at the second replay with "Gradient computed twice").
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hf_infcl.sharding import deepspeed_hold_reduction
from tests.helpers.offline import run_two_processes
from tests.test_fsdp import assert_same_grads

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "helpers" / "sentence_transformers_sharded_workers.py"
LOSSES = ("mnrl", "gist", "distill")
RUNS = [f"{loss}{suffix}" for loss in LOSSES for suffix in ("", "-cached")]
STAGES = ("zero2", "zero3")
ACCUMULATE = "mnrl-cached-accumulate"


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
    runs = load_runs(out, ["fsdp"], [ACCUMULATE])
    runs["abandoned_forward"] = torch.load(out / "abandoned_forward.pt")
    return runs


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("st_deepspeed")
    run_two_processes(WORKER, out, "deepspeed", env={"DS_ACCELERATOR": "cpu"})
    return load_runs(out, STAGES, [ACCUMULATE])


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
    sharded = fsdp_runs[f"fsdp-{ACCUMULATE}"]
    check_matches_ddp(fsdp_runs, "fsdp", ACCUMULATE)
    units = sharded["units"]
    assert sharded["steps"] == [{"all_gather": 2 * units, "reduce_scatter": units}] * 2


def test_sentence_transformers_cached_loss_under_fsdp2_after_a_forward_without_backward(fsdp_runs):
    """The abandoned forward left gradient sync off and the units gathered; the next cached step
    puts both back first, so it reduce-scatters once per unit (three units: layers and root)."""
    assert fsdp_runs["abandoned_forward"] == {"all_gather": 3, "reduce_scatter": 3}


@pytest.mark.parametrize("run", [*RUNS, ACCUMULATE])
@pytest.mark.parametrize("stage", STAGES)
def test_sentence_transformers_under_deepspeed_matches_ddp(deepspeed_runs, stage, run):
    check_matches_ddp(deepspeed_runs, stage, run)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("stage", STAGES)
def test_sentence_transformers_cached_loss_under_deepspeed_reduces_once_per_step(deepspeed_runs, stage, loss):
    """Three mini-batches per column and rank: the cached step's reductions carry as many elements
    as the uncached step's single backward (each parameter's gradient is reduced once)."""
    uncached = [step["reduced"] for step in deepspeed_runs[f"{stage}-{loss}"]["steps"]]
    cached = [step["reduced"] for step in deepspeed_runs[f"{stage}-{loss}-cached"]["steps"]]
    assert len(uncached) == 2 and uncached[0] > 0
    assert cached == uncached


@pytest.mark.parametrize("stage", STAGES)
def test_sentence_transformers_cached_loss_under_deepspeed_with_gradient_accumulation(deepspeed_runs, stage):
    """Two micro-batches per optimizer step: ZeRO reduces at each micro-batch's engine backward
    (its own design under accumulation), so a step reduces twice what one backward does, once per
    micro-batch, not once per replay."""
    once = deepspeed_runs[f"{stage}-mnrl"]["steps"][0]["reduced"]
    assert [step["reduced"] for step in deepspeed_runs[f"{stage}-{ACCUMULATE}"]["steps"]] == [2 * once] * 2


class EngineStandIn(torch.nn.Module):
    """What sentence-transformers' Trainer puts in the loss under ``deepspeed=...``: a module with
    DeepSpeed's accumulation-boundary API around the model (the engine itself needs DeepSpeed's
    initialisation)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        raise AssertionError("the replays leave the engine's boundary alone")

    def forward(self, features):
        return self.module(features)


@pytest.mark.parametrize("no_grad_mini_batch_size", [None, 4], ids=["alike", "no_grad4"])
@pytest.mark.parametrize("loss_class", ["InfCLLoss", "InfCLGISTLoss", "InfCLDistillLoss"])
def test_sentence_transformers_cached_loss_holds_deepspeed_reduction_until_the_last_replay(tmp_path,
                                                                                          loss_class,
                                                                                          no_grad_mini_batch_size):
    """What ZeRO reads when a parameter's gradient has accumulated (``ds_grad_is_ready``): False
    for every replay's backward but the last, True at the last and after the step; the gradient is
    the uncached loss's. With ``no_grad_mini_batch_size=4`` the gradient-free pass embeds each
    column in one mini-batch, and the replays are still four (the last found by its texts)."""
    from hf_infcl import losses
    from tests.helpers.sentence_transformers_fixtures import (
        build_tiny_model_dir,
        features,
        load_tiny_model,
        replay_tolerance,
        text_columns,
    )

    model = load_tiny_model(build_tiny_model_dir(tmp_path / "model")).double().eval()
    guide = (load_tiny_model(build_tiny_model_dir(tmp_path / "guide", seed=1)).double().eval(),) \
        if loss_class != "InfCLLoss" else ()  # GIST's guide, or the distillation's teacher
    numerics = {} if guide else {"backend": "torch"}
    loss = getattr(losses, loss_class)(model, *guide, mini_batch_size=2,
                                       no_grad_mini_batch_size=no_grad_mini_batch_size, **numerics)
    batch = features(model, text_columns(4, 2, seed=5))
    watched = next(model.parameters())
    ready = []
    watched.register_post_accumulate_grad_hook(lambda param: ready.append(param.ds_grad_is_ready))
    loss.model = EngineStandIn(model)  # what the Trainer does at its first step under DeepSpeed
    loss([dict(column) for column in batch], None).backward()
    assert ready == [False, False, False, True]  # two columns of two mini-batches
    assert all(param.ds_grad_is_ready for param in model.parameters())
    cached = watched.grad.clone()
    model.zero_grad()
    loss.model = model
    loss.mini_batch_size = loss.no_grad_mini_batch_size = None
    loss.uses_gradient_cache = False
    loss([dict(column) for column in batch], None).backward()
    torch.testing.assert_close(cached, watched.grad, **replay_tolerance({"rtol": 1e-10, "atol": 1e-12}))


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
    names = ["fsdp"] if engine == "fsdp" else list(STAGES)
    runs = load_runs(tmp_path, names, [ACCUMULATE])
    mismatches = []  # every run checked, so that a failure names all the runs it concerns
    for name, run in [(name, run) for name in names for run in (*RUNS, ACCUMULATE)]:
        sharded, reference = runs[f"{name}-{run}"], runs[f"ddp-{run}"]
        try:
            assert_same_grads(sharded["parameters"], reference["parameters"], tolerance=1e-4)
        except AssertionError as error:
            mismatches.append(f"{name}-{run}: {str(error).splitlines()[0]}")
    assert not mismatches, "\n".join(mismatches)
    for loss in LOSSES if engine == "fsdp" else ():
        cached = runs[f"fsdp-{loss}-cached"]
        assert cached["steps"] == [{"all_gather": cached["units"], "reduce_scatter": cached["units"]}] * 2


class FirstReplayOnlyEngine(EngineStandIn):
    """An engine stand-in whose model has a parameter (``extra``) that only the first forward
    with gradient uses, as an expert of a mixture that no row of the last mini-batch is routed to."""

    replays = 0

    def forward(self, features):
        output = self.module(features)
        if torch.is_grad_enabled():
            self.replays += 1
            if self.replays == 1:
                output["sentence_embedding"] = output["sentence_embedding"] + self.module.extra.sum() * 0
        return output


def test_sentence_transformers_cached_loss_under_deepspeed_refuses_a_parameter_missing_from_the_last_replay(
        tmp_path):
    """Its gradient would stay held in ``.grad``, never reduced: refused at the end of the replays."""
    from hf_infcl import losses
    from tests.helpers.sentence_transformers_fixtures import (
        build_tiny_model_dir,
        features,
        load_tiny_model,
        text_columns,
    )

    model = load_tiny_model(build_tiny_model_dir(tmp_path / "model"))
    model.extra = torch.nn.Parameter(torch.randn(3))
    loss = losses.InfCLLoss(model, mini_batch_size=2, backend="torch")
    batch = features(model, text_columns(4, 2, seed=5))
    loss.model = FirstReplayOnlyEngine(model)
    with pytest.raises(ValueError, match=r"InfCLLoss with mini_batch_size.*DeepSpeed.*; extra were not"):
        loss([dict(column) for column in batch], None).backward()
    assert all(param.ds_grad_is_ready for param in model.parameters())  # the step was ended first
    # used by the last replay too, it is reduced with the rest
    loss.model = EngineStandIn(model)
    loss([dict(column) for column in batch], None).backward()
    assert loss._held is None


def test_deepspeed_hold_reduction_restores_the_flag_and_refuses_a_plain_module():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].requires_grad_(False)

    def flags():
        return [getattr(param, "ds_grad_is_ready", None) for param in model.parameters()]

    with pytest.raises(RuntimeError, match="inside"), deepspeed_hold_reduction(EngineStandIn(model)):
        assert flags() == [False, False, None, None]  # the trainable parameters only
        raise RuntimeError("inside")
    assert flags() == [True, True, None, None]
    refusal = "deepspeed_hold_reduction needs a DeepSpeed engine, got Sequential"
    with pytest.raises(TypeError, match=refusal), deepspeed_hold_reduction(model):
        pass


def test_fsdp_param_groups_reads_either_torch_layout():
    """FSDP2's per-unit state keeps a list of parameter groups on newer torch and a single group
    (None without parameters) on torch 2.11: the reduction check must read both
    (on 2.11 the plural name raised AttributeError at the first cached step)."""
    from types import SimpleNamespace

    from hf_infcl.sharded_replays import fsdp_param_groups

    first, second = SimpleNamespace(reduce_grads=True), SimpleNamespace(reduce_grads=False)
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=[first, second])) == [first, second]
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=first)) == [first]
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
