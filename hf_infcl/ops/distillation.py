"""In-batch distillation's numerics (docs/contract.md, "Distillation over the batch"): the statistics
a block of keys gives, how two blocks' statistics merge, what block ops provide for it, and the
autograd Function over them.

The loss needs, per row (and per key for the symmetric loss, over the rows), three statistics of
the student's logits z and the teacher's t, accumulated tile by tile and never stored as m x k:

    student_lse_i = LSE_j z_ij      teacher_lse_i = LSE_j t_ij
    gap_i         = sum_j exp(t_ij - teacher_lse_i) * (t_ij - z_ij)

so that KL_i = gap_i + student_lse_i - teacher_lse_i. The backward needs only the two log-sum-exps
(O(m + k) numbers): G_ij = a_i exp(z_ij - student_lse_i) - b_i exp(t_ij - teacher_lse_i) (plus the
columns' terms), with a and b the gradients of student_lse and gap (d gap_i / d z_ij is minus the
teacher's probability; the teacher's log-sum-exp has no gradient). The teacher's logits are
recomputed per tile from its embeddings, as the score filter's guide scores are. The autograd
Function runs over a schedule of key blocks: one process's own (:data:`ONE_PROCESS`), or the ring's
(:mod:`hf_infcl.ops.distillation_ring`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .key_blocks import finish_gradients, output_gradient, positive_logits, row_combiner
from .options import Precision
from .spec import accumulation_dtype


@dataclass(frozen=True)
class DistillationSpec:
    """What a distillation block computes: ``columns``, the column statistics too (the symmetric
    loss); ``precision``, how fp32 inputs are multiplied (resolved: ``"tf32"`` or ``"ieee"``)."""

    columns: bool
    precision: Precision = "ieee"


@dataclass(frozen=True)
class TeacherLogits:
    """The teacher of one (row block, key block) pair: t_ij = scale * <queries_i, keys_j>, no gradient."""

    queries: torch.Tensor  # [m, c_t]
    keys: torch.Tensor  # [k_block, c_t]
    scale: torch.Tensor  # 0-d

    def tile(self, row_start: int, row_end: int, key_start: int, key_end: int,
             dtype: torch.dtype) -> torch.Tensor:
        """t of one tile, in ``dtype`` (the student tile's)."""
        rows = self.queries[row_start:row_end].to(dtype)
        return self.scale.to(dtype) * (rows @ self.keys[key_start:key_end].to(dtype).T)


class SoftTargetStats(NamedTuple):
    """One direction's forward statistics over a set of keys (rows, for the columns)."""

    student_lse: torch.Tensor
    teacher_lse: torch.Tensor
    gap: torch.Tensor  # sum of the teacher's probabilities times (t - z)


class SoftTargetGradients(NamedTuple):
    """One direction's complete log-sum-exps and the loss's gradients with respect to its
    ``student_lse`` (``student_weight``) and its ``gap`` (``target_weight``), for the backward."""

    student_lse: torch.Tensor
    teacher_lse: torch.Tensor
    student_weight: torch.Tensor
    target_weight: torch.Tensor


def empty_soft_target_stats(n: int, dtype: torch.dtype, device) -> SoftTargetStats:
    """The statistics of no keys at all: log-sum-exps -inf, gap 0."""
    return SoftTargetStats(torch.full((n,), float("-inf"), dtype=dtype, device=device),
                           torch.full((n,), float("-inf"), dtype=dtype, device=device),
                           torch.zeros(n, dtype=dtype, device=device))


def merge_soft_target_stats(a: SoftTargetStats, b: SoftTargetStats) -> SoftTargetStats:
    """The statistics of two disjoint sets of keys: the log-sum-exps merge as log-sum-exps, the
    gaps as means under the teacher's probabilities (each weighted by its set's share)."""
    teacher_lse = torch.logaddexp(a.teacher_lse, b.teacher_lse)
    gap = _share(a.teacher_lse, teacher_lse) * a.gap + _share(b.teacher_lse, teacher_lse) * b.gap
    return SoftTargetStats(torch.logaddexp(a.student_lse, b.student_lse), teacher_lse, gap)


def _share(part_lse: torch.Tensor, whole_lse: torch.Tensor) -> torch.Tensor:
    """exp(part - whole), 0 for a part of no keys (-inf, where the difference would be NaN)."""
    return torch.where(part_lse == float("-inf"), torch.zeros_like(part_lse), torch.exp(part_lse - whole_lse))


class DistillationBlockOps(Protocol):
    """What a backend provides for distillation, beside :class:`~hf_infcl.ops.spec.BlockOps`."""

    def distillation_forward_block(
        self, spec: DistillationSpec, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor,
        teacher: TeacherLogits,
    ) -> tuple[SoftTargetStats, SoftTargetStats | None]:
        """(rows' statistics [m], keys' statistics over the rows [k] or None without columns)."""

    def distillation_backward_block(
        self, spec: DistillationSpec, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor,
        teacher: TeacherLogits, rows: SoftTargetGradients, columns: SoftTargetGradients | None,
        grad_queries: torch.Tensor, grad_keys: torch.Tensor,
    ) -> torch.Tensor:
        """Add G K to ``grad_queries`` and G^T Q to ``grad_keys`` (unscaled, accumulation dtype, in
        place) and return the row sums of G, for
        G_ij = rows.student_weight_i P_ij - rows.target_weight_i T_ij (+ the columns' own terms),
        P and T the student's and the teacher's probabilities of each direction."""


# The PyTorch tiles' side on CUDA (backend "torch"): each tile costs some 500 small torch calls,
# whose host time dominates smaller tiles there (benchmarks/README.md, bench_objectives); these hold
# about 0.35 GiB of fp32 temporaries, whatever the batch.
_CUDA_TILE = 4096


def distillation_block_ops(backend, device: torch.device) -> DistillationBlockOps:
    """The block ops for distillation on ``device``: for a name, the one ``contrastive_loss`` would
    run (``"auto"``: the Triton kernels on CUDA when Triton imports, else the torch tiles, larger on
    CUDA); or a block-ops object that offers it."""
    if isinstance(backend, str):
        # imported here: tiled.py imports this module, and logit_stats.py imports tiled.py
        from .logit_stats import select_block_ops
        from .tiled import TorchTiles

        ops = select_block_ops(backend, device)
        if isinstance(ops, TorchTiles) and device.type == "cuda":
            return TorchTiles(_CUDA_TILE, _CUDA_TILE)
        return ops
    if not all(callable(getattr(backend, name, None))
               for name in ("distillation_forward_block", "distillation_backward_block")):
        raise TypeError(f"backend {type(backend).__name__} has no distillation_forward_block/"
                        "distillation_backward_block; pass 'torch' or TorchTiles(...)")
    return backend


class DistillationSchedule(Protocol):
    """Which key blocks a process's rows meet, as :class:`~hf_infcl.ops.key_blocks.KeyBlockSchedule`
    is for the contrastive loss: :data:`ONE_PROCESS`, or the ring
    (:class:`~hf_infcl.ops.distillation_ring.DistillationRing`)."""

    def forward(self, spec: DistillationSpec, ops: DistillationBlockOps, queries, keys, scale,
                teacher: TeacherLogits) -> tuple[SoftTargetStats, SoftTargetStats | None]:
        """(this process's rows' statistics [m] over every key, its keys' [k] over every row or None
        without columns)."""

    def backward(self, spec: DistillationSpec, ops: DistillationBlockOps, queries, keys, scale,
                 teacher: TeacherLogits, rows: SoftTargetGradients, columns: SoftTargetGradients | None):
        """(unscaled G K [m, c], unscaled G^T Q as ((start, end), accumulator) slices of this process's
        keys, row sums of G [m]), in the accumulation dtype, for
        :func:`~hf_infcl.ops.key_blocks.finish_gradients`."""


class OneProcess:
    """The :class:`DistillationSchedule` of one process: its own keys are the only block."""

    def forward(self, spec, ops, queries, keys, scale, teacher):
        return ops.distillation_forward_block(spec, queries, keys, scale, teacher)

    def backward(self, spec, ops, queries, keys, scale, teacher, rows, columns):
        acc = accumulation_dtype(queries.dtype)
        grad_queries = torch.zeros(queries.shape, dtype=acc, device=queries.device)
        grad_keys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        row_sums = ops.distillation_backward_block(spec, queries, keys, scale, teacher, rows, columns,
                                                   grad_queries, grad_keys)
        return grad_queries, [((0, keys.shape[0]), grad_keys)], row_sums


ONE_PROCESS = OneProcess()


class DistillationLogitStats(torch.autograd.Function):
    """(queries, keys, scale, teacher_queries, teacher_keys, teacher_scale, positives) ->
    (student_lse [m], teacher_lse [m], gap [m], the same three over the rows for each key [k] (or
    empty without columns), positive logits z_{i,p(i)} [m]) of this process's rows and keys over
    every key and row of ``schedule`` (:data:`ONE_PROCESS`, or the ring). The teacher's log-sum-exps have
    no gradient, and the teacher's tensors get none.

    The positive logits are an output for the reason :mod:`hf_infcl.ops.key_blocks` gives: their
    gradient (the mixed-in softmax loss's) is summed with G's in the fp32 accumulators.
    """

    @staticmethod
    def forward(ctx, queries, keys, scale, teacher_queries, teacher_keys, teacher_scale, positives,
                spec: DistillationSpec, ops: DistillationBlockOps, schedule: DistillationSchedule):
        teacher = TeacherLogits(teacher_queries, teacher_keys, teacher_scale)
        rows, columns = schedule.forward(spec, ops, queries, keys, scale, teacher)
        if columns is None:  # new tensors each: outputs may not alias each other
            columns = SoftTargetStats(*(rows.gap.new_empty(0) for _ in range(3)))
        positive = positive_logits(queries, keys, positives, scale, None, row_combiner(ops))
        ctx.save_for_backward(queries, keys, scale, teacher_queries, teacher_keys, teacher_scale, positives,
                              rows.student_lse, rows.teacher_lse, columns.student_lse, columns.teacher_lse)
        ctx.spec, ctx.ops, ctx.schedule = spec, ops, schedule
        ctx.mark_non_differentiable(rows.teacher_lse, columns.teacher_lse)
        return (*rows, *columns, positive)

    @staticmethod
    def backward(ctx, grad_row_lse, _grad_row_teacher_lse, grad_row_gap, grad_col_lse, _grad_col_teacher_lse,
                 grad_col_gap, grad_positive):
        (queries, keys, scale, teacher_queries, teacher_keys, teacher_scale, positives, row_lse,
         row_teacher_lse, col_lse, col_teacher_lse) = ctx.saved_tensors
        spec, ops = ctx.spec, ctx.ops
        acc = accumulation_dtype(queries.dtype)
        with torch.autocast(queries.device.type, enabled=False):
            rows = SoftTargetGradients(row_lse, row_teacher_lse, output_gradient(grad_row_lse, row_lse, acc),
                                       output_gradient(grad_row_gap, row_lse, acc))
            columns = None
            if spec.columns:
                columns = SoftTargetGradients(col_lse, col_teacher_lse,
                                              output_gradient(grad_col_lse, col_lse, acc),
                                              output_gradient(grad_col_gap, col_lse, acc))
            teacher = TeacherLogits(teacher_queries, teacher_keys, teacher_scale)
            grad_queries, key_slices, row_sums = ctx.schedule.backward(spec, ops, queries, keys, scale,
                                                                       teacher, rows, columns)
            grad_positive = output_gradient(grad_positive, row_lse, acc)
            needs = (*ctx.needs_input_grad[:3], False)  # no bias
            grads = finish_gradients(needs, queries, keys, scale, None, positives, grad_positive,
                                     grad_queries, key_slices, row_sums, combine=row_combiner(ops))
        return (*grads[:3], None, None, None, None, None, None, None)

