"""The one autograd Function of the loss's statistics, over a schedule of key blocks.

A process's rows meet every key of the process group block by block. *Where* the blocks come
from is the schedule's job; *what* is done with them is the same everywhere:

- :class:`SingleBlock`: one process; its own keys are the only block (one ``forward_block`` call
  over all rows and keys, one ``backward_block`` call that recomputes every tile once). No
  transfer, no padding.
- :class:`~hf_infcl.ops.ring.RingLayout`: a group of n processes; n key blocks travel the ring.

A schedule provides ``rank``, ``key_offset(rank)`` and two methods:

- ``forward_stats(spec, ops, queries, keys, scale, bias, labels)`` -> (row_stat [m], col_stat
  [k] or None, positive parts or None, left-out counts or None), the statistics over every key
  and row of the group, ``labels`` the :class:`~hf_infcl.ops.spec.PairLabels` (groups, hardness
  ids, global positive indices, the score filter's guide and thresholds); with
  ``group_positives`` also the :class:`~hf_infcl.ops.positive_pairs.PositiveParts` of the sparse
  positive pairs; with the score filter, where the schedule and the block ops count them, the
  :class:`~hf_infcl.ops.spec.LeftOutCounts` for the backward (``labels.left_out`` there);
- ``backward_accumulators(..., labels, row_stat, col_stat, grad_row_stat, grad_col_stat,
  positives)`` -> (G K [m, c], G^T Q as ((start, end), accumulator) slices of this process's
  keys, row sums of G [m]), unscaled, in the accumulation dtype; ``positives``, a
  :class:`PositiveGradients` with ``group_positives``, adds the positive pairs' entries of G.

:func:`stats_forward` and :func:`stats_backward` add what no schedule needs to know: the
positive logits z_{i,p(i)} and their gradient, the score filter's thresholds, and the scaling and
casting of the accumulators. :class:`KeyBlockLogitStats` is the autograd Function around them;
the custom op of :mod:`hf_infcl.ops.custom_ops` calls the same two functions with a
:class:`SingleBlock`.

Why the positive logits are an output here rather than plain autograd ops outside: their
gradient nearly cancels the statistics' gradient at the positive (P_ii - 1 when the softmax is
peaked). Summed in the fp32 accumulators before the single cast to the input dtype, that
cancellation is exact; summed by autograd after two separate bf16 casts, it loses most of the
significant bits of dQ and dK. The positive parts of ``group_positives`` are outputs for the same
reason, their pairs' gradients added into the same accumulators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from . import score_filter
from .positive_pairs import (
    BlockPairs,
    GroupRanges,
    PositiveParts,
    add_pair_gradients,
    block_positive_parts,
    count_pairs,
    group_ranges,
    listed,
    takes_group_ranges,
)
from .spec import (
    BlockOps,
    LeftOutCounts,
    OnePassSigmoidOps,
    PairLabels,
    StatsSpec,
    accumulation_dtype,
    takes_one_pass,
)

# Row chunks for the O(m c) epilogues, so they allocate no full-size fp32 temporaries.
_EPILOGUE_ELEMENTS = 2**22


class KeyBlockSchedule(Protocol):
    """Which key blocks a process's rows meet, and how they get there (see the module docstring)."""

    rank: int

    def key_offset(self, rank: int) -> int: ...

    def forward_stats(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                      labels: PairLabels): ...

    def backward_accumulators(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                              labels: PairLabels, row_stat, col_stat, grad_row_stat, grad_col_stat,
                              positives: PositiveGradients | None = None): ...

    # Optional: forward_with_gradients(spec, ops, queries, keys, scale, bias, labels) ->
    # (row_stat, UnitGradients, positive parts or None), the sigmoid loss's one pass, with
    # add_positive_pairs(spec, ops, queries, keys, scale, bias, labels, PositiveGradients, grad_queries,
    # grad_keys, row_sums) for its group_positives.


class PositiveGradients(NamedTuple):
    """With ``group_positives``: the complete positive parts (:mod:`hf_infcl.ops.positive_pairs`) and
    the gradients of the loss with respect to them, for the pairs' entries of G."""

    row_part: torch.Tensor  # [m]
    row_weight: torch.Tensor  # [m]
    column_part: torch.Tensor | None  # [k], with a column statistic
    column_weight: torch.Tensor | None  # [k]
    pairs: BlockPairs | GroupRanges | None = None  # the forward's pairs of one process's block, if kept


