"""The backward's gradient-tile kernel and its launcher.

One program per tile of a super-tile of R rows x C keys. It recomputes the logits of its tile
once, forms both directions' probabilities in one expression G = w_r * exp(z - r) + w_c *
exp(z - c) (or w_r * sigmoid(z)), masks them, adds the tile's row sums of G (for d bias) and
writes G (divided by a GPU-resident scale when the caller scales it) to a bounded scratch buffer
of R x C entries in the dtype of the GEMMs that follow (docs/algorithms.md says why G goes
through that buffer). It reads its query and key tiles through TMA tensor descriptors where the
GPU has them.

With the score filter, a tile applies the filter's masks only where one of its scores lies above
the lowest of its thresholds (:func:`.jit_math.may_leave_out`): in a batch of a trained model, the
near-copies and the positives' own tiles; the other tiles run the unmasked epilogue, whose
registers the masks would otherwise crowd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .device import INTERPRET, pair_pointers, tensor_descriptor, unused_pointer
from .jit_math import (
    allowed_pairs,
    at_most_zero,
    dot_precision,
    dot_tile,
    dropped_by_thresholds,
    even_guide_k,
    even_k,
    exp_in_units,
    hardness_offset_logits,
    in_units,
    log2_units,
    may_leave_out,
    not_positive,
    round_guide,
    scale_and_bias,
    scaled_logits,
    sigmoid_and_softplus,
)
from .launch import BASE_SHAPES, autotuned, launch, problem_size_class

# Autotuning candidates beyond the base shapes: taller and wider tiles, and narrow row blocks
# (fewer registers per thread for the sigmoid loss's one-pass epilogue).
_GRAD_SHAPES = [*BASE_SHAPES, (256, 128, 64, 8, 3), (128, 256, 128, 8, 2), (64, 128, 32, 4, 5),
                (64, 256, 64, 8, 3)]


@triton.jit
def _g_terms(dots, scale, bias, scores, row_index, key_index, row_valid, key_valid, row_stat, col_stat,
             row_weight, col_weight, row_group_ptr, key_group_ptr, positive_ptr, key_offset, query_id_ptr,
             key_owner_ptr, hardness_ptr, row_thresholds, key_thresholds,
             COLUMNS: tl.constexpr, SIGMOID: tl.constexpr, ONE_PASS: tl.constexpr, HARDNESS: tl.constexpr,
             FILTER: tl.constexpr, GROUP_POSITIVES: tl.constexpr, CLAMP: tl.constexpr, HAS_BIAS: tl.constexpr,
             LOG2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(G, the one-pass sigmoid route's softplus terms) of a tile before the group mask: each
    direction's probabilities times its weights (the sigmoid loss's sigmoid), and with FILTER each
    term only where its own threshold keeps the entry of ``scores``. Without ONE_PASS the second
    value is G again. The statistics, weights and thresholds come loaded (:func:`_epilogue_vectors`).
    The logits are made here, from the ``dots``: not made before a caller's branch, they need not be
    held beside the dots across it."""
    if FILTER:
        candidates = not_positive(row_index, key_index, row_valid, key_valid, tl.program_id(0) * BLOCK_M,
                                  tl.program_id(1) * BLOCK_N, positive_ptr, key_offset, row_group_ptr,
                                  key_group_ptr, False, GROUP_POSITIVES, BLOCK_M, BLOCK_N)
        row_dropped = dropped_by_thresholds(scores, candidates, row_thresholds, True)
    logits = scaled_logits(dots, scale, bias, HAS_BIAS)
    if ONE_PASS:
        # The sigmoid loss's one pass: unit row weights, and the softplus row sums (the row
        # statistic) from the same logits and the same exponential.
        grad, softplus_terms = sigmoid_and_softplus(logits)
        if FILTER:
            softplus_terms = tl.where(row_dropped, 0.0, softplus_terms)
            grad = tl.where(row_dropped, 0.0, grad)
        return grad, softplus_terms
    elif SIGMOID:
        grad = row_weight[:, None] * tl.sigmoid(logits)
        if FILTER:
            grad = tl.where(row_dropped, 0.0, grad)
    else:
        if HARDNESS != 0:
            strength = in_units(tl.load(hardness_ptr).to(tl.float32), LOG2)
            row_logits = hardness_offset_logits(logits, dots, row_index, key_index, row_valid, key_valid,
                                                query_id_ptr, key_owner_ptr, positive_ptr, key_offset,
                                                strength, row_group_ptr, key_group_ptr, HARDNESS,
                                                GROUP_POSITIVES)
        else:
            row_logits = logits
        row_exponent = row_logits - in_units(row_stat, LOG2)[:, None]
        if CLAMP:  # the score filter's left-out entries, unmasked here (.left_out says why)
            row_exponent = at_most_zero(row_exponent)
        p_row = exp_in_units(row_exponent, LOG2)
        grad = row_weight[:, None] * p_row
        if FILTER:  # where(), not a product: a left-out entry may hold 0 * inf = nan
            grad = tl.where(row_dropped, 0.0, grad)
        if COLUMNS:
            # Their own exponential (docs/algorithms.md). Where col_stat is -inf (a key no row may
            # pair with), p_col is inf and col_weight 0: the where() below drops it.
            col_exponent = logits - in_units(col_stat, LOG2)[None, :]
            if CLAMP:
                col_exponent = at_most_zero(col_exponent)
            p_col = exp_in_units(col_exponent, LOG2)
            if FILTER:
                column_dropped = dropped_by_thresholds(scores, candidates, key_thresholds, False)
                grad += tl.where(column_dropped, 0.0, col_weight[None, :] * p_col)
            else:
                grad += col_weight[None, :] * p_col
    return grad, grad


