"""Matryoshka in one pass on the Triton route: the kernels of :class:`TritonBlocks`'
``prefix_forward_block`` / ``prefix_backward_block`` and their launchers (the algebra, and the
names P^t, a^t, b^t, G^t: :mod:`hf_infcl.ops.matryoshka`).

Both kernels walk each tile's width once, from column 0: the running dot products are the raw
prefix product P^t wherever a prefix ends (the prefixes are nested, the innermost first), and there
term t takes them, in the middle of the walk. Where every prefix ends on a step of the walk (the
dims multiples of BLOCK_K) it is one pipelined loop with a branch at each step; elsewhere one
loop per segment between consecutive dims, with masked loads.

``prefix_stats``: one program owns a block of "outer" vectors (rows, or keys for the column
statistic) and streams the "inner" ones past it, as the plain statistics kernel does; term t
takes the logits z^t = s P^t a^t_i b^t_j (+ b) into its own online log-sum-exp (softmax) or
softplus sum (sigmoid). One product of the widest prefix per tile gives every term's statistics.

``PrefixRoute``: the backward's super-tile route (:mod:`.super_tiles`). Its kernel forms each
term's G^t from the forward's statistics where the term's prefix ends, adds its row and key
sums and writes Ĝ^t = G^t a^t b^t as G buffer t; the walk then adds Ĝ^t K[:, :d_t] and
Ĝ^tᵀ Q[:, :d_t], one pair of GEMMs per term. (The segments' form of
:mod:`hf_infcl.ops.matryoshka`, H_u = sum_{t <= u} Ĝ^t times segment u alone, needs the terms
from the widest down, while the walk meets them from the innermost out; its GEMMs multiply less
but are narrow, and cuBLAS runs the prefixes' wider ones faster.)

The route is opt-in (``TritonBlocks(matryoshka_one_pass=True)``): it saves D - 1 products of the
tiles but none of the D epilogues, which do more than a plain one's, and it measures slower than
one loss call per width (benchmarks/README.md).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..matryoshka import PrefixSpec, PrefixSums
from .device import INTERPRET, unused_pointer
from .jit_math import (
    LN2,
    allowed_pairs,
    column_lse,
    dot_precision,
    exp_in_units,
    in_units,
    log2_units,
    log_in_units,
    outer_block_and_inner_range,
    scale_and_bias,
    scaled_logits,
    softplus,
)
from .launch import autotuned, launch, problem_size_class
from .operands import HALF_TYPES, TINY
from .stats import inner_splits, merge_partials
from .super_tiles import Labels

# Autotuning candidates: base shapes of K steps 64 and 32 (each candidate compiles the loop over
# the width twice, so the list is kept short for the first call).
_PREFIX_SHAPES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
                  (128, 128, 32, 8, 4)]


@triton.jit
def _add_step_dots(acc, a_rows, b_rows, cols, in_width, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    """``acc`` + the dot products of columns ``cols`` (one step of the walk) of the rows at
    ``a_rows`` and ``b_rows`` (pointers to each row's first column), fp32; MASKED: only the
    columns where ``in_width`` holds."""
    if MASKED:
        a = tl.load(a_rows + cols[None, :], mask=in_width[None, :], other=0.0)
        b = tl.load(b_rows + cols[None, :], mask=in_width[None, :], other=0.0)
    else:
        a = tl.load(a_rows + cols[None, :])
        b = tl.load(b_rows + cols[None, :])
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)


@triton.jit
def _add_segment_dots(acc, a_rows, b_rows, start, end, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr):
    """``acc`` + the dot products of columns ``start:end`` of the rows at ``a_rows`` and ``b_rows``,
    with masked loads (any bounds)."""
    width = tl.arange(0, BLOCK_K)
    for c0 in range(start, end, BLOCK_K):
        cols = c0 + width
        acc = _add_step_dots(acc, a_rows, b_rows, cols, cols < end, True, PRECISION, UPCAST)
    return acc


@triton.jit
def _term_statistics(dots, term, term_columns, running_max, running_sum, a, b, scale, bias, allowed,
                     column_partials, inner_index, inner_valid, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr,
                     SIGMOID: tl.constexpr, FUSED_COLUMNS: tl.constexpr, FULL: tl.constexpr,
                     LOG2: tl.constexpr):
    """The running statistics of every term, [BLOCK_M, TERMS_P2] (column t term t's; a list of
    tensors cannot be indexed in a kernel), with term ``term``'s updated by one tile of its raw
    prefix products ``dots``; ``a``, ``b``: the term's inverse norms of the tile's outer and inner
    vectors; ``allowed`` (MASKED): the tile's mask. FUSED_COLUMNS: the tile's column log-sum-exp
    over its rows is stored at ``column_partials`` (this row block's and term's row of partials)
    for the inner vectors ``inner_index``, in natural units."""
    logits = scaled_logits(dots * a[:, None] * b[None, :], scale, bias, HAS_BIAS)
    selected = term_columns == term
    if SIGMOID:
        terms = softplus(logits)
        if MASKED:
            terms = tl.where(allowed, terms, 0.0)
        running_sum += tl.where(selected, tl.sum(terms, axis=1)[:, None], 0.0)
    else:
        if MASKED:
            logits = tl.where(allowed, logits, float("-inf"))
        # As the plain statistics kernel: the tile shifted by its own row maxima, 0 for a row with
        # nothing allowed, exp(-inf - shift) = 0 for what is not.
        tile_max = tl.max(logits, axis=1)
        tile_shift = tl.where(tile_max == float("-inf"), 0.0, tile_max)
        tile_sum = tl.sum(exp_in_units(logits - tile_shift[:, None], LOG2), axis=1)
        old_max = tl.max(tl.where(selected, running_max, float("-inf")), axis=1)
        old_sum = tl.sum(tl.where(selected, running_sum, 0.0), axis=1)
        new_max = tl.maximum(old_max, tile_max)
        new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        new_sum = (old_sum * exp_in_units(old_max - new_shift, LOG2)
                   + tile_sum * exp_in_units(tile_max - new_shift, LOG2))
        running_max = tl.where(selected, new_max[:, None], running_max)
        running_sum = tl.where(selected, new_sum[:, None], running_sum)
        if FUSED_COLUMNS:
            col_lse = column_lse(logits, LOG2)
            if LOG2:
                col_lse *= LN2
            if FULL:
                tl.store(column_partials + inner_index, col_lse)
            else:
                tl.store(column_partials + inner_index, col_lse, mask=inner_valid)
    return running_max, running_sum


@triton.jit
def _prefix_stats_kernel(
    outer_ptr, inner_ptr, outer_norm_ptr, inner_norm_ptr, bounds_ptr, out_ptr, col_partial_ptr, scale_ptr,
    bias_ptr,
    row_group_ptr, key_group_ptr, positive_ptr, key_offset,
    n_outer, n_inner, c, stride_outer, stride_inner, inner_per_split, dims_gcd, size_class,
    TERMS: tl.constexpr, TERMS_P2: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    COLUMNS: tl.constexpr, SIGMOID: tl.constexpr, FUSED_COLUMNS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_SEGMENTS: tl.constexpr, FULL: tl.constexpr, LOG2: tl.constexpr,
):
    pid, outer_index, outer_valid, inner_start, inner_end = outer_block_and_inner_range(
        n_outer, n_inner, inner_per_split, BLOCK_M)
    scale, bias = scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, LOG2)
    term_columns = tl.arange(0, TERMS_P2)[None, :]
    running_max = tl.full((BLOCK_M, TERMS_P2), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M, TERMS_P2), dtype=tl.float32)
    # Rows past the end read row 0 (no load masks); their results are never stored.
    outer_rows = outer_ptr + tl.where(outer_valid, outer_index, 0)[:, None] * stride_outer
    width = tl.arange(0, BLOCK_K)
    # this row block's partials of the column statistic, [TERMS, n_inner] (FUSED_COLUMNS)
    column_partials = col_partial_ptr + pid * TERMS * n_inner
    for n0 in range(inner_start, inner_end, BLOCK_N):
        inner_index = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        inner_valid = inner_index < inner_end
        inner_rows = inner_ptr + tl.where(inner_valid, inner_index, 0)[:, None] * stride_inner
        if HAS_MASK or not FULL:
            if COLUMNS:  # the tile is (keys, rows): the mask built in (rows, keys) order
                allowed = tl.trans(allowed_pairs(inner_index, outer_index, inner_valid, outer_valid,
                                                 row_group_ptr, key_group_ptr, positive_ptr, key_offset,
                                                 HAS_MASK))
            else:
                allowed = allowed_pairs(outer_index, inner_index, outer_valid, inner_valid, row_group_ptr,
                                        key_group_ptr, positive_ptr, key_offset, HAS_MASK)
        else:
            allowed = 0  # never read
        dots = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EVEN_SEGMENTS:
            # One pipelined loop along the width from column 0 (the innermost prefix first); where
            # a step ends a prefix, its term takes the running products.
            term = TERMS - 1 + tl.zeros((), dtype=tl.int32)
            bound = tl.load(bounds_ptr + term)
            for c0 in range(0, c, BLOCK_K):
                cols = c0 + width
                dots = _add_step_dots(dots, outer_rows, inner_rows, cols, cols, False, PRECISION, UPCAST)
                if c0 + BLOCK_K == bound:
                    running_max, running_sum = _term_statistics(
                        dots, term, term_columns, running_max, running_sum,
                        tl.load(outer_norm_ptr + term * n_outer + outer_index, mask=outer_valid, other=0.0),
                        tl.load(inner_norm_ptr + term * n_inner + inner_index, mask=inner_valid, other=0.0),
                        scale, bias, allowed, column_partials + term * n_inner, inner_index, inner_valid,
                        HAS_BIAS, HAS_MASK or not FULL, SIGMOID, FUSED_COLUMNS, FULL, LOG2)
                    term -= 1
                    bound = tl.load(bounds_ptr + tl.maximum(term, 0))
        else:
            # Prefix ends inside a step: one loop per segment, from the innermost, masked loads.
            for step in tl.static_range(TERMS):
                t = TERMS - 1 - step
                dots = _add_segment_dots(dots, outer_rows, inner_rows, tl.load(bounds_ptr + t + 1),
                                         tl.load(bounds_ptr + t), BLOCK_K, PRECISION, UPCAST)
                running_max, running_sum = _term_statistics(
                    dots, t, term_columns, running_max, running_sum,
                    tl.load(outer_norm_ptr + t * n_outer + outer_index, mask=outer_valid, other=0.0),
                    tl.load(inner_norm_ptr + t * n_inner + inner_index, mask=inner_valid, other=0.0),
                    scale, bias, allowed, column_partials + t * n_inner, inner_index, inner_valid, HAS_BIAS,
                    HAS_MASK or not FULL, SIGMOID, FUSED_COLUMNS, FULL, LOG2)

    if SIGMOID:
        result = running_sum
    else:
        shift = tl.where(running_max == float("-inf"), 0.0, running_max)
        result = shift + log_in_units(running_sum, LOG2)  # -inf for a row that saw nothing allowed
        if LOG2:
            result *= LN2  # the statistics leave in natural units
    out = (out_ptr + tl.program_id(1).to(tl.int64) * TERMS * n_outer + term_columns * n_outer
           + outer_index[:, None])
    tl.store(out, result, mask=outer_valid[:, None] & (term_columns < TERMS))


def _even_segments(args: dict) -> bool:
    """EVEN_SEGMENTS: the step along the width divides every prefix width, so that no load needs
    a mask."""
    return args["dims_gcd"] % args["BLOCK_K"] == 0


# restore_value: configs with a smaller BLOCK_M write more row blocks of the column partials (as the
# plain statistics kernel's).
PREFIX_STATS_KERNEL = autotuned(_prefix_stats_kernel, "prefix_stats", _PREFIX_SHAPES, {
    "EVEN_SEGMENTS": _even_segments,
    "LOG2": log2_units,
    "FULL": lambda args: (args["n_outer"] % args["BLOCK_M"] == 0 and args["n_inner"] % args["BLOCK_N"] == 0
                          and args["inner_per_split"] % args["BLOCK_N"] == 0),
}, restore_value=["col_partial_ptr"])
# The smallest row block of any config: column-partial buffers have a row per such block.
MIN_BLOCK_M = min(config.kwargs["BLOCK_M"] for config in PREFIX_STATS_KERNEL.tuner.configs)


@functools.cache
def segment_bounds(dims: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [D + 1]: the dims, then 0 (segment u is columns bounds[u + 1]:bounds[u]); made once
    per process (a copy from the host's memory waits for the GPU's queue)."""
    return torch.tensor((*dims, 0), dtype=torch.int32, device=device)


def prefix_stats(outer: torch.Tensor, inner: torch.Tensor, outer_norms: torch.Tensor,
                 inner_norms: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dims: tuple[int, ...], *, sigmoid: bool, columns: bool, precision: str,
                 splits: int | None = None, mask: dict | None = None,
                 column_partials: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [D, n_outer]: every Matryoshka term's statistic of each ``outer`` vector over every
    ``inner`` one, the log-sum-exp (softmax) or the softplus sum (sigmoid) of z^t = scale P^t a^t_i
    b^t_j (+ bias); ``outer_norms`` [D, n_outer] and ``inner_norms`` [D, n_inner] are the fp32
    inverse prefix norms, ``dims`` the prefix widths (descending). With ``columns`` the outer
    vectors are the keys (the column statistic). ``mask``: the group mask's launcher arguments
    (:func:`.operands.mask_arguments`), in the contract's sense whatever the roles. ``splits``:
    programs sharing one outer block's inner range (None: enough to fill the GPU).

    ``column_partials`` (softmax rows only; fp32 [>= cdiv(n_outer, MIN_BLOCK_M), D, n_inner],
    filled with -inf by the caller) also receives each row block's column log-sum-exp of every
    term, as :func:`.stats.logit_stats`'s does: the forward is then one pass over the tiles."""
    n_outer = outer.shape[0]
    n_inner = inner.shape[0]
    terms = len(dims)
    splits, inner_per_split = inner_splits(n_outer, n_inner, outer.device, splits)
    partials = torch.empty((splits, terms, n_outer), dtype=torch.float32, device=outer.device)
    mask = mask or {}
    dummy = unused_pointer(outer.device)
    grid = lambda meta: (triton.cdiv(n_outer, meta["BLOCK_M"]), splits)  # noqa: E731
    launch(
        PREFIX_STATS_KERNEL, grid, outer.device,
        outer, inner, outer_norms, inner_norms, segment_bounds(dims, outer.device), partials,
        column_partials if column_partials is not None else dummy, scale,
        bias if bias is not None else dummy, mask.get("row_groups", dummy), mask.get("key_groups", dummy),
        mask.get("positive_keys", dummy), mask.get("key_offset", 0),
        n_outer, n_inner, dims[0], outer.stride(0), inner.stride(0), inner_per_split, math.gcd(*dims),
        problem_size_class(n_outer, n_inner),
        TERMS=terms, TERMS_P2=triton.next_power_of_2(terms), HAS_BIAS=bias is not None, HAS_MASK=bool(mask),
        COLUMNS=columns, SIGMOID=sigmoid, FUSED_COLUMNS=column_partials is not None,
        PRECISION=dot_precision(outer.dtype, precision), UPCAST=INTERPRET,
    )
    if splits == 1:
        return partials[0]
    merged = merge_partials(partials.view(splits, terms * n_outer), log_sum_exp=not sigmoid)
    return merged.view(terms, n_outer)


@triton.jit
def _term_gradient(dots, term, h_ptr, q_norm_ptr, k_norm_ptr, row_stat_ptr, row_weight_ptr, col_stat_ptr,
                   col_weight_ptr, row_sums_ptr, row_products_ptr, key_products_ptr, row_index, key_index,
                   row_valid, key_valid, row_terms, key_terms, stride_h_term, stride_h, scale, bias,
                   inv_g_scale_ptr, allowed, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr,
                   COLUMNS: tl.constexpr, SIGMOID: tl.constexpr, SCALED_G: tl.constexpr, FULL: tl.constexpr,
                   LOG2: tl.constexpr):
    """Term ``term`` of one tile, its raw prefix products ``dots``: G^t from the forward's
    statistics and the weights, its row and key sums added (the row sums of G only with a bias),
    and G^t a^t b^t written as G buffer t."""
    a = tl.load(q_norm_ptr + term * row_terms + row_index, mask=row_valid, other=0.0)
    b = tl.load(k_norm_ptr + term * key_terms + key_index, mask=key_valid, other=0.0)
    logits = scaled_logits(dots * a[:, None] * b[None, :], scale, bias, HAS_BIAS)
    row_weight = tl.load(row_weight_ptr + term * row_terms + row_index, mask=row_valid, other=0.0)
    if SIGMOID:
        grad = row_weight[:, None] * tl.sigmoid(logits)
    else:
        row_stat = tl.load(row_stat_ptr + term * row_terms + row_index, mask=row_valid, other=0.0)
        grad = row_weight[:, None] * exp_in_units(logits - in_units(row_stat, LOG2)[:, None], LOG2)
        if COLUMNS:
            col_stat = tl.load(col_stat_ptr + term * key_terms + key_index, mask=key_valid, other=0.0)
            col_weight = tl.load(col_weight_ptr + term * key_terms + key_index, mask=key_valid, other=0.0)
            grad += col_weight[None, :] * exp_in_units(logits - in_units(col_stat, LOG2)[None, :], LOG2)
    if MASKED:
        # where(), not a product: a masked entry may hold 0 * inf = nan
        grad = tl.where(allowed, grad, 0.0)
    if HAS_BIAS:  # the row sums are d bias's alone
        tl.atomic_add(row_sums_ptr + term * row_terms + row_index, tl.sum(grad, axis=1), mask=row_valid)
    weighted = grad * dots
    tl.atomic_add(row_products_ptr + term * row_terms + row_index, tl.sum(weighted * b[None, :], axis=1),
                  mask=row_valid)
    tl.atomic_add(key_products_ptr + term * key_terms + key_index, tl.sum(weighted * a[:, None], axis=0),
                  mask=key_valid)
    grad = grad * a[:, None] * b[None, :]
    if SCALED_G:
        grad = grad * tl.load(inv_g_scale_ptr)
    g_tile = h_ptr + term * stride_h_term + row_index[:, None] * stride_h + key_index[None, :]
    if FULL:
        tl.store(g_tile, grad.to(h_ptr.dtype.element_ty))
    else:
        tl.store(g_tile, grad.to(h_ptr.dtype.element_ty), mask=row_valid[:, None] & key_valid[None, :])


@triton.jit
def _prefix_grad_kernel(
    q_ptr, k_ptr, h_ptr, q_norm_ptr, k_norm_ptr, bounds_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr,
    row_stat_ptr, row_weight_ptr, col_stat_ptr, col_weight_ptr, row_sums_ptr, row_products_ptr,
    key_products_ptr, row_group_ptr, key_group_ptr, positive_ptr, key_offset,
    n_rows, n_keys, c, stride_q, stride_k, stride_h_term, stride_h, row_terms, key_terms, dims_gcd,
    size_class,
    TERMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COLUMNS: tl.constexpr,
    SIGMOID: tl.constexpr, SCALED_G: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_SEGMENTS: tl.constexpr,
    FULL: tl.constexpr, LOG2: tl.constexpr,
):
    row_index = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    key_index = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_valid = row_index < n_rows
    key_valid = key_index < n_keys
    scale, bias = scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, LOG2)
    if HAS_MASK or not FULL:
        allowed = allowed_pairs(row_index, key_index, row_valid, key_valid, row_group_ptr, key_group_ptr,
                                positive_ptr, key_offset, HAS_MASK)
    else:
        allowed = 0  # never read
    q_rows = q_ptr + tl.where(row_valid, row_index, 0)[:, None] * stride_q
    k_rows = k_ptr + tl.where(key_valid, key_index, 0)[:, None] * stride_k
    dots = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EVEN_SEGMENTS:
        # As the statistics kernel: one pipelined loop from column 0, each term where its prefix ends.
        width = tl.arange(0, BLOCK_K)
        term = TERMS - 1 + tl.zeros((), dtype=tl.int32)
        bound = tl.load(bounds_ptr + term)
        for c0 in range(0, c, BLOCK_K):
            cols = c0 + width
            dots = _add_step_dots(dots, q_rows, k_rows, cols, cols, False, PRECISION, UPCAST)
            if c0 + BLOCK_K == bound:
                _term_gradient(dots, term, h_ptr, q_norm_ptr, k_norm_ptr, row_stat_ptr, row_weight_ptr,
                               col_stat_ptr, col_weight_ptr, row_sums_ptr, row_products_ptr,
                               key_products_ptr, row_index, key_index, row_valid, key_valid, row_terms,
                               key_terms, stride_h_term, stride_h, scale, bias, inv_g_scale_ptr, allowed,
                               HAS_BIAS, HAS_MASK or not FULL, COLUMNS, SIGMOID, SCALED_G, FULL, LOG2)
                term -= 1
                bound = tl.load(bounds_ptr + tl.maximum(term, 0))
    else:
        for step in tl.static_range(TERMS):
            t = TERMS - 1 - step
            dots = _add_segment_dots(dots, q_rows, k_rows, tl.load(bounds_ptr + t + 1),
                                     tl.load(bounds_ptr + t), BLOCK_K, PRECISION, UPCAST)
            _term_gradient(dots, t, h_ptr, q_norm_ptr, k_norm_ptr, row_stat_ptr, row_weight_ptr,
                           col_stat_ptr, col_weight_ptr, row_sums_ptr, row_products_ptr, key_products_ptr,
                           row_index, key_index, row_valid, key_valid, row_terms, key_terms, stride_h_term,
                           stride_h, scale, bias, inv_g_scale_ptr, allowed, HAS_BIAS, HAS_MASK or not FULL,
                           COLUMNS, SIGMOID, SCALED_G, FULL, LOG2)


PREFIX_GRAD_KERNEL = autotuned(_prefix_grad_kernel, "prefix_grad", _PREFIX_SHAPES, {
    "EVEN_SEGMENTS": _even_segments,
    "LOG2": log2_units,
    "FULL": lambda args: args["n_rows"] % args["BLOCK_M"] == 0 and args["n_keys"] % args["BLOCK_N"] == 0,
}, reset_to_zero=["row_sums_ptr", "row_products_ptr", "key_products_ptr"])


class PrefixRoute:
    """The backward's super-tile route of the one-pass Matryoshka loss (:class:`.super_tiles.
    SuperTileRoute` with ``segments``): G buffer t of each super-tile holds Ĝ^t (divided by the
    walk's G factor, ``inv_g_scale`` its inverse), which the walk multiplies with the operands'
    prefix of width d_t; the per-term sums go into ``sums``."""

    g_alone = True

    def __init__(self, spec: PrefixSpec, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, query_norms: torch.Tensor, key_norms: torch.Tensor, mask: dict,
                 row_stat, row_weight, col_stat, col_weight, sums: PrefixSums,
                 inv_g_scale: torch.Tensor | None):
        self.spec, self.queries, self.keys, self.scale, self.bias = spec, queries, keys, scale, bias
        self.segments = tuple(slice(0, dim) for dim in spec.dims)
        self.query_norms, self.key_norms = query_norms, key_norms
        self.labels = Labels(mask)
        self.rows = [per_term(x) for x in (row_stat, row_weight)]
        self.columns = None if col_stat is None else [per_term(x) for x in (col_stat, col_weight)]
        self.sums, self.inv_g_scale = sums, inv_g_scale
        self.bounds = segment_bounds(spec.dims, queries.device)
        # one tuning key for every super-tile: tuning (which zeroes the sums it benchmarks on)
        # can only happen on the first
        self.size_class = problem_size_class(queries.shape[0], keys.shape[0])
        self.config = None

    def scratch(self, shape, dtype):
        return torch.empty((len(self.segments), *shape), dtype=dtype, device=self.queries.device)

    def row_panel(self, start, end):
        return dict(queries=self.queries[start:end], norms=self.query_norms[:, start:end],
                    stats=[x[:, start:end] for x in self.rows],
                    sums=[x[:, start:end] for x in (self.sums.row_sums, self.sums.row_products)],
                    mask=self.labels.rows(start, end))

    def key_tile(self, start, end):
        columns = self.columns
        return dict(keys=self.keys[start:end], norms=self.key_norms[:, start:end],
                    stats=None if columns is None else [x[:, start:end] for x in columns],
                    key_products=self.sums.key_products[:, start:end], mask=self.labels.keys(start, end))

    def write(self, row, tile, g):
        queries, keys = row["queries"], tile["keys"]
        dummy = unused_pointer(queries.device)
        mask = {**row["mask"], **tile["mask"]}
        column_stats = tile["stats"] if tile["stats"] is not None else [dummy, dummy]
        grid = lambda meta: (triton.cdiv(queries.shape[0], meta["BLOCK_M"]),  # noqa: E731
                             triton.cdiv(keys.shape[0], meta["BLOCK_N"]))
        self.config = launch(
            PREFIX_GRAD_KERNEL, grid, queries.device,
            queries, keys, g, row["norms"], tile["norms"], self.bounds, self.scale,
            self.bias if self.bias is not None else dummy,
            self.inv_g_scale if self.inv_g_scale is not None else dummy, *row["stats"], *column_stats,
            *row["sums"], tile["key_products"], mask.get("row_groups", dummy), mask.get("key_groups", dummy),
            mask.get("positive_keys", dummy), mask.get("key_offset", 0),
            queries.shape[0], keys.shape[0], self.spec.dims[0], queries.stride(0), keys.stride(0),
            g.stride(0), g.stride(1), row["norms"].stride(0), tile["norms"].stride(0),
            math.gcd(*self.spec.dims), self.size_class,
            TERMS=len(self.spec.dims), HAS_BIAS=self.bias is not None, HAS_MASK=bool(mask),
            COLUMNS=self.columns is not None, SIGMOID=self.spec.loss == "sigmoid",
            SCALED_G=self.inv_g_scale is not None,
            PRECISION=dot_precision(queries.dtype, self.spec.precision), UPCAST=INTERPRET, config=self.config,
        )


def per_term(tensor: torch.Tensor) -> torch.Tensor:
    """A [D, n] statistic, weight or inverse norm as the kernels read it: fp32, contiguous (term
    stride n), no autograd history."""
    return tensor.detach().to(torch.float32).contiguous()


def g_factor(dtype: torch.dtype, query_norms: torch.Tensor, key_norms: torch.Tensor, row_weight: torch.Tensor,
             col_weight: torch.Tensor | None) -> torch.Tensor | None:
    """What the G buffers are stored divided by: in fp16, a bound on every |Ĝ^t| (the largest
    term's weights times its largest inverse norms; a probability is at most 1), so that none
    overflows or loses its relative precision to fp16's range; bf16 and fp32 store Ĝ itself."""
    if dtype != torch.float16:
        return None
    weights = row_weight.abs().amax(dim=1)
    if col_weight is not None:
        weights = weights + col_weight.abs().amax(dim=1)
    bound = (weights * query_norms.amax(dim=1) * key_norms.amax(dim=1)).amax()
    return bound.clamp_min(TINY)


def super_tile(dtype: torch.dtype, m: int, k: int, terms: int, tile_rows: int | None,
               tile_keys: int | None) -> tuple[int, int]:
    """The backward's super-tile: D buffers of G in about four times the plain loss's 128 MiB
    (keys as the plain loss takes them; rows in whole thousands, at least 1024: the narrow
    prefixes' GEMMs run far below cuBLAS's rate on fewer rows), unless the caller set either
    side."""
    keys = tile_keys if tile_keys is not None else 8192
    if tile_rows is not None:
        rows = tile_rows
    else:
        element = 2 if dtype in HALF_TYPES else 4
        rows = max(1024, (512 * 2**20 // (terms * keys * element)) // 1024 * 1024)
    return min(rows, m), min(keys, k)