class UnitGradients(NamedTuple):
    """The one-pass route's gradients, computed in the forward with every row weight 1 (unscaled,
    accumulation dtype): what ``backward_accumulators`` would return for unit weights."""

    queries: torch.Tensor  # [m, c] G K
    key_slices: list  # ((start, end), [end - start, c] G^T Q) covering this process's keys
    row_sums: torch.Tensor  # [m] row sums of G


class BlockPairFinder:
    """The positive pairs of the rows with one key block, found the way the block ops take them
    (:func:`~hf_infcl.ops.positive_pairs.takes_group_ranges`). Make it before queuing the block's
    kernels and call :meth:`pairs` after: a list is counted at construction and listed by
    :meth:`pairs`, whose host synchronisation then waits on the count, not on the kernels; ranges
    need nothing before the kernels and no synchronisation at all. Arguments as
    :func:`~hf_infcl.ops.positive_pairs.count_pairs` takes them."""

    def __init__(self, ops: BlockOps, queries, query_groups, positive_keys, key_groups, key_offset: int = 0,
                 positives_in_block: bool = False):
        self._arguments = (query_groups, positive_keys, key_groups, key_offset, positives_in_block)
        self._ranged = takes_group_ranges(ops, queries)
        self._pending = None if self._ranged else count_pairs(*self._arguments)

    def pairs(self) -> BlockPairs | GroupRanges:
        return group_ranges(*self._arguments) if self._ranged else listed(self._pending)


def block_parts(spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias, pairs: BlockPairs | GroupRanges,
                statistics_dtype) -> PositiveParts:
    """The rows' (and keys') positive parts over a key block's ``pairs``, by the block ops' kernels
    for ranges, else from the list (its "any" log-sum-exps in ``statistics_dtype``); the parts keep
    the pairs for the backward."""
    if isinstance(pairs, GroupRanges):
        return ops.group_positive_parts(spec, queries, keys, scale, bias, pairs)
    parts = block_positive_parts(spec, queries, keys, scale, bias, pairs, row_combiner(ops), statistics_dtype)
    return parts._replace(pairs=pairs)


def left_out_counts(spec: StatsSpec, ops: BlockOps, queries, keys,
                    labels: PairLabels) -> LeftOutCounts | None:
    """Zero counts of the score filter's left-out entries for a forward's key blocks to fill and its
    backward to read, where the block ops keep them (:class:`~hf_infcl.ops.spec.LeftOutListOps`;
    None without the filter)."""
    make = getattr(ops, "left_out_counts", None)
    if not (spec.filters and callable(make)):
        return None
    return make(spec, queries, keys, guided=labels.guide_queries is not None)


def add_block_pair_gradients(spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                             pairs: BlockPairs | GroupRanges, row_part, row_weight, column_part,
                             column_weight, grad_queries, grad_keys, row_sums) -> None:
    """:func:`~hf_infcl.ops.positive_pairs.add_pair_gradients` over a key block's ``pairs``, by the
    block ops' kernels for ranges."""
    if isinstance(pairs, GroupRanges):
        ops.add_group_pair_gradients(spec, queries, keys, scale, bias, pairs, row_part, row_weight,
                                     column_part, column_weight, grad_queries, grad_keys, row_sums)
    else:
        add_pair_gradients(spec, queries, keys, scale, bias, pairs, row_part, row_weight, column_part,
                           column_weight, grad_queries, grad_keys, row_sums, row_combiner(ops))


