"""A tiny CLIPModel and CLIPProcessor built from a config, so the CLIP example downloads nothing.

The tokenizer is a word-level ``tokenizers`` model over the captions' vocabulary wrapped in
``PreTrainedTokenizerFast``; the image processor is a ``CLIPImageProcessor`` constructed from
arguments. Both are saved beside the model, so the output directory reloads with
``CLIPModel.from_pretrained`` and ``CLIPProcessor.from_pretrained`` like any CLIP checkpoint.
"""

from __future__ import annotations

import re

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")
TINY_HEADS = 2  # attention heads per layer of the tiny model: its width must be a multiple
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(4)


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
        # Statistics of bright-on-dark scans differ from photos; 0.5/0.5 keeps inputs in [-1, 1].
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_tiny_clip(
    tokenizer,
    image_size: int = 16,
    patch_size: int = 4,
    width: int = 64,
    layers: int = 2,
    heads: int = TINY_HEADS,
    projection_dim: int = 64,
    max_text_length: int = 32,
    seed: int = 0,
):
    """A freshly initialised CLIPModel small enough to train on two CPU cores in seconds."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    tower = dict(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        dropout=0.0,
        attention_dropout=0.0,
    )
    text_config = dict(
        tower,
        vocab_size=len(tokenizer),
        max_position_embeddings=max_text_length,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    vision_config = dict(tower, image_size=image_size, patch_size=patch_size, num_channels=3)
    config = CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=projection_dim)
    torch.manual_seed(seed)
    return CLIPModel(config)


def build_tiny_clip_and_processor(texts, image_size: int = 16, seed: int = 0, **model_options):
    """(model, processor) for captions ``texts``: the default model of ``train_clip.py``."""
    from transformers import CLIPProcessor

    tokenizer = build_word_tokenizer(texts, max_length=model_options.get("max_text_length", 32))
    processor = CLIPProcessor(image_processor=build_image_processor(image_size), tokenizer=tokenizer)
    model = build_tiny_clip(tokenizer, image_size=image_size, seed=seed, **model_options)
    return model, processor