@triton.jit
def _epilogue_vectors(row_index, key_index, row_valid, key_valid, row_stat_ptr, col_stat_ptr, row_weight_ptr,
                      col_weight_ptr, row_threshold_ptr, key_threshold_ptr, COLUMNS: tl.constexpr,
                      SIGMOID: tl.constexpr, ONE_PASS: tl.constexpr, FILTER: tl.constexpr):
    """(row_stat, col_stat, row_weight, col_weight, row_thresholds, key_thresholds) of a tile, 0.0
    for those the options do not read (thresholds +inf past the ends). Loaded before the K-loop, so
    that their trip to memory overlaps it instead of stalling the epilogue."""
    row_stat, col_stat, row_weight, col_weight = 0.0, 0.0, 0.0, 0.0
    row_thresholds, key_thresholds = 0.0, 0.0
    if not ONE_PASS:
        row_weight = tl.load(row_weight_ptr + row_index, mask=row_valid, other=0.0)
        if not SIGMOID:
            row_stat = tl.load(row_stat_ptr + row_index, mask=row_valid, other=0.0)
            if COLUMNS:
                col_stat = tl.load(col_stat_ptr + key_index, mask=key_valid, other=0.0)
                col_weight = tl.load(col_weight_ptr + key_index, mask=key_valid, other=0.0)
    if FILTER:
        row_thresholds = tl.load(row_threshold_ptr + row_index, mask=row_valid, other=float("inf"))
        if COLUMNS:
            key_thresholds = tl.load(key_threshold_ptr + key_index, mask=key_valid, other=float("inf"))
    return row_stat, col_stat, row_weight, col_weight, row_thresholds, key_thresholds


