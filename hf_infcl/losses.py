"""sentence-transformers adapter: ``losses.InfCLLoss``, a drop-in for MNRL, MNSRL and CachedMNRL,
``losses.InfCLGISTLoss``, a drop-in for GISTEmbedLoss and CachedGISTEmbedLoss, and
``losses.InfCLDistillLoss``, in-batch distillation from a teacher's embeddings (their own docstrings).

``from hf_infcl import losses; loss = losses.InfCLLoss(model)`` inside a
``SentenceTransformerTrainer``. The loss is the one of sentence-transformers'
``MultipleNegativesRankingLoss`` with its ``directions`` and ``partition_mode`` (``symmetric=True``
is ``MultipleNegativesSymmetricRankingLoss``), computed by ``hf_infcl.contrastive_loss`` without a
batch x batch score matrix:

- columns ``(anchor, positive, negative_1, ...)``: every negative column is an extra candidate
  for every anchor, exactly as sentence-transformers concatenates ``docs_all``;
- ``directions`` beyond ``"query_to_doc"`` under ``partition_mode="joint"``: one call over rows
  ``[anchor, positive]`` and zero-padded key blocks, with group ids leaving out the self pairs
  (docs/contract.md, "Directions and partition modes"); ``"per_direction"`` with
  ``"doc_to_query"`` is the symmetric call;
- ``mini_batch_size=N`` caches the gradients w.r.t. the embeddings (GradCache) through
  sentence-transformers' own ``CachedLossMixin`` (sentence-transformers >= 6), but computes the
  loss of the whole batch in ONE fused call instead of
  CachedMNRL's per-chunk Python loop; ``no_grad_mini_batch_size`` runs the gradient-free pass in
  mini-batches of its own size (``hf_infcl.no_grad_mini_batches``: exact without dropout);
- ``hardness_mode`` with ``hardness_strength > 0``: MNRL's detached offset on the selected
  ``query_to_doc`` negatives, computed inside the same call (``contrastive_loss``'s
  ``hardness_mode``, with each example's id and each document's owner);
- ``margin`` / ``margin_strategy``: GIST's false-negative filter with the model as its own guide,
  ``contrastive_loss``'s ``false_negative_margin`` without guide tensors (its scores are the very
  products of the call, detached);
- with several processes and ``gather_across_devices=True`` the loss runs over every process's rows
  and keys with the hf_infcl ring (instead of an all-gather of the embeddings); the default,
  False as in sentence-transformers, keeps negatives local to each process.

Its arguments keep sentence-transformers' names, mapped here to ``contrastive_loss``'s: ``scale``
is ``logit_scale``, ``gather_across_devices`` is ``process_group="auto"`` (False: None);
``directions`` and ``partition_mode`` choose the call's rows, keys, groups and ``symmetric``; the
other options (``backend``, ``precision``) are held as a checked ``LossOptions``
(docs/contract.md, "Options", has the table for every entry point). Not to be confused with
``hf_infcl.InfCLLoss``, the module over embedding tensors that this class calls.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .batch_statistics import check_no_batch_statistics
from .distillation import contrastive_distillation_loss
from .loss import contrastive_loss
from .no_grad_mini_batches import NoGradMiniBatchesMixin, check_no_grad_mini_batch_size
from .ops.options import (
    HARDNESS_MODES,
    BackendName,
    FalseNegativeStrategy,
    HardnessMode,
    LossOptions,
    OptionAttribute,
    Precision,
    check_bool,
    check_choice,
    check_distillation_weight,
    check_hardness_strength,
    check_objective_options,
    check_option,
)
from .sharded_replays import ShardedReplaysMixin

logger = logging.getLogger(__name__)

try:  # sentence-transformers >= 6: the shared GradCache machinery and the merged column forward
    from sentence_transformers import util as _st_util
    from sentence_transformers.base.losses.gradcache import CachedLossMixin, _create_minibatch
    from sentence_transformers.base.losses.merged_forward import embed_columns as _st_embed_columns
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hf_infcl.losses needs sentence-transformers 6 or newer: `pip install 'sentence-transformers>=6'`"
    ) from error


INFCL_CITATION = """
@misc{cheng2024breakingmemorybarriernear,
      title={Breaking the Memory Barrier: Near Infinite Batch Size Scaling for Contrastive Loss},
      author={Zesen Cheng and Hang Zhang and Kehan Li and Sicong Leng and Zhiqiang Hu and Fei Wu
              and Deli Zhao and Xin Li and Lidong Bing},
      year={2024},
      eprint={2410.17243},
      archivePrefix={arXiv},
      primaryClass={cs.CV},
      url={https://arxiv.org/abs/2410.17243},
}
"""


# --------------------------------------------------------------------------------------------
# MNRL's directions and partition modes (docs/contract.md, "Directions and partition modes").

QUERY_TO_DOC, QUERY_TO_QUERY, DOC_TO_QUERY, DOC_TO_DOC = (
    "query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"
)
Direction = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]
PartitionMode = Literal["joint", "per_direction"]
MNRL_DEFAULT = ((QUERY_TO_DOC,), "joint")
MNSRL = ((QUERY_TO_DOC, DOC_TO_QUERY), "per_direction")  # what symmetric=True stands for
# Group ids of the joint call: example i of process r is r * _RANK_STRIDE + i, so that ids differ
# across processes (the ring compares them) whatever the processes' batch sizes; _NOBODY is no
# example's id, for keys that no row may lose.
_RANK_STRIDE = 2**32
_NOBODY = -1


def _mnrl_error(message: str, more: str) -> ValueError:
    """MNRL's message first (code matching it keeps working), then what InfCLLoss adds."""
    return ValueError(f"{message} {more}")


def _checked_directions(directions, partition_mode) -> tuple[str, ...]:
    """``directions`` as MNRL stores it (a tuple, as given), after MNRL's checks, in its order."""
    if isinstance(directions, str):  # tuple() would split it into letters
        raise ValueError(f"directions must be a tuple of direction names, e.g. ({directions!r},); "
                         "got a string")
    directions = tuple(directions)
    # MNRL's set, which its messages print (in an order that varies with the string hashing).
    valid_directions = {"query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"}
    if not directions:
        raise _mnrl_error("At least one direction must be specified.", "(directions of InfCLLoss)")
    if not set(directions).issubset(valid_directions):
        raise _mnrl_error(
            f"Invalid directions: {set(directions) - valid_directions}. Valid: {valid_directions}",
            "(directions of InfCLLoss)",
        )
    if QUERY_TO_DOC not in directions:
        raise _mnrl_error("'query_to_doc' direction is required (contains the positive pair).",
                          f"InfCLLoss got directions={directions!r}.")
    if partition_mode not in ("joint", "per_direction"):
        raise _mnrl_error(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode}",
                          "(partition_mode of InfCLLoss)")
    if partition_mode == "per_direction" and set(directions) & {QUERY_TO_QUERY, DOC_TO_DOC}:
        raise _mnrl_error(
            "partition_mode='per_direction' requires every direction's candidate pool to include the "
            "positive pair. 'query_to_query' and 'doc_to_doc' only contain same-type similarities and never "
            "include the positive, making the per-direction loss ill-defined. Use partition_mode='joint' "
            "instead.",
            f"InfCLLoss got directions={directions!r}.",
        )
    return directions


def _check_hardness(hardness_mode, hardness_strength) -> None:
    """The one check of a hardness setting (``hf_infcl.ops.options.check_hardness``'s two parts),
    its ValueErrors in MNRL's words, and MNRL's warning.

    MNRL applies the weighting only for a ``hardness_mode`` with ``hardness_strength > 0``: every
    other valid setting is MNRL's loss without it.
    """
    try:
        check_choice("hardness_mode", hardness_mode, HARDNESS_MODES, optional=True)
    except ValueError:
        valid_hardness_modes = {None, *HARDNESS_MODES}  # the set MNRL's message prints
        raise _mnrl_error(f"hardness_mode must be one of {valid_hardness_modes}, got {hardness_mode!r}",
                          "(hardness_mode of InfCLLoss)") from None
    try:
        check_hardness_strength(hardness_strength)
    except ValueError:
        raise _mnrl_error("hardness_strength must be non-negative.", f"Got {hardness_strength!r}.") from None
    if hardness_mode is not None and hardness_strength == 0.0:  # MNRL's warning: it changes nothing
        logger.warning(
            f"hardness_mode={hardness_mode!r} is set but hardness_strength=0.0, so hardness weighting has no "
            "effect. Set hardness_strength to a positive value to enable hardness weighting."
        )


def _checked_margin(margin, margin_strategy, directions, partition_mode) -> float | None:
    """The one check of InfCLLoss's score filter (``hf_infcl.ops.options``'s, under GIST's names),
    against the partition it filters; returns the margin as a float (or None: no filter)."""
    margin = check_objective_options(None, margin, margin_strategy,
                                     names=("group_positives", "margin", "margin_strategy"))
    if margin is not None and partition_mode == "joint" and DOC_TO_QUERY in directions:
        # The second copy of the positive pair would be a candidate scoring exactly the positive's
        # score: the filter would keep or drop it by rounding at margin 0, drop it for any margin > 0.
        raise ValueError(
            f"margin={margin!r} is not defined with partition_mode='joint' and 'doc_to_query' in directions: "
            "the joint softmax holds each positive pair twice (query_to_doc and doc_to_query), and the "
            "filter cannot tell the second copy from a false negative. Use partition_mode='per_direction' "
            "(with directions=('query_to_doc', 'doc_to_query')), drop 'doc_to_query', or leave margin None."
        )
    return margin


