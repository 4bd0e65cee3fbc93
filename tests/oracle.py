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
):
    """Return (loss, dict of gradients 'queries', 'keys', 'scale', 'bias') as float64 NumPy."""
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
        row_lse = _logsumexp(masked, axis=1)
        col_lse = _logsumexp(masked, axis=0)
        row_term = row_lse - z_pos
        half = 0.5 if symmetric else 1.0
        prob_row = np.where(allowed, np.exp(masked - row_lse[:, None]), 0.0)
        # dL/dz = w(P+ + [j positive key] P-) - w(1 + [symmetric]) [j = p(i)], w = half * weight
        grad_z = half * weight[:, None] * prob_row
        grad_z[np.arange(m), p] -= half * weight * (2.0 if symmetric else 1.0)
        if symmetric:
            column_weight = np.zeros(n_keys)
            np.add.at(column_weight, p, half * weight)  # a key may be the positive of several rows
            with np.errstate(invalid="ignore"):
                prob_col = np.where(allowed, np.exp(masked - col_lse[None, :]), 0.0)
            grad_z += column_weight[None, :] * prob_col
            per_row = (row_term + (col_lse[p] - z_pos)) / 2
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
