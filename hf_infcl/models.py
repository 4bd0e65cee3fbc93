"""How embeddings, logit scale and bias are taken from contrastive Hugging Face models.

One adapter per model family (:class:`ModelFamily`) says everything the Trainer and the helpers
below need of a model: the batch entries of each tower, how to encode rows, keys or both in one
forward, the names of the two sides, and the loss parameters (the log-scale parameter and an
optional bias parameter). :func:`model_family` picks the adapter; nothing else here asks which
family a model belongs to. Two families are supported:

- CLIP-like image-text models (:class:`ClipFamily`) with ``get_image_features``/
  ``get_text_features`` and a ``logit_scale`` parameter (log of the scale): ``CLIPModel``,
  ``VisionTextDualEncoderModel``, ``SiglipModel`` (sigmoid loss, with ``logit_bias``). In
  transformers 5 the feature methods return an output object whose ``pooler_output`` is the
  projected embedding; in 4.x they return the tensor. Both are handled. Embeddings are
  L2-normalised, as these models' own losses do.
- :class:`~hf_infcl.dual_encoder.DualEncoder` (:class:`DualEncoderFamily`), the text retriever of
  ``hf_infcl.dual_encoder``; its names (``DualEncoder``, ``DualEncoderConfig``,
  ``tokenize_texts``, ...) are re-exported here.

Rows ("queries" of the loss contract) are images or queries; keys are texts or documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .dual_encoder import (
    POOLINGS,
    DualEncoder,
    DualEncoderConfig,
    DualEncoderOutput,
    decoder_position_ids,
    is_decoder_config,
    tokenize_texts,
)

__all__ = [
    "DualEncoder",
    "DualEncoderConfig",
    "DualEncoderOutput",
    "POOLINGS",
    "ClipFamily",
    "DualEncoderFamily",
    "ModelFamily",
    "TowerInputs",
    "contrastive_loss_kind",
    "decoder_position_ids",
    "encode_keys",
    "encode_queries",
    "is_decoder_config",
    "logit_bias_of",
    "logit_scale_of",
    "model_family",
    "pair_embeddings",
    "scale_and_bias",
    "tokenize_texts",
    "tower_inputs",
    "unwrap_model",
]

IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
QUERY_INPUTS = ("query_input_ids", "query_attention_mask", "query_token_type_ids")
DOC_INPUTS = ("doc_input_ids", "doc_attention_mask", "doc_token_type_ids")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / Accelerate / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


@dataclass(frozen=True)
class TowerInputs:
    """The batch keys each tower reads (rows = images/queries, keys = texts/documents)."""

    query: tuple[str, ...]
    key: tuple[str, ...]


def _select(batch, names):
    return {name: batch[name] for name in names if batch.get(name) is not None}


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


# --------------------------------------------------------------------------------------------
# One adapter per model family


class ModelFamily:
    """How hf_infcl reads one family of contrastive models. Stateless: every method takes the
    model (wrapped or not) and reads it *now*, so it sees the parameters as they are held at that
    moment (under FSDP2: sharded DTensors between steps, 1-element vectors for ``fully_shard``).

    Attributes:
        name: the family's model-card template (``hf_infcl.model_card.KINDS``).
        rows, keys: what the two sides are called in metric names (``eval_{rows}_to_{keys}_...``).
        inputs: the batch entries each tower reads.
    """

    name: str
    rows: str
    keys: str
    inputs: TowerInputs

    def encode_rows(self, model, batch: dict) -> torch.Tensor:
        """L2-normalised row embeddings of ``batch`` (the feature method of the unwrapped model)."""
        raise NotImplementedError

    def encode_keys(self, model, batch: dict) -> torch.Tensor:
        """L2-normalised key embeddings of ``batch``."""
        raise NotImplementedError

    def encode_pairs(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(row embeddings, key embeddings) from ONE call of ``model``'s forward (the wrapper's:
        under DDP only a call of the wrapped module's forward prepares the gradient all-reduce)."""
        raise NotImplementedError

    def encode_pairs_on_two_streams(self, model, batch: dict,
                                    key_stream) -> tuple[torch.Tensor, torch.Tensor]:
        """(row embeddings, key embeddings), the key tower on the CUDA stream ``key_stream`` while
        the row tower runs on the current one. Two small towers fill a GPU that each leaves partly
        idle; inside a CUDA graph the two run concurrently. The key tower runs first (its random
        numbers are drawn first). This calls the towers' feature methods, not the model's forward,
        so a DDP wrapper's hooks do not run: for one process."""
        current = torch.cuda.current_stream()
        key_stream.wait_stream(current)
        with torch.cuda.stream(key_stream):
            keys = self.encode_keys(model, batch)
        rows = self.encode_rows(model, batch)
        current.wait_stream(key_stream)
        # a copy made on the current stream: the caching allocator may hand the key stream's block
        # out again once the key stream moves on
        return rows, keys.clone()

    def log_scale(self, model) -> torch.Tensor:
        """The learned log of the logit scale: the parameter itself, as the model holds it now."""
        return unwrap_model(model).logit_scale

    def bias(self, model) -> torch.Tensor | None:
        """SigLIP's additive logit bias parameter, as the model holds it now, or None."""
        bias = getattr(unwrap_model(model), "logit_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def loss_parameters(self, model, loss: str) -> list[torch.Tensor]:
        """The parameters the loss reads directly: ``[log_scale]``, plus the bias for the
        ``"sigmoid"`` loss when the model has one. Parameters, not values: gradient caching and
        FSDP2 need the objects the optimizer updates (:func:`scale_and_bias` makes the values)."""
        params = [self.log_scale(model)]
        bias = self.bias(model) if loss == "sigmoid" else None
        if bias is not None:
            params.append(bias)
        return params


class ClipFamily(ModelFamily):
    """CLIP-like image-text models: ``get_image_features`` / ``get_text_features`` and a
    ``logit_scale`` (``CLIPModel``, ``SiglipModel``, ``VisionTextDualEncoderModel``, ...)."""

    name, rows, keys = "clip", "image", "text"
    inputs = TowerInputs(IMAGE_INPUTS, TEXT_INPUTS)
    REQUIRED = ("get_image_features", "get_text_features", "logit_scale")

    def encode_rows(self, model, batch):
        features = _pooled(unwrap_model(model).get_image_features(**_select(batch, IMAGE_INPUTS)))
        return nn.functional.normalize(features, dim=-1)

    def encode_keys(self, model, batch):
        features = _pooled(unwrap_model(model).get_text_features(**_select(batch, TEXT_INPUTS)))
        return nn.functional.normalize(features, dim=-1)

    def encode_pairs(self, model, batch):
        output = model(**_select(batch, self.inputs.query + self.inputs.key))
        return output.image_embeds, output.text_embeds


class DualEncoderFamily(ModelFamily):
    """:class:`~hf_infcl.dual_encoder.DualEncoder`: ``query_*`` and ``doc_*`` inputs."""

    name, rows, keys = "dual_encoder", "query", "doc"
    inputs = TowerInputs(QUERY_INPUTS, DOC_INPUTS)

    def encode_rows(self, model, batch):
        inputs = _select(batch, QUERY_INPUTS)
        return unwrap_model(model).encode_queries(**{k[len("query_"):]: v for k, v in inputs.items()})

    def encode_keys(self, model, batch):
        inputs = _select(batch, DOC_INPUTS)
        return unwrap_model(model).encode_docs(**{k[len("doc_"):]: v for k, v in inputs.items()})

    def encode_pairs(self, model, batch):
        output = model(**_select(batch, self.inputs.query + self.inputs.key))
        return output.query_embeds, output.doc_embeds


CLIP_FAMILY = ClipFamily()
DUAL_ENCODER_FAMILY = DualEncoderFamily()


def model_family(model) -> ModelFamily:
    """The adapter of ``model``'s family (wrappers are looked through); TypeError if none fits."""
    inner = unwrap_model(model)
    if isinstance(inner, DualEncoder):
        return DUAL_ENCODER_FAMILY
    missing = [name for name in ClipFamily.REQUIRED if not hasattr(inner, name)]
    if missing:
        raise TypeError(
            f"{type(inner).__name__} is not a supported contrastive model: it lacks {', '.join(missing)} "
            "(use a CLIP-like model, e.g. CLIPModel, SiglipModel, VisionTextDualEncoderModel, or DualEncoder)"
        )
    return CLIP_FAMILY


# --------------------------------------------------------------------------------------------
# Model-agnostic access


def scale_and_bias(log_scale: torch.Tensor, bias: torch.Tensor | None = None):
    """The loss's values of its parameters: ``(exp(log_scale), bias)`` as 0-d tensors
    (differentiable; 1-element parameters, as FSDP2 needs them, become 0-d)."""
    return log_scale.reshape(()).exp(), None if bias is None else bias.reshape(())


def tower_inputs(model) -> TowerInputs:
    """Which batch entries feed the row tower and which feed the key tower."""
    return model_family(model).inputs


def contrastive_loss_kind(model) -> str:
    """``"sigmoid"`` for models trained with SigLIP's loss (they have ``logit_bias``), else ``"softmax"``."""
    return "softmax" if model_family(model).bias(model) is None else "sigmoid"


def logit_scale_of(model) -> torch.Tensor:
    """The multiplier of the logits, ``exp(logit_scale)`` (differentiable)."""
    return scale_and_bias(model_family(model).log_scale(model))[0]


def logit_bias_of(model) -> torch.Tensor | None:
    """SigLIP's additive logit bias (differentiable), or None."""
    bias = model_family(model).bias(model)
    return None if bias is None else bias.reshape(())


def encode_queries(model, batch: dict) -> torch.Tensor:
    """L2-normalised row embeddings (images, or queries for a DualEncoder) of ``batch``."""
    return model_family(model).encode_rows(model, batch)


def encode_keys(model, batch: dict) -> torch.Tensor:
    """L2-normalised key embeddings (texts, or documents for a DualEncoder) of ``batch``."""
    return model_family(model).encode_keys(model, batch)


def pair_embeddings(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(row embeddings, key embeddings) from ONE call of ``model``'s forward on a paired batch.

    Going through ``forward`` (rather than the feature methods) matters under DDP: only a call of
    the wrapped module's forward prepares the gradient all-reduce.
    """
    return model_family(model).encode_pairs(model, batch)
