"""The single-process loss as ``torch.library`` custom ops, so that ``torch.compile`` can keep it in
one graph (``fullgraph=True``) instead of tracing into Triton launchers or autotuners.

``hf_infcl.ops.logit_stats`` calls them only while compiling: eager calls run the same forward
and backward through :class:`~hf_infcl.ops.key_blocks.KeyBlockLogitStats`, because the op's
dispatch (its autograd wrapper rebuilds the schema's defaults on every call, then redispatches)
is host time that a small, host-bound step waits for.

Two ops, both functional (they allocate their outputs and write nothing the caller owns):

* ``hf_infcl::logit_stats`` -> (row_stat [m], col_stat [k] or [0], positive_logit [m]), the
  statistics of :mod:`hf_infcl.ops.spec` over one process's rows and keys, three more
  outputs that carry the sigmoid loss's unit-weight gradients to the backward when the forward
  computes them (``StatsSpec.gradients_in_forward``; empty otherwise, never differentiable), and
  with ``group_positives`` the keys' positive parts [k] (columns) and the counts of "each" (never
  differentiable) of :class:`~hf_infcl.ops.key_blocks.ForwardStats` (empty otherwise);
* ``hf_infcl::logit_stats_backward`` -> (d queries, d keys, d scale, d bias), every tile
  recomputed once.

The first op's autograd formula calls the second, so the compiled backward holds one opaque op
too. Each op has a fake (meta) implementation: shapes only, which is all the compiler needs.

A custom op takes tensors, numbers and strings, not Python objects, so the backend is named
(``"torch"`` or ``"triton"``), the group mask and the hardness offset are passed as their
tensors, and the hardness offset's mode and strength as a string and a float, then the score
filter's guide tensors, ``group_positives``, margin and strategy (last, with defaults: none).
Block-ops objects that a caller passes directly go through
:class:`hf_infcl.ops.key_blocks.KeyBlockLogitStats` instead; both run the same forward and backward
(:func:`~hf_infcl.ops.key_blocks.stats_forward`, :func:`~hf_infcl.ops.key_blocks.stats_backward`) over
the one-process schedule.

``validate``: the op checks the argument values (scale > 0, positives in range) itself when it
runs, before its first kernel (:mod:`hf_infcl.ops.value_check`), which needs the values on the
host. ``contrastive_loss`` passes ``validate=True`` on one process: under ``torch.compile`` that
read would break the graph if the caller made it (the eager route checks at the same point).

(No ``from __future__ import annotations`` here: ``custom_op`` reads the annotations as types to
build the op's schema.)
"""


import torch
from torch import Tensor

from .key_blocks import SINGLE_BLOCK, SingleBlock, UnitGradients, stats_backward, stats_forward
from .options import BLOCK_BACKENDS, choice_error
from .spec import PairLabels, StatsSpec, accumulation_dtype
from .tiled import TorchTiles, statistics_dtype
from .value_check import deferred_check

BACKEND_NAMES = BLOCK_BACKENDS  # the named backends an op can run: what "auto" resolves to

