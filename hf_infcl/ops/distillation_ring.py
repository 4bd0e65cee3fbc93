"""In-batch distillation across processes: the student's and the teacher's key blocks travel the
ring together, queries stay put (docs/contract.md, "Distillation over the batch").

The schedule is :mod:`hf_infcl.ops.ring`'s, run by its machinery (the size and option exchange,
the double-buffered key blocks, the backward's key gradients travelling home in slices); only
what travels and what is merged differ:

- forward: each visiting block of student keys and teacher keys (the teacher's of its own width)
  gives this rank's rows a partial :class:`~hf_infcl.ops.distillation.SoftTargetStats`, merged
  with the contract's rule (:func:`~hf_infcl.ops.distillation.merge_soft_target_stats`). For the
  symmetric loss the keys' three column statistics travel one step behind their block, as the
  contrastive loss's column log-sum-exp does, each rank merging in its rows' share, until they
  arrive home complete;
- backward: the blocks travel again with their owner's complete column log-sum-exps and the
  loss's gradients with respect to its column statistics; each rank adds its rows' G^T Q into
  the travelling key gradients.

The statistics travel and merge in :func:`~hf_infcl.ops.tiled.statistics_dtype`'s float64, what
the torch tiles keep them in on one process, so that the ring gives one process's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .distillation import (
    DistillationSpec,
    SoftTargetGradients,
    SoftTargetStats,
    TeacherLogits,
    empty_soft_target_stats,
    merge_soft_target_stats,
)
from .ring import (
    RingLayout,
    TravellingBlocks,
    TravellingKeyGradients,
    key_slices,
    padded_block,
    post_exchange,
    wait_all,
)
from .spec import accumulation_dtype
from .tiled import statistics_dtype


@dataclass(frozen=True)
class DistillationRing:
    """The :class:`~hf_infcl.ops.distillation.DistillationSchedule` of a ring of processes, over
    the layout of :func:`~hf_infcl.ops.ring.exchange_layout`."""

    layout: RingLayout

    def forward(self, spec: DistillationSpec, ops, queries, keys, scale, teacher: TeacherLogits):
        return _ring_forward(self.layout, spec, ops, queries, keys, scale, teacher)

    def backward(self, spec: DistillationSpec, ops, queries, keys, scale, teacher: TeacherLogits,
                 rows: SoftTargetGradients, columns: SoftTargetGradients | None):
        return _ring_backward(self.layout, spec, ops, queries, keys, scale, teacher, rows, columns)


def _stats_dtype(queries: torch.Tensor) -> torch.dtype:
    return statistics_dtype("softmax", queries.dtype)


def _ring_forward(layout: RingLayout, spec: DistillationSpec, ops, queries, keys, scale, teacher):
    stat_dtype, device = _stats_dtype(queries), queries.device
    m, k_max, n = queries.shape[0], layout.max_keys, layout.world_size
    rows = empty_soft_target_stats(m, stat_dtype, device)
    blocks = TravellingBlocks(layout, [padded_block(keys, k_max, 0.0),
                                       padded_block(teacher.keys, k_max, 0.0)])

    # The running column statistics of the block computed last step, one step behind its keys.
    col_works, col_arrived = None, None
    for step in range(n):
        k_owner = layout.keys[layout.owner(step)]
        if step < n - 1:
            blocks.post_next()  # before the compute, so that the transfer overlaps it
        block_keys, block_teacher_keys = (t[:k_owner] for t in blocks.current)

        # nothing to compute (backends need not handle empty blocks), or the compute switched off
        if m == 0 or k_owner == 0 or not layout.schedule.compute:
            partial_rows = empty_soft_target_stats(m, stat_dtype, device)
            partial_cols = empty_soft_target_stats(k_owner, stat_dtype, device)
        else:
            block_teacher = TeacherLogits(teacher.queries, block_teacher_keys, teacher.scale)
            partial_rows, partial_cols = ops.distillation_forward_block(spec, queries, block_keys, scale,
                                                                        block_teacher)
            partial_rows = SoftTargetStats(*(t.to(stat_dtype) for t in partial_rows))
            if partial_cols is not None:
                partial_cols = SoftTargetStats(*(t.to(stat_dtype) for t in partial_cols))
        rows = merge_soft_target_stats(rows, partial_rows)

        if spec.columns:
            wait_all(col_works)  # the running statistics sent by the previous rank last step
            if col_arrived is not None:
                arrived = SoftTargetStats(*col_arrived[:, :k_owner])
                partial_cols = merge_soft_target_stats(arrived, partial_cols)
            outgoing = torch.stack([padded_block(t, k_max, fill) for t, fill in zip(partial_cols, _NO_KEYS)])
            col_arrived = torch.empty_like(outgoing)
            # At the last step this sends the block's complete statistics home to its owner and
            # receives this rank's own.
            col_works = post_exchange(layout, [outgoing], [col_arrived])
        if step < n - 1:
            blocks.advance(keep_spare=step < n - 2)

    columns = None
    if spec.columns:
        wait_all(col_works)
        columns = SoftTargetStats(*col_arrived[:, : keys.shape[0]].clone())
    return rows, columns


# The statistics of no rows (student LSE, teacher LSE, gap): what pads a travelling column block.
_NO_KEYS = (float("-inf"), float("-inf"), 0.0)


def _ring_backward(layout: RingLayout, spec: DistillationSpec, ops, queries, keys, scale, teacher,
                   rows: SoftTargetGradients, columns: SoftTargetGradients | None):
    acc, stat_dtype, device = accumulation_dtype(queries.dtype), _stats_dtype(queries), queries.device
    (m, width), k_max, n = queries.shape, layout.max_keys, layout.world_size
    grad_queries = torch.zeros(m, width, dtype=acc, device=device)
    row_sums = torch.zeros(m, dtype=acc, device=device)

    own = [padded_block(keys, k_max, 0.0), padded_block(teacher.keys, k_max, 0.0)]
    if columns is not None:
        # The owner's complete column log-sum-exps and the loss's gradients travel with the keys.
        col_info = torch.zeros(len(columns), k_max, dtype=stat_dtype, device=device)
        for index, values in enumerate(columns):
            col_info[index, : keys.shape[0]] = values.to(stat_dtype)
        own.append(col_info)
    blocks = TravellingBlocks(layout, own)

    slices = key_slices(k_max, width, torch.finfo(acc).bits // 8)
    key_grads = TravellingKeyGradients(layout, slices, width, acc, device)
    for step in range(n):
        k_owner = layout.keys[layout.owner(step)]
        if step < n - 1:
            blocks.post_next()  # before the compute, so that the transfer overlaps it
        block_keys, block_teacher_keys = blocks.current[:2]

        for index, (lo, hi) in enumerate(slices):
            accumulator = key_grads.accumulator(step, index)
            hi_real = min(hi, k_owner)  # rows past the owner's k are padding: never computed
            if lo < hi_real and m > 0 and layout.schedule.compute:
                block_columns = None
                if columns is not None:
                    lse, teacher_lse, student_weight, target_weight = blocks.current[2][:, lo:hi_real]
                    block_columns = SoftTargetGradients(lse, teacher_lse, student_weight.to(acc),
                                                        target_weight.to(acc))
                block_teacher = TeacherLogits(teacher.queries, block_teacher_keys[lo:hi_real], teacher.scale)
                row_sums += ops.distillation_backward_block(
                    spec, queries, block_keys[lo:hi_real], scale, block_teacher, rows, block_columns,
                    grad_queries, accumulator[: hi_real - lo])
            key_grads.send_on(index, accumulator)
        if step < n - 1:
            blocks.advance(keep_spare=step < n - 2)

    return grad_queries, key_grads.arrived(), row_sums
