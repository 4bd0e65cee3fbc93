"""The score filter's left-out entries, listed so that the backward can run without its masks.

Why: the masks are needed only where an entry is left out, a few per row when the filter catches
false negatives, yet with masks every tile of the backward pays for them (with a guide, one more
GEMM per tile). So:

1. The forward's statistics kernel counts each row's left-out entries (one row sum per tile:
   :class:`~hf_infcl.ops.spec.LeftOutCounts`).
2. The backward reads the counts (one host synchronisation). Where at most a small share of the
   rows has any, and the entries are few enough for memory linear in the batch
   (:func:`rows_to_list`), the statistics kernel runs again over just those rows, listing their
   entries (:func:`record_left_out`: row, key, :data:`ROW` | :data:`COLUMN`); the appends cost a
   reduction and scans per tile, paid only on these rows.
3. The gradient tiles run unmasked, with every exponent z - stat clamped at 0 (``CLAMP`` of the
   gradient-tile kernel): a kept entry never exceeds its statistic, while a left-out one may, by
   any amount; clamped, its term is at most its weight, and nothing overflows.
4. :func:`take_back_left_out` takes each listed entry's terms back out of G K, G^T Q and the row
   sums: one dot product per entry.

Elsewhere the backward filters every tile as the forward did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..spec import LeftOutCounts
from .device import INTERPRET, unused_pointer
from .jit_math import at_most_zero

# The list is worth its second statistics pass over the rows that have left-out entries while
# those are at most this share of the rows (that pass costs about two plain passes over them).
LISTED_ROW_SHARE = 1 / 8
# The list holds at most this many entries per row and key of the block by default, so that its
# memory stays linear in the batch (a margin that leaves out most keys of a few rows keeps the masks).
ENTRIES_PER_VECTOR = 4
# Room in the list beyond the forward's count: the second pass multiplies in another order, and
# a score within rounding of its threshold may then fall on the other side.
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
