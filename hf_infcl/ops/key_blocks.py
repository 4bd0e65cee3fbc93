"""The one autograd Function of the loss's statistics, over a schedule of key blocks.

A process's rows meet every key of the process group block by block. *Where* the blocks come
from is the schedule's job; *what* is done with them is the same everywhere:

- :class:`~hf_infcl.ops.local.SingleBlock`: one process; its own keys are the only block. No
  transfer, no padding.
- :class:`~hf_infcl.ops.ring.RingLayout`: a group of n processes; n key blocks travel the ring.

A schedule provides ``rank``, ``key_offset(rank)`` and two methods:

- ``forward_stats(spec, ops, queries, keys, scale, bias, labels)`` -> (row_stat [m], col_stat
  [k] or None), the statistics over every key and row of the group, ``labels`` the
  :class:`~hf_infcl.ops.spec.PairLabels` (groups, hardness ids, global positive indices);
- ``backward_accumulators(..., labels, row_stat, col_stat, grad_row_stat, grad_col_stat)`` ->
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

from typing import NamedTuple, Protocol

import torch

from .spec import BlockOps, PairLabels, StatsSpec, accumulation_dtype, takes_one_pass

# Row chunks for the O(m c) epilogues, so they allocate no full-size fp32 temporaries.
_EPILOGUE_ELEMENTS = 2**22


class KeyBlockSchedule(Protocol):
    """Which key blocks a process's rows meet, and how they get there (see the module docstring)."""

    rank: int

    def key_offset(self, rank: int) -> int: ...

    def forward_stats(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                      labels: PairLabels): ...

    def backward_accumulators(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                              labels: PairLabels, row_stat, col_stat, grad_row_stat, grad_col_stat): ...

    # Optional: forward_with_gradients(spec, ops, queries, keys, scale, bias, labels) ->
    # (row_stat, UnitGradients), the sigmoid loss's one pass.


class UnitGradients(NamedTuple):
    """The one-pass route's gradients, computed in the forward with every row weight 1 (unscaled,
    accumulation dtype): what ``backward_accumulators`` would return for unit weights."""

    queries: torch.Tensor  # [m, c] G K
    key_slices: list  # ((start, end), [end - start, c] G^T Q) covering this process's keys
    row_sums: torch.Tensor  # [m] row sums of G


def stats_forward(schedule: KeyBlockSchedule, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                  positives, labels: PairLabels):
    """(row_stat [m], col_stat [k] or empty, positive_logit [m], unit gradients or None) of this
    process's rows and keys over every key and row of the schedule; ``labels`` without the
    positives' global indices, which are added here.

    With ``spec.gradients_in_forward`` (and a schedule and block ops that offer it) the same pass
    also gives the :class:`UnitGradients`, which the backward then only scales."""
    labels = _with_positive_keys(schedule, positives, labels)
    unit = None
    if one_pass(spec, schedule, ops):
        row_stat, unit = schedule.forward_with_gradients(spec, ops, queries, keys, scale, bias, labels)
        col_stat = None
    else:
        row_stat, col_stat = schedule.forward_stats(spec, ops, queries, keys, scale, bias, labels)
    if col_stat is None:
        col_stat = row_stat.new_empty(0)
    return row_stat, col_stat, positive_logits(queries, keys, positives, scale, bias), unit


def one_pass(spec: StatsSpec, schedule: KeyBlockSchedule, ops: BlockOps) -> bool:
    """Whether the forward computes the gradients too (``StatsSpec.gradients_in_forward``, where
    the schedule and the block ops offer it)."""
    return (spec.gradients_in_forward and takes_one_pass(ops)
            and callable(getattr(schedule, "forward_with_gradients", None)))


def stats_backward(schedule: KeyBlockSchedule, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                   positives, labels: PairLabels, row_stat, col_stat, grad_row_stat, grad_col_stat,
                   grad_positive_logit, needs=(True, True, True, True), unit: UnitGradients | None = None):
    """(d queries, d keys, d scale, d bias) from the statistics' gradients; ``needs`` says which of
    the four are wanted (None is returned for the others). With the forward's ``unit``
    gradients, no tile is computed again."""
    if unit is not None:
        return finish_gradients(needs, queries, keys, scale, bias, positives, grad_positive_logit,
                                unit.queries, unit.key_slices, unit.row_sums,
                                row_weight=grad_row_stat.to(unit.queries.dtype))
    grad_queries, key_slices, row_sums = schedule.backward_accumulators(
        spec, ops, queries, keys, scale, bias, _with_positive_keys(schedule, positives, labels), row_stat,
        col_stat, grad_row_stat, grad_col_stat,
    )
    return finish_gradients(needs, queries, keys, scale, bias, positives, grad_positive_logit, grad_queries,
                            key_slices, row_sums)


def _with_positive_keys(schedule: KeyBlockSchedule, positives, labels: PairLabels) -> PairLabels:
    """``labels`` with the rows' positives as global key indices (keys numbered in rank order),
    which only group masking and the hardness offset need."""
    if labels.query_groups is None and labels.query_ids is None:
        return labels
    offset = schedule.key_offset(schedule.rank)
    return labels._replace(positive_keys=positives + offset if offset else positives)


