"""Hopper kernel for the symmetric softmax loss's forward: each row's log-sum-exp and each key's,
from one pass over the tiles.

What it replaces, where it can run: the statistics kernel of :mod:`.stats` with fused column
partials, whose tensor-core work and per-logit work (two exponentials, row and column maxima and
sums) run one after the other in each program. Here they overlap, on the skeleton of the sigmoid
loss's kernel (:mod:`.gluon_sigmoid`): one persistent program per SM, two consumer warpgroups that
take turns at the tensor cores, each running its tile's epilogue while the other multiplies, and
one producer warp that loads every chunk by TMA into a shared ring.

The work is cut into *items*: a block of 128 rows against one of ``splits`` equal ranges of key
tiles. A consumer takes a contiguous run of items, walks each item's tiles and keeps its rows'
running maximum and sum of exponentials in registers; at the item's end it writes their
log-sum-exp into ``row_out[split]`` (merged across splits afterwards). Each tile also gives, for
each of its keys, the log-sum-exp over each warp's 32 rows (rows r with (r mod 64) div 16 equal to
the warp's index): those reductions stay inside a warp (no shared memory, no barrier), and
``column_partials`` gets four rows per row block, merged afterwards as the statistics kernel's.

Logits are handled in log2 units (the scale times log2 e), and each maximum is taken over the dot
products and scaled once, since the scale is positive. A tile goes through its epilogue in eight
column parts, so that the temporaries of one part, not of the whole tile, sit beside the
accumulator's registers.

With the score filter on the model's own scores (:class:`OwnScoreFilter`; FILTER), each row's and
each key's bound (its positive pair's dot product where the margin is >= 0) shifts its exponentials
instead of a running maximum: no logit a row or key keeps is far above it (docs/algorithms.md).
Only the tiles whose keys may hold one of the row block's positives test for them.

It covers the symmetric softmax forward, plain or with that filter: half-precision operands whose
rows are 16-byte aligned, no bias, group mask, hardness offset or guide, on a Hopper GPU, with a
Triton that has Gluon. Everything else takes :mod:`.stats`. Gluon kernels do not run under
``TRITON_INTERPRET``: its tests (``tests/test_gluon_stats.py``) run on GPUs only, against float64.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from . import compile_plans, gluon_sigmoid
from .device import sm_count
from .gluon_sigmoid import (
    _PRODUCER_REGISTERS,
    BLOCK_M,
    BLOCK_N,
    MMAS_IN_FLIGHT,
    STAGES,
    gluon,
    make_descriptor,
)
from .jit_math import LN2, LOG2E
from .launch import launch_jit

if gluon is not None:  # (None: a Triton without Gluon)
    from triton.experimental.gluon import language as gl

    # what this kernel shares with the sigmoid loss's: its parts, loads, tile order and MMA loop
    from .gluon_sigmoid import _eighths, _issue_loads, _multiply, _operand_ring, _tile_of_chunk

# Registers per thread of the second consumer warpgroup (the first gets what is left).
_WORKER_REGISTERS = 232
# Column partial rows per row block: one per warp of a consumer warpgroup, each over the warp's
# 32 rows (the module docstring says which).
PARTIALS_PER_BLOCK = 4
# Where ``softmax_statistics="auto"`` takes this kernel: 384 <= c < 2048 and rows x keys x c >=
# 3 * 2^37 (32k x 32k at c = 384, 16k x 16k at 1536). On less work the loss measured no faster
# with it; from c = 2048 on, :mod:`.stats` (tuned to 128 x 256 tiles there) measured faster in the
# loss, or as fast (benchmarks/README.md, "The two statistics kernels by width").
AUTO_MIN_WIDTH = 384
AUTO_MAX_WIDTH = 2048
AUTO_MIN_WORK = 3 * 2**37


def usable(queries: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether :func:`row_and_column_stats` can take these operands (see the module docstring):
    the sigmoid loss's kernel's conditions without a group mask, which are this kernel's too; the
    bias, masks and other options it does not cover are for the caller to rule out, as
    ``TritonBlocks`` does."""
    return gluon_sigmoid.usable(queries, keys, has_mask=False)


