"""A float64 NumPy implementation of docs/contract.md, value and gradients.

It shares no code with the package (not even torch autograd): the gradients are the contract's
closed form dL/dz_ij, so a wrong backward in any backend cannot hide behind the same mistake here.
Only for small shapes (it materialises everything).
"""

from __future__ import annotations

import numpy as np


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    peak = np.max(x, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(peak, axis) + np.log(np.sum(np.exp(x - peak), axis=axis))


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(_log_sigmoid(x))


def contract_loss(
    queries,
    keys,
    scale,
    bias=None,
    *,
    loss="softmax",
    symmetric=True,
    positives=None,
    query_groups=None,
    key_groups=None,
    reduction="mean",
    hardness_mode=None,
    hardness_strength=0.0,
    query_ids=None,
    key_owners=None,
    label_smoothing=0.0,
):
    """Return (loss, dict of gradients 'queries', 'keys', 'scale', 'bias') as float64 NumPy.

    ``label_smoothing`` (softmax, no groups): each cross-entropy term's target is ``1 - eps`` on
    the positive plus ``eps / N`` on each of its N candidates (all keys for the row term, all rows
    for the column term)."""
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    m, n_keys = q.shape[0], k.shape[0]
    p = np.arange(m) if positives is None else np.asarray(positives)
    x = q @ k.T
    z = scale * x + (0.0 if bias is None else bias)

    positive = np.zeros((m, n_keys), dtype=bool)
    positive[np.arange(m), p] = True
    allowed = np.ones((m, n_keys), dtype=bool)
    if query_groups is not None:
        same = np.asarray(query_groups)[:, None] == np.asarray(key_groups)[None, :]
        allowed = ~same | positive

    # The row term's logits: the hardness offset, a constant (no gradient flows through it).
    z_row = z + hardness_strength * hardness_selection(hardness_mode, query_ids, key_owners, positive) * x

    # weight of each row's loss in the reduced loss
    if reduction == "mean":
        weight = np.full(m, 1.0 / m)
    else:
        weight = np.ones(m)

    z_pos = z[np.arange(m), p]
    if loss == "sigmoid":
        y = np.where(positive, 1.0, -1.0)
        per_row = np.where(allowed, -_log_sigmoid(y * z), 0.0).sum(axis=1)
        grad_z = np.where(allowed, -y * _sigmoid(-y * z), 0.0) * weight[:, None]
    else:
        masked = np.where(allowed, z, -np.inf)
        masked_row = np.where(allowed, z_row, -np.inf)
        row_lse = _logsumexp(masked_row, axis=1)
        col_lse = _logsumexp(masked, axis=0)
        row_term = row_lse - z_pos
        half = 0.5 if symmetric else 1.0
        prob_row = np.where(allowed, np.exp(masked_row - row_lse[:, None]), 0.0)
        # dL/dz = w(P+ + [j positive key] P-) - w(1 + [symmetric]) [j = p(i)], w = half * weight
        eps = label_smoothing
        # smoothed targets: (1 - eps) on the positive, eps / N on each of the N candidates
        grad_z = half * weight[:, None] * (prob_row - eps / n_keys)
        grad_z[np.arange(m), p] -= half * weight * (1.0 - eps) * (2.0 if symmetric else 1.0)
        row_term = row_term + eps * (z_pos - z.mean(axis=1))
        if symmetric:
            column_weight = np.zeros(n_keys)
            np.add.at(column_weight, p, half * weight)  # a key may be the positive of several rows
            with np.errstate(invalid="ignore"):
                prob_col = np.where(allowed, np.exp(masked - col_lse[None, :]), 0.0)
            grad_z += column_weight[None, :] * (prob_col - eps / m)
            column_term = col_lse[p] - z_pos + eps * (z_pos - z.mean(axis=0)[p])
            per_row = (row_term + column_term) / 2
        else:
            per_row = row_term

    if reduction == "none":
        value = per_row
    else:
        value = float(np.sum(per_row * weight))
    grads = {
        "queries": scale * grad_z @ k,
        "keys": scale * grad_z.T @ q,
        "scale": float(np.sum(grad_z * x)),
        "bias": float(np.sum(grad_z)),
    }
    return value, grads


def hardness_selection(mode, query_ids, key_owners, positive):
    """h_ij of docs/contract.md ("Hardness offset"): 1.0 where the offset applies."""
    if mode is None:
        return np.zeros(positive.shape)
    owner = np.asarray(key_owners)[None, :]
    owned = owner == np.asarray(query_ids)[:, None]
    selected = {"in_batch_negatives": ~owned, "hard_negatives": owned,
                "all_negatives": np.ones_like(owned)}[mode]
    return (selected & (owner >= 0) & ~positive).astype(np.float64)


# --------------------------------------------------------------------------------------------
# sentence-transformers' directions and partition modes (docs/contract.md, "Directions and
# partition modes"), from their definition: each row's candidate logits are listed pair by pair.


DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _direction_candidates(direction, i, batch, owners):
    """The (row vector, key vector) pairs of one direction for example ``i``: vectors are named
    ("query", index) or ("doc", index into the concatenated document columns)."""
    docs = range(len(owners))
    if direction == "query_to_doc":
        return [(("query", i), ("doc", j)) for j in docs]
    if direction == "query_to_query":
        return [(("query", i), ("query", j)) for j in range(batch) if j != i]
    if direction == "doc_to_query":
        return [(("doc", i), ("query", j)) for j in range(batch)]
    if direction == "doc_to_doc":
        return [(("doc", i), ("doc", j)) for j in docs if owners[j] != i]
    raise ValueError(direction)


def directions_loss(queries, doc_columns, scale, directions, partition_mode, hardness_mode=None,
                    hardness_strength=0.0):
    """MNRL's loss over dot products (normalise first for cosine), with its gradients.

    ``queries`` [b, c]; ``doc_columns`` the positives [b, c] then each negatives column. Row ``i``'s
    positive logit is ``scale * <q_i, d_i>``; its loss is ``LSE(all selected candidates) - positive``
    (``"joint"``) or the mean over the directions of ``LSE(that direction) - positive``
    (``"per_direction"``); the loss is the mean over rows. Returns (loss, {"queries": [b, c],
    "docs": [b * columns, c]}) as float64 NumPy, the gradients in closed form: each candidate
    logit gets its softmax weight, the positive logit minus one, per row.

    ``hardness_mode``: MNRL's hardness weighting adds ``hardness_strength * <q_i, D_j>`` (unscaled,
    no gradient) to the ``query_to_doc`` candidates it selects by the documents' owners.
    """
    vectors = {
        "query": np.asarray(queries, dtype=np.float64),
        "doc": np.concatenate([np.asarray(column, dtype=np.float64) for column in doc_columns]),
    }
    batch = len(vectors["query"])
    owners = np.tile(np.arange(batch), len(doc_columns))  # the example each document belongs to
    grads = {name: np.zeros_like(value) for name, value in vectors.items()}

    def logit(pair):
        (row_kind, row), (key_kind, key) = pair
        return scale * vectors[row_kind][row] @ vectors[key_kind][key]

    def hardness_offset(pair):
        (row_kind, row), (key_kind, key) = pair
        if hardness_mode is None or (row_kind, key_kind) != ("query", "doc") or key == row:
            return 0.0  # only query_to_doc negatives (document ``row`` is the positive)
        selected = {"in_batch_negatives": owners[key] != row, "hard_negatives": owners[key] == row,
                    "all_negatives": True}[hardness_mode]
        return hardness_strength * vectors["query"][row] @ vectors["doc"][key] if selected else 0.0

    def add_gradient(pair, weight):
        (row_kind, row), (key_kind, key) = pair
        grads[row_kind][row] += weight * scale * vectors[key_kind][key]
        grads[key_kind][key] += weight * scale * vectors[row_kind][row]

    total = 0.0
    for i in range(batch):
        candidates = [_direction_candidates(direction, i, batch, owners)
                      for direction in DIRECTIONS if direction in directions]
        partitions = [sum(candidates, [])] if partition_mode == "joint" else candidates
        positive = (("query", i), ("doc", i))
        for pairs in partitions:
            logits = np.array([logit(pair) + hardness_offset(pair) for pair in pairs])
            lse = _logsumexp(logits, axis=0)
            share = 1.0 / (batch * len(partitions))  # this partition's weight in the mean loss
            total += share * lse
            for pair, value in zip(pairs, logits):
                add_gradient(pair, share * np.exp(value - lse))
        total -= logit(positive) / batch
        add_gradient(positive, -1.0 / batch)
    return total, {"queries": grads["query"], "docs": grads["doc"]}


def central_differences(value, case: dict, name: str, step: float = 1e-6):
    """The numerical gradient of ``value(**{name: ...})`` (a float) at ``case[name]``, a tensor or a
    scalar, by central differences of ``step``: what an oracle's analytic gradient is checked against."""
    import torch

    point = case[name]
    if not torch.is_tensor(point):
        return (value(**{name: point + step}) - value(**{name: point - step})) / (2 * step)
    numeric = np.zeros(tuple(point.shape))
    for index in np.ndindex(numeric.shape):
        bump = torch.zeros_like(point)
        bump[index] = step
        numeric[index] = (value(**{name: point + bump}) - value(**{name: point - bump})) / (2 * step)
    return numeric
