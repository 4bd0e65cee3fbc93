"""Tiny models and batches shared by the GradCache, models and Trainer tests (built from configs)."""

from __future__ import annotations

import torch
from transformers import CLIPConfig, CLIPModel


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
    from hf_infcl.models import DualEncoder

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