if gluon is not None:

    @gluon.jit
    def _program_items(n_items, TILES: gl.constexpr):
        """The program's share of the items, in tiles (each item is TILES tiles): the first tile
        and the length of each consumer's run, whole items each."""
        per_worker = gl.cdiv(n_items, 2 * gl.num_programs(0))
        first = (2 * gl.program_id(0) * per_worker, (2 * gl.program_id(0) + 1) * per_worker)
        runs = (gl.minimum(gl.maximum(n_items - first[0], 0), per_worker) * TILES,
                gl.minimum(gl.maximum(n_items - first[1], 0), per_worker) * TILES)
        return (first[0] * TILES, first[1] * TILES), runs

    @gluon.jit
    def _tile_place(tile, SPLITS: gl.constexpr, TILES: gl.constexpr):
        """(row tile, key tile, split, tile within the split) of the ``tile``-th tile, items in
        row-major order (a row block's splits one after the other)."""
        item = tile // TILES
        within = tile - item * TILES
        row_tile = item // SPLITS
        split = item - row_tile * SPLITS
        return row_tile, split * TILES + within, split, within

    @gluon.jit
    def _log2(x):
        """log2 by the special-function unit (lg2.approx: an absolute error of about 2^-22, far
        below what an fp32 log-sum-exp keeps): the library's, a polynomial of about 25
        instructions, was a third of a tile's epilogue in the column log-sum-exps."""
        return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _column_part(dots, scale, col_partial_ptr, row_tile, first_key, n_keys, EVEN: gl.constexpr):
        """Each warp's log-sum-exp over its 32 rows of one part [128, PART] of a tile's dot
        products (-inf outside the problem), stored at ``col_partial[row_tile * 4 + warp, key]``
        in natural units."""
        PART: gl.constexpr = dots.type.shape[1]
        # rows as (64-row half, warp, row within the warp's 16): the half is a register index, so
        # the reduction over it stays in the thread; the one over the 16 rows crosses lanes.
        by_warp = dots.reshape([2, 4, 16, PART])
        col_max = gl.max(gl.max(by_warp, axis=0), axis=1) * scale
        col_shift = col_max
        if not EVEN:  # a column with no row in the problem: shift by 0, its sum is 0, its LSE -inf
            col_shift = gl.where(col_max == float("-inf"), 0.0, col_max)
        terms = gl.exp2(by_warp * scale - gl.expand_dims(gl.expand_dims(col_shift, 1), 0))
        col_lse = (col_shift + _log2(gl.sum(gl.sum(terms, axis=0), axis=1))) * LN2
        layout: gl.constexpr = col_lse.type.layout
        warps = gl.arange(0, 4, layout=gl.SliceLayout(1, layout))
        keys = first_key + gl.arange(0, PART, layout=gl.SliceLayout(0, layout))
        pointers = col_partial_ptr + (row_tile * 4 + warps).to(gl.int64)[:, None] * n_keys + keys[None, :]
        if EVEN:
            gl.store(pointers, col_lse)
        else:
            gl.store(pointers, col_lse, mask=(keys < n_keys)[None, :] & (warps < 4)[:, None])

    @gluon.jit
    def _key_bounds(key_bound_ptr, first_key, n_keys, PART: gl.constexpr, layout: gl.constexpr,
                    EVEN: gl.constexpr):
        """The bounds of the ``PART`` keys from ``first_key`` on, in ``layout`` (0 past the keys)."""
        keys = first_key + gl.arange(0, PART, layout=layout)
        if EVEN:
            bounds = gl.load(key_bound_ptr + keys)
        else:
            bounds = gl.load(key_bound_ptr + keys, mask=keys < n_keys, other=0.0)
        return bounds

    @gluon.jit
    def _filtered_part(dots, scale, row_shift, row_gap, positives, key_bound, margin, relative_margin,
                       col_partial_ptr, row_tile, first_key, n_keys, EVEN: gl.constexpr, TEST: gl.constexpr):
        """One part [128, PART] of a tile under the own-score filter: returns its rows' kept terms,
        and stores each warp's column log-sum-exp over its 32 rows as :func:`_column_part` does.
        Every exponential is shifted by a bound of what its row or key keeps (its positive's dot
        product: ``row_shift`` and the part's ``key_bound``, times ``scale``), so no maximum is
        taken; an entry is left out where its shifted logit is above its threshold's, ``-(margin +
        relative_margin * |bound|) * scale`` (``row_gap`` for the rows). Entries outside the
        problem hold -inf."""
        PART: gl.constexpr = dots.type.shape[1]
        layout: gl.constexpr = dots.type.layout
        keys = first_key + gl.arange(0, PART, layout=gl.SliceLayout(0, layout))
        key_shift = key_bound * scale
        key_gap = -(margin + relative_margin * gl.abs(key_bound)) * scale
        # a NaN logit is never above its threshold: it stays
        row_logits = dots * scale - row_shift[:, None]
        row_dropped = row_logits > row_gap[:, None]
        col_logits = dots * scale - key_shift[None, :]
        col_dropped = col_logits > key_gap[None, :]
        if TEST:  # (tiles that may hold a row's positive) positives are never left out
            candidates = positives[:, None] != keys[None, :]
            row_dropped = row_dropped & candidates
            col_dropped = col_dropped & candidates
        row_terms = gl.where(row_dropped, 0.0, gl.exp2(row_logits))
        col_terms = gl.where(col_dropped, 0.0, gl.exp2(col_logits))
        col_sums = gl.sum(gl.sum(col_terms.reshape([2, 4, 16, PART]), axis=0), axis=1)
        sums_layout: gl.constexpr = col_sums.type.layout
        warps = gl.arange(0, 4, layout=gl.SliceLayout(1, sums_layout))
        keys = first_key + gl.arange(0, PART, layout=gl.SliceLayout(0, sums_layout))
        col_lse = (gl.convert_layout(key_shift, gl.SliceLayout(0, sums_layout))[None, :]
                   + _log2(col_sums)) * LN2
        pointers = col_partial_ptr + (row_tile * 4 + warps).to(gl.int64)[:, None] * n_keys + keys[None, :]
        if EVEN:
            gl.store(pointers, col_lse)
        else:
            gl.store(pointers, col_lse, mask=(keys < n_keys)[None, :] & (warps < 4)[:, None])
        return row_terms

    @gluon.jit
    def _filtered_tile(parts, scale, row_shift, row_gap, positive_ptr, key_bound_ptr, first_bounds, margin,
                       relative_margin, col_partial_ptr, row_tile, key_tile, n_rows, n_keys,
                       EVEN: gl.constexpr, TEST: gl.constexpr):
        """:func:`_filtered_part` over a tile's eight parts; returns the rows' kept terms, added
        entry-wise across the parts. ``first_bounds``: the first part's key bounds, loaded before
        the tile's products were waited for; each later part's are loaded while the part before it
        runs, so that no part waits for its loads. With TEST, the rows' positives are loaded and
        kept."""
        PART: gl.constexpr = parts[0].type.shape[1]
        BM: gl.constexpr = parts[0].type.shape[0]
        bounds_layout: gl.constexpr = first_bounds.type.layout
        positives = None
        if TEST:
            rows = row_tile * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, parts[0].type.layout))
            positives = gl.load(positive_ptr + rows, mask=rows < n_rows, other=-1)
        key_bounds = first_bounds
        for part in gl.static_range(8):
            if part < 7:
                next_bounds = _key_bounds(key_bound_ptr, (key_tile * 8 + part + 1) * PART, n_keys, PART,
                                          bounds_layout, EVEN)
            terms = _filtered_part(parts[part], scale, row_shift, row_gap, positives, key_bounds, margin,
                                   relative_margin, col_partial_ptr, row_tile, (key_tile * 8 + part) * PART,
                                   n_keys, EVEN, TEST)
            if part < 7:
                key_bounds = next_bounds
            if part == 0:
                row_terms = terms
            else:
                row_terms += terms
        return row_terms

    @gluon.jit
    def _consumer(q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, row_out_ptr, col_partial_ptr, scale_ptr,
                  row_bound_ptr, positive_ptr, positive_low_ptr, positive_high_ptr, key_bound_ptr, margin,
                  relative_margin, n_rows, n_keys, n_items, GROUP: gl.constexpr, SPLITS: gl.constexpr,
                  TILES: gl.constexpr, EVEN: gl.constexpr, FILTER: gl.constexpr, STAGES: gl.constexpr,
                  MMAS_IN_FLIGHT: gl.constexpr):
        """One consumer warpgroup: a contiguous run of items, each a row block's running row
        statistics over the item's tiles, and each tile's column partials."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        PART: gl.constexpr = BN // 8
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
        first_tiles, runs = _program_items(n_items, TILES)
        n_chunks = gl.cdiv(q_desc.shape[1], q_desc.block_type.shape[1])
        scale = gl.load(scale_ptr) * LOG2E  # log2 units
        turn_phase = 1 - GROUP  # see gluon_sigmoid._multiply
        acc = gl.zeros([BM, BN], gl.float32, layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        part_rows: gl.constexpr = gl.SliceLayout(1, _eighths(acc)[0].type.layout)
        part_keys: gl.constexpr = gl.SliceLayout(0, _eighths(acc)[0].type.layout)
        local_rows = gl.arange(0, BM, layout=row_layout)
        local_keys = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        running_max = gl.full([BM], float("-inf"), gl.float32, row_layout)
        running_sum = gl.zeros([BM], gl.float32, row_layout)
        for nth_tile in range(runs[GROUP]):
            row_tile, key_tile, split, within = _tile_place(first_tiles[GROUP] + nth_tile, SPLITS, TILES)
            if FILTER:  # the tile's bounds and positive range, loaded while its products are waited for
                part_row_index = row_tile * BM + gl.arange(0, BM, layout=part_rows)
                row_bound = gl.load(row_bound_ptr + part_row_index, mask=part_row_index < n_rows, other=0.0)
                lowest_positive = gl.load(positive_low_ptr + row_tile)
                highest_positive = gl.load(positive_high_ptr + row_tile)
                first_bounds = _key_bounds(key_bound_ptr, key_tile * BN, n_keys, PART, part_keys, EVEN)
            acc, turn_phase = _multiply(q_bufs, k_bufs, ready, empty, turn, acc, nth_tile, runs, turn_phase,
                                        n_chunks, GROUP, STAGES, MMAS_IN_FLIGHT)
            rows = row_tile * BM + local_rows
            dots = acc
            if not EVEN:
                keys = key_tile * BN + local_keys
                dots = gl.where((rows < n_rows)[:, None] & (keys < n_keys)[None, :], dots, float("-inf"))
            parts = _eighths(dots)
            if FILTER:
                # each row's exponentials shifted by its bound: no running maximum
                row_shift = row_bound * scale
                row_gap = -(margin + relative_margin * gl.abs(row_bound)) * scale
                # only the tiles whose keys may hold a row's positive test for them
                if (lowest_positive < key_tile * BN + BN) & (highest_positive >= key_tile * BN):
                    row_terms = _filtered_tile(parts, scale, row_shift, row_gap, positive_ptr,
                                               key_bound_ptr, first_bounds, margin, relative_margin,
                                               col_partial_ptr, row_tile, key_tile, n_rows, n_keys, EVEN,
                                               True)
                else:
                    row_terms = _filtered_tile(parts, scale, row_shift, row_gap, positive_ptr,
                                               key_bound_ptr, first_bounds, margin, relative_margin,
                                               col_partial_ptr, row_tile, key_tile, n_rows, n_keys, EVEN,
                                               False)
                shift = gl.convert_layout(row_shift, row_layout)
            else:
                new_max = gl.maximum(running_max, gl.max(dots, axis=1) * scale)
                shift = new_max
                if not EVEN:  # rows that have met no key yet: shift by 0
                    shift = gl.where(new_max == float("-inf"), 0.0, new_max)
                running_sum = running_sum * gl.exp2(running_max - shift)
                running_max = new_max
                part_shift = gl.convert_layout(shift, part_rows)
                for part in gl.static_range(8):
                    # the rows' terms added entry-wise across the parts, reduced across lanes once
                    if part == 0:
                        row_terms = gl.exp2(parts[part] * scale - part_shift[:, None])
                    else:
                        row_terms += gl.exp2(parts[part] * scale - part_shift[:, None])
                    _column_part(parts[part], scale, col_partial_ptr, row_tile, key_tile * BN + part * PART,
                                 n_keys, EVEN)
            running_sum += gl.convert_layout(gl.sum(row_terms, axis=1), row_layout)
            if within == TILES - 1:  # the item's last tile: its rows' log-sum-exp over the split
                row_lse = (shift + gl.log2(running_sum)) * LN2
                gl.store(row_out_ptr + split.to(gl.int64) * n_rows + rows, row_lse, mask=rows < n_rows)
                running_max = gl.full([BM], float("-inf"), gl.float32, row_layout)
                running_sum = gl.zeros([BM], gl.float32, row_layout)

    @gluon.jit
    def _producer(q_desc, k_desc, q_bufs, k_bufs, ready, empty, n_items, SPLITS: gl.constexpr,
                  TILES: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp: every chunk of the program, in the order the consumers multiply them,
        loaded into the ring as soon as its stage is free."""
        first_tiles, runs = _program_items(n_items, TILES)
        n_chunks = gl.cdiv(q_desc.shape[1], q_desc.block_type.shape[1])
        for chunk in range((runs[0] + runs[1]) * n_chunks):
            tile, k_chunk = _tile_of_chunk(chunk, n_chunks, first_tiles, runs)
            row_tile, key_tile, split, within = _tile_place(tile, SPLITS, TILES)
            _issue_loads(chunk, k_chunk, row_tile, key_tile, q_desc, k_desc, q_bufs, k_bufs, ready, empty,
                         STAGES)

    @gluon.jit
    def _stats_tile_kernel(q_desc, k_desc, row_out_ptr, col_partial_ptr, scale_ptr, row_bound_ptr,
                           positive_ptr, positive_low_ptr, positive_high_ptr, key_bound_ptr, margin,
                           relative_margin, n_rows, n_keys,
                           n_items, SPLITS: gl.constexpr, TILES: gl.constexpr, EVEN: gl.constexpr,
                           FILTER: gl.constexpr, STAGES: gl.constexpr, MMAS_IN_FLIGHT: gl.constexpr,
                           WORKER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
        q_bufs, k_bufs, ready, empty, turn = _operand_ring(q_desc, k_desc, STAGES)
        gl.warp_specialize([
            (_consumer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, row_out_ptr, col_partial_ptr,
                         scale_ptr, row_bound_ptr, positive_ptr, positive_low_ptr, positive_high_ptr,
                         key_bound_ptr, margin, relative_margin, n_rows, n_keys, n_items, 0, SPLITS, TILES,
                         EVEN, FILTER, STAGES, MMAS_IN_FLIGHT)),
            (_consumer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, row_out_ptr, col_partial_ptr,
                         scale_ptr, row_bound_ptr, positive_ptr, positive_low_ptr, positive_high_ptr,
                         key_bound_ptr, margin, relative_margin, n_rows, n_keys, n_items, 1, SPLITS, TILES,
                         EVEN, FILTER, STAGES, MMAS_IN_FLIGHT)),
            (_producer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, n_items, SPLITS, TILES, STAGES)),
        ], [4, 1], [WORKER_REGISTERS, PRODUCER_REGISTERS])

    # Its compile takes seconds: a plan builds it in the background while the call takes the
    # statistics kernel of .stats (``ready``).
    compile_plans.compiles_in_background(_stats_tile_kernel)


