"""Embedding extraction from CLIP-like models, and the DualEncoder retriever (tiny configs only)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    AutoModel,
    BertModel,
    SiglipConfig,
    SiglipModel,
    VisionTextDualEncoderConfig,
    VisionTextDualEncoderModel,
)

from hf_infcl import contrastive_loss
from hf_infcl.models import (
    DualEncoder,
    DualEncoderConfig,
    contrastive_loss_kind,
    encode_keys,
    encode_queries,
    logit_bias_of,
    logit_scale_of,
    pair_embeddings,
    tower_inputs,
)
from tests.trainer_fixtures import (
    clip_batch,
    one_thread,  # noqa: F401  (a fixture)
    pair_text_batch,
    tiny_bert_config,
    tiny_clip,
    tiny_dual_encoder,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=16)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=4, num_channels=1)


def tiny_siglip():
    torch.manual_seed(0)
    return SiglipModel(SiglipConfig(text_config=TEXT, vision_config=VISION)).eval()


def tiny_vision_text_dual_encoder():
    torch.manual_seed(0)
    config = VisionTextDualEncoderConfig(
        vision_config={"model_type": "clip_vision_model", **VISION},
        text_config=tiny_bert_config(0.0).to_dict(), projection_dim=8,
    )
    return VisionTextDualEncoderModel(config).eval()


@pytest.mark.parametrize("build", [lambda: tiny_clip(0.0).eval(), tiny_siglip, tiny_vision_text_dual_encoder],
                         ids=["clip", "siglip", "vision-text-dual-encoder"])
def test_extraction_matches_the_models_own_forward(build):
    model = build()
    batch = clip_batch(5, seed=1)
    if isinstance(model, SiglipModel):  # SigLIP pools the last token and wants fixed-length text
        batch.pop("attention_mask")
    if model.config.vision_config.num_channels == 1 and batch["pixel_values"].shape[1] != 1:
        batch["pixel_values"] = batch["pixel_values"][:, :1]
    with torch.no_grad():
        output = model(**batch)
        images, texts = encode_queries(model, batch), encode_keys(model, batch)
        paired = pair_embeddings(model, batch)
    torch.testing.assert_close(images, output.image_embeds)
    torch.testing.assert_close(texts, output.text_embeds)
    torch.testing.assert_close(paired[0], output.image_embeds)
    torch.testing.assert_close(images.norm(dim=-1), torch.ones(5))
    torch.testing.assert_close(logit_scale_of(model), model.logit_scale.exp().reshape(()))
    sigmoid = isinstance(model, SiglipModel)
    assert contrastive_loss_kind(model) == ("sigmoid" if sigmoid else "softmax")
    assert (logit_bias_of(model) is not None) == sigmoid
    if sigmoid:
        # the SigLIP logits rebuilt from our pieces equal the model's
        logits = images @ texts.T * logit_scale_of(model) + logit_bias_of(model)
        torch.testing.assert_close(logits.detach(), output.logits_per_image)


def test_unsupported_model_is_rejected():
    with pytest.raises(TypeError, match="not a supported contrastive model"):
        tower_inputs(BertModel(tiny_bert_config()))


def _manual_pool(hidden, mask, pooling):
    rows = []
    for h, m in zip(hidden, mask):
        kept = h[m.bool()]
        rows.append({"cls": h[0], "mean": kept.mean(0), "last": kept[-1]}[pooling])
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("pooling", "padding"),
    # cls reads position 0 by definition, so it is only meaningful with right padding
    [("cls", "right"), ("mean", "right"), ("mean", "left"), ("last", "right"), ("last", "left")],
    ids=["cls-right", "mean-right", "mean-left", "last-right", "last-left"],
)
def test_dual_encoder_pooling(pooling, padding):
    model = tiny_dual_encoder(dropout=0.0, pooling=pooling).eval()
    model.config.normalize = False
    batch = pair_text_batch(4, seed=3)
    ids, mask = batch["query_input_ids"], batch["query_attention_mask"]
    if padding == "left":
        order = torch.argsort(mask, dim=1, stable=True)  # padding first, tokens in order after
        ids, mask = ids.gather(1, order), mask.gather(1, order)
    with torch.no_grad():
        hidden = model.query_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = model.encode_queries(ids, mask)
    torch.testing.assert_close(pooled, _manual_pool(hidden, mask, pooling))


def test_dual_encoder_forward_loss_and_normalisation():
    model = tiny_dual_encoder(shared=False, dropout=0.0).eval()
    batch = pair_text_batch(6)
    output = model(**batch, return_loss=True)
    torch.testing.assert_close(output.query_embeds.norm(dim=-1), torch.ones(6))
    reference = contrastive_loss(output.query_embeds.double(), output.doc_embeds.double(),
                                 output.logit_scale.double(), backend="reference")
    torch.testing.assert_close(output.loss.double(), reference, rtol=1e-5, atol=1e-6)
    assert math.isclose(float(output.logit_scale.detach()), 10.0, rel_tol=1e-6)
    # separate towers: the document tower is not the query tower
    assert not torch.allclose(model.encode_docs(batch["query_input_ids"], batch["query_attention_mask"]),
                              model.encode_queries(batch["query_input_ids"], batch["query_attention_mask"]))
    with pytest.raises(ValueError, match="return_loss=True needs both"):
        model(query_input_ids=batch["query_input_ids"], return_loss=True)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
def test_dual_encoder_round_trip(tmp_path, shared):
    model = tiny_dual_encoder(shared=shared, pooling="last", learn_scale=False)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(33.0))  # a value unlike the init, so loading must restore it
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, DualEncoder) and loaded.config.pooling == "last"
    assert (loaded.doc_encoder is None) == shared
    assert not loaded.logit_scale.requires_grad
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
    batch = pair_text_batch(3)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(**batch).doc_embeds, model.eval()(**batch).doc_embeds)


def test_from_encoders_keeps_checkpoint_weights(tmp_path):
    torch.manual_seed(5)
    bert = BertModel(tiny_bert_config())
    bert.save_pretrained(tmp_path / "bert")
    model = DualEncoder.from_encoders(str(tmp_path / "bert"), pooling="cls", learn_scale=True)
    assert model.logit_scale.requires_grad
    for name, value in bert.state_dict().items():
        torch.testing.assert_close(model.query_encoder.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="pooling"):
        DualEncoderConfig(query_encoder=tiny_bert_config(), pooling="max")
    with pytest.raises(ValueError, match="logit_scale_init"):
        DualEncoderConfig(query_encoder=tiny_bert_config(), logit_scale_init=0.0)
    with pytest.raises(TypeError, match="query_encoder"):
        DualEncoderConfig(query_encoder={"hidden_size": 3})
