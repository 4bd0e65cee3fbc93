"""Tiny models and batches shared by the GradCache, models and Trainer tests (built from configs)."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPConfig, CLIPModel


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and spinning OpenMP threads slow a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def is_activation_checkpointing(model) -> bool:
    """Whether a transformers model checkpoints its layers' activations, under the property's name
    in the installed release (``is_activation_checkpointing`` from 5.20, ``is_gradient_checkpointing``
    before; the old name warns where the new one exists)."""
    checkpointing = getattr(type(model), "is_activation_checkpointing", None)
    return checkpointing.fget(model) if checkpointing is not None else model.is_gradient_checkpointing


def logit_scale_of(model) -> torch.Tensor:
    """The multiplier of the logits as the model's forward takes it (``exp(logit_scale)`` for CLIP,
    clamped first for Aimv2, ``1 / temperature`` for ALIGN; differentiable), read through the
    model's family adapter. TypeError for ClapModel, which has one per term of its loss."""
    from hf_infcl.models import model_family

    family = model_family(model)
    return family.scale_and_bias(model, *family.scale_parameters(model))[0]


def logit_bias_of(model) -> torch.Tensor | None:
    """SigLIP's additive logit bias as the loss takes it (0-d, differentiable), or None."""
    from hf_infcl.models import model_family

    bias = model_family(model).bias(model)
    return None if bias is None else bias.reshape(())


def end_worker_process() -> None:
    """End a torchrun worker without interpreter shutdown, its results already written.

    Python 3.11 kills any thread that asks for the GIL while the interpreter finalises. A gloo
    worker thread still releasing the tensors of a last collective (the Trainer's own
    ``store_flos`` all_gather at the end of ``train``) does exactly that, and dies inside a
    noexcept destructor: "terminate called without an active exception", SIGABRT, in about one
    run in ten (caught under gdb; pytorch issue 190489). Destroying the process group is not
    enough while the Trainer still holds it. ``os._exit`` skips the finalisation.
    """
    import os
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tiny_clip_config(dropout: float = 0.1, image_size: int = 8, vocab_size: int = 40) -> CLIPConfig:
    text = dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=16, dropout=dropout,
                attention_dropout=dropout, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=4, num_channels=1, dropout=dropout,
                  attention_dropout=dropout)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)


def tiny_clip(dropout: float = 0.1, seed: int = 0) -> CLIPModel:
    torch.manual_seed(seed)
    model = CLIPModel(tiny_clip_config(dropout))
    return model.train()


def clip_batch(batch: int, seed: int = 1, image_size: int = 8, seq_len: int = 6, vocab_size: int = 40):
    """Random images and token ids (eos id 2 last, some padding) for a tiny CLIP."""
    generator = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(batch, 1, image_size, image_size, generator=generator)
    input_ids = torch.randint(3, vocab_size, (batch, seq_len), generator=generator)
    lengths = torch.randint(3, seq_len + 1, (batch,), generator=generator)
    positions = torch.arange(seq_len)
    attention_mask = (positions[None, :] < lengths[:, None]).long()
    input_ids = torch.where(attention_mask.bool(), input_ids, torch.zeros_like(input_ids))
    input_ids[torch.arange(batch), lengths - 1] = 2
    return {"pixel_values": pixel_values, "input_ids": input_ids, "attention_mask": attention_mask}


def parameter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def tiny_bert_config(dropout: float = 0.1, vocab_size: int = 40):
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout)


def tiny_dual_encoder(shared: bool = True, dropout: float = 0.1, pooling: str = "mean", seed: int = 0,
                      learn_scale: bool = True):
    from hf_infcl.dual_encoder import DualEncoder

    torch.manual_seed(seed)
    config = tiny_bert_config(dropout)
    model = DualEncoder.from_encoders(config, None if shared else config, pooling=pooling,
                                      learn_scale=learn_scale, logit_scale_init=10.0)
    return model.train()


def pair_text_batch(batch: int, seed: int = 2, seq_len: int = 7, vocab_size: int = 40):
    """Random query/document token ids with right padding, as a DualEncoder batch."""
    generator = torch.Generator().manual_seed(seed)
    result = {}
    for side in ("query", "doc"):
        ids = torch.randint(1, vocab_size, (batch, seq_len), generator=generator)
        lengths = torch.randint(2, seq_len + 1, (batch,), generator=generator)
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        result[f"{side}_input_ids"] = ids * mask
        result[f"{side}_attention_mask"] = mask
    return result


DECODER_EOS, DECODER_PAD = 2, 0  # the tiny decoder's special ids (bos is 1)


