"""How embeddings, logit scale and bias are taken from contrastive Hugging Face models.

One adapter per model family (:class:`ModelFamily`) says everything the Trainer and the helpers
below need of a model: the batch entries of each tower, how to encode rows, keys or both in one
forward, the names of the two sides, the loss parameters (the parameters behind the scale, and an
optional bias parameter), how the model's own forward turns their values into the loss's scale
and bias, and the loss the model's own ``return_loss=True`` computes from them.
:func:`model_family` picks the adapter; nothing else here asks which family a model belongs to.
The families:

- CLIP-like image-text models (:class:`ClipFamily`) with ``get_image_features``/
  ``get_text_features`` and a ``logit_scale`` parameter (log of the scale): ``CLIPModel``,
  ``VisionTextDualEncoderModel``, ``SiglipModel`` (sigmoid loss, with ``logit_bias``), ... In
  transformers 5 the feature methods return an output object whose ``pooler_output`` is the
  projected embedding; in 4.x they return the tensor. Both are handled. Embeddings are
  L2-normalised, as these models' own losses do.
- ``Aimv2Model`` (:class:`Aimv2Family`): CLIP-like, its forward clamps the log-scale to
  ``[0, log(max_logit_scale)]`` before ``exp``.
- ``AlignModel`` (:class:`AlignFamily`): CLIP-like, the scale is ``1 / temperature``, and its own
  loss smooths the labels by 0.1.
- ``ClapModel`` (:class:`ClapFamily`): audio-text (``input_features``, ``is_longer``), a log-scale
  per term of its own loss (``logit_scale_a``, ``logit_scale_t``).
- :class:`~hf_infcl.dual_encoder.DualEncoder` (:class:`DualEncoderFamily`), the text retriever of
  ``hf_infcl.dual_encoder``.

Models whose embeddings of one side depend on the other side's inputs (``XCLIPModel``: text
conditioned on the video; BridgeTower: cross-modal layers) are refused with the reason.

Rows ("queries" of the loss contract) are images, audio clips or queries; keys are texts or
documents.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from . import dual_encoder  # the module, so that DualEncoder has one import path

__all__ = [
    "Aimv2Family",
    "AlignFamily",
    "ClapFamily",
    "ClipFamily",
    "DualEncoderFamily",
    "ModelFamily",
    "TowerInputs",
    "contrastive_loss_kind",
    "encode_keys",
    "encode_queries",
    "learned_log_scales",
    "model_family",
    "scale_and_bias",
    "unwrap_model",
]

IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
AUDIO_INPUTS = ("input_features", "is_longer")
CLAP_TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids")  # its forward passes extras to both towers
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


@contextlib.contextmanager
def _without_autocast_cache():
    """Inside an enclosing CUDA autocast, no cache of cast weights: autocast keeps each weight's
    low-precision copy for its whole region, so a tower shared by both streams would read, on one
    stream, a copy cast on the other without waiting for the cast (in a CUDA graph, whose replays
    keep no such order, it reads stale memory); and a cache filled during a graph's capture is
    what PyTorch's CUDA-graph notes ask to avoid. Each stream then casts the weights it uses."""
    if not torch.is_autocast_enabled("cuda"):
        yield
        return
    with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
        yield


