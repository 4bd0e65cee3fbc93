"""The @triton.jit helpers the kernels of this folder share (the Gluon kernel calls them too: Gluon
compiles a called Triton function in its own dialect), and the host-side rules of their
compile-time switches (``EVEN_K``, ``LOG2``, ``PRECISION``).

Units: for TF32 and half-precision operands the softmax kernels hold their logits in log2 units
(the scale times log2(e)), so that every exponential is one exp2 of a difference
(:func:`log2_units`); exact fp32 keeps natural units.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import INTERPRET

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# PTX approximate instructions (one special-function operation each) where the kernels run on a
# GPU; the interpreter has no inline assembly and divides.
_PTX = tl.constexpr(not INTERPRET)


def dot_precision(dtype: torch.dtype, precision: str) -> str:
    """tl.dot input_precision: TF32 for fp32 unless "ieee"; half types ignore it."""
    if dtype == torch.float32 and precision == "ieee":
        return "ieee"
    return "tf32"


def even_k(args: dict) -> bool:
    """EVEN_K: the step along c divides c, so :func:`dot_tile`'s loads need no mask."""
    return args["c"] % args["BLOCK_K"] == 0


def even_guide_k(args: dict) -> bool:
    """EVEN_GUIDE_K: the same for the score filter's guide, of width ``c_guide`` (0 without one)."""
    return args["c_guide"] % args["BLOCK_K"] == 0


def rounds_guide(precision: str, guide_dtype: torch.dtype) -> bool:
    """ROUND_GUIDE's rule: an fp32 guide multiplied with TF32 (``precision``, the ``tl.dot`` input
    precision) is rounded to TF32 as it is loaded (:func:`dot_tile`'s ROUND_TF32), as the fp32
    operands are before the kernels."""
    return precision == "tf32" and guide_dtype == torch.float32


def round_guide(guide_name: str):
    """:func:`rounds_guide` as the heuristic of the kernel whose guide argument is ``guide_name``."""
    return lambda args: rounds_guide(args["PRECISION"], args[guide_name].dtype)


def log2_units(args: dict) -> bool:
    """LOG2: the softmax loss's logits are held in log2 units (scale, bias and hardness strength
    times log2(e); statistics converted where they are loaded or stored), so that each
    exponential is exp2 of a difference: one multiply per logit and direction fewer. Not for
    exact fp32 ("ieee"): pre-scaled logits round to ~1e-7 of |z|, i.e. up to 1e-5 of e^z at
    CLIP's |z| of 100, beyond the fp32 tolerance; TF32 and half-precision operands round their
    logits far more."""
    return args["PRECISION"] != "ieee" and not args["SIGMOID"]


@triton.jit
def dot_tile(a_ptr, b_ptr, a_desc, b_desc, a_index, b_index, a_valid, b_valid, a_start, b_start, c,
             stride_a, stride_b, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
             PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
             ROUND_TF32: tl.constexpr = False):
    """<A_a, B_b> for a BLOCK_A x BLOCK_B tile, walking the width c in BLOCK_K chunks (fp32).

    TMA: the chunks come through the tensor descriptors ``a_desc`` / ``b_desc`` (blocks of
    BLOCK_A / BLOCK_B rows from row ``a_start`` / ``b_start``; the copy engine fills rows and
    columns past the end with zeros). Otherwise through pointers: rows past the end (not
    ``a_valid`` / ``b_valid``) read row 0 instead of being masked, so the loads carry no mask at
    all when BLOCK_K divides c (``EVEN_K``). Either way the dot products of rows past the end are
    meaningless, and every caller discards them with where() on its ``allowed`` tile, never with
    a product.

    ROUND_TF32 (fp32 operands through pointers): each chunk rounded to TF32 to nearest as it is
    loaded (:func:`round_to_tf32`), what the kernels' operands get as rounded copies
    (``operands.round_to_tf32``); the score filter's guide is rounded here, without a copy."""
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
        if ROUND_TF32:
            a = round_to_tf32(a)
            b = round_to_tf32(b)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def outer_block_and_inner_range(n_outer, n_inner, inner_per_split, BLOCK_M: tl.constexpr):
    """How a statistics kernel's grid divides its work: (this program's outer block number, its
    outer vectors' int64 indices and validity, the start and end of its split's inner range), the
    block from program_id(0) and the split from program_id(1)."""
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    outer_index = pid * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    inner_start = split * inner_per_split
    inner_end = tl.minimum(inner_start + inner_per_split, n_inner)
    return pid, outer_index, outer_index < n_outer, inner_start, inner_end


