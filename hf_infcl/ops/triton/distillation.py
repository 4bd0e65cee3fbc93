"""In-batch distillation's kernels and their launchers (what the statistics are:
:mod:`hf_infcl.ops.distillation`; the definitions: docs/contract.md, "Distillation over the batch").

``soft_target_stats``: one program owns a block of "outer" vectors (rows, or keys for the column
statistics) and streams the "inner" ones past it. Each tile gives two logits, the student's
z = s <outer, inner> and the teacher's t = s_t <teacher outer, teacher inner> (its own width), and
each outer vector keeps three running numbers: the student's log-sum-exp, the teacher's, and the
teacher-weighted sum of (t - z), rescaled whenever the teacher's running maximum moves, as the
log-sum-exp's sum is. When there are too few outer blocks to fill the GPU, the inner range is
split over several programs whose partial statistics merge as two disjoint sets of keys do.

``SoftTargetRoute``: the backward's super-tile route (:mod:`.super_tiles`): its kernel forms
G = a_i P_ij - b_i T_ij (+ the columns' c_j P'_ij - d_j T'_ij) from the same two logits and the
forward's log-sum-exps, adds its row sums and writes G for the walk's two GEMMs.

Logits stay in natural units (one multiply by log2(e) per exponential): exact fp32 needs them
(:func:`.jit_math.log2_units`), and the statistics here are few.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..distillation import SoftTargetGradients, SoftTargetStats, TeacherLogits
from .device import INTERPRET, unused_pointer
from .jit_math import dot_precision, dot_tile, even_k, exp_in_units, outer_block_and_inner_range, round_guide
from .launch import BASE_SHAPES, autotuned, launch, launch_jit, problem_size_class
from .operands import scalar
from .stats import inner_splits
from .super_tiles import fp32_vector


def _even_teacher_k(args: dict) -> bool:
    """EVEN_TEACHER_K: the step along c divides the teacher's width, so its loads need no mask."""
    return args["c_teacher"] % args["BLOCK_K"] == 0


