"""Hopper kernel for the sigmoid loss's one pass: a super-tile's logits, G and softplus row sums
in one kernel.

What it replaces, per super-tile of the one pass: a cuBLAS GEMM of fp16 copies of the operands
that writes the dot products into a buffer, then the elementwise kernel of
:mod:`.sigmoid_from_dots` that reads them back and writes G over them. Here the dot products stay
in registers, in fp32 (not rounded to fp16), and no fp16 copies of the operands are made.

Structure, in Gluon (Triton's explicit dialect, ``triton.experimental.gluon``), after the
"ping-pong" kernels of CUTLASS and FlashAttention-3:

* one persistent program per SM runs two consumer warpgroups and one producer warp
  (``gl.warp_specialize``); each consumer takes a contiguous run of the super-tile's 128 x 128
  tiles in row-major order, so that it adds its row sums to memory about once per row block
  rather than once per tile;
* the warpgroups take turns at the tensor cores (the ``turn`` mbarriers): one multiplies its
  tile, chunk by chunk of ``BLOCK_K`` columns, with asynchronous ``wgmma`` into an fp32
  accumulator in registers, while the other runs its previous tile's epilogue;
* both multiply out of one ring of ``STAGES`` shared-memory stages that the producer warp fills
  by TMA, in the order of their turns, as soon as a stage is free; ``ready`` / ``empty``
  mbarriers hand each stage from the copy engine to the MMA and back. (Loads issued by the
  warpgroup at the tensor cores, between its MMAs, kept the MMAs below cuBLAS's rate even without
  an epilogue; see benchmarks/README.md.)
* a consumer keeps ``MMAS_IN_FLIGHT`` chunks' MMAs queued before it waits for the oldest: its
  warps share their schedulers with the other warpgroup's epilogue, and a deeper queue keeps the
  tensor cores busy while they wait for an issue slot;
* the epilogue: z = s x + b (in log2 units), u = 2^-|z|, G = sigmoid(z) (one reciprocal of
  1 + u) in the operands' dtype (divided by a scale if asked), and the row sums of G and of
  softplus(z) = max(z, 0) + log1p(u), with the log1p terms summed through products (see
  ``_epilogue``), in eight column parts of the tile so that the temporaries of one part, not of
  the whole tile, sit beside the accumulator's registers;
* each part of G goes to global memory by a TMA store from a small ring of shared-memory buffers
  per consumer (``G_BUFFERS``), not by stores from registers: those wrote 16 bytes per row and
  instruction, half a memory sector, and cost more than the epilogue's arithmetic.

The turns stay because the shared ring needs the order; a ring per warpgroup left the MMAs
waiting on their loads.

It covers the common case only: half-precision operands whose rows are 16-byte aligned, no
group mask, on a GPU of compute capability 9 (Hopper), with a Triton that has Gluon. Everything
else takes the cuBLAS route. Gluon kernels do not run under ``TRITON_INTERPRET``, so this kernel
is tested on GPUs only (``tests/test_gluon_sigmoid.py``), against float64.
"""

from __future__ import annotations

import torch
import triton

from . import compile_plans
from .device import is_hopper, sm_count, tma_aligned
from .jit_math import LN2, LOG2E, log1p_of_positive, reciprocal
from .launch import launch_jit

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # a Triton without Gluon: the general route only
    gluon = None

# Tile and ring: 128 x 128 logits per warpgroup (a 128-register fp32 accumulator per thread),
# c walked in chunks of 64; six stages of a query and a key chunk: 6 x (16 + 16) KiB = 192 KiB of
# the 227 KiB of shared memory.
BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 128, 64, 6
# G leaves in the epilogue's parts of 128 x 16 entries, through two 4 KiB buffers per consumer.
G_COLUMNS, G_BUFFERS = BLOCK_N // 8, 2
# Chunks whose MMAs a consumer has queued when it waits for the oldest.
MMAS_IN_FLIGHT = 3
# Registers per thread of the second consumer warpgroup (the first gets what is left): the
# accumulator takes 128, the epilogue's temporaries most of the rest.
_WORKER_REGISTERS = 240
# Registers per thread of the producer warp, which only computes addresses and waits.
_PRODUCER_REGISTERS = 40


def available() -> bool:
    """Whether this Triton has the Gluon dialect with Hopper's warpgroup MMA."""
    return gluon is not None


