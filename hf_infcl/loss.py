"""The public loss: ``contrastive_loss`` and the ``InfCLLoss`` module.

This layer checks arguments (docs/contract.md, "Errors", says when), picks a backend, assembles the per-row
loss from the backend's statistics and the positive logits, and reduces. The contract it
implements is docs/contract.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .ops import reference
from .ops.compiler_marks import run_eagerly
from .ops.label_smoothing import smoothing_terms
from .ops.logit_stats import LogitStats, announcing_rejections, logit_stats, select_block_ops
from .ops.matryoshka import PrefixLogitStats, PrefixSpec, prefix_block_ops, prefix_inverse_norms
from .ops.options import (
    BackendName,
    FalseNegativeStrategy,
    GroupPositives,
    HardnessMode,
    LossKind,
    LossOptions,
    OptionAttribute,
    Precision,
    Reduction,
    check_hardness,
    check_label_smoothing,
    check_matryoshka,
    check_objective_options,
    check_option,
)
from .ops.ring import MatryoshkaTerm
from .ops.spec import BlockOps, StatsSpec, accumulation_dtype, resolve_precision
from .ops.value_check import check_scale_value as _check_scale_value
from .ops.value_check import check_values as _check_values
from .ops.value_check import reads_scale_only as _reads_scale_only


def contrastive_loss(
    queries: torch.Tensor,
    keys: torch.Tensor,
    logit_scale: float | torch.Tensor = 1.0,
    logit_bias: float | torch.Tensor | None = None,
    *,
    loss: LossKind = "softmax",
    symmetric: bool = True,
    positives: torch.Tensor | None = None,
    query_groups: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
    reduction: Reduction = "mean",
    process_group=None,
    backend: BackendName | BlockOps = "auto",
    precision: Precision = "auto",
    hardness_mode: HardnessMode | None = None,
    hardness_strength: float = 0.0,
    query_ids: torch.Tensor | None = None,
    key_owners: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    group_positives: GroupPositives | None = None,
    false_negative_margin: float | None = None,
    false_negative_strategy: FalseNegativeStrategy = "absolute",
    guide_queries: torch.Tensor | None = None,
    guide_keys: torch.Tensor | None = None,
    matryoshka_dims: Sequence[int] | None = None,
    matryoshka_weights: Sequence[float] | None = None,
) -> torch.Tensor:
    """Exact InfoNCE (CLIP) or sigmoid (SigLIP) contrastive loss without a b x b matrix.

    Args:
        queries: ``[m, c]`` rows (image embeddings, queries, anchors).
        keys: ``[k, c]`` columns (text embeddings, documents). ``keys[:m]`` are the positives of
            the rows in order unless ``positives`` says otherwise; further keys are extra (hard)
            negatives for every row.
        logit_scale: the multiplier ``s`` of the dot products (CLIP's ``logit_scale.exp()``), a
            positive float or a scalar tensor; gradients flow to it when it requires grad.
        logit_bias: the additive bias ``b`` of SigLIP (float or scalar tensor), or None.
        loss: ``"softmax"`` (InfoNCE) or ``"sigmoid"`` (SigLIP).
        symmetric: softmax only; average the row (query->key) and the column (key->query) terms,
            as CLIP does. The sigmoid loss has no directions and ignores it.
        positives: ``[m]`` integer indices into ``keys`` of each row's positive.
        query_groups, key_groups: ``[m]`` and ``[k]`` integer group ids, given together. Key j is
            not a negative of row i when their groups are equal and j is not i's positive
            (duplicate captions, the same document twice).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-row losses ``[m]``).
        process_group: ``None`` computes over this process's tensors only. A
            ``torch.distributed`` group computes the loss over every row and key of the group
            with the ring (``hf_infcl.ops.ring``): every rank must call this with its own rows
            and keys (a rank may hold no rows), and every rank must backpropagate its result.
            ``"auto"`` means the default (WORLD) group when ``torch.distributed`` is initialised
            with more than one process, and local computation otherwise. A group of one process
            gives exactly the local result.
        backend: ``"auto"`` (Triton on CUDA when importable, else ``"torch"``), ``"torch"``
            (tile-wise PyTorch, any device), ``"triton"``, ``"reference"`` (materialised;
            small inputs only), or a block-ops object such as ``TorchTiles(256, 256)``.
        precision: fp32 inputs on GPU: ``"auto"``/``"tf32"`` use TF32, ``"ieee"`` exact fp32.
        hardness_mode, hardness_strength: softmax only; sentence-transformers' hardness weighting
            (docs/contract.md, "Hardness offset"): the row term's logit of a selected negative
            gets ``+ hardness_strength * x_ij`` (the unscaled dot product, no gradient through
            it). ``"in_batch_negatives"`` selects the keys other rows own, ``"hard_negatives"``
            the row's own keys, ``"all_negatives"`` every owned key; never a row's positive.
            ``hardness_strength=0.0`` (or no mode) is the plain loss.
        query_ids, key_owners: ``[m]`` and ``[k]`` integer ids, given with ``hardness_mode``:
            key j is owned by row i when ``key_owners[j] == query_ids[i]``; a negative owner is
            nobody's (never offset). Across processes they must be unique in the whole group.
        label_smoothing: softmax only, in [0, 1]: every cross-entropy term is smoothed as
            ``torch.nn.functional.cross_entropy(..., label_smoothing=...)`` does, its candidates
            being every key of the group (row term) or every row (column term); ALIGN trains with
            0.1. Computed from the mean key and mean query, never the b x b matrix
            (docs/contract.md, "Label smoothing"). Not with groups, a hardness offset or the score
            filter.
        group_positives: ``"any"`` or ``"each"``, with ``query_groups``/``key_groups``: the keys of
            a row's group are its positives instead of being left out (docs/contract.md, "Several
            positives per row"). ``"any"``: -log of the softmax mass on the positives (MIL-NCE);
            ``"each"``: the mean of -log p over the positives (SupCon's L_out); the sigmoid loss
            labels them all +1 (either). The symmetric loss's column terms follow the same rule.
            Memory grows with the number of same-group pairs (linear while groups are bounded).
        false_negative_margin: leave out of row i's negatives the keys j that score too close to
            its positive: g_ij > tau_i, tau_i = g_{i,p(i)} - margin ("absolute") or
            g_{i,p(i)} - |g_{i,p(i)}| * margin ("relative"); positives are never left out. g is the
            guide's similarity, or without a guide the model's own dot product (detached). A finite
            float, negative margins included (only keys more than |margin| above the positive go);
            None: off (docs/contract.md, "False negatives by score"). With the symmetric softmax
            loss, no two rows may share a positive key.
        false_negative_strategy: ``"absolute"`` or ``"relative"``, as above.
        guide_queries, guide_keys: ``[m, c_g]`` and ``[k, c_g]``, given together and with a margin:
            a guide model's embeddings (GISTEmbedLoss's guide), of the queries' dtype and device;
            they get no gradient. The filter's mask is recomputed per tile, never stored.
        matryoshka_dims: strictly descending prefix widths ``d_1 > ... > d_D``, each in ``[1, c]``
            (sentence-transformers' ``MatryoshkaLoss``): the loss is the weighted sum over t of this
            loss, every other option unchanged, on ``F.normalize(queries[:, :d_t])`` and
            ``F.normalize(keys[:, :d_t])`` (each prefix L2-normalised row by row; the guide is not
            truncated). None: the plain loss on the features as given. The torch tiles compute every
            prefix in one pass where the options allow, else one loss call per dimension
            (docs/contract.md, "Matryoshka in one call"); across processes every rank must pass the
            same dims and weights, or every rank raises ``ValueError``.
        matryoshka_weights: one finite weight >= 0 per dim (None: 1 each); only with
            ``matryoshka_dims``. With ``reduction="none"`` the per-row losses are the weighted sums
            of each prefix's per-row losses.

    Returns:
        The reduced loss (a scalar), or the per-row losses ``[m]`` for ``reduction="none"``.
        With ``"mean"`` over a group of n processes holding M rows in all, each process returns
        ``(n / M) * sum of its rows' losses``, so that averaging the processes' gradients (what
        DDP does) gives exactly the gradient of the global mean.
    """
    objectives = Objectives(group_positives, false_negative_margin, false_negative_strategy, guide_queries,
                            guide_keys)
    return _contrastive_loss(queries, keys, logit_scale, logit_bias, positives, query_groups, key_groups,
                             process_group, loss, symmetric, reduction, backend, precision,
                             options_checked=False, hardness=(hardness_mode, hardness_strength, query_ids,
                                                              key_owners), label_smoothing=label_smoothing,
                             objectives=objectives, matryoshka_dims=matryoshka_dims,
                             matryoshka_weights=matryoshka_weights)


def _matryoshka_loss(queries, keys, logit_scale, logit_bias, positives, query_groups, key_groups,
                     process_group, loss, symmetric, reduction, backend, precision, hardness, label_smoothing,
                     objectives, matryoshka_dims, matryoshka_weights):
    """``contrastive_loss`` with ``matryoshka_dims``: the weighted sum of the loss on each
    re-normalised prefix (docs/contract.md, "Matryoshka in one call"): in one pass
    (:func:`_one_pass_matryoshka_loss`) where the block ops offer it and the options allow
    (:func:`_plain_terms`), else one loss call per dimension.

    The arguments that slicing would hide are checked on the whole features first (a width or dtype
    mismatch between queries and keys survives truncation to a common prefix); each call then checks
    its own, as any call does. ``F.normalize`` of the slices gives autograd the norms' gradients."""
    group, world_size = resolve_process_group(process_group)
    in_ring = world_size > 1
    device = queries.device if torch.is_tensor(queries) else None
    with announcing_rejections(group if in_ring else None, device):
        scale, bias, checked_positives = check_arguments(
            queries, keys, logit_scale, logit_bias, loss, symmetric, positives, query_groups, key_groups,
            reduction, backend, precision, in_ring=in_ring, check_values=False)
        dims, weights = check_matryoshka(matryoshka_dims, matryoshka_weights, queries.shape[1])
    ops = None
    if not in_ring and backend != "reference" and not torch.compiler.is_compiling() and _plain_terms(
            hardness, label_smoothing, objectives):
        ops = prefix_block_ops(select_block_ops(backend, queries.device))
    if ops is not None:
        return _one_pass_matryoshka_loss(queries, keys, scale, bias, checked_positives, query_groups,
                                         key_groups, loss, symmetric, reduction, precision, dims, weights,
                                         ops)
    terms = []
    for dim, weight in zip(dims, weights):
        with torch.autocast(queries.device.type, enabled=False):
            prefix_queries = F.normalize(queries[:, :dim], dim=1)
            prefix_keys = F.normalize(keys[:, :dim], dim=1)
        term = _contrastive_loss(prefix_queries, prefix_keys, logit_scale, logit_bias, positives,
                                 query_groups, key_groups, process_group, loss, symmetric, reduction, backend,
                                 precision, options_checked=True, hardness=hardness,
                                 label_smoothing=label_smoothing, objectives=objectives,
                                 matryoshka_term=MatryoshkaTerm(len(dims), dim, weight))
        terms.append(term)
    return _weighted_sum(terms, weights)


def _weighted_sum(terms, weights):
    """sum_t w_t term_t, a weight of 1 without its product."""
    total = None
    for term, weight in zip(terms, weights):
        if weight != 1.0:
            term = weight * term
        total = term if total is None else total + term
    return total


def _plain_terms(hardness, label_smoothing, objectives) -> bool:
    """Whether a Matryoshka loss's terms use none of the options the one-pass route leaves to one
    loss call per term (which checks them): the hardness offset, label smoothing, several positives,
    the score filter and its guide."""
    unset = (objectives.group_positives, objectives.false_negative_margin, objectives.guide_queries,
             objectives.guide_keys)
    return (hardness[0] is None and not label_smoothing and all(value is None for value in unset)
            and objectives.false_negative_strategy == NO_OBJECTIVES.false_negative_strategy)


def _one_pass_matryoshka_loss(queries, keys, scale, bias, positives, query_groups, key_groups, loss,
                              symmetric, reduction, precision, dims, weights, ops):
    """``contrastive_loss`` with ``matryoshka_dims`` on one process, every term's statistics from one
    pass per tile (:mod:`hf_infcl.ops.matryoshka`); the prefixes' inverse norms are autograd ops.
    The arguments come checked but for the checks that read values, made here before any kernel."""
    _check_values(scale, positives, keys.shape[0], False)
    with torch.autocast(queries.device.type, enabled=False):
        spec = PrefixSpec(loss, loss == "softmax" and symmetric, dims,
                          resolve_precision(precision, queries.dtype, queries.device))
        row_stat, col_stat, positive_logit = PrefixLogitStats.apply(
            queries, keys, scale, bias, prefix_inverse_norms(queries, dims), prefix_inverse_norms(keys, dims),
            positives, query_groups, key_groups, spec, ops)
        acc = accumulation_dtype(queries.dtype)
        term_spec = StatsSpec(loss, spec.columns)
        terms = [assemble_per_row_loss(term_spec, positives, LogitStats(
            row_stat[t].to(acc), col_stat[t].to(acc) if spec.columns else col_stat[t], positive_logit[t],
            queries.shape[0])) for t in range(len(dims))]
        return reduce_per_row(_weighted_sum(terms, weights), reduction, total_rows=queries.shape[0],
                              world_size=1)


class Objectives(NamedTuple):
    """``contrastive_loss``'s several positives and score filter, as it takes them."""

    group_positives: GroupPositives | None = None
    false_negative_margin: float | None = None
    false_negative_strategy: FalseNegativeStrategy = "absolute"
    guide_queries: torch.Tensor | None = None
    guide_keys: torch.Tensor | None = None


NO_OBJECTIVES = Objectives()


def _distinct_positives(objectives: Objectives, loss: str, symmetric: bool) -> bool:
    """Whether no two rows may share a positive key: the score filter with the symmetric softmax
    loss keeps one column threshold per key (as ``StatsSpec.distinct_positives``)."""
    return objectives.false_negative_margin is not None and loss == "softmax" and symmetric


def _contrastive_loss(queries, keys, logit_scale, logit_bias, positives, query_groups, key_groups,
                      process_group, loss, symmetric, reduction, backend, precision, options_checked,
                      hardness=(None, 0.0, None, None), label_smoothing=0.0, objectives=NO_OBJECTIVES,
                      matryoshka_dims=None, matryoshka_weights=None, matryoshka_term=None):
    """``contrastive_loss`` for every entry point: validate, one call for the statistics (one
    process or the ring: :func:`hf_infcl.ops.logit_stats.logit_stats`), assemble, add the label
    smoothing (:func:`hf_infcl.ops.label_smoothing.smoothing_terms`, the same for every backend),
    reduce. ``options_checked``: the caller holds the options as a :class:`LossOptions`, checked
    when it was built, so they are not checked again. ``hardness``: (hardness_mode,
    hardness_strength, query_ids, key_owners) as ``contrastive_loss`` takes them; ``objectives``:
    its several positives and score filter (:class:`Objectives`); ``matryoshka_dims`` /
    ``matryoshka_weights``: the Matryoshka loss (:func:`_matryoshka_loss`) when either is given;
    ``matryoshka_term``: which term of a Matryoshka loss this call is
    (:class:`~hf_infcl.ops.ring.MatryoshkaTerm`), which the ring checks every rank agrees on."""
    if matryoshka_dims is not None or matryoshka_weights is not None:
        return _matryoshka_loss(queries, keys, logit_scale, logit_bias, positives, query_groups, key_groups,
                                process_group, loss, symmetric, reduction, backend, precision, hardness,
                                label_smoothing, objectives, matryoshka_dims, matryoshka_weights)
    group, world_size = resolve_process_group(process_group)
    in_ring = world_size > 1
    # One process makes the checks that read values (scale > 0, positives in range) around the
    # statistics (hf_infcl.ops.value_check says where and why); under torch.compile they would
    # break the graph here. The ring checks here: every rank must agree.
    deferred = not in_ring
    device = queries.device if torch.is_tensor(queries) else None
    with announcing_rejections(group if in_ring else None, device):
        objectives = _check_objectives(queries, keys, query_groups, *objectives)
        scale, bias, positives = check_arguments(
            queries, keys, logit_scale, logit_bias, loss, symmetric, positives, query_groups, key_groups,
            reduction, backend, precision, in_ring=in_ring, check_values=not deferred,
            options_checked=options_checked,
            distinct_positives=_distinct_positives(objectives, loss, symmetric),
        )
        hardness_mode, hardness_strength, query_ids, key_owners = _check_hardness(loss, queries, keys,
                                                                                  *hardness)
        check_label_smoothing(label_smoothing, loss, grouped=query_groups is not None,
                              hardness=hardness_mode is not None,
                              filtered=objectives.false_negative_margin is not None)
    # A scale given as a number was checked on the host: with the default pairing nothing is left
    # to read, and the host need not wait for the GPU at all.
    reads_values = deferred and not (_reads_scale_only(positives) and _scale_at_hand(logit_scale))
    # The loss computes in its inputs' dtype under its own precision policy (``precision``), with
    # autocast on or off: the Triton kernels never see autocast, and the torch and reference backends
    # must not either, or a bf16 autocast would round their logits (|z| up to the scale) to bf16.
    with torch.autocast(queries.device.type, enabled=False):
        if backend == "reference":  # the materialised oracle (one process: the checks refuse it in a ring)
            per_row = _reference_per_row_loss(queries, keys, scale, bias, loss, symmetric, positives,
                                              query_groups, key_groups, validate=reads_values,
                                              hardness=(hardness_mode, hardness_strength, query_ids,
                                                        key_owners), label_smoothing=label_smoothing,
                                              objectives=objectives)
            return reduce_per_row(per_row, reduction, total_rows=queries.shape[0], world_size=1)
        spec = _stats_spec(loss, symmetric, precision, queries, reduction, (queries, keys, scale, bias),
                           hardness_mode, hardness_strength, objectives)
        stats = logit_stats(queries, keys, scale, bias, positives, query_groups, key_groups, spec, backend,
                            group=group if in_ring else None, reduction=reduction, validate=reads_values,
                            query_ids=query_ids, key_owners=key_owners, label_smoothing=label_smoothing,
                            guide_queries=objectives.guide_queries, guide_keys=objectives.guide_keys,
                            matryoshka_term=matryoshka_term)
        per_row = assemble_per_row_loss(spec, positives, stats)
        if label_smoothing:
            per_row = per_row + _smoothing_terms(queries, keys, scale, bias, stats.positive_logit, positives,
                                                 symmetric, label_smoothing, group if in_ring else None)
        return reduce_per_row(per_row, reduction, total_rows=stats.total_rows, world_size=world_size)


@run_eagerly
def _reference_per_row_loss(queries, keys, scale, bias, loss, symmetric, positives, query_groups,
                            key_groups, validate, hardness, label_smoothing, objectives):
    """The materialised loss (a graph break under torch.compile)."""
    if validate:
        _check_values(scale, positives, keys.shape[0], _distinct_positives(objectives, loss, symmetric))
    hardness_mode, hardness_strength, query_ids, key_owners = hardness
    return reference.per_row_loss(
        queries, keys, scale, bias, loss=loss, symmetric=symmetric, positives=positives,
        query_groups=query_groups, key_groups=key_groups, hardness_mode=hardness_mode,
        hardness_strength=hardness_strength, query_ids=query_ids, key_owners=key_owners,
        label_smoothing=label_smoothing, **objectives._asdict(),
    )


_smoothing_terms_eagerly = run_eagerly(smoothing_terms)


def _smoothing_terms(queries, keys, scale, bias, positive_logit, positives, symmetric, label_smoothing,
                     group):
    """:func:`~hf_infcl.ops.label_smoothing.smoothing_terms`; across processes a graph break under
    torch.compile (its all-reduce), as the ring is."""
    compute = smoothing_terms if group is None else _smoothing_terms_eagerly
    return compute(queries, keys, scale, bias, positive_logit, positives, symmetric=symmetric,
                   label_smoothing=label_smoothing, group=group)


def _stats_spec(loss, symmetric, precision, queries, reduction, differentiable, hardness_mode=None,
                hardness_strength=0.0, objectives=NO_OBJECTIVES) -> StatsSpec:
    """The statistics a loss needs, with ``precision="auto"`` resolved (``resolve_precision``).

    The sigmoid loss takes the one-pass route (``StatsSpec.gradients_in_forward``: its gradients
    computed in the forward) when a gradient will be wanted and the reduction gives every row's
    statistic the same gradient; with ``reduction="none"`` the caller's weights are unknown.
    """
    wants_gradient = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in differentiable
    )
    one_pass = loss == "sigmoid" and reduction != "none" and wants_gradient
    return StatsSpec(loss=loss, columns=loss == "softmax" and symmetric,
                     precision=resolve_precision(precision, queries.dtype, queries.device),
                     gradients_in_forward=one_pass, hardness=hardness_mode,
                     hardness_strength=hardness_strength, group_positives=objectives.group_positives,
                     false_negative_margin=objectives.false_negative_margin,
                     false_negative_strategy=objectives.false_negative_strategy)


