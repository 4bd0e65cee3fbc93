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
positive logit are not offset), and the row probabilities below are of those logits. With the
score filter (:class:`ScoreFilter`) the row and the column statistics each leave out their own
entries, so a block has a row ``allowed`` tile and a column one.

A backend's backward receives the gradients of row_stat and
col_stat (``row_weight``, ``col_weight``) and forms, tile by tile,

    softmax:  G_ij = row_weight_i * exp(z_ij - row_stat_i) + col_weight_j * exp(z_ij - col_stat_j)
    sigmoid:  G_ij = row_weight_i * sigmoid(z_ij)

(zero where masked; each direction's term where its own direction allows), from which
dQ = s * G K, dK = s * G^T Q, d(scale) = sum G * x and d(bias) = sum G. A "block op" is an object
with ``forward_block`` and ``backward_block`` methods following :class:`BlockOps`; the one Function
of :mod:`hf_infcl.ops.key_blocks` drives them, locally and in the ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .options import (
    FALSE_NEGATIVE_STRATEGIES,
    GROUP_POSITIVES,
    HARDNESS_MODES,
    FalseNegativeStrategy,
    GroupPositives,
    HardnessMode,
    LossKind,
    Precision,
)


@dataclass(frozen=True)
class StatsSpec:
    """Which statistics to compute.

    Attributes:
        loss: ``"softmax"`` (row, and optionally column, log-sum-exp) or ``"sigmoid"``
            (row sum of softplus).
        columns: softmax only; also compute the column log-sum-exp (the symmetric loss needs it).
        precision: how fp32 inputs are multiplied: ``"tf32"`` (TF32's 10-bit mantissa) or ``"ieee"``
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
        group_positives: ``"any"`` or ``"each"``: the keys of a row's group are its positives
            (docs/contract.md, "Several positives per row"). The groups then leave nothing out of
            the statistics; the positive parts come from the sparse (row, key) pairs
            (:mod:`hf_infcl.ops.positive_pairs`). None: groups leave keys out (``GroupMask``).
        false_negative_margin, false_negative_strategy: the score filter (docs/contract.md, "False
            negatives by score"): each row's threshold from its positive's score, and the entries
            scoring above it left out of the statistics (:class:`ScoreFilter`). None: off.
    """

    loss: LossKind
    columns: bool
    precision: Precision = "auto"
    gradients_in_forward: bool = False
    hardness: HardnessMode | None = None
    hardness_strength: float = 0.0
    group_positives: GroupPositives | None = None
    false_negative_margin: float | None = None
    false_negative_strategy: FalseNegativeStrategy = "absolute"

    def __post_init__(self):
        if self.loss == "sigmoid" and self.columns:
            raise ValueError("the sigmoid loss has no column statistics")
        if self.gradients_in_forward and self.loss != "sigmoid":
            raise ValueError("gradients_in_forward needs the sigmoid loss (the softmax loss's G needs "
                             "its statistics first)")
        if self.hardness is not None and (self.loss != "softmax" or self.hardness not in HARDNESS_MODES):
            raise ValueError(f"hardness {self.hardness!r} needs the softmax loss and one of {HARDNESS_MODES}")
        if self.group_positives is not None and self.group_positives not in GROUP_POSITIVES:
            raise ValueError(f"group_positives must be one of {GROUP_POSITIVES} or None")
        if self.false_negative_strategy not in FALSE_NEGATIVE_STRATEGIES:
            raise ValueError(f"false_negative_strategy must be one of {FALSE_NEGATIVE_STRATEGIES}")

    @property
    def offsets(self) -> bool:
        """Whether the row statistic is taken over hardness-offset logits."""
        return self.hardness is not None and self.hardness_strength != 0.0

    @property
    def filters(self) -> bool:
        """Whether the score filter leaves entries out (a margin is given)."""
        return self.false_negative_margin is not None

    @property
    def distinct_positives(self) -> bool:
        """Whether no two rows may share a positive key: the score filter keeps one column threshold
        per key, its row's (docs/contract.md, "False negatives by score")."""
        return self.filters and self.columns


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
        is_positive = positive_pairs_tile(self.positive_keys, self.key_offset, row_start, row_end, key_start,
                                          key_end)
        return (qg != kg) | is_positive


def positive_pairs_tile(positive_keys: torch.Tensor, key_offset: int, row_start: int, row_end: int,
                        key_start: int, key_end: int, query_groups: torch.Tensor | None = None,
                        key_groups: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [rows, keys] tile: True where key j is one of row i's positives, P(i): its own positive
    (``positive_keys`` global, the block's key j global index ``key_offset + j``) and, with
    ``group_positives`` (``query_groups`` and the block's ``key_groups`` given), every key of its group."""
    key_index = torch.arange(key_offset + key_start, key_offset + key_end, device=positive_keys.device)
    positive = positive_keys[row_start:row_end, None] == key_index[None, :]
    if query_groups is not None:
        positive = positive | (query_groups[row_start:row_end, None] == key_groups[None, key_start:key_end])
    return positive


@dataclass(frozen=True)
class HardnessOffset:
    """The hardness offset of one (row block, key block) pair (docs/contract.md, "Hardness
    offset"): row i's row-statistic logit of key j is z_ij + strength * x_ij where
    :meth:`selected` is True; the column statistic and the gradient's flow (through s * x only)
    are unchanged.

    Key indices are global, as in :class:`GroupMask`; a negative owner is nobody's. With
    ``group_positives``, ``query_groups`` and the block's ``key_groups`` make every key of a row's
    group one of its positives, never offset.
    """

    mode: HardnessMode
    strength: float
    query_ids: torch.Tensor  # [m] int64
    key_owners: torch.Tensor  # [k_block] int64, negative: never offset
    positive_keys: torch.Tensor  # [m] int64, global key indices
    key_offset: int = 0
    query_groups: torch.Tensor | None = None  # [m], with group_positives
    key_groups: torch.Tensor | None = None  # [k_block], with group_positives

    @property
    def mode_code(self) -> int:
        """1, 2, 3 for the modes in :data:`HARDNESS_MODES` order (0 is "no offset" in kernels)."""
        return HARDNESS_MODES.index(self.mode) + 1

    def selected(self, row_start: int, row_end: int, key_start: int, key_end: int) -> torch.Tensor:
        """Boolean [rows, keys] tile: True where the logit gets the offset."""
        owner = self.key_owners[None, key_start:key_end]
        is_positive = positive_pairs_tile(self.positive_keys, self.key_offset, row_start, row_end, key_start,
                                          key_end, self.query_groups, self.key_groups)
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


@dataclass(frozen=True)
class ScoreFilter:
    """The score filter of one (row block, key block) pair (docs/contract.md, "False negatives by
    score"). Entry (i, j) is left out of row i's statistic when key j is not one of row i's
    positives and g_ij > ``row_thresholds[i]``, and out of key j's column statistic when
    g_ij > ``key_thresholds[j]`` (the threshold of the row whose positive key j is; +inf for keys
    that are nobody's). g_ij is the guide's ⟨GQ_i, GK_j⟩, or without a guide the tile's own dot
    product x_ij. Nothing is stored: :meth:`kept` recomputes a tile's two masks from the scores.

    Key indices are global, as in :class:`GroupMask`; ``query_groups`` and the block's
    ``key_groups`` are given with ``group_positives`` (the keys of a row's group are positives).
    """

    row_thresholds: torch.Tensor  # [m], the accumulation dtype
    key_thresholds: torch.Tensor | None  # [k_block]; None without a column statistic
    positive_keys: torch.Tensor  # [m] int64, global key indices
    key_offset: int = 0
    guide_queries: torch.Tensor | None = None  # [m, c_g]
    guide_keys: torch.Tensor | None = None  # [k_block, c_g]
    query_groups: torch.Tensor | None = None  # [m], with group_positives
    key_groups: torch.Tensor | None = None  # [k_block], with group_positives
    left_out: LeftOutCounts | None = None  # counted by the forward, where the block ops can

    def scores(self, dots: torch.Tensor, row_start: int, row_end: int, key_start: int,
               key_end: int) -> torch.Tensor:
        """g of one tile, in the dtype of ``dots`` (the tile's dot products x)."""
        if self.guide_queries is None:
            return dots
        guide_rows = self.guide_queries[row_start:row_end].to(dots.dtype)
        return guide_rows @ self.guide_keys[key_start:key_end].to(dots.dtype).T

    def kept(self, dots: torch.Tensor, row_start: int, row_end: int, key_start: int,
             key_end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(row tile, column tile or None) of booleans: True where the entry counts in the row's
        statistic, and in the key's column statistic. A NaN score leaves nothing out (the loss is
        NaN anyway)."""
        scores = self.scores(dots, row_start, row_end, key_start, key_end)
        positive = positive_pairs_tile(self.positive_keys, self.key_offset, row_start, row_end, key_start,
                                       key_end, self.query_groups, self.key_groups)
        row_kept = positive | ~(scores > self.row_thresholds[row_start:row_end, None])
        if self.key_thresholds is None:
            return row_kept, None
        return row_kept, positive | ~(scores > self.key_thresholds[None, key_start:key_end])


@dataclass(frozen=True)
class LeftOutCounts:
    """How many entries the score filter left out of each row's statistics in one process's block,
    counted by the forward, so that the backward can list just those rows' entries, run the
    filter-free tiles and take the listed entries' terms of G back out (block ops that can:
    :class:`LeftOutListOps`)."""

    per_row: torch.Tensor  # [m] int32


class KeyLabels(NamedTuple):
    """The per-key tensors of a key block that say which of its pairs are masked, offset or
    filtered; None where not given. In the ring they travel with their keys."""

    key_groups: torch.Tensor | None = None  # [k]
    key_owners: torch.Tensor | None = None  # [k], hardness
    guide_keys: torch.Tensor | None = None  # [k, c_g], the score filter's guide
    key_thresholds: torch.Tensor | None = None  # [k], the score filter's column thresholds


class BlockLabels(NamedTuple):
    """What the block ops take for one (row block, key block) pair."""

    mask: GroupMask | None
    hardness: HardnessOffset | None
    score_filter: ScoreFilter | None


class PairLabels(NamedTuple):
    """The per-row and per-key tensors that say which (row, key) pairs are masked
    (:class:`GroupMask`), offset (:class:`HardnessOffset`), filtered (:class:`ScoreFilter`) or
    positives (``group_positives``): this process's rows and its own keys, None where not given.
    A schedule hands them to every key block (:meth:`block`), the key tensors
    (:class:`KeyLabels`) travelling with their keys."""

    query_groups: torch.Tensor | None = None  # [m]
    key_groups: torch.Tensor | None = None  # [k]
    query_ids: torch.Tensor | None = None  # [m]
    key_owners: torch.Tensor | None = None  # [k]
    positive_keys: torch.Tensor | None = None  # [m] global key indices, when a block needs them
    guide_queries: torch.Tensor | None = None  # [m, c_g]
    guide_keys: torch.Tensor | None = None  # [k, c_g]
    row_thresholds: torch.Tensor | None = None  # [m], the score filter's (computed by the schedule's caller)
    key_thresholds: torch.Tensor | None = None  # [k], the score filter's column thresholds
    left_out: LeftOutCounts | None = None  # one process's left-out counts, forward to backward

    def own_keys(self) -> KeyLabels:
        """The labels of this process's own keys."""
        return KeyLabels(self.key_groups, self.key_owners, self.guide_keys, self.key_thresholds)

    def block(self, spec: StatsSpec, keys: KeyLabels, key_offset: int) -> BlockLabels:
        """The mask, hardness offset and score filter of these rows against a key block (its labels
        and the global index of its first key)."""
        group_positives = spec.group_positives is not None
        mask = None
        if self.query_groups is not None and not group_positives:
            mask = GroupMask(self.query_groups, keys.key_groups, self.positive_keys, key_offset)
        positive_groups = (self.query_groups, keys.key_groups) if group_positives else (None, None)
        hardness = None
        if spec.offsets:
            hardness = HardnessOffset(spec.hardness, spec.hardness_strength, self.query_ids, keys.key_owners,
                                      self.positive_keys, key_offset, *positive_groups)
        score_filter = None
        if spec.filters:
            score_filter = ScoreFilter(self.row_thresholds, keys.key_thresholds if spec.columns else None,
                                       self.positive_keys, key_offset, self.guide_queries, keys.guide_keys,
                                       *positive_groups, self.left_out)
        return BlockLabels(mask, hardness, score_filter)


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
        score_filter: ScoreFilter | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (row_stat [m], col_stat [k] or None) in the accumulation dtype; with
        ``hardness``, row_stat is over the offset logits, col_stat over the plain ones; with
        ``score_filter``, each over the entries its own direction keeps."""

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
        score_filter: ScoreFilter | None = None,
    ) -> torch.Tensor:
        """Add G K to ``grad_queries`` [m, c] and G^T Q to ``grad_keys`` [k, c] (both unscaled,
        accumulation dtype, in place) and return the row sums of G [m]. With ``hardness``, the
        row probabilities exp(z - row_stat) are of the offset logits (the column ones are not).
        With ``score_filter``, each direction's term is zero where its direction leaves it out.

        ``row_stat`` and ``col_stat`` are the complete statistics (over every key and every row
        of the whole problem), not this block's partial ones.
        """


class GroupRangeOps(BlockOps, Protocol):
    """Block ops that walk the positive pairs of ``group_positives`` as ranges
    (:class:`~hf_infcl.ops.positive_pairs.GroupRanges`) instead of a list; optional for a
    backend (:func:`~hf_infcl.ops.positive_pairs.takes_group_ranges` asks)."""

    def takes_group_ranges(self, queries: torch.Tensor) -> bool:
        """Whether these inputs go through the two methods below."""

    def group_positive_parts(self, spec: StatsSpec, queries: torch.Tensor, keys: torch.Tensor,
                             scale: torch.Tensor, bias: torch.Tensor | None, ranges):
        """The rows' (and, with a column statistic, the keys') positive parts over ``ranges``' pairs,
        as :func:`~hf_infcl.ops.positive_pairs.block_positive_parts` gives them for a list, keeping
        ``ranges`` for the backward."""

    def add_group_pair_gradients(self, spec: StatsSpec, queries: torch.Tensor, keys: torch.Tensor,
                                 scale: torch.Tensor, bias: torch.Tensor | None, ranges, row_part, row_weight,
                                 column_part, column_weight, grad_queries: torch.Tensor,
                                 grad_keys: torch.Tensor, row_sums: torch.Tensor) -> None:
        """:func:`~hf_infcl.ops.positive_pairs.add_pair_gradients` over ``ranges``' pairs."""


class LeftOutListOps(BlockOps, Protocol):
    """Block ops whose forward can count, row by row, the entries the score filter leaves out
    (:class:`LeftOutCounts`, handed in as ``score_filter.left_out``; the rows without any need no
    filter), and whose backward, where few rows have any, lists those rows' entries, recomputes its
    tiles without the filter's masks (the guide's products among them) and takes the listed
    entries' terms back out; optional for a backend."""

    def left_out_counts(self, spec: StatsSpec, queries: torch.Tensor, keys: torch.Tensor, *,
                        guided: bool) -> LeftOutCounts | None:
        """Zero counts for one block's forward to fill, or None where these inputs and options
        (``guided``: the filter has a guide) keep the filter's masks in the backward."""


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
        score_filter: ScoreFilter | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sigmoid row statistic [m] of this block and, from the same logits, G K added to
        ``grad_queries`` and G^T Q to ``grad_keys`` for G_ij = sigmoid(z_ij) (every row weight
        1; zero where masked or filtered), as ``backward_block`` adds them. Returns (row_stat, row
        sums of G)."""


def takes_one_pass(ops) -> bool:
    """Whether a block-ops object offers the sigmoid loss's one-pass route."""
    return callable(getattr(ops, "forward_backward_block", None))


def probabilities(logits: torch.Tensor, stat: torch.Tensor) -> torch.Tensor:
    """exp(logits - stat) in the logits' dtype, ``stat`` (float64, or the logits' dtype) subtracted
    as its value in that dtype and then the rest: near the row's largest logits the first
    difference is exact, so the result is as exact as the logits."""
    high = stat.to(logits.dtype)
    rest = torch.where(torch.isfinite(stat), stat - high, torch.zeros_like(stat)).to(logits.dtype)
    return torch.exp((logits - high) - rest)
