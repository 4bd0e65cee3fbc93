"""The forward's statistics kernel and the merge of its partial statistics, with their launchers.

``_stats_kernel``: one program owns a block of "outer" vectors and streams every "inner" vector
past it, keeping an online log-sum-exp (softmax) or a running sum of softplus (sigmoid) per
outer vector. With queries outer it gives the row statistic; for the symmetric loss the same
tiles also give each key's log-sum-exp over the program's rows, one partial per (row block, key)
in a bounded buffer that :func:`merge_partials` folds into the column statistic, so the forward
is one pass over the tiles. (With keys outer it gives the column statistic on its own: the
two-pass option.) When there are too few outer blocks to fill the GPU, the inner range is split
over several programs whose partial statistics are merged afterwards.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .device import INTERPRET, pair_pointers, sm_count, unused_pointer
from .jit_math import (
    LN2,
    allowed_pairs,
    column_lse,
    dot_precision,
    dot_tile,
    even_guide_k,
    even_k,
    exp_in_units,
    hardness_offset_logits,
    in_units,
    log2_units,
    log_in_units,
    not_positive,
    outer_block_and_inner_range,
    round_guide,
    scale_and_bias,
    scaled_logits,
    score_filter_drops,
    softplus,
)
from .launch import BASE_SHAPES, autotuned, launch, launch_jit, problem_size_class

# Autotuning candidates beyond the base shapes: a small tile, and narrow row blocks with long
# steps along a wide c (768-1024).
_STATS_SHAPES = [*BASE_SHAPES, (64, 64, 64, 4, 3), (64, 128, 128, 4, 3)]


@triton.jit
def _stats_kernel(
    outer_ptr, inner_ptr, out_ptr, col_partial_ptr, scale_ptr, bias_ptr,
    row_group_ptr, key_group_ptr, positive_ptr, key_offset, query_id_ptr, key_owner_ptr, hardness_ptr,
    guide_outer_ptr, guide_inner_ptr, row_threshold_ptr, key_threshold_ptr,
    n_outer, n_inner, c, stride_outer, stride_inner, inner_per_split, size_class,
    c_guide, stride_guide_outer, stride_guide_inner,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COLUMNS: tl.constexpr, SIGMOID: tl.constexpr,
    FUSED_COLUMNS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, HARDNESS: tl.constexpr,
    FILTER: tl.constexpr, GUIDE: tl.constexpr, GROUP_POSITIVES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_GUIDE_K: tl.constexpr, ROUND_GUIDE: tl.constexpr, FULL: tl.constexpr, LOG2: tl.constexpr,
):
    pid, outer_index, outer_valid, inner_start, inner_end = outer_block_and_inner_range(
        n_outer, n_inner, inner_per_split, BLOCK_M)

    scale, bias = scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, LOG2)
    if HARDNESS != 0:  # rows outer only: the column statistic is of the plain logits
        strength = in_units(tl.load(hardness_ptr).to(tl.float32), LOG2)

    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(inner_start, inner_end, BLOCK_N):
        inner_index = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        inner_valid = inner_index < inner_end
        # Pointer loads (TMA False): this kernel reads its tiles faster that way than through
        # tensor descriptors, unlike the gradient-tile kernel.
        dots = dot_tile(outer_ptr, inner_ptr, None, None, outer_index, inner_index, outer_valid, inner_valid,
                        0, 0, c, stride_outer, stride_inner, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                        EVEN_K, False)
        logits = scaled_logits(dots, scale, bias, HAS_BIAS)
        # Full blocks (FULL) without a group mask allow every pair: no mask tile at all.
        if HAS_MASK or not FULL:
            if COLUMNS:
                # The tile is transposed (keys x rows): build the mask in (rows, keys) order.
                allowed = tl.trans(allowed_pairs(inner_index, outer_index, inner_valid, outer_valid,
                                                 row_group_ptr, key_group_ptr, positive_ptr, key_offset,
                                                 HAS_MASK))
            else:
                allowed = allowed_pairs(outer_index, inner_index, outer_valid, inner_valid,
                                        row_group_ptr, key_group_ptr, positive_ptr, key_offset, HAS_MASK)
        if FILTER:
            scores = dots
            if GUIDE:
                scores = dot_tile(guide_outer_ptr, guide_inner_ptr, None, None, outer_index, inner_index,
                                  outer_valid, inner_valid, 0, 0, c_guide, stride_guide_outer,
                                  stride_guide_inner, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                                  EVEN_GUIDE_K, False, ROUND_GUIDE)
            candidates = not_positive(outer_index, inner_index, outer_valid, inner_valid, pid * BLOCK_M, n0,
                                      positive_ptr, key_offset, row_group_ptr, key_group_ptr, COLUMNS,
                                      GROUP_POSITIVES, BLOCK_M, BLOCK_N)
            # the outer vectors' own thresholds: rows', or keys' with keys outer
            if COLUMNS:
                outer_thresholds = key_threshold_ptr
            else:
                outer_thresholds = row_threshold_ptr
            dropped = score_filter_drops(scores, candidates, outer_thresholds, outer_index, outer_valid, True)
        if SIGMOID:
            terms = softplus(logits)
            if HAS_MASK or not FULL:
                terms = tl.where(allowed, terms, 0.0)
            if FILTER:
                terms = tl.where(dropped, 0.0, terms)
            running_sum += tl.sum(terms, axis=1)
        else:
            if HARDNESS != 0:
                logits = hardness_offset_logits(logits, dots, outer_index, inner_index, outer_valid,
                                                inner_valid, query_id_ptr, key_owner_ptr, positive_ptr,
                                                key_offset, strength, row_group_ptr, key_group_ptr, HARDNESS,
                                                GROUP_POSITIVES)
            if HAS_MASK or not FULL:
                logits = tl.where(allowed, logits, float("-inf"))
            if FILTER:
                logits = tl.where(dropped, float("-inf"), logits)
            # The tile's own row maxima shift its exponentials. A row with nothing allowed has
            # max -inf: shift by 0 there.
            tile_max = tl.max(logits, axis=1)
            tile_shift = tl.where(tile_max == float("-inf"), 0.0, tile_max)
            p = exp_in_units(logits - tile_shift[:, None], LOG2)
            new_max = tl.maximum(running_max, tile_max)
            new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            # exp2(-inf - shift) = 0 takes care of rows and tiles with nothing allowed.
            running_sum = (running_sum * exp_in_units(running_max - new_shift, LOG2)
                           + tl.sum(p, axis=1) * exp_in_units(tile_max - new_shift, LOG2))
            running_max = new_max
            if FUSED_COLUMNS:
                # The same tile's column log-sum-exp over this program's rows: one partial per
                # (row block, key), merged by the launcher. Saves the second forward pass.
                if HARDNESS != 0 or FILTER:
                    # The columns' own logits (no offset, their own filter), made again from the
                    # dots once the rows' are used: one logit tile live at a time, not two.
                    column_logits = scaled_logits(dots, scale, bias, HAS_BIAS)
                    if HAS_MASK or not FULL:
                        column_logits = tl.where(allowed, column_logits, float("-inf"))
                    if FILTER:
                        column_dropped = score_filter_drops(scores, candidates, key_threshold_ptr,
                                                            inner_index, inner_valid, False)
                        column_logits = tl.where(column_dropped, float("-inf"), column_logits)
                    col_lse = column_lse(column_logits, LOG2)
                else:
                    col_lse = column_lse(logits, LOG2)
                if LOG2:  # the partials are merged in natural units
                    col_lse *= LN2
                if FULL:
                    tl.store(col_partial_ptr + pid * n_inner + inner_index, col_lse)
                else:
                    tl.store(col_partial_ptr + pid * n_inner + inner_index, col_lse, mask=inner_valid)

    if SIGMOID:
        result = running_sum
    else:
        shift = tl.where(running_max == float("-inf"), 0.0, running_max)
        result = shift + log_in_units(running_sum, LOG2)  # log(0) = -inf for rows that saw no allowed key
        if LOG2:
            result *= LN2
    tl.store(out_ptr + tl.program_id(1).to(tl.int64) * n_outer + outer_index, result, mask=outer_valid)


# Heuristics, not launcher arguments: the block sizes are the autotuned config's. FULL: every
# program's tiles lie inside the problem, each split's inner range in whole blocks too, so that
# without a group mask no tile needs a mask.
STATS_HEURISTICS = {
    "EVEN_K": even_k,
    "EVEN_GUIDE_K": even_guide_k,
    "ROUND_GUIDE": round_guide("guide_outer_ptr"),
    "LOG2": log2_units,
    "FULL": lambda args: (args["n_outer"] % args["BLOCK_M"] == 0 and args["n_inner"] % args["BLOCK_N"] == 0
                          and args["inner_per_split"] % args["BLOCK_N"] == 0),
}

# restore_value: configs with a smaller BLOCK_M write more rows of the column-partial buffer.
# Without it, rows written by a trial config and not overwritten by the chosen one would stay
# in the buffer after tuning and be merged as if they were real partials.
STATS_KERNEL = autotuned(_stats_kernel, "stats", _STATS_SHAPES, STATS_HEURISTICS,
                         restore_value=["col_partial_ptr"])

# The smallest row block of any stats config: column-partial buffers have a row per such block.
MIN_BLOCK_M = min(config.kwargs["BLOCK_M"] for config in STATS_KERNEL.tuner.configs)
# The widest inner block of any stats config: automatic splits of the inner range are whole
# multiples of it, so that every config sees whole tiles (FULL) when the problem has them.
_MAX_BLOCK_N = max(config.kwargs["BLOCK_N"] for config in STATS_KERNEL.tuner.configs)


def auto_splits(n_outer: int, n_inner: int, device: torch.device) -> int:
    """How many programs share one outer block's inner range: about eight programs per SM
    (assuming 128-wide outer blocks), so that the last, partly filled wave of programs costs
    little, while each program still streams >= 2048 inner vectors. The partial statistics cost a
    few floats per vector and split to merge."""
    outer_blocks = math.ceil(n_outer / 128)
    wanted = math.ceil(8 * sm_count(device) / outer_blocks)
    return max(1, min(wanted, n_inner // 2048))


def inner_splits(n_outer: int, n_inner: int, device: torch.device,
                 splits: int | None = None) -> tuple[int, int]:
    """(splits, inner vectors per split) of a statistics launch: ``splits`` as asked (at most one
    per inner vector), or by default :func:`auto_splits`'s count with each split's range rounded
    up to whole blocks of the widest config, so that the kernel's unmasked path (FULL) runs
    wherever the problem's blocks are whole."""
    if splits is None:
        per_split = math.ceil(n_inner / auto_splits(n_outer, n_inner, device))
        per_split = math.ceil(per_split / _MAX_BLOCK_N) * _MAX_BLOCK_N
    else:
        per_split = math.ceil(n_inner / max(1, min(splits, n_inner)))
    return math.ceil(n_inner / per_split), per_split


