"""Hopper kernels for in-batch distillation: the symmetric forward's statistics of every row and
every key (the student's and the teacher's log-sum-exps and the gap, :class:`SoftTargetStats`)
from one pass over the tiles, and the backward's G of each super-tile (:class:`GluonSoftTargetRoute`).

What it replaces: the two passes of :func:`.distillation.soft_target_stats` (rows over keys, then
keys over rows), each multiplying both models' products for every tile, four products per entry
in all. Here each tile's two products are made once, and its epilogue leaves the rows' running
statistics in registers and each key's statistics over each warp's 32 rows as column partials,
as the softmax loss's Gluon statistics kernel does (:mod:`.gluon_stats`, whose skeleton and item
order this kernel shares): one persistent program per SM, two consumer warpgroups taking turns at
the tensor cores, each running its tile's epilogue while the other multiplies, and one producer
warp that loads every chunk by TMA into a shared ring.

Each tile is 128 rows by 64 keys, so that both fp32 accumulators (the student's and the
teacher's, 64 registers per thread each) sit beside the epilogue's temporaries. A tile's chunks
are the student's chunks of ``BLOCK_K`` columns, then the teacher's (its own width): both go
through the same ring, whose stages hold a row chunk and a key chunk of either model.

Per entry the epilogue takes four exponentials: the student's and the teacher's shifted by their
rows' running maxima (the teacher's weights also weigh the row's gap, t - z) and by their keys'
maxima over the warp's rows (the same for the columns). Logits are in log2 units (each scale
times log2 e) and converted back where the statistics are stored.

The backward's kernel runs on the same skeleton over one super-tile: each tile's two products,
then G = a_i P_ij - b_i T_ij (+ the columns' c_j P'_ij - d_j T'_ij) stored by TMA in parts of
128 x 8, and the row sums added once per row block.

It covers half-precision operands, the student's and the teacher's of one dtype, whose rows are
16-byte aligned, on a Hopper GPU with a Triton that has Gluon. Everything else takes the Triton
kernels of :mod:`.distillation`. Gluon kernels do not run under ``TRITON_INTERPRET``: their tests
against float64 (``tests/test_gluon_distillation.py``) run on GPUs only.
"""

from __future__ import annotations

import torch
import triton

from ..distillation import SoftTargetGradients, TeacherLogits
from .device import is_hopper, sm_count, tma_aligned, unused_pointer
from .distillation import merge_soft_target_parts
from .gluon_sigmoid import _PRODUCER_REGISTERS, MMAS_IN_FLIGHT, gluon, make_descriptor
from .jit_math import LN2, LOG2E
from .launch import launch_jit
from .super_tiles import fp32_vector

if gluon is not None:  # (None: a Triton without Gluon)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma_wait,
    )

    from .gluon_sigmoid import (
        _eighths,
        _multiply_chunks,
        _operand_ring,
        _program_tiles,
        _release_last_stages,
        _take_turn,
        _tile_of_chunk,
    )
    from .gluon_stats import _log2, _program_items, _tile_place

# 128 x 64 logits per warpgroup and model; c walked in chunks of 64; six stages of a row chunk
# and a key chunk: 6 x (16 + 8) KiB = 144 KiB of shared memory.
BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 64, 64, 6
# Registers per thread of the second consumer warpgroup (the first gets what is left).
_WORKER_REGISTERS = 232
# Column partial rows per row block: one per warp of a consumer warpgroup, each over the warp's
# 32 rows (as in .gluon_stats).
PARTIALS_PER_BLOCK = 4
# The backward's G leaves in the epilogue's parts of 128 x 8 entries (16 bytes a row, TMA's
# smallest box), through two buffers per consumer.
G_COLUMNS, G_BUFFERS = BLOCK_N // 8, 2


def usable(queries: torch.Tensor, keys: torch.Tensor, teacher_queries: torch.Tensor,
           teacher_keys: torch.Tensor) -> bool:
    """Whether :func:`soft_target_stats_both` can take these operands (the module docstring)."""
    operands = (queries, keys, teacher_queries, teacher_keys)
    return (
        gluon is not None
        and queries.is_cuda
        and queries.dtype in (torch.float16, torch.bfloat16)
        and all(t.dtype == queries.dtype and t.dim() == 2 for t in operands)
        and is_hopper(queries.device)
        and all(tma_aligned(t) for t in operands)
    )


