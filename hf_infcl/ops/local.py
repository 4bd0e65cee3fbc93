"""The single-process algorithm: one autograd Function over any backend's block ops.

Forward: one call of ``forward_block`` over all rows and keys gives the row (and column)
statistics. Only those O(m + k) floats are saved, with references to the inputs; the backward
recomputes every tile once through ``backward_block``.
"""

from __future__ import annotations

import torch

from .spec import BlockOps, GroupMask, StatsSpec, accumulation_dtype


class LocalLogitStats(torch.autograd.Function):
    """(queries, keys, scale, bias, groups) -> (row_stat [m], col_stat [k] or empty)."""

    @staticmethod
    def forward(
        ctx,
        queries: torch.Tensor,
        keys: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        mask: GroupMask | None,
        spec: StatsSpec,
        ops: BlockOps,
    ):
        row_stat, col_stat = ops.forward_block(spec, queries, keys, scale, bias, mask)
        if col_stat is None:
            col_stat = row_stat.new_empty(0)
        ctx.save_for_backward(queries, keys, scale, bias, row_stat, col_stat)
        ctx.mask, ctx.spec, ctx.ops = mask, spec, ops
        return row_stat, col_stat

    @staticmethod
    def backward(ctx, grad_row_stat, grad_col_stat):
        queries, keys, scale, bias, row_stat, col_stat = ctx.saved_tensors
        spec: StatsSpec = ctx.spec
        acc = accumulation_dtype(queries.dtype)
        grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        row_sums = ctx.ops.backward_block(
            spec,
            queries,
            keys,
            scale,
            bias,
            ctx.mask,
            row_stat,
            col_stat if spec.columns else None,
            grad_row_stat.to(acc),
            grad_col_stat.to(acc) if spec.columns else None,
            grad_queries,
            grad_keys,
        )
        return (*finish_gradients(ctx, queries, keys, scale, bias, grad_queries, grad_keys, row_sums),
                None, None, None)


def finish_gradients(ctx, queries, keys, scale, bias, grad_queries, grad_keys, row_sums):
    """Turn the unscaled accumulators into (d queries, d keys, d scale, d bias).

    d scale = sum_ij G_ij x_ij = sum_i <Q_i, (G K)_i>, so it needs no pass over the tiles.
    Shared by the single-process and the ring Functions.
    """
    acc = grad_queries.dtype
    scale_acc = scale.to(acc)
    need_q, need_k, need_scale, need_bias = ctx.needs_input_grad[:4]
    grad_scale = (grad_queries * queries.to(acc)).sum().to(scale.dtype) if need_scale else None
    grad_bias = row_sums.sum().to(bias.dtype) if need_bias and bias is not None else None
    grad_q = (grad_queries * scale_acc).to(queries.dtype) if need_q else None
    grad_k = (grad_keys * scale_acc).to(keys.dtype) if need_k else None
    return grad_q, grad_k, grad_scale, grad_bias
