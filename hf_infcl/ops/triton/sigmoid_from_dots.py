"""The sigmoid loss's one pass over a super-tile whose dot products a cuBLAS GEMM computed: the
kernel forms G and the softplus row sums, so that the tensor-core work runs at cuBLAS speed and
this kernel does only the elementwise work (which is what bounds it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import INTERPRET, unused_pointer
from .jit_math import (
    allowed_pairs,
    log1p_of_positive,
    product_minus_one,
    scale_and_bias,
    sigmoid_and_exponential,
)
from .launch import launch_jit

# (BLOCK_M, BLOCK_N, warps, key blocks per program): wide along the keys (16-byte loads and stores
# per thread), a few rows, and several key blocks per program so that the row sums are reduced
# across threads (shuffles) and added atomically once per program, not once per block; the best
# of the shapes tried (benchmarks/README.md). The interpreter runs small blocks.
_SHAPE = (16, 32, 1, 2) if INTERPRET else (16, 256, 4, 8)


@triton.jit
def _sigmoid_from_dots_kernel(
    dots_ptr, g_ptr, row_sums_ptr, softplus_sums_ptr, scale_ptr, bias_ptr, inv_g_scale_ptr,
    row_group_ptr, key_group_ptr, positive_ptr, key_offset,
    n_rows, n_keys, stride_dots, stride_g,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SCALED_G: tl.constexpr, FULL_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_BLOCKS: tl.constexpr,
):
    """G = sigmoid(z) (masked) of fp32 or fp16 dot products, z = scale * dots + bias, with the row
    sums of G and of softplus(z) added atomically: what the gradient-tile kernel does in its
    one-pass mode, minus the dot products. A program takes BLOCK_M rows x KEY_BLOCKS * BLOCK_N
    keys; FULL_BLOCKS: every program's block lies inside the tile (no bounds masks).

    Elementwise work bounds this kernel, so each logit costs few instructions: u = e^-|z| (one
    exponential), r = 1 / (1 + u) (one approximate reciprocal); sigmoid(z) = r, or u r for
    z < 0; softplus(z) = max(z, 0) + log1p(u), and the log1p terms are summed as log1p of
    prod (1 + u) - 1 over the KEY_BLOCKS logits that one thread sees at one tile position
    (``product_minus_one``: two operations per logit, and one log1p per KEY_BLOCKS logits where a
    log1p of each costs a dozen). Every operand is positive, so each rounding is relative to the
    partial result: the sums keep fp32's relative accuracy however small the u, and the product
    stays below 2^KEY_BLOCKS."""
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_M
    key_start = tl.program_id(1).to(tl.int64) * (KEY_BLOCKS * BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    row_index = row_start + rows
    row_valid = row_index < n_rows
    # In-program offsets are int32 (a program spans BLOCK_M rows of the tile); the int64 base
    # goes into the pointers once.
    dots_base = dots_ptr + row_start * stride_dots + key_start
    g_base = g_ptr + row_start * stride_g + key_start
    scale, bias = scale_and_bias(scale_ptr, bias_ptr, HAS_BIAS, False)
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
        grad, u = sigmoid_and_exponential(z)
        linear = tl.maximum(z, 0.0)
        if HAS_MASK or not FULL_BLOCKS:
            key_index = key_start + keys
            allowed = allowed_pairs(row_index, key_index, row_valid, key_index < n_keys, row_group_ptr,
                                    key_group_ptr, positive_ptr, key_offset, HAS_MASK)
            grad = tl.where(allowed, grad, 0.0)
            linear = tl.where(allowed, linear, 0.0)
            u = tl.where(allowed, u, 0.0)
        grad_sum += grad
        linear_sum += linear
        excess = product_minus_one(excess, u)
        if SCALED_G:
            grad = grad * inv_g_scale
        if FULL_BLOCKS:
            tl.store(g_base + g_offsets, grad.to(g_ptr.dtype.element_ty))
        else:
            tl.store(g_base + g_offsets, grad.to(g_ptr.dtype.element_ty), mask=in_tile)
    softplus_rows = tl.sum(linear_sum, axis=1) + tl.sum(log1p_of_positive(excess), axis=1)
    tl.atomic_add(softplus_sums_ptr + row_index, softplus_rows, mask=row_valid)
    tl.atomic_add(row_sums_ptr + row_index, tl.sum(grad_sum, axis=1), mask=row_valid)


def sigmoid_from_dots(
    dots: torch.Tensor, g_out: torch.Tensor, row_sums: torch.Tensor, softplus_sums: torch.Tensor,
    scale: torch.Tensor, bias: torch.Tensor | None, inv_g_scale: torch.Tensor | None, *,
    row_groups: torch.Tensor | None = None, key_groups: torch.Tensor | None = None,
    positive_keys: torch.Tensor | None = None, key_offset: int = 0,
) -> None:
    """The sigmoid loss's one pass over a super-tile whose dot products ``dots`` [rows, keys]
    (fp32 or fp16, last stride 1) are already computed: write sigmoid(scale * dots + bias) / g_scale
    (``inv_g_scale`` 0-d, or None for 1), masked, into ``g_out`` (same shape: ``dots`` itself
    reinterpreted, when the element sizes match, or a separate buffer; no partial overlap) and add
    the row sums of G and of the softplus terms into ``row_sums`` and ``softplus_sums`` (fp32
    [rows], atomically). The result equals :func:`.grad_tile.grad_tile` with ``softplus_sums``
    given, up to the rounding of the dot products."""
    n_rows, n_keys = dots.shape
    has_mask = row_groups is not None
    dummy = unused_pointer(dots.device)
    block_m, block_n, warps, key_blocks = _SHAPE
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_keys, block_n * key_blocks))
    if block_m * max(dots.stride(0), g_out.stride(0)) >= 2**31:
        raise ValueError("a super-tile row block too large for the kernel's int32 offsets")
    launch_jit(
        _sigmoid_from_dots_kernel, grid,
        dots, g_out, row_sums, softplus_sums, scale, bias if bias is not None else dummy,
        inv_g_scale if inv_g_scale is not None else dummy,
        row_groups if has_mask else dummy, key_groups if has_mask else dummy,
        positive_keys if has_mask else dummy, key_offset,
        n_rows, n_keys, dots.stride(0), g_out.stride(0),
        HAS_BIAS=bias is not None, HAS_MASK=has_mask, SCALED_G=inv_g_scale is not None,
        FULL_BLOCKS=n_rows % block_m == 0 and n_keys % (block_n * key_blocks) == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, KEY_BLOCKS=key_blocks, num_warps=warps,
    )