@dataclass(frozen=True)
class SingleBlock:
    """The :class:`KeyBlockSchedule` of one process. ``lists_left_out``: the forward has the block
    ops count the score filter's left-out entries per row for the backward
    (:class:`~hf_infcl.ops.spec.LeftOutListOps`); False where the backward cannot receive the
    counts (the custom op's)."""

    rank: int = 0
    lists_left_out: bool = True

    def key_offset(self, rank: int) -> int:
        return 0

    def forward_stats(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias, labels: PairLabels):
        finder = self._pair_finder(spec, ops, queries, labels)  # before the kernel (BlockPairFinder says why)
        if self.lists_left_out:
            labels = labels._replace(left_out=left_out_counts(spec, ops, queries, keys, labels))
        block = labels.block(spec, labels.own_keys(), 0)
        row_stat, col_stat = ops.forward_block(spec, queries, keys, scale, bias, block.mask,
                                               hardness=block.hardness, score_filter=block.score_filter)
        parts = None if finder is None else block_parts(spec, ops, queries, keys, scale, bias, finder.pairs(),
                                                        row_stat.dtype)
        return row_stat, col_stat, parts, labels.left_out

    @staticmethod
    def _pair_finder(spec: StatsSpec, ops: BlockOps, queries, labels: PairLabels) -> BlockPairFinder | None:
        """The :class:`BlockPairFinder` of ``group_positives`` (None without)."""
        if spec.group_positives is None:
            return None
        # one process: its rows' positives are its own keys (checked before any kernel)
        return BlockPairFinder(ops, queries, labels.query_groups, labels.positive_keys, labels.key_groups,
                               positives_in_block=True)

    def backward_accumulators(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                              labels: PairLabels, row_stat, col_stat, grad_row_stat, grad_col_stat,
                              positives: PositiveGradients | None = None):
        acc = accumulation_dtype(queries.dtype)
        grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        block = labels.block(spec, labels.own_keys(), 0)
        columns = spec.columns
        row_sums = ops.backward_block(spec, queries, keys, scale, bias, block.mask, row_stat,
                                      col_stat if columns else None, grad_row_stat.to(acc),
                                      grad_col_stat.to(acc) if columns else None, grad_queries, grad_keys,
                                      hardness=block.hardness, score_filter=block.score_filter)
        if positives is not None:
            self.add_positive_pairs(spec, ops, queries, keys, scale, bias, labels, positives, grad_queries,
                                    grad_keys, row_sums)
        return grad_queries, [((0, keys.shape[0]), grad_keys)], row_sums

    def add_positive_pairs(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                           labels: PairLabels, positives: PositiveGradients, grad_queries, grad_keys,
                           row_sums) -> None:
        """Add the positive pairs' entries of G into the accumulators (in place): with the statistics'
        in the backward, or on the one-pass route into its scaled unit-weight gradients. The pairs
        are the forward's where it kept them, else found again."""
        pairs = positives.pairs
        if pairs is None:
            pairs = self._pair_finder(spec, ops, queries, labels).pairs()
        add_block_pair_gradients(spec, ops, queries, keys, scale, bias, pairs, positives.row_part,
                                 positives.row_weight, positives.column_part, positives.column_weight,
                                 grad_queries, grad_keys, row_sums)

    def forward_with_gradients(self, spec: StatsSpec, ops: OnePassSigmoidOps, queries, keys, scale, bias,
                               labels: PairLabels):
        """The sigmoid loss's one pass: (row_stat, unit-weight gradients, positive parts or None), see
        :class:`UnitGradients`."""
        acc = accumulation_dtype(queries.dtype)
        finder = self._pair_finder(spec, ops, queries, labels)
        grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        block = labels.block(spec, labels.own_keys(), 0)
        row_stat, row_sums = ops.forward_backward_block(spec, queries, keys, scale, bias, block.mask,
                                                        grad_queries, grad_keys,
                                                        score_filter=block.score_filter)
        unit = UnitGradients(grad_queries, [((0, keys.shape[0]), grad_keys)], row_sums)
        parts = None if finder is None else block_parts(spec, ops, queries, keys, scale, bias, finder.pairs(),
                                                        row_stat.dtype)
        return row_stat, unit, parts


SINGLE_BLOCK = SingleBlock()


class ForwardStats(NamedTuple):
    """What :func:`stats_forward` returns: the Function's outputs and the one-pass gradients."""

    row_stat: torch.Tensor  # [m]
    col_stat: torch.Tensor  # [k], or empty without a column statistic
    positive: torch.Tensor  # [m] z_{i,p(i)}; with group_positives the rows' positive parts
    column_positive: torch.Tensor  # [k] the keys' positive parts (group_positives, columns), else empty
    positive_counts: torch.Tensor  # [m] |P(i)| ("each"), else empty
    column_counts: torch.Tensor  # [k] |R(j)| ("each", columns), else empty
    unit: UnitGradients | None
    pairs: BlockPairs | GroupRanges | None = None  # one process's pairs, for the backward
    left_out: LeftOutCounts | None = None  # one process's left-out counts, for the backward
    labels: PairLabels | None = None  # the labels as completed for the kernels (complete_labels)