@triton.jit
def _grad_tile_kernel(
    q_ptr, k_ptr, q_desc, k_desc, g_ptr, row_sums_ptr, softplus_sums_ptr, scale_ptr, bias_ptr,
    inv_g_scale_ptr, row_stat_ptr, col_stat_ptr, row_weight_ptr, col_weight_ptr,
    row_group_ptr, key_group_ptr, positive_ptr, key_offset, query_id_ptr, key_owner_ptr, hardness_ptr,
    guide_q_ptr, guide_k_ptr, row_threshold_ptr, key_threshold_ptr,
    n_rows, n_keys, c, stride_q, stride_k, stride_g, size_class, c_guide, stride_guide_q, stride_guide_k,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COLUMNS: tl.constexpr, SIGMOID: tl.constexpr,
    ONE_PASS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, HARDNESS: tl.constexpr,
    FILTER: tl.constexpr, GUIDE: tl.constexpr, GROUP_POSITIVES: tl.constexpr, CLAMP: tl.constexpr,
    SCALED_G: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_GUIDE_K: tl.constexpr, ROUND_GUIDE: tl.constexpr, FULL: tl.constexpr, LOG2: tl.constexpr,
):
    row_index = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    key_index = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_valid = row_index < n_rows
    key_valid = key_index < n_keys

    scale, bias = scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, LOG2)
    row_stat, col_stat, row_weight, col_weight, row_thresholds, key_thresholds = _epilogue_vectors(
        row_index, key_index, row_valid, key_valid, row_stat_ptr, col_stat_ptr, row_weight_ptr,
        col_weight_ptr, row_threshold_ptr, key_threshold_ptr, COLUMNS, SIGMOID, ONE_PASS, FILTER)
    dots = dot_tile(q_ptr, k_ptr, q_desc, k_desc, row_index, key_index, row_valid, key_valid,
                    tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, c, stride_q, stride_k,
                    BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST, EVEN_K, TMA)

    # Full blocks (FULL) without a group mask allow every pair: no mask tile at all.
    if HAS_MASK or not FULL:
        allowed = allowed_pairs(row_index, key_index, row_valid, key_valid, row_group_ptr, key_group_ptr,
                                positive_ptr, key_offset, HAS_MASK)
    scores = dots
    # The filter's masks are compiled only with FILTER (a branch on a Python bool set before it is
    # not static under every Triton), and taken only by the tiles that may leave an entry out.
    if FILTER:
        if GUIDE:
            scores = dot_tile(guide_q_ptr, guide_k_ptr, None, None, row_index, key_index, row_valid,
                              key_valid, 0, 0, c_guide, stride_guide_q, stride_guide_k, BLOCK_M, BLOCK_N,
                              BLOCK_K, PRECISION, UPCAST, EVEN_GUIDE_K, False, ROUND_GUIDE)
        # Most tiles hold no score above any of their thresholds: those skip the filter's masks.
        if may_leave_out(scores, row_thresholds, key_thresholds, row_valid, key_valid, COLUMNS, FULL):
            grad, softplus_terms = _g_terms(
                dots, scale, bias, scores, row_index, key_index, row_valid, key_valid, row_stat, col_stat,
                row_weight, col_weight, row_group_ptr, key_group_ptr, positive_ptr, key_offset, query_id_ptr,
                key_owner_ptr, hardness_ptr, row_thresholds, key_thresholds, COLUMNS, SIGMOID, ONE_PASS,
                HARDNESS, True, GROUP_POSITIVES, CLAMP, HAS_BIAS, LOG2, BLOCK_M, BLOCK_N)
        else:
            grad, softplus_terms = _g_terms(
                dots, scale, bias, scores, row_index, key_index, row_valid, key_valid, row_stat, col_stat,
                row_weight, col_weight, row_group_ptr, key_group_ptr, positive_ptr, key_offset, query_id_ptr,
                key_owner_ptr, hardness_ptr, row_thresholds, key_thresholds, COLUMNS, SIGMOID, ONE_PASS,
                HARDNESS, False, GROUP_POSITIVES, CLAMP, HAS_BIAS, LOG2, BLOCK_M, BLOCK_N)
    else:
        grad, softplus_terms = _g_terms(
            dots, scale, bias, scores, row_index, key_index, row_valid, key_valid, row_stat, col_stat,
            row_weight, col_weight, row_group_ptr, key_group_ptr, positive_ptr, key_offset, query_id_ptr,
            key_owner_ptr, hardness_ptr, row_thresholds, key_thresholds, COLUMNS, SIGMOID, ONE_PASS,
            HARDNESS, False, GROUP_POSITIVES, CLAMP, HAS_BIAS, LOG2, BLOCK_M, BLOCK_N)
    if ONE_PASS:
        if HAS_MASK or not FULL:
            softplus_terms = tl.where(allowed, softplus_terms, 0.0)
        tl.atomic_add(softplus_sums_ptr + row_index, tl.sum(softplus_terms, axis=1), mask=row_valid)
    if HAS_MASK or not FULL:
        # where(), not a product: a masked entry may hold 0 * inf = nan.
        grad = tl.where(allowed, grad, 0.0)

    tl.atomic_add(row_sums_ptr + row_index, tl.sum(grad, axis=1), mask=row_valid)
    if SCALED_G:
        grad = grad * tl.load(inv_g_scale_ptr)
    g_tile = g_ptr + row_index[:, None] * stride_g + key_index[None, :]
    if FULL:
        tl.store(g_tile, grad.to(g_ptr.dtype.element_ty))
    else:
        tl.store(g_tile, grad.to(g_ptr.dtype.element_ty), mask=row_valid[:, None] & key_valid[None, :])


