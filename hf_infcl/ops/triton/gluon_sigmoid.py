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
* the epilogue: z = s x + b, u = e^-|z|, G = sigmoid(z) (one reciprocal of 1 + u) stored in the
  operands' dtype (divided by a scale if asked), and the row sums of G and of
  softplus(z) = max(z, 0) + log1p(u), with the log1p terms summed through products (see
  ``_epilogue``), in eight column parts of the tile so that the temporaries of one part, not of
  the whole tile, sit beside the accumulator's registers.

The epilogue is kept short because it hides only in part under the other warpgroup's MMAs (its
instructions take about as long as a tile's MMAs). The turns stay because the shared ring needs
the order; a ring per warpgroup left the MMAs waiting on their loads.

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
from .jit_math import LOG2E, log1p_of_positive, reciprocal

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
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
    def _program_tiles(n_rows, n_keys, BM: gl.constexpr, BN: gl.constexpr):
        """The program's share of the super-tile's tiles (numbered in row-major order): the number
        of key tiles, and the first tile and length of each consumer's run."""
        n_key_tiles = gl.cdiv(n_keys, BN)
        n_tiles = gl.cdiv(n_rows, BM) * n_key_tiles
        per_worker = gl.cdiv(n_tiles, 2 * gl.num_programs(0))
        first_tiles = (2 * gl.program_id(0) * per_worker, (2 * gl.program_id(0) + 1) * per_worker)
        runs = (gl.minimum(gl.maximum(n_tiles - first_tiles[0], 0), per_worker),
                gl.minimum(gl.maximum(n_tiles - first_tiles[1], 0), per_worker))
        return n_key_tiles, first_tiles, runs

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
    def _issue_loads(chunk, n_chunks, first_tiles, runs, n_key_tiles, q_desc, k_desc, q_bufs, k_bufs, ready,
                     empty, STAGES: gl.constexpr):
        """TMA loads of the program's ``chunk``-th chunk into stage ``chunk % STAGES`` of the ring,
        once the MMA that read that stage last is done."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BK: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        tile, k_chunk = _tile_of_chunk(chunk, n_chunks, first_tiles, runs)
        row_tile = tile // n_key_tiles
        key_tile = tile - row_tile * n_key_tiles
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
    def _epilogue_part(dots, row_valid, keys, g_ptrs, scale, bias, inv_g_scale, n_keys,
                       HAS_BIAS: gl.constexpr, SCALED_G: gl.constexpr, EVEN: gl.constexpr):
        """G of one part of a tile, stored; returns its row sums of G and of max(z, 0), and
        u = e^-|z| (softplus(z) = max(z, 0) + log1p(u); the caller takes the log1p of products)."""
        z = dots * scale
        if HAS_BIAS:
            z = z + bias
        u = gl.exp2(gl.abs(z) * -LOG2E)
        r = reciprocal(1.0 + u)
        grad = gl.where(z >= 0.0, r, u * r)
        linear = gl.maximum(z, 0.0)
        if not EVEN:
            in_tile = row_valid[:, None] & (keys < n_keys)[None, :]
            grad = gl.where(in_tile, grad, 0.0)
            linear = gl.where(in_tile, linear, 0.0)
            u = gl.where(in_tile, u, 0.0)
        row_grad = gl.sum(grad, axis=1)
        row_linear = gl.sum(linear, axis=1)
        if SCALED_G:
            grad = grad * inv_g_scale
        if EVEN:
            gl.store(g_ptrs, grad.to(g_ptrs.dtype.element_ty))
        else:
            gl.store(g_ptrs, grad.to(g_ptrs.dtype.element_ty), mask=in_tile)
        return row_grad, row_linear, u

    @gluon.jit
    def _eighths(x):
        """The eight column eighths of a [rows, cols] register tensor, in order."""
        first, second = _halves(x)
        a, b = _halves(first)
        c, d = _halves(second)
        return _halves(a) + _halves(b) + _halves(c) + _halves(d)

    @gluon.jit
    def _epilogue(acc, row_tile, key_tile, g_ptr, stride_g, scale, bias, inv_g_scale, n_rows, n_keys,
                  HAS_BIAS: gl.constexpr, SCALED_G: gl.constexpr, EVEN: gl.constexpr):
        """G = sigmoid(z) of one tile into ``g_ptr``; returns the tile's row sums of G and of
        softplus(z). The tile goes in eight column parts, so that the elementwise temporaries of a
        part, not of the whole tile, sit beside the accumulator's registers.

        The log1p terms of softplus are summed as log1p(prod (1 + u) - 1) over the eight entries
        that a thread holds at one position of the parts (``excess``, never forming 1 + u: every
        rounding is relative to the partial product, and the product stays below 2^8), which
        costs two operations per logit and one log1p per eight (a log1p of each, about twenty
        operations, would be a third of the epilogue)."""
        BM: gl.constexpr = acc.type.shape[0]
        BN: gl.constexpr = acc.type.shape[1]
        PART: gl.constexpr = BN // 8
        parts = _eighths(acc)
        layout: gl.constexpr = parts[0].type.layout
        local_rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        local_keys = gl.arange(0, PART, layout=gl.SliceLayout(0, layout))
        rows = row_tile * BM + local_rows
        row_valid = rows < n_rows
        # int64 only in the tile's base; in-tile offsets fit int32 (BM rows of the super-tile).
        g_tile = g_ptr + (row_tile * BM).to(gl.int64) * stride_g + key_tile * BN
        offsets = local_rows[:, None] * stride_g + local_keys[None, :]
        row_grad = gl.zeros([BM], gl.float32, gl.SliceLayout(1, layout))
        row_softplus = gl.zeros([BM], gl.float32, gl.SliceLayout(1, layout))
        excess = gl.zeros([BM, PART], gl.float32, layout)
        for part in gl.static_range(8):
            start = part * PART
            part_grad, part_linear, u = _epilogue_part(
                parts[part], row_valid, key_tile * BN + start + local_keys, g_tile + start + offsets, scale,
                bias, inv_g_scale, n_keys, HAS_BIAS, SCALED_G, EVEN)
            row_grad += part_grad
            row_softplus += part_linear
            excess = excess + u + excess * u
        row_softplus += gl.sum(log1p_of_positive(excess), axis=1)
        return row_grad, row_softplus

    @gluon.jit
    def _consumer(q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, g_ptr, stride_g, row_sums_ptr,
                  softplus_sums_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr, n_rows, n_keys,
                  GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, SCALED_G: gl.constexpr, EVEN: gl.constexpr,
                  STAGES: gl.constexpr):
        """One consumer warpgroup: a contiguous run of tiles in row-major order (so that it adds its
        row sums to memory about once per row block, not once per tile), multiplied from the
        ring the two warpgroups share."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
        n_key_tiles, first_tiles, runs = _program_tiles(n_rows, n_keys, BM, BN)
        my_tiles = runs[GROUP]
        n_chunks = gl.cdiv(q_desc.shape[1], q_desc.block_type.shape[1])

        scale = gl.load(scale_ptr)
        bias = 0.0
        if HAS_BIAS:
            bias = gl.load(bias_ptr)
        inv_g_scale = 1.0
        if SCALED_G:
            inv_g_scale = gl.load(inv_g_scale_ptr)

        # The first warpgroup's first turn is free (parity 1 of a fresh barrier has completed);
        # after that each waits for the other to have issued its tile's MMAs, while the other
        # has tiles left (the second warpgroup's run is never the longer one).
        turn_phase = 1 - GROUP
        acc = gl.zeros([BM, BN], gl.float32, layout)
        sums_layout: gl.constexpr = gl.SliceLayout(1, _eighths(acc)[0].type.layout)
        row_grad = gl.zeros([BM], gl.float32, sums_layout)
        row_softplus = gl.zeros([BM], gl.float32, sums_layout)
        for nth_tile in range(my_tiles):
            tile = first_tiles[GROUP] + nth_tile
            row_tile = tile // n_key_tiles
            key_tile = tile - row_tile * n_key_tiles
            if nth_tile < runs[1 - GROUP] + 1 - GROUP:
                mbarrier.wait(turn.index(GROUP), turn_phase)
                turn_phase = turn_phase ^ 1
            slot = gl.where(nth_tile < runs[1], 2 * nth_tile + GROUP, nth_tile + runs[1])
            first_chunk = slot * n_chunks
            for k_chunk in range(n_chunks):
                chunk = first_chunk + k_chunk
                stage = chunk % STAGES
                mbarrier.wait(ready.index(stage), (chunk // STAGES) & 1)
                acc = warpgroup_mma(q_bufs.index(stage), k_bufs.index(stage).permute((1, 0)), acc,
                                    use_acc=k_chunk > 0, is_async=True)
                # The MMA before this one is done: release its stage to the producer.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((chunk + STAGES - 1) % STAGES), pred=k_chunk > 0)
            mbarrier.arrive(turn.index(1 - GROUP))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((first_chunk + n_chunks - 1) % STAGES))
            tile_grad, tile_softplus = _epilogue(acc, row_tile, key_tile, g_ptr, stride_g, scale, bias,
                                                 inv_g_scale, n_rows, n_keys, HAS_BIAS, SCALED_G, EVEN)
            row_grad += tile_grad
            row_softplus += tile_softplus
            if (nth_tile == my_tiles - 1) or (key_tile == n_key_tiles - 1):  # this row block's last tile
                rows = row_tile * BM + gl.arange(0, BM, layout=sums_layout)
                gl.atomic_add(row_sums_ptr + rows, row_grad, mask=rows < n_rows, sem="relaxed")
                gl.atomic_add(softplus_sums_ptr + rows, row_softplus, mask=rows < n_rows, sem="relaxed")
                row_grad = gl.zeros([BM], gl.float32, sums_layout)
                row_softplus = gl.zeros([BM], gl.float32, sums_layout)

    @gluon.jit
    def _producer(q_desc, k_desc, q_bufs, k_bufs, ready, empty, n_rows, n_keys, STAGES: gl.constexpr):
        """The producer warp: every chunk of the program, in the order the consumers multiply them,
        loaded into the ring as soon as its stage is free."""
        n_key_tiles, first_tiles, runs = _program_tiles(n_rows, n_keys, q_desc.block_type.shape[0],
                                                        k_desc.block_type.shape[0])
        n_chunks = gl.cdiv(q_desc.shape[1], q_desc.block_type.shape[1])
        for chunk in range((runs[0] + runs[1]) * n_chunks):
            _issue_loads(chunk, n_chunks, first_tiles, runs, n_key_tiles, q_desc, k_desc, q_bufs, k_bufs,
                         ready, empty, STAGES)

    @gluon.jit
    def _sigmoid_tile_kernel(q_desc, k_desc, g_ptr, stride_g, row_sums_ptr, softplus_sums_ptr, scale_ptr,
                             bias_ptr, inv_g_scale_ptr, n_rows, n_keys, HAS_BIAS: gl.constexpr,
                             SCALED_G: gl.constexpr, EVEN: gl.constexpr, STAGES: gl.constexpr,
                             WORKER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
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
        gl.warp_specialize([
            (_consumer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, g_ptr, stride_g, row_sums_ptr,
                         softplus_sums_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr, n_rows, n_keys, 0, HAS_BIAS,
                         SCALED_G, EVEN, STAGES)),
            (_consumer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, turn, g_ptr, stride_g, row_sums_ptr,
                         softplus_sums_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr, n_rows, n_keys, 1, HAS_BIAS,
                         SCALED_G, EVEN, STAGES)),
            (_producer, (q_desc, k_desc, q_bufs, k_bufs, ready, empty, n_rows, n_keys, STAGES)),
        ], [4, 1], [WORKER_REGISTERS, PRODUCER_REGISTERS])

    # Its compile takes seconds, longer than the rest of a sigmoid call's kernels together; a plan
    # builds it in the background while the call takes the cuBLAS route (``ready``).
    compile_plans.compiles_in_background(_sigmoid_tile_kernel)


