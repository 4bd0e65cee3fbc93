"""InfCLTrainer under FSDP2 and DeepSpeed ZeRO-2/3, two processes: ``tests/helpers/trainer_fsdp_workers.py``.

On CPU (gloo) the worker switches the Trainer's Accelerator to FSDP2 (Accelerate enables FSDP on
GPUs only), and runs DeepSpeed through its CPU accelerator; the GPU test runs the Trainer's own
``fsdp`` and ``deepspeed`` arguments on two CUDA devices. Each checks that two steps with and
without ``chunk_size`` (under FSDP2, with each ``chunk_gradient_sync`` and
``chunk_parameter_gather``; under ZeRO-2 and ZeRO-3) give the parameters of the same run
under DDP, and that the saved CLIPModel loads with its 0-d logit scale; the FSDP2 runs again with
SigLIP 2 on NaFlex batches.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers.offline import run_two_processes
from tests.helpers.trainer_fixtures import tiny_siglip2
from tests.test_fsdp import assert_same_grads

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"fsdp": ["fsdp", "fsdp-chunk-step", "fsdp-chunk-chunk", "fsdp-chunk-step-gather-chunk"],
            "deepspeed": ["zero2", "zero2-chunk", "zero3", "zero3-chunk"]}


def run_worker(out: Path, cuda: bool, engine: str = "fsdp", family: str = "clip") -> dict[str, dict]:
    env = {"DS_ACCELERATOR": "cpu"} if engine == "deepspeed" and not cuda else None
    run_two_processes(REPO / "tests" / "helpers" / "trainer_fsdp_workers.py", out, engine, family, cuda=cuda,
                      env=env)
    return {name: torch.load(out / f"{name}.pt") for name in ["ddp", *VARIANTS[engine]]}


def check_runs(runs: dict[str, dict], out: Path, tolerance: float, family: str = "clip") -> None:
    from transformers import CLIPModel, Siglip2Model

    # the saved model keeps the family's own shape of the scale: CLIP's 0-d, SigLIP 2's [1]
    model_class, scale_shape = {"clip": (CLIPModel, ()), "siglip2": (Siglip2Model, (1,))}[family]
    reference = runs["ddp"]
    reference_losses = [entry["loss"] for entry in reference["log_history"] if "loss" in entry]
    assert len(reference_losses) == 2
    for name in [name for name in runs if name != "ddp"]:
        parameters = runs[name]["parameters"]
        assert parameters["logit_scale"].shape == (1,)  # what fully_shard needs
        assert_same_grads(parameters, reference["parameters"], tolerance)
        losses = [entry["loss"] for entry in runs[name]["log_history"] if "loss" in entry]
        for got, want in zip(losses, reference_losses, strict=True):
            assert math.isclose(got, want, rel_tol=tolerance), name
        # save_model writes the model's own shape of the scale, so from_pretrained keeps the trained value
        loaded = model_class.from_pretrained(out / name)
        assert loaded.logit_scale.shape == scale_shape
        assert math.isclose(float(loaded.logit_scale), float(parameters["logit_scale"]), rel_tol=1e-6)
        if family == "siglip2":  # the sigmoid loss trains the bias, sharded like the scale
            assert parameters["logit_bias"].shape == (1,)
            assert not torch.equal(parameters["logit_bias"], tiny_siglip2().logit_bias.detach()), name


def test_trainer_under_fsdp2_matches_ddp_with_and_without_chunks(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    check_runs(run_worker(tmp_path, cuda=False), tmp_path, tolerance=1e-5)


def test_siglip2_under_fsdp2_matches_ddp_with_and_without_chunks(tmp_path):
    """SigLIP 2 on NaFlex batches (image rows of different numbers of patches): its sigmoid loss,
    bias and chunked image inputs under FSDP2, against the same run under DDP."""
    pytest.importorskip("torch.distributed.fsdp")
    check_runs(run_worker(tmp_path, cuda=False, family="siglip2"), tmp_path, tolerance=1e-5, family="siglip2")


def test_trainer_under_deepspeed_zero2_and_zero3_matches_ddp_with_and_without_chunks(tmp_path):
    pytest.importorskip("deepspeed")
    check_runs(run_worker(tmp_path, cuda=False, engine="deepspeed"), tmp_path, tolerance=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["clip", "siglip2"])
def test_trainer_under_fsdp2_matches_ddp_on_two_gpus(tmp_path, family):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    check_runs(run_worker(tmp_path, cuda=True, family=family), tmp_path, tolerance=1e-4, family=family)


@pytest.mark.gpu
def test_trainer_under_deepspeed_zero2_and_zero3_matches_ddp_on_two_gpus(tmp_path):
    pytest.importorskip("deepspeed")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    check_runs(run_worker(tmp_path, cuda=True, engine="deepspeed"), tmp_path, tolerance=1e-4)
