"""Several positives per row (docs/contract.md, "Several positives per row"): the positive parts of
the loss from the sparse list of (row, key) pairs with j in P(i), outside the kernels.

With ``group_positives`` the keys of a row's group are its positives, so the groups leave nothing
out of the statistics: the kernels run as without groups. What changes is what each term
subtracts, its positive part over the pairs:

    softmax "any":   LSE_{j in P(i)} z_ij            (rows)    LSE_{i in R(j)} z_ij   (columns)
    softmax "each":  sum_{j in P(i)} z_ij and |P(i)|                sum_{i in R(j)} z_ij and |R(j)|
    sigmoid:         sum_{j in P(i)} z_ij

("each" divides by the count outside, with ordinary autograd). A key block's pairs are found by
sorting its key groups and looking up each row's group: listed (:func:`count_pairs`), O(pairs +
k log k) time and O(pairs) memory, linear while the groups are bounded (one group of n rows and
n keys holds n^2 pairs), or, for block ops that walk them (the Triton kernels), as ranges of
the sorted keys and rows (:func:`group_ranges`), O(m + k) memory and no host synchronisation.
The pairs' logits are row-wise dot products, in the accumulation dtype.

Each key block gives partial parts (:func:`block_positive_parts`) that merge like the statistics
(:func:`merge_positive_parts`), so the ring carries the column parts with its column statistic.
In the backward, a pair's gradient is one more entry of G (``G_ij += w_ij``), added into the same
fp32 accumulators as the statistics' G (:func:`add_pair_gradients`) before the single cast to the
input dtype, where it nearly cancels the statistics' gradient at the positives (the reason
``hf_infcl.ops.key_blocks`` makes the positive logit an output of its Function).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .spec import StatsSpec, accumulation_dtype, probabilities


class BlockPairs(NamedTuple):
    """The pairs (i, j) with key j of a block among row i's positives, sorted by row."""

    rows: torch.Tensor  # [n] int64, non-decreasing
    keys: torch.Tensor  # [n] int64, indices into the block


class PairRanges(NamedTuple):
    """The pairs of each "outer" vector (rows, or keys) as inner indices, with no list of pairs:
    ``order[first[o] : first[o] + count[o]]``, then ``extra_order[extra_first[o] :
    extra_first[o] + extra_count[o]]`` (``extra_first`` None: ``extra_order[o]`` if
    ``extra_count[o]`` is 1, nothing if it is 0)."""

    first: torch.Tensor
    count: torch.Tensor
    order: torch.Tensor
    extra_first: torch.Tensor | None
    extra_count: torch.Tensor
    extra_order: torch.Tensor


class GroupRanges(NamedTuple):
    """One process's pairs as :class:`PairRanges` from both sides: each row's keys (its group's,
    then its own positive where that lies outside the group) and each key's rows (its group's,
    then those whose own positive it is)."""

    rows: PairRanges
    keys: PairRanges


def takes_group_ranges(ops, queries: torch.Tensor) -> bool:
    """Whether the block ops ``ops`` take the pairs as :class:`GroupRanges`, walked by their own
    kernels (:class:`~hf_infcl.ops.spec.GroupRangeOps`: no list, no host synchronisation for its
    length), rather than as :class:`BlockPairs`."""
    takes = getattr(ops, "takes_group_ranges", None)
    return callable(takes) and takes(queries)


def _equal_ranges(values: torch.Tensor, lookups: torch.Tensor):
    """(order, first, count): ``values[order]`` sorted (stably), and for each of ``lookups`` the
    range ``order[first : first + count]`` of the values equal to it."""
    sorted_values, order = torch.sort(values, stable=True)
    first = torch.searchsorted(sorted_values, lookups, side="left")
    return order, first, torch.searchsorted(sorted_values, lookups, side="right") - first


def _own_positives(query_groups, positive_keys, key_groups, key_offset: int, positives_in_block: bool):
    """(own, own_apart): each row's own positive as an index into the key block (int64 groups,
    ``key_offset`` the block's first global index), clamped into it, and whether it is a pair of
    its own: in the block (``positives_in_block``: known to be) and not among its group's keys."""
    k = key_groups.shape[0]
    own = positive_keys.long() - key_offset if key_offset else positive_keys.long()
    own_here = None if positives_in_block else (own >= 0) & (own < k)
    # clamped even in the block: an index past the end would end the process, and the check that
    # positives are in range may still be pending (it runs just before the first kernel)
    own = own.clamp(0, k - 1)
    own_apart = key_groups[own] != query_groups  # not among its group's keys already
    if own_here is not None:
        own_apart &= own_here
    return own, own_apart


