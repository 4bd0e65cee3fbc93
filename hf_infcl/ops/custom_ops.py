"""The single-process loss as ``torch.library`` custom ops, so that ``torch.compile`` can keep it in
one graph (``fullgraph=True``) instead of tracing into Triton launchers or autotuners.

``hf_infcl.ops.logit_stats`` calls them only while compiling: eager calls run the same forward
and backward through :class:`~hf_infcl.ops.key_blocks.KeyBlockLogitStats`, because the op's
dispatch (its autograd wrapper rebuilds the schema's defaults on every call, then redispatches)
is host time that a small, host-bound step waits for.

Two ops, both functional (they allocate their outputs and write nothing the caller owns):

* ``hf_infcl::logit_stats`` -> (row_stat [m], col_stat [k] or [0], positive_logit [m]), the
  statistics of :mod:`hf_infcl.ops.spec` over one process's rows and keys, and three more
  outputs that carry the sigmoid loss's unit-weight gradients to the backward when the forward
  computes them (``StatsSpec.gradients_in_forward``; empty otherwise, never differentiable);
* ``hf_infcl::logit_stats_backward`` -> (d queries, d keys, d scale, d bias), every tile
  recomputed once.

The first op's autograd formula calls the second, so the compiled backward holds one opaque op
too. Each op has a fake (meta) implementation: shapes only, which is all the compiler needs.

A custom op takes tensors, numbers and strings, not Python objects, so the backend is named
(``"torch"`` or ``"triton"``), the group mask and the hardness offset are passed as their
tensors, and the hardness offset's mode and strength as a string and a float (last, with
defaults: none). Block-ops objects that a caller passes directly go through
:class:`hf_infcl.ops.key_blocks.KeyBlockLogitStats` instead; both run the same forward and
backward (:func:`~hf_infcl.ops.key_blocks.stats_forward`,
:func:`~hf_infcl.ops.key_blocks.stats_backward`) over the one-process schedule.

``validate``: the op checks the argument values (scale > 0, positives in range) itself when it
runs, before its first kernel (:mod:`hf_infcl.ops.value_check`), which needs the values on the
host. ``contrastive_loss`` passes ``validate=True`` on one process: under ``torch.compile`` that
read would break the graph if the caller made it (the eager route checks at the same point).

(No ``from __future__ import annotations`` here: ``custom_op`` reads the annotations as types to
build the op's schema.)
"""


import torch
from torch import Tensor

from .key_blocks import SINGLE_BLOCK, UnitGradients, stats_backward, stats_forward
from .options import BLOCK_BACKENDS, choice_error
from .spec import PairLabels, StatsSpec, accumulation_dtype
from .tiled import TorchTiles
from .value_check import deferred_check

BACKEND_NAMES = BLOCK_BACKENDS  # the named backends an op can run: what "auto" resolves to


def block_ops(backend: str):
    """The block-ops object of a named backend."""
    if backend == "torch":
        return TorchTiles()
    if backend == "triton":
        from .triton import TritonBlocks

        return TritonBlocks()
    raise choice_error("backend", backend, BACKEND_NAMES)


