"""The argument checks that read values (``logit_scale > 0``, positives in range), and where one
process runs them: as late as the contract allows.

Reading values is one host synchronisation, which leaves the GPU idle until the next launch. On
one process the Triton block ops run the check after preparing their operands and buffers, just
before the loss's first kernel, so that the GPU waits on as little host work as possible; every
other route runs it before its work starts. The ring checks before the size exchange instead
(every rank must agree), so none of this concerns it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

# The check a one-process call left for its block ops to run (see deferred_check).
_PENDING: contextvars.ContextVar = contextvars.ContextVar("hf_infcl_pending_value_check", default=None)


def check_values(scale: torch.Tensor, positives: torch.Tensor | None, n_keys: int,
                 distinct_positives: bool = False) -> None:
    """The argument checks that read values (one host synchronisation): ``logit_scale`` > 0 and
    every positive index inside ``[0, n_keys)`` (``positives`` None: ``keys[:m]``, in range by
    construction, so only the scale is read); with ``distinct_positives`` (the score filter with a
    column statistic), no key the positive of two rows."""
    scale = scale.detach().reshape(())
    if positives is None or not positives.numel():
        scale_value, positive_range, shared = scale.item(), (), 0
    else:
        readings = [scale.to(torch.float64), positives.min().to(torch.float64),
                    positives.max().to(torch.float64)]  # what the checks read, fetched together
        if distinct_positives:
            ordered = torch.sort(positives).values
            readings.append((ordered[1:] == ordered[:-1]).sum().to(torch.float64))
        scale_value, *positive_range = torch.stack(readings).tolist()
        shared = positive_range.pop() if distinct_positives else 0
    if scale_value <= 0:  # a NaN scale passes: non-finite inputs give a NaN loss
        raise ValueError(f"logit_scale must be > 0 (it multiplies the logits), got {scale_value}")
    if positive_range and (n_keys == 0 or positive_range[0] < 0 or positive_range[1] >= n_keys):
        raise ValueError(f"positives must index keys, i.e. lie in [0, {n_keys}); got values outside")
    if shared:
        raise ValueError(
            "positives: two rows share a positive key, which false_negative_margin does not take with the "
            "symmetric softmax loss (each key keeps one column threshold, its row's); pass symmetric=False, "
            "or give each row its own positive key")


@contextlib.contextmanager
def deferred_check(ops, scale: torch.Tensor, positives: torch.Tensor | None, n_keys: int,
                   enabled: bool = True, distinct_positives: bool = False):
    """Around one process's statistics with the block ops ``ops``: :func:`check_values`, left
    pending for the Triton block ops to run just before their first kernel
    (:func:`run_deferred_check`), or run now for any other block ops. Still pending at the end,
    it runs then, a safety net: block ops that ask for the check must run it before a kernel
    reads the positives. ``enabled=False``: no check (the caller made it). ``distinct_positives``:
    as :func:`check_values` takes it."""
    if not enabled:
        yield
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
