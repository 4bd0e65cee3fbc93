"""Tiny CLIP-like models and their processors built from a config, so that the CLIP example
downloads nothing: CLIP, SigLIP, or SigLIP 2 (NaFlex: each image cut into at most
``max_num_patches`` patches at its own aspect ratio, with ``pixel_attention_mask`` and
``spatial_shapes`` beside ``pixel_values``).

The tokenizer is a word-level ``tokenizers`` model over the captions' vocabulary wrapped in
``PreTrainedTokenizerFast``; the image processor is the family's own, constructed from arguments.
Both are saved beside the model, so the output directory reloads with ``AutoModel`` and
``AutoProcessor`` like any checkpoint of the family.
"""

from __future__ import annotations

import re

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")
TINY_HEADS = 2  # attention heads per layer of the tiny model: its width must be a multiple
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(4)
FAMILIES = ("clip", "siglip", "siglip2")  # the model_type of each family the builders know
# Statistics of bright-on-dark scans differ from photos; 0.5 / 0.5 keeps inputs in [-1, 1].
HALF = [0.5, 0.5, 0.5]


def words_of(text: str) -> list[str]:
    """The tokenizer's own split (lower-cased word / punctuation runs), for the vocabulary."""
    return re.findall(r"\w+|[^\w\s]+", text.lower())


def build_word_tokenizer(texts, max_length: int = 32):
    """A ``PreTrainedTokenizerFast`` whose vocabulary is every word of ``texts``.

    Each text becomes ``[BOS] words [EOS]``; CLIP's text tower pools the hidden state at the
    first ``eos_token_id``, which the model config built below points at ``[EOS]``.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for text in texts:
        for word in words_of(text):
            vocabulary.setdefault(word, len(vocabulary))
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+|[^\w\s]+, as words_of
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", BOS_ID), ("[EOS]", EOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=max_length,
    )


def image_processor_class(name: str):
    """transformers' image processor class ``name``; where torchvision is not installed, its PIL
    twin ``<name>Pil`` (transformers 5), which the plain name falls back to with a warning."""
    import transformers
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available() and hasattr(transformers, f"{name}Pil"):
        return getattr(transformers, f"{name}Pil")
    return getattr(transformers, name)


def build_image_processor(image_size: int):
    """CLIP's preprocessing (resize, centre crop, normalise) at ``image_size`` pixels."""
    return image_processor_class("CLIPImageProcessor")(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_mean=HALF,
        image_std=HALF,
    )


def processor_for(config, tokenizer):
    """The processor of ``config``'s family, its images sized as ``config.vision_config`` says."""
    import transformers

    vision = config.vision_config
    if config.model_type == "clip":
        image_processor = build_image_processor(vision.image_size)
    elif config.model_type == "siglip":
        image_processor = image_processor_class("SiglipImageProcessor")(
            size={"height": vision.image_size, "width": vision.image_size}, image_mean=HALF, image_std=HALF)
    else:  # siglip2: at most num_patches patches per image, whatever its aspect ratio
        image_processor = image_processor_class("Siglip2ImageProcessor")(
            patch_size=vision.patch_size, max_num_patches=vision.num_patches, image_mean=HALF, image_std=HALF)
    processor_class = {"clip": "CLIPProcessor", "siglip": "SiglipProcessor", "siglip2": "Siglip2Processor"}
    return getattr(transformers, processor_class[config.model_type])(image_processor=image_processor,
                                                                     tokenizer=tokenizer)


def with_word_tokenizer(config, tokenizer):
    """``config`` with its text tower's vocabulary and special tokens those of the word-level
    ``tokenizer`` (CLIP's text tower pools at the first ``eos_token_id``: ``[EOS]``)."""
    text = config.text_config
    text.vocab_size = len(tokenizer)
    text.pad_token_id, text.bos_token_id, text.eos_token_id = PAD_ID, BOS_ID, EOS_ID
    return config


def tiny_config(family: str, tokenizer, image_size: int = 16, patch_size: int = 4, width: int = 64,
                layers: int = 2, heads: int = TINY_HEADS, projection_dim: int = 64,
                max_text_length: int = 32):
    """The config of a tiny model of ``family`` (one of :data:`FAMILIES`) over ``tokenizer``'s words.
    SigLIP 2 takes at most (``image_size`` / ``patch_size``)² patches of each image."""
    from transformers import AutoConfig

    tower = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                 num_attention_heads=heads, attention_dropout=0.0)
    text = dict(tower, max_position_embeddings=max_text_length, vocab_size=len(tokenizer),
                pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    vision = dict(tower, patch_size=patch_size, num_channels=3)
    if family == "siglip2":
        vision["num_patches"] = (image_size // patch_size) ** 2
    else:
        vision["image_size"] = image_size
    extra = {"projection_dim": projection_dim} if family == "clip" else {}
    return AutoConfig.for_model(family, text_config=text, vision_config=vision, **extra)


def model_for(config, seed: int = 0):
    """A freshly initialised model of ``config`` (its family's ``*Model``), drawn with ``seed``."""
    import torch
    from transformers import AutoModel

    torch.manual_seed(seed)
    return AutoModel.from_config(config)


def build_tiny_clip(tokenizer, seed: int = 0, **options):
    """A freshly initialised CLIPModel small enough to train on two CPU cores in seconds
    (``options``: :func:`tiny_config`'s)."""
    return model_for(tiny_config("clip", tokenizer, **options), seed)


def build_tiny_clip_and_processor(texts, family: str = "clip", seed: int = 0, **options):
    """(model, processor) of ``family`` for captions ``texts``: the default model of
    ``train_clip.py`` (``options``: :func:`tiny_config`'s)."""
    tokenizer = build_word_tokenizer(texts, max_length=options.get("max_text_length", 32))
    config = tiny_config(family, tokenizer, **options)
    return model_for(config, seed), processor_for(config, tokenizer)
