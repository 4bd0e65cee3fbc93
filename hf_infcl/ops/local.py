"""The single-process algorithm over any backend's block ops (``local_forward``,
``local_backward``, and an autograd Function around them), and the pieces of the backward that
the ring Function shares with it.

Forward: one call of ``forward_block`` over all rows and keys gives the row (and column)
statistics, and the positive logits z_{i,p(i)} are computed beside them. Only those O(m + k)
floats are saved, with references to the inputs; the backward recomputes every tile once
through ``backward_block``.

Why the positive logits are an output of the Function rather than plain autograd ops outside
it: their gradient nearly cancels the statistics' gradient at the positive (P_ii - 1 when the
softmax is peaked). Summed in the fp32 accumulators before the single cast to the input dtype,
that cancellation is exact; summed by autograd after two separate bf16 casts, it loses most of
the significant bits of dQ and dK.
"""

from __future__ import annotations

import torch

from .spec import BlockOps, GroupMask, StatsSpec, accumulation_dtype

# Row chunks for the O(m c) epilogues, so they allocate no full-size fp32 temporaries.
_EPILOGUE_ELEMENTS = 2**22


def _row_chunks(rows: int, width: int):
    step = max(1, _EPILOGUE_ELEMENTS // max(1, width))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def local_mask(query_groups, key_groups, positives) -> GroupMask | None:
    """The group mask of one process's rows and keys (None without groups)."""
    if query_groups is None:
        return None
    return GroupMask(query_groups, key_groups, positives, key_offset=0)


def local_forward(spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias, positives,
                  mask: GroupMask | None):
    """(row_stat [m], col_stat [k] or empty, positive_logit [m]) of one process's rows and keys."""
    row_stat, col_stat = ops.forward_block(spec, queries, keys, scale, bias, mask)
    if col_stat is None:
        col_stat = row_stat.new_empty(0)
    positive_logit = positive_logits(queries, keys, positives, scale, bias)
    return row_stat, col_stat, positive_logit


def local_backward(spec: StatsSpec, ops: BlockOps, mask: GroupMask | None, queries, keys, scale, bias,
                   positives, row_stat, col_stat, grad_row_stat, grad_col_stat, grad_positive_logit,
                   needs=(True, True, True, True)):
    """(d queries, d keys, d scale, d bias) from the statistics' gradients: every tile is
    recomputed once through ``backward_block``. ``needs`` says which of the four are wanted
    (None is returned for the others)."""
    acc = accumulation_dtype(queries.dtype)
    grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
    grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
    row_sums = ops.backward_block(
        spec,
        queries,
        keys,
        scale,
        bias,
        mask,
        row_stat,
        col_stat if spec.columns else None,
        grad_row_stat.to(acc),
        grad_col_stat.to(acc) if spec.columns else None,
        grad_queries,
        grad_keys,
    )
    key_slices = [((0, keys.shape[0]), grad_keys)]
    add_positive_gradients(queries, keys, positives, grad_positive_logit, grad_queries, key_slices, row_sums)
    return finish_gradients(needs, queries, keys, scale, bias, grad_queries, key_slices, row_sums)


class LocalLogitStats(torch.autograd.Function):
    """(queries, keys, scale, bias, positives, mask) ->
    (row_stat [m], col_stat [k] or empty, positive_logit [m]), over any block-ops object.

    The named backends ("torch", "triton") run the same two functions through the custom ops of
    :mod:`hf_infcl.ops.custom_ops`, which ``torch.compile`` can put in a graph; this Function
    serves block-ops objects that a caller passes directly (they cannot be op arguments)."""

    @staticmethod
    def forward(
        ctx,
        queries: torch.Tensor,
        keys: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        positives: torch.Tensor,
        mask: GroupMask | None,
        spec: StatsSpec,
        ops: BlockOps,
    ):
        row_stat, col_stat, positive_logit = local_forward(spec, ops, queries, keys, scale, bias, positives,
                                                           mask)
        ctx.save_for_backward(queries, keys, scale, bias, positives, row_stat, col_stat)
        ctx.mask, ctx.spec, ctx.ops = mask, spec, ops
        return row_stat, col_stat, positive_logit

    @staticmethod
    def backward(ctx, grad_row_stat, grad_col_stat, grad_positive_logit):
        queries, keys, scale, bias, positives, row_stat, col_stat = ctx.saved_tensors
        grads = local_backward(ctx.spec, ctx.ops, ctx.mask, queries, keys, scale, bias, positives, row_stat,
                               col_stat, grad_row_stat, grad_col_stat, grad_positive_logit,
                               needs=ctx.needs_input_grad[:4])
        return (*grads, None, None, None, None)


def positive_logits(queries, keys, positives, scale, bias) -> torch.Tensor:
    """z_{i,p(i)} = s <Q_i, K_{p(i)}> + b in the accumulation dtype, [m]."""
    acc = accumulation_dtype(queries.dtype)
    dots = torch.empty(queries.shape[0], dtype=acc, device=queries.device)
    for rows in _row_chunks(queries.shape[0], queries.shape[1]):
        dots[rows] = (queries[rows].to(acc) * keys[positives[rows]].to(acc)).sum(dim=1)
    logits = scale.to(acc) * dots
    return logits if bias is None else logits + bias.to(acc)


def add_positive_gradients(queries, keys, positives, grad_positive, grad_queries, key_slices, row_sums):
    """Add the positive logits' gradient to the unscaled accumulators, in place.

    ``key_slices`` is a list of ((start, end), accumulator) covering this process's keys (the
    ring keeps its key gradient in slices). d z_{i,p(i)} / d bias = 1, so the gradient is also
    added to ``row_sums``; d scale follows from the accumulators in ``finish_gradients``.
    """
    acc = grad_queries.dtype
    weight = grad_positive.to(acc)
    for rows in _row_chunks(queries.shape[0], queries.shape[1]):
        grad_queries[rows] += weight[rows, None] * keys[positives[rows]].to(acc)
        for (start, end), accumulator in key_slices:
            inside = ((positives[rows] >= start) & (positives[rows] < end)).nonzero().squeeze(1)
            if inside.numel():
                chunk_rows = inside + rows.start
                accumulator.index_add_(
                    0, positives[chunk_rows] - start, weight[chunk_rows, None] * queries[chunk_rows].to(acc)
                )
    row_sums += weight


def finish_gradients(needs, queries, keys, scale, bias, grad_queries, key_slices, row_sums):
    """(d queries, d keys, d scale, d bias) from the unscaled accumulators; ``needs`` (four bools,
    e.g. ``ctx.needs_input_grad[:4]``) says which are wanted, None for the others.

    d scale = sum_ij G_ij x_ij = sum_i <Q_i, (G K)_i>, so it needs no pass over the tiles;
    d bias = sum of G. Works in place and in row chunks, so that the end of the backward makes
    no full-size fp32 temporaries. Shared by the single-process and the ring Functions; the
    key gradient comes as ((start, end), accumulator) slices, freed as they are copied out.
    """
    need_q, need_k, need_scale, need_bias = needs
    acc = grad_queries.dtype
    scale_acc = scale.to(acc)
    grad_scale = grad_bias = grad_q = grad_k = None
    if need_scale:
        total = torch.zeros((), dtype=acc, device=grad_queries.device)
        for rows in _row_chunks(queries.shape[0], queries.shape[1]):
            total += (grad_queries[rows] * queries[rows].to(acc)).sum()
        grad_scale = total.to(scale.dtype)
    if need_bias and bias is not None:
        grad_bias = row_sums.sum().to(bias.dtype)
    if need_q:
        grad_q = grad_queries.mul_(scale_acc).to(queries.dtype)
    if need_k:
        grad_k = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
        for index, ((start, end), accumulator) in enumerate(key_slices):
            real_end = min(end, keys.shape[0])  # the ring pads key blocks to the largest rank's
            if start < real_end:
                grad_k[start:real_end] = accumulator[: real_end - start].mul_(scale_acc)
            key_slices[index] = None  # free each slice as soon as it is copied out
    return grad_q, grad_k, grad_scale, grad_bias