def stats_forward(schedule: KeyBlockSchedule, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                  positives, labels: PairLabels) -> ForwardStats:
    """The statistics of this process's rows and keys over every key and row of the schedule, with
    the positive logits, or with ``group_positives`` the positive parts
    (:mod:`hf_infcl.ops.positive_pairs`: for "each" sums, to be divided by the counts); ``labels``
    without the positives' global indices and the score filter's thresholds, which are added here.

    With ``spec.gradients_in_forward`` (and a schedule and block ops that offer it) the same pass
    also gives the :class:`UnitGradients`, which the backward then only scales."""
    labels = complete_labels(schedule, spec, ops, queries, keys, positives, labels)
    unit = parts = left_out = None
    if one_pass(spec, schedule, ops):
        row_stat, unit, parts = schedule.forward_with_gradients(spec, ops, queries, keys, scale, bias, labels)
        col_stat = None
    else:
        row_stat, col_stat, parts, left_out = schedule.forward_stats(spec, ops, queries, keys, scale, bias,
                                                                     labels)

    def empty():  # a new one each time: a custom op's outputs may not alias each other
        return queries.new_empty(0, dtype=accumulation_dtype(queries.dtype))

    if col_stat is None:
        col_stat = empty()
    if parts is None:
        positive = positive_logits(queries, keys, positives, scale, bias, row_combiner(ops))
        return ForwardStats(row_stat, col_stat, positive, empty(), empty(), empty(), unit, left_out=left_out,
                            labels=labels)
    counts_and_columns = (empty() if t is None else t for t in (parts.columns, parts.row_counts,
                                                                 parts.column_counts))
    return ForwardStats(row_stat, col_stat, parts.rows, *counts_and_columns, unit, parts.pairs, left_out,
                        labels)


def one_pass(spec: StatsSpec, schedule: KeyBlockSchedule, ops: BlockOps) -> bool:
    """Whether the forward computes the gradients too (``StatsSpec.gradients_in_forward``, where
    the schedule and the block ops offer it)."""
    return (spec.gradients_in_forward and takes_one_pass(ops)
            and callable(getattr(schedule, "forward_with_gradients", None))
            # the positive pairs' entries of G are added in the backward, where a schedule can
            and (spec.group_positives is None or callable(getattr(schedule, "add_positive_pairs", None))))


def common_row_weight(schedule: KeyBlockSchedule, row_weight: torch.Tensor) -> torch.Tensor | None:
    """The gradient every row statistic has on the one-pass route, which scales its key gradients:
    the schedule's own answer where it has one (the ring asks every rank, None where they differ),
    else row 0's (one process: the route's precondition)."""
    ask = getattr(schedule, "common_row_weight", None)
    return row_weight[0] if ask is None else ask(row_weight)