def logit_stats(
    outer: torch.Tensor, inner: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, *,
    sigmoid: bool, columns: bool, precision: str, splits: int | None = None, out: torch.Tensor | None = None,
    column_partials: torch.Tensor | None = None,
    # the group mask: rows' and keys' groups, rows' positives (global key indices), keys' offset
    row_groups: torch.Tensor | None = None, key_groups: torch.Tensor | None = None,
    positive_keys: torch.Tensor | None = None, key_offset: int = 0,
    # the hardness offset
    query_ids: torch.Tensor | None = None, key_owners: torch.Tensor | None = None, hardness: int = 0,
    hardness_strength: torch.Tensor | None = None,
    # the score filter, and group_positives (row_groups and key_groups: the positives' groups)
    row_thresholds: torch.Tensor | None = None, key_thresholds: torch.Tensor | None = None,
    guide_queries: torch.Tensor | None = None, guide_keys: torch.Tensor | None = None,
    group_positives: bool = False,
) -> torch.Tensor:
    """Row statistic of ``outer`` against ``inner`` (queries, keys), or with ``columns=True`` the
    column log-sum-exp (outer = keys, inner = queries). fp32 [n_outer].

    ``out`` (optional, fp32 [splits, n_outer]) receives the per-split partial statistics; the
    merged result is returned. Masks use rows/keys in the contract's sense whatever the role.

    ``column_partials`` (softmax rows only; fp32 [>= cdiv(n_outer, MIN_BLOCK_M), n_inner], filled
    with -inf by the caller) also receives, per row block of the launch, the column log-sum-exp
    of the tiles it computed: ``logsumexp(column_partials, 0)`` is then the column statistic of
    these rows, and the forward needs one pass over the tiles instead of two.

    ``hardness`` (rows outer only; 0: none, else 1-3 in ``HARDNESS_MODES`` order) offsets the
    row statistic's logits by ``hardness_strength`` (a 0-d fp32 tensor, in the units of these
    operands' dot products) times the dots where ``query_ids`` [n_outer] and ``key_owners``
    [n_inner] select (docs/contract.md, "Hardness offset"); ``positive_keys`` must be given.
    The column partials stay of the plain logits.

    The score filter (docs/contract.md, "False negatives by score"): ``row_thresholds`` [rows] (the
    row statistic's) and ``key_thresholds`` [keys] (the column statistic's and the column
    partials'), in the units of these operands' dot products, compared with the dot products or,
    given ``guide_queries`` [rows, c_g] and ``guide_keys`` [keys, c_g], the guide's; positives
    (``positive_keys``, and with ``group_positives`` every key of the row's group, whose groups are
    then ``row_groups``/``key_groups`` and mask nothing) are never left out.
    """
    n_outer, c = outer.shape
    n_inner = inner.shape[0]
    splits, inner_per_split = inner_splits(n_outer, n_inner, outer.device, splits)
    if out is None:
        out = torch.empty((splits, n_outer), dtype=torch.float32, device=outer.device)
    has_mask = row_groups is not None and not group_positives
    dummy = unused_pointer(outer.device)
    grid = lambda meta: (triton.cdiv(n_outer, meta["BLOCK_M"]), splits)  # noqa: E731
    fused = column_partials is not None
    filters = row_thresholds is not None or key_thresholds is not None
    guide_outer, guide_inner = (guide_keys, guide_queries) if columns else (guide_queries, guide_keys)
    guided = guide_outer is not None
    launch(
        STATS_KERNEL, grid, outer.device,
        outer, inner, out, column_partials if fused else dummy, scale,
        bias if bias is not None else dummy,
        row_groups if row_groups is not None else dummy, key_groups if key_groups is not None else dummy,
        *pair_pointers(has_mask or filters, hardness, positive_keys, key_offset, query_ids, key_owners,
                       hardness_strength, dummy),
        *(tensor if tensor is not None else dummy
          for tensor in (guide_outer, guide_inner, row_thresholds, key_thresholds)),
        n_outer, n_inner, c, outer.stride(0), inner.stride(0), inner_per_split,
        problem_size_class(n_outer, n_inner),
        guide_outer.shape[1] if guided else 0, guide_outer.stride(0) if guided else 0,
        guide_inner.stride(0) if guided else 0,
        HAS_BIAS=bias is not None, HAS_MASK=has_mask, COLUMNS=columns, SIGMOID=sigmoid,
        FUSED_COLUMNS=fused, PRECISION=dot_precision(outer.dtype, precision), UPCAST=INTERPRET,
        HARDNESS=hardness, FILTER=filters, GUIDE=guided, GROUP_POSITIVES=group_positives,
    )
    if splits == 1:
        return out[0]
    return merge_partials(out, log_sum_exp=not sigmoid)