def group_ranges(query_groups: torch.Tensor, positive_keys: torch.Tensor, key_groups: torch.Tensor,
                 key_offset: int = 0, positives_in_block: bool = True) -> GroupRanges:
    """The :class:`GroupRanges` of the rows (``query_groups`` [m], their positives' global indices
    ``positive_keys``) and a key block (``key_groups`` [k], global index of its first key
    ``key_offset``), as :func:`count_pairs` takes them (``positives_in_block``: every row's
    positive lies in the block, one process's own keys): sorts and binary searches on the
    device, O((m + k) log k), nothing read on the host."""
    query_groups, key_groups = query_groups.long(), key_groups.long()
    k = key_groups.shape[0]
    key_order, row_first, row_count = _equal_ranges(key_groups, query_groups)
    own, own_apart = _own_positives(query_groups, positive_keys, key_groups, key_offset, positives_in_block)
    rows = PairRanges(row_first, row_count, key_order, None, own_apart.long(), own)

    row_order, key_first, key_count = _equal_ranges(query_groups, key_groups)
    # the rows whose own positive lies outside their group, by that key (the others past the end)
    own_rows, own_first, own_count = _equal_ranges(torch.where(own_apart, own, k),
                                                   torch.arange(k, device=own.device))
    keys = PairRanges(key_first, key_count, row_order, own_first, own_count, own_rows)
    return GroupRanges(rows, keys)


class PositiveParts(NamedTuple):
    """Positive parts of a set of key blocks (module docstring), in the accumulation dtype. For
    "any" the parts are log-sum-exps (-inf where no pair), otherwise sums; counts are "each"'s
    (else None); the column parts are None without a column statistic."""

    rows: torch.Tensor  # [m]
    columns: torch.Tensor | None  # [k_block]
    row_counts: torch.Tensor | None  # [m]
    column_counts: torch.Tensor | None  # [k_block]
    pairs: BlockPairs | GroupRanges | None = None  # the pairs they came from, where a caller keeps them


def takes_log_sum_exp(spec: StatsSpec) -> bool:
    """Whether the positive parts are log-sum-exps ("any" with the softmax loss) rather than sums."""
    return spec.loss == "softmax" and spec.group_positives == "any"


def counts_positives(spec: StatsSpec) -> bool:
    """Whether the positive parts come with their counts ("each" with the softmax loss)."""
    return spec.loss == "softmax" and spec.group_positives == "each"