def ready(wait: bool) -> bool:
    """Whether the kernel can launch without waiting for a compile a plan started in the
    background; with ``wait``, wait for that compile first (True)."""
    return gluon is not None and compile_plans.launchable(_stats_tile_kernel, wait)


def splits_for(n_rows: int, n_keys: int, device: torch.device, splits: int | None = None) -> int:
    """How many equal ranges of key tiles each row block's keys are cut into: ``splits`` as asked
    (at most one per key tile), or about eight items per SM, as a divisor of the key tiles where
    one fits, so that every item has whole tiles when the problem does."""
    key_tiles = triton.cdiv(n_keys, BLOCK_N)
    if splits is not None:
        return max(1, min(splits, key_tiles))
    wanted = max(1, math.ceil(8 * sm_count(device) / triton.cdiv(n_rows, BLOCK_M)))
    return max(d for d in range(1, min(wanted, key_tiles) + 1) if key_tiles % d == 0)


class OwnScoreFilter(NamedTuple):
    """The own-score filter as this kernel takes it (docs/contract.md, "False negatives by score",
    without a guide): each row's and each key's *bound*, which shifts its exponentials instead of
    a running maximum; the thresholds are made from the bounds in the kernel, ``bound - (margin +
    relative_margin * |bound|)``. With a margin >= 0 the bound is the dot product of the positive
    pair, which no logit the row or key keeps exceeds; with a negative ``margin`` (the caller's
    half), kept logits exceed the bound by at most ``|margin|``, and the positive's lies as far
    below it. Keys that are nobody's positive take any finite bound: their column statistic is not
    one of the loss's, and the caller sets it aside."""

    row_bounds: torch.Tensor  # fp32 [rows], in the units of the kernel's dot products
    positives: torch.Tensor  # int32 [rows]: each row's positive as an index into the keys, -1 if not there
    key_bounds: torch.Tensor  # fp32 [keys]
    margin: float
    relative_margin: float
    # int32 [row blocks] each: every block of BLOCK_M rows' smallest and largest positive (low >
    # high for a block without any); the kernel tests for positives only in the tiles they meet.
    # A chunk of rows from a multiple of BLOCK_M on takes the slices of its blocks.
    ranges: tuple[torch.Tensor, torch.Tensor]


