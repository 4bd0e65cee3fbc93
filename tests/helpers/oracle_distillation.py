"""A float64 NumPy oracle of docs/contract.md's "Distillation over the batch", value and gradients.

It shares no code with the package (not even torch autograd). The value is the KL divergence
written from its definition, sum_j p^t (log p^t - log p^s) over the materialised log-softmaxes (not
the contract's rearranged form, which the backends use); the gradients are the contract's closed
form dL/dz_ij, so a wrong backward cannot hide behind the same mistake here. The InfoNCE part of a
mixed loss is tests/helpers/oracle.py's. Only for small shapes (it materialises everything).
``soft_target_stats_direct`` gives the backends' intermediate statistics from given logits, in torch.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.helpers.oracle import contract_loss


def soft_target_stats_direct(z: torch.Tensor, t: torch.Tensor, dim: int):
    """(student log-sum-exp, teacher log-sum-exp, gap) over ``dim`` of the student's logits ``z``
    and the teacher's ``t``, from their definitions: the gap is sum softmax(t) (t - z)."""
    gap = (torch.softmax(t, dim=dim) * (t - z)).sum(dim=dim)
    return torch.logsumexp(z, dim=dim), torch.logsumexp(t, dim=dim), gap


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    peak = np.max(x, axis=axis, keepdims=True)
    shifted = x - peak
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _kl_rows(teacher_logits: np.ndarray, student_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(t_i.) || softmax(z_i.)) of every row, and the gradient of each in z: p^s - p^t."""
    log_teacher = _log_softmax(teacher_logits, axis=1)
    log_student = _log_softmax(student_logits, axis=1)
    teacher = np.exp(log_teacher)
    return np.sum(teacher * (log_teacher - log_student), axis=1), np.exp(log_student) - teacher


def distillation_loss(queries, keys, teacher_queries, teacher_keys, scale, teacher_scale, *, symmetric=True,
                      positives=None, distillation_weight=1.0, reduction="mean"):
    """Return (loss, {"queries", "keys", "scale"}) as float64 NumPy: the loss of one process
    (``reduction="none"``: the per-row losses, and the gradients of their sum)."""
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    m, n_keys = q.shape[0], k.shape[0]
    p = np.arange(m) if positives is None else np.asarray(positives)
    x = q @ k.T
    z = scale * x
    t = teacher_scale * (np.asarray(teacher_queries, dtype=np.float64)
                         @ np.asarray(teacher_keys, dtype=np.float64).T)
    weight = np.full(m, 1.0 / m) if reduction == "mean" else np.ones(m)
    lam = distillation_weight

    row_kl, row_grad = _kl_rows(t, z)  # row_grad[i, j] = dKL->_i / dz_ij
    half = 0.5 if symmetric else 1.0
    grad_z = half * lam * weight[:, None] * row_grad
    per_row_kl = row_kl
    if symmetric:
        column_kl, column_grad = _kl_rows(t.T, z.T)  # [k], [k, m]: column j over the rows
        per_row_kl = (row_kl + column_kl[p]) / 2
        column_weight = np.zeros(n_keys)
        np.add.at(column_weight, p, weight)  # v_j: a key may be the positive of several rows
        grad_z += half * lam * column_weight[None, :] * column_grad.T

    per_row = lam * per_row_kl
    grads = {
        "queries": scale * grad_z @ k,
        "keys": scale * grad_z.T @ q,
        "scale": float(np.sum(grad_z * x)),
    }
    if lam < 1.0:  # the softmax loss of tests/helpers/oracle.py, its value per row and its gradients
        options = dict(symmetric=symmetric, positives=positives)
        nce, _ = contract_loss(q, k, scale, reduction="none", **options)
        _, nce_grads = contract_loss(q, k, scale, reduction=reduction, **options)
        per_row = per_row + (1.0 - lam) * nce
        grads = {name: grad + (1.0 - lam) * nce_grads[name] for name, grad in grads.items()}
    value = per_row if reduction == "none" else float(np.sum(per_row * weight))
    return value, grads
