"""sentence-transformers adapter: ``losses.InfCLLoss``, a drop-in for MNRL, MNSRL and CachedMNRL.

``from hf_infcl import losses; loss = losses.InfCLLoss(model)`` inside a
``SentenceTransformerTrainer``. The loss is the one of sentence-transformers'
``MultipleNegativesRankingLoss`` (``symmetric=False``) or
``MultipleNegativesSymmetricRankingLoss`` (``symmetric=True``), computed by
``hf_infcl.contrastive_loss`` without a batch x batch score matrix:

- columns ``(anchor, positive, negative_1, ...)``: every negative column is an extra candidate
  for every anchor, exactly as sentence-transformers concatenates ``docs_all``;
- ``mini_batch_size=N`` caches the gradients w.r.t. the embeddings (GradCache) through
  sentence-transformers' own ``CachedLossMixin`` (sentence-transformers >= 6), but computes the
  loss of the whole batch in ONE fused call instead of
  CachedMNRL's per-chunk Python loop;
- with several processes and ``gather_across_devices=True`` the loss runs over every process's rows
  and keys with the hf_infcl ring (instead of an all-gather of the embeddings); the default,
  False as in sentence-transformers, keeps negatives local to each process.

Its arguments keep sentence-transformers' names, mapped here to ``contrastive_loss``'s: ``scale``
is ``logit_scale``, ``gather_across_devices`` is ``process_group="auto"`` (False: None); the other
options (``symmetric``, ``backend``, ``precision``) are held as a checked ``LossOptions``
(docs/contract.md, "Options", has the table for every entry point). Not to be confused with
``hf_infcl.InfCLLoss``, the module over embedding tensors that this class calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .loss import contrastive_loss
from .ops.options import BackendName, LossOptions, OptionAttribute, Precision, check_option

try:  # sentence-transformers >= 6: the shared GradCache machinery and the merged column forward
    from sentence_transformers import util as _st_util
    from sentence_transformers.base.losses.gradcache import CachedLossMixin
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


def _check_columns(sentence_features: list[dict[str, Any]], cached: bool) -> None:
    if len(sentence_features) < 2:
        # the words of MNRL (which embeds first) and of CachedMNRL, then what the columns are
        counted = "inputs" if cached else "embeddings"
        raise ValueError(
            f"Expected at least 2 {counted}, got {len(sentence_features)}: InfCLLoss needs the columns "
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


class InfCLLoss(CachedLossMixin, nn.Module):
    # The loss options, held as a frozen LossOptions (``.options``) checked once, in __init__.
    symmetric = OptionAttribute()
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
    ) -> None:
        """Exact in-batch-negatives contrastive loss (InfoNCE) without a batch x batch matrix (Inf-CL).

        Args:
            model: the SentenceTransformer model.
            scale: multiplies the similarities (``scale = 1 / temperature``), as in
                MultipleNegativesRankingLoss; ``20.0`` is ``temperature = 0.05``.
            similarity_fct: ``sentence_transformers.util.cos_sim`` (the embeddings are L2-normalised,
                then dotted) or ``util.dot_score``. Other functions raise ``ValueError`` (an
                ``nn.Module``: ``TypeError``), here or when assigned later; an assignment
                (``loss.similarity_fct = util.dot_score``) takes effect at the next forward, as in MNRL.
            symmetric: False gives MultipleNegativesRankingLoss (anchor -> candidates); True adds the
                positive -> anchors direction and averages the two, as
                MultipleNegativesSymmetricRankingLoss does.
            mini_batch_size: None embeds the whole batch with gradients, like
                MultipleNegativesRankingLoss (unless ``mini_batch_num_tokens`` is set). An integer
                embeds it in chunks of that many texts
                with gradient caching (like CachedMultipleNegativesRankingLoss, dropout replayed),
                and computes the loss of the whole batch in one fused call.
            show_progress_bar: show the mini-batch progress of gradient caching.
            gather_across_devices: with several processes, compute the loss over every process's
                anchors and candidates (the hf_infcl ring; no embedding is all-gathered). False, the
                default as in MultipleNegativesRankingLoss, keeps each process's negatives local.
            backend: the hf_infcl backend: ``"auto"`` (Triton on CUDA when available, else tiled
                PyTorch), ``"torch"``, ``"triton"`` or ``"reference"``.
            precision: matmul precision of the loss for fp32 embeddings (``hf_infcl.loss.PRECISIONS``):
                ``"auto"`` (TF32 on CUDA in every backend, exact fp32 elsewhere), ``"tf32"``, or
                ``"ieee"`` (exact fp32). bf16/fp16 embeddings are unaffected.
            mini_batch_num_tokens: gradient caching with mini-batches packed by token count, as in
                CachedMultipleNegativesRankingLoss: each holds as many consecutive texts as fit in this
                many non-padding tokens (a longer text alone), whatever ``mini_batch_size`` is; given
                alone, it turns gradient caching on (sentence-transformers >= 6 only).

        Inputs:
            (anchor, positive) pairs, or (anchor, positive, negative_1, ..., negative_n) tuples;
            labels are ignored. Every negative column is a candidate for every anchor of the batch.

        Example:
            ::

                from hf_infcl import losses
                loss = losses.InfCLLoss(model, mini_batch_size=256)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=dataset, loss=loss)
        """
        super().__init__()
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a positive float, got {type(scale).__name__}")
        if not scale > 0:
            # MNRL's words, then the value: code matching MNRL's message keeps working
            raise ValueError(f"Scale must be a positive value. Got scale={scale!r}.")
        # Checked here, first: assigning similarity_fct (__setattr__) sets _similarity_kind.
        self.similarity_fct = similarity_fct
        # A backend name only, not a block-ops object: get_config_dict saves it as JSON.
        check_option("backend", backend, block_ops=False)
        self.options = LossOptions(loss="softmax", symmetric=symmetric, reduction="mean", backend=backend,
                                   precision=precision)
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
        caches = mini_batch_size is not None or mini_batch_num_tokens is not None
        if caches and _has_static_embedding(model):
            raise ValueError(
                "mini_batch_size / mini_batch_num_tokens (gradient caching) cannot split a StaticEmbedding "
                "model's inputs into mini-batches; leave both None: InfCLLoss's memory does not grow with "
                "batch^2 anyway"
            )

        self.model = model
        self.scale = float(scale)
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
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
        super().__setattr__(name, value)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        cached = self.mini_batch_size is not None or self.mini_batch_num_tokens is not None
        _check_columns(sentence_features, cached)
        if cached:
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
        anchors = embeddings[0]
        rows = [len(column) for column in embeddings]
        if len(set(rows)) != 1:
            raise ValueError(f"every column must hold the same number of texts; got {rows} embeddings")
        # Candidates in sentence-transformers' order: all positives, then each negatives column. The
        # first m candidates are the anchors' positives, which is hf_infcl's default pairing.
        candidates = torch.cat(embeddings[1:]) if len(embeddings) > 2 else embeddings[1]
        if candidates.dtype != anchors.dtype:
            common = torch.promote_types(anchors.dtype, candidates.dtype)
            anchors, candidates = anchors.to(common), candidates.to(common)
        if self._similarity_kind == "cos_sim":
            # util.cos_sim normalises with F.normalize(p=2, dim=-1); the same call keeps parity exact.
            anchors = F.normalize(anchors, p=2, dim=-1)
            candidates = F.normalize(candidates, p=2, dim=-1)
        # symmetric=True is MNSRL: (row LSE over all candidates + column LSE of each anchor's
        # positive over all anchors) / 2 - positive logit. MNSRL's doc_to_query term is
        # similarity(anchors, positives).T: the positives column only, never the hard negatives,
        # which is exactly hf_infcl's column term "over positive keys only" (docs/contract.md).
        return contrastive_loss(
            anchors,
            candidates,
            logit_scale=self.scale,
            process_group="auto" if self.gather_across_devices else None,
            **self.options.as_kwargs(),
        )

    def get_config_dict(self) -> dict[str, Any]:
        """MNRL's keys (and CachedMNRL's), with the values MNRL would report for this loss, plus ours.

        ``symmetric`` is MNRL's ``directions=("query_to_doc", "doc_to_query")``,
        ``partition_mode="per_direction"`` (MNSRL); without it, MNRL's defaults. No hardness term.
        """
        return {
            "scale": self.scale,
            "similarity_fct": self._similarity_kind,
            "gather_across_devices": self.gather_across_devices,
            "directions": ("query_to_doc", "doc_to_query") if self.symmetric else ("query_to_doc",),
            "partition_mode": "per_direction" if self.symmetric else "joint",
            "hardness_mode": None,
            "hardness_strength": 0.0,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
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


__all__ = ["InfCLLoss", "INFCL_CITATION"]