def _process_rank() -> int:
    """This process's rank in the default group ("auto", what the ring runs over); 0 without one."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _loss_operands(anchors, columns, directions, partition_mode, rank, hardness=False):
    """(queries, keys, label arguments) of the one ``contrastive_loss`` call that computes MNRL's
    loss for these directions; ``symmetric`` (held in the options) adds the column term of
    ``per_direction``'s ``doc_to_query``. ``columns``: positives, then each negatives column.
    ``hardness``: add the ids the hardness offset selects its negatives by (docs/contract.md)."""
    # sentence-transformers' candidate order: all positives, then each negatives column. The
    # first m candidates are the anchors' positives, which is hf_infcl's default pairing.
    docs = torch.cat(columns) if len(columns) > 1 else columns[0]
    ids = _example_ids(anchors, rank)
    if partition_mode == "per_direction" or set(directions) == {QUERY_TO_DOC}:
        queries, keys, labels = anchors, docs, {}
    else:
        queries, keys, labels = _joint_operands(anchors, columns[0], docs, len(columns), set(directions), ids)
    if hardness:
        # Every layout starts with the query_to_doc block, the only one offset: a document's
        # owner is its example; every later key is nobody's.
        owners = torch.full((len(keys),), _NOBODY, dtype=ids.dtype, device=ids.device)
        owners[: len(docs)] = ids.repeat(len(columns))
        labels = dict(labels, query_ids=ids, key_owners=owners)
    return queries, keys, labels


def _example_ids(anchors, rank):
    """Example i of process ``rank``: ``rank * _RANK_STRIDE + i``, unique across processes."""
    return torch.arange(len(anchors), device=anchors.device) + rank * _RANK_STRIDE


def _joint_operands(anchors, positives, docs, n_columns, directions, ids):
    """Rows and keys whose row term is the joint partition (docs/contract.md): each row carries the
    query and, when a ``doc_*`` direction is selected, its positive ``[q_i, d_i]``; each key block
    meets one half only (zeros in the other); the groups leave out each query's own
    ``query_to_query`` key and each example's own documents in ``doc_to_doc``."""
    doc_half = bool(directions & {DOC_TO_QUERY, DOC_TO_DOC})

    def nobody(count):
        return torch.full((count,), _NOBODY, dtype=ids.dtype, device=ids.device)

    blocks = [(docs, False, nobody(len(docs)))]  # (keys, meets the document half, key groups)
    if QUERY_TO_QUERY in directions:
        blocks.append((anchors, False, ids))
    if DOC_TO_QUERY in directions:
        blocks.append((anchors, True, nobody(len(anchors))))
    if DOC_TO_DOC in directions:
        blocks.append((docs, True, ids.repeat(n_columns)))  # a document's group: its example's id
    rows = torch.cat([anchors, positives], dim=1) if doc_half else anchors
    keys = torch.cat([_in_half(block, document_half) if doc_half else block
                      for block, document_half, _ in blocks])
    if not directions & {QUERY_TO_QUERY, DOC_TO_DOC}:
        return rows, keys, {}  # nothing to leave out
    return rows, keys, {"query_groups": ids, "key_groups": torch.cat([groups for *_, groups in blocks])}


def _in_half(block: Tensor, document_half: bool) -> Tensor:
    """``block`` padded with zeros to meet only the query half or only the document half of the rows."""
    zeros = torch.zeros_like(block)
    return torch.cat([zeros, block] if document_half else [block, zeros], dim=1)


# --------------------------------------------------------------------------------------------


def _similarity_kind(similarity_fct) -> str:
    """'cos_sim' or 'dot_score' for the similarity functions the fused path supports."""
    if isinstance(similarity_fct, nn.Module):
        # nn.Module.__setattr__ would register it as a submodule (its parameters in the optimizer)
        # and the fused path could never call it: refuse it by name instead of ignoring it.
        raise TypeError(
            "similarity_fct must be sentence_transformers.util.cos_sim or util.dot_score, not an nn.Module: "
            f"InfCLLoss computes the loss with fused dot products and cannot call a module; got "
            f"{type(similarity_fct).__name__}. Use MultipleNegativesRankingLoss for a learned similarity."
        )
    if similarity_fct is _st_util.cos_sim:
        return "cos_sim"
    if similarity_fct is _st_util.dot_score:
        return "dot_score"
    # The same functions reached through another import path (or a re-export in another release).
    name = getattr(similarity_fct, "__name__", None)
    module = getattr(similarity_fct, "__module__", "") or ""
    if module.startswith("sentence_transformers") and name in ("cos_sim", "dot_score"):
        return name
    raise ValueError(
        "similarity_fct must be sentence_transformers.util.cos_sim or util.dot_score: InfCLLoss computes the "
        f"loss with fused dot products and cannot call an arbitrary function; got {similarity_fct!r}. "
        "Use MultipleNegativesRankingLoss for other similarity functions."
    )


def _column_rows(features: dict[str, Any]) -> int:
    """Number of texts in one column's features (padded, flattened or EmbeddingBag inputs)."""
    if "offsets" in features:  # StaticEmbedding: a flat token stream with one offset per text
        return len(features["offsets"])
    if "cu_seq_lens_q" in features:  # flattened (unpadded) inputs
        return len(features["cu_seq_lens_q"]) - 1
    for key in ("input_ids", "attention_mask"):
        value = features.get(key)
        if isinstance(value, Tensor) and value.ndim > 0:
            return value.shape[0]
    for value in features.values():
        if isinstance(value, Tensor) and value.ndim > 0:
            return value.shape[0]
    raise ValueError(f"cannot tell how many texts a column holds from its features {sorted(features)}")


def _check_columns(sentence_features: list[dict[str, Any]], cached: bool, loss_name: str) -> None:
    """At least two columns of equal length; ``loss_name`` is named in the message."""
    if len(sentence_features) < 2:
        # the words of MNRL (which embeds first) and of CachedMNRL, then what the columns are
        counted = "inputs" if cached else "embeddings"
        raise ValueError(
            f"Expected at least 2 {counted}, got {len(sentence_features)}: {loss_name} needs the columns "
            "(anchor, positive[, negative_1, ...])"
        )
    rows = [_column_rows(features) for features in sentence_features]
    if len(set(rows)) != 1:
        raise ValueError(
            "every column must hold the same number of texts (one positive and one negative per anchor "
            f"in each column); got {rows} texts in columns 0..{len(rows) - 1}"
        )


def _embed_columns(model, sentence_features):
    """Embed every column exactly as MultipleNegativesRankingLoss does (same RNG use, so dropout matches)."""
    return _st_embed_columns(model, sentence_features)


