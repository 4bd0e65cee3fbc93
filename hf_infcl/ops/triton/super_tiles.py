"""The backward's walk over super-tiles, and the routes that write each super-tile's G.

The problem is walked in super-tiles of ``tile_rows x tile_keys`` logits. For each, a route
writes G (masked, in the GEMM operands' dtype) into a bounded scratch buffer and adds its row
sums; two cuBLAS GEMMs then add G K to the query accumulator and G^T Q to the key accumulator.
The route is chosen once per call:

- :class:`GradTileRoute`: the gradient-tile kernel recomputes the logits and forms G (the
  backward of either loss, and the sigmoid one pass with ``sigmoid_logits="fused"``);
- :class:`CublasDotsRoute`: the sigmoid one pass; a cuBLAS GEMM computes the dot products and an
  elementwise kernel forms G over them;
- :class:`GluonRoute`: the sigmoid one pass on Hopper; one Gluon kernel computes the logits, G
  and the sums.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from ..value_check import run_deferred_check
from . import gluon_sigmoid
from .device import tensor_descriptor
from .grad_tile import grad_tile
from .launch import problem_size_class
from .operands import KEY_LABELS, ROW_LABELS, TINY, Operands, product, sliced
from .sigmoid_from_dots import sigmoid_from_dots


@dataclass(frozen=True)
class RouteArguments:
    """What every route reads and writes."""

    kernel: Operands  # the operands the kernels multiply, and their logit scale
    bias: torch.Tensor | None  # 0-d fp32
    labels: dict  # the launchers' group-mask and hardness arguments (.operands.label_arguments)
    inv_g_scale: torch.Tensor | None  # 0-d: G is stored times this (None: 1)
    row_sums: torch.Tensor  # [m] fp32: each super-tile's row sums of G are added here
    softplus_sums: torch.Tensor | None = None  # [m] fp32: the sigmoid one pass's row statistic


class SuperTileRoute(Protocol):
    """How a super-tile's G and its row sums are written."""

    g_alone: bool  # G needs no dot-product buffer beside it: super-tiles twice as wide
    # None: one G for the whole width. Else one G per slice of the width (the scratch buffer is
    # [slices, rows, keys]): G u multiplies columns segments[u] only (Matryoshka's Ĝ^t, each with
    # its own prefix).
    segments: tuple[slice, ...] | None

    def scratch(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """The buffer G is written into (the route may share it with its own buffers)."""

    def row_panel(self, start: int, end: int):
        """What the route needs of rows ``start:end``, made once per call."""

    def key_tile(self, start: int, end: int):
        """What the route needs of keys ``start:end``, made once per call."""

    def write(self, row_panel, key_tile, g: torch.Tensor) -> None:
        """G of one super-tile into ``g`` (a view of the scratch buffer), row sums added."""


def walk(route: SuperTileRoute, gemm: Operands, grad_queries: torch.Tensor, grad_keys: torch.Tensor,
         g_factor: torch.Tensor | None, tile: tuple[int, int], precision: str, poison: bool) -> None:
    """Add G K into ``grad_queries`` and G^T Q into ``grad_keys`` over every super-tile of
    ``tile`` = (rows, keys), G from ``route``, stored divided by ``g_factor`` (:func:`g_scale`;
    None: 1), the GEMMs on ``gemm``'s operands (divided by their factors, if any); with the
    route's ``segments``, each segment's G times that segment's columns."""
    m, k = gemm.queries.shape[0], gemm.keys.shape[0]
    # The GEMMs add (G / g_scale) @ (K / k_factor) into grad_queries, whose true increment is that
    # times g_scale * k_factor. Dividing the accumulator by the factor first and multiplying it back
    # after keeps every product exactly one fp32 addmm (no rounded half-precision intermediate
    # that could overflow) at the cost of two cheap passes.
    factor_q, factor_k = product(g_factor, gemm.keys_factor), product(g_factor, gemm.queries_factor)
    if factor_q is not None:
        grad_queries.div_(factor_q)
    if factor_k is not None:
        grad_keys.div_(factor_k)
    tile_rows, tile_keys = tile
    segments = route.segments
    # Row stride padded to 8 elements so that cuBLAS sees aligned leading dimensions.
    scratch = route.scratch((tile_rows, -(-tile_keys // 8) * 8), gemm.queries.dtype)
    # Every view the loop needs, made once (the loop runs once per super-tile, and slicing a dozen
    # tensors per super-tile cost more host time than the GPU work it launched), and each when the
    # loop first needs it: made all up front, they kept the GPU idle before the first launch.
    def row_views(r0, r1):
        return gemm.queries[r0:r1], grad_queries[r0:r1], route.row_panel(r0, r1)

    def key_views(k0, k1):
        return gemm.keys[k0:k1], grad_keys[k0:k1], route.key_tile(k0, k1)

    row_bounds, key_bounds = _bounds(m, tile_rows), _bounds(k, tile_keys)
    first_rows = row_views(*row_bounds[0])
    keys = [key_views(*key_bounds[0])] + [None] * (len(key_bounds) - 1)  # the rest at the first row panel
    g_views = {}  # at most four shapes: full, last row panel, last key tile, both
    run_deferred_check()  # the one-process value check, just before the first kernel
    with _cublas_precision(gemm.queries.dtype, precision, gemm.queries.device):
        for panel, (r0, r1) in enumerate(row_bounds):
            gemm_queries, row_grad, row_panel = first_rows if panel == 0 else row_views(r0, r1)
            for tile_index, (k0, k1) in enumerate(key_bounds):
                if keys[tile_index] is None:
                    keys[tile_index] = key_views(k0, k1)
                gemm_keys, key_grad, key_tile = keys[tile_index]
                shape = (gemm_queries.shape[0], gemm_keys.shape[0])
                g = g_views.get(shape)
                if g is None:
                    g = g_views[shape] = scratch[..., : shape[0], : shape[1]]
                if poison:
                    scratch.fill_(float("nan"))
                route.write(row_panel, key_tile, g)
                if segments is None:
                    add_product(row_grad, g, gemm_keys)
                    add_product(key_grad, g.T, gemm_queries)
                    continue
                for part, columns in zip(g, segments):
                    add_product(row_grad[:, columns], part, gemm_keys[:, columns])
                    add_product(key_grad[:, columns], part.T, gemm_queries[:, columns])
    if factor_q is not None:
        grad_queries.mul_(factor_q)
    if factor_k is not None:
        grad_keys.mul_(factor_k)


def g_scale(gemm_dtype: torch.dtype, row_weight: torch.Tensor,
            col_weight: torch.Tensor | None) -> torch.Tensor | None:
    """The factor G is stored divided by: in fp16, max |weight|, so that G keeps its relative
    precision when the weights are tiny (1/m for a mean over 1M rows underflows fp16); bf16 and
    fp32 have fp32's exponent range and store G itself (None)."""
    if gemm_dtype != torch.float16:
        return None
    scale = row_weight.abs().amax()
    if col_weight is not None:
        scale = scale + col_weight.abs().amax()
    return scale.clamp_min(TINY)


class Labels:
    """The launchers' label arguments (group mask, hardness offset) sliced per row panel and key
    tile: row labels by row, key labels by key with the key tile's global offset."""

    def __init__(self, labels: dict):
        labels = dict(labels)
        self.key_offset = labels.pop("key_offset", 0)
        self.offset = {name: labels.pop(name) for name in ("hardness", "hardness_strength", "group_positives")
                       if name in labels}
        self.tensors = labels

    def rows(self, start: int, end: int) -> dict:
        return sliced(self.tensors, ROW_LABELS, start, end)

    def keys(self, start: int, end: int) -> dict:
        if not self.tensors:
            return {}
        return dict(sliced(self.tensors, KEY_LABELS, start, end), key_offset=self.key_offset + start)


class GradTileRoute:
    """G from the gradient-tile kernel, which recomputes each super-tile's logits: softmax (both
    directions), sigmoid with row weights, or (``softplus_sums`` given) the sigmoid one pass."""

    g_alone = True
    segments = None

    def __init__(self, arguments: RouteArguments, row_stat, row_weight, col_stat, col_weight, *,
                 sigmoid: bool, precision: str, clamp_exponents: bool = False):
        self.arguments = arguments
        self.labels = Labels(arguments.labels)
        self.row_stat, self.row_weight = fp32_vector(row_stat), fp32_vector(row_weight)
        self.col_stat, self.col_weight = fp32_vector(col_stat), fp32_vector(col_weight)
        queries, keys = arguments.kernel.queries, arguments.kernel.keys
        self.options = dict(sigmoid=sigmoid, precision=precision, clamp_exponents=clamp_exponents,
                            **self.labels.offset,
                            # One tuning key for every super-tile, so that tuning (which zeroes the
                            # row sums it benchmarks on) can only happen on the first one.
                            size_class=problem_size_class(queries.shape[0], keys.shape[0]))
        # The kernel's configuration, from its first launch: every later super-tile has the same
        # tuning key, so it goes past the autotuner (host time).
        self.config = None

    def scratch(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.arguments.row_sums.device)

    def row_panel(self, start, end):
        queries = self.arguments.kernel.queries[start:end]
        softplus_sums = self.arguments.softplus_sums
        return dict(queries=queries, row_sums=self.arguments.row_sums[start:end],
                    row_stat=self.row_stat[start:end], row_weight=self.row_weight[start:end],
                    softplus_sums=None if softplus_sums is None else softplus_sums[start:end],
                    labels=self.labels.rows(start, end), descriptor=tensor_descriptor(queries))

    def key_tile(self, start, end):
        keys = self.arguments.kernel.keys[start:end]
        return dict(keys=keys, col_stat=None if self.col_stat is None else self.col_stat[start:end],
                    col_weight=None if self.col_weight is None else self.col_weight[start:end],
                    labels=self.labels.keys(start, end), descriptor=tensor_descriptor(keys))

    def write(self, row, tile, g):
        a = self.arguments
        self.config = grad_tile(
            row["queries"], tile["keys"], g, row["row_sums"], a.kernel.scale, a.bias, a.inv_g_scale,
            row["row_stat"], tile["col_stat"], row["row_weight"], tile["col_weight"],
            softplus_sums=row["softplus_sums"], config=self.config,
            descriptors=(row["descriptor"], tile["descriptor"]), **row["labels"], **tile["labels"],
            **self.options,
        )


class CublasDotsRoute:
    """The sigmoid one pass: each super-tile's dot products from a cuBLAS GEMM of ``dots``'
    operands (:func:`.operands.dot_operands`) into a buffer, G and the sums from the elementwise
    kernel, which writes G over the dot products where their element sizes match."""

    segments = None

    def __init__(self, arguments: RouteArguments, dots: tuple, g_dtype: torch.dtype, poison: bool):
        self.arguments, self.poison = arguments, poison
        self.dot_queries, self.dot_keys, self.dots_scale, self.dots_dtype = dots
        self.labels = Labels(arguments.labels)
        # G over dot products of its own element size (fp16 dots, half-precision G) overwrites
        # them in place: each entry is read and written by the same thread.
        self.g_alone = self.dots_dtype.itemsize == g_dtype.itemsize
        self.dots = None
        self.dot_views = {}

    def scratch(self, shape, dtype):
        device = self.dot_queries.device
        self.dots = torch.empty(shape, dtype=self.dots_dtype, device=device)
        return self.dots.view(dtype) if self.g_alone else torch.empty(shape, dtype=dtype, device=device)

    def row_panel(self, start, end):
        return dict(dot_queries=self.dot_queries[start:end], row_sums=self.arguments.row_sums[start:end],
                    softplus_sums=self.arguments.softplus_sums[start:end],
                    labels=self.labels.rows(start, end))

    def key_tile(self, start, end):
        return dict(dot_keys=self.dot_keys[start:end], labels=self.labels.keys(start, end))

    def write(self, row, tile, g):
        shape = tuple(g.shape)
        d = self.dot_views.get(shape)
        if d is None:
            d = self.dot_views[shape] = self.dots[: shape[0], : shape[1]]
        if self.poison:
            self.dots.fill_(float("nan"))
        add_product(d, row["dot_queries"], tile["dot_keys"].T, beta=0)
        sigmoid_from_dots(d, g, row["row_sums"], row["softplus_sums"], self.dots_scale, self.arguments.bias,
                          self.arguments.inv_g_scale, **row["labels"], **tile["labels"])


class GluonRoute:
    """The sigmoid one pass on Hopper: one Gluon kernel per super-tile computes its logits, G and
    the sums (:mod:`.gluon_sigmoid`)."""

    g_alone = True
    segments = None

    def __init__(self, arguments: RouteArguments):
        self.arguments = arguments

    def scratch(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.arguments.row_sums.device)

    def row_panel(self, start, end):
        queries = self.arguments.kernel.queries[start:end]
        return dict(queries=queries, row_sums=self.arguments.row_sums[start:end],
                    softplus_sums=self.arguments.softplus_sums[start:end],
                    descriptor=gluon_sigmoid.make_descriptor(queries, gluon_sigmoid.BLOCK_M))

    def key_tile(self, start, end):
        keys = self.arguments.kernel.keys[start:end]
        return dict(keys=keys, descriptor=gluon_sigmoid.make_descriptor(keys, gluon_sigmoid.BLOCK_N))

    def write(self, row, tile, g):
        a = self.arguments
        gluon_sigmoid.sigmoid_tile(row["queries"], tile["keys"], g, row["row_sums"], row["softplus_sums"],
                                   a.kernel.scale, a.bias, a.inv_g_scale,
                                   descriptors=(row["descriptor"], tile["descriptor"]))


def fp32_vector(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """What the kernels read as fp32 [n] (statistics and weights)."""
    return None if tensor is None else tensor.to(dtype=torch.float32).contiguous()


def add_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1) -> None:
    """accumulator (fp32, or the operands' dtype) = beta * accumulator + a @ b, with no rounded
    intermediate (beta = 0: overwritten, whatever it held, NaN included).

    Operands of the accumulator's dtype: one in-place addmm. Half operands on CUDA: cuBLAS
    accumulates into the fp32 buffer directly (``out_dtype``). Elsewhere (CPU under the
    interpreter, or a torch without ``out_dtype``): the product of fp32 copies.
    """
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a, b, beta=beta)
        return
    if a.is_cuda and _HAS_OUT_DTYPE[0]:
        try:
            torch.addmm(accumulator, a, b, out_dtype=accumulator.dtype, beta=beta, out=accumulator)
            return
        except (RuntimeError, TypeError):
            _HAS_OUT_DTYPE[0] = False  # an older torch: use the general path from now on
    accumulator.addmm_(a.to(accumulator.dtype), b.to(accumulator.dtype), beta=beta)


# Whether torch.addmm(..., out_dtype=) works here; cleared at the first failure.
_HAS_OUT_DTYPE = [True]


@contextlib.contextmanager
def _cublas_precision(dtype: torch.dtype, precision: str, device: torch.device):
    """The G K and G^T Q GEMMs of fp32 operands follow ``precision`` like the kernels' tl.dot:
    TF32 unless "ieee" ("auto" included, whatever torch's global default says)."""
    if device.type != "cuda" or dtype != torch.float32:
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision != "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _bounds(n: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(start + step, n)) for start in range(0, n, step)]
