"""The one autograd Function of the loss's statistics, over a schedule of key blocks.

A process's rows meet every key of the process group block by block. *Where* the blocks come
from is the schedule's job; *what* is done with them is the same everywhere:

- :class:`SingleBlock`: one process; its own keys are the only block (one ``forward_block`` call
  over all rows and keys, one ``backward_block`` call that recomputes every tile once). No
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

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .spec import BlockOps, OnePassSigmoidOps, PairLabels, StatsSpec, accumulation_dtype, takes_one_pass

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


@dataclass(frozen=True)
class SingleBlock:
    """The :class:`KeyBlockSchedule` of one process."""

    rank: int = 0

    def key_offset(self, rank: int) -> int:
        return 0

    def forward_stats(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias, labels: PairLabels):
        mask, hardness = _own_block(spec, labels)
        return ops.forward_block(spec, queries, keys, scale, bias, mask, hardness=hardness)

    def backward_accumulators(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                              labels: PairLabels, row_stat, col_stat, grad_row_stat, grad_col_stat):
        acc = accumulation_dtype(queries.dtype)
        grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        mask, hardness = _own_block(spec, labels)
        columns = spec.columns
        row_sums = ops.backward_block(spec, queries, keys, scale, bias, mask, row_stat,
                                      col_stat if columns else None, grad_row_stat.to(acc),
                                      grad_col_stat.to(acc) if columns else None, grad_queries, grad_keys,
                                      hardness=hardness)
        return grad_queries, [((0, keys.shape[0]), grad_keys)], row_sums

    def forward_with_gradients(self, spec: StatsSpec, ops: OnePassSigmoidOps, queries, keys, scale, bias,
                               labels: PairLabels):
        """The sigmoid loss's one pass: (row_stat, unit-weight gradients), see
        :class:`UnitGradients`."""
        acc = accumulation_dtype(queries.dtype)
        grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        row_stat, row_sums = ops.forward_backward_block(spec, queries, keys, scale, bias,
                                                        labels.mask(labels.key_groups, 0), grad_queries,
                                                        grad_keys)
        return row_stat, UnitGradients(grad_queries, [((0, keys.shape[0]), grad_keys)], row_sums)


SINGLE_BLOCK = SingleBlock()


def _own_block(spec: StatsSpec, labels: PairLabels):
    """(group mask, hardness offset) of the rows against this process's own keys, the only block."""
    return labels.mask(labels.key_groups, 0), labels.hardness(spec, labels.key_owners, 0)


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
    return row_stat, col_stat, positive_logits(queries, keys, positives, scale, bias, row_combiner(ops)), unit


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
                                row_weight=grad_row_stat.to(unit.queries.dtype), combine=row_combiner(ops))
    grad_queries, key_slices, row_sums = schedule.backward_accumulators(
        spec, ops, queries, keys, scale, bias, _with_positive_keys(schedule, positives, labels), row_stat,
        col_stat, grad_row_stat, grad_col_stat,
    )
    return finish_gradients(needs, queries, keys, scale, bias, positives, grad_positive_logit, grad_queries,
                            key_slices, row_sums, combine=row_combiner(ops))


def _with_positive_keys(schedule: KeyBlockSchedule, positives, labels: PairLabels) -> PairLabels:
    """``labels`` with the rows' positives as global key indices (keys numbered in rank order),
    which only group masking and the hardness offset need (``positives`` None: ``keys[:m]``)."""
    if labels.query_groups is None and labels.query_ids is None:
        return labels
    if positives is None:
        rows = labels.query_groups if labels.query_groups is not None else labels.query_ids
        positives = torch.arange(rows.shape[0], device=rows.device)
    offset = schedule.key_offset(schedule.rank)
    return labels._replace(positive_keys=positives + offset if offset else positives)