def ready(wait: bool) -> bool:
    """Whether the kernel can launch without waiting for a compile a plan started in the
    background; with ``wait``, wait for that compile first (True)."""
    if gluon is None:
        return False
    if wait:
        compile_plans.wait_for_background(_sigmoid_tile_kernel)
    return not compile_plans.compiling(_sigmoid_tile_kernel)


def sigmoid_tile(
    queries: torch.Tensor, keys: torch.Tensor, g_out: torch.Tensor, row_sums: torch.Tensor,
    softplus_sums: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    inv_g_scale: torch.Tensor | None, descriptors=None,
) -> None:
    """One super-tile of the sigmoid one pass: G = sigmoid(scale * queries keys^T + bias) (divided by
    the scale whose inverse ``inv_g_scale`` holds, if given) into ``g_out`` [rows, keys] (the
    operands' dtype, unit last stride), and the row sums of G and of softplus into ``row_sums``
    and ``softplus_sums`` (fp32 [rows], added to). What ``cuBLAS dots + sigmoid_from_dots`` compute
    without a mask, with the dot products in fp32 instead of rounded to fp16. ``descriptors``:
    the (queries, keys) descriptors of :func:`make_descriptor`, made once
    per operand by a caller that calls this for many super-tiles."""
    n_rows, n_keys = queries.shape[0], keys.shape[0]
    q_desc, k_desc = descriptors if descriptors is not None else (make_descriptor(queries, BLOCK_M),
                                                                  make_descriptor(keys, BLOCK_N))
    if BLOCK_M * g_out.stride(0) >= 2**31:
        raise ValueError("a super-tile row block too large for the kernel's int32 offsets")
    tiles = triton.cdiv(n_rows, BLOCK_M) * triton.cdiv(n_keys, BLOCK_N)
    grid = (max(1, min(sm_count(queries.device), triton.cdiv(tiles, 2))),)
    _sigmoid_tile_kernel[grid](
        q_desc, k_desc, g_out, g_out.stride(0), row_sums, softplus_sums, scale,
        bias if bias is not None else scale, inv_g_scale if inv_g_scale is not None else scale,
        n_rows, n_keys, HAS_BIAS=bias is not None, SCALED_G=inv_g_scale is not None,
        EVEN=n_rows % BLOCK_M == 0 and n_keys % BLOCK_N == 0, STAGES=STAGES,
        WORKER_REGISTERS=_WORKER_REGISTERS, PRODUCER_REGISTERS=_PRODUCER_REGISTERS, num_warps=4,
    )


def make_descriptor(operand: torch.Tensor, block_rows: int):
    """The TMA descriptor of a [rows, c] operand as the kernel reads it: blocks of ``block_rows``
    rows (``BLOCK_M`` for queries, ``BLOCK_N`` for keys) by ``BLOCK_K`` columns."""
    block = [block_rows, BLOCK_K]
    dtype = gl.bfloat16 if operand.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return GluonTensorDescriptor.from_tensor(operand, block, layout)
