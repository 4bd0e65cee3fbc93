"""Where one process makes the checks that read values (hf_infcl.ops.value_check): block ops
that ask for it (the Triton ones) get the check pending and run it just before their first
kernel; any other block ops see it made before they are called; a check nobody ran still runs
before the loss returns. (The Triton block ops themselves: tests/helpers/triton_interpreted.py.)"""

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

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(value_check, "check_values", counted)
        value = contrastive_loss(queries, keys, 3.0, backend=DeferringTiles(events=[]))
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    assert calls == [1]
    value_check.run_deferred_check()  # nothing left pending after the call
    assert calls == [1]