def stats_backward(schedule: KeyBlockSchedule, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                   positives, labels: PairLabels, row_stat, col_stat, grad_row_stat, grad_col_stat,
                   grad_positive_logit, needs=(True, True, True, True), unit: UnitGradients | None = None,
                   positive_parts=None, grad_column_positive=None,
                   pairs: BlockPairs | GroupRanges | None = None, left_out: LeftOutCounts | None = None):
    """(d queries, d keys, d scale, d bias) from the statistics' gradients; ``needs`` says which of
    the four are wanted (None is returned for the others). With the forward's ``unit``
    gradients, no tile is computed again. With ``group_positives``, ``positive_parts`` are the
    forward's (rows' [m], columns' [k] or empty) and ``grad_positive_logit`` and
    ``grad_column_positive`` their gradients, and ``pairs`` the forward's positive pairs where it
    kept them (:attr:`ForwardStats.pairs`; None: the schedule finds them again). ``left_out``: the
    forward's counts of the score filter's left-out entries (:attr:`ForwardStats.left_out`), if any."""
    pair_gradients = None
    if spec.group_positives is not None:
        row_part, column_part = positive_parts
        columns = spec.columns
        pair_gradients = PositiveGradients(row_part, grad_positive_logit, column_part if columns else None,
                                           grad_column_positive if columns else None, pairs)
        grad_positive_logit = None  # the pairs' gradients go into the accumulators
    if unit is not None and pair_gradients is None:
        row_weight = grad_row_stat.to(unit.queries.dtype)
        key_weight = common_row_weight(schedule, row_weight)
        if key_weight is not None:
            return finish_gradients(needs, queries, keys, scale, bias, positives, grad_positive_logit,
                                    unit.queries, unit.key_slices, unit.row_sums, row_weight=row_weight,
                                    key_weight=key_weight, combine=row_combiner(ops))
        unit = None  # rows weighted unevenly: the tiles again, each row with its own weight
    labels = labels._replace(left_out=left_out)
    labels = complete_labels(schedule, spec, ops, queries, keys, positives, labels)
    if unit is not None:
        # The one pass with positive pairs: its unit-weight gradients scaled into new accumulators
        # (the forward's are kept for a second backward), the pairs' entries added to them.
        weight = grad_row_stat.to(unit.queries.dtype)
        (_, unit_keys), = unit.key_slices  # the one pass is one process's: a single block
        grad_queries = unit.queries * weight[:, None]
        grad_keys = unit_keys * common_row_weight(schedule, weight)
        row_sums = unit.row_sums * weight
        schedule.add_positive_pairs(spec, ops, queries, keys, scale, bias, labels, pair_gradients,
                                    grad_queries, grad_keys, row_sums)
        return finish_gradients(needs, queries, keys, scale, bias, positives, None, grad_queries,
                                [((0, keys.shape[0]), grad_keys)], row_sums, combine=row_combiner(ops))
    grad_queries, key_slices, row_sums = schedule.backward_accumulators(
        spec, ops, queries, keys, scale, bias, labels, row_stat, col_stat, grad_row_stat, grad_col_stat,
        pair_gradients,
    )
    return finish_gradients(needs, queries, keys, scale, bias, positives, grad_positive_logit, grad_queries,
                            key_slices, row_sums, combine=row_combiner(ops))


def complete_labels(schedule: KeyBlockSchedule, spec: StatsSpec, ops: BlockOps, queries, keys, positives,
                    labels: PairLabels) -> PairLabels:
    """``labels`` with the rows' positives as global key indices (keys numbered in rank order),
    which group masking, the hardness offset, the score filter and the positive pairs need
    (``positives`` None: ``keys[:m]``), and with the score filter's thresholds
    (:func:`hf_infcl.ops.score_filter.thresholds`). Labels the forward completed (a backward's)
    are returned as they are."""
    if labels.query_groups is None and labels.query_ids is None and not spec.filters:
        return labels
    if labels.positive_keys is not None:
        return labels
    global_positives = positives
    if positives is None:
        global_positives = torch.arange(queries.shape[0], device=queries.device)
    offset = schedule.key_offset(schedule.rank)
    labels = labels._replace(positive_keys=global_positives + offset if offset else global_positives)
    if not spec.filters:
        return labels
    # The thresholds index keys by the positives before the one-process value check has read them
    # (it runs just before the loss's first kernel, so that the GPU does not idle through this host
    # work): clamped, an index out of range reads a key, not past the keys, and the check rejects it.
    index = None if positives is None else positives.clamp(0, keys.shape[0] - 1)
    row_thresholds, key_thresholds = score_filter.thresholds(spec, queries, keys, index,
                                                             labels.guide_queries, labels.guide_keys,
                                                             row_combiner(ops))
    return labels._replace(row_thresholds=row_thresholds, key_thresholds=key_thresholds)