@triton.jit
def _soft_target_stats_kernel(
    outer_ptr, inner_ptr, teacher_outer_ptr, teacher_inner_ptr, scale_ptr, teacher_scale_ptr,
    student_lse_ptr, teacher_lse_ptr, gap_ptr,
    n_outer, n_inner, c, c_teacher, stride_outer, stride_inner, stride_teacher_outer, stride_teacher_inner,
    inner_per_split, size_class,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND_TEACHER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_TEACHER_K: tl.constexpr,
):
    _, outer_index, outer_valid, inner_start, inner_end = outer_block_and_inner_range(
        n_outer, n_inner, inner_per_split, BLOCK_M)
    scale = tl.load(scale_ptr).to(tl.float32)
    teacher_scale = tl.load(teacher_scale_ptr).to(tl.float32)

    student_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    student_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    teacher_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    teacher_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    gap = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum of e^(t - teacher_max) (t - z)
    for n0 in range(inner_start, inner_end, BLOCK_N):
        inner_index = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        inner_valid = inner_index < inner_end
        valid = outer_valid[:, None] & inner_valid[None, :]
        z = scale * dot_tile(outer_ptr, inner_ptr, None, None, outer_index, inner_index, outer_valid,
                             inner_valid, 0, 0, c, stride_outer, stride_inner, BLOCK_M, BLOCK_N, BLOCK_K,
                             PRECISION, UPCAST, EVEN_K, False)
        t = teacher_scale * dot_tile(teacher_outer_ptr, teacher_inner_ptr, None, None, outer_index,
                                     inner_index, outer_valid, inner_valid, 0, 0, c_teacher,
                                     stride_teacher_outer, stride_teacher_inner, BLOCK_M, BLOCK_N, BLOCK_K,
                                     PRECISION, UPCAST, EVEN_TEACHER_K, False, ROUND_TEACHER)
        z = tl.where(valid, z, float("-inf"))
        t = tl.where(valid, t, float("-inf"))
        # Each running sum is relative to its running maximum; a row that has seen nothing yet has
        # maximum -inf and is shifted by 0, so that no -inf - -inf appears.
        new_max = tl.maximum(student_max, tl.max(z, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        student_sum = (student_sum * exp_in_units(student_max - shift, False)
                       + tl.sum(exp_in_units(z - shift[:, None], False), axis=1))
        student_max = new_max
        new_max = tl.maximum(teacher_max, tl.max(t, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = exp_in_units(teacher_max - shift, False)
        weights = exp_in_units(t - shift[:, None], False)  # 0 outside the problem
        teacher_sum = teacher_sum * rescale + tl.sum(weights, axis=1)
        # where(), not a product: outside the problem t - z is -inf - -inf = nan
        gap = gap * rescale + tl.sum(tl.where(valid, weights * (t - z), 0.0), axis=1)
        teacher_max = new_max

    out = tl.program_id(1).to(tl.int64) * n_outer + outer_index  # this split's partial statistics
    student_shift = tl.where(student_max == float("-inf"), 0.0, student_max)
    teacher_shift = tl.where(teacher_max == float("-inf"), 0.0, teacher_max)
    tl.store(student_lse_ptr + out, student_shift + tl.log(student_sum), mask=outer_valid)
    tl.store(teacher_lse_ptr + out, teacher_shift + tl.log(teacher_sum), mask=outer_valid)
    # a split with no inner vector has teacher_sum 0: its gap counts for nothing in the merge
    tl.store(gap_ptr + out, tl.where(teacher_sum > 0.0, gap / teacher_sum, 0.0), mask=outer_valid)


# ROUND_TEACHER: an fp32 teacher multiplied with TF32 is rounded to TF32 to nearest as it is loaded
# (the score filter's guide's rule), as the student's fp32 operands are in copies before the kernels.
SOFT_TARGET_STATS_KERNEL = autotuned(_soft_target_stats_kernel, "soft_target_stats", BASE_SHAPES, {
    "EVEN_K": even_k, "EVEN_TEACHER_K": _even_teacher_k, "ROUND_TEACHER": round_guide("teacher_outer_ptr")})


def soft_target_stats(outer: torch.Tensor, inner: torch.Tensor, teacher_outer: torch.Tensor,
                      teacher_inner: torch.Tensor, scale: torch.Tensor, teacher_scale: torch.Tensor, *,
                      precision: str, splits: int | None = None) -> SoftTargetStats:
    """The distillation statistics of each ``outer`` vector over every ``inner`` one (rows over
    keys, or keys over rows for the column statistics), fp32 [n_outer] each: the student's
    log-sum-exp of z = scale <outer, inner>, the teacher's of t = teacher_scale <teacher_outer,
    teacher_inner>, and the gap sum_j softmax(t)_j (t_j - z_j). ``inner`` must not be empty.
    ``splits``: programs sharing one outer block's inner range (None: enough to fill the GPU)."""
    n_outer, c = outer.shape
    n_inner = inner.shape[0]
    splits, inner_per_split = inner_splits(n_outer, n_inner, outer.device, splits)
    student_lse, teacher_lse, gap = parts = torch.empty((3, splits, n_outer), dtype=torch.float32,
                                                        device=outer.device)
    grid = lambda meta: (triton.cdiv(n_outer, meta["BLOCK_M"]), splits)  # noqa: E731
    launch(
        SOFT_TARGET_STATS_KERNEL, grid, outer.device,
        outer, inner, teacher_outer, teacher_inner, scale, teacher_scale, student_lse, teacher_lse, gap,
        n_outer, n_inner, c, teacher_outer.shape[1], outer.stride(0), inner.stride(0),
        teacher_outer.stride(0), teacher_inner.stride(0), inner_per_split,
        problem_size_class(n_outer, n_inner), PRECISION=dot_precision(outer.dtype, precision),
        UPCAST=INTERPRET,
    )
    # the splits' key sets are disjoint: they merge as any two blocks of keys do
    return SoftTargetStats(*merge_soft_target_parts(parts))


_MERGE_BLOCK_PARTS = 4 if INTERPRET else 8
_MERGE_BLOCK_N = 16 if INTERPRET else 128


@triton.jit
def _merge_soft_target_parts_kernel(
    parts_ptr, previous_ptr, out_ptr, n_parts, n, stride_statistic, stride_part, stride_out,
    HAS_PREVIOUS: tl.constexpr, BLOCK_PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[:, j] = the statistics over the union of the disjoint key sets p of parts[:, p, j]
    (student log-sum-exp, teacher log-sum-exp, gap), and of previous[:, j] when given: the
    log-sum-exps merge online, the gaps as means under the teacher's shares. A set of no keys
    (teacher -inf) counts for nothing, a union of none has gap 0, a NaN anywhere gives NaN."""
    columns = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = columns < n
    if HAS_PREVIOUS:  # the running statistics, one more set of keys
        student_top = tl.load(previous_ptr + columns, mask=valid, other=float("-inf"))
        teacher_top = tl.load(previous_ptr + stride_out + columns, mask=valid, other=float("-inf"))
        teacher_weighted_gap = tl.load(previous_ptr + 2 * stride_out + columns, mask=valid, other=0.0)
        student_total = tl.where(student_top == float("-inf"), 0.0, 1.0)
        teacher_total = tl.where(teacher_top == float("-inf"), 0.0, 1.0)
        teacher_weighted_gap *= teacher_total
    else:
        student_top = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        teacher_top = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        student_total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        teacher_total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        teacher_weighted_gap = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for first in range(0, n_parts, BLOCK_PARTS):
        parts = first + tl.arange(0, BLOCK_PARTS).to(tl.int64)
        inside = (parts[:, None] < n_parts) & valid[None, :]
        at = parts_ptr + parts[:, None] * stride_part + columns[None, :]
        student = tl.load(at, mask=inside, other=float("-inf"))
        teacher = tl.load(at + stride_statistic, mask=inside, other=float("-inf"))
        gap = tl.load(at + 2 * stride_statistic, mask=inside, other=0.0)
        # measured from 0 while every value so far is -inf, so that no -inf - -inf appears
        new_top = tl.maximum(student_top, tl.max(student, axis=0))
        base = tl.where(new_top == float("-inf"), 0.0, new_top)
        student_shares = tl.exp(student - base[None, :])
        student_total = student_total * tl.exp(student_top - base) + tl.sum(student_shares, axis=0)
        student_top = new_top
        new_top = tl.maximum(teacher_top, tl.max(teacher, axis=0))
        base = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(teacher_top - base)
        shares = tl.exp(teacher - base[None, :])
        teacher_total = teacher_total * rescale + tl.sum(shares, axis=0)
        # a set of no keys has share 0 and gap 0: 0, never 0 * inf
        weighted = tl.where(shares == 0.0, 0.0, shares * gap)
        teacher_weighted_gap = teacher_weighted_gap * rescale + tl.sum(weighted, axis=0)
        teacher_top = new_top
    # a NaN statistic must give NaN even where tl.maximum dropped it from the running top
    student_lse = tl.where(student_total != student_total, student_total, student_top + tl.log(student_total))
    teacher_lse = tl.where(teacher_total != teacher_total, teacher_total, teacher_top + tl.log(teacher_total))
    gap = tl.where(teacher_total == 0.0, 0.0, teacher_weighted_gap / teacher_total)
    tl.store(out_ptr + columns, student_lse, mask=valid)
    tl.store(out_ptr + stride_out + columns, teacher_lse, mask=valid)
    tl.store(out_ptr + 2 * stride_out + columns, gap, mask=valid)


def merge_soft_target_parts(parts: torch.Tensor, previous: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [3, n]: the statistics (student log-sum-exp, teacher log-sum-exp, gap) over the union
    of disjoint sets of keys, from each set's in fp32 ``parts`` [3, sets, n], and from
    ``previous`` [3, n] (the running statistics of one more set) when given: what
    :func:`~hf_infcl.ops.distillation.merge_soft_target_stats` gives set by set, in one launch.
    ``out`` [3, n] may be ``previous`` itself, or a view into a longer buffer."""
    _, n_parts, n = parts.shape
    if parts.stride(2) != 1:
        raise ValueError("merge_soft_target_parts needs parts with unit column stride")
    if out is None:
        out = torch.empty((3, n), dtype=torch.float32, device=parts.device)
    for name, tensor in (("out", out), ("previous", previous)):
        if tensor is not None and (tensor.stride(1) != 1 or tensor.stride(0) != out.stride(0)):
            raise ValueError(f"{name} must have unit column stride, and the stride of out between statistics")
    if n == 0:
        return out
    launch_jit(
        _merge_soft_target_parts_kernel, (triton.cdiv(n, _MERGE_BLOCK_N),),
        parts, previous if previous is not None else out, out, n_parts, n, parts.stride(0), parts.stride(1),
        out.stride(0), HAS_PREVIOUS=previous is not None, BLOCK_PARTS=_MERGE_BLOCK_PARTS,
        BLOCK_N=_MERGE_BLOCK_N, num_warps=4,
    )
    return out


@triton.jit
def _soft_target_grad_kernel(
    q_ptr, k_ptr, teacher_q_ptr, teacher_k_ptr, scale_ptr, teacher_scale_ptr, inv_g_scale_ptr, g_ptr,
    row_sums_ptr, row_student_lse_ptr, row_teacher_lse_ptr, row_student_weight_ptr,
    row_target_weight_ptr,
    col_student_lse_ptr, col_teacher_lse_ptr, col_student_weight_ptr, col_target_weight_ptr,
    n_rows, n_keys, c, c_teacher, stride_q, stride_k, stride_teacher_q, stride_teacher_k, stride_g,
    size_class,
    COLUMNS: tl.constexpr, SCALED_G: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ROUND_TEACHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_TEACHER_K: tl.constexpr,
):
    row_index = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    key_index = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_valid = row_index < n_rows
    key_valid = key_index < n_keys
    valid = row_valid[:, None] & key_valid[None, :]
    z = tl.load(scale_ptr).to(tl.float32) * dot_tile(
        q_ptr, k_ptr, None, None, row_index, key_index, row_valid, key_valid, 0, 0, c, stride_q, stride_k,
        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST, EVEN_K, False)
    t = tl.load(teacher_scale_ptr).to(tl.float32) * dot_tile(
        teacher_q_ptr, teacher_k_ptr, None, None, row_index, key_index, row_valid, key_valid, 0, 0,
        c_teacher, stride_teacher_q, stride_teacher_k, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
        EVEN_TEACHER_K, False, ROUND_TEACHER)

    student_lse = tl.load(row_student_lse_ptr + row_index, mask=row_valid, other=0.0)
    teacher_lse = tl.load(row_teacher_lse_ptr + row_index, mask=row_valid, other=0.0)
    student_weight = tl.load(row_student_weight_ptr + row_index, mask=row_valid, other=0.0)
    target_weight = tl.load(row_target_weight_ptr + row_index, mask=row_valid, other=0.0)
    grad = (student_weight[:, None] * exp_in_units(z - student_lse[:, None], False)
            - target_weight[:, None] * exp_in_units(t - teacher_lse[:, None], False))
    if COLUMNS:
        student_lse = tl.load(col_student_lse_ptr + key_index, mask=key_valid, other=0.0)
        teacher_lse = tl.load(col_teacher_lse_ptr + key_index, mask=key_valid, other=0.0)
        student_weight = tl.load(col_student_weight_ptr + key_index, mask=key_valid, other=0.0)
        target_weight = tl.load(col_target_weight_ptr + key_index, mask=key_valid, other=0.0)
        grad += (student_weight[None, :] * exp_in_units(z - student_lse[None, :], False)
                 - target_weight[None, :] * exp_in_units(t - teacher_lse[None, :], False))
    # where(), not a product: outside the problem the exponentials may be inf and the weights 0
    grad = tl.where(valid, grad, 0.0)
    tl.atomic_add(row_sums_ptr + row_index, tl.sum(grad, axis=1), mask=row_valid)
    if SCALED_G:
        grad = grad * tl.load(inv_g_scale_ptr)
    tl.store(g_ptr + row_index[:, None] * stride_g + key_index[None, :], grad.to(g_ptr.dtype.element_ty),
             mask=valid)


SOFT_TARGET_GRAD_KERNEL = autotuned(_soft_target_grad_kernel, "soft_target_grad", BASE_SHAPES, {
    "EVEN_K": even_k, "EVEN_TEACHER_K": _even_teacher_k, "ROUND_TEACHER": round_guide("teacher_q_ptr")},
    reset_to_zero=["row_sums_ptr"])


class SoftTargetRoute:
    """The backward's super-tile route (:class:`.super_tiles.SuperTileRoute`) of the distillation:
    the kernel recomputes both logits of each super-tile and writes its G (divided by the walk's
    G factor, ``inv_g_scale`` its inverse) and adds its row sums into ``row_sums``."""

    g_alone = True  # its kernel makes both products itself: no dot-product buffer beside G
    segments = None

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor, teacher: TeacherLogits,
                 rows: SoftTargetGradients, columns: SoftTargetGradients | None, row_sums: torch.Tensor,
                 inv_g_scale: torch.Tensor | None, precision: str):
        self.queries, self.keys, self.scale, self.teacher = queries, keys, scale, teacher
        self.rows = SoftTargetGradients(*map(fp32_vector, rows))
        self.columns = None if columns is None else SoftTargetGradients(*map(fp32_vector, columns))
        self.row_sums, self.inv_g_scale, self.precision = row_sums, inv_g_scale, precision
        # one tuning key for every super-tile: tuning (which zeroes the row sums it benchmarks on)
        # can only happen on the first
        self.size_class = problem_size_class(queries.shape[0], keys.shape[0])
        self.config = None

    def scratch(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.queries.device)

    def row_panel(self, start, end):
        return dict(queries=self.queries[start:end], teacher=self.teacher.queries[start:end],
                    row_sums=self.row_sums[start:end], stats=[part[start:end] for part in self.rows])

    def key_tile(self, start, end):
        columns = self.columns
        return dict(keys=self.keys[start:end], teacher=self.teacher.keys[start:end],
                    stats=None if columns is None else [part[start:end] for part in columns])

    def write(self, row, tile, g):
        queries, keys = row["queries"], tile["keys"]
        dummy = unused_pointer(queries.device)
        column_stats = tile["stats"] if tile["stats"] is not None else [dummy] * 4
        grid = lambda meta: (triton.cdiv(queries.shape[0], meta["BLOCK_M"]),  # noqa: E731
                             triton.cdiv(keys.shape[0], meta["BLOCK_N"]))
        self.config = launch(
            SOFT_TARGET_GRAD_KERNEL, grid, queries.device,
            queries, keys, row["teacher"], tile["teacher"], self.scale, self.teacher.scale,
            self.inv_g_scale if self.inv_g_scale is not None else dummy, g, row["row_sums"], *row["stats"],
            *column_stats, queries.shape[0], keys.shape[0], queries.shape[1], row["teacher"].shape[1],
            queries.stride(0), keys.stride(0), row["teacher"].stride(0), tile["teacher"].stride(0),
            g.stride(0), self.size_class, COLUMNS=tile["stats"] is not None,
            SCALED_G=self.inv_g_scale is not None,
            PRECISION=dot_precision(queries.dtype, self.precision), UPCAST=INTERPRET, config=self.config,
        )


def teacher_scalars(teacher: TeacherLogits) -> TeacherLogits:
    """The teacher as the kernels read it: contiguous embeddings and a 0-d fp32 scale."""
    return TeacherLogits(teacher.queries.contiguous(), teacher.keys.contiguous(), scalar(teacher.scale))
