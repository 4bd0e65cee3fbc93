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
) -> torch.Tensor:
    """Per-row loss l_i [m] of one process's rows against its keys.

    Computes in float64 for float64 inputs and in float32 otherwise; differentiable with
    ordinary autograd. ``label_smoothing`` (softmax, no groups, no hardness offset) as
    ``torch.nn.functional.cross_entropy`` defines it, each term over all of its candidates.
    """
    compute_dtype = torch.float64 if queries.dtype == torch.float64 else torch.float32
    q = queries.to(compute_dtype)
    k = keys.to(compute_dtype)
    m, n_keys = q.shape[0], k.shape[0]
    rows = torch.arange(m, device=q.device)
    if positives is None:
        positives = rows

    dots = q @ k.T
    z = logit_scale.to(compute_dtype) * dots
    if logit_bias is not None:
        z = z + logit_bias.to(compute_dtype)

    # allowed[i, j]: key j takes part in row i's loss (and row i in column j's).
    is_positive = torch.zeros(m, n_keys, dtype=torch.bool, device=q.device)
    is_positive[rows, positives] = True
    if query_groups is None:
        allowed = torch.ones_like(is_positive)
    else:
        same_group = query_groups[:, None] == key_groups[None, :]
        allowed = ~same_group | is_positive

    positive_logit = z[rows, positives]

    if loss == "sigmoid":
        labels = torch.where(is_positive, 1.0, -1.0).to(compute_dtype)
        pair_loss = -F.logsigmoid(labels * z)
        return torch.where(allowed, pair_loss, torch.zeros_like(pair_loss)).sum(dim=1)

    masked = z.masked_fill(~allowed, float("-inf"))
    row_logits = masked
    if hardness_mode is not None:  # the offset of docs/contract.md, a constant: no gradient
        offset = hardness_strength * dots.detach()
        selected = _hardness_selection(hardness_mode, query_ids, key_owners, is_positive)
        row_logits = masked + torch.where(selected, offset, torch.zeros_like(offset))
    row_term = torch.logsumexp(row_logits, dim=1) - positive_logit
    eps = label_smoothing
    if eps:  # the target (1 - eps) on the positive plus eps / N on every one of the N candidates
        row_term = (1 - eps) * row_term + eps * (row_term + positive_logit - z.mean(dim=1))
    if not symmetric:
        return row_term
    column_lse = torch.logsumexp(masked, dim=0)  # over the rows allowed for each key
    column_term = column_lse[positives] - positive_logit
    if eps:
        column_term = (1 - eps) * column_term + eps * (column_lse[positives] - z.mean(dim=0)[positives])
    return (row_term + column_term) / 2


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
