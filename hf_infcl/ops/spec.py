"""The shared vocabulary of every backend: which statistics of the logits a block computes,
how a block's masking is described, and how partial statistics of two key blocks merge.

The loss is split so that no backend ever needs to know where a row's positive is, except to
exempt it from group masking:

    z_ij = s * <Q_i, K_j> + b
    softmax:  row_stat_i = LSE_{j allowed for i} z_ij      col_stat_j = LSE_{i allowed for j} z_ij
    sigmoid:  row_stat_i = sum_{j allowed for i} softplus(z_ij)

and the per-row loss is assembled from these and the positive logit z_{i,p(i)} with ordinary
autograd ops (``hf_infcl.loss``). A backend's backward receives the gradients of row_stat and
col_stat (``row_weight``, ``col_weight``) and forms, tile by tile,

    softmax:  G_ij = row_weight_i * exp(z_ij - row_stat_i) + col_weight_j * exp(z_ij - col_stat_j)
    sigmoid:  G_ij = row_weight_i * sigmoid(z_ij)

(zero where masked), from which dQ = s * G K, dK = s * G^T Q, d(scale) = sum G * x and
d(bias) = sum G. A "block op" is an object with ``forward_block`` and ``backward_block`` methods
following :class:`BlockOps`; the one Function of :mod:`hf_infcl.ops.key_blocks` drives them,
locally and in the ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .options import LossKind, Precision


@dataclass(frozen=True)
class StatsSpec:
    """Which statistics to compute.

    Attributes:
        loss: ``"softmax"`` (row, and optionally column, log-sum-exp) or ``"sigmoid"``
            (row sum of softplus).
        columns: softmax only; also compute the column log-sum-exp (the symmetric loss needs it).
        precision: how fp32 inputs are multiplied: ``"tf32"`` (TF32 tensor cores) or ``"ieee"``
            (exact fp32); ``"auto"`` follows :func:`resolve_precision`. Ignored for
            half-precision and float64 inputs.
        gradients_in_forward: sigmoid only; the caller promises that every row's statistic
            gets the same gradient (a mean or sum over the rows), so the forward can compute
            the gradients too, with every row weight 1, in the same pass as the statistic
            (:meth:`BlockOps.forward_backward_block`), and the backward only scales them:
            three GEMM passes instead of four. The sigmoid loss's G needs no statistic, so
            nothing has to be known before the pass.
    """

    loss: LossKind
    columns: bool
    precision: Precision = "auto"
    gradients_in_forward: bool = False

    def __post_init__(self):
        if self.loss == "sigmoid" and self.columns:
            raise ValueError("the sigmoid loss has no column statistics")
        if self.gradients_in_forward and self.loss != "sigmoid":
            raise ValueError("gradients_in_forward needs the sigmoid loss (the softmax loss's G needs "
                             "its statistics first)")


@dataclass(frozen=True)
class GroupMask:
    """False-negative masking for one (row block, key block) pair.

    Key j is masked for row i when ``query_groups[i] == key_groups[j]`` and key j is not row i's
    positive. Key indices are global: key ``j`` of this block has index ``key_offset + j``, and
    ``positive_keys[i]`` is the global index of row i's positive.
    """

    query_groups: torch.Tensor  # [m] int64
    key_groups: torch.Tensor  # [k_block] int64
    positive_keys: torch.Tensor  # [m] int64, global key indices
    key_offset: int = 0

    def with_keys(self, key_groups: torch.Tensor, key_offset: int) -> GroupMask:
        """The same rows against another key block (used by the ring)."""
        return GroupMask(self.query_groups, key_groups, self.positive_keys, key_offset)

    def allowed(self, row_start: int, row_end: int, key_start: int, key_end: int) -> torch.Tensor:
        """Boolean [rows, keys] tile: True where the key counts for the row."""
        qg = self.query_groups[row_start:row_end, None]
        kg = self.key_groups[None, key_start:key_end]
        key_index = torch.arange(
            self.key_offset + key_start, self.key_offset + key_end, device=kg.device
        )
        is_positive = self.positive_keys[row_start:row_end, None] == key_index[None, :]
        return (qg != kg) | is_positive


def resolve_precision(precision: str, dtype: torch.dtype, device: torch.device) -> Precision:
    """The one rule for how fp32 inputs are multiplied: ``"tf32"`` or ``"ieee"``.

    ``"auto"`` means TF32 where TF32 exists, i.e. fp32 inputs on a CUDA device, in every backend
    (whatever ``torch.backends.cuda.matmul.allow_tf32`` says), and exact fp32 elsewhere. An
    explicit ``"tf32"`` or ``"ieee"`` is kept as given. Half-precision inputs always run on
    tensor cores with fp32 accumulation; float64 inputs are always exact.
    """
    if precision != "auto":
        return precision
    return "tf32" if dtype == torch.float32 and torch.device(device).type == "cuda" else "ieee"


def check_values(scale: torch.Tensor, positives: torch.Tensor, n_keys: int) -> None:
    """The argument checks that read values (one host synchronisation): ``logit_scale`` > 0 and
    every positive index inside ``[0, n_keys)``."""
    if bool(scale.detach() <= 0):
        raise ValueError(f"logit_scale must be > 0 (it multiplies the logits), got {float(scale)}")
    if positives.numel() and (n_keys == 0 or int(positives.min()) < 0 or int(positives.max()) >= n_keys):
        raise ValueError(f"positives must index keys, i.e. lie in [0, {n_keys}); got values outside")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and gradient accumulators: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_row_stats(spec: StatsSpec, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine the statistics of two disjoint key blocks (log-sum-exp, or plain sum)."""
    return torch.logaddexp(a, b) if spec.loss == "softmax" else a + b


