"""The guided score filter's left-out entries: found by the guide alone, so that the statistics
of the rows without any run without the filter, and the backward without its masks.

Why: the filter's masks are needed only where it leaves an entry out, a few per row when it
catches false negatives. Yet with masks every tile pays for the guide's second GEMM and for the
comparisons, in the forward and in the backward. So, per key block:

1. :func:`find_left_out` counts each row's left-out entries from the guide's products alone (one
   GEMM with a comparison, no exponential: :class:`~hf_infcl.ops.spec.LeftOutCounts`).
2. The forward reads the counts (one host synchronisation). Where at most a small share of the
   rows has any, the other rows' statistics come from the plain kernel, and only those rows'
   from the filtering one; their column partials merge into one column statistic.
3. The backward reads the counts of every block. Where the rows are that few, and the entries
   few enough for memory linear in the batch (:func:`rows_to_list`), :func:`find_left_out` lists
   those rows' entries (:func:`record_left_out`: row, key, :data:`ROW` | :data:`COLUMN`).
4. The gradient tiles then run unmasked, with every exponent z - stat clamped at 0 (``CLAMP`` of
   the gradient-tile kernel): a kept entry never exceeds its statistic, while a left-out one may,
   by any amount; clamped, its term is at most its weight, and nothing overflows.
5. :func:`take_back_left_out` takes each listed entry's terms back out of G K, G^T Q and the row
   sums: one dot product per entry.

Elsewhere (more rows than the share, no guide) the forward and the backward filter every tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..spec import LeftOutCounts
from .device import INTERPRET, unused_pointer
from .jit_math import (
    allowed_pairs,
    at_most_zero,
    dot_tile,
    not_positive,
    outer_block_and_inner_range,
    rounds_guide,
    score_filter_drops,
)
from .stats import inner_splits

# The rows that have left-out entries take the filtering kernels while they are at most this share
# of the rows (those kernels cost two to three plain passes over them), the others the plain ones.
LISTED_ROW_SHARE = 1 / 8
# The list holds at most this many entries per row and key of the block by default, so that its
# memory stays linear in the batch (a margin that leaves out most keys of a few rows keeps the masks).
ENTRIES_PER_VECTOR = 4
# Room in the list beyond the count, a guard: the count and the list come from the same kernel and
# block shape, so each entry's guide product, and so its decision, is the same in both.
_SLACK = 1024

# An entry's flags: which statistics left it out.
ROW = tl.constexpr(1)
COLUMN = tl.constexpr(2)


@dataclass(frozen=True)
class LeftOutList:
    """The listed entries of one block: the first ``count`` columns of ``entries``."""

    entries: torch.Tensor  # [3, capacity] int32: row, key, ROW | COLUMN
    count: torch.Tensor  # [1] int32, on the device (entries past the capacity are counted, not stored)

    @property
    def capacity(self) -> int:
        return self.entries.shape[1]


def zero_counts(rows: int, device: torch.device) -> LeftOutCounts:
    return LeftOutCounts(torch.zeros(rows, dtype=torch.int32, device=device))


def rows_to_list(counts: LeftOutCounts, share: float, per_vector: int,
                 keys: int) -> tuple[torch.Tensor, int] | None:
    """(the rows with left-out entries, their number of entries) where those rows are at most
    ``share`` of all rows and the entries at most ``per_vector`` per row and key of a block of
    ``keys`` keys, else None (two host synchronisations, back to back)."""
    m = counts.per_row.shape[0]
    rows = torch.nonzero(counts.per_row).squeeze(1)
    if rows.numel() > share * m:
        return None
    entries = int(counts.per_row.sum())
    if entries > per_vector * (m + keys):
        return None
    return rows, entries


def empty_list(entries: int, device: torch.device) -> LeftOutList:
    """A list with room for ``entries`` (and some slack)."""
    return LeftOutList(torch.empty((3, entries + _SLACK), dtype=torch.int32, device=device),
                       torch.zeros(1, dtype=torch.int32, device=device))


@triton.jit
def record_left_out(flags, row_ids, key_index, entries_ptr, count_ptr, capacity):
    """Append the entries of a (rows, keys) tile whose ``flags`` (:data:`ROW` | :data:`COLUMN`) are
    not 0, as (``row_ids`` of the tile's rows, ``key_index``, flags): one atomic per tile reserves
    their slots, a scan orders them. Entries past ``capacity`` are counted, not stored."""
    left = (flags != 0).to(tl.int32)
    per_row = tl.sum(left, axis=1)
    total = tl.sum(per_row, axis=0)
    if total > 0:
        first = tl.atomic_add(count_ptr, total)
        if first < capacity:
            row_start = tl.cumsum(per_row, axis=0) - per_row
            slots = first + row_start[:, None] + tl.cumsum(left, axis=1) - left
            stored = (left != 0) & (slots < capacity)
            rows = tl.broadcast_to(row_ids.to(tl.int32)[:, None], flags.shape)
            keys = tl.broadcast_to(key_index.to(tl.int32)[None, :], flags.shape)
            tl.store(entries_ptr + slots, rows, mask=stored)
            tl.store(entries_ptr + capacity + slots, keys, mask=stored)
            tl.store(entries_ptr + 2 * capacity + slots, flags, mask=stored)


# One block shape, not tuned: the kernel is a GEMM with a comparison, and a first call must not
# wait for a tuner. fp32 guides take half the step along c (the same bytes of shared memory).
_FIND_BLOCK = 16 if INTERPRET else 128
_FIND_STEP = 16 if INTERPRET else 64
_FIND_WARPS, _FIND_STAGES = 4, 3


@triton.jit
def _find_left_out_kernel(
    guide_q_ptr, guide_k_ptr, row_threshold_ptr, key_threshold_ptr, positive_ptr, key_offset,
    row_group_ptr, key_group_ptr, counts_ptr, entries_ptr, count_ptr, capacity, row_id_ptr,
    n_rows, n_keys, c, stride_q, stride_k, keys_per_split,
    HAS_MASK: tl.constexpr, GROUP_POSITIVES: tl.constexpr, COLUMNS: tl.constexpr, LIST: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_GUIDE: tl.constexpr, EVEN_K: tl.constexpr,
    FULL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid, row_index, row_valid, key_start, key_end = outer_block_and_inner_range(
        n_rows, n_keys, keys_per_split, BLOCK_M)
    if LIST:
        row_ids = tl.load(row_id_ptr + row_index, mask=row_valid, other=0)
    else:
        row_left = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for n0 in range(key_start, key_end, BLOCK_N):
        key_index = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        key_valid = key_index < key_end
        scores = dot_tile(guide_q_ptr, guide_k_ptr, None, None, row_index, key_index, row_valid, key_valid,
                          0, 0, c, stride_q, stride_k, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST, EVEN_K,
                          False, ROUND_GUIDE)
        candidates = not_positive(row_index, key_index, row_valid, key_valid, pid * BLOCK_M, n0, positive_ptr,
                                  key_offset, row_group_ptr, key_group_ptr, False, GROUP_POSITIVES, BLOCK_M,
                                  BLOCK_N)
        row_drops = score_filter_drops(scores, candidates, row_threshold_ptr, row_index, row_valid, True)
        if COLUMNS:
            column_drops = score_filter_drops(scores, candidates, key_threshold_ptr, key_index, key_valid,
                                              False)
        # Pairs the group mask takes out are no negatives to leave out, nor are pairs past the ends;
        # whole tiles (FULL) without a group mask hold none.
        if HAS_MASK or not FULL:
            allowed = allowed_pairs(row_index, key_index, row_valid, key_valid, row_group_ptr, key_group_ptr,
                                    positive_ptr, key_offset, HAS_MASK)
        if LIST:
            flags = ROW * row_drops.to(tl.int32)
            if COLUMNS:
                flags += COLUMN * column_drops.to(tl.int32)
            if HAS_MASK or not FULL:
                flags = tl.where(allowed, flags, 0)
            record_left_out(flags, row_ids, key_index, entries_ptr, count_ptr, capacity)
        else:
            left = row_drops
            if COLUMNS:
                left = left | column_drops
            if HAS_MASK or not FULL:
                left = left & allowed
            row_left += tl.sum(left.to(tl.int32), axis=1)
    if not LIST:
        tl.atomic_add(counts_ptr + row_index, row_left, mask=row_valid & (row_left > 0))


def find_left_out(
    guide_queries: torch.Tensor, guide_keys: torch.Tensor, *, precision: str, row_thresholds: torch.Tensor,
    positive_keys: torch.Tensor, key_offset: int = 0, key_thresholds: torch.Tensor | None = None,
    row_groups: torch.Tensor | None = None, key_groups: torch.Tensor | None = None,
    group_positives: bool = False, counts: torch.Tensor | None = None,
    listed: LeftOutList | None = None, row_ids: torch.Tensor | None = None, splits: int | None = None,
) -> None:
    """The guided score filter's left-out entries of these rows (docs/contract.md, "False negatives
    by score"), from the guide's products alone: those of the row statistic (``row_thresholds``)
    and, given ``key_thresholds``, of the keys'. ``counts`` (int32 [rows]) gets each row's number of
    them added; or ``listed`` gets them appended, each row as its ``row_ids``
    entry. ``precision``: the ``tl.dot`` input precision of the kernels the filter serves (an fp32
    guide with TF32 is rounded as it is loaded, as theirs is). The group mask (``row_groups``,
    ``key_groups`` without ``group_positives``) takes its pairs out of the negatives first; the
    positives (``positive_keys``, global key indices from ``key_offset``; with ``group_positives``
    every key of the row's group) are never left out."""
    if (counts is None) == (listed is None):
        raise ValueError("find_left_out takes counts or a list, one of the two")
    if listed is not None and row_ids is None:
        raise ValueError("a list of left-out entries takes row_ids")
    n_rows, c = guide_queries.shape
    n_keys = guide_keys.shape[0]
    if n_rows == 0 or n_keys == 0:
        return
    splits, keys_per_split = inner_splits(n_rows, n_keys, guide_queries.device, splits)
    dummy = unused_pointer(guide_queries.device)
    has_mask = row_groups is not None and not group_positives
    step = _FIND_STEP if guide_queries.element_size() <= 2 or INTERPRET else _FIND_STEP // 2
    grid = (triton.cdiv(n_rows, _FIND_BLOCK), splits)
    _find_left_out_kernel[grid](
        guide_queries, guide_keys, row_thresholds, key_thresholds if key_thresholds is not None else dummy,
        positive_keys, key_offset, row_groups if row_groups is not None else dummy,
        key_groups if key_groups is not None else dummy, counts if counts is not None else dummy,
        listed.entries if listed is not None else dummy, listed.count if listed is not None else dummy,
        listed.capacity if listed is not None else 0, row_ids if row_ids is not None else dummy,
        n_rows, n_keys, c, guide_queries.stride(0), guide_keys.stride(0), keys_per_split,
        HAS_MASK=has_mask, GROUP_POSITIVES=group_positives, COLUMNS=key_thresholds is not None,
        LIST=listed is not None, PRECISION=precision, UPCAST=INTERPRET,
        ROUND_GUIDE=rounds_guide(precision, guide_queries.dtype),
        EVEN_K=c % step == 0, BLOCK_M=_FIND_BLOCK, BLOCK_N=_FIND_BLOCK, BLOCK_K=step,
        FULL=n_rows % _FIND_BLOCK == 0 and n_keys % _FIND_BLOCK == 0 and keys_per_split % _FIND_BLOCK == 0,
        num_warps=_FIND_WARPS, num_stages=_FIND_STAGES,
    )


_BLOCK_ENTRIES = 16 if INTERPRET else 32
_BLOCK_C = 16 if INTERPRET else 128


@triton.jit
def _take_back_kernel(
    entries_ptr, count_ptr, capacity, q_ptr, k_ptr, scale_ptr, bias_ptr, row_stat_ptr, col_stat_ptr,
    row_weight_ptr, col_weight_ptr, grad_q_ptr, grad_k_ptr, row_sums_ptr, sum_q_ptr, sum_k_ptr,
    c, stride_q, stride_k, stride_grad_q, stride_grad_k, stride_sum_q, stride_sum_k,
    HAS_BIAS: tl.constexpr, COLUMNS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
):
    count = tl.minimum(tl.load(count_ptr), capacity)
    first = tl.program_id(0) * BLOCK_E
    if first < count:
        index = first + tl.arange(0, BLOCK_E)
        valid = index < count
        rows = tl.load(entries_ptr + index, mask=valid, other=0).to(tl.int64)
        keys = tl.load(entries_ptr + capacity + index, mask=valid, other=0).to(tl.int64)
        flags = tl.load(entries_ptr + 2 * capacity + index, mask=valid, other=0)
        # the entries' logits, as the tiles formed them (from the kernels' operands)
        dots = tl.zeros((BLOCK_E,), dtype=tl.float32)
        for c0 in range(0, c, BLOCK_C):
            columns = c0 + tl.arange(0, BLOCK_C)
            inside = valid[:, None] & (columns < c)[None, :]
            q = tl.load(q_ptr + rows[:, None] * stride_q + columns[None, :], mask=inside, other=0.0)
            k = tl.load(k_ptr + keys[:, None] * stride_k + columns[None, :], mask=inside, other=0.0)
            dots += tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1)
        logits = tl.load(scale_ptr) * dots
        if HAS_BIAS:
            logits += tl.load(bias_ptr)
        # the terms the unmasked tiles added where the filter leaves the entry out (exponent clamped)
        row_exponent = logits - tl.load(row_stat_ptr + rows, mask=valid, other=0.0)
        row_weight = tl.load(row_weight_ptr + rows, mask=valid, other=0.0)
        row_term = row_weight * tl.exp(at_most_zero(row_exponent))
        taken = tl.where((flags & ROW) != 0, row_term, 0.0)
        if COLUMNS:
            col_exponent = logits - tl.load(col_stat_ptr + keys, mask=valid, other=0.0)
            col_weight = tl.load(col_weight_ptr + keys, mask=valid, other=0.0)
            col_term = col_weight * tl.exp(at_most_zero(col_exponent))
            taken += tl.where((flags & COLUMN) != 0, col_term, 0.0)
        delta = tl.where(valid, -taken, 0.0)
        tl.atomic_add(row_sums_ptr + rows, delta, mask=valid)
        # G K and G^T Q of those entries, out of the accumulators
        for c0 in range(0, c, BLOCK_C):
            columns = c0 + tl.arange(0, BLOCK_C)
            inside = valid[:, None] & (columns < c)[None, :]
            k = tl.load(sum_k_ptr + keys[:, None] * stride_sum_k + columns[None, :], mask=inside, other=0.0)
            tl.atomic_add(grad_q_ptr + rows[:, None] * stride_grad_q + columns[None, :],
                          delta[:, None] * k.to(tl.float32), mask=inside)
            q = tl.load(sum_q_ptr + rows[:, None] * stride_sum_q + columns[None, :], mask=inside, other=0.0)
            tl.atomic_add(grad_k_ptr + keys[:, None] * stride_grad_k + columns[None, :],
                          delta[:, None] * q.to(tl.float32), mask=inside)


def take_back_left_out(left_out: LeftOutList, queries: torch.Tensor, keys: torch.Tensor,
                       scale: torch.Tensor, bias: torch.Tensor | None, row_stat: torch.Tensor,
                       col_stat: torch.Tensor | None, row_weight: torch.Tensor,
                       col_weight: torch.Tensor | None,
                       grad_queries: torch.Tensor, grad_keys: torch.Tensor, row_sums: torch.Tensor,
                       summed_queries: torch.Tensor, summed_keys: torch.Tensor) -> None:
    """Take the listed entries' terms of G out of the unit-scale accumulators ``grad_queries``
    (G K), ``grad_keys`` (G^T Q) and ``row_sums``, after the unmasked, clamped tiles added them.
    Logits from ``queries`` x ``keys`` (the kernels' operands) with the 0-d fp32 ``scale`` and
    ``bias``; ``summed_queries`` / ``summed_keys``: what the accumulators sum (the block's
    inputs). Statistics and weights fp32; ``col_stat`` None without a column statistic."""
    columns = col_stat is not None
    dummy = unused_pointer(queries.device)
    grid = (triton.cdiv(left_out.capacity, _BLOCK_ENTRIES),)
    _take_back_kernel[grid](
        left_out.entries, left_out.count, left_out.capacity, queries, keys, scale,
        bias if bias is not None else dummy, row_stat, col_stat if columns else dummy, row_weight,
        col_weight if columns else dummy, grad_queries, grad_keys, row_sums, summed_queries, summed_keys,
        queries.shape[1], queries.stride(0), keys.stride(0), grad_queries.stride(0), grad_keys.stride(0),
        summed_queries.stride(0), summed_keys.stride(0),
        HAS_BIAS=bias is not None, COLUMNS=columns, BLOCK_E=_BLOCK_ENTRIES, BLOCK_C=_BLOCK_C, num_warps=4,
    )
