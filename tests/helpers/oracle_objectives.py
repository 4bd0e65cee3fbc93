"""A float64 oracle for docs/contract.md's "Several positives per row", "False negatives by score"
and "GIST (sentence-transformers)": the loss written from its definition over the materialised
logits z and boolean masks.

Torch float64 with autograd: the value is the contract's formula, the gradients are autograd's of
it (the masks are constants, as the contract says). It never imports hf_infcl. The closed-form
dL/dz the contract states for these objectives is checked against these gradients in
tests/test_oracle_objectives.py. Only for small shapes (it materialises everything).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tests.helpers.oracle import hardness_selection

GROUP_POSITIVES = (None, "any", "each")
STRATEGIES = ("absolute", "relative")


def as_float64(value) -> torch.Tensor:
    """A float64 tensor of ``value``, keeping its autograd graph when it is one already."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64)
    return torch.as_tensor(np.asarray(value, dtype=np.float64))


def as_index(value) -> torch.Tensor:
    return torch.as_tensor(np.asarray(value), dtype=torch.long)


def thresholds(positive_scores: torch.Tensor, margin: float, strategy: str) -> torch.Tensor:
    """τ_i: a candidate of row i scoring strictly above it is left out."""
    if strategy == "absolute":
        return positive_scores - margin
    if strategy == "relative":
        return positive_scores - positive_scores.abs() * margin
    raise ValueError(f"false_negative_strategy must be one of {STRATEGIES}; got {strategy!r}")


@dataclass
class Masks:
    """The boolean masks of one call.

    Row side, [m, k]: ``positive[i, j]`` is j ∈ P(i), ``allowed[i, j]`` is "key j counts in row i".
    Column side, [m, m], for row i's column term (at key p(i)): ``column_positive[i, i2]`` is
    i2 ∈ R(p(i)), ``column_allowed[i, i2]`` is "row i2 counts in that column".
    ``thresholds`` [m]: τ_i, or None without a margin.
    """

    positive: torch.Tensor
    allowed: torch.Tensor
    column_positive: torch.Tensor
    column_allowed: torch.Tensor
    thresholds: torch.Tensor | None


def objective_masks(scores, positives, query_groups=None, key_groups=None, group_positives=None,
                    margin=None, strategy="absolute") -> Masks:
    """The masks from the filter's scores g [m, k] (guide or detached dot products), as the contract
    defines them."""
    if group_positives not in GROUP_POSITIVES:
        raise ValueError(f"group_positives must be one of {GROUP_POSITIVES}; got {group_positives!r}")
    if group_positives is not None and query_groups is None:
        raise ValueError("group_positives needs query_groups and key_groups")
    m, k = scores.shape
    rows = torch.arange(m)
    own = torch.zeros(m, k, dtype=torch.bool)
    own[rows, positives] = True  # j = p(i)
    if query_groups is None:
        same_group = torch.zeros(m, k, dtype=torch.bool)
    else:
        same_group = as_index(query_groups)[:, None] == as_index(key_groups)[None, :]
    if group_positives is None:
        positive = own
        left_out = same_group & ~own  # today's rule: the row's group is neither positive nor negative
    else:
        positive = own | same_group
        left_out = torch.zeros(m, k, dtype=torch.bool)
    # row i's column term runs down key p(i): entry [i, i2] is (row i2, key p(i))
    column_positive = positive[:, positives].T
    column_left_out = left_out[:, positives].T
    tau = None
    if margin is not None:
        tau = thresholds(scores[rows, positives], margin, strategy)
        left_out = left_out | ((scores > tau[:, None]) & ~positive)
        column_scores = scores[:, positives].T
        column_left_out = column_left_out | ((column_scores > tau[:, None]) & ~column_positive)
    return Masks(positive, ~left_out, column_positive, ~column_left_out, tau)