class InfCLLoss(ShardedReplaysMixin, NoGradMiniBatchesMixin, CachedLossMixin, nn.Module):
    """Exact in-batch-negatives contrastive loss (InfoNCE) without a batch x batch matrix (Inf-CL).

    Args:
        model: the SentenceTransformer model.
        scale: multiplies the similarities (``scale = 1 / temperature``), as in
            MultipleNegativesRankingLoss; ``20.0`` is ``temperature = 0.05``.
        similarity_fct: ``sentence_transformers.util.cos_sim`` (the embeddings are L2-normalised,
            then dotted) or ``util.dot_score``. Other functions raise ``ValueError`` (an
            ``nn.Module``: ``TypeError``), here or when assigned later; an assignment
            (``loss.similarity_fct = util.dot_score``) takes effect at the next forward, as in MNRL.
        symmetric: True is MultipleNegativesSymmetricRankingLoss, short for
            ``directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"`` (and
            cannot be combined with other values of them); False leaves both as given.
            Assigning it later sets both: True to those, False to MNRL's defaults.
        mini_batch_size: None embeds the whole batch with gradients, like
            MultipleNegativesRankingLoss (unless ``mini_batch_num_tokens`` is set). An integer
            embeds it in chunks of that many texts
            with gradient caching (like CachedMultipleNegativesRankingLoss, dropout replayed),
            and computes the loss of the whole batch in one fused call. A model with BatchNorm
            layers in training mode is refused at its forward (each mini-batch would be
            normalised alone; ``hf_infcl.batch_statistics``).
        show_progress_bar: show the mini-batch progress of gradient caching.
        gather_across_devices: with several processes, compute the loss over every process's
            anchors and candidates (the hf_infcl ring; no embedding is all-gathered). False, the
            default as in MultipleNegativesRankingLoss, keeps each process's negatives local.
        backend: the hf_infcl backend: ``"auto"`` (Triton on CUDA when available, else tiled
            PyTorch), ``"torch"``, ``"triton"`` or ``"reference"``.
        precision: matmul precision of the loss for fp32 embeddings (``hf_infcl.ops.options.PRECISIONS``):
            ``"auto"`` (TF32 on CUDA in every backend, exact fp32 elsewhere), ``"tf32"``, or
            ``"ieee"`` (exact fp32). bf16/fp16 embeddings are unaffected.
        mini_batch_num_tokens: gradient caching with mini-batches packed by token count, as in
            CachedMultipleNegativesRankingLoss: each holds as many consecutive texts as fit in this
            many non-padding tokens (a longer text alone), whatever ``mini_batch_size`` is; given
            alone, it turns gradient caching on (sentence-transformers >= 6 only).
        no_grad_mini_batch_size: texts per mini-batch of gradient caching's gradient-free pass; None
            (default) is ``mini_batch_size``. That pass keeps no activations, so larger mini-batches
            fit there and run faster; the replays keep ``mini_batch_size``. They then cannot draw
            the first pass's random numbers again, so the gradients are exact (to rounding) only for
            a model that draws none in training (dropout 0, as ``hf_infcl.grad_cache.cached_step``'s
            ``no_grad_chunk_size``); with a dropout layer active in training mode they are
            approximate, and the first such forward warns once. Needs ``mini_batch_size``; refused
            with ``mini_batch_num_tokens`` (ValueError). Assignable later (checked).
        directions: which similarities compete with each (anchor, positive) pair, as in
            MultipleNegativesRankingLoss: ``"query_to_doc"`` (required: every document),
            ``"query_to_query"`` (the other anchors), ``"doc_to_query"`` (from the positive: every
            anchor), ``"doc_to_doc"`` (from the positive: every document of the other examples).
        partition_mode: ``"joint"``, one softmax over every selected direction, or
            ``"per_direction"``, one per direction, averaged (``"query_to_doc"`` and
            ``"doc_to_query"`` only). docs/contract.md has the formulas; both are exact, without
            a batch x batch matrix, across processes too. Assignable later, as in MNRL (checked).
        hardness_mode, hardness_strength: MNRL's hardness weighting: with a mode and a positive
            strength ``alpha``, ``alpha * similarity`` (unscaled, no gradient through it) is added
            to the ``query_to_doc`` logits of the negatives the mode selects:
            ``"in_batch_negatives"`` (the other examples' documents), ``"hard_negatives"`` (the
            example's own negative columns) or ``"all_negatives"`` (every document but the
            positive). The other directions (``per_direction``'s ``doc_to_query`` included) keep
            their plain logits. Computed inside the fused kernels, across processes too; both are
            assignable later, as in MNRL (checked; a mode with strength 0 warns, as in MNRL).
        margin_strategy, margin: false-negative filtering by the model's own scores, under the
            names of GISTEmbedLoss (whose rule it is, with the model as its own guide; the rule of
            Qwen3-Embedding and NV-Retriever). ``margin=None`` (default) filters nothing: MNRL's
            loss. With a finite float, anchor i's candidate j is left out when its similarity
            (``similarity_fct``, unscaled, detached) exceeds the positive pair's minus the margin:
            ``s_ij > s_ip - margin`` ("absolute", default) or ``s_ij > s_ip - |s_ip| * margin``
            ("relative"); the positive is always kept. Every direction's candidates are filtered
            against the threshold of its example's positive pair (``doc_to_query``: the queries
            scored from the positive). A negative margin leaves out only candidates more than
            ``|margin|`` above the positive (Qwen3-Embedding: -0.1 on the cosine). Not defined with
            ``"doc_to_query"`` under ``partition_mode="joint"`` (that softmax holds the positive pair
            twice; ValueError). Computed inside the fused kernels (the mask is never stored), across
            processes too; both are assignable later (checked).

    Inputs:
        (anchor, positive) pairs, or (anchor, positive, negative_1, ..., negative_n) tuples;
        labels are ignored. Every negative column is a candidate for every anchor of the batch.

    Sharded models: under FSDP2 a cached step gathers each unit once and reduce-scatters once;
    under DeepSpeed ZeRO-2/3 a cached step hands ZeRO each gradient once, at the last replay
    (``hf_infcl.sharded_replays``).

    Example:
        ::

            from hf_infcl import losses
            loss = losses.InfCLLoss(model, mini_batch_size=256)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=dataset, loss=loss)
    """

    # The loss options, held as a frozen LossOptions (``.options``) checked once, in __init__. Its
    # ``symmetric`` follows directions and partition_mode (the ``symmetric`` property below).
    backend = OptionAttribute()
    precision = OptionAttribute()

    def __init__(
        self,
        model,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
        symmetric: bool = False,
        mini_batch_size: int | None = None,
        show_progress_bar: bool = False,
        gather_across_devices: bool = False,
        backend: BackendName = "auto",
        precision: Precision = "auto",
        mini_batch_num_tokens: int | None = None,
        directions: tuple[Direction, ...] = MNRL_DEFAULT[0],
        partition_mode: PartitionMode = MNRL_DEFAULT[1],
        hardness_mode: HardnessMode | None = None,
        hardness_strength: float = 0.0,
        margin_strategy: FalseNegativeStrategy = "absolute",
        margin: float | None = None,
        no_grad_mini_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        _check_scale(scale)
        # Checked here, first: assigning similarity_fct (__setattr__) sets _similarity_kind.
        self.similarity_fct = similarity_fct
        # A backend name only, not a block-ops object: get_config_dict saves it as JSON.
        check_option("backend", backend, block_ops=False)
        self.options = LossOptions(loss="softmax", symmetric=symmetric, reduction="mean", backend=backend,
                                   precision=precision)
        self._margin_filter = (None, "absolute")  # no filter until checked against the partition
        self._set_partition(*_with_symmetric(symmetric, directions, partition_mode))
        self._set_margin_filter(margin, margin_strategy)
        _check_hardness(hardness_mode, hardness_strength)
        self._hardness = (hardness_mode, hardness_strength)
        caches = _caches_gradients(model, mini_batch_size, mini_batch_num_tokens, no_grad_mini_batch_size)

        self.model = model
        self.scale = float(scale)
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.no_grad_mini_batch_size = no_grad_mini_batch_size  # checked against the two above
        self.show_progress_bar = show_progress_bar
        self.gather_across_devices = gather_across_devices
        # Losses that back-propagate from a hook (gradient caching) say so: MatryoshkaLoss and
        # AdaptiveLayerLoss read this to treat them specially.
        self.uses_gradient_cache = caches

    def __setattr__(self, name: str, value: Any) -> None:
        # MultipleNegativesRankingLoss reads ``self.similarity_fct`` at every forward, so assigning it
        # after construction takes effect; the fused path reads the kind checked here, so an assignment
        # is checked (and honoured) here too, before nn.Module.__setattr__ could file a module away.
        if name == "similarity_fct":
            super().__setattr__("_similarity_kind", _similarity_kind(value))
        if name == "calculate_loss":
            value = _OneCallMatryoshka.around(self, value)
        super().__setattr__(name, value)

    # MNRL's hyperparameters, assignable after construction as in MNRL (CachedMNRL delegates the
    # assignment to its MNRL); here every assignment is checked as in __init__, against the other
    # attribute of the pair, and takes effect at the next forward.

    @property
    def directions(self) -> tuple[str, ...]:
        return self._directions

    @directions.setter
    def directions(self, value) -> None:
        self._set_partition(value, self.partition_mode)

    @property
    def partition_mode(self) -> str:
        return self._partition_mode

    @partition_mode.setter
    def partition_mode(self, value) -> None:
        self._set_partition(self.directions, value)

    @property
    def symmetric(self) -> bool:
        """Whether the loss is MNSRL's: both directions, one softmax each, averaged."""
        return self.options.symmetric

    @symmetric.setter
    def symmetric(self, value: bool) -> None:
        check_option("symmetric", value)
        self._set_partition(*(MNSRL if value else MNRL_DEFAULT))

    def _set_partition(self, directions, partition_mode) -> None:
        # nn.Module.__setattr__ keeps plain values as plain attributes.
        directions = _checked_directions(directions, partition_mode)
        _checked_margin(*self._margin_filter, directions, partition_mode)
        self._directions = directions
        self._partition_mode = partition_mode
        # contrastive_loss's column term is per_direction's doc_to_query term (docs/contract.md).
        symmetric = partition_mode == "per_direction" and DOC_TO_QUERY in self._directions
        self.options = dataclasses.replace(self.options, symmetric=symmetric)

    @property
    def hardness_mode(self) -> str | None:
        return self._hardness[0]

    @hardness_mode.setter
    def hardness_mode(self, value) -> None:
        _check_hardness(value, self.hardness_strength)
        self._hardness = (value, self.hardness_strength)

    @property
    def hardness_strength(self) -> float:
        return self._hardness[1]

    @hardness_strength.setter
    def hardness_strength(self, value) -> None:
        _check_hardness(self.hardness_mode, value)
        self._hardness = (self.hardness_mode, value)

    @property
    def margin(self) -> float | None:
        return self._margin_filter[0]

    @margin.setter
    def margin(self, value) -> None:
        self._set_margin_filter(value, self.margin_strategy)

    @property
    def margin_strategy(self) -> str:
        return self._margin_filter[1]

    @margin_strategy.setter
    def margin_strategy(self, value) -> None:
        self._set_margin_filter(self.margin, value)

    def _set_margin_filter(self, margin, margin_strategy) -> None:
        margin = _checked_margin(margin, margin_strategy, self.directions, self.partition_mode)
        self._margin_filter = (margin, margin_strategy)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        cached = self._caches_this_forward()
        _check_columns(sentence_features, cached, type(self).__name__)
        if cached:
            # at each forward, not at construction: the trainer sets the layers' modes at every step
            check_no_batch_statistics(self.model, "mini_batch_size=None, mini_batch_num_tokens=None")
            return self.forward_cached(sentence_features, labels)
        embeddings = _embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels)

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """The GradCache loss step: the whole batch's loss in one fused call (the mixin's contract)."""
        loss = self.compute_loss_from_embeddings([torch.cat(column) for column in reps], labels)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        """The loss from one embedding tensor per column: anchors, positives, then negatives columns."""
        if len(embeddings) < 2:
            raise ValueError(f"Expected at least 2 embeddings, got {len(embeddings)}")
        rows = [len(column) for column in embeddings]
        if len(set(rows)) != 1:
            raise ValueError(f"every column must hold the same number of texts; got {rows} embeddings")
        common = _common_dtype(embeddings)
        embeddings = [column.to(common) for column in embeddings]
        if self._similarity_kind == "cos_sim":
            # util.cos_sim normalises with F.normalize(p=2, dim=-1); the same call keeps parity exact.
            # (Not _normalized: its backward rounds apart from F.normalize's, and MNRL's own
            # all-gather comparison already sits near its fp32 tolerance.)
            embeddings = [F.normalize(column, p=2, dim=-1) for column in embeddings]
        # per_direction's doc_to_query (symmetric, MNSRL) is similarity(anchors, positives).T: the
        # positives column only, never the hard negatives, which is exactly hf_infcl's column term
        # "over positive keys only" (docs/contract.md).
        hardness_mode, hardness_strength = self._hardness
        hardness = hardness_mode is not None and hardness_strength > 0.0  # as MNRL applies it
        queries, keys, labels = _loss_operands(
            embeddings[0], embeddings[1:], self.directions, self.partition_mode,
            rank=_process_rank() if self.gather_across_devices else 0, hardness=hardness,
        )
        if hardness:
            labels.update(hardness_mode=hardness_mode, hardness_strength=float(hardness_strength))
        margin, margin_strategy = self._margin_filter
        return contrastive_loss(
            queries,
            keys,
            logit_scale=self.scale,
            process_group="auto" if self.gather_across_devices else None,
            # the filter's scores are these very products, detached: the model as its own guide
            false_negative_margin=margin,
            false_negative_strategy=margin_strategy,
            **labels,
            **self.options.as_kwargs(),
            **_OneCallMatryoshka.step_dims(self),
        )

    def get_config_dict(self) -> dict[str, Any]:
        """MNRL's keys (and CachedMNRL's), with the values MNRL would report for this loss, plus ours."""
        return {
            "scale": self.scale,
            "similarity_fct": self._similarity_kind,
            "gather_across_devices": self.gather_across_devices,
            "directions": self.directions,
            "partition_mode": self.partition_mode,
            "hardness_mode": self.hardness_mode,
            "hardness_strength": self.hardness_strength,
            "margin_strategy": self.margin_strategy,
            "margin": self.margin,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "no_grad_mini_batch_size": self.no_grad_mini_batch_size,
            "symmetric": self.symmetric,
            "backend": self.backend,
            "precision": self.precision,
        }

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    @property
    def citation(self) -> str:
        return INFCL_CITATION


