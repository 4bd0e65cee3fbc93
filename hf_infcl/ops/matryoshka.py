"""Matryoshka in one pass (docs/contract.md, "Matryoshka in one call", its one-pass form): every
prefix's statistics from one product of the full width per tile, and the features' gradient from
one product per segment, where the loss of each prefix on its own costs a product of the prefix's
width per term.

The width is cut at the dims into segments ``S_u = [d_{u+1}, d_u)`` (``d_D = 0``); prefix ``t``
covers the segments ``u >= t``. A tile's raw dot products P^t of every prefix come out of one loop
over the segments from the innermost (the running sum is P^t once segment t is added), and the
logits of term t are

    z^t_ij = s * P^t_ij * a^t_i * b^t_j (+ b)        a^t_i = 1 / |Q_i[:d_t]|,   b^t_j = 1 / |K_j[:d_t]|

with the inverse norms ``a`` [D, m] and ``b`` [D, k] inputs of :class:`PrefixLogitStats`, computed
by autograd ops outside it (:func:`prefix_inverse_norms`), so that the norms' chain rule is
autograd's. Each term keeps its own statistics, [D, m] rows and [D, k] columns. With G^t the
gradient of the loss in z^t (the statistics' gradients and the positive logits', as for one term)
and Ĝ^t = G^t a^t_i b^t_j, segment u takes H_u = sum_{t <= u} Ĝ^t:

    dQ[:, S_u] = s H_u K[:, S_u]     dK[:, S_u] = s H_uᵀ Q[:, S_u]
    d a^t_i = s sum_j G^t_ij P^t_ij b^t_j     d b^t_j = s sum_i G^t_ij P^t_ij a^t_i
    d s = sum_t sum_i a^t_i (sum_j G^t_ij P^t_ij b^t_j)     d b = sum_t sum_ij G^t_ij

This route covers one process with the softmax (either direction) or sigmoid loss, ``positives``,
extra keys, the groups' mask and a bias (the rule is ``hf_infcl.loss._plain_terms``); the other
options take one loss call per term, as does a backend whose block ops lack the prefix methods
(:func:`prefix_block_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .key_blocks import output_gradient, row_chunks
from .options import LossKind, Precision
from .spec import GroupMask, accumulation_dtype


@dataclass(frozen=True)
class PrefixSpec:
    """What a Matryoshka block computes: the ``loss``, ``columns`` (the symmetric softmax loss's
    column statistics), the prefix widths ``dims`` (strictly descending) and ``precision`` (how
    fp32 inputs are multiplied, resolved: ``"tf32"`` or ``"ieee"``)."""

    loss: LossKind
    columns: bool
    dims: tuple[int, ...]
    precision: Precision = "ieee"

    def __post_init__(self):
        if self.loss == "sigmoid" and self.columns:
            raise ValueError("the sigmoid loss has no column statistics")

    @property
    def segments(self) -> tuple[slice, ...]:
        """``S_u = [d_{u+1}, d_u)`` for u = 0..D-1 (the innermost last)."""
        bounds = (*self.dims, 0)
        return tuple(slice(bounds[u + 1], bounds[u]) for u in range(len(self.dims)))


class PrefixSums(NamedTuple):
    """What a Matryoshka backward block returns beside its products, per term (unscaled by s)."""

    row_sums: torch.Tensor  # [D, m] sum_j G^t_ij (d bias's alone: block ops may leave it 0 without a bias)
    row_products: torch.Tensor  # [D, m] sum_j G^t_ij P^t_ij b^t_j
    key_products: torch.Tensor  # [D, k] sum_i G^t_ij P^t_ij a^t_i


class PrefixBlockOps(Protocol):
    """What a backend provides for the one-pass Matryoshka loss, beside
    :class:`~hf_infcl.ops.spec.BlockOps`."""

    def prefix_forward_block(
        self, spec: PrefixSpec, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor,
        bias: torch.Tensor | None, query_scales: torch.Tensor, key_scales: torch.Tensor,
        mask: GroupMask | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(row statistics [D, m], column statistics [D, k] or None without columns) of every term,
        as :class:`~hf_infcl.ops.spec.BlockOps` computes one term's."""

    def prefix_backward_block(
        self, spec: PrefixSpec, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor,
        bias: torch.Tensor | None, query_scales: torch.Tensor, key_scales: torch.Tensor,
        mask: GroupMask | None, row_stat: torch.Tensor, col_stat: torch.Tensor | None,
        row_weight: torch.Tensor, col_weight: torch.Tensor | None, grad_queries: torch.Tensor,
        grad_keys: torch.Tensor,
    ) -> PrefixSums:
        """Add each segment's H_u K[:, S_u] to ``grad_queries[:, S_u]`` and H_uᵀ Q[:, S_u] to
        ``grad_keys[:, S_u]`` (unscaled, accumulation dtype, in place; the same sums as each term's
        Ĝ^t K[:, :d_t] and Ĝ^tᵀ Q[:, :d_t], which a backend may add instead), G^t formed from the
        weights as :class:`~hf_infcl.ops.spec.BlockOps` forms one term's; return the
        :class:`PrefixSums`."""