def tiny_decoder_config(dropout: float = 0.1, vocab_size: int = 40, model_type: str = "qwen2"):
    """A tiny decoder-only LLM config: "qwen2" (Qwen2 layout), "llama", or "gpt2" (learned absolute
    positions, where left padding changes the result unless positions are counted over the mask).
    Hidden 16, 2 layers, 2 heads, 1 KV head (grouped-query attention); ``dropout`` is the
    attention dropout (what Qwen2/Llama have); eos 2, pad 0, bos 1."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    special = dict(eos_token_id=DECODER_EOS, pad_token_id=DECODER_PAD, bos_token_id=1)
    if model_type == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=2, n_head=2, n_inner=32, n_positions=64,
                          attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout, **special)
    builders = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    if model_type not in builders:
        raise ValueError(f"model_type must be 'qwen2', 'llama' or 'gpt2'; got {model_type!r}")
    return builders[model_type](
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, attention_dropout=dropout,
        tie_word_embeddings=False, **special,
    )


def tiny_decoder_dual_encoder(shared: bool = True, dropout: float = 0.1, pooling: str = "last", seed: int = 0,
                              learn_scale: bool = True, model_type: str = "qwen2",
                              attn_implementation: str | None = None, **settings):
    """A DualEncoder over tiny decoder towers (``tiny_decoder_config``), last-token pooling by default,
    in training mode; ``settings`` go to ``DualEncoder.from_encoders`` (e.g. ``query_instruction``)."""
    from hf_infcl.dual_encoder import DualEncoder

    torch.manual_seed(seed)
    config = tiny_decoder_config(dropout, model_type=model_type)
    model = DualEncoder.from_encoders(config, None if shared else config, pooling=pooling,
                                      learn_scale=learn_scale, logit_scale_init=10.0,
                                      attn_implementation=attn_implementation, **settings)
    return model.train()


def decoder_text_batch(batch: int, seed: int = 2, seq_len: int = 7, vocab_size: int = 40,
                       padding_side: str = "left"):
    """Random query/document token ids for a tiny decoder DualEncoder: each text ends with the EOS id
    (2), is padded with 0 on ``padding_side``, and the first row of each side fills the whole
    length (an all-ones mask beside shorter rows). The same ``seed`` gives the same texts on
    either padding side, so the two batches must give the same embeddings."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right'; got {padding_side!r}")
    generator = torch.Generator().manual_seed(seed)
    result = {}
    for side in ("query", "doc"):
        ids = torch.randint(3, vocab_size, (batch, seq_len), generator=generator)
        lengths = torch.randint(2, seq_len + 1, (batch,), generator=generator)
        lengths[0] = seq_len
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        ids[torch.arange(batch), lengths - 1] = DECODER_EOS
        ids = ids * mask + DECODER_PAD * (1 - mask)
        if padding_side == "left":
            order = torch.argsort(mask, dim=1, stable=True)  # padding first, tokens in order after
            ids, mask = ids.gather(1, order), mask.gather(1, order)
        result[f"{side}_input_ids"] = ids
        result[f"{side}_attention_mask"] = mask
    return result


def decoder_word_tokenizer(add_eos: bool = False):
    """A word-level tokenizer for the tiny decoders (ids below 40), built offline: like Qwen2's and
    Llama's, it adds no EOS unless ``add_eos``; ``<|endoftext|>`` (id 2) is its EOS, ``<pad>`` (0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["Instruct:", "find", "the", "word", "Query:", "passage:", "a", "an", "dog", "cat", "is", "was",
             "small", "big", "red", "blue", "one", "two", "three", "what", "which", "animal", "colour",
             "number", "runs", "sits"]
    vocab = {"<pad>": 0, "<bos>": 1, "<|endoftext|>": 2, "<unk>": 3}
    for word in words:
        vocab.setdefault(word, len(vocab))
    assert len(vocab) <= 40
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_eos:
        core.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                            special_tokens=[("<|endoftext|>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|endoftext|>",
                                   bos_token="<bos>", unk_token="<unk>")


class PairDataset(torch.utils.data.Dataset):
    """Rows of a dict of equally long tensors, one dict per example (what a collator stacks)."""

    def __init__(self, columns: dict[str, torch.Tensor]):
        self.columns = columns
        self.length = len(next(iter(columns.values())))

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return {name: values[index] for name, values in self.columns.items()}


def trainer_arguments(output_dir, **overrides):
    """Small, quiet, CPU-only InfCLTrainingArguments for tests."""
    from hf_infcl import InfCLTrainingArguments

    settings = dict(output_dir=str(output_dir), use_cpu=True, report_to="none", disable_tqdm=True,
                    save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0)
    settings.update(overrides)
    return InfCLTrainingArguments(**settings)


def trained_parameters(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def float64_sgd_steps(model, columns, loss_of, steps: int, learning_rate: float) -> dict[str, torch.Tensor]:
    """``steps`` plain SGD steps of the model in float64 on the whole batch ``columns``, the loss
    ``loss_of(model, family, batch)`` (the batch's floating columns in float64): the hand-written
    loop a Trainer run without clipping or schedule is compared with. The parameters after, in fp32."""
    from hf_infcl.models import model_family

    model = model.double()
    family = model_family(model)
    batch = {name: value.double() if value.is_floating_point() else value for name, value in columns.items()}
    for _ in range(steps):
        loss = loss_of(model, family, batch)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param -= learning_rate * param.grad
    return {name: param.detach().float() for name, param in model.named_parameters()}


DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CAPTION_TEMPLATES = ("a photo of the digit {}", "handwritten {}", "the number {}", "a {} written by hand")


def caption_tokenizer():
    """A word-level tokenizer over the digit captions, built offline ([BOS] words [EOS], pad 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3}
    for template in CAPTION_TEMPLATES:
        for word in (*template.split(), *DIGIT_WORDS):
            vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 2), ("[EOS]", 3)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]", unk_token="[UNK]")