def _check_scale(scale, name: str = "scale") -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a positive float, got {type(scale).__name__}")
    if not scale > 0:
        # MNRL's words, then the value: code matching MNRL's message keeps working
        subject = "Scale" if name == "scale" else name
        raise ValueError(f"{subject} must be a positive value. Got {name}={scale!r}.")


def _caches_gradients(model, mini_batch_size, mini_batch_num_tokens, no_grad_mini_batch_size) -> bool:
    """Whether these mini-batch settings turn gradient caching on, after their checks (the
    gradient-free pass's size: :func:`hf_infcl.no_grad_mini_batches.check_no_grad_mini_batch_size`)."""
    if mini_batch_size is not None and (
        isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size <= 0
    ):
        # (CachedMNRL accepts 0 and fails later; refused here)
        raise ValueError(f"mini_batch_size must be a positive integer or None. Got {mini_batch_size!r}.")
    # mini_batch_num_tokens alone turns gradient caching on, as in CachedMNRL, whose mini-batches are
    # then packed by the token budget only (its mini_batch_size no longer bounds them).
    if mini_batch_num_tokens is not None and (
        isinstance(mini_batch_num_tokens, bool) or not isinstance(mini_batch_num_tokens, int)
        or mini_batch_num_tokens <= 0
    ):
        raise ValueError(
            f"mini_batch_num_tokens must be a positive integer or None. Got {mini_batch_num_tokens!r}."
        )
    check_no_grad_mini_batch_size(no_grad_mini_batch_size, mini_batch_size, mini_batch_num_tokens)
    caches = mini_batch_size is not None or mini_batch_num_tokens is not None
    if caches and _has_static_embedding(model):
        raise ValueError(
            "mini_batch_size / mini_batch_num_tokens (gradient caching) cannot split a StaticEmbedding "
            "model's inputs into mini-batches; leave both None: InfCLLoss's memory does not grow with "
            "batch^2 anyway"
        )
    return caches


def _with_symmetric(symmetric: bool, directions, partition_mode):
    """(directions, partition_mode) for the constructor's arguments: ``symmetric=True`` stands for
    MNSRL's pair, and refuses other non-default values of them rather than pick one."""
    if not symmetric:
        return directions, partition_mode
    if (directions, partition_mode) == MNRL_DEFAULT:
        return MNSRL
    if partition_mode == MNSRL[1] and not isinstance(directions, str) and set(directions) == set(MNSRL[0]):
        return directions, partition_mode  # the same loss, spelled out
    raise ValueError(
        f"symmetric=True is directions={MNSRL[0]!r}, partition_mode={MNSRL[1]!r}; got also "
        f"directions={directions!r}, partition_mode={partition_mode!r}: give one or the other"
    )


def _has_static_embedding(model) -> bool:
    try:
        from sentence_transformers.base.losses.gradcache import has_static_embedding_input
    except ImportError:
        has_static_embedding_input = None
    if has_static_embedding_input is not None:
        try:
            return bool(has_static_embedding_input(model))
        except Exception:  # a model layout the helper does not know: fall through
            pass
    try:
        from sentence_transformers.models import StaticEmbedding
    except ImportError:
        return False
    first = model[0] if isinstance(model, nn.Sequential) and len(model) else model
    return isinstance(first, StaticEmbedding)


# --------------------------------------------------------------------------------------------
# GISTEmbedLoss / CachedGISTEmbedLoss (docs/contract.md, "GIST (sentence-transformers)").

GIST_CITATION = """
@misc{solatorio2024gistembed,
    title={GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning},
    author={Aivin V. Solatorio},
    year={2024},
    eprint={2402.16829},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""


def _joined_normalized(columns: list[Tensor]) -> Tensor:
    """The columns (anchor, positive, negatives...), or every mini-batch of them in that order,
    L2-normalised in one tensor ``[a; p; n...]``: a loss's rows and keys are views of it, so the
    batch exists once."""
    return _normalized(torch.cat(columns))


class _NormalizedRows(torch.autograd.Function):
    """``F.normalize(rows, p=2, dim=-1)`` (the same operations forward) whose backward keeps the
    output and the norms, [m, c] and [m], instead of the input: the loss's normalised keys are
    held for its own backward anyway, so the raw batch is freed once normalised, where
    ``F.normalize`` would keep it to the end of the backward."""

    @staticmethod
    def forward(ctx, rows: Tensor) -> Tensor:
        norms = rows.norm(p=2, dim=-1, keepdim=True).clamp_min(_NORM_EPS)
        normalized = rows / norms
        ctx.save_for_backward(normalized, norms)
        return normalized

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        normalized, norms = ctx.saved_tensors
        # d(x / |x|) = (g - y <y, g>) / |x|; where the norm was clamped, it is the constant eps.
        along = (normalized * grad).sum(dim=-1, keepdim=True)
        return torch.where(norms > _NORM_EPS, grad - normalized * along, grad) / norms


# F.normalize's default eps.
_NORM_EPS = 1e-12


def _normalized(rows: Tensor) -> Tensor:
    """Each row L2-normalised, as ``F.normalize(rows, p=2, dim=-1)``; see :class:`_NormalizedRows`."""
    return _NormalizedRows.apply(rows) if rows.requires_grad else F.normalize(rows, p=2, dim=-1)


def _normalized_in_place(rows: Tensor) -> Tensor:
    """``F.normalize(rows, p=2, dim=-1)``, the same operations, written over ``rows`` (no
    gradient): a gradient-free batch normalised without a second copy."""
    return rows.div_(rows.norm(p=2, dim=-1, keepdim=True).clamp_min(_NORM_EPS))


def _joined_normalized_frozen(chunks: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A frozen model's embeddings (columns, or their mini-batches, in order) joined into one
    L2-normalised tensor of ``dtype`` on ``device``, normalised in place of the join (no gradient)."""
    joined = torch.cat([chunk.detach().to(device=device, dtype=dtype) for chunk in chunks])
    return _normalized_in_place(joined)