def assemble_per_row_loss(spec, positives, stats):
    """Per-row loss from the statistics and the positive logits z_{i,p(i)} (docs/contract.md),
    or with ``group_positives`` the positive parts; ``positives`` None: ``keys[:m]``."""
    row_stat, positive_logit = stats.row_stat, stats.positive_logit
    m = row_stat.shape[0]

    def at_positives(per_key):
        return per_key[:m] if positives is None else per_key[positives]

    if spec.loss == "sigmoid":
        # -log sigmoid(z) = softplus(z) - z for each positive, softplus(z) for each negative.
        return row_stat - positive_logit
    if spec.group_positives == "each":  # the parts are sums over the positives: their means
        positive_logit = positive_logit / stats.positive_counts
    if not spec.columns:
        return row_stat - positive_logit
    positive_col_stat = at_positives(stats.col_stat)
    if spec.group_positives is None:
        return (row_stat + positive_col_stat) / 2 - positive_logit
    column_positive = at_positives(stats.column_positive)
    if spec.group_positives == "each":
        column_positive = column_positive / at_positives(stats.column_counts)
    return (row_stat - positive_logit + positive_col_stat - column_positive) / 2


def reduce_per_row(per_row: torch.Tensor, reduction: str, total_rows: int, world_size: int) -> torch.Tensor:
    if reduction == "none":
        return per_row
    if reduction == "sum":
        return per_row.sum()
    return per_row.sum() * (world_size / total_rows)