class KeyBlockLogitStats(torch.autograd.Function):
    """(queries, keys, scale, bias, positives, query_groups, key_groups, query_ids, key_owners) ->
    (row_stat [m], col_stat [k] or empty, positive_logit [m]) over ``schedule``'s key blocks,
    with any block-ops object.

    ``positives`` are local key indices: a row's positive is always among its own process's keys.
    """

    @staticmethod
    def forward(ctx, queries, keys, scale, bias, positives, query_groups, key_groups, query_ids, key_owners,
                spec: StatsSpec, ops: BlockOps, schedule: KeyBlockSchedule):
        labels = PairLabels(query_groups, key_groups, query_ids, key_owners)
        row_stat, col_stat, positive_logit, unit = stats_forward(schedule, spec, ops, queries, keys, scale,
                                                                 bias, positives, labels)
        ctx.save_for_backward(queries, keys, scale, bias, positives, query_groups, key_groups, query_ids,
                              key_owners, row_stat, col_stat)
        ctx.spec, ctx.ops, ctx.schedule, ctx.unit = spec, ops, schedule, unit
        return row_stat, col_stat, positive_logit

    @staticmethod
    def backward(ctx, grad_row_stat, grad_col_stat, grad_positive_logit):
        (queries, keys, scale, bias, positives, query_groups, key_groups, query_ids, key_owners, row_stat,
         col_stat) = ctx.saved_tensors
        labels = PairLabels(query_groups, key_groups, query_ids, key_owners)
        # On the CPU the backward runs in the caller's thread, under its autocast if it is on: the
        # gradients keep the forward's precision (hf_infcl.loss turns autocast off for the forward).
        with torch.autocast(queries.device.type, enabled=False):
            grads = stats_backward(ctx.schedule, ctx.spec, ctx.ops, queries, keys, scale, bias, positives,
                                   labels, row_stat, col_stat, grad_row_stat, grad_col_stat,
                                   grad_positive_logit, needs=ctx.needs_input_grad[:4], unit=ctx.unit)
        return (*grads, None, None, None, None, None, None, None, None)


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


def finish_gradients(needs, queries, keys, scale, bias, positives, grad_positive, grad_queries, key_slices,
                     row_sums, row_weight=None):
    """(d queries, d keys, d scale, d bias) from the unscaled accumulators of the statistics'
    gradient, adding the positive logits' gradient ``grad_positive``; ``needs`` (four bools, e.g.
    ``ctx.needs_input_grad[:4]``) says which are wanted, None for the others.

    The accumulators are G K [m, c], G^T Q as ((start, end), accumulator) slices of the keys (the
    ring keeps its key gradient in slices, padded to the largest rank's keys), and the row sums
    of G. With ``row_weight`` None they hold the gradient itself and are used up (added to in
    place, and each key slice dropped from the list once copied out). With ``row_weight`` [m]
    they hold the unit-weight G of the one-pass route (``StatsSpec.gradients_in_forward``) and
    are only read: row i of G K is scaled by its weight, G^T Q by the rows' common weight.

    The positive logits' gradient is summed into the fp32 accumulators before the single cast,
    where it nearly cancels G's entry at the positive (see the module docstring).
    d scale = sum_ij G_ij x_ij = sum_i <Q_i, (G K)_i>, so it needs no pass over the tiles;
    d bias = sum of G. Everything runs in row chunks: no full-size fp32 temporaries.
    """
    need_q, need_k, need_scale, need_bias = needs
    acc = grad_queries.dtype
    scale_acc = scale.to(acc)
    weight = grad_positive.to(acc)
    grad_scale = grad_bias = grad_q = grad_k = None
    total = torch.zeros((), dtype=acc, device=grad_queries.device)
    if need_q:
        grad_q = torch.empty(queries.shape, dtype=queries.dtype, device=queries.device)
    for rows in _row_chunks(queries.shape[0], queries.shape[1]):
        block = grad_queries[rows] if row_weight is None else grad_queries[rows] * row_weight[rows, None]
        block += weight[rows, None] * keys[positives[rows]].to(acc)
        if need_scale:
            total += (block * queries[rows].to(acc)).sum()
        if need_q:
            grad_q[rows] = (block * scale_acc).to(queries.dtype)
    if need_scale:
        grad_scale = total.to(scale.dtype)
    if need_bias and bias is not None:
        sums = row_sums if row_weight is None else row_sums * row_weight
        grad_bias = (sums.sum() + weight.sum()).to(bias.dtype)
    if need_k:
        # Every row's statistic has the same gradient on the one-pass route (its precondition).
        key_weight = None if row_weight is None else row_weight[:1]
        grad_k = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
        for index, ((start, end), accumulator) in enumerate(key_slices):
            end = min(end, keys.shape[0])  # the ring pads key blocks to the largest rank's
            for part in _row_chunks(max(0, end - start), keys.shape[1]):
                lo, hi = start + part.start, start + part.stop
                block = accumulator[part] if key_weight is None else accumulator[part] * key_weight
                inside = ((positives >= lo) & (positives < hi)).nonzero().squeeze(1)
                if inside.numel():
                    positive_rows = weight[inside, None] * queries[inside].to(acc)
                    block.index_add_(0, positives[inside] - lo, positive_rows)
                grad_k[lo:hi] = (block * scale_acc).to(keys.dtype)
            if row_weight is None:
                key_slices[index] = None  # free each slice as soon as it is copied out
    return grad_q, grad_k, grad_scale, grad_bias
