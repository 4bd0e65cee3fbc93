"""Matryoshka in one pass on the Triton route: the kernels of :class:`TritonBlocks`'
``prefix_forward_block`` / ``prefix_backward_block`` and their launchers (the algebra, and the
names P^t, a^t, b^t, G^t, H_u: :mod:`hf_infcl.ops.matryoshka`).

``prefix_stats``: one program owns a block of "outer" vectors (rows, or keys for the column
statistic) and streams the "inner" ones past it, as the plain statistics kernel does. Each tile's
dot products are summed over the width's segments from the innermost, so that after segment u
the running sum is the raw prefix product P^u; each term t then takes its logits
z^t = s P^t a^t_i b^t_j (+ b) and updates its own online log-sum-exp (softmax) or softplus sum
(sigmoid). One product of the widest prefix per tile gives every term's statistics.

``PrefixRoute``: the backward's super-tile route (:mod:`.super_tiles`). Its kernel recomputes each
tile's full product P^0 once, then walks the terms from the widest: term t forms G^t from the
forward's statistics, adds its row and key sums, adds G^t a^t b^t into the running H and writes
H_t (the sum over the terms that cover segment t) as G buffer t; it then takes segment t's
product off P, which leaves P^{t+1}. The walk's GEMMs multiply each H_u with its segment only,
so dQ and dK cost one product of the widest prefix, as the plain loss's do. The recompute costs
the widest prefix plus every segment but the innermost once more: H_u needs the terms from the
widest down, while a running sum from the innermost meets them in the other order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..matryoshka import PrefixSpec, PrefixSums
from .device import INTERPRET, unused_pointer
from .jit_math import (
    allowed_pairs,
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


# Autotuning candidates: the base shapes of K step 64 that every other kernel tunes among most often
# (each candidate compiles D unrolled segment loops, so the list is kept short for the first call).
_PREFIX_SHAPES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)]


@triton.jit
def _add_segment_dots(acc, a_rows, b_rows, start, end, NEGATE: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_SEGMENTS: tl.constexpr):
    """``acc`` + (or - with NEGATE) the dot products of columns ``start:end`` of the rows at
    ``a_rows`` and ``b_rows`` (pointers to each row's first column), fp32. EVEN_SEGMENTS: every
    segment bound is a multiple of BLOCK_K, so that the loads need no mask."""
    width = tl.arange(0, BLOCK_K)
    for c0 in range(start, end, BLOCK_K):
        cols = c0 + width
        if EVEN_SEGMENTS:
            a = tl.load(a_rows + cols[None, :])
            b = tl.load(b_rows + cols[None, :])
        else:
            in_segment = cols[None, :] < end
            a = tl.load(a_rows + cols[None, :], mask=in_segment, other=0.0)
            b = tl.load(b_rows + cols[None, :], mask=in_segment, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if NEGATE:  # exact: a sign flip of the loaded operand, the same single accumulator
            a = -a
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _prefix_stats_kernel(
    outer_ptr, inner_ptr, outer_norm_ptr, inner_norm_ptr, bounds_ptr, out_ptr, scale_ptr, bias_ptr,
    row_group_ptr, key_group_ptr, positive_ptr, key_offset,
    n_outer, n_inner, c, stride_outer, stride_inner, inner_per_split, dims_gcd, size_class,
    TERMS: tl.constexpr, TERMS_P2: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    COLUMNS: tl.constexpr, SIGMOID: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_SEGMENTS: tl.constexpr,
    FULL: tl.constexpr, LOG2: tl.constexpr,
):
    pid, outer_index, outer_valid, inner_start, inner_end = outer_block_and_inner_range(
        n_outer, n_inner, inner_per_split, BLOCK_M)
    scale, bias = scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, LOG2)
    # Every term's running statistics side by side, column t term t's (a list of tensors cannot
    # be indexed in a kernel): each update reads and writes its own column.
    term = tl.arange(0, TERMS_P2)[None, :]
    running_max = tl.full((BLOCK_M, TERMS_P2), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M, TERMS_P2), dtype=tl.float32)
    # Rows past the end read row 0 (no load masks); their results are never stored.
    outer_rows = outer_ptr + tl.where(outer_valid, outer_index, 0)[:, None] * stride_outer
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
        dots = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in tl.static_range(TERMS):
            t = TERMS - 1 - step  # from the innermost segment out
            dots = _add_segment_dots(dots, outer_rows, inner_rows, tl.load(bounds_ptr + t + 1),
                                     tl.load(bounds_ptr + t), False, BLOCK_K, PRECISION, UPCAST,
                                     EVEN_SEGMENTS)
            a = tl.load(outer_norm_ptr + t * n_outer + outer_index, mask=outer_valid, other=0.0)
            b = tl.load(inner_norm_ptr + t * n_inner + inner_index, mask=inner_valid, other=0.0)
            logits = scaled_logits(dots * a[:, None] * b[None, :], scale, bias, HAS_BIAS)
            selected = term == t
            if SIGMOID:
                terms = softplus(logits)
                if HAS_MASK or not FULL:
                    terms = tl.where(allowed, terms, 0.0)
                running_sum += tl.where(selected, tl.sum(terms, axis=1)[:, None], 0.0)
            else:
                if HAS_MASK or not FULL:
                    logits = tl.where(allowed, logits, float("-inf"))
                # As the plain statistics kernel: the tile shifted by its own row maxima, 0 for a
                # row with nothing allowed, exp(-inf - shift) = 0 for what is not.
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

    if SIGMOID:
        result = running_sum
    else:
        shift = tl.where(running_max == float("-inf"), 0.0, running_max)
        result = shift + log_in_units(running_sum, LOG2)  # -inf for a row that saw nothing allowed
        if LOG2:
            result *= 0.6931471805599453  # ln 2: the statistics leave in natural units
    out = out_ptr + tl.program_id(1).to(tl.int64) * TERMS * n_outer + term * n_outer + outer_index[:, None]
    tl.store(out, result, mask=outer_valid[:, None] & (term < TERMS))


def _even_segments(args: dict) -> bool:
    """EVEN_SEGMENTS: the step along the width divides every prefix width, so that no load needs
    a mask."""
    return args["dims_gcd"] % args["BLOCK_K"] == 0


PREFIX_STATS_KERNEL = autotuned(_prefix_stats_kernel, "prefix_stats", _PREFIX_SHAPES, {
    "EVEN_SEGMENTS": _even_segments,
    "LOG2": log2_units,
    "FULL": lambda args: (args["n_outer"] % args["BLOCK_M"] == 0 and args["n_inner"] % args["BLOCK_N"] == 0
                          and args["inner_per_split"] % args["BLOCK_N"] == 0),
})


def segment_bounds(dims: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [D + 1]: the dims, then 0 (segment u is columns bounds[u + 1]:bounds[u])."""
    return torch.tensor((*dims, 0), dtype=torch.int32, device=device)


def prefix_stats(outer: torch.Tensor, inner: torch.Tensor, outer_norms: torch.Tensor,
                 inner_norms: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dims: tuple[int, ...], *, sigmoid: bool, columns: bool, precision: str,
                 splits: int | None = None, mask: dict | None = None) -> torch.Tensor:
    """fp32 [D, n_outer]: every Matryoshka term's statistic of each ``outer`` vector over every
    ``inner`` one, the log-sum-exp (softmax) or the softplus sum (sigmoid) of z^t = scale P^t a^t_i
    b^t_j (+ bias); ``outer_norms`` [D, n_outer] and ``inner_norms`` [D, n_inner] are the fp32
    inverse prefix norms, ``dims`` the prefix widths (descending). With ``columns`` the outer
    vectors are the keys (the column statistic). ``mask``: the group mask's launcher arguments
    (:func:`.operands.mask_arguments`), in the contract's sense whatever the roles. ``splits``:
    programs sharing one outer block's inner range (None: enough to fill the GPU)."""
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
        outer, inner, outer_norms, inner_norms, segment_bounds(dims, outer.device), partials, scale,
        bias if bias is not None else dummy, mask.get("row_groups", dummy), mask.get("key_groups", dummy),
        mask.get("positive_keys", dummy), mask.get("key_offset", 0),
        n_outer, n_inner, dims[0], outer.stride(0), inner.stride(0), inner_per_split, math.gcd(*dims),
        problem_size_class(n_outer, n_inner),
        TERMS=terms, TERMS_P2=triton.next_power_of_2(terms), HAS_BIAS=bias is not None, HAS_MASK=bool(mask),
        COLUMNS=columns, SIGMOID=sigmoid, PRECISION=dot_precision(outer.dtype, precision), UPCAST=INTERPRET,
    )
    if splits == 1:
        return partials[0]
    merged = merge_partials(partials.view(splits, terms * n_outer), log_sum_exp=not sigmoid)
    return merged.view(terms, n_outer)


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
    q_rows = q_ptr + tl.where(row_valid, row_index, 0)[:, None] * stride_q
    k_rows = k_ptr + tl.where(key_valid, key_index, 0)[:, None] * stride_k
    dots = _add_segment_dots(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), q_rows, k_rows, 0,
                             tl.load(bounds_ptr), False, BLOCK_K, PRECISION, UPCAST, EVEN_SEGMENTS)
    covering = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # H: the terms so far, scaled
    for t in tl.static_range(TERMS):  # from the widest prefix in; dots holds P^t
        a = tl.load(q_norm_ptr + t * row_terms + row_index, mask=row_valid, other=0.0)
        b = tl.load(k_norm_ptr + t * key_terms + key_index, mask=key_valid, other=0.0)
        logits = scaled_logits(dots * a[:, None] * b[None, :], scale, bias, HAS_BIAS)
        row_weight = tl.load(row_weight_ptr + t * row_terms + row_index, mask=row_valid, other=0.0)
        if SIGMOID:
            grad = row_weight[:, None] * tl.sigmoid(logits)
        else:
            row_stat = tl.load(row_stat_ptr + t * row_terms + row_index, mask=row_valid, other=0.0)
            grad = row_weight[:, None] * exp_in_units(logits - in_units(row_stat, LOG2)[:, None], LOG2)
            if COLUMNS:
                col_stat = tl.load(col_stat_ptr + t * key_terms + key_index, mask=key_valid, other=0.0)
                col_weight = tl.load(col_weight_ptr + t * key_terms + key_index, mask=key_valid, other=0.0)
                grad += col_weight[None, :] * exp_in_units(logits - in_units(col_stat, LOG2)[None, :], LOG2)
        if HAS_MASK or not FULL:
            # where(), not a product: a masked entry may hold 0 * inf = nan
            grad = tl.where(allowed, grad, 0.0)
        tl.atomic_add(row_sums_ptr + t * row_terms + row_index, tl.sum(grad, axis=1), mask=row_valid)
        weighted = grad * dots
        tl.atomic_add(row_products_ptr + t * row_terms + row_index, tl.sum(weighted * b[None, :], axis=1),
                      mask=row_valid)
        tl.atomic_add(key_products_ptr + t * key_terms + key_index, tl.sum(weighted * a[:, None], axis=0),
                      mask=key_valid)
        covering += grad * a[:, None] * b[None, :]
        h = covering
        if SCALED_G:
            h = h * tl.load(inv_g_scale_ptr)
        h_tile = h_ptr + t * stride_h_term + row_index[:, None] * stride_h + key_index[None, :]
        if FULL:
            tl.store(h_tile, h.to(h_ptr.dtype.element_ty))
        else:
            tl.store(h_tile, h.to(h_ptr.dtype.element_ty), mask=row_valid[:, None] & key_valid[None, :])
        if t < TERMS - 1:  # P^{t+1}: segment t's product taken off
            dots = _add_segment_dots(dots, q_rows, k_rows, tl.load(bounds_ptr + t + 1),
                                     tl.load(bounds_ptr + t), True, BLOCK_K, PRECISION, UPCAST, EVEN_SEGMENTS)