@torch.library.custom_op("hf_infcl::logit_stats", mutates_args=())
def logit_stats(
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    positives: Tensor | None,
    query_groups: Tensor | None,
    key_groups: Tensor | None,
    loss: str,
    columns: bool,
    precision: str,
    gradients_in_forward: bool,
    backend: str,
    validate: bool,
    query_ids: Tensor | None = None,
    key_owners: Tensor | None = None,
    hardness: str | None = None,
    hardness_strength: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(row_stat, col_stat, positive_logit) and, with ``gradients_in_forward``, the unit-weight
    gradients (G K [m, c], G^T Q [k, c], row sums of G [m]) for the backward; else three empty
    tensors. Only the first three are differentiable outputs."""
    ops = block_ops(backend)
    spec = StatsSpec(loss, columns, precision, gradients_in_forward, hardness, hardness_strength)
    with deferred_check(ops, scale, positives, keys.shape[0], enabled=validate):
        row_stat, col_stat, positive_logit, unit = stats_forward(
            SINGLE_BLOCK, spec, ops, queries, keys, scale, bias, positives,
            PairLabels(query_groups, key_groups, query_ids, key_owners),
        )
    if unit is None:
        if gradients_in_forward:  # the fake implementation promises the gradients' shapes
            raise RuntimeError(f"the {backend!r} block ops do not take the one-pass route")
        empty = row_stat.new_empty(0)
        return row_stat, col_stat, positive_logit, empty, empty.clone(), empty.clone()
    (_, unit_keys), = unit.key_slices
    return row_stat, col_stat, positive_logit, unit.queries, unit_keys, unit.row_sums


@logit_stats.register_fake
def _logit_stats_fake(queries, keys, scale, bias, positives, query_groups, key_groups, loss, columns,
                      precision, gradients_in_forward, backend, validate, query_ids=None, key_owners=None,
                      hardness=None, hardness_strength=0.0):
    acc = accumulation_dtype(queries.dtype)
    (m, c), k = queries.shape, keys.shape[0]
    stats = (queries.new_empty((m,), dtype=acc), queries.new_empty((k if columns else 0,), dtype=acc),
             queries.new_empty((m,), dtype=acc))
    if not gradients_in_forward:
        return (*stats, *(queries.new_empty((0,), dtype=acc) for _ in range(3)))
    return (*stats, queries.new_empty((m, c), dtype=acc), queries.new_empty((k, c), dtype=acc),
            queries.new_empty((m,), dtype=acc))


@torch.library.custom_op("hf_infcl::logit_stats_backward", mutates_args=())
def logit_stats_backward(
    grad_row_stat: Tensor,
    grad_col_stat: Tensor,
    grad_positive_logit: Tensor,
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    positives: Tensor | None,
    query_groups: Tensor | None,
    key_groups: Tensor | None,
    row_stat: Tensor,
    col_stat: Tensor,
    unit_queries: Tensor,
    unit_keys: Tensor,
    unit_row_sums: Tensor,
    loss: str,
    columns: bool,
    precision: str,
    gradients_in_forward: bool,
    backend: str,
    query_ids: Tensor | None = None,
    key_owners: Tensor | None = None,
    hardness: str | None = None,
    hardness_strength: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec = StatsSpec(loss, columns, precision, gradients_in_forward, hardness, hardness_strength)
    unit = None
    if gradients_in_forward:
        unit = UnitGradients(unit_queries, [((0, keys.shape[0]), unit_keys)], unit_row_sums)
    grad_q, grad_k, grad_scale, grad_bias = stats_backward(
        SINGLE_BLOCK, spec, block_ops(backend), queries, keys, scale, bias, positives,
        PairLabels(query_groups, key_groups, query_ids, key_owners), row_stat, col_stat, grad_row_stat,
        grad_col_stat, grad_positive_logit,
        needs=(True, True, True, bias is not None), unit=unit,
    )
    if grad_bias is None:  # an op returns tensors only; the autograd formula drops this one
        grad_bias = torch.zeros((), dtype=scale.dtype, device=scale.device)
    return grad_q, grad_k, grad_scale, grad_bias


@logit_stats_backward.register_fake
def _logit_stats_backward_fake(grad_row_stat, grad_col_stat, grad_positive_logit, queries, keys, scale, bias,
                               positives, query_groups, key_groups, row_stat, col_stat, unit_queries,
                               unit_keys, unit_row_sums, loss, columns, precision, gradients_in_forward,
                               backend, query_ids=None, key_owners=None, hardness=None,
                               hardness_strength=0.0):
    grad_bias = scale.new_empty(()) if bias is None else bias.new_empty(())
    return torch.empty_like(queries), torch.empty_like(keys), scale.new_empty(()), grad_bias


def _setup_context(ctx, inputs, output):
    (queries, keys, scale, bias, positives, query_groups, key_groups, loss, columns, precision,
     gradients_in_forward, backend, _validate, query_ids, key_owners, hardness, hardness_strength) = inputs
    row_stat, col_stat, _positive_logit, unit_queries, unit_keys, unit_row_sums = output
    ctx.mark_non_differentiable(unit_queries, unit_keys, unit_row_sums)
    ctx.save_for_backward(queries, keys, scale, bias, positives, query_groups, key_groups, row_stat, col_stat,
                          unit_queries, unit_keys, unit_row_sums, query_ids, key_owners)
    ctx.options = (loss, columns, precision, gradients_in_forward, backend)
    ctx.hardness = (hardness, hardness_strength)


def _backward(ctx, grad_row_stat, grad_col_stat, grad_positive_logit, *_unit_grads):
    (queries, keys, scale, bias, positives, query_groups, key_groups, row_stat, col_stat, unit_queries,
     unit_keys, unit_row_sums, query_ids, key_owners) = ctx.saved_tensors
    # Outputs that did not reach the loss get no gradient; the backward op needs tensors.
    grad_row_stat = torch.zeros_like(row_stat) if grad_row_stat is None else grad_row_stat
    grad_col_stat = torch.zeros_like(col_stat) if grad_col_stat is None else grad_col_stat
    if grad_positive_logit is None:
        grad_positive_logit = torch.zeros_like(row_stat)
    with torch.autocast(queries.device.type, enabled=False):  # as KeyBlockLogitStats.backward
        grad_q, grad_k, grad_scale, grad_bias = logit_stats_backward(
            grad_row_stat, grad_col_stat, grad_positive_logit, queries, keys, scale, bias, positives,
            query_groups, key_groups, row_stat, col_stat, unit_queries, unit_keys, unit_row_sums,
            *ctx.options, query_ids, key_owners, *ctx.hardness,
        )
    return (grad_q, grad_k, grad_scale, grad_bias if bias is not None else None,
            None, None, None, None, None, None, None, None, None, None, None, None, None)


logit_stats.register_autograd(_backward, setup_context=_setup_context)