def _common_dtype(tensors: list[Tensor]) -> torch.dtype:
    """The dtype the embeddings of a loss's columns are joined in."""
    return functools.reduce(torch.promote_types, [tensor.dtype for tensor in tensors])


def _gist_row_losses(keys: Tensor, guide_keys: Tensor, examples: int, scale: float, contrast_anchors: bool,
                     contrast_positives: bool, call) -> Tensor:
    """GIST's per-row losses from its normalised keys ``[a; p; n...]`` and the guide's (the
    two-call form of docs/contract.md, "GIST"): the anchor rows against the positives (row i's:
    p_i), the negatives and, with ``contrast_anchors``, the anchors; with ``contrast_positives``
    also the positive rows against the positives, their log-sum-exps merged row by row.
    ``call(queries, keys, guide_queries, guide_keys, anchor_keys=None, **labels)`` is one
    ``contrastive_loss`` with ``reduction="none"`` and logit scale ``scale``; ``anchor_keys`` says
    which of its keys are the anchors. No row is padded to twice the width."""
    # One split, not two slices: the backward joins the rows' gradients into one tensor, where each
    # slice would fill a zero tensor of the whole batch.
    anchors, positives = keys.split(examples)[:2]
    if contrast_anchors:
        first = call(anchors, keys, guide_keys[:examples], guide_keys, anchor_keys=slice(0, examples),
                     positives=torch.arange(examples, 2 * examples, device=keys.device))
    else:
        first = call(anchors, keys[examples:], guide_keys[:examples], guide_keys[examples:])
    if not contrast_positives:
        return first
    # The positive rows p_i against the positives p_j (self-pairs included, as GIST's pp_sim). Each
    # needs a positive of its own that changes nothing: the decoy d_i = a_i - (gap / scale) p_i, whose
    # logit z(p_i, d_i) = z(a_i, p_i) - gap lies gap below the first call's positive logit (its
    # weight e^-gap at most), under the guide key ga_i, so that the filter's threshold is GIST's,
    # from the guide's cos(a_i, p_i). The d_j share a group with every row: never negatives.
    # The decoy stands for z(a_i, p_i) in the second call, gradient included: through d_i it reaches
    # a_i as z(a_i, p_i)'s does; p_i's share differs only along p_i, which the normalisation's
    # backward removes. So the merge below needs no gradient of its own, and no [m, c] tensor.
    accumulate = torch.promote_types(keys.dtype, torch.float32)
    second_keys = torch.cat([anchors - positives.detach() * (_decoy_gap(accumulate) / scale), positives])
    zeros = torch.zeros(examples, dtype=torch.long, device=keys.device)
    second = call(positives, second_keys, guide_keys[examples:2 * examples],
                  guide_keys[:2 * examples], positives=torch.arange(examples, device=keys.device),
                  query_groups=zeros, key_groups=torch.cat([zeros, zeros + 1]))
    # l_1 = r_1 - z(a_i, p_i), l_2 = r_2 - z(p_i, d_i); the row's loss is
    # logaddexp(r_1, r_2) - z(a_i, p_i) = logaddexp(l_1, l_2 + z(p_i, d_i) - z(a_i, p_i)), the
    # difference (-gap, up to the rounding of d_i in the keys' dtype) taken from the keys as they are,
    # summed in the accumulation dtype as the calls' kernels sum their logits.
    with torch.no_grad():
        decoys = second_keys[:examples].to(accumulate)
        shift = scale * ((decoys - anchors.to(accumulate)) * positives.to(accumulate)).sum(dim=1)
    del second_keys, decoys
    return torch.logaddexp(first, second + shift)


def _decoy_gap(accumulate: torch.dtype) -> float:
    """How far the logits of the decoy positives of GIST's positive rows lie below their rows'
    positive logits: far enough that a decoy's weight, at most e^-gap of its row's sum, is below the
    resolution of ``accumulate``, and no further, since the decoy's gradient along p_i grows with the
    gap, and its removal by the normalisation's backward leaves rounding in proportion."""
    return math.ceil(-math.log(torch.finfo(accumulate).eps)) + 4.0


def _gathering_world() -> tuple[int, int]:
    """(rank, world size) of the default group GIST gathers over; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _marked_by_process(guide_rows: Tensor, guide_keys: Tensor, anchor_keys: slice, margin: float, rank: int,
                       world_size: int) -> tuple[Tensor, Tensor]:
    """The guide rows and keys with ``world_size`` more coordinates that leave out every other
    process's anchor keys (docs/contract.md, "GIST"): ``e_rank`` on each row,
    ``C * (1 - e_rank)`` on this process's anchor keys (``guide_keys[anchor_keys]``), so another
    process's anchor scores above any threshold; GIST gathers the candidates, not the anchors."""
    marks = guide_rows.new_zeros(len(guide_rows), world_size)
    marks[:, rank] = 1.0
    far = guide_keys.new_zeros(len(guide_keys), world_size)
    far[anchor_keys] = 3.0 + 2.0 * abs(margin)  # > 1 + |margin|, above every threshold
    far[anchor_keys, rank] = 0.0
    return torch.cat([guide_rows, marks], dim=1), torch.cat([guide_keys, far], dim=1)


def _check_gist_models(model, guide, caches: bool) -> bool:
    """GISTEmbedLoss's (and, when caching, CachedGISTEmbedLoss's) checks of the two models, in their
    order and words; returns whether the guide must re-tokenise the texts (their rule)."""
    from transformers import PreTrainedTokenizerBase

    if caches and _has_static_embedding(model):
        raise ValueError(
            "CachedGISTEmbedLoss is not compatible with a SentenceTransformer model based on a "
            "StaticEmbedding. Consider using GISTEmbedLoss instead. (InfCLGISTLoss: leave mini_batch_size "
            "and mini_batch_num_tokens None)"
        )
    if not hasattr(model, "tokenizer") or not hasattr(guide, "tokenizer"):
        raise ValueError("Both the training model and the guiding model must have a tokenizer attribute.")
    if not isinstance(model.tokenizer, PreTrainedTokenizerBase) or not isinstance(
        guide.tokenizer, PreTrainedTokenizerBase
    ):
        raise ValueError(
            "Both the training model and the guiding model must use a PreTrainedTokenizer from transformers."
        )
    must_retokenize = _must_retokenize(model, guide)
    if must_retokenize and not caches and _has_static_embedding(model):
        raise ValueError(
            "If we must retokenize because the guide model has a different tokenizer, "
            "then the Sentence Transformer model must not be based on a StaticEmbedding."
        )
    return must_retokenize


def _must_retokenize(model, frozen) -> bool:
    """GIST's rule for a second model (guide or teacher) given the model's features: re-tokenise
    when its vocabulary differs or it would truncate the model's texts shorter."""
    return (model.tokenizer.get_vocab() != frozen.tokenizer.get_vocab()
            or frozen.max_seq_length < model.max_seq_length)


