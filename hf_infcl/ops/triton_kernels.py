"""Fused Triton kernels for the logit statistics of :mod:`hf_infcl.ops.spec`, and their launchers.

The kernels, none of which ever holds more than one ``BLOCK_M x BLOCK_N`` tile of logits:

* ``_stats_kernel`` (forward): one program owns a block of "outer" vectors and streams every
  "inner" vector past it, keeping an online log-sum-exp (softmax) or a running sum of softplus
  (sigmoid) per outer vector. With queries outer it gives the row statistic. For the symmetric
  loss the same tiles also yield each key's log-sum-exp over the program's rows, written as one
  partial per (row block, key) into a bounded buffer and merged by the launcher: the forward is
  ONE pass over the tiles. (With keys outer, the kernel gives the column statistic on its own;
  that second pass is kept as an option.) When there are too few outer blocks to fill the GPU,
  the inner range is split over several programs whose partial statistics are merged
  afterwards (a few floats per vector).

* ``_grad_tile_kernel`` (backward): one program per tile of a "super-tile" of R rows x C keys.
  It recomputes the logits of its tile once, forms both directions' probabilities in one
  expression G = w_r * exp(z - r) + w_c * exp(z - c) (or w_r * sigmoid(z)), masks them, adds the
  tile's row sums of G (for d bias) and writes G (divided by a GPU-resident scale when the
  caller scales it) to a bounded scratch buffer of R x C entries in the dtype of the GEMMs that
  follow. It reads its query and key tiles through TMA tensor descriptors where the GPU has
  them (``tensor_descriptor``); the statistics kernel measured slower that way and uses pointers.

Both kernels skip their mask tile, its where() and masked stores when every tile is whole and
no group mask is given (the ``FULL`` heuristic), and the bias add without a bias.

For the symmetric softmax loss both kernels take a second exponential per logit for the column
direction. Deriving the column terms from the row exponentials (per-row and per-column factors
about a midpoint of the tile's statistics) saves that exponential but needs the tile's range of
statistics (tile-wide reductions, each a barrier) and an exact fallback where it spreads too
far: measured on an H100 it cost more than the exponential, in the backward (3.6 -> 3.3 ms at
32k x 32k, c = 512, without it) as in the forward (``_column_lse``). Both load their operands
without masks where the tile's step along c divides c (``_dot_tile``). They call exp2 (the
hardware's exponential) on differences of logits. For TF32 and half-precision operands the
softmax kernels hold their logits in log2 units (the scale times log2(e)), which saves a multiply
per exponential (``_log2_units``); exact fp32 takes the differences in natural units, times
log2(e), since pre-scaled logits tripled the rounding error of those differences, which the fp32
tests at c = 1 caught.

* The two products dQ += G K and dK += G^T Q of that super-tile are then plain cuBLAS GEMMs.

* ``_sigmoid_from_dots_kernel`` (the sigmoid loss's one pass, by default): the same G and the
  softplus row sums from dot products that a cuBLAS GEMM already computed into a buffer, so that
  the tensor-core work runs at cuBLAS speed and this kernel does only the elementwise work (which
  is what bounds it; it is kept to ~18 instructions per logit).

* ``_merge_partials_kernel``: the partial statistics of the forward (splits of the inner range,
  the symmetric loss's column partials) merged by an online log-sum-exp, one launch.

* ``_combine_rows_kernel``: the O(m c) epilogues (:func:`hf_infcl.ops.key_blocks.combine_rows`:
  the positive logits, and the accumulators turned into the returned gradients) in one launch,
  one program per row.

Why G goes through a bounded scratch buffer instead of register accumulators (the question the
design leaves open for c = 512..1024): a row block's dQ accumulator is BLOCK_M x c fp32, i.e.
128 x 1024 x 4 B = 512 KiB for c = 1024, twice the register file of an SM. The alternatives each
cost more than they save:
  - splitting c across the grid means every c-slice recomputes the whole z tile (c / slice extra
    GEMM passes: 2-4 more passes at c = 512..1024);
  - fp32 atomics of partial dQ/dK per tile are 2 * BLOCK * c atomics per tile, about as many
    atomics as multiply-adds / BLOCK, which saturates L2;
  - a two-kernel dQ / dK scheme recomputes every tile twice (4 backward passes instead of 3).
Writing G once (2 bytes per logit in bf16) and reading it twice from GEMMs costs 6 bytes per
logit of memory traffic but keeps the backward at three GEMM-sized passes (recompute, dQ, dK),
each tile recomputed exactly once, with the two products running at cuBLAS speed. The buffer is
bounded (64 MiB by default), so memory stays O((m + k) c), never O(m k). In fp16, G is stored
divided by max|w| so that it never underflows when the weights are 1/m-small; the caller folds
the factor back into its accumulators (``hf_infcl.ops.triton_blocks``). What the three passes
cost against one cuBLAS GEMM pass is measured in ``benchmarks/triton_notes.md``.

Every index is int64, so m * k > 2^31 is fine; any m, k, c >= 1 works through load masks (c is
walked in ``BLOCK_K`` chunks, never reshaped). ``scale`` and ``bias`` are read through pointers,
so nothing waits on the host.

Under ``TRITON_INTERPRET=1`` (checked at import) every kernel runs one small fixed config and
upcasts its loads to fp32 before ``tl.dot``: the interpreter's half-precision dot is not exact.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from .tuning_store import TuningStore, tuning_key

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# HF_INFCL_TRITON_AUTOTUNE=0 uses one safe config per kernel: GPU tests compile many
# specialisations (dtype x loss x mask) and need not autotune each of them.
AUTOTUNE = os.environ.get("HF_INFCL_TRITON_AUTOTUNE", "1") != "0"
_UNTUNED = (128, 128, 32, 4, 3)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Keys of the autotuners: the width c and a coarse size class (tiny / medium / large problems),
# so a small first call does not fix the configuration of large ones. The autotuner adds the
# dtypes of tensor arguments to the key by itself.
_TUNE_KEY = ["c", "size_class"]


def problem_size_class(n_outer: int, n_inner: int) -> int:
    entries = n_outer * n_inner
    return 0 if entries < 2**22 else (1 if entries < 2**28 else 2)


# Autotuning candidates: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
_STATS_SHAPES = [
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 32, 8, 4),
    (64, 64, 64, 4, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 2),
    # Wide c (768-1024): fewer, longer steps along c per tile.
    (128, 128, 128, 8, 3),
    (64, 128, 128, 4, 3),
]
_GRAD_SHAPES = [
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 32, 8, 4),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 2),
    (128, 128, 128, 8, 3),
    (128, 256, 128, 8, 2),
    # Narrow row blocks: fewer registers per thread for the sigmoid loss's one-pass epilogue.
    (64, 128, 32, 4, 5),
    (64, 256, 64, 8, 3),
]


# The block size that gives the rows of each tensor-descriptor argument's blocks (the columns:
# BLOCK_K). A host-side descriptor carries its block shape, which must be the config's.
_DESCRIPTOR_ROWS = {"q_desc": "BLOCK_M", "k_desc": "BLOCK_N"}


def _set_descriptor_blocks(nargs: dict) -> None:
    """Every config's pre-hook: the launch's tensor descriptors take the config's block shapes."""
    for name, rows in _DESCRIPTOR_ROWS.items():
        descriptor = nargs.get(name)
        if isinstance(descriptor, TensorDescriptor):
            descriptor.block_shape = [nargs[rows], nargs["BLOCK_K"]]


