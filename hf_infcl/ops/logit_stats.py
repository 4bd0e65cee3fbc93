"""One entry point for the loss's statistics, for one process or a ring of processes.

:func:`logit_stats` returns the row statistics (row log-sum-exp, or the sigmoid loss's row sums),
the column statistics of the symmetric softmax loss, and the positive logits z_{i,p(i)}, over
every row and key of the process group, with the number of rows in the group. The public layer
(``hf_infcl.loss``) validates, calls it once, assembles the per-row loss and reduces; it knows
nothing of how the statistics are computed:

- one process: the schedule is a single key block (:class:`~hf_infcl.ops.key_blocks.SingleBlock`):
  no padding, no collective. Under ``torch.compile`` the named backends run as the custom op of
  :mod:`hf_infcl.ops.custom_ops` (the compiler keeps it in a graph); eager calls, and a
  block-ops object given directly, run the same forward and backward through
  :class:`~hf_infcl.ops.key_blocks.KeyBlockLogitStats`, without the op's dispatch.
- a group of several: the sizes and options are exchanged (:func:`~hf_infcl.ops.ring.exchange_layout`),
  and the resulting layout is the schedule: key blocks travel the ring, through the same
  :class:`~hf_infcl.ops.key_blocks.KeyBlockLogitStats`; eager, a graph break under
  ``torch.compile``.

:func:`announcing_rejections` wraps a rank's argument checks, so that a rank whose arguments fail
takes part in the size exchange with a rejection, and the other ranks raise instead of waiting.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from . import custom_ops, ring, warm_start
from .compiler_marks import constant_when_compiled, run_eagerly
from .key_blocks import SINGLE_BLOCK, KeyBlockLogitStats
from .spec import BlockOps, StatsSpec, accumulation_dtype
from .value_check import deferred_check

__all__ = ["LogitStats", "announcing_rejections", "backend_name", "logit_stats", "select_block_ops"]


class LogitStats(NamedTuple):
    """What :func:`logit_stats` returns."""

    row_stat: torch.Tensor  # [m] this process's rows
    col_stat: torch.Tensor  # [k] this process's keys (symmetric softmax), else empty
    # [m] z_{i,p(i)}, in the accumulation dtype; with group_positives the rows' positive parts
    # (hf_infcl.ops.positive_pairs: a log-sum-exp for "any", else a sum)
    positive_logit: torch.Tensor
    total_rows: int  # rows in the whole group (m with one process)
    column_positive: torch.Tensor | None = None  # [k] keys' positive parts (group_positives, columns)
    positive_counts: torch.Tensor | None = None  # [m] |P(i)| (group_positives "each")
    column_counts: torch.Tensor | None = None  # [k] |R(j)| (group_positives "each", columns)


def logit_stats(queries, keys, scale, bias, positives, query_groups, key_groups, spec: StatsSpec,
                backend, *, group=None, reduction: str = "mean", validate: bool = False, query_ids=None,
                key_owners=None, label_smoothing: float = 0.0, guide_queries=None,
                guide_keys=None, matryoshka_term: ring.MatryoshkaTerm | None = None) -> LogitStats:
    """The statistics of ``spec`` over this process's rows against every key of ``group``.

    Args:
        queries, keys, scale, bias, positives, query_groups, key_groups: checked arguments of the
            loss (``positives`` as local key indices; ``scale``/``bias`` as tensors).
        spec: which statistics (:class:`~hf_infcl.ops.spec.StatsSpec`), precision resolved.
        backend: a backend name (``"auto"``, ``"torch"``, ``"triton"``) or a block-ops object.
        group: a process group of several ranks for the ring, or None for one process.
        reduction: the loss's reduction; the ring checks that every rank asks for the same.
        validate: make the checks that read values (scale > 0, positives in range) here, before
            the first kernel, for a caller that left them out (one process; as late as that
            allows: :mod:`hf_infcl.ops.value_check`).
        query_ids, key_owners: the hardness offset's ids (``spec.hardness``), or None.
        label_smoothing: the loss's, which the statistics do not use; the ring checks that every
            rank asks for the same (the smoothing's all-reduce follows on every rank or on none).
        guide_queries, guide_keys: the score filter's guide (``spec.false_negative_margin``), or
            None.
        matryoshka_term: the term of a Matryoshka loss this call computes, or None; the ring checks
            that every rank computes the same term (:class:`~hf_infcl.ops.ring.MatryoshkaTerm`).
    """
    labels = (query_groups, key_groups, query_ids, key_owners, guide_queries, guide_keys)
    if group is not None:
        return _ring_stats(group, queries, keys, scale, bias, positives, labels, spec, backend, reduction,
                           label_smoothing, matryoshka_term)
    if isinstance(backend, str) and torch.compiler.is_compiling():
        (row_stat, col_stat, positive_logit, _unit_queries, _unit_keys, _unit_row_sums,
         *positive_parts) = custom_ops.logit_stats(
            queries, keys, scale, bias, positives, query_groups, key_groups, spec.loss, spec.columns,
            spec.precision, spec.gradients_in_forward, backend_name(backend, queries.device), validate,
            query_ids, key_owners, spec.hardness, spec.hardness_strength, guide_queries, guide_keys,
            spec.group_positives, spec.false_negative_margin, spec.false_negative_strategy,
        )
    else:
        # Eager: the same forward and backward as the op's, without the op. torch's custom-op
        # layer costs host time on every call (its autograd wrapper rebuilds the 17-argument
        # schema's defaults, then redispatches), which at small batches is time the GPU waits.
        row_stat, col_stat, positive_logit, *positive_parts = _block_ops_stats(
            queries, keys, scale, bias, positives, labels, spec, select_block_ops(backend, queries.device),
            validate,
        )
    # Block ops may keep the statistics finer (the "torch" backend's are float64) for their own
    # backward; the loss is assembled in the accumulation dtype.
    acc = accumulation_dtype(queries.dtype)
    return LogitStats(row_stat.to(acc), col_stat.to(acc), positive_logit, queries.shape[0], *positive_parts)


@run_eagerly
def _block_ops_stats(queries, keys, scale, bias, positives, labels, spec, ops, validate):
    """One process, eager: a block-ops object (which cannot be a custom-op argument: a graph
    break under torch.compile), or a named backend's outside a compiled region.
    ``labels``: (query_groups, key_groups, query_ids, key_owners, guide_queries, guide_keys)."""
    with deferred_check(ops, scale, positives, keys.shape[0], enabled=validate,
                        distinct_positives=spec.distinct_positives):
        return KeyBlockLogitStats.apply(queries, keys, scale, bias, positives, *labels, spec, ops,
                                        SINGLE_BLOCK)


@run_eagerly
def _ring_stats(group, queries, keys, scale, bias, positives, labels, spec, backend,
                reduction, label_smoothing, matryoshka_term) -> LogitStats:
    query_groups, guide_queries = labels[0], labels[4]
    layout = ring.exchange_layout(group, queries, keys, spec, bias is not None, query_groups is not None,
                                  reduction, label_smoothing,
                                  guide_width=None if guide_queries is None else guide_queries.shape[1],
                                  matryoshka_term=matryoshka_term)
    row_stat, col_stat, positive_logit, *positive_parts = KeyBlockLogitStats.apply(
        queries, keys, scale, bias, positives, *labels, spec, select_block_ops(backend, queries.device),
        layout,
    )
    return LogitStats(row_stat, col_stat, positive_logit, layout.total_rows, *positive_parts)


@contextlib.contextmanager
def announcing_rejections(group, device: torch.device | None):
    """Around a rank's argument checks: if they raise TypeError/ValueError and ``group`` is a ring,
    tell the other ranks (waiting in the size exchange) first, so that they raise too."""
    try:
        yield
    except (TypeError, ValueError):
        if group is not None:
            ring.announce_rejected_arguments(group, device)
        raise


def select_block_ops(backend, device: torch.device) -> BlockOps:
    """The block ops for a backend name (or a block-ops object given directly)."""
    if not isinstance(backend, str):
        return backend
    return custom_ops.block_ops(backend_name(backend, device))


def backend_name(backend: str, device: torch.device) -> str:
    """"torch" or "triton" for a backend name: "auto" is Triton on CUDA when it can be imported."""
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not _triton_importable():
            raise ImportError("backend='triton' needs Triton (`pip install triton`, Linux with a CUDA GPU)")
        return "triton"
    return "triton" if device.type == "cuda" and _triton_importable() else "torch"


@constant_when_compiled
def _triton_importable() -> bool:
    # constant_when_compiled: torch.compile calls this once while tracing and keeps the answer,
    # instead of tracing an import.
    warm_start.wait()  # its thread may be importing the route right now
    try:
        from . import triton  # noqa: F401
    except ImportError:
        return False
    return True
