"""How embeddings, logit scale and bias are taken from contrastive Hugging Face models.

Two families are supported:

- CLIP-like image-text models with ``get_image_features``/``get_text_features`` and a
  ``logit_scale`` parameter (log of the scale): ``CLIPModel``, ``VisionTextDualEncoderModel``,
  ``SiglipModel`` (sigmoid loss, with ``logit_bias``). In transformers 5 the feature methods
  return an output object whose ``pooler_output`` is the projected embedding; in 4.x they return
  the tensor. Both are handled. Embeddings are L2-normalised, as these models' own losses do.
- :class:`DualEncoder`, a text retriever (query and document towers, shared or separate, from
  any ``AutoModel`` checkpoint or config) with its own config registered for the Auto classes.

Rows ("queries" of the loss contract) are images or queries; keys are texts or documents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

try:
    from transformers import initialization as _hf_init
except ImportError:  # transformers 4.x
    _hf_init = None

__all__ = [
    "DualEncoder",
    "DualEncoderConfig",
    "DualEncoderOutput",
    "POOLINGS",
    "TowerInputs",
    "contrastive_loss_kind",
    "encode_keys",
    "encode_queries",
    "logit_bias_of",
    "logit_scale_of",
    "pair_embeddings",
    "tower_inputs",
    "unwrap_model",
]

POOLINGS = ("cls", "mean", "last")

IMAGE_INPUTS = ("pixel_values",)
TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
QUERY_INPUTS = ("query_input_ids", "query_attention_mask", "query_token_type_ids")
DOC_INPUTS = ("doc_input_ids", "doc_attention_mask", "doc_token_type_ids")


# --------------------------------------------------------------------------------------------
# Model-agnostic access


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / Accelerate / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _is_dual_encoder(model) -> bool:
    return isinstance(unwrap_model(model), DualEncoder)


def _check_supported(model) -> nn.Module:
    inner = unwrap_model(model)
    if isinstance(inner, DualEncoder):
        return inner
    missing = [name for name in ("get_image_features", "get_text_features", "logit_scale")
               if not hasattr(inner, name)]
    if missing:
        raise TypeError(
            f"{type(inner).__name__} is not a supported contrastive model: it lacks {', '.join(missing)} "
            "(use a CLIP-like model, e.g. CLIPModel, SiglipModel, VisionTextDualEncoderModel, or DualEncoder)"
        )
    return inner


@dataclass(frozen=True)
class TowerInputs:
    """The batch keys each tower reads (rows = images/queries, keys = texts/documents)."""

    query: tuple[str, ...]
    key: tuple[str, ...]


def tower_inputs(model) -> TowerInputs:
    """Which batch entries feed the row tower and which feed the key tower."""
    if _is_dual_encoder(model):
        return TowerInputs(QUERY_INPUTS, DOC_INPUTS)
    _check_supported(model)
    return TowerInputs(IMAGE_INPUTS, TEXT_INPUTS)


def contrastive_loss_kind(model) -> str:
    """``"sigmoid"`` for models trained with SigLIP's loss (they have ``logit_bias``), else ``"softmax"``."""
    inner = _check_supported(model)
    return "sigmoid" if isinstance(getattr(inner, "logit_bias", None), torch.Tensor) else "softmax"


def logit_scale_of(model) -> torch.Tensor:
    """The multiplier of the logits, ``exp(logit_scale)`` (differentiable)."""
    return _check_supported(model).logit_scale.reshape(()).exp()


def logit_bias_of(model) -> torch.Tensor | None:
    """SigLIP's additive logit bias (differentiable), or None."""
    bias = getattr(_check_supported(model), "logit_bias", None)
    return bias.reshape(()) if isinstance(bias, torch.Tensor) else None