def digits_clip(vocab_size: int):
    """A small CLIP for 8x8 one-channel digit images (eos id 3, so CLIP pools at the [EOS] token)."""
    from transformers import CLIPConfig, CLIPModel

    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=10, eos_token_id=3, bos_token_id=2,
                pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=8, patch_size=2, num_channels=1)
    torch.manual_seed(0)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def digits_image_caption_split(tokenizer, n_train: int = 1500, seed: int = 0):
    """sklearn's digits as image-caption pairs: a training PairDataset and held-out (images, labels)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 8.0 - 1.0
    labels = torch.tensor(digits.target)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=generator)
    train, held_out = order[:n_train], order[n_train:]
    template = torch.randint(0, len(CAPTION_TEMPLATES), (n_train,), generator=generator)
    captions = [CAPTION_TEMPLATES[int(t)].format(DIGIT_WORDS[int(labels[i])])
                for i, t in zip(train, template)]
    tokens = tokenizer(captions, padding="max_length", max_length=10, return_tensors="pt")
    dataset = PairDataset({"pixel_values": images[train], "input_ids": tokens["input_ids"],
                           "attention_mask": tokens["attention_mask"], "label": labels[train]})
    return dataset, images[held_out], labels[held_out]


def tiny_siglip(seed: int = 0):
    """A tiny SiglipModel (sigmoid loss with a learned logit_bias) for 8x8 one-channel images."""
    from transformers import SiglipConfig, SiglipModel

    text = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=8, patch_size=4, num_channels=1)
    torch.manual_seed(seed)
    return SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).train()


SIGLIP2_PATCH_PIXELS = 4  # one channel, 2 x 2 patches: a NaFlex patch holds 4 values
SIGLIP2_MAX_PATCHES = 16
# (height, width) in patches of NaFlex images: different aspect ratios and numbers of valid patches
SIGLIP2_SHAPES = ((4, 4), (2, 3), (3, 3), (1, 5), (2, 2), (4, 3), (3, 5), (1, 1), (2, 7), (3, 4))


def tiny_siglip2(seed: int = 0):
    """A tiny Siglip2Model (NaFlex: patchified images of variable shape) in training mode:
    2 x 2 one-channel patches, a 4 x 4 position grid, up to ``SIGLIP2_MAX_PATCHES`` patches."""
    from transformers import Siglip2Config, Siglip2Model

    text = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  patch_size=2, num_channels=1, num_patches=16)
    torch.manual_seed(seed)
    model = Siglip2Model(Siglip2Config(text_config=text, vision_config=vision))
    with torch.no_grad():  # a bias away from zero, so that its gradient matters
        model.logit_bias.fill_(-2.0)
    return model.train()


def naflex_batch(batch: int, seed: int = 1, seq_len: int = 6, vocab_size: int = 40):
    """A SigLIP 2 batch as its processor makes one: ``pixel_values`` [batch, SIGLIP2_MAX_PATCHES, 4]
    (each image's patches first, zeros after), ``pixel_attention_mask`` [batch, patches] and
    ``spatial_shapes`` [batch, 2], rows cycling through ``SIGLIP2_SHAPES`` (different numbers of
    valid patches), and fixed-length token ids."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes = torch.tensor([SIGLIP2_SHAPES[i % len(SIGLIP2_SHAPES)] for i in range(batch)])
    valid = spatial_shapes.prod(-1)
    pixel_attention_mask = (torch.arange(SIGLIP2_MAX_PATCHES)[None, :] < valid[:, None]).long()
    pixel_values = torch.randn(batch, SIGLIP2_MAX_PATCHES, SIGLIP2_PATCH_PIXELS, generator=generator)
    pixel_values = pixel_values * pixel_attention_mask[..., None]
    input_ids = torch.randint(3, vocab_size, (batch, seq_len), generator=generator)
    return {"pixel_values": pixel_values, "pixel_attention_mask": pixel_attention_mask,
            "spatial_shapes": spatial_shapes, "input_ids": input_ids}


def tiny_groupvit(seed: int = 0):
    """A tiny GroupViTModel for 8x8 one-channel images, in training mode. Its projection heads hold
    BatchNorm1d layers (batch statistics); CLIP-like inputs (``clip_batch``: eos id 2 last)."""
    from transformers import GroupViTConfig, GroupViTModel

    text = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, depths=[1, 1],
                  num_group_tokens=[4, 0], num_output_groups=[4, 2], num_attention_heads=2, image_size=8,
                  patch_size=4, num_channels=1)
    torch.manual_seed(seed)
    config = GroupViTConfig(text_config=text, vision_config=vision, projection_dim=8,
                            projection_intermediate_dim=16)
    return GroupViTModel(config).train()