_MERGE_BLOCK_PARTS = 4 if INTERPRET else 16
_MERGE_BLOCK_N = 16 if INTERPRET else 128


@triton.jit
def _merge_partials_kernel(
    partials_ptr, previous_ptr, out_ptr, n_parts, n, stride_parts,
    LOG_SUM_EXP: tl.constexpr, HAS_PREVIOUS: tl.constexpr, BLOCK_PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[j] = logsumexp over p of partials[p, j] (or the plain sum), merged with previous[j]
    (logaddexp, or +) when given. An online log-sum-exp per column: a column of -inf gives -inf,
    a NaN anywhere gives NaN."""
    columns = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = columns < n
    top = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    default = float("-inf") if LOG_SUM_EXP else 0.0  # what a part outside the range contributes
    for first in range(0, n_parts, BLOCK_PARTS):
        parts = first + tl.arange(0, BLOCK_PARTS).to(tl.int64)
        inside = (parts[:, None] < n_parts) & valid[None, :]
        block = tl.load(partials_ptr + parts[:, None] * stride_parts + columns[None, :], mask=inside,
                        other=default)
        if LOG_SUM_EXP:
            new_top = tl.maximum(top, tl.max(block, axis=0))
            # Measured from 0 while every value so far is -inf, so that no -inf - -inf appears.
            base = tl.where(new_top == float("-inf"), 0.0, new_top)
            total = total * tl.exp(top - base) + tl.sum(tl.exp(block - base[None, :]), axis=0)
            top = new_top
        else:
            total += tl.sum(block, axis=0)
    if LOG_SUM_EXP:
        result = top + tl.log(total)
        # A NaN partial must give NaN even where tl.maximum dropped it from the running top.
        result = tl.where(total != total, total, result)
    else:
        result = total
    if HAS_PREVIOUS:
        previous = tl.load(previous_ptr + columns, mask=valid, other=0.0)
        if LOG_SUM_EXP:
            high = tl.maximum(previous, result)
            low = tl.minimum(previous, result)
            merged = high + tl.log(1.0 + tl.exp(low - high))
            merged = tl.where(low == float("-inf"), high, merged)
            result = tl.where((previous != previous) | (result != result), previous + result, merged)
        else:
            result = previous + result
    tl.store(out_ptr + columns, result, mask=valid)


def merge_partials(partials: torch.Tensor, *, log_sum_exp: bool, previous: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [n]: ``logsumexp(partials, 0)`` (or ``partials.sum(0)``) of fp32 [parts, n] partial
    statistics, merged with ``previous`` [n] (``logaddexp``, or +) when given, in one launch
    instead of torch's eight or so. ``out`` may be ``previous`` itself."""
    n_parts, n = partials.shape
    if partials.stride(1) != 1:
        raise ValueError("merge_partials needs partials with unit column stride")
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=partials.device)
    if n == 0:
        return out
    launch_jit(
        _merge_partials_kernel, (triton.cdiv(n, _MERGE_BLOCK_N),),
        partials, previous if previous is not None else out, out, n_parts, n, partials.stride(0),
        LOG_SUM_EXP=log_sum_exp, HAS_PREVIOUS=previous is not None, BLOCK_PARTS=_MERGE_BLOCK_PARTS,
        BLOCK_N=_MERGE_BLOCK_N, num_warps=4,
    )
    return out
