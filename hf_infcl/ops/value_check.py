"""The argument checks that read values (``logit_scale > 0``, positives in range), and where one
process runs them: as late as the contract allows.

Reading values is one host synchronisation. Made before the loss's first kernel, it leaves the
GPU idle from the moment it has caught up with the host until the host's next launch. On one
process:

- where the check reads only ``logit_scale`` (``positives`` not given), which no kernel indexes
  memory with, a CUDA scale is copied to the host behind the work queued before the loss, and the
  host waits for that copy only once the loss's statistics are queued behind it: the GPU runs them
  while the host waits, and a bad scale raises before the call returns, the queued results unused;
- otherwise the Triton block ops run the check after preparing their operands and buffers, just
  before their first kernel, so that the GPU waits on as little host work as possible; every other
  route runs it before its work starts.

A scale given as a number is checked on the host (``hf_infcl.loss.check_arguments``); with the
default pairing such a call asks for no check here at all. The ring checks before the size
exchange instead (every rank must agree), so none of this concerns it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

# The check a one-process call left for its block ops to run (see deferred_check).
_PENDING: contextvars.ContextVar = contextvars.ContextVar("hf_infcl_pending_value_check", default=None)


def reads_scale_only(positives: torch.Tensor | None) -> bool:
    """Whether the checks read the scale alone: no positives given (``keys[:m]``, in range by
    construction), so nothing to range-check and no kernel that indexes memory by them."""
    return positives is None or not positives.numel()


def check_values(scale: torch.Tensor, positives: torch.Tensor | None, n_keys: int,
                 distinct_positives: bool = False) -> None:
    """The argument checks that read values (one host synchronisation): ``logit_scale`` > 0 and
    every positive index inside ``[0, n_keys)`` (``positives`` None: ``keys[:m]``, in range by
    construction, so only the scale is read); with ``distinct_positives`` (the score filter with a
    column statistic), no key the positive of two rows."""
    scale = scale.detach().reshape(())
    if reads_scale_only(positives):
        scale_value, positive_range, shared = scale.item(), (), 0
    else:
        readings = [scale.to(torch.float64), positives.min().to(torch.float64),
                    positives.max().to(torch.float64)]  # what the checks read, fetched together
        if distinct_positives:
            ordered = torch.sort(positives).values
            readings.append((ordered[1:] == ordered[:-1]).sum().to(torch.float64))
        scale_value, *positive_range = torch.stack(readings).tolist()
        shared = positive_range.pop() if distinct_positives else 0
    check_scale_value(scale_value)
    if positive_range and (n_keys == 0 or positive_range[0] < 0 or positive_range[1] >= n_keys):
        raise ValueError(f"positives must index keys, i.e. lie in [0, {n_keys}); got values outside")
    if shared:
        raise ValueError(
            "positives: two rows share a positive key, which false_negative_margin does not take with the "
            "symmetric softmax loss (each key keeps one column threshold, its row's); pass symmetric=False, "
            "or give each row its own positive key")


def check_scale_value(scale_value: float) -> None:
    """``logit_scale`` > 0, once its value is on the host."""
    if scale_value <= 0:  # a NaN scale passes: non-finite inputs give a NaN loss
        raise ValueError(f"logit_scale must be > 0 (it multiplies the logits), got {scale_value}")


# Device types whose scale is read after the statistics are queued (a CPU tensor's value is at hand).
READ_SCALE_LATER_ON = ("cuda",)


class ScaleReading:
    """``logit_scale``'s value on its way to the host: copied behind the work queued so far,
    without waiting for it; :meth:`check` waits for the copy alone and checks the value."""

    def __init__(self, scale: torch.Tensor):
        scale = scale.detach().reshape(())
        self.event = None
        if scale.device.type == "cuda":
            self.host = torch.empty((), dtype=scale.dtype, pin_memory=True)
            self.host.copy_(scale, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(scale.device))  # the copy's stream
        else:
            self.host = scale.to("cpu", copy=True)

    def check(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        check_scale_value(self.host.item())


@contextlib.contextmanager
def deferred_check(ops, scale: torch.Tensor, positives: torch.Tensor | None, n_keys: int,
                   enabled: bool = True, distinct_positives: bool = False):
    """Around one process's statistics with the block ops ``ops``: :func:`check_values`, left
    pending for the Triton block ops to run just before their first kernel
    (:func:`run_deferred_check`), or run now for any other block ops. Still pending at the end,
    it runs then, a safety net: block ops that ask for the check must run it before a kernel
    reads the positives. ``enabled=False``: no check (the caller made it). ``distinct_positives``:
    as :func:`check_values` takes it. A check of the scale alone on a device of
    :data:`READ_SCALE_LATER_ON` reads the value behind the work queued before the block ops and
    waits for it after them (:class:`ScaleReading`)."""
    if not enabled:
        yield
        return
    if reads_scale_only(positives) and scale.device.type in READ_SCALE_LATER_ON:
        reading = ScaleReading(scale)
        yield
        reading.check()
        return
    if not getattr(ops, "runs_deferred_value_check", False):
        check_values(scale, positives, n_keys, distinct_positives)
        yield
        return
    token = _PENDING.set(functools.partial(check_values, scale, positives, n_keys, distinct_positives))
    try:
        yield
        run_deferred_check()
    finally:
        _PENDING.reset(token)


def run_deferred_check() -> None:
    """Run the check :func:`deferred_check` left pending, once; nothing when none is."""
    check = _PENDING.get()
    if check is not None:
        _PENDING.set(None)
        check()
