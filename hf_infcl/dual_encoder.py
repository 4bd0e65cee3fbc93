"""``DualEncoder``: a text retriever as a ``PreTrainedModel``, its config and its tokenize helpers.

Query and document towers (shared or separate) from any ``AutoModel`` checkpoint or config, with
pooling; ``DualEncoderConfig`` is registered for the Auto classes when this module is imported.
Encoder towers (BERT-like) and decoder towers (Qwen2/Qwen3/Llama-style LLMs, see
:func:`is_decoder_config`) are both supported; a decoder tower is given position ids counted over
its attention mask, so its embeddings do not depend on the padding side.

How the Trainer reads this model (its inputs, embeddings and loss parameters) is its adapter in
``hf_infcl.models``; this module imports nothing else of hf_infcl but the loss, lazily, for
``forward(return_loss=True)``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, BatchEncoding, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput, logging

from .ops.options import check_positive_int

try:
    from transformers import initialization as _hf_init
except ImportError:  # transformers 4.x
    _hf_init = None

__all__ = [
    "DualEncoder",
    "DualEncoderConfig",
    "DualEncoderOutput",
    "POOLINGS",
    "decoder_position_ids",
    "is_decoder_config",
    "tokenize_texts",
]

# The logger keeps the name it had before this module was split out of hf_infcl.models, so that
# log filters and levels users set on "hf_infcl.models" still reach the config's warnings.
logger = logging.get_logger("hf_infcl.models")

POOLINGS = ("cls", "mean", "last")
SIDES = ("query", "doc")


def is_decoder_config(config: dict | PretrainedConfig) -> bool:
    """Whether a tower's config (a ``PretrainedConfig`` or a dict with ``model_type``) is a decoder.

    The rule: ``config.is_decoder`` is true, or the model type has a causal-LM head in transformers
    (``AutoModelForCausalLM``) and no masked-LM head (``AutoModelForMaskedLM``). So decoder-only
    LLMs (qwen2, qwen3, llama, mistral, gemma, phi3, gpt2, ...) are decoders; BERT-like encoders
    (bert, roberta, xlm-roberta, modernbert, ...) are not, as they have a masked-LM head (bert and
    roberta also have a causal-LM head, used only with ``is_decoder=True``). It reads the config
    only, so it gives the same answer before and after the weights are loaded.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if isinstance(config, PretrainedConfig):
        is_decoder, model_type = getattr(config, "is_decoder", False), getattr(config, "model_type", None)
    else:
        is_decoder, model_type = config.get("is_decoder", False), config.get("model_type")
    if is_decoder:
        return True
    causal, masked = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return model_type in causal and model_type not in masked


def decoder_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over the attended tokens: 0 at each row's first token, whatever the padding.

    A decoder numbers its positions 0..L-1 when it is given none, so a left-padded row would start
    at the number of padding tokens and its rotary/absolute positions (hence its hidden states)
    would differ from the same text right-padded. Padding positions get 0 (left) or repeat the
    last position (right); they are masked out anyway.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)