class KeyBlockLogitStats(torch.autograd.Function):
    """(queries, keys, scale, bias, positives, query_groups, key_groups, query_ids, key_owners) ->
    (row_stat [m], col_stat [k] or empty, positive_logit [m]) over ``schedule``'s key blocks,
    with any block-ops object.

    ``positives`` are local key indices: a row's positive is always among its own process's keys
    (None: ``keys[:m]``, row i's positive is key i).
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


class RowCombiner(Protocol):
    """The O(m c) epilogues' one primitive (:func:`combine_rows` says what it computes). Block ops
    may offer a faster one as a ``combine_rows`` method (the Triton backend: one kernel launch)."""

    def __call__(self, *, rows: int, sources, source_index, source_weight=None, entry_rows=None,
                 accumulator=None, weight=None, out=None, scale=None, dot_with=None): ...


def row_combiner(ops) -> RowCombiner:
    """``ops.combine_rows`` where the block ops offer one, else :func:`combine_rows`."""
    return getattr(ops, "combine_rows", combine_rows)


def combine_rows(*, rows: int, sources, source_index, source_weight=None, entry_rows=None, accumulator=None,
                 weight=None, out=None, scale=None, dot_with=None):
    """For each row r < ``rows``, in the accumulation dtype of ``sources``:

        v_r = weight_r * accumulator[r] + sum over the entries t of row r of
              source_weight[t] * sources[source_index[t]]

    Entry t belongs to row t (``entry_rows`` None: one entry per row) or to row
    ``entry_rows[t]`` (non-decreasing; entries outside [0, rows) are ignored). ``source_index``
    None is the identity: entry t takes ``sources[t]``, and with ``entry_rows`` None the rows
    from ``len(sources)`` on have no entry. ``accumulator``
    None counts as zeros, ``weight`` None as 1 (a 0-d ``weight`` is every row's, a [rows] one
    each row's own), ``source_weight`` None as 1. Writes ``out[r] = scale * v_r`` in ``out``'s
    dtype (if ``out`` is given) and returns the dot products ``<v_r, dot_with[r]>`` [rows] (if
    ``dot_with`` is given, else None).

    The epilogues' uses: dQ_i = s (w_i (G K)_i + a_i K_p(i)) with d scale from <., Q_i> (one entry
    per row); dK_j = s (w (G^T Q)_j + sum_{i: p(i) = j} a_i Q_i) (entries sorted by positive);
    the positive logits <Q_i, K_p(i)> (no accumulator, no output). This version runs in row chunks
    of torch ops (no full-size fp32 temporaries) and reads the chunks' entry ranges with one host
    synchronisation.
    """
    acc = accumulation_dtype(sources.dtype)
    width = sources.shape[1]
    chunks = list(_row_chunks(rows, width))
    dots = None if dot_with is None else torch.empty(rows, dtype=acc, device=sources.device)
    if entry_rows is not None:
        starts = torch.tensor([part.start for part in chunks] + [rows], device=entry_rows.device)
        bounds = torch.searchsorted(entry_rows, starts).tolist()
    for index, part in enumerate(chunks):
        if accumulator is None:
            block = torch.zeros((part.stop - part.start, width), dtype=acc, device=sources.device)
        elif weight is None:
            block = accumulator[part].to(acc, copy=True)
        else:
            block = accumulator[part] * (weight if weight.dim() == 0 else weight[part, None]).to(acc)
        if entry_rows is None:
            stop = part.stop if source_index is not None else min(part.stop, sources.shape[0])
            entries, targets = slice(part.start, max(part.start, stop)), None
        else:
            entries = slice(bounds[index], bounds[index + 1])
            targets = entry_rows[entries] - part.start
        if entries.stop > entries.start:
            picked = sources[entries] if source_index is None else sources[source_index[entries]]
            added = picked.to(acc)
            if source_weight is not None:
                added = added * source_weight[entries, None].to(acc)
            if targets is None:
                block[: added.shape[0]] += added
            else:
                block.index_add_(0, targets, added)
        if dots is not None:
            dots[part] = (block * dot_with[part].to(acc)).sum(dim=1)
        if out is not None:
            out[part] = (block * scale.to(acc)).to(out.dtype)
    return dots


def positive_logits(queries, keys, positives, scale, bias,
                    combine: RowCombiner = combine_rows) -> torch.Tensor:
    """z_{i,p(i)} = s <Q_i, K_{p(i)}> + b in the accumulation dtype, [m] (``positives`` None:
    p(i) = i)."""
    acc = accumulation_dtype(queries.dtype)
    dots = combine(rows=queries.shape[0], sources=keys, source_index=positives, dot_with=queries)
    logits = scale.to(acc) * dots
    return logits if bias is None else logits + bias.to(acc)


def finish_gradients(needs, queries, keys, scale, bias, positives, grad_positive, grad_queries, key_slices,
                     row_sums, row_weight=None, combine: RowCombiner = combine_rows):
    """(d queries, d keys, d scale, d bias) from the unscaled accumulators of the statistics'
    gradient, adding the positive logits' gradient ``grad_positive``; ``needs`` (four bools, e.g.
    ``ctx.needs_input_grad[:4]``) says which are wanted, None for the others.

    The accumulators are G K [m, c], G^T Q as ((start, end), accumulator) slices of the keys (the
    ring keeps its key gradient in slices, padded to the largest rank's keys), and the row sums
    of G. With ``row_weight`` None they hold the gradient itself, and each key slice is dropped
    from the list once used (its memory freed). With ``row_weight`` [m] they hold the unit-weight
    G of the one-pass route (``StatsSpec.gradients_in_forward``) and are kept: row i of G K is
    scaled by its weight, G^T Q by the rows' common weight. They are only ever read (a second
    backward of the one-pass route reads them again).

    The positive logits' gradient is summed with the fp32 accumulators before the single cast,
    where it nearly cancels G's entry at the positive (see the module docstring).
    d scale = sum_ij G_ij x_ij = sum_i <Q_i, (G K)_i>, so it needs no pass over the tiles;
    d bias = sum of G. Every [m, c] product goes through ``combine`` (:func:`combine_rows`).
    """
    need_q, need_k, need_scale, need_bias = needs
    acc = grad_queries.dtype
    scale_acc = scale.to(acc)
    weight = grad_positive.to(acc)
    grad_scale = grad_bias = grad_q = grad_k = None
    if need_q:
        grad_q = torch.empty(queries.shape, dtype=queries.dtype, device=queries.device)
    if need_q or need_scale:
        dots = combine(rows=queries.shape[0], sources=keys, source_index=positives, source_weight=weight,
                       accumulator=grad_queries, weight=row_weight, out=grad_q, scale=scale_acc,
                       dot_with=queries if need_scale else None)
        if need_scale:
            grad_scale = dots.sum().to(scale.dtype)
    if need_bias and bias is not None:
        sums = row_sums if row_weight is None else row_sums * row_weight
        grad_bias = (sums.sum() + weight.sum()).to(bias.dtype)
    if need_k:
        # Every row's statistic has the same gradient on the one-pass route (its precondition).
        key_weight = None if row_weight is None else row_weight[0]
        if positives is not None:
            # Key j takes the rows whose positive it is: the rows sorted by positive, so that
            # each key's rows are one contiguous range of entries.
            sorted_positives, by_positive = torch.sort(positives, stable=True)
            entry_weight = weight[by_positive]
        grad_k = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
        rows = queries.shape[0]
        for index, ((start, end), accumulator) in enumerate(key_slices):
            end = min(end, keys.shape[0])  # the ring pads key blocks to the largest rank's
            if end > start:
                if positives is None:  # key j < m takes row j: the slice's rows start..
                    first, last = min(start, rows), min(end, rows)
                    entries = dict(sources=queries[first:last], source_index=None,
                                   source_weight=weight[first:last])
                else:
                    entries = dict(sources=queries, source_index=by_positive, source_weight=entry_weight,
                                   entry_rows=sorted_positives - start)
                combine(rows=end - start, **entries, accumulator=accumulator, weight=key_weight,
                        out=grad_k[start:end], scale=scale_acc)
            if row_weight is None:
                key_slices[index] = None  # free each slice as soon as it is used
    return grad_q, grad_k, grad_scale, grad_bias