def row_and_column_stats(queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor,
                         row_out: torch.Tensor, column_partials: torch.Tensor, splits: int,
                         score_filter: OwnScoreFilter | None = None) -> int:
    """Row log-sum-exp of ``scale * queries keys^T`` per range of keys into ``row_out`` (fp32
    [>= splits, rows]: split s's rows are ``row_out[s]``), and the column log-sum-exp over each 32
    rows into ``column_partials`` (fp32 [>= PARTIALS_PER_BLOCK * cdiv(rows, BLOCK_M), keys]; every
    such row written), over the entries ``score_filter`` keeps if given. ``splits``
    (:func:`splits_for`) is rounded to whole tiles per split; returns the number used."""
    return stats_launch(queries, keys, scale, row_out, column_partials, splits, score_filter)()


class StatsLaunch(NamedTuple):
    """One launch of the kernel, its arguments checked and made: called, it launches and returns
    the number of splits used. Made before a host synchronisation, it leaves the GPU waiting on
    the launch alone after it."""

    grid: tuple[int]
    arguments: tuple
    constants: dict
    splits: int

    def __call__(self) -> int:
        launch_jit(_stats_tile_kernel, self.grid, *self.arguments, **self.constants)
        return self.splits


def stats_launch(queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor, row_out: torch.Tensor,
                 column_partials: torch.Tensor, splits: int,
                 score_filter: OwnScoreFilter | None = None) -> StatsLaunch:
    """The launch :func:`row_and_column_stats` makes (the same arguments), not launched yet."""
    n_rows, n_keys = queries.shape[0], keys.shape[0]
    # the kernel addresses both by its own row counts: split s's rows at s * rows, partial p at p * keys
    if row_out.stride() != (n_rows, 1):
        raise ValueError(f"row_out must hold contiguous rows of {n_rows} entries, got strides "
                         f"{row_out.stride()}")
    if column_partials.stride() != (n_keys, 1):
        raise ValueError(f"column_partials must hold contiguous rows of {n_keys} entries, got strides "
                         f"{column_partials.stride()}")
    key_tiles = triton.cdiv(n_keys, BLOCK_N)
    tiles_per_split = triton.cdiv(key_tiles, splits)
    splits = triton.cdiv(key_tiles, tiles_per_split)
    n_items = triton.cdiv(n_rows, BLOCK_M) * splits
    grid = (max(1, min(sm_count(queries.device), triton.cdiv(n_items, 2))),)
    if score_filter is None:
        filter_arguments = (scale,) * 5 + (0.0, 0.0)  # (unused pointers and margins)
    else:
        ranges = score_filter.ranges
        row_blocks = triton.cdiv(n_rows, BLOCK_M)
        for name, vector, length in (("row_bounds", score_filter.row_bounds, n_rows),
                                     ("positives", score_filter.positives, n_rows),
                                     ("key_bounds", score_filter.key_bounds, n_keys),
                                     ("ranges[0]", ranges[0], row_blocks),
                                     ("ranges[1]", ranges[1], row_blocks)):
            if vector.shape != (length,) or not vector.is_contiguous():
                raise ValueError(f"score_filter.{name} must be a contiguous vector of {length} entries")
        filter_arguments = (score_filter.row_bounds, score_filter.positives, *ranges, score_filter.key_bounds,
                            float(score_filter.margin), float(score_filter.relative_margin))
    arguments = (make_descriptor(queries, BLOCK_M), make_descriptor(keys, BLOCK_N), row_out, column_partials,
                 scale, *filter_arguments, n_rows, n_keys, n_items)
    constants = dict(SPLITS=splits, TILES=tiles_per_split,
                     EVEN=n_rows % BLOCK_M == 0 and n_keys % (BLOCK_N * tiles_per_split) == 0,
                     FILTER=score_filter is not None, STAGES=STAGES, MMAS_IN_FLIGHT=MMAS_IN_FLIGHT,
                     WORKER_REGISTERS=_WORKER_REGISTERS, PRODUCER_REGISTERS=_PRODUCER_REGISTERS, num_warps=4)
    return StatsLaunch(grid, arguments, constants, splits)