def _pooled(output) -> torch.Tensor:
    """The projected embedding from a feature method's return value (tensor or output object)."""
    if isinstance(output, torch.Tensor):
        return output
    pooled = getattr(output, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        return pooled
    if isinstance(output, (tuple, list)) and len(output) > 1 and isinstance(output[1], torch.Tensor):
        return output[1]  # return_dict=False: (last_hidden_state, pooler_output, ...)
    raise TypeError(f"cannot find the embedding in a {type(output).__name__} (no pooler_output)")


def _select(batch, names):
    return {name: batch[name] for name in names if batch.get(name) is not None}


def encode_queries(model, batch: dict) -> torch.Tensor:
    """L2-normalised row embeddings (images, or queries for a DualEncoder) of ``batch``."""
    inner = _check_supported(model)
    if isinstance(inner, DualEncoder):
        return inner.encode_queries(**{k[len("query_"):]: v for k, v in _select(batch, QUERY_INPUTS).items()})
    features = _pooled(inner.get_image_features(**_select(batch, IMAGE_INPUTS)))
    return nn.functional.normalize(features, dim=-1)


def encode_keys(model, batch: dict) -> torch.Tensor:
    """L2-normalised key embeddings (texts, or documents for a DualEncoder) of ``batch``."""
    inner = _check_supported(model)
    if isinstance(inner, DualEncoder):
        return inner.encode_docs(**{k[len("doc_"):]: v for k, v in _select(batch, DOC_INPUTS).items()})
    features = _pooled(inner.get_text_features(**_select(batch, TEXT_INPUTS)))
    return nn.functional.normalize(features, dim=-1)


def pair_embeddings(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(row embeddings, key embeddings) from ONE call of ``model``'s forward on a paired batch.

    Going through ``forward`` (rather than the feature methods) matters under DDP: only a call of
    the wrapped module's forward prepares the gradient all-reduce.
    """
    names = tower_inputs(model)
    output = model(**_select(batch, names.query + names.key))
    if _is_dual_encoder(model):
        return output.query_embeds, output.doc_embeds
    return output.image_embeds, output.text_embeds


# --------------------------------------------------------------------------------------------
# DualEncoder


class DualEncoderConfig(PretrainedConfig):
    """Configuration of :class:`DualEncoder`.

    Args:
        query_encoder: the config (as a dict with ``model_type``, or a ``PretrainedConfig``) of
            the query tower, any ``AutoModel`` architecture.
        doc_encoder: the document tower's config when the towers are separate; None shares the
            query tower.
        pooling: ``"cls"`` (first token), ``"mean"`` (mean over the attention mask) or ``"last"``
            (last non-padding token, for decoder models; left or right padding).
        normalize: L2-normalise the embeddings.
        logit_scale_init: the initial scale s of the logits (e.g. 20 = temperature 0.05).
        learn_scale: learn log(s) as a parameter; otherwise s stays fixed.
    """

    model_type = "infcl_dual_encoder"

    def __init__(
        self,
        query_encoder: dict | PretrainedConfig | None = None,
        doc_encoder: dict | PretrainedConfig | None = None,
        pooling: str = "mean",
        normalize: bool = True,
        logit_scale_init: float = 20.0,
        learn_scale: bool = False,
        **kwargs,
    ):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(map(repr, POOLINGS))}; got {pooling!r}")
        if not logit_scale_init > 0:
            raise ValueError(f"logit_scale_init must be > 0, got {logit_scale_init!r}")
        self.query_encoder = _config_dict(query_encoder, "query_encoder")
        self.doc_encoder = _config_dict(doc_encoder, "doc_encoder")
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.logit_scale_init = float(logit_scale_init)
        self.learn_scale = bool(learn_scale)
        super().__init__(**kwargs)

    @property
    def shared_towers(self) -> bool:
        return self.doc_encoder is None


def _config_dict(config, name):
    if config is None:
        return None
    if isinstance(config, PretrainedConfig):
        config = config.to_dict()
    if not isinstance(config, dict) or "model_type" not in config:
        raise TypeError(f"{name} must be a PretrainedConfig or a dict with 'model_type'; got {config!r:.50}")
    return dict(config)


def _build_encoder(config_dict: dict) -> PreTrainedModel:
    settings = dict(config_dict)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    return AutoModel.from_config(config)


@dataclass
class DualEncoderOutput(ModelOutput):
    """``loss`` (with ``return_loss=True``), the embeddings of each tower given, and the scale."""

    loss: torch.Tensor | None = None
    query_embeds: torch.Tensor | None = None
    doc_embeds: torch.Tensor | None = None
    logit_scale: torch.Tensor | None = None


class DualEncoder(PreTrainedModel):
    """A text retriever: query and document towers (shared or separate) with pooling.

    Build one from checkpoints or configs with :meth:`from_encoders`; save and load it with
    ``save_pretrained``/``from_pretrained`` (also through ``AutoModel`` once ``hf_infcl.models``
    is imported). ``forward`` takes ``query_*`` and/or ``doc_*`` inputs and returns their
    embeddings; ``return_loss=True`` adds the symmetric InfoNCE loss over the pairs.
    """

    config_class = DualEncoderConfig
    base_model_prefix = "dual_encoder"
    supports_gradient_checkpointing = True
    main_input_name = "query_input_ids"

    def __init__(self, config: DualEncoderConfig, query_encoder: PreTrainedModel | None = None,
                 doc_encoder: PreTrainedModel | None = None):
        super().__init__(config)
        if query_encoder is None:
            if config.query_encoder is None:
                raise ValueError("DualEncoderConfig.query_encoder is needed to build the query tower")
            query_encoder = _build_encoder(config.query_encoder)
        self.query_encoder = query_encoder
        if config.shared_towers:
            self.doc_encoder = None
        else:
            self.doc_encoder = doc_encoder if doc_encoder is not None else _build_encoder(config.doc_encoder)
        # log of the scale, like CLIP's logit_scale, so the same clamp and extraction code applies
        self.logit_scale = nn.Parameter(torch.tensor(math.log(config.logit_scale_init)),
                                        requires_grad=config.learn_scale)
        self.post_init()

    @classmethod
    def from_encoders(
        cls,
        query_encoder: str | PretrainedConfig,
        doc_encoder: str | PretrainedConfig | None = None,
        *,
        pooling: str = "mean",
        normalize: bool = True,
        logit_scale_init: float = 20.0,
        learn_scale: bool = False,
        **from_pretrained_kwargs,
    ) -> DualEncoder:
        """A DualEncoder from ``AutoModel`` checkpoints (names or paths) or configs.

        A config builds a randomly initialised tower; a checkpoint loads its weights. ``doc_encoder``
        None shares the query tower.
        """
        towers = [_load_tower(query_encoder, from_pretrained_kwargs)]
        if doc_encoder is not None:
            towers.append(_load_tower(doc_encoder, from_pretrained_kwargs))
        config = DualEncoderConfig(
            query_encoder=towers[0].config,
            doc_encoder=towers[1].config if len(towers) > 1 else None,
            pooling=pooling, normalize=normalize, logit_scale_init=logit_scale_init, learn_scale=learn_scale,
        )
        return cls(config, *towers)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        # Loading replaces the parameter (requires_grad=True); a fixed scale must stay frozen, or
        # optimisers and DDP would wait for a gradient that never comes.
        model.logit_scale.requires_grad_(model.config.learn_scale)
        return model

    def _init_weights(self, module):
        # The towers initialise themselves (they are PreTrainedModels); only our scale is ours.
        if module is self:
            value = math.log(self.config.logit_scale_init)
            if _hf_init is not None:  # transformers 5: skips a scale that was just loaded
                _hf_init.constant_(self.logit_scale, value)
            else:
                with torch.no_grad():
                    self.logit_scale.fill_(value)

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        pooling = self.config.pooling
        if attention_mask is None:
            attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        if pooling == "cls":
            return hidden[:, 0]
        if pooling == "mean":
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
            return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        # last: with left padding every row ends at the last position; with right padding at
        # the row's last attended token.
        if bool(attention_mask[:, -1].all()):
            return hidden[:, -1]
        last = attention_mask.long().sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last.clamp_min(0)]

    def _encode(self, encoder, input_ids, attention_mask=None, token_type_ids=None, **kwargs):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        output = encoder(**inputs)
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        pooled = self._pool(hidden, attention_mask)
        return nn.functional.normalize(pooled, dim=-1) if self.config.normalize else pooled

    def encode_queries(self, input_ids, attention_mask=None, token_type_ids=None, **kwargs) -> torch.Tensor:
        return self._encode(self.query_encoder, input_ids, attention_mask, token_type_ids, **kwargs)

    def encode_docs(self, input_ids, attention_mask=None, token_type_ids=None, **kwargs) -> torch.Tensor:
        encoder = self.query_encoder if self.doc_encoder is None else self.doc_encoder
        return self._encode(encoder, input_ids, attention_mask, token_type_ids, **kwargs)

    def forward(
        self,
        query_input_ids: torch.Tensor | None = None,
        query_attention_mask: torch.Tensor | None = None,
        query_token_type_ids: torch.Tensor | None = None,
        doc_input_ids: torch.Tensor | None = None,
        doc_attention_mask: torch.Tensor | None = None,
        doc_token_type_ids: torch.Tensor | None = None,
        return_loss: bool = False,
        **kwargs,
    ) -> DualEncoderOutput:
        query_embeds = doc_embeds = loss = None
        if query_input_ids is not None:
            query_embeds = self.encode_queries(query_input_ids, query_attention_mask, query_token_type_ids)
        if doc_input_ids is not None:
            doc_embeds = self.encode_docs(doc_input_ids, doc_attention_mask, doc_token_type_ids)
        scale = self.logit_scale.exp()
        if return_loss:
            if query_embeds is None or doc_embeds is None:
                raise ValueError("return_loss=True needs both query_input_ids and doc_input_ids")
            from .loss import contrastive_loss

            loss = contrastive_loss(query_embeds, doc_embeds, scale)
        return DualEncoderOutput(loss=loss, query_embeds=query_embeds, doc_embeds=doc_embeds,
                                 logit_scale=scale)


def _load_tower(source, from_pretrained_kwargs) -> PreTrainedModel:
    if isinstance(source, PretrainedConfig):
        return AutoModel.from_config(source)
    if isinstance(source, str):
        return AutoModel.from_pretrained(source, **from_pretrained_kwargs)
    raise TypeError(
        f"an encoder must be a checkpoint name/path or a PretrainedConfig, got {type(source).__name__}"
    )


AutoConfig.register(DualEncoderConfig.model_type, DualEncoderConfig, exist_ok=True)
AutoModel.register(DualEncoderConfig, DualEncoder, exist_ok=True)