if gluon is not None:

    @gluon.jit
    def _issue_pair_loads(chunk, k_chunk, n_student, row_tile, key_tile, q_desc, k_desc, tq_desc, tk_desc,
                          q_bufs, k_bufs, ready, empty, STAGES: gl.constexpr):
        """TMA loads of the program's ``chunk``-th chunk into stage ``chunk % STAGES``: column chunk
        ``k_chunk`` of the student's operands while it is below ``n_student``, else chunk
        ``k_chunk - n_student`` of the teacher's, once the MMA that read the stage last is done."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BK: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        stage = chunk % STAGES
        mbarrier.wait(empty.index(stage), ((chunk // STAGES) & 1) ^ 1)  # (see gluon_sigmoid)
        bar = ready.index(stage)
        mbarrier.expect(bar, q_desc.block_type.nbytes + k_desc.block_type.nbytes)
        if k_chunk < n_student:
            tma.async_copy_global_to_shared(q_desc, [row_tile * BM, k_chunk * BK], bar, q_bufs.index(stage))
            tma.async_copy_global_to_shared(k_desc, [key_tile * BN, k_chunk * BK], bar, k_bufs.index(stage))
        else:
            offset = (k_chunk - n_student) * BK
            tma.async_copy_global_to_shared(tq_desc, [row_tile * BM, offset], bar, q_bufs.index(stage))
            tma.async_copy_global_to_shared(tk_desc, [key_tile * BN, offset], bar, k_bufs.index(stage))

    @gluon.jit
    def _multiply_pair(q_bufs, k_bufs, ready, empty, turn, student, teacher, nth_tile, runs, turn_phase,
                       n_student, n_chunks, GROUP: gl.constexpr, STAGES: gl.constexpr,
                       MMAS_IN_FLIGHT: gl.constexpr):
        """The consumer's ``nth_tile``-th tile: its first ``n_student`` chunks into ``student``, the
        rest into ``teacher``, in its turn at the tensor cores, as :func:`.gluon_sigmoid._multiply`
        multiplies one; every stage it read released. Returns both accumulators and the turn's
        phase."""
        first_chunk, turn_phase = _take_turn(turn, nth_tile, runs, turn_phase, n_chunks, GROUP)
        student = _multiply_chunks(q_bufs, k_bufs, ready, empty, student, first_chunk, 0, n_student, STAGES,
                                   MMAS_IN_FLIGHT)
        teacher = _multiply_chunks(q_bufs, k_bufs, ready, empty, teacher, first_chunk, n_student, n_chunks,
                                   STAGES, MMAS_IN_FLIGHT)
        mbarrier.arrive(turn.index(1 - GROUP))
        student, teacher = warpgroup_mma_wait(num_outstanding=0, deps=(student, teacher))
        _release_last_stages(empty, first_chunk, n_chunks, STAGES, MMAS_IN_FLIGHT)
        return student, teacher, turn_phase

    @gluon.jit
    def _column_pair_part(z, t, col_partial_ptr, n_partials, row_tile, first_key, n_keys, EVEN: gl.constexpr):
        """Each warp's statistics over its 32 rows of one part [128, PART] of a tile, the logits
        ``z`` (student) and ``t`` (teacher) in log2 units and -inf outside the problem: the
        student's and the teacher's log-sum-exp and the gap, stored in natural units at
        ``col_partial[statistic, row_tile * 4 + warp, key]``."""
        PART: gl.constexpr = z.type.shape[1]
        # rows as (64-row half, warp, row within the warp's 16), as in .gluon_stats
        z_by_warp = z.reshape([2, 4, 16, PART])
        t_by_warp = t.reshape([2, 4, 16, PART])
        z_shift = gl.max(gl.max(z_by_warp, axis=0), axis=1)
        t_shift = gl.max(gl.max(t_by_warp, axis=0), axis=1)
        if not EVEN:  # a column with no row in the problem: shift by 0, its sums are 0
            z_shift = gl.where(z_shift == float("-inf"), 0.0, z_shift)
            t_shift = gl.where(t_shift == float("-inf"), 0.0, t_shift)
        z_terms = gl.exp2(z_by_warp - gl.expand_dims(gl.expand_dims(z_shift, 1), 0))
        weights = gl.exp2(t_by_warp - gl.expand_dims(gl.expand_dims(t_shift, 1), 0))
        gaps = weights * (t_by_warp - z_by_warp)
        if not EVEN:  # outside the problem t - z is -inf - -inf = nan, and its weight 0
            gaps = gl.where(weights > 0.0, gaps, 0.0)
        z_sum = gl.sum(gl.sum(z_terms, axis=0), axis=1)
        t_sum = gl.sum(gl.sum(weights, axis=0), axis=1)
        gap = gl.sum(gl.sum(gaps, axis=0), axis=1)
        student_lse = (z_shift + _log2(z_sum)) * LN2
        teacher_lse = (t_shift + _log2(t_sum)) * LN2
        gap = gl.where(t_sum > 0.0, gap / t_sum, 0.0) * LN2
        layout: gl.constexpr = student_lse.type.layout
        warps = gl.arange(0, 4, layout=gl.SliceLayout(1, layout))
        keys = first_key + gl.arange(0, PART, layout=gl.SliceLayout(0, layout))
        pointers = col_partial_ptr + (row_tile * 4 + warps).to(gl.int64)[:, None] * n_keys + keys[None, :]
        stride = n_partials.to(gl.int64) * n_keys  # between the three statistics
        if EVEN:
            gl.store(pointers, student_lse)
            gl.store(pointers + stride, teacher_lse)
            gl.store(pointers + 2 * stride, gap)
        else:
            in_problem = (keys < n_keys)[None, :] & (warps < 4)[:, None]
            gl.store(pointers, student_lse, mask=in_problem)
            gl.store(pointers + stride, teacher_lse, mask=in_problem)
            gl.store(pointers + 2 * stride, gap, mask=in_problem)

    @gluon.jit
    def _consumer(q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, row_out_ptr, col_partial_ptr, scale_ptr,
                  teacher_scale_ptr, n_rows, n_keys, n_items, n_partials, n_student, n_chunks,
                  GROUP: gl.constexpr, SPLITS: gl.constexpr, TILES: gl.constexpr, EVEN: gl.constexpr,
                  STAGES: gl.constexpr, MMAS_IN_FLIGHT: gl.constexpr):
        """One consumer warpgroup: a contiguous run of items, each a row block's running statistics
        of both models over the item's tiles, and each tile's column partials."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        PART: gl.constexpr = BN // 8
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
        first_tiles, runs = _program_items(n_items, TILES)
        z_scale = gl.load(scale_ptr) * LOG2E  # log2 units
        t_scale = gl.load(teacher_scale_ptr) * LOG2E
        turn_phase = 1 - GROUP  # see gluon_sigmoid._multiply
        student = gl.zeros([BM, BN], gl.float32, layout)
        teacher = gl.zeros([BM, BN], gl.float32, layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        part_rows: gl.constexpr = gl.SliceLayout(1, _eighths(student)[0].type.layout)
        local_rows = gl.arange(0, BM, layout=row_layout)
        local_keys = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        z_max = gl.full([BM], float("-inf"), gl.float32, row_layout)
        t_max = gl.full([BM], float("-inf"), gl.float32, row_layout)
        z_sum = gl.zeros([BM], gl.float32, row_layout)
        t_sum = gl.zeros([BM], gl.float32, row_layout)
        gap = gl.zeros([BM], gl.float32, row_layout)  # sum of 2^(t - t_max) (t - z), log2 units
        for nth_tile in range(runs[GROUP]):
            row_tile, key_tile, split, within = _tile_place(first_tiles[GROUP] + nth_tile, SPLITS, TILES)
            student, teacher, turn_phase = _multiply_pair(
                q_bufs, k_bufs, ready, empty, turn, student, teacher, nth_tile, runs, turn_phase, n_student,
                n_chunks, GROUP, STAGES, MMAS_IN_FLIGHT)
            rows = row_tile * BM + local_rows
            z_dots = student
            t_dots = teacher
            if not EVEN:
                keys = key_tile * BN + local_keys
                in_problem = (rows < n_rows)[:, None] & (keys < n_keys)[None, :]
                z_dots = gl.where(in_problem, z_dots, float("-inf"))
                t_dots = gl.where(in_problem, t_dots, float("-inf"))
            # The rows' running maxima moved by the tile's (each taken over the dot products and
            # scaled once: the scales are positive), and the sums rescaled to them. Each part is
            # scaled as it is taken, so that no scaled copy of a whole accumulator is held.
            new_z_max = gl.maximum(z_max, gl.max(z_dots, axis=1) * z_scale)
            new_t_max = gl.maximum(t_max, gl.max(t_dots, axis=1) * t_scale)
            z_shift = new_z_max
            t_shift = new_t_max
            if not EVEN:  # rows that have met no key yet: shift by 0
                z_shift = gl.where(new_z_max == float("-inf"), 0.0, new_z_max)
                t_shift = gl.where(new_t_max == float("-inf"), 0.0, new_t_max)
            z_sum = z_sum * gl.exp2(z_max - z_shift)
            t_rescale = gl.exp2(t_max - t_shift)
            t_sum = t_sum * t_rescale
            gap = gap * t_rescale
            z_max = new_z_max
            t_max = new_t_max
            z_parts = _eighths(z_dots)
            t_parts = _eighths(t_dots)
            z_part_shift = gl.convert_layout(z_shift, part_rows)
            t_part_shift = gl.convert_layout(t_shift, part_rows)
            for part in gl.static_range(8):
                # the rows' terms added entry-wise across the parts, reduced across lanes once
                z = z_parts[part] * z_scale
                t = t_parts[part] * t_scale
                z_terms = gl.exp2(z - z_part_shift[:, None])
                weights = gl.exp2(t - t_part_shift[:, None])
                gaps = weights * (t - z)
                if not EVEN:  # outside the problem t - z is -inf - -inf = nan, and its weight 0
                    gaps = gl.where(weights > 0.0, gaps, 0.0)
                if part == 0:
                    z_row_terms = z_terms
                    t_row_terms = weights
                    gap_row_terms = gaps
                else:
                    z_row_terms += z_terms
                    t_row_terms += weights
                    gap_row_terms += gaps
                _column_pair_part(z, t, col_partial_ptr, n_partials, row_tile, key_tile * BN + part * PART,
                                  n_keys, EVEN)
            z_sum += gl.convert_layout(gl.sum(z_row_terms, axis=1), row_layout)
            t_sum += gl.convert_layout(gl.sum(t_row_terms, axis=1), row_layout)
            gap += gl.convert_layout(gl.sum(gap_row_terms, axis=1), row_layout)
            if within == TILES - 1:  # the item's last tile: its rows' statistics over the split
                out = row_out_ptr + split.to(gl.int64) * n_rows + rows
                stride = SPLITS * n_rows  # between the three statistics
                in_rows = rows < n_rows
                gl.store(out, (z_shift + gl.log2(z_sum)) * LN2, mask=in_rows)
                gl.store(out + stride, (t_shift + gl.log2(t_sum)) * LN2, mask=in_rows)
                gl.store(out + 2 * stride, gl.where(t_sum > 0.0, gap / t_sum, 0.0) * LN2, mask=in_rows)
                z_max = gl.full([BM], float("-inf"), gl.float32, row_layout)
                t_max = gl.full([BM], float("-inf"), gl.float32, row_layout)
                z_sum = gl.zeros([BM], gl.float32, row_layout)
                t_sum = gl.zeros([BM], gl.float32, row_layout)
                gap = gl.zeros([BM], gl.float32, row_layout)

    @gluon.jit
    def _producer(q_desc, k_desc, tq_desc, tk_desc, q_bufs, k_bufs, ready, empty, n_items, n_student,
                  n_chunks, SPLITS: gl.constexpr, TILES: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp: every chunk of the program, in the order the consumers multiply them,
        loaded into the ring as soon as its stage is free."""
        first_tiles, runs = _program_items(n_items, TILES)
        for chunk in range((runs[0] + runs[1]) * n_chunks):
            tile, k_chunk = _tile_of_chunk(chunk, n_chunks, first_tiles, runs)
            row_tile, key_tile, split, within = _tile_place(tile, SPLITS, TILES)
            _issue_pair_loads(chunk, k_chunk, n_student, row_tile, key_tile, q_desc, k_desc, tq_desc, tk_desc,
                              q_bufs, k_bufs, ready, empty, STAGES)

    @gluon.jit
    def _distillation_tile_kernel(q_desc, k_desc, tq_desc, tk_desc, row_out_ptr, col_partial_ptr, scale_ptr,
                                  teacher_scale_ptr, n_rows, n_keys, n_items, n_partials,
                                  SPLITS: gl.constexpr, TILES: gl.constexpr, EVEN: gl.constexpr,
                                  STAGES: gl.constexpr, MMAS_IN_FLIGHT: gl.constexpr,
                                  WORKER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
        BK: gl.constexpr = q_desc.block_type.shape[1]
        n_student = gl.cdiv(q_desc.shape[1], BK)
        n_chunks = n_student + gl.cdiv(tq_desc.shape[1], BK)
        q_bufs, k_bufs, ready, empty, turn = _operand_ring(q_desc, k_desc, STAGES)
        gl.warp_specialize([
            (_consumer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, row_out_ptr, col_partial_ptr,
                         scale_ptr, teacher_scale_ptr, n_rows, n_keys, n_items, n_partials, n_student,
                         n_chunks, 0, SPLITS, TILES, EVEN, STAGES, MMAS_IN_FLIGHT)),
            (_consumer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, row_out_ptr, col_partial_ptr,
                         scale_ptr, teacher_scale_ptr, n_rows, n_keys, n_items, n_partials, n_student,
                         n_chunks, 1, SPLITS, TILES, EVEN, STAGES, MMAS_IN_FLIGHT)),
            (_producer, (q_desc, k_desc, tq_desc, tk_desc, q_bufs, k_bufs, ready, empty, n_items, n_student,
                         n_chunks, SPLITS, TILES, STAGES)),
        ], [4, 1], [WORKER_REGISTERS, PRODUCER_REGISTERS])


if gluon is not None:

    @gluon.jit
    def _vector_part(pointer, first, n, PART: gl.constexpr, layout: gl.constexpr, EVEN: gl.constexpr):
        """``PART`` fp32 entries of a vector from ``first`` on, in ``layout`` (0 past ``n``)."""
        index = first + gl.arange(0, PART, layout=layout)
        if EVEN:
            return gl.load(pointer + index)
        return gl.load(pointer + index, mask=index < n, other=0.0)

    @gluon.jit
    def _soft_target_part(z, t, rows, row_z_lse, row_t_lse, row_z_weight, row_t_weight, col_stats, keys,
                          n_rows, n_keys, COLUMNS: gl.constexpr, EVEN: gl.constexpr):
        """G of one part of a tile from the logits ``z`` and ``t`` (log2 units): the rows' terms
        (log-sum-exps in log2 units, weights), and with COLUMNS the keys' (``col_stats``, the same
        four); 0 outside the problem."""
        grad = (row_z_weight[:, None] * gl.exp2(z - row_z_lse[:, None])
                - row_t_weight[:, None] * gl.exp2(t - row_t_lse[:, None]))
        if COLUMNS:
            col_z_lse, col_t_lse, col_z_weight, col_t_weight = col_stats
            grad += (col_z_weight[None, :] * gl.exp2(z - col_z_lse[None, :])
                     - col_t_weight[None, :] * gl.exp2(t - col_t_lse[None, :]))
        if not EVEN:  # outside the problem the exponentials may be inf and the weights 0
            grad = gl.where((rows < n_rows)[:, None] & (keys < n_keys)[None, :], grad, 0.0)
        return grad

    @gluon.jit
    def _grad_consumer(q_desc, k_desc, g_desc, q_bufs, k_bufs, g_bufs, ready, empty, turn, row_sums_ptr,
                       row_z_lse_ptr, row_t_lse_ptr, row_z_weight_ptr, row_t_weight_ptr, col_z_lse_ptr,
                       col_t_lse_ptr, col_z_weight_ptr, col_t_weight_ptr, scale_ptr, teacher_scale_ptr,
                       inv_g_scale_ptr, n_rows, n_keys, n_student, n_chunks, GROUP: gl.constexpr,
                       COLUMNS: gl.constexpr, SCALED_G: gl.constexpr, EVEN: gl.constexpr,
                       STAGES: gl.constexpr, MMAS_IN_FLIGHT: gl.constexpr, G_BUFFERS: gl.constexpr):
        """One consumer warpgroup of the backward: a contiguous run of the super-tile's tiles in
        row-major order, each tile's G stored by TMA in eight parts, its row sums added to memory
        once per row block."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        PART: gl.constexpr = BN // 8
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
        n_key_tiles, _, first_tiles, runs = _program_tiles(n_rows, n_keys, q_desc, k_desc)
        my_tiles = runs[GROUP]
        z_scale = gl.load(scale_ptr) * LOG2E  # log2 units
        t_scale = gl.load(teacher_scale_ptr) * LOG2E
        inv_g_scale = 1.0
        if SCALED_G:
            inv_g_scale = gl.load(inv_g_scale_ptr)
        turn_phase = 1 - GROUP  # see gluon_sigmoid._multiply
        student = gl.zeros([BM, BN], gl.float32, layout)
        teacher = gl.zeros([BM, BN], gl.float32, layout)
        part_layout: gl.constexpr = _eighths(student)[0].type.layout
        part_rows: gl.constexpr = gl.SliceLayout(1, part_layout)
        part_keys: gl.constexpr = gl.SliceLayout(0, part_layout)
        row_sums = gl.zeros([BM], gl.float32, part_rows)
        for nth_tile in range(my_tiles):
            tile = first_tiles[GROUP] + nth_tile
            row_tile = tile // n_key_tiles
            key_tile = tile - row_tile * n_key_tiles
            # the rows' statistics, loaded while the tile's products are waited for
            first_row = row_tile * BM
            row_z_lse = _vector_part(row_z_lse_ptr, first_row, n_rows, BM, part_rows, EVEN) * LOG2E
            row_t_lse = _vector_part(row_t_lse_ptr, first_row, n_rows, BM, part_rows, EVEN) * LOG2E
            row_z_weight = _vector_part(row_z_weight_ptr, first_row, n_rows, BM, part_rows, EVEN)
            row_t_weight = _vector_part(row_t_weight_ptr, first_row, n_rows, BM, part_rows, EVEN)
            student, teacher, turn_phase = _multiply_pair(
                q_bufs, k_bufs, ready, empty, turn, student, teacher, nth_tile, runs, turn_phase, n_student,
                n_chunks, GROUP, STAGES, MMAS_IN_FLIGHT)
            rows = first_row + gl.arange(0, BM, layout=part_rows)
            z_parts = _eighths(student)
            t_parts = _eighths(teacher)
            for part in gl.static_range(8):
                first_key = key_tile * BN + part * PART
                keys = first_key + gl.arange(0, PART, layout=part_keys)
                col_stats = (row_z_lse, row_t_lse, row_z_weight, row_t_weight)  # (unused without COLUMNS)
                if COLUMNS:
                    col_stats = (
                        _vector_part(col_z_lse_ptr, first_key, n_keys, PART, part_keys, EVEN) * LOG2E,
                        _vector_part(col_t_lse_ptr, first_key, n_keys, PART, part_keys, EVEN) * LOG2E,
                        _vector_part(col_z_weight_ptr, first_key, n_keys, PART, part_keys, EVEN),
                        _vector_part(col_t_weight_ptr, first_key, n_keys, PART, part_keys, EVEN))
                grad = _soft_target_part(z_parts[part] * z_scale, t_parts[part] * t_scale, rows, row_z_lse,
                                         row_t_lse, row_z_weight, row_t_weight, col_stats, keys, n_rows,
                                         n_keys, COLUMNS, EVEN)
                # the rows' sums added entry-wise across the parts, reduced across lanes once a tile
                if part == 0:
                    grad_sums = grad
                else:
                    grad_sums += grad
                stored = grad
                if SCALED_G:
                    stored = grad * inv_g_scale
                g_buffer = g_bufs.index(GROUP * G_BUFFERS + part % G_BUFFERS)
                # The store that last read this buffer (G_BUFFERS parts ago) is done.
                tma.store_wait(pendings=G_BUFFERS - 1)
                g_buffer.store(stored.to(g_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(g_desc, [first_row, first_key], g_buffer)
            row_sums += gl.sum(grad_sums, axis=1)
            if (nth_tile == my_tiles - 1) or (key_tile == n_key_tiles - 1):  # this row block's last tile
                gl.atomic_add(row_sums_ptr + rows, row_sums, mask=rows < n_rows, sem="relaxed")
                row_sums = gl.zeros([BM], gl.float32, part_rows)
        tma.store_wait(pendings=0)  # G's last stores have read their buffers before the program ends

    @gluon.jit
    def _grad_producer(q_desc, k_desc, tq_desc, tk_desc, q_bufs, k_bufs, ready, empty, n_rows, n_keys,
                       n_student, n_chunks, STAGES: gl.constexpr):
        """The backward's producer warp: every chunk of the program, in the order the consumers
        multiply them, loaded into the ring as soon as its stage is free."""
        n_key_tiles, _, first_tiles, runs = _program_tiles(n_rows, n_keys, q_desc, k_desc)
        for chunk in range((runs[0] + runs[1]) * n_chunks):
            tile, k_chunk = _tile_of_chunk(chunk, n_chunks, first_tiles, runs)
            row_tile = tile // n_key_tiles
            key_tile = tile - row_tile * n_key_tiles
            _issue_pair_loads(chunk, k_chunk, n_student, row_tile, key_tile, q_desc, k_desc, tq_desc, tk_desc,
                              q_bufs, k_bufs, ready, empty, STAGES)

    @gluon.jit
    def _soft_target_tile_kernel(q_desc, k_desc, tq_desc, tk_desc, g_desc, row_sums_ptr, row_z_lse_ptr,
                                 row_t_lse_ptr, row_z_weight_ptr, row_t_weight_ptr, col_z_lse_ptr,
                                 col_t_lse_ptr, col_z_weight_ptr, col_t_weight_ptr, scale_ptr,
                                 teacher_scale_ptr, inv_g_scale_ptr, n_rows, n_keys, COLUMNS: gl.constexpr,
                                 SCALED_G: gl.constexpr, EVEN: gl.constexpr, STAGES: gl.constexpr,
                                 MMAS_IN_FLIGHT: gl.constexpr, G_BUFFERS: gl.constexpr,
                                 WORKER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
        BK: gl.constexpr = q_desc.block_type.shape[1]
        n_student = gl.cdiv(q_desc.shape[1], BK)
        n_chunks = n_student + gl.cdiv(tq_desc.shape[1], BK)
        q_bufs, k_bufs, ready, empty, turn = _operand_ring(q_desc, k_desc, STAGES)
        g_bufs = gl.allocate_shared_memory(g_desc.dtype, [2 * G_BUFFERS] + g_desc.block_type.shape,
                                           g_desc.layout)
        gl.warp_specialize([
            (_grad_consumer, (q_desc, k_desc, g_desc, q_bufs, k_bufs, g_bufs, ready, empty, turn,
                              row_sums_ptr, row_z_lse_ptr, row_t_lse_ptr, row_z_weight_ptr, row_t_weight_ptr,
                              col_z_lse_ptr, col_t_lse_ptr, col_z_weight_ptr, col_t_weight_ptr, scale_ptr,
                              teacher_scale_ptr, inv_g_scale_ptr, n_rows, n_keys, n_student, n_chunks, 0,
                              COLUMNS, SCALED_G, EVEN, STAGES, MMAS_IN_FLIGHT, G_BUFFERS)),
            (_grad_consumer, (q_desc, k_desc, g_desc, q_bufs, k_bufs, g_bufs, ready, empty, turn,
                              row_sums_ptr, row_z_lse_ptr, row_t_lse_ptr, row_z_weight_ptr, row_t_weight_ptr,
                              col_z_lse_ptr, col_t_lse_ptr, col_z_weight_ptr, col_t_weight_ptr, scale_ptr,
                              teacher_scale_ptr, inv_g_scale_ptr, n_rows, n_keys, n_student, n_chunks, 1,
                              COLUMNS, SCALED_G, EVEN, STAGES, MMAS_IN_FLIGHT, G_BUFFERS)),
            (_grad_producer, (q_desc, k_desc, tq_desc, tk_desc, q_bufs, k_bufs, ready, empty, n_rows, n_keys,
                              n_student, n_chunks, STAGES)),
        ], [4, 1], [WORKER_REGISTERS, PRODUCER_REGISTERS])


# What finishing an item costs a consumer beyond its tiles (storing the row block's statistics and
# starting afresh), in tiles: an estimate, which only breaks ties between splits.
ITEM_OVERHEAD_TILES = 0.5


def splits_for(n_rows: int, n_keys: int, device: torch.device, splits: int | None = None) -> int:
    """How many equal ranges of key tiles each row block's keys are cut into (``splits`` if
    given, at most the key tiles): the divisor of the key tiles whose items (a row block's range)
    keep the busiest consumer shortest. Each program's two consumers take equal runs of whole
    items, so the launch lasts cdiv(items, consumers) items; more splits spread them more evenly
    but each item costs ``ITEM_OVERHEAD_TILES`` more."""
    key_tiles = triton.cdiv(n_keys, BLOCK_N)
    if splits is not None:
        return max(1, min(splits, key_tiles))
    consumers, row_blocks = 2 * sm_count(device), triton.cdiv(n_rows, BLOCK_M)

    def busiest_consumer(d: int) -> float:
        return triton.cdiv(row_blocks * d, consumers) * (key_tiles // d + ITEM_OVERHEAD_TILES)

    divisors = [d for d in range(1, key_tiles + 1) if key_tiles % d == 0]
    return min(divisors, key=lambda d: (busiest_consumer(d), d))


def soft_target_stats_both(queries: torch.Tensor, keys: torch.Tensor, teacher_queries: torch.Tensor,
                           teacher_keys: torch.Tensor, scale: torch.Tensor, teacher_scale: torch.Tensor,
                           column_partials: torch.Tensor, rows_out: torch.Tensor, columns: torch.Tensor, *,
                           accumulate_columns: bool, splits: int | None = None) -> None:
    """The distillation statistics (:func:`.distillation.soft_target_stats`'s: student log-sum-exp,
    teacher log-sum-exp, gap) of every row over every key, written to ``rows_out`` [3, rows], and
    of every key over these rows, written to ``columns`` [3, keys] or, with
    ``accumulate_columns``, merged into the key statistics it holds (over other rows): both
    directions in one launch. ``scale``, ``teacher_scale``: 0-d fp32. ``column_partials``: an fp32
    buffer of at least ``3 * PARTIALS_PER_BLOCK * cdiv(rows, BLOCK_M) * keys`` entries,
    overwritten. ``rows_out`` and ``columns``: fp32 with unit column stride."""
    n_rows, n_keys = queries.shape[0], keys.shape[0]
    n_partials = PARTIALS_PER_BLOCK * triton.cdiv(n_rows, BLOCK_M)
    if not column_partials.is_contiguous() or column_partials.numel() < 3 * n_partials * n_keys:
        raise ValueError(f"column_partials must be a contiguous buffer of at least {3 * n_partials * n_keys} "
                         f"entries, got {column_partials.numel()}")
    partials = column_partials.view(-1)[: 3 * n_partials * n_keys].view(3, n_partials, n_keys)
    device = queries.device
    splits = splits_for(n_rows, n_keys, device, splits)
    key_tiles = triton.cdiv(n_keys, BLOCK_N)
    tiles_per_split = triton.cdiv(key_tiles, splits)
    splits = triton.cdiv(key_tiles, tiles_per_split)
    row_out = torch.empty((3, splits, n_rows), dtype=torch.float32, device=device)
    n_items = (n_partials // PARTIALS_PER_BLOCK) * splits
    grid = (max(1, min(sm_count(device), triton.cdiv(n_items, 2))),)
    descriptors = (make_descriptor(queries, BLOCK_M), make_descriptor(keys, BLOCK_N),
                   make_descriptor(teacher_queries, BLOCK_M), make_descriptor(teacher_keys, BLOCK_N))
    launch_jit(
        _distillation_tile_kernel, grid,
        *descriptors, row_out, partials, scale, teacher_scale, n_rows, n_keys, n_items, n_partials,
        SPLITS=splits, TILES=tiles_per_split,
        EVEN=n_rows % BLOCK_M == 0 and n_keys % (BLOCK_N * tiles_per_split) == 0, STAGES=STAGES,
        MMAS_IN_FLIGHT=MMAS_IN_FLIGHT, WORKER_REGISTERS=_WORKER_REGISTERS,
        PRODUCER_REGISTERS=_PRODUCER_REGISTERS, num_warps=4,
    )
    merge_soft_target_parts(row_out, out=rows_out)
    merge_soft_target_parts(partials, previous=columns if accumulate_columns else None, out=columns)


class GluonSoftTargetRoute:
    """The distillation backward's super-tile route (:mod:`.super_tiles`) on Hopper: one Gluon kernel
    per super-tile multiplies both models' products, writes G = a_i P_ij - b_i T_ij (+ the columns'
    c_j P'_ij - d_j T'_ij), divided by the walk's G factor (``inv_g_scale`` its inverse), by TMA,
    and adds its row sums into ``row_sums``: what :class:`.distillation.SoftTargetRoute` computes
    with the Triton kernel, whose epilogue the MMAs do not overlap."""

    g_alone = True  # the kernel makes both products itself: no dot-product buffer beside G
    segments = None

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor, teacher: TeacherLogits,
                 rows: SoftTargetGradients, columns: SoftTargetGradients | None, row_sums: torch.Tensor,
                 inv_g_scale: torch.Tensor | None):
        self.queries, self.keys, self.scale, self.teacher = queries, keys, scale, teacher
        self.rows = SoftTargetGradients(*map(fp32_vector, rows))
        self.columns = None if columns is None else SoftTargetGradients(*map(fp32_vector, columns))
        self.row_sums, self.inv_g_scale = row_sums, inv_g_scale

    def scratch(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.queries.device)

    def row_panel(self, start, end):
        return dict(rows=end - start, row_sums=self.row_sums[start:end],
                    stats=[part[start:end] for part in self.rows],
                    descriptors=(make_descriptor(self.queries[start:end], BLOCK_M),
                                 make_descriptor(self.teacher.queries[start:end], BLOCK_M)))

    def key_tile(self, start, end):
        columns = self.columns
        stats = None if columns is None else [part[start:end] for part in columns]
        return dict(keys=end - start, stats=stats,
                    descriptors=(make_descriptor(self.keys[start:end], BLOCK_N),
                                 make_descriptor(self.teacher.keys[start:end], BLOCK_N)))

    def write(self, row, tile, g):
        n_rows, n_keys = row["rows"], tile["keys"]
        if not tma_aligned(g):
            raise ValueError("g: its start and row stride must be multiples of 16 bytes (G leaves the "
                             "kernel by TMA)")
        dummy = unused_pointer(g.device)
        column_stats = tile["stats"] if tile["stats"] is not None else [dummy] * 4
        tiles = triton.cdiv(n_rows, BLOCK_M) * triton.cdiv(n_keys, BLOCK_N)
        grid = (max(1, min(sm_count(g.device), triton.cdiv(tiles, 2))),)
        (q_desc, teacher_q_desc), (k_desc, teacher_k_desc) = row["descriptors"], tile["descriptors"]
        launch_jit(
            _soft_target_tile_kernel, grid,
            q_desc, k_desc, teacher_q_desc, teacher_k_desc, make_descriptor(g, BLOCK_M, G_COLUMNS),
            row["row_sums"], *row["stats"], *column_stats, self.scale, self.teacher.scale,
            self.inv_g_scale if self.inv_g_scale is not None else dummy, n_rows, n_keys,
            COLUMNS=tile["stats"] is not None, SCALED_G=self.inv_g_scale is not None,
            EVEN=n_rows % BLOCK_M == 0 and n_keys % BLOCK_N == 0, STAGES=STAGES,
            MMAS_IN_FLIGHT=MMAS_IN_FLIGHT, G_BUFFERS=G_BUFFERS, WORKER_REGISTERS=_WORKER_REGISTERS,
            PRODUCER_REGISTERS=_PRODUCER_REGISTERS, num_warps=4,
        )