# The block size that gives the rows of each tensor-descriptor argument's blocks (the columns:
# BLOCK_K). A host-side descriptor carries its block shape, which must be the config's.
_DESCRIPTOR_ROWS = {"q_desc": "BLOCK_M", "k_desc": "BLOCK_N"}


def _set_descriptor_blocks(nargs: dict) -> None:
    """Every config's pre-hook: the launch's tensor descriptors take the config's block shapes."""
    for name, rows in _DESCRIPTOR_ROWS.items():
        descriptor = nargs.get(name)
        if isinstance(descriptor, TensorDescriptor):
            descriptor.block_shape = [nargs[rows], nargs["BLOCK_K"]]


GRAD_HEURISTICS = {
    "EVEN_K": even_k,
    "EVEN_GUIDE_K": even_guide_k,
    "ROUND_GUIDE": round_guide("guide_q_ptr"),
    "LOG2": log2_units,
    "FULL": lambda args: args["n_rows"] % args["BLOCK_M"] == 0 and args["n_keys"] % args["BLOCK_N"] == 0,
}

GRAD_TILE_KERNEL = autotuned(_grad_tile_kernel, "grad_tile", _GRAD_SHAPES, GRAD_HEURISTICS,
                             pre_hook=_set_descriptor_blocks,
                             reset_to_zero=["row_sums_ptr", "softplus_sums_ptr"])