# The op's outputs are tensors: counts of the score filter's left-out entries could not reach the
# backward op, so its forward counts none (the backward filters every tile).
_UNLISTED = SingleBlock(lists_left_out=False)


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
    guide_queries: Tensor | None = None,
    guide_keys: Tensor | None = None,
    group_positives: str | None = None,
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(row_stat, col_stat, positive_logit); with ``gradients_in_forward``, the unit-weight
    gradients (G K [m, c], G^T Q [k, c], row sums of G [m]) for the backward, else three empty
    tensors; (column_positive, positive_counts, column_counts), empty where not computed. The
    first three and column_positive are the differentiable outputs."""
    ops = block_ops(backend)
    spec = _spec(loss, columns, precision, gradients_in_forward, hardness, hardness_strength, group_positives,
                 false_negative_margin, false_negative_strategy)
    with deferred_check(ops, scale, positives, keys.shape[0], enabled=validate,
                        distinct_positives=spec.distinct_positives):
        stats = stats_forward(
            _UNLISTED, spec, ops, queries, keys, scale, bias, positives,
            PairLabels(query_groups, key_groups, query_ids, key_owners, guide_queries=guide_queries,
                       guide_keys=guide_keys),
        )
    outputs = stats.row_stat, stats.col_stat, stats.positive
    parts = stats.column_positive, stats.positive_counts, stats.column_counts
    if stats.unit is None:
        if gradients_in_forward:  # the fake implementation promises the gradients' shapes
            raise RuntimeError(f"the {backend!r} block ops do not take the one-pass route")
        empty = stats.row_stat.new_empty(0)
        return *outputs, empty, empty.clone(), empty.clone(), *parts
    (_, unit_keys), = stats.unit.key_slices
    return *outputs, stats.unit.queries, unit_keys, stats.unit.row_sums, *parts


def _spec(loss, columns, precision, gradients_in_forward, hardness, hardness_strength, group_positives,
          false_negative_margin, false_negative_strategy) -> StatsSpec:
    return StatsSpec(loss, columns, precision, gradients_in_forward, hardness, hardness_strength,
                     group_positives, false_negative_margin, false_negative_strategy)


@logit_stats.register_fake
def _logit_stats_fake(queries, keys, scale, bias, positives, query_groups, key_groups, loss, columns,
                      precision, gradients_in_forward, backend, validate, query_ids=None, key_owners=None,
                      hardness=None, hardness_strength=0.0, guide_queries=None, guide_keys=None,
                      group_positives=None, false_negative_margin=None, false_negative_strategy="absolute"):
    acc = accumulation_dtype(queries.dtype)
    (m, c), k = queries.shape, keys.shape[0]

    def vector(length, dtype=acc):
        return queries.new_empty((length,), dtype=dtype)

    stat = statistics_dtype(loss, queries.dtype) if backend == "torch" else acc
    stats = (vector(m, stat), vector(k, stat) if columns else vector(0), vector(m))
    grouped = group_positives is not None
    counting = grouped and loss == "softmax" and group_positives == "each"
    parts = (vector(k if grouped and columns else 0), vector(m if counting else 0),
             vector(k if counting and columns else 0))
    if not gradients_in_forward:
        return (*stats, *(vector(0) for _ in range(3)), *parts)
    return (*stats, queries.new_empty((m, c), dtype=acc), queries.new_empty((k, c), dtype=acc), vector(m),
            *parts)


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
    guide_queries: Tensor | None = None,
    guide_keys: Tensor | None = None,
    group_positives: str | None = None,
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
    positive_logit: Tensor | None = None,
    column_positive: Tensor | None = None,
    grad_column_positive: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec = _spec(loss, columns, precision, gradients_in_forward, hardness, hardness_strength, group_positives,
                 false_negative_margin, false_negative_strategy)
    unit = None
    if gradients_in_forward:
        unit = UnitGradients(unit_queries, [((0, keys.shape[0]), unit_keys)], unit_row_sums)
    grad_q, grad_k, grad_scale, grad_bias = stats_backward(
        SINGLE_BLOCK, spec, block_ops(backend), queries, keys, scale, bias, positives,
        PairLabels(query_groups, key_groups, query_ids, key_owners, guide_queries=guide_queries,
                   guide_keys=guide_keys), row_stat, col_stat, grad_row_stat,
        grad_col_stat, grad_positive_logit,
        needs=(True, True, True, bias is not None), unit=unit,
        positive_parts=(positive_logit, column_positive), grad_column_positive=grad_column_positive,
    )
    if grad_bias is None:  # an op returns tensors only; the autograd formula drops this one
        grad_bias = torch.zeros((), dtype=scale.dtype, device=scale.device)
    return grad_q, grad_k, grad_scale, grad_bias


@logit_stats_backward.register_fake
def _logit_stats_backward_fake(grad_row_stat, grad_col_stat, grad_positive_logit, queries, keys, scale, bias,
                               positives, query_groups, key_groups, row_stat, col_stat, unit_queries,
                               unit_keys, unit_row_sums, loss, columns, precision, gradients_in_forward,
                               backend, query_ids=None, key_owners=None, hardness=None,
                               hardness_strength=0.0, guide_queries=None, guide_keys=None,
                               group_positives=None, false_negative_margin=None,
                               false_negative_strategy="absolute",
                               positive_logit=None, column_positive=None, grad_column_positive=None):
    grad_bias = scale.new_empty(()) if bias is None else bias.new_empty(())
    return torch.empty_like(queries), torch.empty_like(keys), scale.new_empty(()), grad_bias


def _setup_context(ctx, inputs, output):
    (queries, keys, scale, bias, positives, query_groups, key_groups, loss, columns, precision,
     gradients_in_forward, backend, _validate, query_ids, key_owners, hardness, hardness_strength,
     guide_queries, guide_keys, group_positives, false_negative_margin, false_negative_strategy) = inputs
    (row_stat, col_stat, positive_logit, unit_queries, unit_keys, unit_row_sums, column_positive,
     positive_counts, column_counts) = output
    ctx.mark_non_differentiable(unit_queries, unit_keys, unit_row_sums, positive_counts, column_counts)
    ctx.save_for_backward(queries, keys, scale, bias, positives, query_groups, key_groups, row_stat, col_stat,
                          unit_queries, unit_keys, unit_row_sums, query_ids, key_owners, guide_queries,
                          guide_keys, positive_logit, column_positive)
    ctx.options = (loss, columns, precision, gradients_in_forward, backend)
    ctx.hardness = (hardness, hardness_strength)
    ctx.objectives = (group_positives, false_negative_margin, false_negative_strategy)


def _backward(ctx, grad_row_stat, grad_col_stat, grad_positive_logit, _grad_unit_queries, _grad_unit_keys,
              _grad_unit_row_sums, grad_column_positive, *_grad_counts):
    (queries, keys, scale, bias, positives, query_groups, key_groups, row_stat, col_stat, unit_queries,
     unit_keys, unit_row_sums, query_ids, key_owners, guide_queries, guide_keys, positive_logit,
     column_positive) = ctx.saved_tensors
    # Outputs that did not reach the loss get no gradient; the backward op needs tensors.
    grad_row_stat = torch.zeros_like(row_stat) if grad_row_stat is None else grad_row_stat
    grad_col_stat = torch.zeros_like(col_stat) if grad_col_stat is None else grad_col_stat
    if grad_positive_logit is None:
        grad_positive_logit = torch.zeros_like(row_stat)
    if grad_column_positive is None:
        grad_column_positive = torch.zeros_like(column_positive)
    with torch.autocast(queries.device.type, enabled=False):  # as KeyBlockLogitStats.backward
        grad_q, grad_k, grad_scale, grad_bias = logit_stats_backward(
            grad_row_stat, grad_col_stat, grad_positive_logit, queries, keys, scale, bias, positives,
            query_groups, key_groups, row_stat, col_stat, unit_queries, unit_keys, unit_row_sums,
            *ctx.options, query_ids, key_owners, *ctx.hardness, guide_queries, guide_keys, *ctx.objectives,
            positive_logit, column_positive, grad_column_positive,
        )
    return (grad_q, grad_k, grad_scale, grad_bias if bias is not None else None, *(None,) * 18)


logit_stats.register_autograd(_backward, setup_context=_setup_context)
