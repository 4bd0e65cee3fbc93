"""The one autograd Function of the loss's statistics, over a schedule of key blocks.

A process's rows meet every key of the process group block by block. *Where* the blocks come
from is the schedule's job; *what* is done with them is the same everywhere:

- :class:`~hf_infcl.ops.local.SingleBlock`: one process; its own keys are the only block. No
  transfer, no padding.
- :class:`~hf_infcl.ops.ring.RingLayout`: a group of n processes; n key blocks travel the ring.

A schedule provides ``rank``, ``key_offset(rank)`` and two methods:

- ``forward_stats(spec, ops, queries, keys, scale, bias, query_groups, key_groups,
  positive_keys)`` -> (row_stat [m], col_stat [k] or None), the statistics over every key and
  row of the group;
- ``backward_accumulators(..., row_stat, col_stat, grad_row_stat, grad_col_stat)`` ->
  (G K [m, c], G^T Q as ((start, end), accumulator) slices of this process's keys, row sums of
  G [m]), unscaled, in the accumulation dtype.

:func:`stats_forward` and :func:`stats_backward` add what no schedule needs to know: the
positive logits z_{i,p(i)} and their gradient, and the scaling and casting of the accumulators.
:class:`KeyBlockLogitStats` is the autograd Function around them; the custom op of
:mod:`hf_infcl.ops.custom_ops` calls the same two functions with a :class:`SingleBlock`.

Why the positive logits are an output here rather than plain autograd ops outside: their
gradient nearly cancels the statistics' gradient at the positive (P_ii - 1 when the softmax is
peaked). Summed in the fp32 accumulators before the single cast to the input dtype, that
cancellation is exact; summed by autograd after two separate bf16 casts, it loses most of the
significant bits of dQ and dK.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .spec import BlockOps, StatsSpec, accumulation_dtype

# Row chunks for the O(m c) epilogues, so they allocate no full-size fp32 temporaries.
_EPILOGUE_ELEMENTS = 2**22


class KeyBlockSchedule(Protocol):
    """Which key blocks a process's rows meet, and how they get there (see the module docstring)."""

    rank: int

    def key_offset(self, rank: int) -> int: ...

    def forward_stats(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias, query_groups,
                      key_groups, positive_keys): ...

    def backward_accumulators(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                              query_groups, key_groups, positive_keys, row_stat, col_stat, grad_row_stat,
                              grad_col_stat): ...


def stats_forward(schedule: KeyBlockSchedule, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                  positives, query_groups, key_groups):
    """(row_stat [m], col_stat [k] or empty, positive_logit [m]) of this process's rows and keys
    over every key and row of the schedule."""
    positive_keys = _positive_keys(schedule, positives, query_groups)
    row_stat, col_stat = schedule.forward_stats(spec, ops, queries, keys, scale, bias, query_groups,
                                                key_groups, positive_keys)
    if col_stat is None:
        col_stat = row_stat.new_empty(0)
    return row_stat, col_stat, positive_logits(queries, keys, positives, scale, bias)


def stats_backward(schedule: KeyBlockSchedule, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                   positives, query_groups, key_groups, row_stat, col_stat, grad_row_stat, grad_col_stat,
                   grad_positive_logit, needs=(True, True, True, True)):
    """(d queries, d keys, d scale, d bias) from the statistics' gradients; ``needs`` says which of
    the four are wanted (None is returned for the others)."""
    positive_keys = _positive_keys(schedule, positives, query_groups)
    grad_queries, key_slices, row_sums = schedule.backward_accumulators(
        spec, ops, queries, keys, scale, bias, query_groups, key_groups, positive_keys, row_stat, col_stat,
        grad_row_stat, grad_col_stat,
    )
    add_positive_gradients(queries, keys, positives, grad_positive_logit, grad_queries, key_slices, row_sums)
    return finish_gradients(needs, queries, keys, scale, bias, grad_queries, key_slices, row_sums)


def _positive_keys(schedule: KeyBlockSchedule, positives, query_groups):
    """The rows' positives as global key indices (keys numbered in rank order), which only group
    masking needs."""
    if query_groups is None:
        return None
    offset = schedule.key_offset(schedule.rank)
    return positives + offset if offset else positives