def empty_row_stats(spec: StatsSpec, m: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The statistic of no keys at all: -inf for a log-sum-exp, 0 for a sum."""
    fill = float("-inf") if spec.loss == "softmax" else 0.0
    return torch.full((m,), fill, dtype=dtype, device=device)


class BlockOps(Protocol):
    """What a backend provides: statistics of one query block against one key block."""

    def forward_block(
        self,
        spec: StatsSpec,
        queries: torch.Tensor,
        keys: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        mask: GroupMask | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (row_stat [m], col_stat [k] or None) in the accumulation dtype."""

    def backward_block(
        self,
        spec: StatsSpec,
        queries: torch.Tensor,
        keys: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        mask: GroupMask | None,
        row_stat: torch.Tensor,
        col_stat: torch.Tensor | None,
        row_weight: torch.Tensor,
        col_weight: torch.Tensor | None,
        grad_queries: torch.Tensor,
        grad_keys: torch.Tensor,
    ) -> torch.Tensor:
        """Add G K to ``grad_queries`` [m, c] and G^T Q to ``grad_keys`` [k, c] (both unscaled,
        accumulation dtype, in place) and return the row sums of G [m].

        ``row_stat`` and ``col_stat`` are the complete statistics (over every key and every row
        of the whole problem), not this block's partial ones.
        """


class OnePassSigmoidOps(BlockOps, Protocol):
    """Block ops that can also take the sigmoid loss's one-pass route
    (``StatsSpec.gradients_in_forward``); optional for a backend."""

    def forward_backward_block(
        self,
        spec: StatsSpec,
        queries: torch.Tensor,
        keys: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        mask: GroupMask | None,
        grad_queries: torch.Tensor,
        grad_keys: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sigmoid row statistic [m] of this block and, from the same logits, G K added to
        ``grad_queries`` and G^T Q to ``grad_keys`` for G_ij = sigmoid(z_ij) (every row weight
        1; zero where masked), as ``backward_block`` adds them. Returns (row_stat, row sums of G)."""


def takes_one_pass(ops) -> bool:
    """Whether a block-ops object offers the sigmoid loss's one-pass route."""
    return callable(getattr(ops, "forward_backward_block", None))
