"""A float64 NumPy oracle of docs/contract.md's "Matryoshka in one call", value and gradients.

It computes the loss in the one-pass form the contract gives for the kernels, not as the package
does (one loss call per re-normalised prefix, autograd through ``F.normalize``): the raw dot
products and squared norms of each segment between consecutive dims, summed into every prefix
that covers it; the cosines x^t = P^t / (|Q_i[:d_t]| |K_j[:d_t]|); each term's gradient in its
cosines, H^t = w_t dL_t/dx^t, from the base oracle (tests/helpers/oracle.py, or
tests/helpers/oracle_objectives.py for several positives and the score filter); and the gradient
of the features segment by segment, each segment taking the H^t of every prefix that covers it
and the norms' chain rule. Only for small shapes (it materialises everything).

The base oracles take features, not logits. Each term's cosines go in as ``queries = I_m`` and
``keys = (x^t)ᵀ``, whose dot products are x^t exactly; the base oracle's gradient of those keys is
then s·Gᵀ = (dL_t/dx^t)ᵀ, and its scale and bias gradients are the term's own.
"""

from __future__ import annotations

import numpy as np

from tests.helpers.oracle import contract_loss
from tests.helpers.oracle_objectives import objective_gradients

# the options only tests/helpers/oracle_objectives.py computes
_OBJECTIVE_OPTIONS = ("group_positives", "false_negative_margin", "guide_queries", "guide_keys")


def _term(cosines, scale, bias, reduction, options):
    """(value, dL/dx, dL/ds, dL/db) of one prefix's loss on its cosines [m, k]."""
    m = cosines.shape[0]
    objective = any(options.get(name) is not None for name in _OBJECTIVE_OPTIONS)
    base = objective_gradients if objective else contract_loss
    value, grads = base(np.eye(m), cosines.T.copy(), scale, bias, reduction=reduction, **options)
    return value, grads["keys"].T, grads["scale"], grads["bias"]


def matryoshka_loss(queries, keys, scale, bias=None, *, dims, weights=None, reduction="mean", **options):
    """Return (loss, {"queries", "keys", "scale", "bias"}) as float64 NumPy: sum_t w_t L_t on the
    re-normalised prefixes of widths ``dims`` (descending); ``reduction="none"``: the weighted sum
    of the per-row losses, and the gradients of its sum. ``options``: the base loss's (``loss``,
    ``symmetric``, ``positives``, groups, hardness, label smoothing, several positives, the score
    filter and its guide, which is not truncated)."""
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    dims = tuple(dims)
    weights = (1.0,) * len(dims) if weights is None else tuple(weights)
    # segment u holds the columns [dims[u + 1], dims[u]); prefix t covers the segments u >= t
    bounds = dims + (0,)
    segments = [slice(bounds[u + 1], bounds[u]) for u in range(len(dims))]

    # The K-loop over the columns from 0: each segment's raw dots and squared norms added to the
    # running sums, which are prefix t's once the loop has passed column d_t - 1.
    dots, query_sq, key_sq = [], [], []
    running = (0.0, 0.0, 0.0)
    for segment in reversed(segments):
        running = (running[0] + q[:, segment] @ k[:, segment].T,
                   running[1] + np.sum(q[:, segment] ** 2, axis=1),
                   running[2] + np.sum(k[:, segment] ** 2, axis=1))
        dots.insert(0, running[0])
        query_sq.insert(0, running[1])
        key_sq.insert(0, running[2])

    value = 0.0
    grad_scale = grad_bias = 0.0
    cosine_grads, query_norms, key_norms, cosines = [], [], [], []
    for dot, q_sq, k_sq, weight in zip(dots, query_sq, key_sq, weights):
        q_norm, k_norm = np.sqrt(q_sq), np.sqrt(k_sq)
        x = dot / np.outer(q_norm, k_norm)
        term, grad_x, term_scale, term_bias = _term(x, scale, bias, reduction, options)
        value = value + weight * np.asarray(term)
        grad_scale += weight * term_scale
        grad_bias += weight * term_bias
        cosine_grads.append(weight * grad_x)  # H^t
        query_norms.append(q_norm)
        key_norms.append(k_norm)
        cosines.append(x)

    # Backward, segment by segment: dL/dP^t = H^t / (|Q_i^t| |K_j^t|), and each norm's share
    # -sum_j H^t_ij x^t_ij / |Q_i^t| along Q_i^t / |Q_i^t| (the keys' alike), summed over the prefixes
    # that cover the segment.
    grad_q, grad_k = np.zeros_like(q), np.zeros_like(k)
    grad_dots = np.zeros((q.shape[0], k.shape[0]))
    query_shrink, key_shrink = np.zeros(q.shape[0]), np.zeros(k.shape[0])
    for u, segment in enumerate(segments):  # prefixes 0..u cover segment u
        h, x, q_norm, k_norm = cosine_grads[u], cosines[u], query_norms[u], key_norms[u]
        grad_dots = grad_dots + h / np.outer(q_norm, k_norm)
        query_shrink = query_shrink + np.sum(h * x, axis=1) / q_norm ** 2
        key_shrink = key_shrink + np.sum(h * x, axis=0) / k_norm ** 2
        grad_q[:, segment] = grad_dots @ k[:, segment] - query_shrink[:, None] * q[:, segment]
        grad_k[:, segment] = grad_dots.T @ q[:, segment] - key_shrink[:, None] * k[:, segment]

    if reduction != "none":
        value = float(value)
    return value, {"queries": grad_q, "keys": grad_k, "scale": float(grad_scale), "bias": float(grad_bias)}