PREFIX_GRAD_KERNEL = autotuned(_prefix_grad_kernel, "prefix_grad", _PREFIX_SHAPES, {
    "EVEN_SEGMENTS": _even_segments,
    "LOG2": log2_units,
    "FULL": lambda args: args["n_rows"] % args["BLOCK_M"] == 0 and args["n_keys"] % args["BLOCK_N"] == 0,
}, reset_to_zero=["row_sums_ptr", "row_products_ptr", "key_products_ptr"])


class PrefixRoute:
    """The backward's super-tile route of the one-pass Matryoshka loss (:class:`.super_tiles.
    SuperTileRoute` with ``segments``): G buffer u of each super-tile holds H_u (divided by the
    walk's G factor, ``inv_g_scale`` its inverse), which the walk multiplies with segment u of
    the operands; the per-term sums go into ``sums``."""

    g_alone = True

    def __init__(self, spec: PrefixSpec, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, query_norms: torch.Tensor, key_norms: torch.Tensor, mask: dict,
                 row_stat, row_weight, col_stat, col_weight, sums: PrefixSums,
                 inv_g_scale: torch.Tensor | None):
        self.spec, self.queries, self.keys, self.scale, self.bias = spec, queries, keys, scale, bias
        self.segments = spec.segments
        self.query_norms, self.key_norms = query_norms, key_norms
        self.mask = mask
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
        mask = {name: self.mask[name][start:end] for name in ("row_groups", "positive_keys")
                if name in self.mask}
        return dict(queries=self.queries[start:end], norms=self.query_norms[:, start:end],
                    stats=[x[:, start:end] for x in self.rows],
                    sums=[x[:, start:end] for x in (self.sums.row_sums, self.sums.row_products)], mask=mask)

    def key_tile(self, start, end):
        mask = {}
        if self.mask:
            mask = dict(key_groups=self.mask["key_groups"][start:end],
                        key_offset=self.mask["key_offset"] + start)
        columns = self.columns
        return dict(keys=self.keys[start:end], norms=self.key_norms[:, start:end],
                    stats=None if columns is None else [x[:, start:end] for x in columns],
                    key_products=self.sums.key_products[:, start:end], mask=mask)

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
    """What the H buffers are stored divided by: in fp16, a bound on |H| (each term's largest
    weights times its largest inverse norms; a probability is at most 1), so that H neither
    overflows nor loses its relative precision to fp16's range; bf16 and fp32 store H itself."""
    if dtype != torch.float16:
        return None
    weights = row_weight.abs().amax(dim=1)
    if col_weight is not None:
        weights = weights + col_weight.abs().amax(dim=1)
    bound = (weights * query_norms.amax(dim=1) * key_norms.amax(dim=1)).sum()
    return bound.clamp_min(TINY)


def super_tile(dtype: torch.dtype, m: int, k: int, terms: int, tile_rows: int | None,
               tile_keys: int | None) -> tuple[int, int]:
    """The backward's super-tile: D buffers of H in about twice the plain loss's 128 MiB of G
    (keys as the plain loss takes them; rows in whole thousands, at least 1024), unless the caller
    set either side."""
    keys = tile_keys if tile_keys is not None else 8192
    if tile_rows is not None:
        rows = tile_rows
    else:
        element = 2 if dtype in HALF_TYPES else 4
        rows = max(1024, (256 * 2**20 // (terms * keys * element)) // 1024 * 1024)
    return min(rows, m), min(keys, k)
