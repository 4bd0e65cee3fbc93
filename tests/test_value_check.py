"""Where one process makes the checks that read values (hf_infcl.ops.value_check): block ops
that ask for it (the Triton ones) get the check pending and run it just before their first
kernel; any other block ops see it made before they are called; a check nobody ran still runs
before the loss returns. A check of the scale alone on a GPU reads it after the block ops were
called, and still raises before the loss returns. (The Triton block ops themselves:
tests/helpers/triton_interpreted.py; the GPU's own reading: tests/test_triton.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from hf_infcl import TorchTiles, contrastive_loss
from hf_infcl.ops import value_check


@dataclass(frozen=True)
class RecordingTiles(TorchTiles):
    """TorchTiles that record, per forward, whether the value check had run when they started,
    and that run a pending check (``runs_first_kernel``) after their own preparation."""

    events: list = None
    runs_first_kernel: bool = True

    def forward_block(self, *arguments, **options):
        self.events.append("forward")
        if self.runs_first_kernel:
            value_check.run_deferred_check()
            self.events.append("checked")
        return super().forward_block(*arguments, **options)


@dataclass(frozen=True)
class DeferringTiles(RecordingTiles):
    runs_deferred_value_check: ClassVar[bool] = True


def inputs():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    return torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(8, 4, generator=gen,
                                                                                dtype=torch.float64)


@pytest.mark.parametrize("runs_first_kernel", [True, False], ids=["run-by-the-ops", "run-at-the-end"])
def test_a_deferred_check_raises_after_the_block_ops_preparation(runs_first_kernel):
    events = []
    ops = DeferringTiles(events=events, runs_first_kernel=runs_first_kernel)
    queries, keys = inputs()
    with pytest.raises(ValueError, match="logit_scale"):
        contrastive_loss(queries, keys, torch.tensor(-1.0, dtype=torch.float64), backend=ops)
    assert events == ["forward"]  # called with the bad scale: the check came after, and raised
    if runs_first_kernel:  # (positives out of range must be caught before a kernel indexes by them)
        with pytest.raises(ValueError, match="positives"):
            contrastive_loss(queries, keys, 2.0, positives=torch.tensor([0, 1, 2, 3, 4, 8]), backend=ops)
        assert events == ["forward", "forward"]


def test_other_block_ops_see_the_check_made_before_they_are_called():
    events = []
    ops = RecordingTiles(events=events, runs_first_kernel=False)
    queries, keys = inputs()
    with pytest.raises(ValueError, match="logit_scale"):
        contrastive_loss(queries, keys, torch.tensor(-1.0, dtype=torch.float64), backend=ops)
    assert events == []


def test_a_deferred_check_that_passes_runs_once_and_changes_nothing():
    queries, keys = inputs()
    expected = contrastive_loss(queries, keys, 3.0, backend="reference")
    calls = []
    check = value_check.check_values

    def counted(*arguments):
        calls.append(1)
        check(*arguments)

    scale = torch.tensor(3.0, dtype=torch.float64)  # a tensor: its value must be read (a float's is at hand)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(value_check, "check_values", counted)
        value = contrastive_loss(queries, keys, scale, backend=DeferringTiles(events=[]))
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    assert calls == [1]
    value_check.run_deferred_check()  # nothing left pending after the call
    assert calls == [1]


@pytest.fixture
def scale_read_later_on_cpu(monkeypatch):
    """The CPU treated as the GPU is: the scale read after the block ops were called."""
    monkeypatch.setattr(value_check, "READ_SCALE_LATER_ON", ("cpu",))


@pytest.mark.parametrize("ops_class", [RecordingTiles, DeferringTiles], ids=["other-ops", "deferring-ops"])
def test_a_scale_read_later_raises_after_the_block_ops_and_before_the_loss_returns(
        scale_read_later_on_cpu, ops_class):
    events = []
    ops = ops_class(events=events, runs_first_kernel=False)
    queries, keys = inputs()
    with pytest.raises(ValueError, match="logit_scale must be > 0"):
        contrastive_loss(queries, keys, torch.tensor(-1.0, dtype=torch.float64), backend=ops)
    assert events == ["forward"]  # the block ops ran, and their result was not returned
    # positives given: a kernel indexes the keys by them, so the check comes first as before
    with pytest.raises(ValueError, match="positives"):
        contrastive_loss(queries, keys, 2.0, positives=torch.tensor([0, 1, 2, 3, 4, 8]),
                         backend=RecordingTiles(events=events, runs_first_kernel=False))
    assert events == ["forward"]


def test_a_scale_read_later_that_passes_changes_nothing(scale_read_later_on_cpu):
    queries, keys = inputs()
    scale = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    expected = contrastive_loss(queries, keys, scale, backend="reference")
    value = contrastive_loss(queries, keys, scale, backend=DeferringTiles(events=[], runs_first_kernel=False))
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    value.backward()
    assert scale.grad is not None and torch.isfinite(scale.grad)


@pytest.mark.parametrize("read_later", [False, True], ids=["cpu", "read-later"])
def test_a_scale_given_as_a_number_is_checked_on_the_host_and_never_read_back(monkeypatch, read_later):
    """A float scale's value is at hand: a bad one raises before the block ops are called, and a
    good one with the default pairing leaves nothing to read (no host synchronisation at all)."""
    if read_later:
        monkeypatch.setattr(value_check, "READ_SCALE_LATER_ON", ("cpu",))
    readings = []
    monkeypatch.setattr(value_check, "check_values", lambda *arguments: readings.append("check_values"))
    monkeypatch.setattr(value_check, "ScaleReading", lambda scale: readings.append("ScaleReading"))
    events = []
    queries, keys = inputs()
    for bad in (-1.0, 0, 0.0):
        with pytest.raises(ValueError, match="logit_scale must be > 0"):
            contrastive_loss(queries, keys, bad, backend=DeferringTiles(events=events))
    assert events == [] and readings == []
    expected = contrastive_loss(queries, keys, 2.5, backend="reference")
    value = contrastive_loss(queries, keys, 2.5, backend=DeferringTiles(events=events))
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    assert events == ["forward", "checked"] and readings == []
    # positives given: their range is still read (the scale with them, in one reading)
    contrastive_loss(queries, keys, 2.5, positives=torch.tensor([0, 1, 2, 3, 4, 7]),
                     backend=DeferringTiles(events=events))
    assert readings == ["check_values"]
