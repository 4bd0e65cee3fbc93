"""Several positives per row without a list of pairs: their parts and gradients from ranges.

Against a key block (one process's keys, or one block of the ring) the pairs (i, j) with j in
P(i) are, for each row, the block's keys of its group (a range of the keys sorted by group) and its
own positive where that lies in the block but outside the group; for each key, the rows of its
group and the rows whose own positive it is (:class:`PairRanges`, built by
:func:`hf_infcl.ops.positive_pairs.group_ranges` with device ops only). One program per row (or
key) walks its ranges, forming each pair's logit from the two vectors, and keeps

    forward:  "any": the log-sum-exp of the logits; otherwise their sum and count
    backward: sum_j w_ij K_j added into the row's accumulator (and sum_j w_ij into its row sum),
              w_ij = a_i exp(z_ij - part_i) + b_j exp(z_ij - part'_j) for "any" (the row and
              column terms), a_i + b_j otherwise

so nothing waits on the host for the number of pairs (the pair list needs it) and no [pairs]
tensor exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..positive_pairs import PairRanges
from .device import unused_pointer

# The widest vectors one program holds in registers (its own and its running gradient).
MAX_WIDTH = 8192


@triton.jit
def _pair_logit(vector, inner_ptr, index, stride_inner, columns, valid, scale, bias, HAS_BIAS: tl.constexpr,
                LOGITS: tl.constexpr):
    other = tl.load(inner_ptr + index * stride_inner + columns, mask=valid, other=0.0).to(tl.float32)
    logit = 0.0
    if LOGITS:
        logit = scale * tl.sum(vector * other, axis=0)
        if HAS_BIAS:
            logit += bias
    return logit, other


@triton.jit
def _group_pairs_kernel(
    outer_ptr, inner_ptr, scale_ptr, bias_ptr,
    first_ptr, count_ptr, order_ptr, extra_first_ptr, extra_count_ptr, extra_order_ptr,
    part_ptr, pair_count_ptr,
    outer_part_ptr, outer_weight_ptr, inner_part_ptr, inner_weight_ptr, accumulator_ptr, row_sums_ptr,
    width, stride_outer, stride_inner, stride_accumulator, stride_outer_weight, stride_inner_weight,
    HAS_BIAS: tl.constexpr, LOG_SUM_EXP: tl.constexpr, BACKWARD: tl.constexpr, OUTER_TERMS: tl.constexpr,
    INNER_TERMS: tl.constexpr, ROW_SUMS: tl.constexpr, EXTRA_PER_OUTER: tl.constexpr, LOGITS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    outer = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_C)
    valid = columns < width
    vector = tl.load(outer_ptr + outer * stride_outer + columns, mask=valid, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr).to(tl.float32)

    first = tl.load(first_ptr + outer)
    in_range = tl.load(count_ptr + outer)
    extra_count = tl.load(extra_count_ptr + outer)
    if EXTRA_PER_OUTER:
        extra_first = outer
    else:
        extra_first = tl.load(extra_first_ptr + outer)

    outer_weight = 0.0
    outer_part = 0.0
    if BACKWARD and OUTER_TERMS:
        outer_weight = tl.load(outer_weight_ptr + outer * stride_outer_weight).to(tl.float32)
        if LOG_SUM_EXP:
            outer_part = tl.load(outer_part_ptr + outer).to(tl.float32)
    # forward: "any"'s running maximum and sum of exponentials relative to it, or the sum of logits
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], dtype=tl.float32)
    pairs = tl.zeros([], dtype=tl.float32)
    gradient = tl.zeros((BLOCK_C,), dtype=tl.float32)  # backward: sum of w_ij * inner_j
    weight_sum = tl.zeros([], dtype=tl.float32)

    for entry in range(0, in_range + extra_count):
        if entry < in_range:
            index = tl.load(order_ptr + first + entry).to(tl.int64)
        else:
            index = tl.load(extra_order_ptr + extra_first + entry - in_range).to(tl.int64)
        logit, other = _pair_logit(vector, inner_ptr, index, stride_inner, columns, valid, scale, bias,
                                   HAS_BIAS, LOGITS)
        if BACKWARD:
            weight = 0.0
            if LOG_SUM_EXP:
                if OUTER_TERMS:
                    weight += outer_weight * tl.exp(logit - outer_part)
                if INNER_TERMS:
                    inner_weight = tl.load(inner_weight_ptr + index * stride_inner_weight).to(tl.float32)
                    weight += inner_weight * tl.exp(logit - tl.load(inner_part_ptr + index).to(tl.float32))
            else:
                weight = outer_weight
                if INNER_TERMS:
                    weight += tl.load(inner_weight_ptr + index * stride_inner_weight).to(tl.float32)
            gradient += weight * other
            weight_sum += weight
        elif LOG_SUM_EXP:
            new_max = tl.maximum(running_max, logit)
            # exp(-inf - new_max) = 0 at the first entry (new_max finite)
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(logit - new_max)
            running_max = new_max
        else:
            running_sum += logit
            pairs += 1.0

    if BACKWARD:
        target = accumulator_ptr + outer * stride_accumulator + columns
        tl.store(target, tl.load(target, mask=valid, other=0.0) + gradient, mask=valid)
        if ROW_SUMS:
            tl.store(row_sums_ptr + outer, tl.load(row_sums_ptr + outer) + weight_sum)
    elif LOG_SUM_EXP:
        shift = tl.where(running_max == float("-inf"), 0.0, running_max)
        tl.store(part_ptr + outer, shift + tl.log(running_sum))  # no pair: log(0) = -inf
    else:
        tl.store(part_ptr + outer, running_sum)
        tl.store(pair_count_ptr + outer, pairs)


def _launch(outer, inner, scale, bias, ranges: PairRanges, *, log_sum_exp: bool, backward: bool,
            part=None, pair_count=None, outer_part=None, outer_weight=None, inner_part=None,
            inner_weight=None, accumulator=None, row_sums=None) -> None:
    n_outer, width = outer.shape
    if n_outer == 0:
        return
    if width > MAX_WIDTH:
        raise ValueError(f"group_pairs: vectors of width {width} exceed {MAX_WIDTH}")
    dummy = unused_pointer(outer.device)

    def pointer(tensor):
        return dummy if tensor is None else tensor

    def stride(tensor):
        return 0 if tensor is None else tensor.stride(0)

    block = triton.next_power_of_2(width)
    _group_pairs_kernel[(n_outer,)](
        outer, inner, scale, pointer(bias), ranges.first, ranges.count, ranges.order,
        pointer(ranges.extra_first), ranges.extra_count, ranges.extra_order,
        pointer(part), pointer(pair_count), pointer(outer_part), pointer(outer_weight), pointer(inner_part),
        pointer(inner_weight), pointer(accumulator), pointer(row_sums),
        width, outer.stride(0), inner.stride(0), stride(accumulator), stride(outer_weight),
        stride(inner_weight),
        HAS_BIAS=bias is not None, LOG_SUM_EXP=log_sum_exp, BACKWARD=backward,
        OUTER_TERMS=outer_weight is not None, INNER_TERMS=inner_weight is not None,
        ROW_SUMS=row_sums is not None, EXTRA_PER_OUTER=ranges.extra_first is None,
        LOGITS=log_sum_exp or not backward,  # the backward needs them only for "any"'s probabilities
        BLOCK_C=block,
        num_warps=_warps(block),
    )


def _warps(block: int) -> int:
    """Warps per program for vectors of ``block`` entries (a power of two): one up to 1024, whose
    dot products then reduce within a warp (fastest at c = 512 and 768, of 1 to 8 warps)."""
    return max(1, min(8, block // 1024))


def group_pair_parts(outer: torch.Tensor, inner: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     ranges: PairRanges, *, log_sum_exp: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each outer vector's positive part over its pairs, fp32 [n_outer]: the log-sum-exp of the
    logits s <outer, inner> + b (``log_sum_exp``), else their sum, with the pair counts."""
    part = torch.empty(outer.shape[0], dtype=torch.float32, device=outer.device)
    pair_count = None if log_sum_exp else torch.empty_like(part)
    _launch(outer, inner, scale, bias, ranges, log_sum_exp=log_sum_exp, backward=False, part=part,
            pair_count=pair_count)
    return part, pair_count


def add_group_pair_gradients(outer: torch.Tensor, inner: torch.Tensor, scale: torch.Tensor,
                             bias: torch.Tensor | None, ranges: PairRanges, accumulator: torch.Tensor, *,
                             log_sum_exp: bool, outer_part=None, outer_weight=None, inner_part=None,
                             inner_weight=None, row_sums: torch.Tensor | None = None) -> None:
    """Adds sum_j w_oj inner_j into ``accumulator[o]`` (fp32 [n_outer, width], in place) and, with
    ``row_sums``, sum_j w_oj into ``row_sums[o]``: w_oj = outer_weight_o exp(z_oj - outer_part_o)
    + inner_weight_j exp(z_oj - inner_part_j) (``log_sum_exp``), else outer_weight_o +
    inner_weight_j; either side's terms left out where its weight is None."""
    _launch(outer, inner, scale, bias, ranges, log_sum_exp=log_sum_exp, backward=True,
            outer_part=outer_part, outer_weight=outer_weight, inner_part=inner_part,
            inner_weight=inner_weight, accumulator=accumulator, row_sums=row_sums)