class DualEncoderConfig(PretrainedConfig):
    """Configuration of :class:`DualEncoder`.

    Args:
        query_encoder: the config (as a dict with ``model_type``, or a ``PretrainedConfig``) of
            the query tower, any ``AutoModel`` architecture: an encoder (BERT-like) or a decoder
            (Qwen2/Qwen3/Llama-style, see :func:`is_decoder_config`).
        doc_encoder: the document tower's config when the towers are separate; None shares the
            query tower.
        pooling: ``"cls"`` (first token; encoders only), ``"mean"`` (mean over the attention mask)
            or ``"last"`` (each row's last attended token, left or right padding: what decoder
            towers use). None means ``"mean"``, the default since the first release;
            :meth:`DualEncoder.from_encoders` picks ``"last"`` for decoder towers instead.
        normalize: L2-normalise the embeddings.
        logit_scale_init: the initial scale s of the logits (e.g. 20 = temperature 0.05).
        learn_scale: learn log(s), the parameter ``log_logit_scale``; otherwise s stays fixed.
        query_instruction: text put before every query by :meth:`DualEncoder.tokenize` (and
            :func:`tokenize_texts`), e.g. ``"Instruct: Given a web search query, retrieve relevant
            passages that answer the query\\nQuery: "`` as Qwen3-Embedding, gte-Qwen2 and E5-mistral
            are trained; saved with the model so that whoever loads it encodes queries the same way.
        doc_instruction: the same for documents (most LLM embedders use none; E5 uses ``"passage: "``).
        append_eos: :meth:`DualEncoder.tokenize` ends every text with the tokenizer's EOS token
            when the tokenizer does not add it (Qwen2's and Llama's do not), so that last-token
            pooling reads the hidden state of the EOS token, as Qwen3-Embedding and E5-mistral do.
        encoder_attn_implementation: the towers' attention (``"sdpa"``, ``"eager"``,
            ``"flash_attention_2"``, ...); None is transformers' default (SDPA where the architecture
            supports it, else eager). Kept here, as the towers' own configs do not save it.
    """

    model_type = "infcl_dual_encoder"

    def __init__(
        self,
        query_encoder: dict | PretrainedConfig | None = None,
        doc_encoder: dict | PretrainedConfig | None = None,
        pooling: str | None = None,
        normalize: bool = True,
        logit_scale_init: float = 20.0,
        learn_scale: bool = False,
        query_instruction: str | None = None,
        doc_instruction: str | None = None,
        append_eos: bool = False,
        encoder_attn_implementation: str | None = None,
        **kwargs,
    ):
        self.query_encoder = _config_dict(query_encoder, "query_encoder")
        self.doc_encoder = _config_dict(doc_encoder, "doc_encoder")
        decoder = self.has_decoder_tower
        if pooling is None:
            pooling = "mean"
            if decoder:
                logger.warning("DualEncoderConfig: pooling not given, so 'mean'; a decoder tower (%s) is "
                               "usually pooled at its last token: pass pooling='last'", self._tower_types())
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(map(repr, POOLINGS))}; got {pooling!r}")
        if pooling == "cls" and decoder:
            raise ValueError(
                f"pooling='cls' reads the first token, which a decoder tower ({self._tower_types()}) "
                "computes from that token alone: use pooling='last' (or 'mean')"
            )
        if not logit_scale_init > 0:
            raise ValueError(f"logit_scale_init must be > 0, got {logit_scale_init!r}")
        for name, value in (("query_instruction", query_instruction), ("doc_instruction", doc_instruction),
                            ("encoder_attn_implementation", encoder_attn_implementation)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string or None; got {type(value).__name__}")
        if not isinstance(append_eos, bool):
            raise TypeError(f"append_eos must be True or False; got {append_eos!r}")
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.logit_scale_init = float(logit_scale_init)
        self.learn_scale = bool(learn_scale)
        self.query_instruction = query_instruction or None
        self.doc_instruction = doc_instruction or None
        self.append_eos = append_eos
        self.encoder_attn_implementation = encoder_attn_implementation
        super().__init__(**kwargs)

    @property
    def shared_towers(self) -> bool:
        return self.doc_encoder is None

    @property
    def has_decoder_tower(self) -> bool:
        """Whether either tower is a decoder (:func:`is_decoder_config`)."""
        return any(is_decoder_config(c) for c in (self.query_encoder, self.doc_encoder) if c is not None)

    def _tower_types(self) -> str:
        return " / ".join(dict.fromkeys(c["model_type"] for c in (self.query_encoder, self.doc_encoder) if c))

    def instruction(self, side: str) -> str | None:
        """``query_instruction`` or ``doc_instruction`` (``side`` is "query" or "doc")."""
        if side not in SIDES:
            raise ValueError(f"side must be 'query' or 'doc'; got {side!r}")
        return self.query_instruction if side == "query" else self.doc_instruction

    def to_diff_dict(self) -> dict:
        # Always saved, even where equal to DualEncoderConfig()'s (transformers 4.x leaves such values
        # out; 5 keeps them): a decoder config saved with "mean" would load with the "pooling not
        # given" warning, and a reader of the file sees the pooling without knowing the defaults.
        diff = super().to_diff_dict()
        diff["pooling"] = self.pooling
        return diff


def _config_dict(config, name):
    if config is None:
        return None
    if isinstance(config, PretrainedConfig):
        config = config.to_dict()
    if not isinstance(config, dict) or "model_type" not in config:
        raise TypeError(f"{name} must be a PretrainedConfig or a dict with 'model_type'; got {config!r:.50}")
    return dict(config)


def _attn_kwargs(attn_implementation: str | None) -> dict:
    return {} if attn_implementation is None else {"attn_implementation": attn_implementation}


def _build_encoder(config_dict: dict, attn_implementation: str | None = None) -> PreTrainedModel:
    settings = dict(config_dict)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    return AutoModel.from_config(config, **_attn_kwargs(attn_implementation))


def tokenize_texts(
    tokenizer,
    texts,
    *,
    instruction: str | None = None,
    append_eos: bool = False,
    max_length: int | None = None,
    padding_side: str | None = None,
    return_tensors: str | None = "pt",
) -> BatchEncoding:
    """Tokenise ``texts`` (a string or a list) for a DualEncoder tower: padded ``input_ids`` and
    ``attention_mask`` (and ``token_type_ids`` where the tokenizer makes them).

    Args:
        instruction: put before every text (e.g. ``"Instruct: ...\\nQuery: "``); its tokens count
            towards ``max_length``, as in Qwen3-Embedding's and E5-mistral's own code.
        append_eos: end every text with ``tokenizer.eos_token_id`` when the tokenizer did not put it
            there; a text cut at ``max_length`` has its last token replaced, so it stays within
            ``max_length`` and still ends in EOS (E5-mistral cuts at ``max_length - 1`` and appends).
        max_length: truncate to this many tokens; None does not truncate.
        padding_side: "left" or "right"; None is the tokenizer's own. A DualEncoder gives the same
            embeddings either way.

    With no instruction and ``append_eos=False`` this is ``tokenizer(texts, padding=True,
    truncation=..., max_length=max_length)``.
    """
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a string or a list of strings")
    if instruction is not None and not isinstance(instruction, str):
        raise TypeError(f"instruction must be a string or None; got {type(instruction).__name__}")
    check_positive_int("max_length", max_length, optional=True)
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be 'left', 'right' or None; got {padding_side!r}")
    if tokenizer.pad_token_id is None and len(texts) > 1:
        raise ValueError(
            "the tokenizer has no pad_token, so texts of different lengths cannot be batched: set "
            "tokenizer.pad_token (e.g. tokenizer.pad_token = tokenizer.eos_token)"
        )
    if instruction:
        texts = [instruction + text for text in texts]
    pad = {} if padding_side is None else {"padding_side": padding_side}
    truncation = max_length is not None
    if not append_eos:
        return tokenizer(texts, padding=True, truncation=truncation, max_length=max_length,
                         return_tensors=return_tensors, **pad)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("append_eos=True needs a tokenizer with an eos_token (tokenizer.eos_token is None)")
    encoded = tokenizer(texts, padding=False, truncation=truncation, max_length=max_length)
    keep = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in encoded]
    rows = {name: [list(row) for row in encoded[name]] for name in keep}
    for i, ids in enumerate(rows["input_ids"]):
        if ids and ids[-1] == eos:
            continue
        if max_length is not None and len(ids) >= max_length:
            ids[-1] = eos
            continue
        ids.append(eos)
        if "attention_mask" in rows:
            rows["attention_mask"][i].append(1)
        if "token_type_ids" in rows:
            types = rows["token_type_ids"][i]
            types.append(types[-1] if types else 0)
    return tokenizer.pad(rows, padding=True, return_tensors=return_tensors, **pad)