def usable(queries: torch.Tensor, keys: torch.Tensor, has_mask: bool) -> bool:
    """Whether :func:`sigmoid_tile` can take these operands (see the module docstring)."""
    return (
        gluon is not None
        and not has_mask
        and queries.is_cuda
        and queries.dtype in (torch.float16, torch.bfloat16)
        and keys.dtype == queries.dtype
        and is_hopper(queries.device)
        and all(tma_aligned(t) for t in (queries, keys))
    )


if gluon is not None:

    @gluon.jit
    def _program_tiles(n_rows, n_keys, q_desc, k_desc):
        """The program's share of the super-tile's tiles (numbered in row-major order): the number
        of key tiles and of chunks of c per tile, and the first tile and length of each consumer's
        run."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        n_key_tiles = gl.cdiv(n_keys, BN)
        n_chunks = gl.cdiv(q_desc.shape[1], q_desc.block_type.shape[1])
        n_tiles = gl.cdiv(n_rows, BM) * n_key_tiles
        per_worker = gl.cdiv(n_tiles, 2 * gl.num_programs(0))
        first_tiles = (2 * gl.program_id(0) * per_worker, (2 * gl.program_id(0) + 1) * per_worker)
        runs = (gl.minimum(gl.maximum(n_tiles - first_tiles[0], 0), per_worker),
                gl.minimum(gl.maximum(n_tiles - first_tiles[1], 0), per_worker))
        return n_key_tiles, n_chunks, first_tiles, runs

    @gluon.jit
    def _operand_ring(q_desc, k_desc, STAGES: gl.constexpr):
        """The shared ring both Gluon kernels load their operands into: ``STAGES`` chunks of rows
        and of keys, a ``ready`` and an ``empty`` barrier per stage, and the two consumers' ``turn``
        barriers at the tensor cores (see :func:`_multiply`)."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BK: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, BK], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, BK], k_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        return q_bufs, k_bufs, ready, empty, turn

    @gluon.jit
    def _tile_of_chunk(chunk, n_chunks, first_tiles, runs):
        """The tile and column offset of the program's ``chunk``-th chunk. The program's chunks go
        in the order its two warpgroups multiply them: their tiles alternate (the first
        warpgroup's first) while both have tiles, then the rest of the first one's run."""
        slot = chunk // n_chunks
        paired = (slot < 2 * runs[1]).to(gl.int32)
        owner = paired * (slot % 2)
        nth_tile = paired * (slot // 2) + (1 - paired) * (slot - runs[1])
        tile = first_tiles[0] + owner * (first_tiles[1] - first_tiles[0]) + nth_tile
        return tile, chunk - slot * n_chunks

    @gluon.jit
    def _issue_loads(chunk, k_chunk, row_tile, key_tile, q_desc, k_desc, q_bufs, k_bufs, ready, empty,
                     STAGES: gl.constexpr):
        """TMA loads of the program's ``chunk``-th chunk (column chunk ``k_chunk`` of the tile at
        ``row_tile``, ``key_tile``) into stage ``chunk % STAGES`` of the ring, once the MMA that read
        that stage last is done."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BK: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        stage = chunk % STAGES
        # The stage's previous chunk was released (its use count's parity); a fresh barrier
        # passes parity 1 at once, so the first round waits for nothing.
        mbarrier.wait(empty.index(stage), ((chunk // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, q_desc.block_type.nbytes + k_desc.block_type.nbytes)
        k_offset = k_chunk * BK
        tma.async_copy_global_to_shared(q_desc, [row_tile * BM, k_offset], bar, q_bufs.index(stage))
        tma.async_copy_global_to_shared(k_desc, [key_tile * BN, k_offset], bar, k_bufs.index(stage))

    @gluon.jit
    def _halves(x):
        """The two column halves of a [rows, cols] register tensor (no data movement: in the
        MMA layout a column's upper bit is a register index)."""
        ROWS: gl.constexpr = x.type.shape[0]
        COLS: gl.constexpr = x.type.shape[1]
        return gl.split(x.reshape([ROWS, 2, COLS // 2]).permute(0, 2, 1))

    @gluon.jit
    def _epilogue_part(dots, row_valid, keys, scale, bias, inv_g_scale, n_keys, g_desc, g_buffer, g_row,
                       g_column, HAS_BIAS: gl.constexpr, SCALED_G: gl.constexpr, EVEN: gl.constexpr,
                       G_BUFFERS: gl.constexpr):
        """G of one part of a tile, stored at (``g_row``, ``g_column``) of G through ``g_buffer``;
        returns, per entry, G, max(z, 0) and u = 2^-|z| (softplus = (max(z, 0) + log2(1 + u)) ln 2;
        the caller takes the logarithm of products). ``scale`` and ``bias`` are in log2 units."""
        z = dots * scale
        if HAS_BIAS:
            z = z + bias
        u = gl.exp2(-gl.abs(z))
        r = reciprocal(1.0 + u)
        grad = gl.where(z >= 0.0, r, u * r)
        linear = gl.maximum(z, 0.0)
        if not EVEN:  # the sums skip what lies past the tile; the TMA store clips it
            in_tile = row_valid[:, None] & (keys < n_keys)[None, :]
            grad = gl.where(in_tile, grad, 0.0)
            linear = gl.where(in_tile, linear, 0.0)
            u = gl.where(in_tile, u, 0.0)
        stored = grad
        if SCALED_G:
            stored = grad * inv_g_scale
        # The store that last read this buffer (G_BUFFERS parts ago) is done.
        tma.store_wait(pendings=G_BUFFERS - 1)
        g_buffer.store(stored.to(g_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(g_desc, [g_row, g_column], g_buffer)
        return grad, linear, u

    @gluon.jit
    def _eighths(x):
        """The eight column eighths of a [rows, cols] register tensor, in order."""
        first, second = _halves(x)
        a, b = _halves(first)
        c, d = _halves(second)
        return _halves(a) + _halves(b) + _halves(c) + _halves(d)

    @gluon.jit
    def _epilogue(acc, row_tile, key_tile, g_desc, g_bufs, first_buffer, scale, bias, inv_g_scale, n_rows,
                  n_keys, HAS_BIAS: gl.constexpr, SCALED_G: gl.constexpr, EVEN: gl.constexpr,
                  G_BUFFERS: gl.constexpr):
        """G = sigmoid(z) of one tile into G (``g_desc``) through the consumer's ``G_BUFFERS``
        buffers of ``g_bufs`` from ``first_buffer`` on;
        returns the tile's row sums of G and of softplus(z). ``scale`` and ``bias`` are in log2
        units. The tile goes in eight column parts, so that the elementwise temporaries of a part,
        not of the whole tile, sit beside the accumulator's registers.

        The row sums are added entry-wise across the parts (the two column halves of a part first:
        in the MMA layout those are registers of one thread) and reduced across threads once per
        tile. The log1p terms of softplus are summed as log1p(prod (1 + u) - 1) over the 16
        entries of a row that a thread holds at one position of the parts' halves (``excess``,
        never forming 1 + u: every rounding is relative to the partial product, and the product
        stays below 2^16), which costs two operations per logit and one log1p per sixteen."""
        BM: gl.constexpr = acc.type.shape[0]
        BN: gl.constexpr = acc.type.shape[1]
        PART: gl.constexpr = BN // 8
        parts = _eighths(acc)
        layout: gl.constexpr = parts[0].type.layout
        local_rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        local_keys = gl.arange(0, PART, layout=gl.SliceLayout(0, layout))
        row_valid = row_tile * BM + local_rows < n_rows
        for part in gl.static_range(8):
            column = key_tile * BN + part * PART
            grad, linear, u = _epilogue_part(
                parts[part], row_valid, column + local_keys, scale, bias, inv_g_scale, n_keys, g_desc,
                g_bufs.index(first_buffer + part % G_BUFFERS), row_tile * BM, column, HAS_BIAS, SCALED_G,
                EVEN, G_BUFFERS)
            grad_first, grad_second = _halves(grad)
            linear_first, linear_second = _halves(linear)
            if part == 0:
                grad_sums = grad_first + grad_second
                linear_sums = linear_first + linear_second
                excess = u
            else:
                grad_sums += grad_first + grad_second
                linear_sums += linear_first + linear_second
                excess = excess + u + excess * u
        excess_first, excess_second = _halves(excess)
        excess = excess_first + excess_second + excess_first * excess_second
        row_grad = gl.sum(grad_sums, axis=1)
        row_softplus = gl.sum(linear_sums, axis=1) * LN2 + gl.sum(log1p_of_positive(excess), axis=1)
        sums_layout: gl.constexpr = gl.SliceLayout(1, layout)
        return gl.convert_layout(row_grad, sums_layout), gl.convert_layout(row_softplus, sums_layout)

    @gluon.jit
    def _take_turn(turn, nth_tile, runs, turn_phase, n_chunks, GROUP: gl.constexpr):
        """Wait for the consumer's turn at the tensor cores for its ``nth_tile``-th tile. Returns the
        tile's first chunk in the shared ring and the turn's phase."""
        # The first warpgroup's first turn is free (parity 1 of a fresh barrier has completed);
        # after that each waits for the other to have issued its tile's MMAs, while the other
        # has tiles left (the second warpgroup's run is never the longer one).
        if nth_tile < runs[1 - GROUP] + 1 - GROUP:
            mbarrier.wait(turn.index(GROUP), turn_phase)
            turn_phase = turn_phase ^ 1
        slot = gl.where(nth_tile < runs[1], 2 * nth_tile + GROUP, nth_tile + runs[1])
        return slot * n_chunks, turn_phase

    @gluon.jit
    def _multiply_chunks(q_bufs, k_bufs, ready, empty, acc, first_chunk, start, stop, STAGES: gl.constexpr,
                         MMAS_IN_FLIGHT: gl.constexpr):
        """``acc`` = the product of the tile's chunks ``start`` to ``stop`` out of the shared ring
        (its first chunk at ``first_chunk``), each stage released once the MMA that read it is done,
        except the last MMAS_IN_FLIGHT (:func:`_release_last_stages`)."""
        for k_chunk in range(start, stop):
            chunk = first_chunk + k_chunk
            stage = chunk % STAGES
            mbarrier.wait(ready.index(stage), (chunk // STAGES) & 1)
            acc = warpgroup_mma(q_bufs.index(stage), k_bufs.index(stage).permute((1, 0)), acc,
                                use_acc=k_chunk > start, is_async=True)
            # The MMA MMAS_IN_FLIGHT chunks back is done: release its stage to the producer.
            acc = warpgroup_mma_wait(num_outstanding=MMAS_IN_FLIGHT, deps=(acc,))
            mbarrier.arrive(empty.index((chunk + STAGES - MMAS_IN_FLIGHT) % STAGES),
                            pred=k_chunk >= MMAS_IN_FLIGHT)
        return acc

    @gluon.jit
    def _release_last_stages(empty, first_chunk, n_chunks, STAGES: gl.constexpr,
                             MMAS_IN_FLIGHT: gl.constexpr):
        """Release the stages of the tile's last MMAS_IN_FLIGHT chunks, once every MMA is done."""
        for behind in gl.static_range(MMAS_IN_FLIGHT):
            last_chunks = n_chunks - MMAS_IN_FLIGHT + behind
            mbarrier.arrive(empty.index((first_chunk + last_chunks) % STAGES), pred=last_chunks >= 0)

    @gluon.jit
    def _multiply(q_bufs, k_bufs, ready, empty, turn, acc, nth_tile, runs, turn_phase, n_chunks,
                  GROUP: gl.constexpr, STAGES: gl.constexpr, MMAS_IN_FLIGHT: gl.constexpr):
        """The consumer's ``nth_tile``-th tile into ``acc``, chunk by chunk out of the shared ring,
        in its turn at the tensor cores (the other consumer's turn follows once the last chunk is
        issued); every stage it read released. Returns the accumulator and the turn's phase."""
        first_chunk, turn_phase = _take_turn(turn, nth_tile, runs, turn_phase, n_chunks, GROUP)
        acc = _multiply_chunks(q_bufs, k_bufs, ready, empty, acc, first_chunk, 0, n_chunks, STAGES,
                               MMAS_IN_FLIGHT)
        mbarrier.arrive(turn.index(1 - GROUP))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _release_last_stages(empty, first_chunk, n_chunks, STAGES, MMAS_IN_FLIGHT)
        return acc, turn_phase

    @gluon.jit
    def _consumer(q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, g_desc, g_bufs, row_sums_ptr,
                  softplus_sums_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr, n_rows, n_keys,
                  GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, SCALED_G: gl.constexpr, EVEN: gl.constexpr,
                  STAGES: gl.constexpr, MMAS_IN_FLIGHT: gl.constexpr, G_BUFFERS: gl.constexpr):
        """One consumer warpgroup: a contiguous run of tiles in row-major order (so that it adds its
        row sums to memory about once per row block, not once per tile), multiplied from the
        ring the two warpgroups share."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
        n_key_tiles, n_chunks, first_tiles, runs = _program_tiles(n_rows, n_keys, q_desc, k_desc)
        my_tiles = runs[GROUP]

        # The epilogue works in log2 units: 2^(z log2 e) = e^z.
        scale = gl.load(scale_ptr) * LOG2E
        bias = 0.0
        if HAS_BIAS:
            bias = gl.load(bias_ptr) * LOG2E
        inv_g_scale = 1.0
        if SCALED_G:
            inv_g_scale = gl.load(inv_g_scale_ptr)

        turn_phase = 1 - GROUP  # see _multiply
        acc = gl.zeros([BM, BN], gl.float32, layout)
        sums_layout: gl.constexpr = gl.SliceLayout(1, _eighths(acc)[0].type.layout)
        row_grad = gl.zeros([BM], gl.float32, sums_layout)
        row_softplus = gl.zeros([BM], gl.float32, sums_layout)
        for nth_tile in range(my_tiles):
            tile = first_tiles[GROUP] + nth_tile
            row_tile = tile // n_key_tiles
            key_tile = tile - row_tile * n_key_tiles
            acc, turn_phase = _multiply(q_bufs, k_bufs, ready, empty, turn, acc, nth_tile, runs, turn_phase,
                                        n_chunks, GROUP, STAGES, MMAS_IN_FLIGHT)
            tile_grad, tile_softplus = _epilogue(acc, row_tile, key_tile, g_desc, g_bufs, GROUP * G_BUFFERS,
                                                 scale, bias, inv_g_scale, n_rows, n_keys, HAS_BIAS, SCALED_G,
                                                 EVEN, G_BUFFERS)
            row_grad += tile_grad
            row_softplus += tile_softplus
            if (nth_tile == my_tiles - 1) or (key_tile == n_key_tiles - 1):  # this row block's last tile
                rows = row_tile * BM + gl.arange(0, BM, layout=sums_layout)
                gl.atomic_add(row_sums_ptr + rows, row_grad, mask=rows < n_rows, sem="relaxed")
                gl.atomic_add(softplus_sums_ptr + rows, row_softplus, mask=rows < n_rows, sem="relaxed")
                row_grad = gl.zeros([BM], gl.float32, sums_layout)
                row_softplus = gl.zeros([BM], gl.float32, sums_layout)
        tma.store_wait(pendings=0)  # G's last stores have read their buffers before the program ends

    @gluon.jit
    def _producer(q_desc, k_desc, q_bufs, k_bufs, ready, empty, n_rows, n_keys, STAGES: gl.constexpr):
        """The producer warp: every chunk of the program, in the order the consumers multiply them,
        loaded into the ring as soon as its stage is free."""
        n_key_tiles, n_chunks, first_tiles, runs = _program_tiles(n_rows, n_keys, q_desc, k_desc)
        for chunk in range((runs[0] + runs[1]) * n_chunks):
            tile, k_chunk = _tile_of_chunk(chunk, n_chunks, first_tiles, runs)
            row_tile = tile // n_key_tiles
            _issue_loads(chunk, k_chunk, row_tile, tile - row_tile * n_key_tiles, q_desc, k_desc, q_bufs,
                         k_bufs, ready, empty, STAGES)

    @gluon.jit
    def _sigmoid_tile_kernel(q_desc, k_desc, g_desc, row_sums_ptr, softplus_sums_ptr, scale_ptr, bias_ptr,
                             inv_g_scale_ptr, n_rows, n_keys, HAS_BIAS: gl.constexpr, SCALED_G: gl.constexpr,
                             EVEN: gl.constexpr, STAGES: gl.constexpr, MMAS_IN_FLIGHT: gl.constexpr,
                             G_BUFFERS: gl.constexpr, WORKER_REGISTERS: gl.constexpr,
                             PRODUCER_REGISTERS: gl.constexpr):
        q_bufs, k_bufs, ready, empty, turn = _operand_ring(q_desc, k_desc, STAGES)
        g_bufs = gl.allocate_shared_memory(g_desc.dtype, [2 * G_BUFFERS] + g_desc.block_type.shape,
                                           g_desc.layout)
        gl.warp_specialize([
            (_consumer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, g_desc, g_bufs, row_sums_ptr,
                         softplus_sums_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr, n_rows, n_keys, 0, HAS_BIAS,
                         SCALED_G, EVEN, STAGES, MMAS_IN_FLIGHT, G_BUFFERS)),
            (_consumer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, g_desc, g_bufs, row_sums_ptr,
                         softplus_sums_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr, n_rows, n_keys, 1, HAS_BIAS,
                         SCALED_G, EVEN, STAGES, MMAS_IN_FLIGHT, G_BUFFERS)),
            (_producer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, n_rows, n_keys, STAGES)),
        ], [4, 1], [WORKER_REGISTERS, PRODUCER_REGISTERS])

    # Its compile takes seconds, longer than the rest of a sigmoid call's kernels together; a plan
    # builds it in the background while the call takes the cuBLAS route (``ready``).
    compile_plans.compiles_in_background(_sigmoid_tile_kernel)


def ready(wait: bool) -> bool:
    """Whether the kernel can launch without waiting for a compile a plan started in the
    background; with ``wait``, wait for that compile first (True)."""
    return gluon is not None and compile_plans.launchable(_sigmoid_tile_kernel, wait)


def sigmoid_tile(
    queries: torch.Tensor, keys: torch.Tensor, g_out: torch.Tensor, row_sums: torch.Tensor,
    softplus_sums: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    inv_g_scale: torch.Tensor | None, descriptors=None,
) -> None:
    """One super-tile of the sigmoid one pass: G = sigmoid(scale * queries keys^T + bias) (divided by
    the scale whose inverse ``inv_g_scale`` holds, if given) into ``g_out`` [rows, keys] (the
    operands' dtype, unit last stride, rows and start 16-byte aligned: G leaves by TMA, which writes
    whole 16-byte units, so a row's entries past its last key up to the next 16-byte boundary are
    overwritten, with zeros), and the row sums of G and of softplus into ``row_sums`` and
    ``softplus_sums`` (fp32 [rows], added to).
    What ``cuBLAS dots + sigmoid_from_dots`` compute without a mask, with the dot products in fp32
    instead of rounded to fp16. ``descriptors``: the (queries, keys) descriptors of
    :func:`make_descriptor`, made once per operand by a caller that calls this for many
    super-tiles."""
    n_rows, n_keys = queries.shape[0], keys.shape[0]
    if not tma_aligned(g_out):
        raise ValueError("g_out: its start and row stride must be multiples of 16 bytes (G leaves the "
                         "kernel by TMA)")
    q_desc, k_desc = descriptors if descriptors is not None else (make_descriptor(queries, BLOCK_M),
                                                                  make_descriptor(keys, BLOCK_N))
    tiles = triton.cdiv(n_rows, BLOCK_M) * triton.cdiv(n_keys, BLOCK_N)
    grid = (max(1, min(sm_count(queries.device), triton.cdiv(tiles, 2))),)
    launch_jit(
        _sigmoid_tile_kernel, grid,
        q_desc, k_desc, make_descriptor(g_out, BLOCK_M, G_COLUMNS), row_sums, softplus_sums, scale,
        bias if bias is not None else scale, inv_g_scale if inv_g_scale is not None else scale,
        n_rows, n_keys, HAS_BIAS=bias is not None, SCALED_G=inv_g_scale is not None,
        EVEN=n_rows % BLOCK_M == 0 and n_keys % BLOCK_N == 0, STAGES=STAGES, MMAS_IN_FLIGHT=MMAS_IN_FLIGHT,
        G_BUFFERS=G_BUFFERS, WORKER_REGISTERS=_WORKER_REGISTERS, PRODUCER_REGISTERS=_PRODUCER_REGISTERS,
        num_warps=4,
    )


def make_descriptor(tensor: torch.Tensor, block_rows: int, block_columns: int = BLOCK_K):
    """The TMA descriptor of a 2-D half-precision tensor as the kernel reads or writes it: blocks of
    ``block_rows`` x ``block_columns`` (an operand [rows, c]: ``BLOCK_M`` or ``BLOCK_N`` rows by
    ``BLOCK_K`` columns; G: ``BLOCK_M`` by ``G_COLUMNS``)."""
    block = [block_rows, block_columns]
    dtype = gl.bfloat16 if tensor.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return GluonTensorDescriptor.from_tensor(tensor, block, layout)
