"""The shared vocabulary of every backend: which statistics of the logits a block computes,
how a block's masking is described, and how partial statistics of two key blocks merge.

The loss is split so that no backend ever needs to know where a row's positive is, except to
exempt it from group masking:

    z_ij = s * <Q_i, K_j> + b
    softmax:  row_stat_i = LSE_{j allowed for i} z_ij      col_stat_j = LSE_{i allowed for j} z_ij
    sigmoid:  row_stat_i = sum_{j allowed for i} softplus(z_ij)

and the per-row loss is assembled from these and the positive logit z_{i,p(i)} with ordinary
autograd ops (``hf_infcl.loss``). With a hardness offset (:class:`HardnessOffset`) the softmax
row_stat is over z_ij + alpha * x_ij where the offset selects (the column statistic and the
positive logit are not offset), and the row probabilities below are of those logits.

A backend's backward receives the gradients of row_stat and
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
from typing import NamedTuple, Protocol

import torch

from .options import HARDNESS_MODES, HardnessMode, LossKind, Precision


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
        hardness, hardness_strength: softmax only; the row statistic is taken over the offset
            logits z + strength * x where :class:`HardnessOffset` selects (docs/contract.md,
            "Hardness offset"); the column statistic keeps the plain logits. None (or strength
            0): no offset.
    """

    loss: LossKind
    columns: bool
    precision: Precision = "auto"
    gradients_in_forward: bool = False
    hardness: HardnessMode | None = None
    hardness_strength: float = 0.0

    def __post_init__(self):
        if self.loss == "sigmoid" and self.columns:
            raise ValueError("the sigmoid loss has no column statistics")
        if self.gradients_in_forward and self.loss != "sigmoid":
            raise ValueError("gradients_in_forward needs the sigmoid loss (the softmax loss's G needs "
                             "its statistics first)")
        if self.hardness is not None and (self.loss != "softmax" or self.hardness not in HARDNESS_MODES):
            raise ValueError(f"hardness {self.hardness!r} needs the softmax loss and one of {HARDNESS_MODES}")

    @property
    def offsets(self) -> bool:
        """Whether the row statistic is taken over hardness-offset logits."""
        return self.hardness is not None and self.hardness_strength != 0.0


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


@dataclass(frozen=True)
class HardnessOffset:
    """The hardness offset of one (row block, key block) pair (docs/contract.md, "Hardness
    offset"): row i's row-statistic logit of key j is z_ij + strength * x_ij where
    :meth:`selected` is True; the column statistic and the gradient's flow (through s * x only)
    are unchanged.

    Key indices are global, as in :class:`GroupMask`; a negative owner is nobody's.
    """

    mode: HardnessMode
    strength: float
    query_ids: torch.Tensor  # [m] int64
    key_owners: torch.Tensor  # [k_block] int64, negative: never offset
    positive_keys: torch.Tensor  # [m] int64, global key indices
    key_offset: int = 0

    @property
    def mode_code(self) -> int:
        """1, 2, 3 for the modes in :data:`HARDNESS_MODES` order (0 is "no offset" in kernels)."""
        return HARDNESS_MODES.index(self.mode) + 1

    def selected(self, row_start: int, row_end: int, key_start: int, key_end: int) -> torch.Tensor:
        """Boolean [rows, keys] tile: True where the logit gets the offset."""
        owner = self.key_owners[None, key_start:key_end]
        key_index = torch.arange(self.key_offset + key_start, self.key_offset + key_end, device=owner.device)
        is_positive = self.positive_keys[row_start:row_end, None] == key_index[None, :]
        selected = (owner >= 0) & ~is_positive
        if self.mode == "all_negatives":
            return selected
        same_owner = self.query_ids[row_start:row_end, None] == owner
        return selected & (same_owner if self.mode == "hard_negatives" else ~same_owner)

    def offset_logits(self, logits: torch.Tensor, dots: torch.Tensor, row_start: int, row_end: int,
                      key_start: int, key_end: int) -> torch.Tensor:
        """The row statistic's logits of one tile: ``logits`` plus the offset where selected."""
        selected = self.selected(row_start, row_end, key_start, key_end)
        return logits + torch.where(selected, self.strength * dots, torch.zeros_like(dots))


class PairLabels(NamedTuple):
    """The per-row and per-key tensors that say which (row, key) pairs are masked
    (:class:`GroupMask`) or offset (:class:`HardnessOffset`): this process's rows and its own
    keys, None where not given. A schedule hands them to every key block, the key tensors
    travelling with their keys."""

    query_groups: torch.Tensor | None = None  # [m]
    key_groups: torch.Tensor | None = None  # [k]
    query_ids: torch.Tensor | None = None  # [m]
    key_owners: torch.Tensor | None = None  # [k]
    positive_keys: torch.Tensor | None = None  # [m] global key indices, when either is given

    def mask(self, key_groups: torch.Tensor | None, key_offset: int) -> GroupMask | None:
        """The group mask of these rows against a key block (its groups and global offset)."""
        if self.query_groups is None:
            return None
        return GroupMask(self.query_groups, key_groups, self.positive_keys, key_offset)

    def hardness(self, spec: StatsSpec, key_owners: torch.Tensor | None,
                 key_offset: int) -> HardnessOffset | None:
        """The hardness offset of these rows against a key block, or None when ``spec`` asks for
        none."""
        if not spec.offsets:
            return None
        return HardnessOffset(spec.hardness, spec.hardness_strength, self.query_ids, key_owners,
                              self.positive_keys, key_offset)


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
        hardness: HardnessOffset | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (row_stat [m], col_stat [k] or None) in the accumulation dtype; with
        ``hardness``, row_stat is over the offset logits, col_stat over the plain ones."""

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
        hardness: HardnessOffset | None = None,
    ) -> torch.Tensor:
        """Add G K to ``grad_queries`` [m, c] and G^T Q to ``grad_keys`` [k, c] (both unscaled,
        accumulation dtype, in place) and return the row sums of G [m]. With ``hardness``, the
        row probabilities exp(z - row_stat) are of the offset logits (the column ones are not).

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