# ---- more contrastive families of transformers (tiny configs, dropout off) -----------------------

TINY_TEXT = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2)


def tiny_aimv2(seed: int = 0):
    """A tiny Aimv2Model for 8x8 one-channel images (eos id 2, where clip_batch ends each text)."""
    from transformers import Aimv2Config, Aimv2Model

    text = dict(TINY_TEXT, max_position_embeddings=16, eos_token_id=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=8, patch_size=4, num_channels=1)
    torch.manual_seed(seed)
    return Aimv2Model(Aimv2Config(text_config=text, vision_config=vision, projection_dim=8)).train()


def tiny_align(seed: int = 0, dropout: float = 0.0):
    """A tiny AlignModel (an EfficientNet image tower with BatchNorm, a BERT text tower, a learned
    temperature) for 8x8 one-channel images."""
    from transformers import AlignConfig, AlignModel

    text = dict(TINY_TEXT, max_position_embeddings=16, hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout)
    vision = dict(num_channels=1, image_size=8, width_coefficient=0.25, depth_coefficient=0.25,
                  kernel_sizes=[3, 3], in_channels=[32, 16], out_channels=[16, 24], strides=[1, 2],
                  num_block_repeats=[1, 1], expand_ratios=[1, 2], hidden_dim=32, drop_connect_rate=dropout,
                  depthwise_padding=[])
    torch.manual_seed(seed)
    return AlignModel(AlignConfig(text_config=text, vision_config=vision, projection_dim=8)).train()


def tiny_clap(seed: int = 0, dropout: float = 0.0):
    """A tiny ClapModel: an HTSAT audio tower (BatchNorm over 8 mel bins, 16 frames) and a RoBERTa
    text tower, with its two learned log-scales moved apart (audio 2.3, text 2.9) so that a loss
    taking one for the other is told apart."""
    from transformers import ClapConfig, ClapModel

    text = dict(TINY_TEXT, max_position_embeddings=20, hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout)
    audio = dict(window_size=2, num_mel_bins=8, spec_size=16, patch_size=2, patch_stride=(2, 2),
                 hidden_size=32, depths=[1, 1], num_attention_heads=[2, 2], patch_embeds_hidden_size=16,
                 hidden_dropout_prob=dropout, num_hidden_layers=2, enable_fusion=False)
    torch.manual_seed(seed)
    model = ClapModel(ClapConfig(text_config=text, audio_config=audio, projection_dim=8))
    with torch.no_grad():
        model.logit_scale_a.fill_(2.3)
        model.logit_scale_t.fill_(2.9)
    return model.train()


def clap_batch(batch: int, seed: int = 1, seq_len: int = 6, vocab_size: int = 40):
    """Random log-mel features ``[batch, 1, 16, 8]``, ``is_longer`` flags and token ids (RoBERTa's
    bos 0 first, eos 2 last, pad 1) for a tiny ClapModel."""
    generator = torch.Generator().manual_seed(seed)
    input_features = torch.randn(batch, 1, 16, 8, generator=generator)
    is_longer = torch.rand(batch, 1, generator=generator) < 0.5
    input_ids = torch.randint(3, vocab_size, (batch, seq_len), generator=generator)
    lengths = torch.randint(3, seq_len + 1, (batch,), generator=generator)
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    input_ids = torch.where(attention_mask.bool(), input_ids, torch.ones_like(input_ids))
    input_ids[:, 0] = 0
    input_ids[torch.arange(batch), lengths - 1] = 2
    return {"input_features": input_features, "is_longer": is_longer, "input_ids": input_ids,
            "attention_mask": attention_mask}