def masked_logsumexp(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """LSE over the entries of each row where ``mask`` holds (-inf for none)."""
    return torch.logsumexp(torch.where(mask, values, -torch.inf), dim=1)


def positive_term(values: torch.Tensor, positive: torch.Tensor, own: torch.Tensor,
                  group_positives) -> torch.Tensor:
    """What each row's term subtracts: its own positive's logit (None), the LSE over its positives
    ("any") or their mean ("each")."""
    if group_positives is None:
        return values[own]
    if group_positives == "any":
        return masked_logsumexp(values, positive)
    return torch.where(positive, values, 0.0).sum(dim=1) / positive.sum(dim=1)


def objective_loss(queries, keys, scale, bias=None, *, loss="softmax", symmetric=True, positives=None,
                   query_groups=None, key_groups=None, group_positives=None, false_negative_margin=None,
                   false_negative_strategy="absolute", guide_queries=None, guide_keys=None,
                   hardness_mode=None, hardness_strength=0.0, query_ids=None, key_owners=None,
                   reduction="mean") -> torch.Tensor:
    """The contract's loss with several positives per row and the score filter (float64 tensor with
    its autograd graph; [m] for ``reduction="none"``)."""
    q, k = as_float64(queries), as_float64(keys)
    m = q.shape[0]
    rows = torch.arange(m)
    p = rows if positives is None else as_index(positives)
    x = q @ k.T
    z = as_float64(scale) * x + (0.0 if bias is None else as_float64(bias))
    if (guide_queries is None) != (guide_keys is None):
        raise ValueError("guide_queries and guide_keys go together")
    if guide_queries is None:
        scores = x.detach()
    else:
        scores = as_float64(guide_queries).detach() @ as_float64(guide_keys).detach().T
    masks = objective_masks(scores, p, query_groups, key_groups, group_positives, false_negative_margin,
                            false_negative_strategy)
    own = torch.zeros_like(masks.positive)
    own[rows, p] = True

    if loss == "sigmoid":
        pair_loss = torch.where(masks.positive, F.softplus(-z), F.softplus(z))
        per_row = torch.where(masks.allowed, pair_loss, 0.0).sum(dim=1)
    elif loss == "softmax":
        offset = hardness_selection(hardness_mode, query_ids, key_owners, masks.positive.numpy())
        z_row = z + hardness_strength * torch.as_tensor(offset) * x.detach()
        per_row = (masked_logsumexp(z_row, masks.allowed)
                   - positive_term(z, masks.positive, own, group_positives))
        if symmetric:
            z_column = z[:, p].T  # [i, i2] = z_{i2, p(i)}
            column_own = torch.zeros_like(masks.column_positive)
            column_own[rows, rows] = True  # row i's own pair in its column
            column_term = (masked_logsumexp(z_column, masks.column_allowed)
                           - positive_term(z_column, masks.column_positive, column_own, group_positives))
            per_row = (per_row + column_term) / 2
    else:
        raise ValueError(f"loss must be 'softmax' or 'sigmoid'; got {loss!r}")

    if reduction == "none":
        return per_row
    if reduction == "sum":
        return per_row.sum()
    return per_row.mean()


def objective_gradients(queries, keys, scale, bias=None, **options):
    """(loss, {"queries", "keys", "scale", "bias"}) as float64 NumPy, as tests/helpers/oracle.py's
    ``contract_loss`` returns them; for ``reduction="none"`` the gradients are those of the sum."""
    q = as_float64(queries).detach().clone().requires_grad_(True)
    k = as_float64(keys).detach().clone().requires_grad_(True)
    s = as_float64(scale).detach().clone().requires_grad_(True)
    # without a bias, "bias" is the gradient of a zero bias (as tests/helpers/oracle.py's)
    b = as_float64(0.0 if bias is None else bias).detach().clone().requires_grad_(True)
    value = objective_loss(q, k, s, b, **options)
    value.sum().backward()
    grads = {"queries": q.grad.numpy(), "keys": k.grad.numpy(), "scale": float(s.grad), "bias": float(b.grad)}
    value = value.detach()
    loss = value.numpy() if value.dim() else float(value)
    return loss, grads


# --------------------------------------------------------------------------------------------
# sentence-transformers' GISTEmbedLoss / CachedGISTEmbedLoss as calls of the contract
# (docs/contract.md, "GIST (sentence-transformers)").


def gist_blocks(anchor, positive, negatives, contrast_anchors, contrast_positives):
    """(rows, shared keys, anchor keys) of the contract's mapping, from normalised embeddings.

    Rows R_i = [a_i, p_i] (just a_i without contrast_positives, and then no padding); the shared
    keys are the blocks every process sees, [p_j, 0], [0, p_j] (contrast_positives) and [n_j, 0]
    for each negatives column, row i's positive being shared key i; the anchor keys [a_j, 0]
    (contrast_anchors; else none) are the block each process sees of its own anchors only.
    """
    width = anchor.shape[1]

    def left(block):
        return F.pad(block, (0, width)) if contrast_positives else block

    rows = torch.cat([anchor, positive], dim=1) if contrast_positives else anchor
    shared = [left(positive)]
    if contrast_positives:
        shared.append(F.pad(positive, (width, 0)))
    shared += [left(negative) for negative in negatives]
    anchors = left(anchor) if contrast_anchors else rows.new_zeros(0, rows.shape[1])
    return rows, torch.cat(shared), anchors


def gist_loss(anchor, positive, negatives, guide_anchor, guide_positive, guide_negatives, *, temperature,
              margin, margin_strategy="absolute", contrast_anchors=True, contrast_positives=True,
              world_size=1, gathered_as="two_statistics"):
    """GIST's loss by the contract's mapping (float64, autograd graph to the raw embeddings).

    The embeddings are every process's examples in rank order, ``world_size`` processes of equal
    size; the value is the sum over processes of what each returns (its rows' mean), whose gradient
    is what ``gather_across_devices=True`` gives each process. ``gathered_as``: "two_statistics"
    (row i's statistic is the logaddexp of the shared blocks' LSE and its process's anchor block's)
    or "one_call" (every anchor in one call, other processes' anchors left out by guide coordinates
    that mark the process). With one process both are the plain single call.
    """
    def normalised(tensors):
        return [F.normalize(as_float64(t), dim=-1) for t in tensors]

    anchor, positive, *negatives = normalised([anchor, positive, *negatives])
    with torch.no_grad():
        guide_anchor, guide_positive, *guide_negatives = normalised([guide_anchor, guide_positive,
                                                                     *guide_negatives])
    rows, shared, anchors = gist_blocks(anchor, positive, negatives, contrast_anchors, contrast_positives)
    guide_rows, guide_shared, guide_anchors = gist_blocks(guide_anchor, guide_positive, guide_negatives,
                                                          contrast_anchors, contrast_positives)
    options = dict(loss="softmax", symmetric=False, false_negative_margin=margin,
                   false_negative_strategy=margin_strategy)
    total = rows.shape[0]
    if world_size == 1:
        return objective_loss(rows, torch.cat([shared, anchors]), 1.0 / temperature,
                              guide_queries=guide_rows, guide_keys=torch.cat([guide_shared, guide_anchors]),
                              **options)
    per_process = total // world_size
    process = torch.arange(total) // per_process  # of each example (row, anchor key)
    if gathered_as == "one_call":
        marks = F.one_hot(process, world_size).to(torch.float64)
        far = 3.0 + 2.0 * abs(margin)  # above any threshold: cosines are at most 1
        guide_rows = torch.cat([guide_rows, marks], dim=1)
        guide_shared = F.pad(guide_shared, (0, world_size))
        guide_anchors = torch.cat([guide_anchors, far * (1.0 - marks[:len(guide_anchors)])], dim=1)
        guide_keys = torch.cat([guide_shared, guide_anchors])
        per_row = objective_loss(rows, torch.cat([shared, anchors]), 1.0 / temperature,
                                 guide_queries=guide_rows, guide_keys=guide_keys, reduction="none", **options)
        return per_row.sum() / per_process
    if gathered_as != "two_statistics":
        raise ValueError(gathered_as)
    # The shared blocks, every process's: the contract over all rows and shared keys (the ring).
    scale = 1.0 / temperature
    z_shared = scale * rows @ shared.T
    masks = objective_masks(guide_rows @ guide_shared.T, torch.arange(total), margin=margin,
                            strategy=margin_strategy)
    shared_statistic = masked_logsumexp(z_shared, masks.allowed)
    # The anchor block, each process's own: same thresholds, keys of the row's process only.
    z_anchors = scale * rows @ anchors.T
    same_process = process[:, None] == process[None, :len(anchors)]
    kept = same_process & ~(guide_rows @ guide_anchors.T > masks.thresholds[:, None])
    anchor_statistic = masked_logsumexp(z_anchors, kept)
    positive_logits = z_shared.diagonal()  # row i's positive is shared key i
    per_row = torch.logaddexp(shared_statistic, anchor_statistic) - positive_logits
    return per_row.sum() / per_process