class FrozenModelColumnsMixin:
    """A second SentenceTransformer (GIST's guide, a distillation teacher) that embeds every column
    without gradient beside ``self.model``: put before ``CachedLossMixin`` among a loss's bases.

    The loss names the second model by the ``frozen_model`` property (a property, so that the module
    is registered once, under the loss's own name for it), and sets ``must_retokenize`` and, when it
    is True, ``tokenizer`` (the model's, to decode the texts). Cached, the second model embeds each
    mini-batch of the gradient-free pass only, kept in ``_frozen_columns`` (one list per column)
    while ``forward_cached`` runs inside :meth:`_forward_cached_with_frozen_columns`. Both models'
    normalised keys ``[a; p; n...]`` come from :meth:`_cached_keys` (a cached step) or
    :meth:`_keys_from_embeddings` (whole columns), for the loss's ``_loss_from_keys``.
    """

    must_retokenize: bool = False
    # The second model's mini-batch embeddings of the current cached forward, one list per column.
    _frozen_columns: list[list[Tensor]] | None = None
    # Or, once joined by _joined_normalized_frozen_keys, all of them in one normalised tensor.
    _frozen_keys: Tensor | None = None

    @property
    def frozen_model(self):
        raise NotImplementedError

    def _follow_features(self, features: dict[str, Any]) -> None:
        """Move the second model to the device of the features it embeds. The Trainer moves the loss,
        and the second model with it, to the model's device when it is built; under FSDP2 and
        DeepSpeed that is still the CPU, and only the trained model moves to the GPU later."""
        device = next((value.device for value in features.values() if isinstance(value, Tensor)), None)
        if device is not None and self.frozen_model.device != device:
            self.frozen_model.to(device)

    def _frozen_features(self, features: dict[str, Any]) -> dict[str, Any]:
        """The second model's inputs for these texts: the model's own features, or the texts decoded
        with the model's tokenizer and preprocessed by the second model when it must re-tokenise."""
        self._follow_features(features)
        if not self.must_retokenize:
            return dict(features)  # a shallow copy: the second model writes its outputs into it
        from sentence_transformers.util import batch_to_device

        input_ids = features["input_ids"]
        if "cu_seq_lens_q" in features:  # flattened inputs: one token stream, cut at the offsets
            stream, bounds = input_ids[0].tolist(), features["cu_seq_lens_q"].tolist()
            input_ids = [stream[begin:end] for begin, end in zip(bounds[:-1], bounds[1:])]
        texts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        return batch_to_device(self.frozen_model.preprocess(texts), self.frozen_model.device)

    def _embed_frozen_columns(self, sentence_features: list[dict[str, Any]]) -> list[Tensor]:
        """The second model's embeddings of whole columns, without gradient."""
        with torch.no_grad():
            features = [self._frozen_features(column) for column in sentence_features]
            return _embed_columns(self.frozen_model, features)

    def _forward_cached_with_frozen_columns(self, sentence_features, labels):
        """``forward_cached``, the second model's mini-batch embeddings collected meanwhile."""
        self._frozen_columns = []
        try:
            return self.forward_cached(sentence_features, labels)
        finally:
            self._frozen_columns = self._frozen_keys = None

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        """The mixin's mini-batch embedding, then (in the first, gradient-free pass only) the second
        model's embedding of the same texts, kept for ``calculate_loss``."""
        reps, random_state = super().embed_minibatch(sentence_feature, begin, end, with_grad,
                                                     copy_random_state, random_state)
        if not with_grad and self._frozen_columns is not None:
            if begin == 0:  # every column's mini-batches start at 0
                self._frozen_columns.append([])
            with torch.no_grad():
                features = self._frozen_features(_create_minibatch(sentence_feature, begin, end))
                self._frozen_columns[-1].append(self.frozen_model(features)["sentence_embedding"].detach())
        return reps, random_state

    def _joined_normalized_frozen_keys(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The second model's embeddings of every column joined into one L2-normalised tensor
        ``[a; p; n...]`` of ``dtype`` on ``device``, kept in place of the mini-batches (MatryoshkaLoss
        calls ``calculate_loss`` again per dimension): the batch is held once, not as mini-batches,
        joined columns and their normalised copy."""
        if self._frozen_keys is None:
            self._frozen_keys = _joined_normalized_frozen(
                [chunk for column in self._frozen_columns for chunk in column], dtype, device)
            self._frozen_columns = []
        return self._frozen_keys

    def _cached_keys(self, reps: list[list[Tensor]]) -> tuple[Tensor, Tensor, int]:
        """(the model's keys, the second model's keys, rows per column) of a cached step: every
        mini-batch joined straight into ``[a; p; n...]`` and normalised, the second model's in place
        of its mini-batches, so that neither batch is also held column by column."""
        embeddings = [chunk for column in reps for chunk in column]
        common = _common_dtype(embeddings)
        frozen_keys = self._joined_normalized_frozen_keys(common, embeddings[0].device)
        keys = _joined_normalized([chunk.to(common) for chunk in embeddings])
        return keys, frozen_keys, sum(len(chunk) for chunk in reps[0])

    @staticmethod
    def _keys_from_embeddings(embeddings: list[Tensor],
                              frozen_embeddings: list[Tensor]) -> tuple[Tensor, Tensor, int]:
        """:meth:`_cached_keys` from whole columns: the model's (with gradient) and the second
        model's (without)."""
        common = _common_dtype(embeddings)
        frozen_keys = _joined_normalized_frozen(frozen_embeddings, common, embeddings[0].device)
        keys = _joined_normalized([column.to(common) for column in embeddings])
        return keys, frozen_keys, len(embeddings[0])


class _OneCallMatryoshka:
    """``InfCLLoss.calculate_loss`` under sentence-transformers' ``MatryoshkaLoss`` with gradient
    caching. ``MatryoshkaLoss`` wraps ``calculate_loss`` in its ``CachedLossDecorator``, which calls it
    once per dim on the embeddings truncated and L2-normalised (``shrink``), weighted. This takes the
    wrapper's place: it draws the step's dims as the decorator does (``n_dims_per_step``: the same
    ``random.sample`` of the same indices) and makes one call on the whole embeddings, whose loss
    then passes them as ``contrastive_loss``'s ``matryoshka_dims`` and ``matryoshka_weights``: the
    same loss (prefixes normalised there, whatever ``similarity_fct``: a prefix of normalised
    embeddings normalises to the prefix's own direction), its terms in one pass where the backend
    allows (docs/contract.md, "Matryoshka in one call")."""

    def __init__(self, loss, calculate_loss, decorator):
        self.loss, self.calculate_loss, self.decorator = loss, calculate_loss, decorator

    @classmethod
    def around(cls, loss, value):
        """``value`` assigned to ``loss.calculate_loss``: this in place of ``MatryoshkaLoss``'s
        decorator of the loss's own method, anything else as it is."""
        from sentence_transformers.sentence_transformer.losses.matryoshka import CachedLossDecorator

        wrapped = getattr(value, "fn", None)
        if (isinstance(value, CachedLossDecorator) and getattr(wrapped, "__self__", None) is loss
                and getattr(wrapped, "__func__", None) is type(loss).calculate_loss):
            return cls(loss, wrapped, value)
        return value

    def __call__(self, reps, *args, **kwargs):
        decorator = self.decorator
        indices = range(len(decorator.matryoshka_dims))
        if 0 < decorator.n_dims_per_step < len(indices):
            indices = random.sample(indices, decorator.n_dims_per_step)
        dims, weights = decorator.matryoshka_dims, decorator.matryoshka_weights
        chosen = sorted(((dims[i], float(weights[i])) for i in indices), reverse=True)
        self.loss._matryoshka_step = tuple(zip(*chosen))
        try:
            return self.calculate_loss(reps, *args, **kwargs)
        finally:
            self.loss._matryoshka_step = None

    @staticmethod
    def step_dims(loss) -> dict:
        """The ``contrastive_loss`` arguments of the step's dims (none outside ``MatryoshkaLoss``)."""
        step = getattr(loss, "_matryoshka_step", None)
        return {} if step is None else dict(matryoshka_dims=step[0], matryoshka_weights=step[1])


class InfCLGISTLoss(FrozenModelColumnsMixin, ShardedReplaysMixin, NoGradMiniBatchesMixin, CachedLossMixin,
                    nn.Module):
    """GISTEmbed's guided loss without a batch x batch matrix: a drop-in for GISTEmbedLoss
    (``mini_batch_size=None``) and CachedGISTEmbedLoss (``mini_batch_size`` set).

    The loss is GIST's cross-entropy over the anchor-positive, anchor-anchor
    (``contrast_anchors``), positive-positive (``contrast_positives``) and anchor-negative cosines
    divided by ``temperature``, each candidate left out when the guide scores it above the
    anchor-positive guide score minus the margin (``margin_strategy`` "absolute":
    ``margin``; "relative": ``|score| * margin``), the positive itself always kept. It is two
    ``hf_infcl.contrastive_loss`` calls (the anchor rows; the positive rows against the positives)
    with the guide's embeddings as ``guide_queries`` / ``guide_keys``, merged row by row
    (docs/contract.md, "GIST (sentence-transformers)", the two-call form), so neither the model's
    nor the guide's similarity matrix is ever stored, and no embedding is padded or held twice. Any
    number of negatives columns with ``mini_batch_size``; at most one without, as GISTEmbedLoss.

    Args:
        model: the SentenceTransformer model to train.
        guide: the SentenceTransformer guide; its embeddings are computed without gradient, and its
            parameters are frozen (``requires_grad_(False)``, unless it is ``model`` itself), which keeps
            them out of the Trainer's optimizer, as FSDP2 needs. When
            its vocabulary differs from the model's, or its ``max_seq_length`` is shorter, the
            texts are decoded with the model's tokenizer and re-tokenised for the guide, as in GIST.
        temperature: divides the cosines (``1 / temperature`` is the logit scale).
        mini_batch_size: None embeds the whole batch with gradients, as GISTEmbedLoss. An integer
            embeds it in chunks of that many texts with gradient caching (dropout replayed), as
            CachedGISTEmbedLoss, and computes the loss of the whole batch in one fused call.
            Where it differs from GISTEmbedLoss: the guide then embeds in the same mini-batches too
            (as CachedGISTEmbedLoss does), so its memory is bounded by the mini-batch as well.
        mini_batch_num_tokens: mini-batches packed by token count, as CachedGISTEmbedLoss; given
            alone, it turns gradient caching on.
        show_progress_bar: show the mini-batch progress of gradient caching.
        no_grad_mini_batch_size: the gradient-free pass's mini-batches, as ``InfCLLoss``'s (exact
            gradients only for a model without active dropout); the guide embeds those.
        margin_strategy, margin: GIST's false-negative filter ("absolute" or "relative").
        contrast_anchors, contrast_positives: include the anchor-anchor and positive-positive
            cosines among the candidates (GIST's defaults: both).
        gather_across_devices: with several processes, every process's positives and negatives
            (and positive-positive keys) are candidates of this process's anchors, the anchor-anchor
            block staying local, as GIST's all-gather does; computed by the hf_infcl ring, no
            embedding gathered. False (default): each process's negatives local.
        backend, precision: as ``hf_infcl.contrastive_loss``'s (not GIST's). The default
            ("auto") runs hf_infcl's tiled PyTorch backend on CPU and its default route on CUDA,
            where fp32 embeddings are multiplied in TF32; there a candidate scored within TF32's
            rounding of the threshold can be kept where GISTEmbedLoss's fp32 matmul leaves it out.
            ``precision="ieee"`` multiplies them in exact fp32, as GISTEmbedLoss does by default.

    Every hyperparameter is a plain attribute read at each forward: ``loss.margin = 0.1`` takes
    effect at the next step, as in GIST. Sharded models (FSDP2, DeepSpeed ZeRO-2/3), cached or
    not, as ``InfCLLoss``.
    """

    def __init__(
        self,
        model,
        guide,
        temperature: float = 0.01,
        mini_batch_size: int | None = None,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
        margin_strategy: Literal["absolute", "relative"] = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        backend: BackendName = "auto",
        precision: Precision = "auto",
        no_grad_mini_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        caches = mini_batch_size is not None or mini_batch_num_tokens is not None
        self.must_retokenize = _check_gist_models(model, guide, caches)
        # A backend name only, not a block-ops object: get_config_dict saves it as JSON.
        check_option("backend", backend, block_ops=False)
        check_option("precision", precision)
        caches = _caches_gradients(model, mini_batch_size, mini_batch_num_tokens, no_grad_mini_batch_size)
        if margin_strategy not in ("absolute", "relative"):
            raise ValueError("margin_strategy must be 'absolute' or 'relative'.")
        self.model = model
        # Never trained (embedded without gradient); frozen, its parameters stay out of the Trainer's
        # optimizer, whose FSDP2 preparation refuses parameters outside the sharded model.
        self.guide = guide if guide is model else guide.requires_grad_(False)
        if self.must_retokenize:
            self.tokenizer = model.tokenizer
        self.temperature = temperature
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.no_grad_mini_batch_size = no_grad_mini_batch_size  # checked against the two above
        self.show_progress_bar = show_progress_bar
        self.margin_strategy = margin_strategy
        self.margin = margin
        self.contrast_anchors = contrast_anchors
        self.contrast_positives = contrast_positives
        self.gather_across_devices = gather_across_devices
        self.backend = backend
        self.precision = precision
        # See InfCLLoss: MatryoshkaLoss reads this to decorate calculate_loss instead of the forward.
        self.uses_gradient_cache = caches

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        cached = self._caches_this_forward()
        if not cached and len(sentence_features) not in (2, 3):
            raise ValueError(f"Expected 2 or 3 embeddings, got {len(sentence_features)}")  # GIST's words
        _check_columns(sentence_features, cached, type(self).__name__)
        if cached:
            check_no_batch_statistics(self.model, "mini_batch_size=None, mini_batch_num_tokens=None")
            return self._forward_cached_with_frozen_columns(sentence_features, labels)
        # GIST's order: the model's columns first, then the guide's (the same RNG draws as GIST);
        # the guide reads copies of the features, taken before the model writes its outputs into them.
        guide_features = [dict(features) for features in sentence_features]
        embeddings = _embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, self._embed_frozen_columns(guide_features))

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """The GradCache loss step: the whole batch's loss in one fused call (the mixin's contract)."""
        loss = self._loss_from_keys(*self._cached_keys(reps))
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    @property
    def frozen_model(self):
        return self.guide

    def compute_loss_from_embeddings(self, embeddings: list[Tensor],
                                     guide_embeddings: list[Tensor]) -> Tensor:
        """The loss from the model's and the guide's embeddings of each column (anchors, positives,
        then negatives columns)."""
        # GIST's cosine: normalised embeddings, dotted; each column once, the model's and the guide's.
        return self._loss_from_keys(*self._keys_from_embeddings(embeddings, guide_embeddings))

    def _loss_from_keys(self, keys: Tensor, guide_keys: Tensor, examples: int) -> Tensor:
        """The loss from the model's and the guide's normalised keys ``[a; p; n...]`` (``examples``
        rows per column)."""
        rank, world_size = _gathering_world() if self.gather_across_devices else (0, 1)
        margin = float(self.margin)

        def call(queries, call_keys, guide_queries, call_guide_keys, anchor_keys=None, **labels):
            if world_size > 1 and anchor_keys is not None:
                # Every process's anchors travel the ring with the keys; only its own are candidates.
                guide_queries, call_guide_keys = _marked_by_process(
                    guide_queries, call_guide_keys, anchor_keys, margin, rank, world_size)
            return contrastive_loss(
                queries, call_keys, logit_scale=1.0 / self.temperature, loss="softmax", symmetric=False,
                reduction="none", false_negative_margin=margin, false_negative_strategy=self.margin_strategy,
                guide_queries=guide_queries, guide_keys=call_guide_keys,
                process_group="auto" if world_size > 1 else None, backend=self.backend,
                precision=self.precision, **labels,
            )

        # GIST's mean over this process's rows (it needs the same b on every process).
        return _gist_row_losses(keys, guide_keys, examples, 1.0 / self.temperature, self.contrast_anchors,
                                self.contrast_positives, call).mean()

    def get_config_dict(self) -> dict[str, Any]:
        """CachedGISTEmbedLoss's keys (GISTEmbedLoss's and the mini-batch settings)."""
        return {
            "guide": self.guide,
            "temperature": self.temperature,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "no_grad_mini_batch_size": self.no_grad_mini_batch_size,
            "margin_strategy": self.margin_strategy,
            "margin": self.margin,
            "contrast_anchors": self.contrast_anchors,
            "contrast_positives": self.contrast_positives,
            "gather_across_devices": self.gather_across_devices,
            "backend": self.backend,
            "precision": self.precision,
        }

    @property
    def citation(self) -> str:
        return GIST_CITATION


# --------------------------------------------------------------------------------------------
# In-batch distillation (docs/contract.md, "Distillation over the batch").


def _check_teacher_model(model, teacher) -> bool:
    """The checks of a teacher model against the student; returns whether the teacher must
    re-tokenise the texts (GIST's rule for its guide)."""
    from transformers import PreTrainedTokenizerBase

    if teacher is model:
        raise ValueError("teacher is the model being trained; the teacher is frozen, so pass another "
                         "SentenceTransformer (a copy of the model, for self-distillation)")
    if not callable(teacher) or not hasattr(teacher, "tokenizer"):
        raise TypeError(f"teacher must be a SentenceTransformer (or None), got {type(teacher).__name__}")
    if getattr(model, "tokenizer", None) is teacher.tokenizer:
        return False
    if not (isinstance(getattr(model, "tokenizer", None), PreTrainedTokenizerBase)
            and isinstance(teacher.tokenizer, PreTrainedTokenizerBase)):
        raise ValueError("teacher: a teacher with a tokenizer of its own needs the model and the teacher to "
                         "use PreTrainedTokenizers from transformers (to tell whether it must re-tokenise "
                         "the texts); or precompute its embeddings into the dataset's label column")
    must_retokenize = _must_retokenize(model, teacher)
    if must_retokenize and _has_static_embedding(model):
        raise ValueError("teacher: a teacher with another tokenizer re-tokenises the model's texts, which a "
                         "StaticEmbedding model's inputs cannot be decoded into; precompute its embeddings "
                         "into the dataset's label column")
    return must_retokenize


def _check_teacher_labels(labels, columns: int, rows: int) -> None:
    """The one check of the teacher's embeddings in ``labels``: ``[rows, columns, teacher_dim]``."""
    if labels is None:
        raise ValueError("labels: InfCLDistillLoss without a teacher model takes the teacher's embeddings "
                         f"from the dataset's label column, shape [batch, {columns}, teacher_dim] (anchor, "
                         "positive, negatives in column order); got no labels. Add that column, or pass "
                         "teacher=SentenceTransformer(...)")
    if not torch.is_tensor(labels) or not labels.is_floating_point():
        raise TypeError("labels must be a floating-point tensor of the teacher's embeddings, shape "
                        f"[batch, {columns}, teacher_dim]; got "
                        f"{labels.dtype if torch.is_tensor(labels) else type(labels).__name__}")
    if labels.ndim != 3 or labels.shape[:2] != (rows, columns) or labels.shape[2] == 0:
        raise ValueError(f"labels must hold the teacher's embeddings of every text, shape [batch, columns, "
                         f"teacher_dim] = [{rows}, {columns}, teacher_dim] (anchor, positive, negatives in "
                         f"column order); got {list(labels.shape)}")


class InfCLDistillLoss(FrozenModelColumnsMixin, ShardedReplaysMixin, NoGradMiniBatchesMixin, CachedLossMixin,
                       nn.Module):
    """In-batch distillation without a batch x batch matrix: the KL divergence of the model's softmax
    over EVERY candidate of the batch from a teacher's, optionally mixed with InfoNCE
    (:func:`hf_infcl.contrastive_distillation_loss`; docs/contract.md, "Distillation over the batch").

    Where sentence-transformers' ``DistillKLDivLoss`` compares each anchor with its own listed
    candidates only, here every anchor's distribution runs over every positive and negative of the
    batch: anchors are the rows; the positives, then each negatives column, are the keys (as in
    ``InfCLLoss``). The student's logits are ``scale`` times the cosines of its embeddings, the
    teacher's ``teacher_scale`` times the cosines of the teacher's embeddings (of any width).

    Args:
        model: the SentenceTransformer model to train (the student).
        teacher: None (default): the teacher's embeddings come from the dataset, precomputed, in its
            label column (``labels``), shape ``[batch, n_columns, teacher_dim]``: for every example
            the teacher's embedding of each text column in column order (anchor, positive,
            negative_1, ...), the layout of sentence-transformers' ``EmbedDistillLoss`` for
            per-column teacher embeddings. Or a SentenceTransformer that embeds the same texts,
            without gradient, at each step; its parameters are frozen (``requires_grad_(False)``,
            which keeps them out of the Trainer's optimizer), it is used in the mode it is in (put
            it in ``eval()`` for targets without dropout), and when its vocabulary differs from the
            model's, or its ``max_seq_length`` is shorter, the texts are decoded and re-tokenised for
            it, as GISTEmbedLoss does with its guide. Labels and a teacher model together raise.
        scale: the student's logit scale (``1 / temperature``), as in ``InfCLLoss``.
        teacher_scale: the teacher's logit scale; None (default) is ``scale``.
        distillation_weight: ``w`` in [0, 1]: the loss is ``(1 - w) * InfoNCE + w * KL`` per anchor
            (InfoNCE as ``InfCLLoss`` with the same ``symmetric``); 1: the KL alone.
        symmetric: also the column term (the KL over the anchors at each anchor's positive),
            averaged with the row term, as MultipleNegativesSymmetricRankingLoss averages its two.
        mini_batch_size, mini_batch_num_tokens, show_progress_bar, no_grad_mini_batch_size: gradient
            caching as in ``InfCLLoss``; a teacher model then embeds the mini-batches of the
            gradient-free pass, without gradient, in that pass only.
        backend, precision: the hf_infcl backend (``"auto"``: the distillation's Triton kernels on
            CUDA, the tiled PyTorch loss elsewhere) and matmul precision, as in ``InfCLLoss``.
        gather_across_devices: with several processes, every anchor's distributions run over every
            process's candidates (the student's and the teacher's key blocks travel the hf_infcl
            ring; nothing is gathered), as ``InfCLLoss``'s option. False (default): each process
            distils over its own batch.

    Inputs:
        (anchor, positive[, negative_1, ..., negative_n]) columns; labels: the teacher's embeddings
        ``[batch, n_columns, teacher_dim]`` unless a teacher model is given.

    Under ``MatryoshkaLoss`` the student's embeddings are truncated, the teacher's not (it is the
    target), except that ``MatryoshkaLoss`` without gradient caching truncates labels whose width is
    the model's own. Sharded models (FSDP2, DeepSpeed ZeRO-2/3) as ``InfCLLoss``.

    Example:
        ::

            from hf_infcl import losses
            loss = losses.InfCLDistillLoss(student, teacher=teacher, teacher_scale=50.0, mini_batch_size=64)
            trainer = SentenceTransformerTrainer(model=student, train_dataset=dataset, loss=loss)
    """

    def __init__(
        self,
        model,
        teacher=None,
        scale: float = 20.0,
        teacher_scale: float | None = None,
        distillation_weight: float = 1.0,
        symmetric: bool = False,
        mini_batch_size: int | None = None,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
        backend: BackendName = "auto",
        precision: Precision = "auto",
        gather_across_devices: bool = False,
        no_grad_mini_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        _check_scale(scale)
        check_bool("gather_across_devices", gather_across_devices)
        teacher_scale = scale if teacher_scale is None else teacher_scale
        _check_scale(teacher_scale, "teacher_scale")
        distillation_weight = check_distillation_weight(distillation_weight)
        check_option("symmetric", symmetric)
        # A backend name only, not a block-ops object: get_config_dict saves it as JSON.
        check_option("backend", backend, block_ops=False)
        check_option("precision", precision)
        self.must_retokenize = teacher is not None and _check_teacher_model(model, teacher)
        caches = _caches_gradients(model, mini_batch_size, mini_batch_num_tokens, no_grad_mini_batch_size)
        self.model = model
        # Never trained; frozen, its parameters stay out of the Trainer's optimizer (as GIST's guide).
        self.teacher = None if teacher is None else teacher.requires_grad_(False)
        if self.must_retokenize:
            self.tokenizer = model.tokenizer
        self.scale = float(scale)
        self.teacher_scale = float(teacher_scale)
        self.distillation_weight = distillation_weight
        self.symmetric = symmetric
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.no_grad_mini_batch_size = no_grad_mini_batch_size  # checked against the two above
        self.show_progress_bar = show_progress_bar
        self.backend = backend
        self.precision = precision
        self.gather_across_devices = gather_across_devices
        # See InfCLLoss: MatryoshkaLoss reads this to decorate calculate_loss instead of the forward.
        self.uses_gradient_cache = caches

    @property
    def frozen_model(self):
        return self.teacher

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        cached = self._caches_this_forward()
        _check_columns(sentence_features, cached, type(self).__name__)
        self._check_teacher_source(labels, sentence_features)
        if cached:
            check_no_batch_statistics(self.model, "mini_batch_size=None, mini_batch_num_tokens=None")
            if self.teacher is None:
                return self.forward_cached(sentence_features, labels)
            return self._forward_cached_with_frozen_columns(sentence_features, labels)
        if self.teacher is None:
            return self.compute_loss_from_embeddings(_embed_columns(self.model, sentence_features),
                                                     list(labels.unbind(1)))
        # The teacher reads copies of the features, taken before the model writes its outputs into them.
        teacher_features = [dict(features) for features in sentence_features]
        embeddings = _embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, self._embed_frozen_columns(teacher_features))

    def _check_teacher_source(self, labels, sentence_features) -> None:
        """Exactly one source of the teacher's embeddings, and labels of the documented layout."""
        if self.teacher is not None:
            if labels is not None:
                raise ValueError("labels were given and so was a teacher model: InfCLDistillLoss takes the "
                                 "teacher's embeddings from one of them; drop the dataset's label column, or "
                                 "pass teacher=None to use it")
            return
        _check_teacher_labels(labels, len(sentence_features), _column_rows(sentence_features[0]))

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """The GradCache loss step: the whole batch's loss in one fused call (the mixin's contract)."""
        if self.teacher is None:  # the teacher's embeddings are the labels
            loss = self.compute_loss_from_embeddings([torch.cat(column) for column in reps],
                                                     list(labels.unbind(1)))
        else:
            loss = self._loss_from_keys(*self._cached_keys(reps))
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def compute_loss_from_embeddings(self, embeddings: list[Tensor],
                                     teacher_embeddings: list[Tensor]) -> Tensor:
        """The loss from the model's and the teacher's embeddings of each column (anchors, positives,
        then negatives columns)."""
        if len(embeddings) < 2 or len(teacher_embeddings) != len(embeddings):
            raise ValueError(f"Expected at least 2 embedding columns and the teacher's of each; got "
                             f"{len(embeddings)} and {len(teacher_embeddings)}")
        return self._loss_from_keys(*self._keys_from_embeddings(embeddings, teacher_embeddings))

    def _loss_from_keys(self, student: Tensor, teacher: Tensor, examples: int) -> Tensor:
        """The loss from the model's and the teacher's normalised columns ``[a; p; n...]``
        (``examples`` rows per column): the cosine of both models, normalised embeddings dotted."""
        return contrastive_distillation_loss(
            student[:examples], student[examples:], teacher[:examples], teacher[examples:],
            logit_scale=self.scale, teacher_logit_scale=self.teacher_scale, symmetric=self.symmetric,
            distillation_weight=self.distillation_weight, reduction="mean", backend=self.backend,
            precision=self.precision, process_group="auto" if self.gather_across_devices else None,
        )

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "teacher": self.teacher,
            "scale": self.scale,
            "teacher_scale": self.teacher_scale,
            "distillation_weight": self.distillation_weight,
            "symmetric": self.symmetric,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "no_grad_mini_batch_size": self.no_grad_mini_batch_size,
            "backend": self.backend,
            "precision": self.precision,
            "gather_across_devices": self.gather_across_devices,
        }

    @property
    def citation(self) -> str:
        return INFCL_CITATION


__all__ = ["InfCLLoss", "InfCLGISTLoss", "InfCLDistillLoss", "INFCL_CITATION", "GIST_CITATION"]
