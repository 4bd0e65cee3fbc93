"""GradCache under FSDP2 (``fully_shard``), two processes on CPU over gloo (``pytest -k fsdp``).

``tests/helpers/fsdp_workers.py`` runs once per session and writes every variant's full gradients; the
tests compare them: the cached step, with either reduction strategy, equals the uncached step
under the same sharding (dropout on: the replays draw the same masks), and with dropout off both
equal one process without FSDP on the concatenated batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.fsdp_workers import scale_name
from tests.helpers.offline import run_two_processes

REPO = Path(__file__).resolve().parent.parent
KINDS = ["clip", "dual-encoder", "decoder"]  # decoder: a Qwen2-style DualEncoder, last-token pooling
STRATEGIES = ["cached-per-step", "cached-per-replay", "cached-per-step-gather-once",
              "cached-per-replay-gather-once"]


@pytest.fixture(scope="module")
def fsdp_grads(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    out = tmp_path_factory.mktemp("fsdp")
    run_two_processes(REPO / "tests" / "helpers" / "fsdp_workers.py", out)
    return torch.load(out / "grads.pt")


def assert_same_grads(got, expected, tolerance: float = 1e-5):
    """Tensor dicts (gradients or parameters) equal, each within ``tolerance`` of its norm."""
    assert got.keys() == expected.keys() and len(expected) > 10
    for name, reference in expected.items():
        value = got[name].reshape(reference.shape).float()
        # Norm-wise, with an absolute floor: a few gradients are zero in exact arithmetic (the
        # attention key biases) and hold only fp32 rounding noise of ~1e-7.
        difference, size = float((value - reference.float()).norm()), float(reference.norm())
        assert difference <= tolerance * size + 1e-6, f"{name}: difference {difference:.2e}, norm {size:.2e}"


@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no-dropout"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_cached_step_equals_the_uncached_step(fsdp_grads, kind, strategy, dropout):
    cached = dict(fsdp_grads[(kind, dropout, strategy)])
    cached.pop("all-gathers")
    assert_same_grads(cached, fsdp_grads[(kind, dropout, "uncached")])
    assert float(cached[scale_name(kind)].abs().max()) > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("setting", ["bf16", "checkpointing", "offload"])
def test_fsdp_cached_step_with_what_big_models_use(fsdp_grads, setting, strategy):
    """The decoder DualEncoder, dropout on, with activation checkpointing or parameters offloaded
    to the host: the cached step equals the uncached step under the same setting. With bf16
    parameters (fp32 reduction) the two round differently (the uncached loss even sees a bf16
    logit scale, the cached one its fp32 value), so both are held to the fp32 step: the cached
    step's worst parameter may be at most 1.25 x as far from it as the uncached step's."""
    kind = f"decoder-{setting}"
    cached, uncached = dict(fsdp_grads[(kind, 0.1, strategy)]), fsdp_grads[(kind, 0.1, "uncached")]
    cached.pop("all-gathers")
    assert float(cached[scale_name(kind)].abs().max()) > 0
    if setting != "bf16":
        assert_same_grads(cached, uncached)
        return
    fp32 = fsdp_grads[("decoder", 0.1, "uncached")]

    def worst_error(grads):
        return max(float((grads[name].float().reshape(value.shape) - value).norm())
                   / (float(value.norm()) + 1e-6) for name, value in fp32.items())

    assert cached.keys() == fp32.keys()
    assert worst_error(cached) <= 1.25 * worst_error(uncached) and worst_error(cached) < 0.25


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_steps_equal_one_process_on_the_concatenated_batch(fsdp_grads, kind):
    """The loss's mean over the group and the logit scale's gradient averaged over ranks give the
    gradient of one process's mean over every pair."""
    one_process = fsdp_grads[(kind, 0.0, "one-process")]
    for variant in ("uncached", *STRATEGIES):
        grads = dict(fsdp_grads[(kind, 0.0, variant)])
        grads.pop("all-gathers", None)
        assert_same_grads(grads, one_process)


# fully_shard units of the worker's models: each encoder/decoder layer, and the root
UNITS = {"clip": 5, "dual-encoder": 3, "decoder": 3}


@pytest.mark.parametrize("strategy", ["cached-per-step", "cached-per-replay"])
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_gather_once_gathers_each_unit_once_per_step(fsdp_grads, kind, strategy):
    """Three chunks: FSDP2 alone gathers every unit for each chunk's forward in both passes and
    again for each replay's backward; inside fsdp_gather_once each unit is gathered once."""
    default = int(fsdp_grads[(kind, 0.1, strategy)]["all-gathers"])
    once = int(fsdp_grads[(kind, 0.1, f"{strategy}-gather-once")]["all-gathers"])
    assert once == UNITS[kind], (once, default)
    assert default >= 2 * 3 * UNITS[kind] - 1, default


def test_fsdp_no_sync_rejects_a_module_that_is_not_sharded():
    from hf_infcl.sharding import fsdp_no_sync

    with pytest.raises(TypeError, match="fully_shard"), fsdp_no_sync(torch.nn.Linear(2, 2)):
        pass