@dataclass
class DualEncoderOutput(ModelOutput):
    """``loss`` (with ``return_loss=True``), the embeddings of each tower given, and the logit
    scale (the multiplier of the similarities: ``exp(log_logit_scale)``)."""

    loss: torch.Tensor | None = None
    query_embeds: torch.Tensor | None = None
    doc_embeds: torch.Tensor | None = None
    logit_scale: torch.Tensor | None = None


class DualEncoder(PreTrainedModel):
    """A text retriever: query and document towers (shared or separate) with pooling.

    Build one from checkpoints or configs with :meth:`from_encoders`; save and load it with
    ``save_pretrained``/``from_pretrained`` (also through ``AutoModel`` once this module is
    imported, as ``hf_infcl.models`` and ``hf_infcl.DualEncoder`` do). ``forward`` takes
    ``query_*`` and/or ``doc_*`` inputs and returns their embeddings; ``return_loss=True`` adds the
    symmetric InfoNCE loss over the pairs.

    Towers may be encoders (BERT-like) or decoders (Qwen2/Qwen3/Llama-style LLMs, see
    :func:`is_decoder_config`). A decoder tower is run with position ids counted over the attention
    mask (:func:`decoder_position_ids`) and without a KV cache, so a text's embedding is the same
    in a left- or right-padded batch; ``"last"`` pooling reads each row's last attended token.
    :meth:`tokenize` applies the saved query/document instructions and the EOS token.
    ``gradient_checkpointing_enable()`` reaches the towers' layers.
    """

    config_class = DualEncoderConfig
    base_model_prefix = "dual_encoder"
    supports_gradient_checkpointing = True
    main_input_name = "query_input_ids"

    def __init__(self, config: DualEncoderConfig, query_encoder: PreTrainedModel | None = None,
                 doc_encoder: PreTrainedModel | None = None):
        super().__init__(config)
        attn = config.encoder_attn_implementation
        if query_encoder is None:
            if config.query_encoder is None:
                raise ValueError("DualEncoderConfig.query_encoder is needed to build the query tower")
            query_encoder = _build_encoder(config.query_encoder, attn)
        self.query_encoder = query_encoder
        if config.shared_towers:
            self.doc_encoder = None
        else:
            if doc_encoder is None:
                doc_encoder = _build_encoder(config.doc_encoder, attn)
            self.doc_encoder = doc_encoder
        # Plain attributes (not in the state dict): how each tower is called.
        self._query_is_decoder = is_decoder_config(config.query_encoder)
        self._doc_is_decoder = self._query_is_decoder if config.shared_towers else is_decoder_config(
            config.doc_encoder)
        # The log of the logit scale (the scale is its exp, as for CLIP's logit_scale parameter).
        self.log_logit_scale = nn.Parameter(torch.tensor(math.log(config.logit_scale_init)),
                                            requires_grad=config.learn_scale)
        self.register_load_state_dict_pre_hook(_load_clip_scale_key)
        self.post_init()

    @classmethod
    def from_encoders(
        cls,
        query_encoder: str | PretrainedConfig,
        doc_encoder: str | PretrainedConfig | None = None,
        *,
        pooling: str | None = None,
        normalize: bool = True,
        logit_scale_init: float = 20.0,
        learn_scale: bool = False,
        query_instruction: str | None = None,
        doc_instruction: str | None = None,
        append_eos: bool | None = None,
        attn_implementation: str | None = None,
        **from_pretrained_kwargs,
    ) -> DualEncoder:
        """A DualEncoder from ``AutoModel`` checkpoints (names or paths) or configs.

        A config builds a randomly initialised tower; a checkpoint loads its weights. ``doc_encoder``
        None shares the query tower. ``pooling`` None is ``"last"`` when a tower is a decoder
        (:func:`is_decoder_config`), else ``"mean"``; ``append_eos`` None is True exactly when a
        decoder tower is pooled at its last token. ``attn_implementation`` (e.g. ``"sdpa"``,
        ``"eager"``, ``"flash_attention_2"``) is passed to the towers and kept in the config as
        ``encoder_attn_implementation``; None is transformers' default (SDPA where supported).
        Other keyword arguments (``dtype``, ``revision``, ...) go to ``AutoModel.from_pretrained``.
        """
        attn = _attn_kwargs(attn_implementation)
        towers = [_load_tower(query_encoder, from_pretrained_kwargs, attn, "query_encoder")]
        if doc_encoder is not None:
            towers.append(_load_tower(doc_encoder, from_pretrained_kwargs, attn, "doc_encoder"))
        decoder = any(is_decoder_config(tower.config) for tower in towers)
        if pooling is None:
            pooling = "last" if decoder else "mean"
        if append_eos is None:
            append_eos = decoder and pooling == "last"
        config = DualEncoderConfig(
            query_encoder=towers[0].config,
            doc_encoder=towers[1].config if len(towers) > 1 else None,
            pooling=pooling, normalize=normalize, logit_scale_init=logit_scale_init, learn_scale=learn_scale,
            query_instruction=query_instruction, doc_instruction=doc_instruction, append_eos=append_eos,
            encoder_attn_implementation=attn_implementation,
        )
        return cls(config, *towers)

    @classmethod
    def from_pretrained(cls, *args, attn_implementation: str | None = None, **kwargs):
        """``PreTrainedModel.from_pretrained``; ``attn_implementation`` is the towers' (see
        :meth:`set_attn_implementation`), else the one saved in the config."""
        model = super().from_pretrained(*args, **kwargs)
        # Loading replaces the parameter (requires_grad=True); a fixed scale must stay frozen, or
        # optimisers and DDP would wait for a gradient that never comes.
        model.log_logit_scale.requires_grad_(model.config.learn_scale)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        return model

    def set_attn_implementation(self, attn_implementation: str, **kwargs) -> None:
        """Switch the towers' attention (``"sdpa"``, ``"eager"``, ...) and record it in the config."""
        if not isinstance(attn_implementation, str):
            raise TypeError(f"attn_implementation must be a string; got {type(attn_implementation).__name__}")
        for tower in self._towers():
            tower.set_attn_implementation(attn_implementation, **kwargs)
        self.config.encoder_attn_implementation = attn_implementation

    def _towers(self) -> list[PreTrainedModel]:
        return [self.query_encoder] + ([] if self.doc_encoder is None else [self.doc_encoder])

    def _init_weights(self, module):
        # The towers initialise themselves (they are PreTrainedModels); only our scale is ours.
        if module is self:
            value = math.log(self.config.logit_scale_init)
            if _hf_init is not None:  # transformers 5: skips a scale that was just loaded
                _hf_init.constant_(self.log_logit_scale, value)
            else:
                with torch.no_grad():
                    self.log_logit_scale.fill_(value)

    def tokenize(self, tokenizer, texts, side: str = "query", *, max_length: int | None = None,
                 padding_side: str | None = None, return_tensors: str | None = "pt") -> BatchEncoding:
        """:func:`tokenize_texts` with this model's saved settings: ``side="query"`` puts
        ``config.query_instruction`` first, ``side="doc"`` ``config.doc_instruction``; both end in
        EOS when ``config.append_eos``. The result feeds :meth:`encode_queries` / :meth:`encode_docs`
        (or ``query_*`` / ``doc_*`` of ``forward``)."""
        return tokenize_texts(tokenizer, texts, instruction=self.config.instruction(side),
                              append_eos=self.config.append_eos, max_length=max_length,
                              padding_side=padding_side, return_tensors=return_tensors)

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        pooling = self.config.pooling
        if attention_mask is None:
            attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        if pooling == "cls":
            return hidden[:, 0]
        if pooling == "mean":
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
            return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        # last: each row's last attended position, so left padding (every row ends at the last
        # position), right padding (the row's last token) and full rows are all read correctly.
        # A row with no attended token reads position 0.
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        last = torch.where(attention_mask.bool(), positions, 0).amax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    def _encode(self, encoder, is_decoder, input_ids, attention_mask=None, token_type_ids=None, **kwargs):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        if is_decoder:
            inputs.setdefault("use_cache", False)  # training and embedding need no KV cache
            if attention_mask is not None and inputs.get("position_ids") is None:
                inputs["position_ids"] = decoder_position_ids(attention_mask)
        output = encoder(**inputs)
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        pooled = self._pool(hidden, attention_mask)
        return nn.functional.normalize(pooled, dim=-1) if self.config.normalize else pooled

    def get_input_embeddings(self) -> nn.Module:
        """The query tower's token embeddings (the only ones when the towers are shared).
        Accelerate's FSDP2 preparation asks for them to shard them as a unit of their own."""
        return self.query_encoder.get_input_embeddings()

    def encode_queries(self, input_ids, attention_mask=None, token_type_ids=None, **kwargs) -> torch.Tensor:
        return self._encode(self.query_encoder, self._query_is_decoder, input_ids, attention_mask,
                            token_type_ids, **kwargs)

    def encode_docs(self, input_ids, attention_mask=None, token_type_ids=None, **kwargs) -> torch.Tensor:
        encoder = self.query_encoder if self.doc_encoder is None else self.doc_encoder
        return self._encode(encoder, self._doc_is_decoder, input_ids, attention_mask, token_type_ids,
                            **kwargs)

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
        scale = self.log_logit_scale.exp()
        if return_loss:
            if query_embeds is None or doc_embeds is None:
                raise ValueError("return_loss=True needs both query_input_ids and doc_input_ids")
            from .loss import contrastive_loss

            loss = contrastive_loss(query_embeds, doc_embeds, scale)
        return DualEncoderOutput(loss=loss, query_embeds=query_embeds, doc_embeds=doc_embeds,
                                 logit_scale=scale)


