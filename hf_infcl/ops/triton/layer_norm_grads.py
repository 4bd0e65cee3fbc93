"""LayerNorm's weight and bias gradients, reduced over the rows by every SM, with its launcher.

PyTorch's LayerNorm backward splits the rows over thread blocks only for more than 64 × 1024
rows; below that, one block per 32 columns walks every row, so a 768-wide LayerNorm keeps 24
blocks busy on a GPU of 132 SMs. A chunk of a gradient-cached step (256 images of 50 patches,
256 texts of 77 tokens) is such a call, many times per step. Here the rows are split until there
are a few programs per SM; each program writes one partial sum per column, and the partials are
added afterwards (deterministic: no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import INTERPRET, sm_count

__all__ = ["layer_norm_affine_grads"]


@triton.jit
def _affine_grads_kernel(x_ptr, grad_ptr, mean_ptr, rstd_ptr, weight_partial_ptr, bias_partial_ptr,
                         n_rows, n_cols, rows_per_split, stride_x, stride_grad,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_valid = columns < n_cols
    split = tl.program_id(1)
    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, n_rows)
    weight_sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bias_sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_valid = rows < row_end
        valid = row_valid[:, None] & column_valid[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * stride_x + columns[None, :], mask=valid, other=0.0)
        grad = tl.load(grad_ptr + rows64 * stride_grad + columns[None, :], mask=valid, other=0.0)
        x, grad = x.to(tl.float32), grad.to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_valid, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_valid, other=0.0)
        weight_sums += grad * ((x - mean[:, None]) * rstd[:, None])
        bias_sums += grad
    out = split.to(tl.int64) * n_cols + columns
    tl.store(weight_partial_ptr + out, tl.sum(weight_sums, axis=0), mask=column_valid)
    tl.store(bias_partial_ptr + out, tl.sum(bias_sums, axis=0), mask=column_valid)


# Rows per program step and columns per program; under the interpreter, small ones so that the
# CPU tests cross several steps, programs and splits.
_BLOCK_M, _BLOCK_N, _WARPS = (4, 8, 1) if INTERPRET else (32, 64, 4)
# Programs per SM to aim for: enough to hide the loads' latency.
_PROGRAMS_PER_SM = 4


def layer_norm_affine_grads(x: torch.Tensor, grad: torch.Tensor, mean: torch.Tensor,
                            rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight gradient, bias gradient) of a LayerNorm, in fp32: the column sums of
    ``grad * (x - mean) * rstd`` and of ``grad``.

    ``x`` and ``grad``: [rows, columns] with unit column stride (the input and the output's
    gradient, any float dtype); ``mean`` and ``rstd``: [rows] fp32, as ``torch.native_layer_norm``
    returns them."""
    n_rows, n_cols = x.shape
    if n_rows == 0:
        zeros = torch.zeros(n_cols, dtype=torch.float32, device=x.device)
        return zeros, zeros.clone()
    column_blocks = triton.cdiv(n_cols, _BLOCK_N)
    row_blocks = triton.cdiv(n_rows, _BLOCK_M)
    splits = max(1, min(row_blocks, triton.cdiv(_PROGRAMS_PER_SM * sm_count(x.device), column_blocks)))
    rows_per_split = triton.cdiv(row_blocks, splits) * _BLOCK_M
    splits = triton.cdiv(n_rows, rows_per_split)
    weight_partials = torch.empty(splits, n_cols, dtype=torch.float32, device=x.device)
    bias_partials = torch.empty(splits, n_cols, dtype=torch.float32, device=x.device)
    _affine_grads_kernel[(column_blocks, splits)](
        x, grad, mean, rstd, weight_partials, bias_partials, n_rows, n_cols, rows_per_split,
        x.stride(0), grad.stride(0), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, num_warps=_WARPS)
    return weight_partials.sum(0), bias_partials.sum(0)
