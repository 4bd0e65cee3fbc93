"""The public distillation loss: ``contrastive_distillation_loss``, in-batch distillation over every
key of the batch (docs/contract.md, "Distillation over the batch").

The loss layer of distillation, as :mod:`hf_infcl.loss` is of the contrastive loss, whose argument
checks and reduction it reuses: validate, one call for the statistics
(:class:`~hf_infcl.ops.distillation.DistillationLogitStats`), assemble the per-row loss, reduce.
"""

from __future__ import annotations

import torch

from .loss import (
    as_scalar_tensor,
    check_arguments,
    check_second_embeddings,
    reduce_per_row,
    resolve_process_group,
)
from .ops import reference, ring
from .ops.distillation import ONE_PROCESS, DistillationLogitStats, DistillationSpec, distillation_block_ops
from .ops.distillation_ring import DistillationRing
from .ops.logit_stats import announcing_rejections
from .ops.options import BackendName, Precision, Reduction, check_distillation_weight
from .ops.spec import BlockOps, StatsSpec, accumulation_dtype, resolve_precision


def contrastive_distillation_loss(
    queries: torch.Tensor,
    keys: torch.Tensor,
    teacher_queries: torch.Tensor,
    teacher_keys: torch.Tensor,
    logit_scale: float | torch.Tensor = 1.0,
    teacher_logit_scale: float | torch.Tensor = 1.0,
    *,
    symmetric: bool = True,
    positives: torch.Tensor | None = None,
    distillation_weight: float = 1.0,
    reduction: Reduction = "mean",
    process_group=None,
    backend: BackendName | BlockOps = "auto",
    precision: Precision = "auto",
) -> torch.Tensor:
    """KL divergence of the student's softmax over every key of the batch from a teacher's, exact and
    without a b x b matrix, optionally mixed with the InfoNCE loss.

    Row i's term is KL(softmax_j t_ij || softmax_j z_ij) over all keys j, with the student's logits
    z_ij = logit_scale * <queries_i, keys_j> and the teacher's t_ij = teacher_logit_scale *
    <teacher_queries_i, teacher_keys_j>; ``symmetric`` averages it with the same KL over the rows at
    row i's positive key, as CLIP's loss averages its two directions (docs/contract.md,
    "Distillation over the batch").

    Args:
        queries, keys, logit_scale, positives, reduction, backend, precision: the student, as
            :func:`hf_infcl.contrastive_loss` takes them (no bias: the softmax is shift-invariant).
            ``keys[:m]`` (or ``positives``) are the rows' positives, used by the column term and the
            mixed-in InfoNCE loss.
        teacher_queries, teacher_keys: ``[m, c_t]`` and ``[k, c_t]``, the teacher's embeddings of the
            same rows and keys (precomputed, or a teacher model's under ``torch.no_grad()``), of
            their own width, the queries' dtype and device. A constant: they get no gradient.
        teacher_logit_scale: the teacher's scale (its inverse temperature), a positive float or
            scalar tensor; it gets no gradient.
        symmetric: also the column (key -> row) term, averaged with the row term.
        distillation_weight: ``w`` in [0, 1]; the loss is ``(1 - w) * InfoNCE + w * KL`` per row
            (InfoNCE with the same ``symmetric`` and positives). 1 (the default): the KL alone.
        process_group: ``None`` (or ``"auto"`` outside ``torch.distributed``, or a group of one
            process): this process's rows and keys. A group of several processes (``"auto"``: the
            default group when ``torch.distributed`` is initialised): every rank passes its own rows,
            keys and the teacher's embeddings of them, and each row's KL runs over every key of the
            group (the student's and the teacher's key blocks travel a ring, as
            :func:`hf_infcl.contrastive_loss`'s do; nothing is gathered). Ranks may hold different
            numbers of rows, none included; ``"mean"`` is then (n / M) times the sum of this rank's
            rows (M rows in the group), so that DDP's average of the gradients is the global mean's;
            ``positives`` index this rank's own keys.
            Every rank must pass the same options (widths, the teacher's width, dtype, ``symmetric``,
            ``distillation_weight``, ``reduction``, ``precision``), or every rank raises
            ``ValueError``.
        backend: as ``contrastive_loss``'s: ``"auto"`` runs the distillation's Triton kernels on
            CUDA when Triton imports, else the tile-wise PyTorch block ops (``"torch"``, on any
            device); ``"triton"`` needs CUDA tensors; ``"reference"`` materialises the logits
            (small inputs, one process); or a block-ops object offering
            ``distillation_forward_block``/``distillation_backward_block``, such as
            ``TorchTiles(256, 256)`` or ``hf_infcl.ops.triton.TritonBlocks()``.

    Returns:
        The reduced loss (a scalar), or the per-row losses ``[m]`` for ``reduction="none"``.
    """
    group, world_size = resolve_process_group(process_group)
    in_ring = world_size > 1
    # A rank whose checks fail tells the others (waiting in the ring's option exchange) first.
    device = queries.device if torch.is_tensor(queries) else None
    with announcing_rejections(group if in_ring else None, device):
        distillation_weight = check_distillation_weight(distillation_weight)
        scale, _, positives = check_arguments(queries, keys, logit_scale, None, "softmax", symmetric,
                                               positives, None, None, reduction, backend, precision,
                                               in_ring=in_ring)
        check_second_embeddings(queries, keys, teacher_queries, teacher_keys, "teacher", required=True)
        teacher_scale = _teacher_scale(teacher_logit_scale, queries)
        ops = None if backend == "reference" else distillation_block_ops(backend, queries.device)
    # As contrastive_loss: its inputs' dtype and precision, whatever autocast says.
    with torch.autocast(queries.device.type, enabled=False):
        if backend == "reference":  # one process: the checks refuse it in a ring
            per_row = reference.distillation_per_row_loss(
                queries, keys, scale, teacher_queries, teacher_keys, teacher_scale, symmetric=symmetric,
                positives=positives, distillation_weight=distillation_weight)
            return reduce_per_row(per_row, reduction, total_rows=queries.shape[0], world_size=1)
        spec = DistillationSpec(columns=symmetric,
                                precision=resolve_precision(precision, queries.dtype, queries.device))
        schedule, total_rows = ONE_PROCESS, queries.shape[0]
        if in_ring:
            layout = ring.exchange_layout(group, queries, keys, StatsSpec(loss="softmax", columns=symmetric,
                                                                          precision=spec.precision),
                                          has_bias=False, has_groups=False, reduction=reduction,
                                          teacher_width=teacher_queries.shape[1],
                                          distillation_weight=distillation_weight)
            schedule, total_rows = DistillationRing(layout), layout.total_rows
        stats = DistillationLogitStats.apply(queries, keys, scale, teacher_queries, teacher_keys,
                                             teacher_scale, positives, spec, ops, schedule)
        per_row = _per_row_loss(stats, positives, symmetric, distillation_weight)
        per_row = per_row.to(accumulation_dtype(queries.dtype))
        return reduce_per_row(per_row, reduction, total_rows=total_rows, world_size=world_size)