def grad_tile(
    queries: torch.Tensor, keys: torch.Tensor, g_out: torch.Tensor, row_sums: torch.Tensor,
    scale: torch.Tensor, bias: torch.Tensor | None, inv_g_scale: torch.Tensor | None,
    row_stat: torch.Tensor, col_stat: torch.Tensor | None, row_weight: torch.Tensor,
    col_weight: torch.Tensor | None, *, sigmoid: bool, precision: str, size_class: int | None = None,
    softplus_sums: torch.Tensor | None = None,
    # the group mask and the hardness offset (as .stats.logit_stats takes them)
    row_groups: torch.Tensor | None = None, key_groups: torch.Tensor | None = None,
    positive_keys: torch.Tensor | None = None, key_offset: int = 0, query_ids: torch.Tensor | None = None,
    key_owners: torch.Tensor | None = None, hardness: int = 0, hardness_strength: torch.Tensor | None = None,
    # the score filter and group_positives (as .stats.logit_stats takes them)
    row_thresholds: torch.Tensor | None = None, key_thresholds: torch.Tensor | None = None,
    guide_queries: torch.Tensor | None = None, guide_keys: torch.Tensor | None = None,
    group_positives: bool = False, clamp_exponents: bool = False,
    config: triton.Config | None = None, descriptors: tuple | None = None,
) -> triton.Config:
    """Write G / g_scale of ``queries`` x ``keys`` into ``g_out`` [rows, keys] (a view whose last
    stride is 1; ``inv_g_scale`` 0-d, or None for 1) and add the row sums of G into ``row_sums``
    [rows] (fp32, atomically). Returns the kernel configuration it ran.

    ``softplus_sums`` (sigmoid only; fp32 [rows]): the one-pass route. G is sigmoid(z) with
    every row weight 1 (``row_weight`` is not read), and the tile's softplus row sums (the
    sigmoid row statistic) are added into it, atomically.

    ``size_class`` (default: from this tile's shape) is part of the autotuning key. Tuning zeroes
    ``row_sums`` before each trial, so callers that launch several tiles into one buffer pass the
    class of the whole problem: then only their first launch can trigger tuning.

    ``hardness``, ``hardness_strength``, ``query_ids``, ``key_owners``: the row probabilities are
    of the offset logits, as in :func:`.stats.logit_stats`; the column ones are not.

    ``row_thresholds``, ``key_thresholds`` (with a column statistic), ``guide_queries``,
    ``guide_keys``, ``group_positives``: the score filter, as in :func:`.stats.logit_stats`: each
    direction's term of G is zero where its own threshold leaves the entry out.

    ``clamp_exponents`` (softmax, without the filter's masks): each exponent z - stat is clamped at
    0, so that the terms of entries a filter left out are bounded, for :mod:`.left_out` to take
    back; a kept entry's exponent is never above 0.

    ``config``: what an earlier call returned, for a call with the same tuning key (the same
    ``size_class``, width and dtypes, the same options): launched past the autotuner
    (:func:`.launch.launch`).

    ``descriptors``: (:func:`.device.tensor_descriptor` of ``queries``, of ``keys``), made once by
    a caller that launches many tiles over the same row panels and key tiles; by default made here.
    """
    n_rows, c = queries.shape
    n_keys = keys.shape[0]
    has_mask = row_groups is not None and not group_positives
    columns = col_stat is not None
    filters = row_thresholds is not None
    guided = guide_queries is not None
    dummy = unused_pointer(queries.device)
    grid = lambda meta: (triton.cdiv(n_rows, meta["BLOCK_M"]), triton.cdiv(n_keys, meta["BLOCK_N"]))  # noqa: E731
    one_pass = softplus_sums is not None
    if one_pass and not sigmoid:
        raise ValueError("softplus_sums is for the sigmoid loss")
    if descriptors is None:
        descriptors = tensor_descriptor(queries), tensor_descriptor(keys)
    # Both operands through descriptors, or both through pointers.
    tma = None not in descriptors
    q_desc, k_desc = descriptors if tma else (queries, keys)
    return launch(
        GRAD_TILE_KERNEL, grid, queries.device,
        queries, keys, q_desc, k_desc, g_out, row_sums, softplus_sums if one_pass else dummy, scale,
        bias if bias is not None else dummy, inv_g_scale if inv_g_scale is not None else dummy,
        row_stat, col_stat if columns else dummy, row_weight, col_weight if columns else dummy,
        row_groups if row_groups is not None else dummy, key_groups if key_groups is not None else dummy,
        *pair_pointers(has_mask or filters, hardness, positive_keys, key_offset, query_ids, key_owners,
                       hardness_strength, dummy),
        *(tensor if tensor is not None else dummy
          for tensor in (guide_queries, guide_keys, row_thresholds, key_thresholds if columns else None)),
        n_rows, n_keys, c, queries.stride(0), keys.stride(0), g_out.stride(0),
        size_class if size_class is not None else problem_size_class(n_rows, n_keys),
        guide_queries.shape[1] if guided else 0, guide_queries.stride(0) if guided else 0,
        guide_keys.stride(0) if guided else 0,
        HAS_BIAS=bias is not None, HAS_MASK=has_mask, COLUMNS=columns, SIGMOID=sigmoid, ONE_PASS=one_pass,
        PRECISION=dot_precision(queries.dtype, precision), UPCAST=INTERPRET, HARDNESS=hardness,
        FILTER=filters, GUIDE=guided, GROUP_POSITIVES=group_positives, CLAMP=clamp_exponents,
        SCALED_G=inv_g_scale is not None, TMA=tma, config=config,
    )
