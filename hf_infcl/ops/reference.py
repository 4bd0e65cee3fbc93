"""The materialised contrastive loss, written for clarity: the oracle of every test.

It builds the whole m x k logit matrix, so it is only for small batches (and for checking the
other backends). It follows docs/contract.md literally and shares no code with them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_row_loss(
    queries: torch.Tensor,
    keys: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
    *,
    loss: str = "softmax",
    symmetric: bool = True,
    positives: torch.Tensor | None = None,
    query_groups: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    query_ids: torch.Tensor | None = None,
    key_owners: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    group_positives: str | None = None,
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
    guide_queries: torch.Tensor | None = None,
    guide_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row loss l_i [m] of one process's rows against its keys.

    Computes in float64 for float64 inputs and in float32 otherwise; differentiable with
    ordinary autograd. ``label_smoothing`` (softmax, no groups, no hardness offset) as
    ``torch.nn.functional.cross_entropy`` defines it, each term over all of its candidates.
    ``group_positives`` and the score filter (``false_negative_margin``, ...) as docs/contract.md's
    "Several positives per row" and "False negatives by score" define them.
    """
    compute_dtype = torch.float64 if queries.dtype == torch.float64 else torch.float32
    q = queries.to(compute_dtype)
    k = keys.to(compute_dtype)
    m = q.shape[0]
    rows = torch.arange(m, device=q.device)
    if positives is None:
        positives = rows

    dots = q @ k.T
    z = logit_scale.to(compute_dtype) * dots
    if logit_bias is not None:
        z = z + logit_bias.to(compute_dtype)

    positive, allowed, column_allowed = _pair_masks(
        dots, positives, query_groups, key_groups, group_positives, false_negative_margin,
        false_negative_strategy, guide_queries, guide_keys)

    if loss == "sigmoid":
        labels = torch.where(positive, 1.0, -1.0).to(compute_dtype)
        pair_loss = -F.logsigmoid(labels * z)
        return torch.where(allowed, pair_loss, torch.zeros_like(pair_loss)).sum(dim=1)

    positive_logit = z[rows, positives]
    row_positive = _positive_part(z, positive, group_positives, positive_logit)
    row_logits = z.masked_fill(~allowed, float("-inf"))
    if hardness_mode is not None:  # the offset of docs/contract.md, a constant: no gradient
        offset = hardness_strength * dots.detach()
        selected = _hardness_selection(hardness_mode, query_ids, key_owners, positive)
        row_logits = row_logits + torch.where(selected, offset, torch.zeros_like(offset))
    row_term = torch.logsumexp(row_logits, dim=1) - row_positive
    eps = label_smoothing
    if eps:  # the target (1 - eps) on the positive plus eps / N on every one of the N candidates
        row_term = (1 - eps) * row_term + eps * (row_term + positive_logit - z.mean(dim=1))
    if not symmetric:
        return row_term
    # over the rows allowed for each key; the column's positive part over its positive rows
    column_lse = torch.logsumexp(z.masked_fill(~column_allowed, float("-inf")), dim=0)
    column_positive = _positive_part(z.T, positive.T, group_positives, None)
    column_term = column_lse[positives] - (positive_logit if column_positive is None
                                           else column_positive[positives])
    if eps:
        column_term = (1 - eps) * column_term + eps * (column_lse[positives] - z.mean(dim=0)[positives])
    return (row_term + column_term) / 2