class KeyBlockLogitStats(torch.autograd.Function):
    """(queries, keys, scale, bias, positives, query_groups, key_groups, query_ids, key_owners,
    guide_queries, guide_keys) -> (row_stat [m], col_stat [k] or empty, positive_logit [m],
    column_positive [k] or empty, positive_counts [m] or empty, column_counts [k] or empty) over
    ``schedule``'s key blocks, with any block-ops object (:class:`ForwardStats` says what each
    is; the counts have no gradient).

    ``positives`` are local key indices: a row's positive is always among its own process's keys
    (None: ``keys[:m]``, row i's positive is key i).
    """

    @staticmethod
    def forward(ctx, queries, keys, scale, bias, positives, query_groups, key_groups, query_ids, key_owners,
                guide_queries, guide_keys, spec: StatsSpec, ops: BlockOps, schedule: KeyBlockSchedule):
        labels = PairLabels(query_groups, key_groups, query_ids, key_owners, guide_queries=guide_queries,
                            guide_keys=guide_keys)
        stats = stats_forward(schedule, spec, ops, queries, keys, scale, bias, positives, labels)
        ctx.save_for_backward(queries, keys, scale, bias, positives, query_groups, key_groups, query_ids,
                              key_owners, guide_queries, guide_keys, stats.row_stat, stats.col_stat,
                              stats.positive, stats.column_positive)
        ctx.spec, ctx.ops, ctx.schedule, ctx.unit, ctx.pairs = spec, ops, schedule, stats.unit, stats.pairs
        ctx.left_out = stats.left_out
        # what complete_labels added (no inputs: those are saved above), so that the backward,
        # which starts while the GPU has nothing queued, does not make it again
        completed = stats.labels
        ctx.completed = None if completed is None else (completed.positive_keys, completed.row_thresholds,
                                                        completed.key_thresholds)
        ctx.mark_non_differentiable(stats.positive_counts, stats.column_counts)
        return stats[:6]

    @staticmethod
    def backward(ctx, grad_row_stat, grad_col_stat, grad_positive, grad_column_positive, *_grad_counts):
        (queries, keys, scale, bias, positives, query_groups, key_groups, query_ids, key_owners,
         guide_queries, guide_keys, row_stat, col_stat, positive, column_positive) = ctx.saved_tensors
        labels = PairLabels(query_groups, key_groups, query_ids, key_owners, guide_queries=guide_queries,
                            guide_keys=guide_keys)
        if ctx.completed is not None:
            positive_keys, row_thresholds, key_thresholds = ctx.completed
            labels = labels._replace(positive_keys=positive_keys, row_thresholds=row_thresholds,
                                     key_thresholds=key_thresholds)
        # On the CPU the backward runs in the caller's thread, under its autocast if it is on: the
        # gradients keep the forward's precision (hf_infcl.loss turns autocast off for the forward).
        with torch.autocast(queries.device.type, enabled=False):
            grads = stats_backward(
                ctx.schedule, ctx.spec, ctx.ops, queries, keys, scale, bias, positives, labels, row_stat,
                col_stat, grad_row_stat, grad_col_stat, output_gradient(grad_positive, positive),
                needs=ctx.needs_input_grad[:4], unit=ctx.unit, positive_parts=(positive, column_positive),
                grad_column_positive=output_gradient(grad_column_positive, column_positive), pairs=ctx.pairs,
                left_out=ctx.left_out)
        return (*grads, *(None,) * 10)


