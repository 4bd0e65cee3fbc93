"""Label smoothing of the softmax loss from the mean logits, without the m x k matrix.

``cross_entropy(..., label_smoothing=eps)`` of a term with candidates C and positive p is the plain
term plus ``eps * (z_p - mean_C z)`` (docs/contract.md, "Label smoothing"). The mean logit of a
row over every key of the group is ``s * <Q_i, mean key> + b``, that of a key's column over every
row ``s * <mean query, K_j> + b``: two vectors of width c, whatever the batch. Across processes
they come from sums all-reduced over the group (:class:`SumOverGroup`, whose backward all-reduces
the gradient: each process's backward is the gradient of the sum of every process's loss, as the
ring's is). The public layer adds :func:`smoothing_terms` to the per-row loss of any backend.
"""

from __future__ import annotations

import torch

from .spec import accumulation_dtype

__all__ = ["RowDots", "SumOverGroup", "smoothing_terms"]

# Rows per slice when rows of a half-precision matrix are taken to fp32: bounds the fp32 copy.
_SLICE_ROWS = 8192


class SumOverGroup(torch.autograd.Function):
    """``all_reduce(tensor, SUM)`` over ``group``, differentiable: the backward all-reduces the
    gradient (every process's output is the same sum, so each input's gradient is the sum of the
    gradients of every process's output)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        import torch.distributed as dist

        grad = grad_total.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class RowDots(torch.autograd.Function):
    """``matrix @ vector`` ([n, c] rows of any float dtype, a [c] vector in the accumulation
    dtype) in the vector's dtype. Half-precision rows are upcast a slice at a time, and only the
    matrix itself (no fp32 copy) is kept for the backward."""

    @staticmethod
    def forward(ctx, matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(matrix, vector)
        return torch.cat([part.to(vector.dtype) @ vector for part in _slices(matrix)])

    @staticmethod
    def backward(ctx, grad_dots):
        matrix, vector = ctx.saved_tensors
        grad_matrix = grad_vector = None
        if ctx.needs_input_grad[0]:
            grad_matrix = (grad_dots[:, None] * vector[None, :]).to(matrix.dtype)
        if ctx.needs_input_grad[1]:
            grad_vector = torch.zeros_like(vector)
            # a backward run inside the caller's autocast region must not round the product to bf16
            with torch.autocast(vector.device.type, enabled=False):
                for start, part in zip(range(0, matrix.shape[0], _SLICE_ROWS), _slices(matrix)):
                    grad_vector += grad_dots[start:start + part.shape[0]] @ part.to(vector.dtype)
        return grad_matrix, grad_vector


def _slices(matrix: torch.Tensor):
    if matrix.shape[0] == 0:
        return [matrix]
    return matrix.split(_SLICE_ROWS) if matrix.dtype in (torch.float16, torch.bfloat16) else [matrix]


def smoothing_terms(queries, keys, scale, bias, positive_logit, positives, *, symmetric: bool,
                    label_smoothing: float, group=None) -> torch.Tensor:
    """What label smoothing adds to each of this process's rows' loss, ``[m]`` in the
    accumulation dtype: ``eps * (z_ip - row mean logit)``, averaged with ``eps * (z_ip - column
    mean logit of p(i))`` when ``symmetric``.

    Args:
        queries, keys: this process's rows ``[m, c]`` and keys ``[k, c]``.
        scale, bias: the loss's scale and bias (0-d tensors; bias may be None).
        positive_logit: ``[m]`` z_{i,p(i)} as the statistics computed them.
        positives: ``[m]`` local key indices of the rows' positives, or None for ``keys[:m]``.
        group: the process group of the ring, or None for this process alone. Every process of
            the group must call this (one all-reduce forward, one in the backward).
    """
    acc = accumulation_dtype(queries.dtype)
    m, n_keys = queries.shape[0], keys.shape[0]
    key_sum = keys.sum(dim=0, dtype=acc)
    query_sum = queries.sum(dim=0, dtype=acc)
    counts = torch.tensor([n_keys, m], dtype=acc, device=queries.device)
    if group is not None:
        key_sum, query_sum, counts = SumOverGroup.apply(
            torch.cat([key_sum, query_sum, counts]), group).split([key_sum.shape[0], query_sum.shape[0], 2])
    mean_key, mean_query = key_sum / counts[0], query_sum / counts[1]
    offset = 0.0 if bias is None else bias
    row_mean_logit = scale * RowDots.apply(queries, mean_key) + offset
    terms = positive_logit - row_mean_logit
    if symmetric:
        column_mean_logit = scale * RowDots.apply(keys, mean_query) + offset  # [k], every local key's
        positive_column_mean = column_mean_logit[:m] if positives is None else column_mean_logit[positives]
        terms = (terms + positive_logit - positive_column_mean) / 2
    return label_smoothing * terms