def distillation_per_row_loss(queries, keys, logit_scale, teacher_queries, teacher_keys,
                              teacher_logit_scale, *, symmetric: bool = True,
                              positives: torch.Tensor | None = None,
                              distillation_weight: float = 1.0) -> torch.Tensor:
    """Per-row loss of docs/contract.md's "Distillation over the batch" [m]: the KL divergence of the
    student's softmax from the teacher's, over keys (and over rows at each row's positive key for
    ``symmetric``), mixed with :func:`per_row_loss`'s softmax loss by ``distillation_weight``. The
    teacher is a constant (detached)."""
    compute_dtype = torch.float64 if queries.dtype == torch.float64 else torch.float32
    z = logit_scale.to(compute_dtype) * (queries.to(compute_dtype) @ keys.to(compute_dtype).T)
    teacher = teacher_queries.detach().to(compute_dtype) @ teacher_keys.detach().to(compute_dtype).T
    t = teacher_logit_scale.detach().to(compute_dtype) * teacher

    def kl(dim):  # KL(softmax(t) || softmax(z)) along dim
        log_student, log_teacher = F.log_softmax(z, dim=dim), F.log_softmax(t, dim=dim)
        return (log_teacher.exp() * (log_teacher - log_student)).sum(dim=dim)

    distillation = kl(1)
    if symmetric:
        m = queries.shape[0]
        at_positives = torch.arange(m, device=z.device) if positives is None else positives
        distillation = (distillation + kl(0)[at_positives]) / 2
    if distillation_weight == 1.0:
        return distillation
    contrastive = per_row_loss(queries, keys, logit_scale, symmetric=symmetric, positives=positives)
    return distillation_weight * distillation + (1.0 - distillation_weight) * contrastive


def _pair_masks(dots, positives, query_groups, key_groups, group_positives, false_negative_margin,
                false_negative_strategy, guide_queries, guide_keys):
    """(positive, allowed, column_allowed), boolean [m, k]: key j is one of row i's positives; key j
    takes part in row i's loss; row i takes part in key j's column (docs/contract.md)."""
    m, n_keys = dots.shape
    rows = torch.arange(m, device=dots.device)
    # own[i, j]: j = p(i). positive[i, j]: j is one of row i's positives (i one of key j's).
    own = torch.zeros(m, n_keys, dtype=torch.bool, device=dots.device)
    own[rows, positives] = True
    same_group = torch.zeros_like(own)
    if query_groups is not None:
        same_group = query_groups[:, None] == key_groups[None, :]
    positive = own if group_positives is None else own | same_group
    # allowed[i, j]: key j takes part in row i's loss; column_allowed[i, j]: row i in key j's column.
    allowed = ~same_group | own if group_positives is None else torch.ones_like(own)
    column_allowed = allowed
    if false_negative_margin is not None:
        if guide_queries is None:
            scores = dots.detach()
        else:
            scores = guide_queries.detach().to(dots.dtype) @ guide_keys.detach().to(dots.dtype).T
        positive_scores = scores[rows, positives]
        if false_negative_strategy == "absolute":
            threshold = positive_scores - false_negative_margin
        else:
            threshold = positive_scores - positive_scores.abs() * false_negative_margin
        # key p(i)'s column threshold is its row's; keys that are nobody's positive keep every row
        key_threshold = torch.full((n_keys,), float("inf"), dtype=dots.dtype, device=dots.device)
        key_threshold[positives] = threshold
        allowed = allowed & (positive | ~(scores > threshold[:, None]))
        column_allowed = column_allowed & (positive | ~(scores > key_threshold[None, :]))
    return positive, allowed, column_allowed


def _positive_part(z, positive, group_positives, own_logit):
    """What each row of ``z`` subtracts: ``own_logit`` (group_positives None), the log-sum-exp of
    its positives' logits ("any") or their mean ("each")."""
    if group_positives is None:
        return own_logit
    if group_positives == "any":
        return torch.logsumexp(z.masked_fill(~positive, float("-inf")), dim=1)
    return torch.where(positive, z, torch.zeros_like(z)).sum(dim=1) / positive.sum(dim=1)


def _hardness_selection(mode, query_ids, key_owners, is_positive):
    """[m, k] True where the hardness offset applies (docs/contract.md, "Hardness offset")."""
    owner = key_owners[None, :]
    same_owner = query_ids[:, None] == owner
    if mode == "in_batch_negatives":
        by_mode = ~same_owner
    elif mode == "hard_negatives":
        by_mode = same_owner
    else:  # all_negatives
        by_mode = torch.ones_like(same_owner)
    return by_mode & (owner >= 0) & ~is_positive
