"""The schedule of one process: its own keys are the only key block (no transfer, no padding).

Forward: one call of ``forward_block`` over all rows and keys gives the row (and column)
statistics. Backward: one call of ``backward_block`` recomputes every tile once. The Function
and the epilogues around it are those of every schedule (:mod:`hf_infcl.ops.key_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .key_blocks import UnitGradients
from .spec import BlockOps, OnePassSigmoidOps, PairLabels, StatsSpec, accumulation_dtype


@dataclass(frozen=True)
class SingleBlock:
    """A :class:`~hf_infcl.ops.key_blocks.KeyBlockSchedule` of one process."""

    rank: int = 0

    def key_offset(self, rank: int) -> int:
        return 0

    def forward_stats(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias, labels: PairLabels):
        mask, hardness = _own_block(spec, labels)
        return ops.forward_block(spec, queries, keys, scale, bias, mask, hardness=hardness)

    def backward_accumulators(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                              labels: PairLabels, row_stat, col_stat, grad_row_stat, grad_col_stat):
        acc = accumulation_dtype(queries.dtype)
        grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        mask, hardness = _own_block(spec, labels)
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
            hardness=hardness,
        )
        return grad_queries, [((0, keys.shape[0]), grad_keys)], row_sums

    def forward_with_gradients(self, spec: StatsSpec, ops: OnePassSigmoidOps, queries, keys, scale, bias,
                               labels: PairLabels):
        """The sigmoid loss's one pass: (row_stat, unit-weight gradients), see
        :class:`~hf_infcl.ops.key_blocks.UnitGradients`."""
        acc = accumulation_dtype(queries.dtype)
        grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        row_stat, row_sums = ops.forward_backward_block(spec, queries, keys, scale, bias,
                                                        labels.mask(labels.key_groups, 0), grad_queries,
                                                        grad_keys)
        return row_stat, UnitGradients(grad_queries, [((0, keys.shape[0]), grad_keys)], row_sums)


SINGLE_BLOCK = SingleBlock()


def _own_block(spec: StatsSpec, labels: PairLabels):
    """(group mask, hardness offset) of the rows against this process's own keys, the only block."""
    return labels.mask(labels.key_groups, 0), labels.hardness(spec, labels.key_owners, 0)