def resolve_process_group(process_group):
    """(group, world size) for ``process_group``: None is local; "auto" is the default group."""
    if process_group is None:
        return None, 1
    import torch.distributed as dist

    if isinstance(process_group, str):
        if process_group != "auto":
            raise ValueError(f"process_group must be None, 'auto' or a process group, got {process_group!r}")
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        process_group = dist.group.WORLD
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group was given but torch.distributed is not initialised")
    return process_group, dist.get_world_size(process_group)


# --------------------------------------------------------------------------------------------
# Argument checks: every one raises before any computation, naming the argument.


def _check_features(name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.ndim != 2:
        raise ValueError(f"{name} must be 2-D [rows, width], got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def _check_index_vector(name, tensor, length, device):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(tensor).__name__}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {tensor.dtype}")
    if tensor.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but queries are on {device}")


def _scale_at_hand(logit_scale) -> bool:
    """Whether ``logit_scale`` is a number, its value on the host (a bool is refused elsewhere)."""
    return isinstance(logit_scale, (int, float)) and not isinstance(logit_scale, bool)


def as_scalar_tensor(name, value, dtype, device, allow_none):
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a float or a scalar tensor, got None")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a scalar tensor, got a bool")
    if isinstance(value, (int, float)):
        # a fill, not torch.tensor: its copy of a host value to the GPU synchronises with the stream
        return torch.full((), float(value), dtype=dtype, device=device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float or a scalar tensor, got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {value.dtype}")
    return value.reshape(()).to(device=device, dtype=dtype)


def check_arguments(queries, keys, logit_scale, logit_bias, loss, symmetric, positives,
                     query_groups, key_groups, reduction, backend, precision, in_ring=False,
                     check_values=True, options_checked=False, distinct_positives=False):
    """Validate everything; return (scale tensor, bias tensor or None, positives [m] int64 or None).

    ``positives`` None stays None: the rows' positives are ``keys[:m]`` in order, which every
    backend takes without an index tensor (no range to check, no sort of the positives).

    ``in_ring``: one rank of several, which may hold no rows (the ring checks the group has some).
    ``check_values=False`` leaves out the checks that read values (``value_check.check_values``), for
    callers that have them made later (one process's op makes them itself). ``options_checked``: the options
    come from a :class:`LossOptions` (checked when it was built). ``distinct_positives``: no two
    rows may share a positive key (the score filter with the symmetric softmax loss).
    """
    _check_features("queries", queries)
    _check_features("keys", keys)
    if not options_checked:
        for field, value in (("loss", loss), ("reduction", reduction), ("precision", precision),
                             ("backend", backend), ("symmetric", symmetric)):
            check_option(field, value)

    if keys.dtype != queries.dtype:
        raise TypeError(f"keys have dtype {keys.dtype} but queries have {queries.dtype}; they must match")
    if keys.device != queries.device:
        raise ValueError(f"keys are on {keys.device} but queries are on {queries.device}")
    m, width = queries.shape
    n_keys, key_width = keys.shape
    if key_width != width:
        raise ValueError(f"keys have width {key_width} but queries have width {width}; they must match")
    if m == 0 and not in_ring:
        raise ValueError("queries has no rows (m = 0)")
    if in_ring and backend == "reference":
        raise ValueError("backend='reference' materialises the logits of one process only; "
                         "use 'torch' or 'triton' with a process group")
    if width == 0:
        raise ValueError("queries and keys have width 0")
    if backend == "triton" and queries.device.type != "cuda":
        raise ValueError(f"backend='triton' needs CUDA tensors, got queries on {queries.device}")

    device = queries.device
    if positives is None:
        if n_keys < m:
            raise ValueError(
                f"keys has {n_keys} rows but queries has {m}: keys[:m] must be the rows' positives "
                "(pass positives= to pair them otherwise)"
            )
    else:
        _check_index_vector("positives", positives, m, device)
        positives = positives.long()

    if (query_groups is None) != (key_groups is None):
        given = "query_groups" if key_groups is None else "key_groups"
        missing = "key_groups" if key_groups is None else "query_groups"
        raise ValueError(f"{given} was given without {missing}; group masking needs both")
    if query_groups is not None:
        _check_index_vector("query_groups", query_groups, m, device)
        _check_index_vector("key_groups", key_groups, n_keys, device)

    acc = accumulation_dtype(queries.dtype)
    scale = as_scalar_tensor("logit_scale", logit_scale, acc, device, allow_none=False)
    if _scale_at_hand(logit_scale):  # checked here, not read back
        _check_scale_value(float(logit_scale))
    bias = as_scalar_tensor("logit_bias", logit_bias, acc, device, allow_none=True)
    if check_values:
        _check_values(scale, positives, n_keys, distinct_positives)
    return scale, bias, positives


def _check_objectives(queries, keys, query_groups, group_positives, false_negative_margin,
                      false_negative_strategy, guide_queries, guide_keys) -> Objectives:
    """Validate the several positives and the score filter (docs/contract.md, "Errors"); return
    them as :class:`Objectives`, the margin as a float. A guide is compared with ``queries`` and
    ``keys`` only where they are 2-D tensors; their own checks follow."""
    false_negative_margin = check_objective_options(group_positives, false_negative_margin,
                                                    false_negative_strategy)
    if group_positives is not None and query_groups is None:
        raise ValueError(f"group_positives={group_positives!r} needs query_groups and key_groups (the keys "
                         "of a row's group are its positives)")
    check_second_embeddings(queries, keys, guide_queries, guide_keys, "guide", required=False)
    if guide_queries is not None and false_negative_margin is None:
        raise ValueError("guide_queries/guide_keys were given without false_negative_margin; the guide "
                         "only scores keys for the score filter")
    return Objectives(group_positives, false_negative_margin, false_negative_strategy, guide_queries,
                      guide_keys)


def check_second_embeddings(queries, keys, second_queries, second_keys, model: str, *,
                            required: bool) -> None:
    """The one check of a second model's embeddings of the same rows and keys, ``{model}_queries``
    and ``{model}_keys`` (the score filter's guide, distillation's teacher): both or neither (both
    when ``required``), 2-D floating point, of the dtype and device of ``queries`` and ``keys``, with
    their row counts, of one nonzero width of their own. They are compared with ``queries`` and
    ``keys`` only where these are 2-D tensors; their own checks follow."""
    names = (f"{model}_queries", f"{model}_keys")
    given = [name for name, tensor in zip(names, (second_queries, second_keys)) if tensor is not None]
    if len(given) == 1:
        missing = names[1 - names.index(given[0])]
        raise ValueError(f"{given[0]} was given without {missing}; the {model}'s similarities need both")
    if not given:
        if required:
            raise TypeError(f"{names[0]} and {names[1]} must be torch.Tensors, got None")
        return
    for name, second, features, role in ((names[0], second_queries, queries, "queries"),
                                         (names[1], second_keys, keys, "keys")):
        _check_features(name, second)
        if not (torch.is_tensor(features) and features.ndim == 2):
            continue  # the features' own check names them
        if second.dtype != features.dtype:
            raise TypeError(f"{name} has dtype {second.dtype} but {role} have {features.dtype}; they must "
                            "match")
        if second.device != features.device:
            raise ValueError(f"{name} is on {second.device} but {role} are on {features.device}")
        if second.shape[0] != features.shape[0]:
            raise ValueError(f"{name} has {second.shape[0]} rows but {role} has {features.shape[0]}; the "
                             f"{model} embeds the same {role}")
    if second_queries.shape[1] != second_keys.shape[1]:
        raise ValueError(f"{names[0]} have width {second_queries.shape[1]} but {names[1]} have width "
                         f"{second_keys.shape[1]}; they must match")
    if second_queries.shape[1] == 0:
        raise ValueError(f"{names[0]} and {names[1]} have width 0")


def _check_hardness(loss, queries, keys, hardness_mode, hardness_strength, query_ids, key_owners):
    """Validate the hardness arguments; return (mode, strength, query_ids, key_owners), the mode
    None when the strength is 0 (no offset: the plain loss, whatever ids were given)."""
    check_hardness(hardness_mode, hardness_strength)
    if hardness_mode is None:
        if hardness_strength > 0.0:
            raise ValueError(f"hardness_strength={hardness_strength!r} needs a hardness_mode")
        if query_ids is not None or key_owners is not None:
            raise ValueError("query_ids/key_owners were given without hardness_mode; they only say which "
                             "keys the hardness offset selects")
        return None, 0.0, None, None
    if loss != "softmax":
        raise ValueError(f"hardness_mode needs loss='softmax' (it offsets softmax logits), got loss={loss!r}")
    if query_ids is None or key_owners is None:
        raise ValueError(f"hardness_mode={hardness_mode!r} needs query_ids and key_owners (which keys each "
                         "row owns)")
    _check_index_vector("query_ids", query_ids, queries.shape[0], queries.device)
    _check_index_vector("key_owners", key_owners, keys.shape[0], queries.device)
    if hardness_strength == 0.0:
        return None, 0.0, None, None
    return hardness_mode, float(hardness_strength), query_ids.long(), key_owners.long()


class InfCLLoss(nn.Module):
    """Module form of :func:`contrastive_loss`: options in ``__init__``, tensors in ``forward``.

    ``logit_scale``/``logit_bias`` given here are the defaults for ``forward``; pass an
    ``nn.Parameter`` to learn them inside this module, or pass the model's own at call time.

    The options are checked once, here, and held as a frozen :class:`LossOptions` (``.options``);
    ``.loss``, ``.symmetric``, ``.reduction``, ``.backend`` and ``.precision`` read it, and
    assigning one of them replaces it with a checked copy. ``.label_smoothing``,
    ``.group_positives``, ``.false_negative_margin``, ``.false_negative_strategy``,
    ``.matryoshka_dims`` and ``.matryoshka_weights`` are plain attributes, checked here and with the
    other arguments on every call; ``forward`` takes the score filter's guide tensors. (Not to be
    confused with ``hf_infcl.losses.InfCLLoss``, the sentence-transformers loss, which takes a model.)
    """

    loss = OptionAttribute()
    symmetric = OptionAttribute()
    reduction = OptionAttribute()
    backend = OptionAttribute()
    precision = OptionAttribute()

    def __init__(
        self,
        logit_scale: float | torch.Tensor = 1.0,
        logit_bias: float | torch.Tensor | None = None,
        *,
        loss: LossKind = "softmax",
        symmetric: bool = True,
        reduction: Reduction = "mean",
        process_group=None,
        backend: BackendName | BlockOps = "auto",
        precision: Precision = "auto",
        label_smoothing: float = 0.0,
        group_positives: GroupPositives | None = None,
        false_negative_margin: float | None = None,
        false_negative_strategy: FalseNegativeStrategy = "absolute",
        matryoshka_dims: Sequence[int] | None = None,
        matryoshka_weights: Sequence[float] | None = None,
    ):
        super().__init__()
        check_matryoshka(matryoshka_dims, matryoshka_weights)  # the widths against the features' per call
        self.options = LossOptions(loss=loss, symmetric=symmetric, reduction=reduction, backend=backend,
                                   precision=precision)
        false_negative_margin = check_objective_options(group_positives, false_negative_margin,
                                                        false_negative_strategy)
        check_label_smoothing(label_smoothing, loss, filtered=false_negative_margin is not None)
        self.label_smoothing = label_smoothing
        self.group_positives = group_positives
        self.false_negative_margin = false_negative_margin
        self.false_negative_strategy = false_negative_strategy
        self.matryoshka_dims = matryoshka_dims
        self.matryoshka_weights = matryoshka_weights
        self.logit_scale = logit_scale
        self.logit_bias = logit_bias
        self.process_group = process_group

    def forward(self, queries, keys, logit_scale=None, logit_bias=None, positives=None,
                query_groups=None, key_groups=None, guide_queries=None, guide_keys=None):
        options = self.options  # checked when built: not again on every call
        scale = self.logit_scale if logit_scale is None else logit_scale
        bias = self.logit_bias if logit_bias is None else logit_bias
        objectives = Objectives(self.group_positives, self.false_negative_margin,
                                self.false_negative_strategy, guide_queries, guide_keys)
        return _contrastive_loss(
            queries, keys, scale, bias, positives, query_groups, key_groups, self.process_group, options.loss,
            options.symmetric, options.reduction, options.backend, options.precision, options_checked=True,
            label_smoothing=self.label_smoothing, objectives=objectives, matryoshka_dims=self.matryoshka_dims,
            matryoshka_weights=self.matryoshka_weights,
        )

    def extra_repr(self) -> str:
        extra = ""
        if self.label_smoothing:
            extra += f", label_smoothing={self.label_smoothing}"
        if self.group_positives is not None:
            extra += f", group_positives={self.group_positives!r}"
        if self.false_negative_margin is not None:
            extra += (f", false_negative_margin={self.false_negative_margin}, "
                      f"false_negative_strategy={self.false_negative_strategy!r}")
        if self.matryoshka_dims is not None:
            extra += f", matryoshka_dims={tuple(self.matryoshka_dims)}"
            if self.matryoshka_weights is not None:
                extra += f", matryoshka_weights={tuple(self.matryoshka_weights)}"
        return (
            f"loss={self.loss!r}, symmetric={self.symmetric}, reduction={self.reduction!r}, "
            f"backend={self.backend!r}{extra}"
        )