@triton.jit
def round_to_tf32(x):
    """fp32 values rounded to the nearest TF32 value (10 mantissa bits, ties away from zero): half
    a unit of the last kept bit added to the bit pattern, the dropped bits cleared (the tensor
    cores' TF32 input truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -0x2000).to(tl.float32, bitcast=True)


@triton.jit
def scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS: tl.constexpr, LOG2: tl.constexpr):
    """The logit scale and bias (0 without one) as fp32, read on the device, in the kernel's
    units (:func:`in_units`)."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr).to(tl.float32)
    else:
        bias = 0.0
    return in_units(scale, LOG2), in_units(bias, LOG2)


@triton.jit
def scaled_logits(dots, scale, bias, HAS_BIAS: tl.constexpr):
    """scale * dots (+ bias). Without a bias there is no add at all: the compiler may not drop
    ``+ 0.0`` (-0.0 + 0.0 is +0.0), and that add is one instruction per logit."""
    if HAS_BIAS:
        return dots * scale + bias
    else:
        return dots * scale


@triton.jit
def reciprocal(x):
    """1 / x to 1 ulp (rcp.approx: one special-function operation; IEEE division costs several)."""
    if _PTX:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def log1p(u):
    """log(1 + u) for -1/4 <= u <= 1, to fp32 accuracy relative to the result.

    log1p(u) = 2 atanh(t) = 2 t (1 + t^2/3 + ... + t^14/15), t = u / (2 + u), -1/7 <= t <= 1/3:
    the truncated series is below fp32's rounding (the next term is < 4e-9 relative); relative
    accuracy holds for the tiny u of very negative logits (no 1 + u that rounds away u); and it
    costs one reciprocal and eight fused multiply-adds where a library logarithm costs about 25
    instructions (elementwise work bounds the sigmoid loss's elementwise pass)."""
    t = u * reciprocal(2.0 + u)
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
def log1p_of_positive(x):
    """log(1 + x) for 0 <= x < 2^100, to a few ulps relative: w = 1 + x = 2^e m with m in
    [0.75, 1.5) (e and 2^-e from w's exponent bits, exact), log(m) = log1p(m - 1) (m - 1 is
    exact), and (x - (w - 1)) / w restores what rounding w lost (tiny x keep their relative
    accuracy). About 20 instructions; the kernels' logarithms are approximate (lg2.approx) to
    2^-22 absolute, i.e. useless for small x."""
    w = 1.0 + x
    exponent = ((w * (4.0 / 3.0)).to(tl.int32, bitcast=True) >> 23) - 127
    m = w * ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    return exponent.to(tl.float32) * LN2 + log1p(m - 1.0) + (x - (w - 1.0)) * reciprocal(w)


@triton.jit
def product_minus_one(a, b):
    """(1 + a)(1 + b) - 1, never forming 1 + a: for positive a, b every rounding is relative to
    the result, so small products keep their relative accuracy."""
    return a + b + a * b


@triton.jit
def softplus(z):
    """log(1 + e^z) = max(z, 0) + log1p(e^-|z|): no overflow, and the small values of very
    negative z kept."""
    return tl.maximum(z, 0.0) + log1p(tl.exp2(-tl.abs(z) * LOG2E))


@triton.jit
def sigmoid_and_exponential(z):
    """(sigmoid(z), u = e^-|z|): sigmoid(z) = r for z >= 0 and u r below, r = 1 / (1 + u) (one
    exponential, one approximate reciprocal); u is what softplus(z) = max(z, 0) + log1p(u) needs."""
    u = tl.exp2(-tl.abs(z) * LOG2E)
    return reciprocal(1.0 + u) * tl.where(z >= 0.0, 1.0, u), u


@triton.jit
def sigmoid_and_softplus(z):
    """(sigmoid(z), softplus(z)) sharing one exponential (:func:`sigmoid_and_exponential`)."""
    sigmoid, u = sigmoid_and_exponential(z)
    return sigmoid, tl.maximum(z, 0.0) + log1p(u)


