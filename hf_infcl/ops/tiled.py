"""Pure-PyTorch tile-wise block ops: the statistics of :mod:`hf_infcl.ops.spec`, one tile at a time.

Runs on any device, CPU included. At most one ``tile_rows x tile_keys`` tile of logits (and a
few tiles of the same size for its probabilities) exists at any moment, so memory is
O((m + k) * c + tile_rows * tile_keys), never O(m * k).

Tiles are computed in the accumulation dtype (fp32, or fp64 for fp64 inputs): half-precision
inputs are upcast one tile at a time, so the logits are never rounded to bf16.

The softmax loss's log-sum-exps are kept in float64 (:func:`statistics_dtype`), whatever the
inputs: at a logit scale of 100 an fp32 log-sum-exp near 100 is off by up to 4e-6, and that
error scales every probability of its row in the backward. Each tile's log-sum-exp is its max
(exact) plus the log of a sum of exp(z - max) (small, so exact to fp32's relative precision),
added in float64; the backward subtracts the statistic from the logits in two fp32 steps, its
fp32 value then the rest (:func:`~hf_infcl.ops.spec.probabilities`), so the tiles themselves stay in fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .distillation import (
    DistillationSpec,
    SoftTargetGradients,
    SoftTargetStats,
    TeacherLogits,
    empty_soft_target_stats,
    merge_soft_target_stats,
)
from .matryoshka import PrefixSpec, PrefixSums
from .options import check_positive_int
from .spec import (
    GroupMask,
    HardnessOffset,
    ScoreFilter,
    StatsSpec,
    accumulation_dtype,
    empty_row_stats,
    probabilities,
    resolve_precision,
)

# The softmax statistics' dtype, whatever the inputs' (the module docstring says why).
_LSE_DTYPE = torch.float64
# Above this, softplus(z) == z to well under float64 resolution of the row sums we form.
_SOFTPLUS_LINEAR_ABOVE = 40.0


@contextlib.contextmanager
def _matmul_precision(spec: StatsSpec, dtype: torch.dtype, device: torch.device):
    """fp32 matmuls on CUDA follow ``spec.precision`` (:func:`resolve_precision`), whatever torch's
    global TF32 switch says; elsewhere a no-op."""
    if device.type != "cuda":
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = resolve_precision(spec.precision, dtype, device) == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@dataclass(frozen=True)
class TorchTiles:
    """Block ops built from plain torch ops over ``tile_rows x tile_keys`` tiles."""

    tile_rows: int = 1024
    tile_keys: int = 1024

    def __post_init__(self):
        for name in ("tile_rows", "tile_keys"):
            check_positive_int(name, getattr(self, name))

    def _tiles(self, m: int, k: int):
        for row_start in range(0, m, self.tile_rows):
            row_end = min(row_start + self.tile_rows, m)
            for key_start in range(0, k, self.tile_keys):
                yield row_start, row_end, key_start, min(key_start + self.tile_keys, k)

    @staticmethod
    def _logits(q_tile, k_tile, scale, bias):
        """Scaled logits and the raw dot products of one tile."""
        dots = q_tile @ k_tile.T
        logits = scale * dots
        if bias is not None:
            logits = logits + bias
        return logits, dots

    def _logit_tiles(self, spec, queries, keys, scale, bias, hardness: HardnessOffset | None = None):
        """(r0, r1, k0, k1, query tile, key tile, logits, row logits, dots) of every tile, in the
        accumulation dtype; the row logits are the logits with the hardness offset (the same
        tensor without one). The caller's loop body runs under ``spec``'s matmul precision too."""
        acc = accumulation_dtype(queries.dtype)
        scale = scale.to(acc)
        bias = None if bias is None else bias.to(acc)
        with _matmul_precision(spec, queries.dtype, queries.device):
            for r0, r1, k0, k1 in self._tiles(queries.shape[0], keys.shape[0]):
                q_tile = queries[r0:r1].to(acc)
                k_tile = keys[k0:k1].to(acc)
                logits, dots = self._logits(q_tile, k_tile, scale, bias)
                row_logits = logits
                if hardness is not None:
                    row_logits = hardness.offset_logits(logits, dots, r0, r1, k0, k1)
                yield r0, r1, k0, k1, q_tile, k_tile, logits, row_logits, dots

    def forward_block(self, spec, queries, keys, scale, bias, mask: GroupMask | None,
                      hardness: HardnessOffset | None = None, score_filter: ScoreFilter | None = None):
        m, k = queries.shape[0], keys.shape[0]
        device = queries.device
        stat = statistics_dtype(spec.loss, queries.dtype)
        if spec.loss == "softmax":
            row_stat = torch.full((m,), float("-inf"), dtype=stat, device=device)
        else:
            row_stat = torch.zeros(m, dtype=stat, device=device)
        col_stat = torch.full((k,), float("-inf"), dtype=stat, device=device) if spec.columns else None

        tiles = self._logit_tiles(spec, queries, keys, scale, bias, hardness)
        for r0, r1, k0, k1, _, _, logits, row_logits, dots in tiles:
            row_allowed, col_allowed = _allowed(mask, score_filter, dots, r0, r1, k0, k1)
            _add_tile_stats(spec.loss, row_stat[r0:r1], None if col_stat is None else col_stat[k0:k1], logits,
                            row_logits, row_allowed, col_allowed)
        return row_stat, col_stat

    def backward_block(
        self,
        spec,
        queries,
        keys,
        scale,
        bias,
        mask: GroupMask | None,
        row_stat,
        col_stat,
        row_weight,
        col_weight,
        grad_queries,
        grad_keys,
        hardness: HardnessOffset | None = None,
        score_filter: ScoreFilter | None = None,
    ):
        acc = accumulation_dtype(queries.dtype)
        row_sums = torch.zeros(queries.shape[0], dtype=acc, device=queries.device)
        tiles = self._logit_tiles(spec, queries, keys, scale, bias, hardness)
        for r0, r1, k0, k1, q_tile, k_tile, logits, row_logits, dots in tiles:
            row_allowed, col_allowed = _allowed(mask, score_filter, dots, r0, r1, k0, k1)
            columns = (None, None) if col_weight is None else (col_stat[k0:k1], col_weight[k0:k1])
            grad_logits = _tile_gradient(spec.loss, logits, row_logits, row_stat[r0:r1], row_weight[r0:r1],
                                         *columns, row_allowed, col_allowed)
            _add_products(grad_logits, q_tile, k_tile, grad_queries[r0:r1], grad_keys[k0:k1], row_sums[r0:r1])
        return row_sums

    def forward_backward_block(self, spec, queries, keys, scale, bias, mask: GroupMask | None, grad_queries,
                               grad_keys, score_filter: ScoreFilter | None = None):
        """The sigmoid loss's one pass (``OnePassSigmoidOps``): each tile's logits give its
        softplus row sums and, with every row weight 1, G = sigmoid(z) and the two products."""
        acc = accumulation_dtype(queries.dtype)
        row_stat = torch.zeros(queries.shape[0], dtype=acc, device=queries.device)
        row_sums = torch.zeros(queries.shape[0], dtype=acc, device=queries.device)
        tiles = self._logit_tiles(spec, queries, keys, scale, bias)
        for r0, r1, k0, k1, q_tile, k_tile, logits, _, dots in tiles:
            allowed, _ = _allowed(mask, score_filter, dots, r0, r1, k0, k1)
            terms = F.softplus(logits, threshold=_SOFTPLUS_LINEAR_ABOVE)
            grad_logits = torch.sigmoid(logits)
            if allowed is not None:
                terms = terms.masked_fill(~allowed, 0.0)
                grad_logits = grad_logits.masked_fill(~allowed, 0.0)
            row_stat[r0:r1] += terms.sum(dim=1)
            _add_products(grad_logits, q_tile, k_tile, grad_queries[r0:r1], grad_keys[k0:k1], row_sums[r0:r1])
        return row_stat, row_sums

    def distillation_forward_block(self, spec: DistillationSpec, queries, keys, scale,
                                   teacher: TeacherLogits):
        """In-batch distillation's statistics (:class:`~hf_infcl.ops.distillation.DistillationBlockOps`),
        each tile's merged into the running ones as a log-sum-exp is, in float64 as the softmax
        loss's."""
        rows = empty_soft_target_stats(queries.shape[0], _LSE_DTYPE, queries.device)
        columns = empty_soft_target_stats(keys.shape[0], _LSE_DTYPE, queries.device) if spec.columns else None
        for r0, r1, k0, k1, _, _, logits, _, _ in self._logit_tiles(spec, queries, keys, scale, None):
            teacher_logits = teacher.tile(r0, r1, k0, k1, logits.dtype)
            _merge_into(rows, slice(r0, r1), _soft_target_tile(logits, teacher_logits, dim=1))
            if columns is not None:
                _merge_into(columns, slice(k0, k1), _soft_target_tile(logits, teacher_logits, dim=0))
        return rows, columns

    def distillation_backward_block(self, spec: DistillationSpec, queries, keys, scale,
                                    teacher: TeacherLogits, rows: SoftTargetGradients,
                                    columns: SoftTargetGradients | None, grad_queries, grad_keys):
        acc = accumulation_dtype(queries.dtype)
        row_sums = torch.zeros(queries.shape[0], dtype=acc, device=queries.device)
        tiles = self._logit_tiles(spec, queries, keys, scale, None)
        for r0, r1, k0, k1, q_tile, k_tile, logits, _, _ in tiles:
            teacher_logits = teacher.tile(r0, r1, k0, k1, logits.dtype)
            grad_logits = _soft_target_gradient(logits, teacher_logits, rows, slice(r0, r1), dim=1)
            if columns is not None:
                grad_logits += _soft_target_gradient(logits, teacher_logits, columns, slice(k0, k1), dim=0)
            _add_products(grad_logits, q_tile, k_tile, grad_queries[r0:r1], grad_keys[k0:k1], row_sums[r0:r1])
        return row_sums

    def _prefix_logit_tiles(self, spec: PrefixSpec, queries, keys, scale, bias, query_scales, key_scales):
        """(r0, r1, k0, k1, query tile, key tile, [P^t], [z^t]) of every tile, t = 0..D-1, in the
        accumulation dtype: the raw prefix dot products from one product per segment, summed from
        the innermost (:mod:`hf_infcl.ops.matryoshka`), and each term's logits."""
        acc = accumulation_dtype(queries.dtype)
        scale = scale.to(acc)
        bias = None if bias is None else bias.to(acc)
        segments = spec.segments
        with _matmul_precision(spec, queries.dtype, queries.device):
            for r0, r1, k0, k1 in self._tiles(queries.shape[0], keys.shape[0]):
                q_tile = queries[r0:r1].to(acc)
                k_tile = keys[k0:k1].to(acc)
                dots = [None] * len(segments)
                running = 0.0
                for u in reversed(range(len(segments))):
                    running = running + q_tile[:, segments[u]] @ k_tile[:, segments[u]].T
                    dots[u] = running
                logits = [scale * (p * query_scales[t, r0:r1, None]) * key_scales[t, None, k0:k1]
                          for t, p in enumerate(dots)]
                if bias is not None:
                    logits = [z + bias for z in logits]
                yield r0, r1, k0, k1, q_tile, k_tile, dots, logits

    def prefix_forward_block(self, spec: PrefixSpec, queries, keys, scale, bias, query_scales, key_scales,
                             mask: GroupMask | None):
        """Every Matryoshka term's statistics (:class:`~hf_infcl.ops.matryoshka.PrefixBlockOps`)."""
        terms, m, k = len(spec.dims), queries.shape[0], keys.shape[0]
        stat = statistics_dtype(spec.loss, queries.dtype)
        row_stat = empty_row_stats(spec, terms * m, stat, queries.device).view(terms, m)
        col_stat = None
        if spec.columns:
            col_stat = empty_row_stats(spec, terms * k, stat, queries.device).view(terms, k)
        tiles = self._prefix_logit_tiles(spec, queries, keys, scale, bias, query_scales, key_scales)
        for r0, r1, k0, k1, _, _, _, logits in tiles:
            allowed = None if mask is None else mask.allowed(r0, r1, k0, k1)
            for t, z in enumerate(logits):
                columns = None if col_stat is None else col_stat[t, k0:k1]
                _add_tile_stats(spec.loss, row_stat[t, r0:r1], columns, z, z, allowed, allowed)
        return row_stat, col_stat

    def prefix_backward_block(self, spec: PrefixSpec, queries, keys, scale, bias, query_scales, key_scales,
                              mask: GroupMask | None, row_stat, col_stat, row_weight, col_weight,
                              grad_queries, grad_keys) -> PrefixSums:
        """Each segment's products with the running sum of the terms' scaled G that cover it, and
        the per-term sums (:class:`~hf_infcl.ops.matryoshka.PrefixBlockOps`)."""
        acc = accumulation_dtype(queries.dtype)
        terms, m, k = len(spec.dims), queries.shape[0], keys.shape[0]
        sums = PrefixSums(*(torch.zeros((terms, n), dtype=acc, device=queries.device) for n in (m, m, k)))
        tiles = self._prefix_logit_tiles(spec, queries, keys, scale, bias, query_scales, key_scales)
        for r0, r1, k0, k1, q_tile, k_tile, dots, logits in tiles:
            allowed = None if mask is None else mask.allowed(r0, r1, k0, k1)
            covering = 0.0  # H_u: the scaled G of the terms t <= u
            for t, (p, z) in enumerate(zip(dots, logits)):
                columns = (None, None) if col_weight is None else (col_stat[t, k0:k1], col_weight[t, k0:k1])
                grad = _tile_gradient(spec.loss, z, z, row_stat[t, r0:r1], row_weight[t, r0:r1], *columns,
                                      allowed, allowed)
                a, b = query_scales[t, r0:r1, None], key_scales[t, None, k0:k1]
                sums.row_sums[t, r0:r1] += grad.sum(dim=1)
                weighted = grad * p
                sums.row_products[t, r0:r1] += (weighted * b).sum(dim=1)
                sums.key_products[t, k0:k1] += (weighted * a).sum(dim=0)
                covering = covering + grad * a * b
                segment = spec.segments[t]
                grad_queries[r0:r1, segment].addmm_(covering, k_tile[:, segment])
                grad_keys[k0:k1, segment].addmm_(covering.T, q_tile[:, segment])
        return sums