# A config as the autotuners hold it (also the tuning store's loaded ones): with that pre-hook.
_tuned_config = functools.partial(triton.Config, pre_hook=_set_descriptor_blocks)


def _configs(shapes):
    """The autotuner's configs: one small fixed config under the interpreter, one safe config
    with HF_INFCL_TRITON_AUTOTUNE=0, else every candidate shape."""
    if INTERPRET:
        return [_tuned_config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1)]
    if not AUTOTUNE:
        shapes = [_UNTUNED]
    return [
        _tuned_config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


def _stats_configs():
    return _configs(_STATS_SHAPES)


# The smallest row block of any stats config: column-partial buffers have a row per such block.
MIN_BLOCK_M = min(config.kwargs["BLOCK_M"] for config in _stats_configs())
# The widest inner block of any stats config: automatic splits of the inner range are whole
# multiples of it, so that every config sees whole tiles (FULL) when the problem has them.
_MAX_BLOCK_N = max(config.kwargs["BLOCK_N"] for config in _stats_configs())


def _grad_configs():
    return _configs(_GRAD_SHAPES)


# --------------------------------------------------------------------------------------------
# Device functions


@triton.jit
def _dot_tile(a_ptr, b_ptr, a_desc, b_desc, a_index, b_index, a_valid, b_valid, a_start, b_start, c,
              stride_a, stride_b, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """<A_a, B_b> for a BLOCK_A x BLOCK_B tile, walking the width c in BLOCK_K chunks (fp32).

    TMA: the chunks come through the tensor descriptors ``a_desc`` / ``b_desc`` (blocks of
    BLOCK_A / BLOCK_B rows from row ``a_start`` / ``b_start``; the copy engine fills rows and
    columns past the end with zeros). Otherwise through pointers: rows past the end (not
    ``a_valid`` / ``b_valid``) read row 0 instead of being masked, so the loads carry no mask at
    all when BLOCK_K divides c (``EVEN_K``). With the exact column log-sum-exp below, that took
    the statistics kernel from 3.76 to 3.09 ms and the gradient-tile kernel from 3.81 to 3.61 ms
    at 32k x 32k, c = 512, on an H100 (benchmarks/triton_notes.md). Either way the dot products
    of rows past the end are meaningless, and every caller discards them with where() on its
    ``allowed`` tile, never with a product."""
    acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
    if TMA:
        for c0 in range(0, c, BLOCK_K):
            a = a_desc.load([a_start, c0])
            b = b_desc.load([b_start, c0])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        return acc
    width = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + tl.where(a_valid, a_index, 0)[:, None] * stride_a
    b_rows = b_ptr + tl.where(b_valid, b_index, 0)[:, None] * stride_b
    for c0 in range(0, c, BLOCK_K):
        cols = c0 + width
        if EVEN_K:
            a = tl.load(a_rows + cols[None, :])
            b = tl.load(b_rows + cols[None, :])
        else:
            in_width = cols[None, :] < c
            a = tl.load(a_rows + cols[None, :], mask=in_width, other=0.0)
            b = tl.load(b_rows + cols[None, :], mask=in_width, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS: tl.constexpr, LOG2: tl.constexpr):
    """The logit scale and bias (0 without one) as fp32, read on the device, in the kernel's
    units (:func:`_in_units`)."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr).to(tl.float32)
    else:
        bias = 0.0
    return _in_units(scale, LOG2), _in_units(bias, LOG2)


@triton.jit
def _logits(dots, scale, bias, HAS_BIAS: tl.constexpr):
    """scale * dots (+ bias). Without a bias there is no add at all: the compiler may not drop
    ``+ 0.0`` (-0.0 + 0.0 is +0.0), and that add was one instruction per logit."""
    if HAS_BIAS:
        return dots * scale + bias
    else:
        return dots * scale


# PTX approximate instructions (one special-function operation each) where the kernels run on a
# GPU; the interpreter has no inline assembly and divides.
_PTX = tl.constexpr(not INTERPRET)


@triton.jit
def _reciprocal(x):
    """1 / x to 1 ulp (rcp.approx: one special-function operation; IEEE division costs several)."""
    if _PTX:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def _log1p(u):
    """log(1 + u) for -1/4 <= u <= 1, to fp32 accuracy relative to the result.

    log1p(u) = 2 atanh(t) = 2 t (1 + t^2/3 + ... + t^14/15), t = u / (2 + u), -1/7 <= t <= 1/3:
    the truncated series is below fp32's rounding (the next term is < 4e-9 relative); relative
    accuracy holds for the tiny u of very negative logits (no 1 + u that rounds away u); and it
    costs one reciprocal and eight fused multiply-adds where a library logarithm cost about 25
    instructions. This elementwise work, not memory, bounds the sigmoid loss's elementwise pass
    (``benchmarks/triton_notes.md``)."""
    t = u * _reciprocal(2.0 + u)
    t2 = t * t
    series = 1.0 / 15.0
    series = series * t2 + 1.0 / 13.0
    series = series * t2 + 1.0 / 11.0
    series = series * t2 + 1.0 / 9.0
    series = series * t2 + 1.0 / 7.0
    series = series * t2 + 1.0 / 5.0
    series = series * t2 + 1.0 / 3.0
    two_t = 2.0 * t
    return two_t + two_t * (t2 * series)


@triton.jit
def _softplus(z):
    """log(1 + e^z) = max(z, 0) + log1p(e^-|z|): no overflow, and the small values of very
    negative z kept."""
    return tl.maximum(z, 0.0) + _log1p(tl.exp2(-tl.abs(z) * LOG2E))


@triton.jit
def _sigmoid_and_exponential(z):
    """(sigmoid(z), u = e^-|z|): sigmoid(z) = r for z >= 0 and u r below, r = 1 / (1 + u) (one
    exponential, one approximate reciprocal); u is what softplus(z) = max(z, 0) + log1p(u) needs."""
    u = tl.exp2(-tl.abs(z) * LOG2E)
    return _reciprocal(1.0 + u) * tl.where(z >= 0.0, 1.0, u), u


@triton.jit
def _sigmoid_and_softplus(z):
    """(sigmoid(z), softplus(z)) sharing one exponential (``_sigmoid_and_exponential``)."""
    sigmoid, u = _sigmoid_and_exponential(z)
    return sigmoid, tl.maximum(z, 0.0) + _log1p(u)


@triton.jit
def _allowed(row_index, key_index, row_valid, key_valid, row_group_ptr, key_group_ptr,
             positive_ptr, key_offset, HAS_MASK: tl.constexpr):
    """Boolean [rows, keys] tile of the contract's masking (positives always allowed)."""
    allowed = row_valid[:, None] & key_valid[None, :]
    if HAS_MASK:
        row_group = tl.load(row_group_ptr + row_index, mask=row_valid, other=0)
        key_group = tl.load(key_group_ptr + key_index, mask=key_valid, other=0)
        positive = tl.load(positive_ptr + row_index, mask=row_valid, other=-1)
        is_positive = positive[:, None] == (key_offset + key_index)[None, :]
        allowed = allowed & ((row_group[:, None] != key_group[None, :]) | is_positive)
    return allowed


@triton.jit
def _hardness_offset(logits, dots, row_index, key_index, row_valid, key_valid, query_id_ptr, key_owner_ptr,
                     positive_ptr, key_offset, strength, HARDNESS: tl.constexpr):
    """The row statistic's logits of a [rows, keys] tile: ``logits`` + strength * dots where the
    contract's hardness offset selects (HARDNESS: 1 in-batch, 2 hard, 3 all negatives; a negative
    owner is nobody's, a row's positive is never offset). The offset is a constant of the loss,
    so the backward's G keeps flowing through the scaled dots only."""
    query_id = tl.load(query_id_ptr + row_index, mask=row_valid, other=-1)
    owner = tl.load(key_owner_ptr + key_index, mask=key_valid, other=-1)
    positive = tl.load(positive_ptr + row_index, mask=row_valid, other=-1)
    selected = (owner[None, :] >= 0) & (positive[:, None] != (key_offset + key_index)[None, :])
    if HARDNESS == 1:
        selected = selected & (owner[None, :] != query_id[:, None])
    elif HARDNESS == 2:
        selected = selected & (owner[None, :] == query_id[:, None])
    return logits + tl.where(selected, strength * dots, 0.0)


@triton.jit
def _in_units(x, LOG2: tl.constexpr):
    """x (a logit, a statistic, a factor of the logits) in the kernel's units: times log2(e) in
    log2 units (:func:`_log2_units`), else as it is."""
    if LOG2:
        return x * LOG2E
    else:
        return x


@triton.jit
def _exp_in_units(x, LOG2: tl.constexpr):
    """e^x for x in the kernel's units (:func:`_log2_units`): exp2(x) in log2 units."""
    if LOG2:
        return tl.exp2(x)
    else:
        return tl.exp2(x * LOG2E)


@triton.jit
def _log_in_units(x, LOG2: tl.constexpr):
    """log(x) in the kernel's units (log2 in log2 units)."""
    if LOG2:
        return tl.log2(x)
    else:
        return tl.log(x)


@triton.jit
def _column_lse(logits, LOG2: tl.constexpr):
    """Log-sum-exp of each column of a tile of logits, each column shifted by its own maximum,
    in the logits' units (:func:`_log2_units`).

    A second exponential per logit and a reduction across the tile's rows. Reusing the rows'
    exponentials (one shift for the whole tile) saves both, but loses the terms of rows more than
    ~87 below the tile's largest logit (CLIP's scale of 100 spreads logits by 200), and the check
    for that and the exact fallback it needs cost more registers and a cross-warp reduction than
    the exponential saves: with the unmasked loads of ``_dot_tile``, dropping them took the
    statistics pass from 3.76 to 3.09 ms at 32k x 32k, c = 512, on an H100
    (benchmarks/triton_notes.md)."""
    col_max = tl.max(logits, axis=0)
    col_shift = tl.where(col_max == float("-inf"), 0.0, col_max)
    return col_shift + _log_in_units(tl.sum(_exp_in_units(logits - col_shift[None, :], LOG2), axis=0), LOG2)


# --------------------------------------------------------------------------------------------
# Forward: row statistic (queries outer) or column log-sum-exp (keys outer)


@triton.jit
def _stats_kernel_body(
    outer_ptr, inner_ptr, out_ptr, col_partial_ptr, scale_ptr, bias_ptr,
    row_group_ptr, key_group_ptr, positive_ptr, key_offset, query_id_ptr, key_owner_ptr, hardness_ptr,
    n_outer, n_inner, c, stride_outer, stride_inner, inner_per_split, size_class,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COLUMNS: tl.constexpr, SIGMOID: tl.constexpr,
    FUSED_COLUMNS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, HARDNESS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    FULL: tl.constexpr, LOG2: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    outer_index = pid * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    outer_valid = outer_index < n_outer
    inner_start = split * inner_per_split
    inner_end = tl.minimum(inner_start + inner_per_split, n_inner)

    scale, bias = _scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, LOG2)
    if HARDNESS != 0:  # rows outer only: the column statistic is of the plain logits
        strength = _in_units(tl.load(hardness_ptr).to(tl.float32), LOG2)

    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(inner_start, inner_end, BLOCK_N):
        inner_index = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        inner_valid = inner_index < inner_end
        # Pointer loads (TMA False): through tensor descriptors this kernel measured slower (3.07
        # -> 3.42 ms at 32k x 32k, c = 512, bf16, H100), unlike the gradient-tile kernel.
        dots = _dot_tile(outer_ptr, inner_ptr, None, None, outer_index, inner_index, outer_valid, inner_valid,
                         0, 0, c, stride_outer, stride_inner, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                         EVEN_K, False)
        logits = _logits(dots, scale, bias, HAS_BIAS)
        # Full blocks (FULL) without a group mask allow every pair: no mask tile at all.
        if HAS_MASK or not FULL:
            if COLUMNS:
                # The tile is transposed (keys x rows): build the mask in (rows, keys) order.
                allowed = tl.trans(_allowed(inner_index, outer_index, inner_valid, outer_valid,
                                            row_group_ptr, key_group_ptr, positive_ptr, key_offset, HAS_MASK))
            else:
                allowed = _allowed(outer_index, inner_index, outer_valid, inner_valid,
                                   row_group_ptr, key_group_ptr, positive_ptr, key_offset, HAS_MASK)
        if SIGMOID:
            terms = _softplus(logits)
            if HAS_MASK or not FULL:
                terms = tl.where(allowed, terms, 0.0)
            running_sum += tl.sum(terms, axis=1)
        else:
            if HARDNESS != 0:
                # The columns' logits, kept before the rows' offset replaces them.
                plain_logits = logits
                if HAS_MASK or not FULL:
                    plain_logits = tl.where(allowed, logits, float("-inf"))
                logits = _hardness_offset(logits, dots, outer_index, inner_index, outer_valid, inner_valid,
                                          query_id_ptr, key_owner_ptr, positive_ptr, key_offset, strength,
                                          HARDNESS)
            if HAS_MASK or not FULL:
                logits = tl.where(allowed, logits, float("-inf"))
            # The tile's own row maxima shift its exponentials. A row with nothing allowed has
            # max -inf: shift by 0 there.
            tile_max = tl.max(logits, axis=1)
            tile_shift = tl.where(tile_max == float("-inf"), 0.0, tile_max)
            p = _exp_in_units(logits - tile_shift[:, None], LOG2)
            new_max = tl.maximum(running_max, tile_max)
            new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            # exp2(-inf - shift) = 0 takes care of rows and tiles with nothing allowed.
            running_sum = (running_sum * _exp_in_units(running_max - new_shift, LOG2)
                           + tl.sum(p, axis=1) * _exp_in_units(tile_max - new_shift, LOG2))
            running_max = new_max
            if FUSED_COLUMNS:
                # The same tile's column log-sum-exp over this program's rows: one partial per
                # (row block, key), merged by the launcher. Saves the second forward pass.
                if HARDNESS != 0:  # the columns' statistic is of the plain logits, without the offset
                    col_lse = _column_lse(plain_logits, LOG2)
                else:
                    col_lse = _column_lse(logits, LOG2)
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
        result = shift + _log_in_units(running_sum, LOG2)  # log(0) = -inf for rows that saw no allowed key
        if LOG2:
            result *= LN2
    tl.store(out_ptr + split * n_outer + outer_index, result, mask=outer_valid)


def _even_k(args: dict) -> bool:
    """EVEN_K: the step along c divides c, so ``_dot_tile``'s loads need no mask."""
    return args["c"] % args["BLOCK_K"] == 0


def _log2_units(args: dict) -> bool:
    """LOG2: the softmax loss's logits are held in log2 units (scale, bias and hardness strength
    times log2(e); statistics converted where they are loaded or stored), so that each
    exponential is exp2 of a difference: one multiply per logit and direction fewer. Not for
    exact fp32 ("ieee"): pre-scaled logits round to ~1e-7 of |z|, i.e. up to 1e-5 of e^z at
    CLIP's |z| of 100, which the fp32 tests at c = 1 once caught (v9 in
    benchmarks/triton_notes.md); TF32 and half-precision operands round their logits far more."""
    return args["PRECISION"] != "ieee" and not args["SIGMOID"]


# Heuristics, not launcher arguments: the block sizes are the autotuned config's. FULL: every
# program's tiles lie inside the problem, so that without a group mask no tile needs a mask
# (for the statistics kernel, each split's inner range is whole blocks too).
_STATS_HEURISTICS = {
    "EVEN_K": _even_k,
    "LOG2": _log2_units,
    "FULL": lambda args: (args["n_outer"] % args["BLOCK_M"] == 0 and args["n_inner"] % args["BLOCK_N"] == 0
                          and args["inner_per_split"] % args["BLOCK_N"] == 0),
}
_GRAD_HEURISTICS = {
    "EVEN_K": _even_k,
    "LOG2": _log2_units,
    "FULL": lambda args: args["n_rows"] % args["BLOCK_M"] == 0 and args["n_keys"] % args["BLOCK_N"] == 0,
}

# restore_value: configs with a smaller BLOCK_M write more rows of the column-partial buffer.
# Without it, rows written by a trial config and not overwritten by the chosen one would stay
# in the buffer after tuning and be merged as if they were real partials.
_stats_kernel = triton.autotune(configs=_stats_configs(), key=_TUNE_KEY, restore_value=["col_partial_ptr"])(
    triton.heuristics(_STATS_HEURISTICS)(_stats_kernel_body)
)


# --------------------------------------------------------------------------------------------
# Backward: G of one super-tile, written to a scratch buffer


@triton.jit
def _grad_tile_kernel_body(
    q_ptr, k_ptr, q_desc, k_desc, g_ptr, row_sums_ptr, softplus_sums_ptr, scale_ptr, bias_ptr,
    inv_g_scale_ptr, row_stat_ptr, col_stat_ptr, row_weight_ptr, col_weight_ptr,
    row_group_ptr, key_group_ptr, positive_ptr, key_offset, query_id_ptr, key_owner_ptr, hardness_ptr,
    n_rows, n_keys, c, stride_q, stride_k, stride_g, size_class,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COLUMNS: tl.constexpr, SIGMOID: tl.constexpr,
    ONE_PASS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, HARDNESS: tl.constexpr,
    SCALED_G: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    FULL: tl.constexpr, LOG2: tl.constexpr,
):
    row_index = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    key_index = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_valid = row_index < n_rows
    key_valid = key_index < n_keys

    scale, bias = _scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, LOG2)
    dots = _dot_tile(q_ptr, k_ptr, q_desc, k_desc, row_index, key_index, row_valid, key_valid,
                     tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, c, stride_q, stride_k,
                     BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST, EVEN_K, TMA)

    # Full blocks (FULL) without a group mask allow every pair: no mask tile at all.
    if HAS_MASK or not FULL:
        allowed = _allowed(row_index, key_index, row_valid, key_valid, row_group_ptr, key_group_ptr,
                           positive_ptr, key_offset, HAS_MASK)
    logits = _logits(dots, scale, bias, HAS_BIAS)
    if ONE_PASS:
        # The sigmoid loss's one pass: unit row weights, and the softplus row sums (the row
        # statistic) from the same logits and the same exponential.
        grad, softplus = _sigmoid_and_softplus(logits)
        if HAS_MASK or not FULL:
            softplus = tl.where(allowed, softplus, 0.0)
        tl.atomic_add(softplus_sums_ptr + row_index, tl.sum(softplus, axis=1), mask=row_valid)
    elif SIGMOID:
        row_weight = tl.load(row_weight_ptr + row_index, mask=row_valid, other=0.0)
        grad = row_weight[:, None] * tl.sigmoid(logits)
    else:
        row_weight = tl.load(row_weight_ptr + row_index, mask=row_valid, other=0.0)
        row_stat = tl.load(row_stat_ptr + row_index, mask=row_valid, other=0.0)
        if HARDNESS != 0:
            strength = _in_units(tl.load(hardness_ptr).to(tl.float32), LOG2)
            row_logits = _hardness_offset(logits, dots, row_index, key_index, row_valid, key_valid,
                                          query_id_ptr, key_owner_ptr, positive_ptr, key_offset,
                                          strength, HARDNESS)
        else:
            row_logits = logits
        p_row = _exp_in_units(row_logits - _in_units(row_stat, LOG2)[:, None], LOG2)
        grad = row_weight[:, None] * p_row
        if COLUMNS:
            col_stat = tl.load(col_stat_ptr + key_index, mask=key_valid, other=0.0)
            col_weight = tl.load(col_weight_ptr + key_index, mask=key_valid, other=0.0)
            # Their own exponential (see the module docstring). Where col_stat is -inf (a key no
            # row may pair with), p_col is inf and col_weight 0: the where() below drops it.
            p_col = _exp_in_units(logits - _in_units(col_stat, LOG2)[None, :], LOG2)
            grad += col_weight[None, :] * p_col
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


_grad_tile_kernel = triton.autotune(
    configs=_grad_configs(), key=_TUNE_KEY, reset_to_zero=["row_sums_ptr", "softplus_sums_ptr"]
)(triton.heuristics(_GRAD_HEURISTICS)(_grad_tile_kernel_body))


# --------------------------------------------------------------------------------------------
# The sigmoid loss's one pass from dot products that cuBLAS computed

# (BLOCK_M, BLOCK_N, warps, key blocks per program): wide along the keys (16-byte loads and stores
# per thread), a few rows, and several key blocks per program so that the row sums are reduced
# across threads (shuffles) and added atomically once per program, not once per block. The
# interpreter runs small blocks.
# (16, 256, 4, 8) measured best of eight shapes at 64k x 768 on an H100 (benchmarks/triton_notes.md).
_SIGMOID_DOTS_SHAPE = (16, 32, 1, 2) if INTERPRET else (16, 256, 4, 8)


@triton.jit
def _product_minus_one(a, b):
    """(1 + a)(1 + b) - 1, never forming 1 + a: for positive a, b every rounding is relative to
    the result, so small products keep their relative accuracy."""
    return a + b + a * b


@triton.jit
def _log1p_of_positive(x):
    """log(1 + x) for 0 <= x < 2^100, to a few ulps relative: w = 1 + x = 2^e m with m in
    [0.75, 1.5) (e and 2^-e from w's exponent bits, exact), log(m) = _log1p(m - 1) (m - 1 is
    exact), and (x - (w - 1)) / w restores what rounding w lost (tiny x keep their relative
    accuracy). About 20 instructions; the kernels' logarithms are approximate (lg2.approx) to
    2^-22 absolute, i.e. useless for small x."""
    w = 1.0 + x
    exponent = ((w * (4.0 / 3.0)).to(tl.int32, bitcast=True) >> 23) - 127
    m = w * ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    return exponent.to(tl.float32) * LN2 + _log1p(m - 1.0) + (x - (w - 1.0)) * _reciprocal(w)


@triton.jit
def _sigmoid_from_dots_kernel(
    dots_ptr, g_ptr, row_sums_ptr, softplus_sums_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr,
    row_group_ptr, key_group_ptr, positive_ptr, key_offset,
    n_rows, n_keys, stride_dots, stride_g,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SCALED_G: tl.constexpr, FULL_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_BLOCKS: tl.constexpr,
):
    """G = sigmoid(z) (masked) of fp32 or fp16 dot products, z = scale * dots + bias, with the row
    sums of G and of softplus(z) added atomically: what ``_grad_tile_kernel`` does in its
    one-pass mode, minus the dot products. A program takes BLOCK_M rows x KEY_BLOCKS * BLOCK_N
    keys; FULL_BLOCKS: every program's block lies inside the tile (no bounds masks).

    Elementwise work, not memory, bounded this kernel, so each logit costs few instructions:
    u = e^-|z| (one exponential), r = 1 / (1 + u) (one approximate reciprocal); sigmoid(z) = r,
    or u r for z < 0; softplus(z) = max(z, 0) + log1p(u), and the log1p terms are summed as
    log1p of prod (1 + u) - 1 over the KEY_BLOCKS logits that one thread sees at one tile
    position (``_product_minus_one``: two operations per logit, and one log1p per KEY_BLOCKS
    logits where a log1p of each cost a dozen). Every operand is positive, so each rounding is
    relative to the partial result: the sums keep fp32's relative accuracy however small the
    u, and the product stays below 2^KEY_BLOCKS."""
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_M
    key_start = tl.program_id(1).to(tl.int64) * (KEY_BLOCKS * BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    row_index = row_start + rows
    row_valid = row_index < n_rows
    # In-program offsets are int32 (a program spans BLOCK_M rows of the tile); the int64 base
    # goes into the pointers once.
    dots_base = dots_ptr + row_start * stride_dots + key_start
    g_base = g_ptr + row_start * stride_g + key_start
    scale, bias = _scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, False)
    inv_g_scale = tl.load(inv_g_scale_ptr) if SCALED_G else 1.0
    grad_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    linear_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    excess = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # prod (1 + u) - 1 over the key blocks
    for block in range(KEY_BLOCKS):
        keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
        dots_offsets = rows[:, None] * stride_dots + keys[None, :]
        g_offsets = rows[:, None] * stride_g + keys[None, :]
        if FULL_BLOCKS:
            dots = tl.load(dots_base + dots_offsets)
        else:
            key_valid = key_start + keys < n_keys
            in_tile = row_valid[:, None] & key_valid[None, :]
            dots = tl.load(dots_base + dots_offsets, mask=in_tile, other=0.0)
        z = dots.to(tl.float32) * scale + bias
        grad, u = _sigmoid_and_exponential(z)
        linear = tl.maximum(z, 0.0)
        if HAS_MASK or not FULL_BLOCKS:
            key_index = key_start + keys
            allowed = _allowed(row_index, key_index, row_valid, key_index < n_keys, row_group_ptr,
                               key_group_ptr, positive_ptr, key_offset, HAS_MASK)
            grad = tl.where(allowed, grad, 0.0)
            linear = tl.where(allowed, linear, 0.0)
            u = tl.where(allowed, u, 0.0)
        grad_sum += grad
        linear_sum += linear
        excess = _product_minus_one(excess, u)
        if SCALED_G:
            grad = grad * inv_g_scale
        if FULL_BLOCKS:
            tl.store(g_base + g_offsets, grad.to(g_ptr.dtype.element_ty))
        else:
            tl.store(g_base + g_offsets, grad.to(g_ptr.dtype.element_ty), mask=in_tile)
    softplus_rows = tl.sum(linear_sum, axis=1) + tl.sum(_log1p_of_positive(excess), axis=1)
    tl.atomic_add(softplus_sums_ptr + row_index, softplus_rows, mask=row_valid)
    tl.atomic_add(row_sums_ptr + row_index, tl.sum(grad_sum, axis=1), mask=row_valid)


# --------------------------------------------------------------------------------------------
# The O(m c) epilogues (hf_infcl.ops.key_blocks.combine_rows) in one launch

# Columns per step of a row: up to 1024 (c = 768 takes one masked step).
_COMBINE_MAX_BLOCK = 64 if INTERPRET else 1024


@triton.jit
def _combine_rows_kernel(
    out_ptr, accumulator_ptr, weight_ptr, sources_ptr, source_index_ptr, source_weight_ptr, offsets_ptr,
    scale_ptr, dot_with_ptr, dots_ptr, width, n_sources, stride_out, stride_accumulator, stride_sources,
    stride_dot_with, stride_weight, stride_source_weight,
    HAS_OUT: tl.constexpr, HAS_ACCUMULATOR: tl.constexpr, WEIGHT: tl.constexpr,
    HAS_SOURCE_WEIGHT: tl.constexpr, ONE_ENTRY_PER_ROW: tl.constexpr, INDEXED: tl.constexpr,
    HAS_DOTS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program per row r: v = w * accumulator[r] + sum_t source_weight[t] * sources[source_index[t]]
    over the row's entries t in [offsets[r], offsets[r + 1]) (t = r with ONE_ENTRY_PER_ROW), in
    fp32; stores scale * v into out[r] and <v, dot_with[r]> into dots[r]. WEIGHT: 0 none, 1 one
    per row, 2 one for all rows. Without INDEXED, entry t takes sources[t], and (one entry per
    row) rows from n_sources on have none."""
    row = tl.program_id(0).to(tl.int64)
    if ONE_ENTRY_PER_ROW:
        first = row
        if INDEXED:
            last = row + 1
        else:
            last = tl.where(row < n_sources, row + 1, row)
    else:
        first = tl.load(offsets_ptr + row)
        last = tl.load(offsets_ptr + row + 1)
    if WEIGHT == 1:
        weight = tl.load(weight_ptr + row * stride_weight).to(tl.float32)
    elif WEIGHT == 2:
        weight = tl.load(weight_ptr).to(tl.float32)
    else:
        weight = 1.0
    scale = tl.load(scale_ptr).to(tl.float32) if HAS_OUT else 1.0
    dot = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for column_start in range(0, width, BLOCK_C):
        columns = column_start + tl.arange(0, BLOCK_C)
        valid = columns < width
        value = tl.zeros((BLOCK_C,), dtype=tl.float32)
        if HAS_ACCUMULATOR:
            value = tl.load(accumulator_ptr + row * stride_accumulator + columns, mask=valid,
                            other=0.0).to(tl.float32) * weight
        for entry in range(first, last):
            if INDEXED:
                source = tl.load(source_index_ptr + entry).to(tl.int64)
            else:
                source = entry
            added = tl.load(sources_ptr + source * stride_sources + columns, mask=valid,
                            other=0.0).to(tl.float32)
            if HAS_SOURCE_WEIGHT:
                added = added * tl.load(source_weight_ptr + entry * stride_source_weight).to(tl.float32)
            value += added
        if HAS_DOTS:
            dot += value * tl.load(dot_with_ptr + row * stride_dot_with + columns, mask=valid,
                                   other=0.0).to(tl.float32)
        if HAS_OUT:
            tl.store(out_ptr + row * stride_out + columns, (value * scale).to(out_ptr.dtype.element_ty),
                     mask=valid)
    if HAS_DOTS:
        tl.store(dots_ptr + row, tl.sum(dot, axis=0))


# --------------------------------------------------------------------------------------------
# Partial statistics merged (the statistics kernel's splits and column partials) in one launch

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


# Tuned configurations persist on disk (hf_infcl.ops.tuning_store): tuning is paid once per machine.
TUNING_STORE = TuningStore()


def reset_autotuning() -> None:
    """Forget the configurations the autotuners chose, so that the next call of each kernel tunes
    afresh (and saves its new choice): also the saved ones, for the rest of this process. The
    tuning keys are coarse (the width and a size class), so without this a benchmark sweeping
    sizes would time every size of a class with the configs tuned at the first one; after it,
    each size is tuned for itself, as a training run at that size would be."""
    for tuner in (_stats_kernel, _grad_tile_kernel):
        tuner.cache.clear()
    _CHOSEN.clear()
    _COMPILED.clear()
    TUNING_STORE.retune()


# Part of the names under which tuned configurations are saved: raise it when a kernel changes in
# a way that can change which configuration is fastest, so that machines tune the new kernel
# instead of loading the old kernel's choice. 2: unmasked loads, exact column log-sum-exp.
# 3: the gradient-tile kernel's column probabilities by their own exponential. 4: no mask tile,
# bias add or G scaling where a launch needs none (FULL, HAS_BIAS, SCALED_G). 5: softmax logits in
# log2 units (LOG2).
_KERNEL_REVISION = 5


# The configuration each (kernel, tuning key) ran with in this process, once it was tuned or
# loaded: later launches with that key go straight to the JIT function (see _launch).
_CHOSEN: dict[tuple, triton.Config] = {}


def _launch(tuner, name: str, grid, device: torch.device, *args, before_launch=None,
            **kwargs) -> triton.Config:
    """``tuner[grid](*args, **kwargs)``, with its tuned configuration loaded from, or saved to,
    the machine's tuning store; returns the configuration it ran (see :func:`_launch_tuned`).
    ``before_launch`` (optional) is called just before the kernel is launched, after the
    launch's own host work (the value check's synchronisation: see :func:`logit_stats`).

    A key launched before in this process skips the tuning store and the autotuner: their
    Python was ~0.2-0.4 ms per launch on an H100 machine's host, time the GPU waited for after
    the value check's synchronisation and that an 8k-row step (host-bound) paid in full."""
    if not _tunes():  # one config: nothing is tuned
        call_if_given(before_launch)
        tuner[grid](*args, **kwargs)
        return tuner.best_config
    key = tuning_key(tuner, args, kwargs)
    name = f"{name}-r{_KERNEL_REVISION}"
    config = _CHOSEN.get((name, key))
    call_if_given(before_launch)
    if config is not None:
        body, heuristics = _TUNED_BODIES[name]
        return _launch_tuned(body, heuristics, config, grid, *args, **kwargs)
    with TUNING_STORE.tuned(tuner, name, key, _device_name(device), triton.__version__, _tuned_config):
        tuner[grid](*args, **kwargs)
    _CHOSEN[(name, key)] = tuner.best_config
    return tuner.best_config


def _launch_tuned(kernel, heuristics: dict, config: triton.Config, grid, *args, **kwargs) -> triton.Config:
    """The launch of :func:`_launch` again with a configuration it returned for the same tuning
    key, straight to the JIT function (``kernel``: the one under the autotuner and its
    ``heuristics``, which this evaluates itself). The backward launches the gradient-tile kernel
    once per super-tile with one key, and the autotuner's and the heuristics' Python (~0.2 ms of
    a ~0.3 ms launch on an H100 machine's host, profiled) made the super-tile loop wait on the
    host: 32 launches at 32k x 32k, c = 512, took 10.1 ms of host time against ~7 ms of GPU
    work. A launch whose compiled kernel an earlier one ran goes past the JIT function too
    (:func:`_launch_compiled`)."""
    named = {**dict(zip(kernel.arg_names, args)), **kwargs, **config.kwargs}
    if config.pre_hook is not None:
        config.pre_hook(named)
    constexprs = {name: heuristic(named) for name, heuristic in heuristics.items()}
    named.update(constexprs)
    key = (kernel, id(config), _specialization(named.values()))
    compiled = _COMPILED.get(key)
    if compiled is not None:
        _launch_compiled(kernel, compiled[1], grid, named)
        return config
    compiled = kernel[grid](*args, **kwargs, **config.all_kwargs(), **constexprs)
    if not INTERPRET and all(hasattr(compiled, name) for name in _COMPILED_KERNEL_API):
        _COMPILED[key] = (config, compiled)  # the config kept alive, so that its id stays its own
    return config


# Compiled kernels that _launch_tuned ran, by (JIT function, id of the configuration,
# _specialization of the launch's arguments). The same key again launches the compiled kernel
# through its own launcher, past JITFunction.run: binding ~40 arguments, their specialisation and
# the cache-key string cost host time on every launch, and the backward's super-tile loop (a
# gradient-tile launch and two GEMMs per 8192 x 4096 super-tile at b = 32k, c = 512) waited on
# the host: ~250 us of host time per super-tile against ~190 us of GPU work on an H100 machine
# (benchmarks/triton_notes.md). The attributes Triton's own launch uses (3.6) are checked once;
# a Triton whose compiled kernels lack them keeps the JIT function's launch.
_COMPILED: dict[tuple, tuple] = {}
_COMPILED_KERNEL_API = ("run", "function", "packed_metadata", "launch_metadata")


def _specialization(values) -> tuple:
    """What a launch's compiled kernel depends on besides the configuration, for every argument
    value (constexprs included): a superset of what Triton specialises on (a tensor's dtype and
    16-byte alignment; an integer's width, divisibility by 16 and being 1; a tensor descriptor's
    dtype, alignment, shape, strides and block), so that two launches with one key never need
    two compilations. The converse (a new key for a kernel Triton already has) only costs one
    launch through the JIT function."""
    facts = []
    for value in values:
        if isinstance(value, torch.Tensor):
            facts.append((value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or value is None:
            facts.append(value)
        elif isinstance(value, int):
            facts.append((value == 1, value % 16 == 0, -(2**31) <= value < 2**31))
        elif isinstance(value, TensorDescriptor):
            facts.append((value.base.dtype, value.base.data_ptr() % 16 == 0, tuple(value.shape),
                          tuple(value.strides), tuple(value.block_shape), value.padding))
        else:  # strings and other constexpr values
            facts.append(value)
    return tuple(facts)


def _launch_compiled(kernel, compiled, grid, named: dict) -> None:
    """Launch ``compiled`` (a kernel of ``kernel`` that JITFunction.run compiled and returned for
    the same specialisation) as JITFunction.run does after its look-ups: the grid, the current
    stream, the launch hooks, and every parameter's value in the signature's order."""
    values = [named[name] for name in kernel.arg_names]
    grid = grid(named) if callable(grid) else grid
    device = triton.runtime.driver.active.get_current_device()
    stream = triton.runtime.driver.active.get_current_stream(device)
    hooks = knobs.runtime  # the launch hooks (proton, users' profilers), read per launch as Triton does
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, compiled.launch_metadata(grid, stream, *values),
                 hooks.launch_enter_hook, hooks.launch_exit_hook, *values)


def call_if_given(callback) -> None:
    """``callback()``, unless it is None (the ``before_launch`` and ``before_first_kernel`` hooks)."""
    if callback is not None:
        callback()


def _tunes() -> bool:
    """Whether the autotuners have several configurations to choose from (see :func:`_configs`)."""
    return AUTOTUNE and not INTERPRET


# The JIT function under each autotuned kernel, and its heuristics, by store name.
_TUNED_BODIES = {f"stats-r{_KERNEL_REVISION}": (_stats_kernel_body, _STATS_HEURISTICS),
                 f"grad_tile-r{_KERNEL_REVISION}": (_grad_tile_kernel_body, _GRAD_HEURISTICS)}


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


# --------------------------------------------------------------------------------------------
# Launchers


def dot_precision(dtype: torch.dtype, precision: str) -> str:
    """tl.dot input_precision: TF32 for fp32 unless "ieee"; half types ignore it."""
    if dtype == torch.float32 and precision == "ieee":
        return "ieee"
    return "tf32"


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_splits(n_outer: int, n_inner: int, device: torch.device) -> int:
    """How many programs share one outer block's inner range: about eight programs per SM
    (assuming 128-wide outer blocks), so that the last, partly filled wave of programs costs
    little, while each program still streams >= 2048 inner vectors. The partial statistics cost a
    few floats per vector and split to merge. (Why eight, measured: ``benchmarks/triton_notes.md``.)"""
    outer_blocks = math.ceil(n_outer / 128)
    wanted = math.ceil(8 * _sm_count(device) / outer_blocks)
    return max(1, min(wanted, n_inner // 2048))


def inner_splits(n_outer: int, n_inner: int, device: torch.device,
                 splits: int | None = None) -> tuple[int, int]:
    """(splits, inner vectors per split) of a statistics launch: ``splits`` as asked (at most one
    per inner vector), or by default :func:`auto_splits`'s count with each split's range rounded
    up to whole blocks of the widest config. Without that rounding, 32k keys in 5 splits of 6554
    left every split a partial tile, and the kernel's masked path (not FULL) ran on all of them."""
    if splits is None:
        per_split = math.ceil(n_inner / auto_splits(n_outer, n_inner, device))
        per_split = math.ceil(per_split / _MAX_BLOCK_N) * _MAX_BLOCK_N
    else:
        per_split = math.ceil(n_inner / max(1, min(splits, n_inner)))
    return math.ceil(n_inner / per_split), per_split


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Whether the GPU has the tensor memory accelerator (Hopper, compute capability 9, and later)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_aligned(tensor: torch.Tensor) -> bool:
    """Whether the copy engine can read ``tensor`` as [rows, c] blocks: 2-D, not empty, unit column
    stride, base address and row stride in bytes multiples of 16."""
    return (
        tensor.dim() == 2 and tensor.shape[0] > 0 and tensor.stride(1) == 1 and tensor.data_ptr() % 16 == 0
        and (tensor.stride(0) * tensor.element_size()) % 16 == 0
    )


def tensor_descriptor(tensor: torch.Tensor) -> TensorDescriptor | None:
    """A tensor descriptor of a [rows, c] operand where the copy engine can read it (a Hopper GPU
    or the interpreter; 16-byte aligned base and row stride, unit column stride), else None. Its
    block shape is set per config (``_set_descriptor_blocks``).

    Why: through descriptors the gradient-tile kernel took 3.15 -> 2.88 ms (32 super-tiles of
    8192 x 4096) at 32k x 32k, c = 512, bf16, on an H100 (``benchmarks/triton_notes.md``).
    """
    usable = INTERPRET or (tensor.is_cuda and _has_tma(tensor.device))
    if not (usable and tma_aligned(tensor)):
        return None
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), [16, 16])


@functools.cache
def _unused_pointer(device: torch.device) -> torch.Tensor:
    """A one-element buffer of this module's own (one per device) for pointer arguments that a
    kernel specialisation never reads.

    It must not be one of the caller's tensors: the autotuner restores ``col_partial_ptr`` (and
    zeroes ``row_sums_ptr``) around every trial, i.e. it copies into whatever tensor sits in that
    slot. Passing the logit scale there made the first, tuning call bump the version counter of
    the caller's ``logit_scale`` tensor and broke its autograd graph. Its contents never matter.
    """
    return torch.empty(1, dtype=torch.float32, device=device)


def logit_stats(
    outer: torch.Tensor,
    inner: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    sigmoid: bool,
    columns: bool,
    precision: str,
    row_groups: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
    positive_keys: torch.Tensor | None = None,
    key_offset: int = 0,
    splits: int | None = None,
    out: torch.Tensor | None = None,
    column_partials: torch.Tensor | None = None,
    query_ids: torch.Tensor | None = None,
    key_owners: torch.Tensor | None = None,
    hardness: int = 0,
    hardness_strength: torch.Tensor | None = None,
    before_launch=None,
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

    ``before_launch`` (optional): called just before the kernel's launch, after this launcher's
    own host work. The one-process value check goes there: its host synchronisation leaves the
    GPU idle until the next launch, and this launcher's Python before the launch took ~0.2 ms of
    that idle time at b = 32k on an H100 machine's host (``benchmarks/triton_notes.md``).
    """
    n_outer, c = outer.shape
    n_inner = inner.shape[0]
    splits, inner_per_split = inner_splits(n_outer, n_inner, outer.device, splits)
    if out is None:
        out = torch.empty((splits, n_outer), dtype=torch.float32, device=outer.device)
    has_mask = row_groups is not None
    dummy = _unused_pointer(outer.device)
    grid = lambda meta: (triton.cdiv(n_outer, meta["BLOCK_M"]), splits)  # noqa: E731
    fused = column_partials is not None
    _launch(
        _stats_kernel, "stats", grid, outer.device,
        outer, inner, out, column_partials if fused else dummy, scale,
        bias if bias is not None else dummy,
        row_groups if has_mask else dummy, key_groups if has_mask else dummy,
        *_pair_pointers(has_mask, hardness, positive_keys, key_offset, query_ids, key_owners,
                        hardness_strength, dummy),
        n_outer, n_inner, c, outer.stride(0), inner.stride(0), inner_per_split,
        problem_size_class(n_outer, n_inner),
        HAS_BIAS=bias is not None, HAS_MASK=has_mask, COLUMNS=columns, SIGMOID=sigmoid,
        FUSED_COLUMNS=fused, PRECISION=dot_precision(outer.dtype, precision), UPCAST=INTERPRET,
        HARDNESS=hardness, before_launch=before_launch,
    )
    if splits == 1:
        return out[0]
    return merge_partials(out, log_sum_exp=not sigmoid)


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
    _merge_partials_kernel[(triton.cdiv(n, _MERGE_BLOCK_N),)](
        partials, previous if previous is not None else out, out, n_parts, n, partials.stride(0),
        LOG_SUM_EXP=log_sum_exp, HAS_PREVIOUS=previous is not None, BLOCK_PARTS=_MERGE_BLOCK_PARTS,
        BLOCK_N=_MERGE_BLOCK_N, num_warps=4,
    )
    return out


def grad_tile(
    queries: torch.Tensor,
    keys: torch.Tensor,
    g_out: torch.Tensor,
    row_sums: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    inv_g_scale: torch.Tensor | None,
    row_stat: torch.Tensor,
    col_stat: torch.Tensor | None,
    row_weight: torch.Tensor,
    col_weight: torch.Tensor | None,
    *,
    sigmoid: bool,
    precision: str,
    row_groups: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
    positive_keys: torch.Tensor | None = None,
    key_offset: int = 0,
    size_class: int | None = None,
    softplus_sums: torch.Tensor | None = None,
    query_ids: torch.Tensor | None = None,
    key_owners: torch.Tensor | None = None,
    hardness: int = 0,
    hardness_strength: torch.Tensor | None = None,
    config: triton.Config | None = None,
    descriptors: tuple | None = None,
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
    of the offset logits, as in :func:`logit_stats`; the column ones are not.

    ``config``: what an earlier call returned, for a call with the same tuning key (the same
    ``size_class``, width and dtypes, the same options): it is launched without the autotuner's
    and the tuning store's look-ups, which cost more host time than a super-tile's GPU work.

    ``descriptors``: (:func:`tensor_descriptor` of ``queries``, of ``keys``), made once by a caller
    that launches many tiles over the same row panels and key tiles (their construction and checks
    were host time on every super-tile); by default made here.
    """
    n_rows, c = queries.shape
    n_keys = keys.shape[0]
    has_mask = row_groups is not None
    columns = col_stat is not None
    dummy = _unused_pointer(queries.device)
    grid = lambda meta: (triton.cdiv(n_rows, meta["BLOCK_M"]), triton.cdiv(n_keys, meta["BLOCK_N"]))  # noqa: E731
    one_pass = softplus_sums is not None
    if one_pass and not sigmoid:
        raise ValueError("softplus_sums is for the sigmoid loss")
    launch = (functools.partial(_launch_tuned, _grad_tile_kernel_body, _GRAD_HEURISTICS, config, grid)
              if config is not None
              else functools.partial(_launch, _grad_tile_kernel, "grad_tile", grid, queries.device))
    if descriptors is None:
        descriptors = tensor_descriptor(queries), tensor_descriptor(keys)
    # Both operands through descriptors, or both through pointers.
    tma = None not in descriptors
    q_desc, k_desc = descriptors if tma else (queries, keys)
    return launch(
        queries, keys, q_desc, k_desc, g_out, row_sums, softplus_sums if one_pass else dummy, scale,
        bias if bias is not None else dummy, inv_g_scale if inv_g_scale is not None else dummy,
        row_stat, col_stat if columns else dummy, row_weight, col_weight if columns else dummy,
        row_groups if has_mask else dummy, key_groups if has_mask else dummy,
        *_pair_pointers(has_mask, hardness, positive_keys, key_offset, query_ids, key_owners,
                        hardness_strength, dummy),
        n_rows, n_keys, c, queries.stride(0), keys.stride(0), g_out.stride(0),
        size_class if size_class is not None else problem_size_class(n_rows, n_keys),
        HAS_BIAS=bias is not None, HAS_MASK=has_mask, COLUMNS=columns, SIGMOID=sigmoid, ONE_PASS=one_pass,
        PRECISION=dot_precision(queries.dtype, precision), UPCAST=INTERPRET, HARDNESS=hardness,
        SCALED_G=inv_g_scale is not None, TMA=tma,
    )


def sigmoid_from_dots(
    dots: torch.Tensor,
    g_out: torch.Tensor,
    row_sums: torch.Tensor,
    softplus_sums: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    inv_g_scale: torch.Tensor | None,
    *,
    row_groups: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
    positive_keys: torch.Tensor | None = None,
    key_offset: int = 0,
) -> None:
    """The sigmoid loss's one pass over a super-tile whose dot products ``dots`` [rows, keys]
    (fp32 or fp16, last stride 1) are already computed: write sigmoid(scale * dots + bias) / g_scale
    (``inv_g_scale`` 0-d, or None for 1),
    masked, into ``g_out`` (same shape: ``dots`` itself reinterpreted, when the element sizes
    match, or a separate buffer; no partial overlap) and add the row sums of G
    and of the softplus terms into ``row_sums`` and ``softplus_sums`` (fp32 [rows], atomically).
    The result equals :func:`grad_tile` with ``softplus_sums`` given, up to the rounding of the
    dot products."""
    n_rows, n_keys = dots.shape
    has_mask = row_groups is not None
    dummy = _unused_pointer(dots.device)
    block_m, block_n, warps, key_blocks = _SIGMOID_DOTS_SHAPE
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_keys, block_n * key_blocks))
    if block_m * max(dots.stride(0), g_out.stride(0)) >= 2**31:
        raise ValueError("a super-tile row block too large for the kernel's int32 offsets")
    _sigmoid_from_dots_kernel[grid](
        dots, g_out, row_sums, softplus_sums, scale, bias if bias is not None else dummy,
        inv_g_scale if inv_g_scale is not None else dummy,
        row_groups if has_mask else dummy, key_groups if has_mask else dummy,
        positive_keys if has_mask else dummy, key_offset,
        n_rows, n_keys, dots.stride(0), g_out.stride(0),
        HAS_BIAS=bias is not None, HAS_MASK=has_mask, SCALED_G=inv_g_scale is not None,
        FULL_BLOCKS=n_rows % block_m == 0 and n_keys % (block_n * key_blocks) == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, KEY_BLOCKS=key_blocks, num_warps=warps,
    )


def combine_rows(*, rows: int, sources, source_index, source_weight=None, entry_rows=None, accumulator=None,
                 weight=None, out=None, scale=None, dot_with=None):
    """:func:`hf_infcl.ops.key_blocks.combine_rows` in one launch (fp32 arithmetic; sources of
    fp32, fp16 or bf16, an fp32 accumulator). No host synchronisation: the rows' entry ranges
    are found on the device, and ``source_index`` None (the identity) needs none."""
    device = sources.device
    dummy = _unused_pointer(device)
    dots = torch.empty(rows, dtype=torch.float32, device=device) if dot_with is not None else None
    if rows == 0:
        return dots
    offsets = None
    if entry_rows is not None:
        row_starts = torch.arange(rows + 1, device=device, dtype=entry_rows.dtype)
        offsets = torch.searchsorted(entry_rows, row_starts)
    width = sources.shape[1]
    weight_kind = 0 if weight is None else (2 if weight.dim() == 0 else 1)
    # The weights are read through their strides: a loss's backward hands in expanded ones
    # (stride 0), which need no copy.
    source_index = None if source_index is None else source_index.contiguous()

    def pointer(tensor):  # an empty slice's address may lie past its allocation: never passed
        return dummy if tensor is None or tensor.numel() == 0 else tensor

    def stride(tensor):
        return 0 if tensor is None else tensor.stride(0)

    for tensor in (sources, accumulator, out, dot_with):
        if tensor is not None and tensor.stride(-1) != 1:
            raise ValueError("combine_rows needs rows with unit column stride")
    _combine_rows_kernel[(rows,)](
        pointer(out), pointer(accumulator), pointer(weight), pointer(sources), pointer(source_index),
        pointer(source_weight), pointer(offsets), pointer(scale), pointer(dot_with), pointer(dots), width,
        sources.shape[0], stride(out), stride(accumulator), sources.stride(0), stride(dot_with),
        stride(weight) if weight_kind == 1 else 0, stride(source_weight),
        HAS_OUT=out is not None, HAS_ACCUMULATOR=accumulator is not None, WEIGHT=weight_kind,
        HAS_SOURCE_WEIGHT=source_weight is not None, ONE_ENTRY_PER_ROW=entry_rows is None,
        INDEXED=source_index is not None, HAS_DOTS=dot_with is not None,
        BLOCK_C=min(_COMBINE_MAX_BLOCK, triton.next_power_of_2(width)), num_warps=4,
    )
    return dots


def _pair_pointers(has_mask: bool, hardness: int, positive_keys, key_offset: int, query_ids, key_owners,
                   hardness_strength, dummy) -> tuple:
    """(positive_ptr, key_offset, query_id_ptr, key_owner_ptr, hardness_ptr) of a launch: the
    positives serve the group mask and the hardness offset alike; ``dummy`` where nothing reads."""
    if not hardness:
        return positive_keys if has_mask else dummy, key_offset, dummy, dummy, dummy
    return positive_keys, key_offset, query_ids, key_owners, hardness_strength