@triton.jit
def allowed_pairs(row_index, key_index, row_valid, key_valid, row_group_ptr, key_group_ptr,
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
def positive_pairs(row_index, key_index, row_valid, key_valid, positive_ptr, key_offset, row_group_ptr,
                   key_group_ptr, GROUP_POSITIVES: tl.constexpr):
    """Boolean [rows, keys] tile: key j is one of row i's positives, its own (``positive_ptr``, global
    key indices) and with GROUP_POSITIVES every key of its group (docs/contract.md, "Several
    positives per row"). Entries past the ends are meaningless: callers mask them with ``allowed``."""
    positive = tl.load(positive_ptr + row_index, mask=row_valid, other=-1)
    is_positive = positive[:, None] == (key_offset + key_index)[None, :]
    if GROUP_POSITIVES:
        row_group = tl.load(row_group_ptr + row_index, mask=row_valid, other=0)
        key_group = tl.load(key_group_ptr + key_index, mask=key_valid, other=0)
        is_positive = is_positive | (row_group[:, None] == key_group[None, :])
    return is_positive


@triton.jit
def positive_columns(positive_ptr, row_index, row_valid, key_start, BLOCK_KEYS: tl.constexpr):
    """Each row's positive (``positive_ptr``: global key indices) as a column of the BLOCK_KEYS keys
    from global index ``key_start``: int32, -1 where it lies outside them (and for rows past the
    end). Compared with ``tl.arange(0, BLOCK_KEYS)`` it finds a tile's positives with one 32-bit
    compare per entry, where the global indices take a 64-bit one."""
    column = tl.load(positive_ptr + row_index, mask=row_valid, other=-1) - key_start
    return tl.where((column >= 0) & (column < BLOCK_KEYS), column, -1).to(tl.int32)


@triton.jit
def not_positive(outer_index, inner_index, outer_valid, inner_valid, outer_start, inner_start, positive_ptr,
                 key_offset, row_group_ptr, key_group_ptr, KEYS_OUTER: tl.constexpr,
                 GROUP_POSITIVES: tl.constexpr, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr):
    """Boolean (outer, inner) tile (rows outer, or keys with KEYS_OUTER; the tile's first outer and
    inner indices ``outer_start`` and ``inner_start``): True where the key is not one of the row's
    positives, i.e. where the score filter may leave the entry out."""
    if KEYS_OUTER:  # the tile is (keys, rows)
        if GROUP_POSITIVES:
            return tl.trans(positive_pairs(inner_index, outer_index, inner_valid, outer_valid, positive_ptr,
                                           key_offset, row_group_ptr, key_group_ptr, GROUP_POSITIVES)) == 0
        positive = positive_columns(positive_ptr, inner_index, inner_valid, key_offset + outer_start,
                                    BLOCK_OUTER)
        return positive[None, :] != tl.arange(0, BLOCK_OUTER)[:, None]
    if GROUP_POSITIVES:
        return positive_pairs(outer_index, inner_index, outer_valid, inner_valid, positive_ptr, key_offset,
                              row_group_ptr, key_group_ptr, GROUP_POSITIVES) == 0
    positive = positive_columns(positive_ptr, outer_index, outer_valid, key_offset + inner_start, BLOCK_INNER)
    return positive[:, None] != tl.arange(0, BLOCK_INNER)[None, :]


@triton.jit
def score_filter_drops(scores, candidates, threshold_ptr, index, valid, OUTER: tl.constexpr):
    """The score filter (docs/contract.md, "False negatives by score") on a tile of ``scores``: True
    where an entry is left out, i.e. it is one of the ``candidates`` (:func:`not_positive`) and its
    score is above its threshold, that of the tile's outer vector (OUTER; ``index`` the outer
    vectors) or of its inner one. The outer vectors' statistic takes its own vectors' thresholds
    (rows', or keys' with keys outer); the fused column statistic of a rows-outer tile takes the
    inner (keys') ones. A NaN score is never above: it stays."""
    return dropped_by_thresholds(scores, candidates, tl.load(threshold_ptr + index, mask=valid, other=0.0),
                                 OUTER)


@triton.jit
def dropped_by_thresholds(scores, candidates, thresholds, OUTER: tl.constexpr):
    """:func:`score_filter_drops` with the ``thresholds`` of the outer (OUTER) or inner vectors
    already loaded."""
    if OUTER:
        return (scores > thresholds[:, None]) & candidates
    else:
        return (scores > thresholds[None, :]) & candidates


@triton.jit
def may_leave_out(scores, row_thresholds, key_thresholds, row_valid, key_valid, COLUMNS: tl.constexpr,
                  FULL: tl.constexpr):
    """Whether the score filter may leave out an entry of a [rows, keys] tile of ``scores``: some
    score of the tile is above the lowest of its rows' ``row_thresholds`` (with COLUMNS, of those
    and its keys' ``key_thresholds``; +inf past the ends). Where not, every entry is kept
    (:func:`score_filter_drops` would drop none), and the tile needs no masks: one maximum per
    entry instead of the masks' comparisons. A NaN score never counts (the masks keep it too)."""
    lowest = tl.min(row_thresholds, axis=0)
    if COLUMNS:
        lowest = tl.minimum(lowest, tl.min(key_thresholds, axis=0))
    if not FULL:  # the scores of rows and keys past the ends are meaningless
        scores = tl.where(row_valid[:, None] & key_valid[None, :], scores, float("-inf"))
    return tl.max(tl.max(scores, axis=1), axis=0) > lowest


@triton.jit
def hardness_offset_logits(logits, dots, row_index, key_index, row_valid, key_valid, query_id_ptr,
                           key_owner_ptr, positive_ptr, key_offset, strength, row_group_ptr, key_group_ptr,
                           HARDNESS: tl.constexpr, GROUP_POSITIVES: tl.constexpr):
    """The row statistic's logits of a [rows, keys] tile: ``logits`` + strength * dots where the
    contract's hardness offset selects (HARDNESS: 1 in-batch, 2 hard, 3 all negatives; a negative
    owner is nobody's, a row's positive is never offset, with GROUP_POSITIVES none of its group).
    The offset is a constant of the loss, so the backward's G keeps flowing through the scaled
    dots only."""
    query_id = tl.load(query_id_ptr + row_index, mask=row_valid, other=-1)
    owner = tl.load(key_owner_ptr + key_index, mask=key_valid, other=-1)
    if GROUP_POSITIVES:
        is_positive = positive_pairs(row_index, key_index, row_valid, key_valid, positive_ptr, key_offset,
                                     row_group_ptr, key_group_ptr, GROUP_POSITIVES)
        selected = (owner[None, :] >= 0) & (is_positive == 0)
    else:
        positive = tl.load(positive_ptr + row_index, mask=row_valid, other=-1)
        selected = (owner[None, :] >= 0) & (positive[:, None] != (key_offset + key_index)[None, :])
    if HARDNESS == 1:
        selected = selected & (owner[None, :] != query_id[:, None])
    elif HARDNESS == 2:
        selected = selected & (owner[None, :] == query_id[:, None])
    return logits + tl.where(selected, strength * dots, 0.0)


@triton.jit
def in_units(x, LOG2: tl.constexpr):
    """x (a logit, a statistic, a factor of the logits) in the kernel's units: times log2(e) in
    log2 units (:func:`log2_units`), else as it is."""
    if LOG2:
        return x * LOG2E
    else:
        return x


@triton.jit
def at_most_zero(exponent):
    """``exponent`` clamped at 0, NaN kept: the exponents z - stat of the score filter's listed
    backward (:mod:`.left_out`), in the gradient tiles and where their terms are taken back."""
    return tl.minimum(exponent, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def exp_in_units(x, LOG2: tl.constexpr):
    """e^x for x in the kernel's units (:func:`log2_units`): exp2(x) in log2 units."""
    if LOG2:
        return tl.exp2(x)
    else:
        return tl.exp2(x * LOG2E)


@triton.jit
def log_in_units(x, LOG2: tl.constexpr):
    """log(x) in the kernel's units (log2 in log2 units)."""
    if LOG2:
        return tl.log2(x)
    else:
        return tl.log(x)


@triton.jit
def column_lse(logits, LOG2: tl.constexpr):
    """Log-sum-exp of each column of a tile of logits, each column shifted by its own maximum,
    in the logits' units (:func:`log2_units`).

    A second exponential per logit and a reduction across the tile's rows. Reusing the rows'
    exponentials (one shift for the whole tile) would lose the terms of rows more than ~87 below
    the tile's largest logit (CLIP's scale of 100 spreads logits by 200), and the check for that
    and its exact fallback cost more than the exponential (docs/algorithms.md)."""
    col_max = tl.max(logits, axis=0)
    col_shift = tl.where(col_max == float("-inf"), 0.0, col_max)
    return col_shift + log_in_units(tl.sum(exp_in_units(logits - col_shift[None, :], LOG2), axis=0), LOG2)
