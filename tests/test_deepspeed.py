"""GradCache under DeepSpeed ZeRO-2 and ZeRO-3, two processes on CPU over gloo
(``tests/helpers/deepspeed_workers.py``; skipped where DeepSpeed is not installed).

One SGD step (lr 1) of a tiny CLIP and a Qwen2-style decoder DualEncoder, dropout on: the cached
step through the engine (``deepspeed_no_sync``, the engine's backward, ``engine.step()``) moves
every parameter as the uncached step does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.fsdp_workers import scale_name
from tests.helpers.offline import run_two_processes

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def deepspeed_parameters(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("deepspeed")
    run_two_processes(REPO / "tests" / "helpers" / "deepspeed_workers.py", out, env={"DS_ACCELERATOR": "cpu"})
    return torch.load(out / "parameters.pt")


@pytest.mark.parametrize("kind", ["clip", "decoder"])
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_deepspeed_cached_step_moves_parameters_as_the_uncached_step(deepspeed_parameters, stage, kind):
    start = deepspeed_parameters["start", kind]
    uncached = deepspeed_parameters[stage, kind, "uncached"]
    cached = deepspeed_parameters[stage, kind, "cached"]
    assert cached.keys() == uncached.keys() == start.keys() and len(start) > 10
    for name, before in start.items():
        update = uncached[name].reshape(before.shape) - before
        difference = float((cached[name].reshape(before.shape) - uncached[name].reshape(before.shape)).norm())
        assert difference <= 1e-4 * float(update.norm()) + 1e-6, f"{name}: {difference:.2e}"
    scale = scale_name(kind)
    assert float((uncached[scale] - start[scale]).abs().max()) > 0  # the scale learned


def test_deepspeed_no_sync_rejects_what_is_not_an_engine():
    from hf_infcl.sharding import deepspeed_no_sync

    with pytest.raises(TypeError, match="DeepSpeed engine"), deepspeed_no_sync(torch.nn.Linear(2, 2)):
        pass


def test_cached_step_refuses_a_zero3_loss_parameter_that_zero3_would_free():
    """A ZeRO-3 parameter read after the model's forward must be kept gathered; without it the
    loss would read an empty placeholder (DeepSpeed's marker of a partitioned parameter, ds_status,
    is set by hand: this runs without DeepSpeed)."""
    pytest.importorskip("deepspeed")  # the gathered read of the accepted parameter imports it
    from hf_infcl.grad_cache import cached_step

    scale = torch.nn.Parameter(torch.ones(1))
    scale.ds_status = "NOT_AVAILABLE"
    batch = {"x": torch.randn(4, 3)}
    refusal = r"loss parameter is partitioned by DeepSpeed ZeRO-3.*keep_gathered_under_zero3"
    with pytest.raises(ValueError, match=refusal):
        cached_step(lambda chunk: chunk["x"], batch, lambda rows, s: (rows * s).sum(), 2, loss_params=[scale])
    scale.is_external_param = True  # what keep_gathered_under_zero3 sets
    cached_step(lambda chunk: chunk["x"], batch, lambda rows, s: (rows * s).sum(), 2, loss_params=[scale])
    assert scale.grad is not None