class KeyBlockLogitStats(torch.autograd.Function):
    """(queries, keys, scale, bias, positives, query_groups, key_groups) ->
    (row_stat [m], col_stat [k] or empty, positive_logit [m]) over ``schedule``'s key blocks,
    with any block-ops object.

    ``positives`` are local key indices: a row's positive is always among its own process's keys.
    """

    @staticmethod
    def forward(ctx, queries, keys, scale, bias, positives, query_groups, key_groups, spec: StatsSpec,
                ops: BlockOps, schedule: KeyBlockSchedule):
        row_stat, col_stat, positive_logit = stats_forward(schedule, spec, ops, queries, keys, scale, bias,
                                                           positives, query_groups, key_groups)
        ctx.save_for_backward(queries, keys, scale, bias, positives, query_groups, key_groups, row_stat,
                              col_stat)
        ctx.spec, ctx.ops, ctx.schedule = spec, ops, schedule
        return row_stat, col_stat, positive_logit

    @staticmethod
    def backward(ctx, grad_row_stat, grad_col_stat, grad_positive_logit):
        (queries, keys, scale, bias, positives, query_groups, key_groups, row_stat,
         col_stat) = ctx.saved_tensors
        grads = stats_backward(ctx.schedule, ctx.spec, ctx.ops, queries, keys, scale, bias, positives,
                               query_groups, key_groups, row_stat, col_stat, grad_row_stat, grad_col_stat,
                               grad_positive_logit, needs=ctx.needs_input_grad[:4])
        return (*grads, None, None, None, None, None, None)


def _row_chunks(rows: int, width: int):
    step = max(1, _EPILOGUE_ELEMENTS // max(1, width))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def positive_logits(queries, keys, positives, scale, bias) -> torch.Tensor:
    """z_{i,p(i)} = s <Q_i, K_{p(i)}> + b in the accumulation dtype, [m]."""
    acc = accumulation_dtype(queries.dtype)
    dots = torch.empty(queries.shape[0], dtype=acc, device=queries.device)
    for rows in _row_chunks(queries.shape[0], queries.shape[1]):
        dots[rows] = (queries[rows].to(acc) * keys[positives[rows]].to(acc)).sum(dim=1)
    logits = scale.to(acc) * dots
    return logits if bias is None else logits + bias.to(acc)


def add_positive_gradients(queries, keys, positives, grad_positive, grad_queries, key_slices, row_sums):
    """Add the positive logits' gradient to the unscaled accumulators, in place.

    ``key_slices`` is a list of ((start, end), accumulator) covering this process's keys (the
    ring keeps its key gradient in slices). d z_{i,p(i)} / d bias = 1, so the gradient is also
    added to ``row_sums``; d scale follows from the accumulators in ``finish_gradients``.
    """
    acc = grad_queries.dtype
    weight = grad_positive.to(acc)
    for rows in _row_chunks(queries.shape[0], queries.shape[1]):
        grad_queries[rows] += weight[rows, None] * keys[positives[rows]].to(acc)
        for (start, end), accumulator in key_slices:
            inside = ((positives[rows] >= start) & (positives[rows] < end)).nonzero().squeeze(1)
            if inside.numel():
                chunk_rows = inside + rows.start
                accumulator.index_add_(
                    0, positives[chunk_rows] - start, weight[chunk_rows, None] * queries[chunk_rows].to(acc)
                )
    row_sums += weight


def finish_gradients(needs, queries, keys, scale, bias, grad_queries, key_slices, row_sums):
    """(d queries, d keys, d scale, d bias) from the unscaled accumulators; ``needs`` (four bools,
    e.g. ``ctx.needs_input_grad[:4]``) says which are wanted, None for the others.

    d scale = sum_ij G_ij x_ij = sum_i <Q_i, (G K)_i>, so it needs no pass over the tiles;
    d bias = sum of G. Works in place and in row chunks, so that the end of the backward makes
    no full-size fp32 temporaries. The key gradient comes as ((start, end), accumulator) slices,
    freed as they are copied out.
    """
    need_q, need_k, need_scale, need_bias = needs
    acc = grad_queries.dtype
    scale_acc = scale.to(acc)
    grad_scale = grad_bias = grad_q = grad_k = None
    if need_scale:
        total = torch.zeros((), dtype=acc, device=grad_queries.device)
        for rows in _row_chunks(queries.shape[0], queries.shape[1]):
            total += (grad_queries[rows] * queries[rows].to(acc)).sum()
        grad_scale = total.to(scale.dtype)
    if need_bias and bias is not None:
        grad_bias = row_sums.sum().to(bias.dtype)
    if need_q:
        grad_q = grad_queries.mul_(scale_acc).to(queries.dtype)
    if need_k:
        grad_k = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
        for index, ((start, end), accumulator) in enumerate(key_slices):
            real_end = min(end, keys.shape[0])  # the ring pads key blocks to the largest rank's
            if start < real_end:
                grad_k[start:real_end] = accumulator[: real_end - start].mul_(scale_acc)
            key_slices[index] = None  # free each slice as soon as it is copied out
    return grad_q, grad_k, grad_scale, grad_bias