def statistics_dtype(loss: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of :class:`TorchTiles`' row and column statistics for inputs of ``dtype``: float64
    for the softmax loss's log-sum-exps (the module docstring says why), else the accumulation
    dtype."""
    return _LSE_DTYPE if loss == "softmax" else accumulation_dtype(dtype)


def _logsumexp(logits: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.logsumexp`` of one tile, the max added to the log of the sum in float64 (the module
    docstring says why)."""
    top = logits.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all -inf, an inf or a NaN
    log_sum = torch.log(torch.exp(logits - top).sum(dim=dim))
    return top.squeeze(dim).to(_LSE_DTYPE) + log_sum.to(_LSE_DTYPE)


def _allowed(mask: GroupMask | None, score_filter: ScoreFilter | None, dots, r0, r1, k0, k1):
    """(row tile, column tile) of booleans, True where the entry counts in the row's statistic and in
    the key's column statistic; None where everything counts. The column tile is None too without a
    column statistic."""
    allowed = None if mask is None else mask.allowed(r0, r1, k0, k1)
    if score_filter is None:
        return allowed, allowed
    row_kept, col_kept = score_filter.kept(dots, r0, r1, k0, k1)
    if allowed is None:
        return row_kept, col_kept
    return allowed & row_kept, None if col_kept is None else allowed & col_kept


def _where(allowed: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    return values if allowed is None else torch.where(allowed, values, torch.zeros_like(values))


def _add_tile_stats(loss: str, row_stat, col_stat, logits, row_logits, row_allowed, col_allowed) -> None:
    """Merge one tile's statistics into the running ones of its rows (views, updated in place) and,
    with ``col_stat`` (a view, or None), of its keys; ``row_logits``: the logits of the row
    statistic (the hardness offset's), ``logits`` the column statistic's."""
    if loss == "sigmoid":
        terms = F.softplus(logits, threshold=_SOFTPLUS_LINEAR_ABOVE)
        if row_allowed is not None:
            terms = terms.masked_fill(~row_allowed, 0.0)
        row_stat += terms.sum(dim=1)
        return
    if row_allowed is not None:
        row_logits = row_logits.masked_fill(~row_allowed, float("-inf"))
    row_stat.copy_(torch.logaddexp(row_stat, _logsumexp(row_logits, dim=1)))
    if col_stat is not None:
        if col_allowed is not None:
            logits = logits.masked_fill(~col_allowed, float("-inf"))
        col_stat.copy_(torch.logaddexp(col_stat, _logsumexp(logits, dim=0)))


def _tile_gradient(loss: str, logits, row_logits, row_stat, row_weight, col_stat, col_weight, row_allowed,
                   col_allowed) -> torch.Tensor:
    """G of one tile from the statistics and weights of its rows (and, with ``col_weight``, of its
    keys), zero where a direction does not allow the entry."""
    # where(), not a product: a masked entry may hold inf * 0 = nan.
    if loss == "sigmoid":
        return _where(row_allowed, row_weight[:, None] * torch.sigmoid(logits))
    grad = _where(row_allowed, row_weight[:, None] * probabilities(row_logits, row_stat[:, None]))
    if col_weight is not None:
        grad += _where(col_allowed, col_weight[None, :] * probabilities(logits, col_stat[None, :]))
    return grad


def _add_products(grad_logits, q_tile, k_tile, grad_queries, grad_keys, row_sums) -> None:
    """Add one tile's G K, G^T Q and row sums of G into the (sliced) accumulators, in place."""
    grad_queries.addmm_(grad_logits, k_tile)
    grad_keys.addmm_(grad_logits.T, q_tile)
    row_sums += grad_logits.sum(dim=1)


def _soft_target_tile(logits, teacher_logits, dim: int) -> SoftTargetStats:
    """One tile's distillation statistics along ``dim`` (1: each row's over the tile's keys, 0: each
    key's over its rows), in float64."""
    teacher_lse = _logsumexp(teacher_logits, dim)
    teacher_probs = probabilities(teacher_logits, teacher_lse.unsqueeze(dim))
    gap = (teacher_probs * (teacher_logits - logits)).sum(dim=dim).to(_LSE_DTYPE)
    return SoftTargetStats(_logsumexp(logits, dim), teacher_lse, gap)


def _merge_into(stats: SoftTargetStats, part: slice, tile: SoftTargetStats) -> None:
    """Merge a tile's statistics into the running ones of the rows (or keys) ``part``, in place."""
    merged = merge_soft_target_stats(SoftTargetStats(*(running[part] for running in stats)), tile)
    for running, value in zip(stats, merged):
        running[part] = value


def _soft_target_gradient(logits, teacher_logits, direction: SoftTargetGradients, part: slice, dim: int):
    """One direction's share of a tile's G: student_weight * P - target_weight * T, the weights and
    log-sum-exps those of the rows (``dim`` 1) or keys (``dim`` 0) ``part``."""
    def along(values):
        return values[part].unsqueeze(dim)

    student = along(direction.student_weight) * probabilities(logits, along(direction.student_lse))
    teacher = along(direction.target_weight) * probabilities(teacher_logits, along(direction.teacher_lse))
    return student - teacher