def _teacher_scale(teacher_logit_scale, queries) -> torch.Tensor:
    """The teacher's scale as a detached scalar tensor in the accumulation dtype, checked > 0 (a NaN
    passes: non-finite inputs give a NaN loss)."""
    scale = as_scalar_tensor("teacher_logit_scale", teacher_logit_scale, accumulation_dtype(queries.dtype),
                              queries.device, allow_none=False).detach()
    if scale.item() <= 0:
        raise ValueError(f"teacher_logit_scale must be > 0 (it multiplies the teacher's logits), got "
                         f"{scale.item()}")
    return scale


def _per_row_loss(stats, positives, symmetric: bool, distillation_weight: float) -> torch.Tensor:
    """The per-row loss from :class:`~hf_infcl.ops.distillation.DistillationLogitStats`' outputs:
    KL = gap + student LSE - teacher LSE per direction (the column's at each row's positive key),
    and the softmax loss's LSE - z_{i,p(i)} where it is mixed in."""
    row_lse, row_teacher_lse, row_gap, col_lse, col_teacher_lse, col_gap, positive_logit = stats
    m = row_lse.shape[0]

    def at_positives(per_key):
        return per_key[:m] if positives is None else per_key[positives]

    distillation = row_gap + row_lse - row_teacher_lse
    contrastive = row_lse - positive_logit
    if symmetric:
        column_lse = at_positives(col_lse)
        distillation = (distillation + at_positives(col_gap) + column_lse - at_positives(col_teacher_lse)) / 2
        contrastive = (contrastive + column_lse - positive_logit) / 2
    if distillation_weight == 1.0:
        return distillation
    return distillation_weight * distillation + (1.0 - distillation_weight) * contrastive