# A state dict may hold the log-scale under CLIP's key, "logit_scale": the model's checkpoints
# written by transformers >= 5 do (its save writes the key the conversion mapping below loads).
CLIP_SCALE_KEY, SCALE_KEY = "logit_scale", "log_logit_scale"


def _load_clip_scale_key(module, state_dict, prefix, *args) -> None:
    """A ``load_state_dict`` pre-hook: the log-scale under CLIP's key loads into ``log_logit_scale``."""
    clip_key, key = prefix + CLIP_SCALE_KEY, prefix + SCALE_KEY
    if clip_key in state_dict and key not in state_dict:
        state_dict[key] = state_dict.pop(clip_key)


def _register_clip_scale_key() -> None:
    """The same for ``from_pretrained``: transformers >= 5 loads through its conversion mapping
    (4.x through ``load_state_dict``, so the pre-hook serves)."""
    try:
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return
    renaming = WeightRenaming(source_patterns=f"^{CLIP_SCALE_KEY}", target_patterns=SCALE_KEY)
    register_checkpoint_conversion_mapping(DualEncoderConfig.model_type, [renaming], overwrite=True)


def _load_tower(source, from_pretrained_kwargs, attn_kwargs, name) -> PreTrainedModel:
    if isinstance(source, PretrainedConfig):
        # from_config writes the attention choice into the config it is given: work on a copy
        return AutoModel.from_config(copy.deepcopy(source), **attn_kwargs)
    if isinstance(source, str):
        return AutoModel.from_pretrained(source, **attn_kwargs, **from_pretrained_kwargs)
    raise TypeError(
        f"{name} must be a checkpoint name/path or a PretrainedConfig, got {type(source).__name__}"
    )


AutoConfig.register(DualEncoderConfig.model_type, DualEncoderConfig, exist_ok=True)
AutoModel.register(DualEncoderConfig, DualEncoder, exist_ok=True)
_register_clip_scale_key()
