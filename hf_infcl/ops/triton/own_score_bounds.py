"""The own-score filter's arguments of the Gluon statistics kernel (:class:`.gluon_stats.OwnScoreFilter`)
from the filter's thresholds, in one launch.

The kernel shifts each row's and each key's exponentials by a *bound*, the positive's score the
threshold was made from (:mod:`hf_infcl.ops.score_filter`):

    "absolute":  bound = tau + margin
    "relative":  bound = tau / (1 - margin) where tau >= 0, tau / (1 + margin) where not

(a key that is nobody's positive, tau = +inf, takes 0). It also takes each row's positive as an
index into the block's keys (-1 where the positive is not among them) and each block of
``BLOCK_M`` rows' smallest and largest such index (``OwnScoreFilter.ranges``). Made with
torch operations these are about twenty small launches, each a few microseconds of host time while
the GPU waits for the statistics kernel; this kernel makes them all at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gluon_stats
from .launch import launch_jit


@triton.jit
def _bounds_of(thresholds, margin, RELATIVE: tl.constexpr):
    if RELATIVE:
        bounds = tl.where(thresholds >= 0, thresholds / (1 - margin), thresholds / (1 + margin))
    else:
        bounds = thresholds + margin
    return tl.where(thresholds == float("inf"), 0.0, bounds)


@triton.jit
def _own_score_bounds_kernel(
    row_threshold_ptr, key_threshold_ptr, positive_key_ptr, row_bound_ptr, positive_ptr, key_bound_ptr,
    low_ptr, high_ptr, key_offset, margin, n_rows, n_keys, RELATIVE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program p: rows and keys [p * BLOCK, (p + 1) * BLOCK), and row block p's positive range."""
    start = tl.program_id(0) * BLOCK
    rows = start + tl.arange(0, BLOCK)
    row_valid = rows < n_rows
    thresholds = tl.load(row_threshold_ptr + rows, mask=row_valid, other=0.0)
    tl.store(row_bound_ptr + rows, _bounds_of(thresholds, margin, RELATIVE), mask=row_valid)
    local = tl.load(positive_key_ptr + rows, mask=row_valid, other=0).to(tl.int64) - key_offset
    inside = row_valid & (local >= 0) & (local < n_keys)
    positives = tl.where(inside, local, -1).to(tl.int32)
    tl.store(positive_ptr + rows, positives, mask=row_valid)
    if start < n_rows:
        tl.store(low_ptr + tl.program_id(0), tl.min(tl.where(inside, positives, 2147483647), axis=0))
        tl.store(high_ptr + tl.program_id(0), tl.max(positives, axis=0))
    keys = start + tl.arange(0, BLOCK)
    key_valid = keys < n_keys
    thresholds = tl.load(key_threshold_ptr + keys, mask=key_valid, other=0.0)
    tl.store(key_bound_ptr + keys, _bounds_of(thresholds, margin, RELATIVE), mask=key_valid)


def own_score_filter(row_thresholds: torch.Tensor, key_thresholds: torch.Tensor, positive_keys: torch.Tensor,
                     key_offset: int, n_keys: int, margin: float,
                     strategy: str) -> gluon_stats.OwnScoreFilter:
    """The :class:`.gluon_stats.OwnScoreFilter` of thresholds made with ``margin`` and
    ``strategy`` ("absolute" any margin, "relative" from 0 to below 1, where a threshold's sign
    is its score's): fp32 ``row_thresholds`` [rows] and ``key_thresholds`` [n_keys], the rows'
    positives ``positive_keys`` [rows] as global key indices, the block's first key at
    ``key_offset``; the row blocks' ranges made too."""
    n_rows = row_thresholds.shape[0]
    if key_thresholds.shape != (n_keys,) or positive_keys.shape != (n_rows,):
        raise ValueError(f"key_thresholds must have {n_keys} entries and positive_keys {n_rows}, got "
                         f"{tuple(key_thresholds.shape)} and {tuple(positive_keys.shape)}")
    if strategy not in ("absolute", "relative"):
        raise ValueError(f"strategy must be 'absolute' or 'relative', got {strategy!r}")
    relative = strategy == "relative"
    device, block = row_thresholds.device, gluon_stats.BLOCK_M
    row_bounds = torch.empty(n_rows, dtype=torch.float32, device=device)
    positives = torch.empty(n_rows, dtype=torch.int32, device=device)
    key_bounds = torch.empty(n_keys, dtype=torch.float32, device=device)
    low, high = (torch.empty(triton.cdiv(n_rows, block), dtype=torch.int32, device=device) for _ in range(2))
    launch_jit(_own_score_bounds_kernel, (max(triton.cdiv(n_rows, block), triton.cdiv(n_keys, block)),),
               row_thresholds.contiguous(), key_thresholds.contiguous(), positive_keys.contiguous(),
               row_bounds, positives, key_bounds, low, high, key_offset, float(margin), n_rows, n_keys,
               RELATIVE=relative, BLOCK=block)
    return gluon_stats.OwnScoreFilter(row_bounds, positives, key_bounds, margin=0.0 if relative else margin,
                                      relative_margin=margin if relative else 0.0, ranges=(low, high))