def prefix_block_ops(ops) -> PrefixBlockOps | None:
    """``ops`` if it offers the one-pass Matryoshka blocks and takes them (block ops may decline
    with a false ``matryoshka_one_pass``), else None (one loss call per term)."""
    methods = ("prefix_forward_block", "prefix_backward_block")
    offered = all(callable(getattr(ops, name, None)) for name in methods)
    return ops if offered and getattr(ops, "matryoshka_one_pass", True) else None


def prefix_inverse_norms(features: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """[D, n]: 1 / max(|features_i[:d_t]|, 1e-12) in the accumulation dtype, autograd's ops (the
    norms' chain rule), as ``torch.nn.functional.normalize`` divides."""
    acc = features.to(accumulation_dtype(features.dtype))
    return torch.stack([1.0 / torch.linalg.vector_norm(acc[:, :dim], dim=1).clamp_min(1e-12) for dim in dims])


def _positive_dots(spec: PrefixSpec, rows: torch.Tensor, keys, index: torch.Tensor) -> torch.Tensor:
    """[D, len(rows)] P^t of each row of ``rows`` and its positive ``keys[index]``, in the
    accumulation dtype."""
    acc = accumulation_dtype(rows.dtype)
    products = rows.to(acc) * keys[index].to(acc)
    segments = torch.stack([products[:, segment].sum(dim=1) for segment in spec.segments])
    return segments.flip(0).cumsum(0).flip(0)  # prefix t: the segments u >= t


def _positive_index(positives, m: int, device) -> torch.Tensor:
    return torch.arange(m, device=device) if positives is None else positives


class PrefixLogitStats(torch.autograd.Function):
    """(queries, keys, scale, bias, query_scales [D, m], key_scales [D, k], positives, query_groups,
    key_groups) -> (row statistics [D, m], column statistics [D, k] (empty without columns),
    positive logits z^t_{i,p(i)} [D, m]) of one process, every term's from one pass per tile.

    The positive logits are an output, and their gradient is added into the fp32 accumulators, for
    the reason :mod:`hf_infcl.ops.key_blocks` gives (it nearly cancels G's entry at the positive)."""

    @staticmethod
    def forward(ctx, queries, keys, scale, bias, query_scales, key_scales, positives, query_groups,
                key_groups, spec: PrefixSpec, ops: PrefixBlockOps):
        mask = _mask(queries, positives, query_groups, key_groups)
        row_stat, col_stat = ops.prefix_forward_block(spec, queries, keys, scale, bias, query_scales,
                                                      key_scales, mask)
        if col_stat is None:
            col_stat = row_stat.new_empty((len(spec.dims), 0))
        acc = accumulation_dtype(queries.dtype)
        index = _positive_index(positives, queries.shape[0], queries.device)
        positive_dots = torch.cat([_positive_dots(spec, queries[rows], keys, index[rows])
                                   for rows in row_chunks(*queries.shape)], dim=1)
        positive = scale.to(acc) * positive_dots * query_scales * key_scales[:, index]
        if bias is not None:
            positive = positive + bias.to(acc)
        ctx.save_for_backward(queries, keys, scale, bias, query_scales, key_scales, positives, query_groups,
                              key_groups, row_stat, col_stat, positive_dots)
        ctx.spec, ctx.ops = spec, ops
        return row_stat, col_stat, positive

    @staticmethod
    def backward(ctx, grad_row, grad_col, grad_positive):
        (queries, keys, scale, bias, query_scales, key_scales, positives, query_groups, key_groups, row_stat,
         col_stat, positive_dots) = ctx.saved_tensors
        spec, ops = ctx.spec, ctx.ops
        acc = accumulation_dtype(queries.dtype)
        with torch.autocast(queries.device.type, enabled=False):
            row_weight = output_gradient(grad_row, row_stat, acc)
            col_weight = output_gradient(grad_col, col_stat, acc) if spec.columns else None
            grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
            grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
            mask = _mask(queries, positives, query_groups, key_groups)
            sums = ops.prefix_backward_block(spec, queries, keys, scale, bias, query_scales, key_scales, mask,
                                             row_stat, col_stat if spec.columns else None, row_weight,
                                             col_weight, grad_queries, grad_keys)
            _add_positive_pairs(spec, queries, keys, positives, positive_dots, query_scales, key_scales,
                                output_gradient(grad_positive, row_stat, acc), grad_queries, grad_keys, sums)
            s = scale.to(acc)
            grads = (
                (s * grad_queries).to(queries.dtype) if ctx.needs_input_grad[0] else None,
                (s * grad_keys).to(keys.dtype) if ctx.needs_input_grad[1] else None,
                (query_scales * sums.row_products).sum().to(scale.dtype) if ctx.needs_input_grad[2] else None,
                sums.row_sums.sum().to(bias.dtype) if bias is not None and ctx.needs_input_grad[3] else None,
                (s * sums.row_products).to(query_scales.dtype) if ctx.needs_input_grad[4] else None,
                (s * sums.key_products).to(key_scales.dtype) if ctx.needs_input_grad[5] else None,
            )
        return (*grads, None, None, None, None, None)


def _mask(queries, positives, query_groups, key_groups) -> GroupMask | None:
    if query_groups is None:
        return None
    return GroupMask(query_groups, key_groups, _positive_index(positives, queries.shape[0], queries.device))


def _add_positive_pairs(spec: PrefixSpec, queries, keys, positives, positive_dots, query_scales, key_scales,
                        grad_positive, grad_queries, grad_keys, sums: PrefixSums) -> None:
    """The positive logits' gradient, G^t_{i,p(i)} += grad_positive^t_i, added into the fp32
    accumulators and the sums (in place), row chunk by row chunk; ``positive_dots``: the pairs'
    P^t [D, m] the forward computed."""
    acc = grad_queries.dtype
    positive_index = _positive_index(positives, queries.shape[0], queries.device)
    for rows in row_chunks(*queries.shape):
        index, dots = positive_index[rows], positive_dots[:, rows]
        a, b, g = query_scales[:, rows], key_scales[:, index], grad_positive[:, rows]
        sums.row_sums[:, rows] += g
        sums.row_products[:, rows] += g * dots * b
        sums.key_products.index_add_(1, index, g * dots * a)
        coefficient = (g * a * b).cumsum(0)  # segment u: the terms t <= u
        q_rows, k_rows = queries[rows].to(acc), keys[index].to(acc)
        for u, segment in enumerate(spec.segments):
            grad_queries[rows, segment] += coefficient[u, :, None] * k_rows[:, segment]
            grad_keys[:, segment].index_add_(0, index, coefficient[u, :, None] * q_rows[:, segment])