def output_gradient(grad: torch.Tensor | None, output: torch.Tensor,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output's gradient (in ``dtype``, if given), zeros where autograd gives None (the output
    did not reach the loss)."""
    dtype = output.dtype if dtype is None else dtype
    return torch.zeros(output.shape, dtype=dtype, device=output.device) if grad is None else grad.to(dtype)


def row_chunks(rows: int, width: int):
    """Slices of ``rows`` rows whose ``width``-wide temporaries stay below a fixed size."""
    step = max(1, _EPILOGUE_ELEMENTS // max(1, width))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


class RowCombiner(Protocol):
    """The O(m c) epilogues' one primitive (:func:`combine_rows` says what it computes). Block ops
    may offer a faster one as a ``combine_rows`` method (the Triton backend: one kernel launch)."""

    def __call__(self, *, rows: int, sources, source_index, source_weight=None, entry_rows=None,
                 accumulator=None, weight=None, out=None, scale=None, dot_with=None, dot_index=None): ...


def row_combiner(ops) -> RowCombiner:
    """``ops.combine_rows`` where the block ops offer one, else :func:`combine_rows`."""
    return getattr(ops, "combine_rows", combine_rows)


def combine_rows(*, rows: int, sources, source_index, source_weight=None, entry_rows=None, accumulator=None,
                 weight=None, out=None, scale=None, dot_with=None, dot_index=None):
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
    ``dot_with`` is given, else None), or ``<v_r, dot_with[dot_index[r]]>`` with ``dot_index``.

    The epilogues' uses: dQ_i = s (w_i (G K)_i + a_i K_p(i)) with d scale from <., Q_i> (one entry
    per row); dK_j = s (w (G^T Q)_j + sum_{i: p(i) = j} a_i Q_i) (entries sorted by positive);
    the positive logits <Q_i, K_p(i)> (no accumulator, no output); the dot products of a list
    of (row, key) pairs (one entry per pair, ``dot_index`` the rows). This version runs in row chunks
    of torch ops (no full-size fp32 temporaries) and reads the chunks' entry ranges with one host
    synchronisation.
    """
    acc = accumulation_dtype(sources.dtype)
    width = sources.shape[1]
    chunks = list(row_chunks(rows, width))
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
            partners = dot_with[part] if dot_index is None else dot_with[dot_index[part]]
            dots[part] = (block * partners.to(acc)).sum(dim=1)
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
                     row_sums, row_weight=None, key_weight=None, combine: RowCombiner = combine_rows):
    """(d queries, d keys, d scale, d bias) from the unscaled accumulators of the statistics'
    gradient, adding the positive logits' gradient ``grad_positive``; ``needs`` (four bools, e.g.
    ``ctx.needs_input_grad[:4]``) says which are wanted, None for the others.

    The accumulators are G K [m, c], G^T Q as ((start, end), accumulator) slices of the keys (the
    ring keeps its key gradient in slices, padded to the largest rank's keys), and the row sums
    of G. With ``row_weight`` None they hold the gradient itself, and each key slice is dropped
    from the list once used (its memory freed). With ``row_weight`` [m] they hold the unit-weight
    G of the one-pass route (``StatsSpec.gradients_in_forward``) and are kept: row i of G K is
    scaled by its weight, G^T Q by the rows' common weight ``key_weight`` (:func:`common_row_weight`).
    They are only ever read (a second backward of the one-pass route reads them again).

    The positive logits' gradient is summed with the fp32 accumulators before the single cast,
    where it nearly cancels G's entry at the positive (see the module docstring). ``grad_positive``
    None: there is none to add (the accumulators hold the positive pairs' gradients already).
    d scale = sum_ij G_ij x_ij = sum_i <Q_i, (G K)_i>, so it needs no pass over the tiles;
    d bias = sum of G. Every [m, c] product goes through ``combine`` (:func:`combine_rows`).
    """
    need_q, need_k, need_scale, need_bias = needs
    acc = grad_queries.dtype
    scale_acc = scale.to(acc)
    grad_scale = grad_bias = grad_q = grad_k = None
    if grad_positive is None:  # no entries: sources of no rows, taken in order (source_index None)
        positives, query_sources, key_sources, weight = None, keys[:0], queries[:0], None
    else:
        query_sources, key_sources, weight = keys, queries, grad_positive.to(acc)
    if need_q:
        grad_q = torch.empty(queries.shape, dtype=queries.dtype, device=queries.device)
    if need_q or need_scale:
        dots = combine(rows=queries.shape[0], sources=query_sources, source_index=positives,
                       source_weight=weight, accumulator=grad_queries, weight=row_weight, out=grad_q,
                       scale=scale_acc, dot_with=queries if need_scale else None)
        if need_scale:
            grad_scale = dots.sum().to(scale.dtype)
    if need_bias and bias is not None:
        sums = row_sums if row_weight is None else row_sums * row_weight
        grad_bias = (sums.sum() + (0.0 if weight is None else weight.sum())).to(bias.dtype)
    if need_k:
        if positives is not None:
            # Key j takes the rows whose positive it is: the rows sorted by positive, so that
            # each key's rows are one contiguous range of entries.
            sorted_positives, by_positive = torch.sort(positives, stable=True)
            entry_weight = weight[by_positive]
        grad_k = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
        for index, ((start, end), accumulator) in enumerate(key_slices):
            end = min(end, keys.shape[0])  # the ring pads key blocks to the largest rank's
            if end > start:
                if positives is None:  # key j < m takes row j: the slice's rows start..
                    first, last = min(start, key_sources.shape[0]), min(end, key_sources.shape[0])
                    entries = dict(sources=key_sources[first:last], source_index=None,
                                   source_weight=None if weight is None else weight[first:last])
                else:
                    entries = dict(sources=queries, source_index=by_positive, source_weight=entry_weight,
                                   entry_rows=sorted_positives - start)
                combine(rows=end - start, **entries, accumulator=accumulator, weight=key_weight,
                        out=grad_k[start:end], scale=scale_acc)
            if row_weight is None:
                key_slices[index] = None  # free each slice as soon as it is used
    return grad_q, grad_k, grad_scale, grad_bias