class ModelFamily:
    """How hf_infcl reads one family of contrastive models. Stateless: every method takes the
    model (wrapped or not) and reads it *now*, so it sees the parameters as they are held at that
    moment (under FSDP2: sharded DTensors between steps, 1-element vectors for ``fully_shard``).

    Attributes:
        name: the family's model-card template (``hf_infcl.model_card.KINDS``).
        rows, keys: what the two sides are called in metric names (``eval_{rows}_to_{keys}_...``).
        inputs: the batch entries each tower reads.
        label_smoothing: the label smoothing of the model's own loss (the Trainer's default).
        distillable: whether its loss is one softmax loss with one scale, which distillation's KL
            replaces (``InfCLTrainingArguments.distillation_weight``).
    """

    name: str
    rows: str
    keys: str
    inputs: TowerInputs
    REQUIRED: tuple[str, ...] = ()  # attributes a model of the family has
    label_smoothing: float = 0.0
    distillable: bool = True

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
        with _without_autocast_cache():
            with torch.cuda.stream(key_stream):
                keys = self.encode_keys(model, batch)
            rows = self.encode_rows(model, batch)
        current.wait_stream(key_stream)
        # a copy made on the current stream: the caching allocator may hand the key stream's block
        # out again once the key stream moves on
        return rows, keys.clone()

    def log_scale(self, model) -> torch.Tensor:
        """The learned log of the logit scale: the parameter itself, as the model holds it now
        (transformers' CLIP-like models name it ``logit_scale``)."""
        return unwrap_model(model).logit_scale

    def bias(self, model) -> torch.Tensor | None:
        """SigLIP's additive logit bias parameter, as the model holds it now, or None."""
        bias = getattr(unwrap_model(model), "logit_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def scale_parameters(self, model) -> list[torch.Tensor]:
        """The parameters behind the loss's scale(s), as the model holds them now, in the order
        :meth:`scale_and_bias` and :meth:`loss` take their values."""
        return [self.log_scale(model)]

    def loss_parameters(self, model, loss: str) -> list[torch.Tensor]:
        """The parameters the loss reads directly: :meth:`scale_parameters`, plus the bias for the
        ``"sigmoid"`` loss when the model has one. Parameters, not values: gradient caching and
        FSDP2 need the objects the optimizer updates (:meth:`scale_and_bias` makes the values)."""
        params = self.scale_parameters(model)
        bias = self.bias(model) if loss == "sigmoid" else None
        if bias is not None:
            params.append(bias)
        return params

    def scale_and_bias(self, model, *values) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss's ``(scale, bias)`` as 0-d tensors from the values of :meth:`loss_parameters`
        (whole values: under FSDP2 gathered, as ``cached_step`` hands them to the loss), taken as
        the model's own forward takes them; differentiable. ``model`` gives the constants of the
        transform (Aimv2's clamp), never the values."""
        return scale_and_bias(*values)

    def loss(self, model, contrastive, rows, keys, *values) -> torch.Tensor:
        """The loss of ``rows`` against ``keys`` that the model's own ``return_loss=True``
        computes, from ``contrastive(queries, keys, scale, bias, symmetric=...)`` (the caller's
        configured :func:`hf_infcl.contrastive_loss`) and the values of :meth:`loss_parameters`."""
        return contrastive(rows, keys, *self.scale_and_bias(model, *values))

    def check_loss_options(self, loss: str, symmetric: bool) -> None:
        """Raise ValueError for a ``contrastive_loss`` kind or ``symmetric`` setting this family's
        loss does not define."""

    def logged_scales(self, model, *values) -> dict[str, torch.Tensor]:
        """The scale(s) to log, by name, from the values of :meth:`scale_parameters`."""
        return {"logit_scale": self.scale_and_bias(model, *values)[0]}

    def clamped_log_scales(self, model) -> list[torch.Tensor]:
        """The learned log-scale parameters that a ``logit_scale_max`` clamp applies to."""
        return self.scale_parameters(model)


class ClipFamily(ModelFamily):
    """CLIP-like image-text models: ``get_image_features`` / ``get_text_features`` and a
    ``logit_scale`` (``CLIPModel``, ``SiglipModel``, ``VisionTextDualEncoderModel``, ...)."""

    name, rows, keys = "clip", "image", "text"
    inputs = TowerInputs(IMAGE_INPUTS, TEXT_INPUTS)
    REQUIRED = ("get_image_features", "get_text_features", "logit_scale")
    # each tower's feature method, and the forward's output of its embeddings: (rows, keys)
    FEATURES = ("get_image_features", "get_text_features")
    EMBEDS = ("image_embeds", "text_embeds")

    def encode_rows(self, model, batch):
        return self._features(model, self.FEATURES[0], _select(batch, self.inputs.query))

    def encode_keys(self, model, batch):
        return self._features(model, self.FEATURES[1], _select(batch, self.inputs.key))

    def encode_pairs(self, model, batch):
        output = model(**_select(batch, self.inputs.query + self.inputs.key))
        return getattr(output, self.EMBEDS[0]), getattr(output, self.EMBEDS[1])

    @staticmethod
    def _features(model, method: str, inputs: dict) -> torch.Tensor:
        features = _pooled(getattr(unwrap_model(model), method)(**inputs))
        return nn.functional.normalize(features, dim=-1)


class Aimv2Family(ClipFamily):
    """``Aimv2Model``: its forward takes ``logit_scale.clamp(0, max_log_logit_scale).exp()`` (no
    gradient reaches the parameter outside that range)."""

    def scale_and_bias(self, model, log_scale, bias=None):
        maximum = float(getattr(unwrap_model(model), "max_log_logit_scale", math.log(100.0)))
        return scale_and_bias(log_scale.clamp(0.0, maximum), bias)


class AlignFamily(ClipFamily):
    """``AlignModel``: logits are ``similarity / temperature`` (a learned ``temperature``, not a
    log-scale), and its own loss is the symmetric cross-entropy with ``label_smoothing=0.1``. The
    temperature is left to the optimizer, as the model's own training leaves it (no clamp)."""

    label_smoothing = 0.1
    REQUIRED = ("get_image_features", "get_text_features", "temperature")

    def scale_parameters(self, model):
        return [unwrap_model(model).temperature]

    def scale_and_bias(self, model, temperature, bias=None):
        return 1.0 / temperature.reshape(()), None if bias is None else bias.reshape(())

    def clamped_log_scales(self, model):
        return []


class ClapFamily(ClipFamily):
    """``ClapModel`` (audio-text): ``get_audio_features`` (``input_features``, ``is_longer``) /
    ``get_text_features``, encoded as CLIP's towers are; rows are audio clips, keys texts. Its own
    loss has two terms, each with its own learned log-scale: ``cross_entropy(logits_per_text)``
    with ``logit_scale_t`` and ``cross_entropy(logits_per_audio.t())`` with ``logit_scale_a``,
    averaged. Both rank the audio clips for each text (``logits_per_audio.t()`` is the text-rows
    matrix again), so the loss here is two text-to-audio passes, one per scale: the model's own,
    value and gradients."""

    name, rows, keys = "clap", "audio", "text"
    distillable = False  # two text-to-audio terms, a scale each
    inputs = TowerInputs(AUDIO_INPUTS, CLAP_TEXT_INPUTS)
    REQUIRED = ("get_audio_features", "get_text_features", "logit_scale_a", "logit_scale_t")
    FEATURES = ("get_audio_features", "get_text_features")
    EMBEDS = ("audio_embeds", "text_embeds")

    def log_scale(self, model):
        raise TypeError("ClapModel has a log-scale per term of its loss (logit_scale_a, logit_scale_t), "
                        "not one logit_scale: use scale_parameters")

    def bias(self, model):
        return None

    def scale_parameters(self, model):
        inner = unwrap_model(model)
        return [inner.logit_scale_a, inner.logit_scale_t]

    def scale_and_bias(self, model, *values):
        raise TypeError("ClapModel's loss uses two scales (logit_scale_a, logit_scale_t), one per term; "
                        "ClapFamily.loss applies them")

    def loss(self, model, contrastive, rows, keys, log_scale_audio, log_scale_text):
        texts, audio = keys, rows
        with_text_scale = contrastive(texts, audio, log_scale_text.reshape(()).exp(), None, symmetric=False)
        with_audio_scale = contrastive(texts, audio, log_scale_audio.reshape(()).exp(), None, symmetric=False)
        return (with_text_scale + with_audio_scale) / 2

    def check_loss_options(self, loss, symmetric):
        if loss != "softmax" or not symmetric:
            raise ValueError(
                "ClapModel trains with its own loss (two softmax terms, each with its own scale); "
                f"contrastive_loss={loss!r} with symmetric={symmetric} is not defined for it: leave "
                "contrastive_loss=None (or 'softmax') and symmetric=True"
            )

    def logged_scales(self, model, log_scale_audio, log_scale_text):
        return {"logit_scale_audio": log_scale_audio.reshape(()).exp(),
                "logit_scale_text": log_scale_text.reshape(()).exp()}


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

    def log_scale(self, model):
        return unwrap_model(model).log_logit_scale


CLIP_FAMILY = ClipFamily()
DUAL_ENCODER_FAMILY = DualEncoderFamily()
# Families whose forward takes the scale, the inputs or the loss otherwise, by config.model_type.
FAMILIES = {"aimv2": Aimv2Family(), "align": AlignFamily(), "clap": ClapFamily()}
# Contrastive models no adapter can take embeddings from, and why.
UNSUPPORTED = {
    "xclip": "its text embeddings are conditioned on the video (a prompt generator mixes each video's "
             "features into every text), so a text has one embedding per video, not one per text",
    "bridgetower": "its image and text embeddings come out of cross-modal layers in which each side "
                   "attends to the other, so neither tower's embedding exists without its pair",
}


def model_family(model) -> ModelFamily:
    """The adapter of ``model``'s family (wrappers are looked through); TypeError if none fits."""
    inner = unwrap_model(model)
    if isinstance(inner, dual_encoder.DualEncoder):
        return DUAL_ENCODER_FAMILY
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type in UNSUPPORTED:
        raise TypeError(f"{type(inner).__name__} is not a supported contrastive model: "
                        f"{UNSUPPORTED[model_type]}. The loss needs two towers that embed each side alone")
    family = FAMILIES.get(model_type, CLIP_FAMILY)
    missing = [name for name in family.REQUIRED if not hasattr(inner, name)]
    if missing:
        raise TypeError(
            f"{type(inner).__name__} is not a supported contrastive model: it lacks {', '.join(missing)} "
            "(use a CLIP-like model, e.g. CLIPModel, SiglipModel, VisionTextDualEncoderModel, AlignModel, "
            "ClapModel, or DualEncoder)"
        )
    return family


# --------------------------------------------------------------------------------------------
# Model-agnostic access


def scale_and_bias(log_scale: torch.Tensor, bias: torch.Tensor | None = None):
    """The loss's values of a log-scale and a bias: ``(exp(log_scale), bias)`` as 0-d tensors
    (differentiable; 1-element parameters, as FSDP2 needs them, become 0-d). What CLIP's forward
    does; a family that takes its scale otherwise says so in ``ModelFamily.scale_and_bias``."""
    return log_scale.reshape(()).exp(), None if bias is None else bias.reshape(())


def contrastive_loss_kind(model) -> str:
    """``"sigmoid"`` for models trained with SigLIP's loss (they have ``logit_bias``), else ``"softmax"``."""
    return "softmax" if model_family(model).bias(model) is None else "sigmoid"


def learned_log_scales(model) -> list[torch.Tensor]:
    """The learned log-scale parameters of ``model`` that a ``logit_scale_max`` clamp applies to
    (none for models no family fits, or whose scale is not a log-scale, as ALIGN's temperature)."""
    try:
        family = model_family(model)
    except TypeError:
        return []
    return [param for param in family.clamped_log_scales(model) if param.requires_grad]


def encode_queries(model, batch: dict) -> torch.Tensor:
    """L2-normalised row embeddings (images, or queries for a DualEncoder) of ``batch``."""
    return model_family(model).encode_rows(model, batch)


def encode_keys(model, batch: dict) -> torch.Tensor:
    """L2-normalised key embeddings (texts, or documents for a DualEncoder) of ``batch``."""
    return model_family(model).encode_keys(model, batch)