class PendingPairs:
    """A key block's pairs in two steps (:func:`count_pairs`, then :meth:`pairs`): the pair counts
    are queued on the device and their total starts its copy to the host at once, so that a caller
    can queue the first kernel before it waits for that number (the pairs' one host
    synchronisation then waits on the count, not on the kernel)."""

    def __init__(self, in_group, first, own, order, counts, k: int):
        self._parts = (in_group, first, own, order, counts)
        self._k = k
        total = counts.sum()
        if total.device.type == "cuda":
            # pinned, so that the copy is asynchronous; the event marks its end
            self._total = torch.empty((), dtype=total.dtype, pin_memory=True).copy_(total, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._total, self._copied = total, None

    def pairs(self) -> BlockPairs:
        """The pairs, sorted by row: waits for the total (the host synchronisation), then lists them."""
        in_group, first, own, order, counts = self._parts
        if self._copied is not None:
            self._copied.synchronize()
        total = int(self._total)
        device = counts.device
        row_numbers = torch.arange(counts.shape[0], device=device)
        rows = torch.repeat_interleave(row_numbers, counts, output_size=total)
        position = torch.arange(total, device=device) - (torch.cumsum(counts, 0) - counts)[rows]
        from_group = position < in_group[rows]
        group_key = order[(first[rows] + position).clamp(max=self._k - 1)]
        return BlockPairs(rows, torch.where(from_group, group_key, own[rows]))


def count_pairs(query_groups: torch.Tensor, positive_keys: torch.Tensor, key_groups: torch.Tensor,
                key_offset: int, positives_in_block: bool = False) -> PendingPairs | BlockPairs:
    """The pairs of the rows (``query_groups`` [m], their positives' global indices
    ``positive_keys``) with a key block (``key_groups`` [k_block], global index of its first key
    ``key_offset``): each row's own positive if it lies in the block, and every key of its group.
    Returned pending (:class:`PendingPairs`), or as the empty :class:`BlockPairs` when there are
    no rows or keys. ``positives_in_block``: every row's positive is known to lie in the block
    (one process's own keys), which spares the range test: these operations run before the first
    kernel, where their host time idles the GPU."""
    device = key_groups.device
    m, k = query_groups.shape[0], key_groups.shape[0]
    if m == 0 or k == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return BlockPairs(empty, empty)
    query_groups, key_groups = query_groups.long(), key_groups.long()
    order, first, in_group = _equal_ranges(key_groups, query_groups)
    own, own_apart = _own_positives(query_groups, positive_keys, key_groups, key_offset, positives_in_block)
    counts = in_group + own_apart
    return PendingPairs(in_group, first, own, order, counts, k)


def listed(pending: PendingPairs | BlockPairs | None) -> BlockPairs | None:
    """The pairs of :func:`count_pairs`' result (listing them if still pending); None stays None."""
    return pending.pairs() if isinstance(pending, PendingPairs) else pending


def pair_logits(queries, keys, pairs: BlockPairs, scale, bias, combine) -> torch.Tensor:
    """z of every pair, s <Q_i, K_j> + b, in the accumulation dtype [n]; ``combine``: the block ops'
    row primitive (:func:`hf_infcl.ops.key_blocks.combine_rows`), one entry per pair."""
    acc = accumulation_dtype(queries.dtype)
    dots = combine(rows=pairs.rows.shape[0], sources=keys, source_index=pairs.keys, dot_with=queries,
                   dot_index=pairs.rows)
    logits = scale.to(acc) * dots.to(acc)
    return logits if bias is None else logits + bias.to(acc)


def segment_logsumexp(values: torch.Tensor, segments: torch.Tensor, n: int, dtype=None) -> torch.Tensor:
    """[n]: the log-sum-exp of the ``values`` of each segment (-inf for a segment with none), in
    ``dtype`` (default the values'): each segment's max (exact) plus the log of its small sum, added
    in that dtype, as the statistics the parts are compared with are formed (the "torch" block
    ops keep theirs in float64)."""
    top = torch.full((n,), float("-inf"), dtype=values.dtype, device=values.device)
    top = top.scatter_reduce(0, segments, values, "amax")
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    sums = torch.zeros_like(top).index_add_(0, segments, torch.exp(values - shift[segments]))
    dtype = dtype or values.dtype
    return shift.to(dtype) + torch.log(sums).to(dtype)


def empty_positive_parts(spec: StatsSpec, m: int, k: int, dtype, device) -> PositiveParts:
    """The parts of no pairs at all (what a block without pairs contributes)."""
    fill = float("-inf") if takes_log_sum_exp(spec) else 0.0
    counting = counts_positives(spec)
    return PositiveParts(
        torch.full((m,), fill, dtype=dtype, device=device),
        torch.full((k,), fill, dtype=dtype, device=device) if spec.columns else None,
        torch.zeros(m, dtype=dtype, device=device) if counting else None,
        torch.zeros(k, dtype=dtype, device=device) if counting and spec.columns else None,
    )


def block_positive_parts(spec: StatsSpec, queries, keys, scale, bias, pairs: BlockPairs, combine,
                         statistics_dtype=None) -> PositiveParts:
    """The partial positive parts of the rows against one key block, from its pairs (``combine``:
    see :func:`pair_logits`); "any"'s log-sum-exps in ``statistics_dtype``, that of the block
    ops' statistics (default the accumulation dtype), so that the backward's two probabilities of
    a positive pair, which nearly cancel, are rounded alike."""
    acc = accumulation_dtype(queries.dtype)
    m, k = queries.shape[0], keys.shape[0]
    if pairs.rows.numel() == 0:
        return empty_positive_parts(spec, m, k, acc, queries.device)
    logits = pair_logits(queries, keys, pairs, scale, bias, combine)
    if takes_log_sum_exp(spec):
        rows = segment_logsumexp(logits, pairs.rows, m, statistics_dtype)
        columns = segment_logsumexp(logits, pairs.keys, k, statistics_dtype) if spec.columns else None
    else:
        rows = torch.zeros(m, dtype=acc, device=queries.device).index_add_(0, pairs.rows, logits)
        columns = None
        if spec.columns:
            columns = torch.zeros(k, dtype=acc, device=queries.device).index_add_(0, pairs.keys, logits)
    row_counts = column_counts = None
    if counts_positives(spec):
        ones = torch.ones_like(logits)
        row_counts = torch.zeros(m, dtype=acc, device=queries.device).index_add_(0, pairs.rows, ones)
        if spec.columns:
            column_counts = torch.zeros(k, dtype=acc, device=queries.device).index_add_(0, pairs.keys, ones)
    return PositiveParts(rows, columns, row_counts, column_counts)


def merge_parts(spec: StatsSpec, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Combine one kind of part of two disjoint sets of pairs (log-sum-exps, or sums)."""
    if a is None:
        return b
    return torch.logaddexp(a, b) if takes_log_sum_exp(spec) else a + b


def merge_positive_parts(spec: StatsSpec, a: PositiveParts, b: PositiveParts) -> PositiveParts:
    """The row parts of two key blocks merged (their column parts are of different keys: ``b``'s
    are kept)."""
    row_counts = None if a.row_counts is None else a.row_counts + b.row_counts
    return PositiveParts(merge_parts(spec, a.rows, b.rows), b.columns, row_counts, b.column_counts)


def add_pair_gradients(spec: StatsSpec, queries, keys, scale, bias, pairs: BlockPairs, row_part, row_weight,
                       column_part, column_weight, grad_queries, grad_keys, row_sums, combine) -> None:
    """Add the pairs' entries of G to the block's unscaled accumulators (in place): w_ij K_j to
    ``grad_queries`` [m, c], w_ij Q_i to ``grad_keys`` [k_block, c], w_ij to ``row_sums`` [m], where
    w_ij is the gradient of the loss with respect to z_ij through the positive parts:

        "any" (softmax):  row_weight_i exp(z_ij - row_part_i) + column_weight_j exp(z_ij - column_part_j)
        otherwise:        row_weight_i + column_weight_j

    ``row_part`` [m] and ``column_part`` [k_block] are the complete parts (over every key and row of
    the problem); ``column_part`` and ``column_weight`` are None without a column statistic. Both
    products go through ``combine`` (:func:`hf_infcl.ops.key_blocks.combine_rows`), each row's or
    key's pairs as one range of entries: no atomics, no [pairs, c] temporaries."""
    if pairs.rows.numel() == 0:
        return
    acc = grad_queries.dtype
    weight = row_weight.to(acc)[pairs.rows]
    if takes_log_sum_exp(spec):
        logits = pair_logits(queries, keys, pairs, scale, bias, combine)
        weight = weight * probabilities(logits, row_part[pairs.rows])
        if column_weight is not None:
            column_probability = probabilities(logits, column_part[pairs.keys])
            column_weight = column_weight.to(acc)[pairs.keys] * column_probability
    elif column_weight is not None:
        column_weight = column_weight.to(acc)[pairs.keys]
    if column_weight is not None:
        weight = weight + column_weight
    one = torch.ones((), dtype=acc, device=grad_queries.device)
    # In place: each output row is read, then written, by the same step of the combiner.
    combine(rows=grad_queries.shape[0], sources=keys, source_index=pairs.keys, source_weight=weight,
            entry_rows=pairs.rows, accumulator=grad_queries, out=grad_queries, scale=one)
    by_key = torch.argsort(pairs.keys, stable=True)
    combine(rows=grad_keys.shape[0], sources=queries, source_index=pairs.rows[by_key],
            source_weight=weight[by_key], entry_rows=pairs.keys[by_key], accumulator=grad_keys, out=grad_keys,
            scale=one)
    row_sums.index_add_(0, pairs.rows, weight)
