"""Embedding extraction from CLIP-like models, and the DualEncoder retriever (tiny configs only)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    AutoModel,
    BertConfig,
    BertModel,
    SiglipConfig,
    SiglipModel,
    VisionTextDualEncoderConfig,
    VisionTextDualEncoderModel,
)

from hf_infcl import contrastive_loss
from hf_infcl.dual_encoder import DualEncoder, DualEncoderConfig, is_decoder_config, tokenize_texts
from hf_infcl.models import contrastive_loss_kind, encode_keys, encode_queries, model_family
from hf_infcl.training_args import CHECKPOINTING_ARGUMENT
from tests.helpers.trainer_fixtures import (
    DECODER_EOS,
    PairDataset,
    clip_batch,
    decoder_text_batch,
    decoder_word_tokenizer,
    logit_bias_of,
    logit_scale_of,
    naflex_batch,
    one_thread,  # noqa: F401  (a fixture)
    pair_text_batch,
    parameter_grads,
    tiny_bert_config,
    tiny_clip,
    tiny_decoder_config,
    tiny_decoder_dual_encoder,
    tiny_dual_encoder,
    tiny_groupvit,
    tiny_siglip2,
    trainer_arguments,
)
from tests.test_fsdp import assert_same_grads

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
        paired = model_family(model).encode_pairs(model, batch)
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


# Each family's own return_loss=True loss is the oracle: dropout off, float64, the whole batch in
# one call. SigLIP 2 takes NaFlex batches whose rows have different numbers of valid patches;
# GroupViT normalises its projections with BatchNorm1d over the batch and draws Gumbel noise
# (seeded alike in both calls).
OWN_LOSS_FAMILIES = {
    "clip": (lambda: tiny_clip(0.0), lambda: clip_batch(7, seed=4)),
    "siglip": (lambda: tiny_siglip().train(), lambda: clip_batch(7, seed=4)),
    "siglip2": (tiny_siglip2, lambda: naflex_batch(7, seed=4)),
    "groupvit": (tiny_groupvit, lambda: clip_batch(7, seed=4)),
}


@pytest.mark.parametrize("family", list(OWN_LOSS_FAMILIES))
def test_loss_and_every_gradient_equal_the_models_own_loss(family):
    build, make_batch = OWN_LOSS_FAMILIES[family]
    batch = {name: value.double() if value.is_floating_point() else value
             for name, value in make_batch().items()}
    if family == "siglip":  # SigLIP pools the last token and wants fixed-length text
        batch.pop("attention_mask")
    model = build().double()
    torch.manual_seed(5)
    own = model(**batch, return_loss=True).loss
    own.backward()
    expected = parameter_grads(model)

    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    images, texts = model_family(model).encode_pairs(model, batch)
    kind = contrastive_loss_kind(model)
    loss = contrastive_loss(images, texts, logit_scale_of(model), logit_bias_of(model), loss=kind)
    loss.backward()
    got = parameter_grads(model)
    assert kind == ("sigmoid" if family.startswith("siglip") else "softmax")
    torch.testing.assert_close(loss.detach(), own.detach(), rtol=1e-12, atol=0)
    assert "logit_scale" in got and ("logit_bias" in got) == (kind == "sigmoid")
    assert_same_grads(got, expected, tolerance=1e-10)  # each within 1e-10 of its norm


def test_every_image_input_of_siglip2_reaches_its_image_tower():
    """NaFlex inputs: the padding patches of each row change nothing, its valid patches do."""
    model = tiny_siglip2().eval()
    batch = naflex_batch(4, seed=2)
    assert model_family(model).inputs.query == ("pixel_values", "pixel_attention_mask", "spatial_shapes")
    with torch.no_grad():
        images = encode_queries(model, batch)
        padding = (1 - batch["pixel_attention_mask"])[..., None]
        padded = dict(batch, pixel_values=batch["pixel_values"] + 5.0 * padding)
        torch.testing.assert_close(encode_queries(model, padded), images)
        # the same patches on a transposed grid
        reshaped = dict(batch, spatial_shapes=batch["spatial_shapes"].flip(-1))
        assert not torch.allclose(encode_queries(model, reshaped), images)
        torch.testing.assert_close(model_family(model).encode_pairs(model, batch)[0], images)


def test_unsupported_model_is_rejected():
    with pytest.raises(TypeError, match="not a supported contrastive model"):
        model_family(BertModel(tiny_bert_config()))


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
        model.log_logit_scale.fill_(math.log(33.0))  # a value unlike the init, so loading must restore it
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, DualEncoder) and loaded.config.pooling == "last"
    assert (loaded.doc_encoder is None) == shared
    assert not loaded.log_logit_scale.requires_grad
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
    batch = pair_text_batch(3)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(**batch).doc_embeds, model.eval()(**batch).doc_embeds)


@pytest.mark.parametrize("key", ["logit_scale", "log_logit_scale"], ids=["clip-key", "own-key"])
def test_dual_encoder_log_scale_is_named_for_what_it_holds(tmp_path, key):
    """The parameter ``log_logit_scale`` holds log(s); ``logit_scale`` is the scale s itself, as
    the forward returns it and the loss takes it. A checkpoint holding the log-scale under either
    key, CLIP's "logit_scale" or the parameter's own, loads through from_pretrained and
    load_state_dict."""
    from safetensors.torch import load_file, save_file

    model = tiny_dual_encoder(shared=True, learn_scale=True)
    with torch.no_grad():
        model.log_logit_scale.fill_(math.log(33.0))  # a value unlike the init, so loading must restore it
    assert not hasattr(model, "logit_scale")
    assert math.isclose(float(model(**pair_text_batch(2)).logit_scale.detach()), 33.0, rel_tol=1e-6)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights[key] = weights.pop("logit_scale" if "logit_scale" in weights else "log_logit_scale")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    state = {name: value for name, value in model.state_dict().items() if name != "log_logit_scale"}
    state[key] = model.log_logit_scale.detach().clone()
    fresh = tiny_dual_encoder(shared=True, learn_scale=True)
    fresh.load_state_dict(state)
    for loaded in (AutoModel.from_pretrained(tmp_path), fresh):
        assert math.isclose(float(loaded.log_logit_scale.detach().exp()), 33.0, rel_tol=1e-6)
        assert loaded.log_logit_scale.requires_grad


def test_from_encoders_keeps_checkpoint_weights(tmp_path):
    torch.manual_seed(5)
    bert = BertModel(tiny_bert_config())
    bert.save_pretrained(tmp_path / "bert")
    model = DualEncoder.from_encoders(str(tmp_path / "bert"), pooling="cls", learn_scale=True)
    assert model.log_logit_scale.requires_grad
    for name, value in bert.state_dict().items():
        torch.testing.assert_close(model.query_encoder.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="pooling"):
        DualEncoderConfig(query_encoder=tiny_bert_config(), pooling="max")
    with pytest.raises(ValueError, match="logit_scale_init"):
        DualEncoderConfig(query_encoder=tiny_bert_config(), logit_scale_init=0.0)
    with pytest.raises(TypeError, match="query_encoder"):
        DualEncoderConfig(query_encoder={"hidden_size": 3})


# ---- DualEncoder over decoder (LLM) towers ---------------------------------------------------

DECODERS = ["qwen2", "llama", "gpt2"]  # gpt2: learned absolute positions, where padding matters most


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("model_type", DECODERS)
def test_decoder_embeddings_do_not_depend_on_the_padding_side(model_type, pooling):
    """Left- and right-padded batches of the same texts give the same embeddings, and each equals
    the one of the text alone (no padding): for "last", the hidden state at the text's last token."""
    model = tiny_decoder_dual_encoder(dropout=0.0, pooling=pooling, model_type=model_type).eval()
    model.config.normalize = False
    left, right = decoder_text_batch(5, seed=4, padding_side="left"), decoder_text_batch(5, seed=4,
                                                                                       padding_side="right")
    assert left["query_attention_mask"][0].all() and not left["query_attention_mask"].all()  # mixed lengths
    with torch.no_grad():
        embeds = {name: model(**batch) for name, batch in (("left", left), ("right", right))}
        for side in ("query", "doc"):
            got_left, got_right = embeds["left"][f"{side}_embeds"], embeds["right"][f"{side}_embeds"]
            torch.testing.assert_close(got_left, got_right, rtol=1e-5, atol=1e-6)
            ids, mask = right[f"{side}_input_ids"], right[f"{side}_attention_mask"]
            for row in range(len(ids)):
                text = ids[row, : int(mask[row].sum())][None]
                hidden = model.query_encoder(input_ids=text).last_hidden_state[0]
                alone = hidden[-1] if pooling == "last" else hidden.mean(0)
                assert int(text[0, -1]) == DECODER_EOS
                torch.testing.assert_close(got_left[row], alone, rtol=1e-5, atol=1e-6)


def test_last_pooling_reads_each_rows_last_attended_token():
    """Full rows, right padding, left padding and an empty row in one batch."""
    model = tiny_dual_encoder(dropout=0.0, pooling="last")
    hidden = torch.randn(4, 5, 3)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    pooled = model._pool(hidden, mask)
    torch.testing.assert_close(pooled, torch.stack([hidden[0, 4], hidden[1, 1], hidden[2, 4], hidden[3, 0]]))
    torch.testing.assert_close(model._pool(hidden, None), hidden[:, -1])


def test_decoder_towers_get_mask_positions_and_no_cache():
    model = tiny_decoder_dual_encoder(dropout=0.0)
    seen = []
    model.query_encoder.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs),
                                                  with_kwargs=True)
    batch = decoder_text_batch(3, padding_side="left")
    model(**batch)
    assert len(seen) == 2 and all(kwargs["use_cache"] is False for kwargs in seen)
    mask = batch["query_attention_mask"]
    expected = torch.where(mask.bool(), mask.cumsum(1) - 1, 0)
    torch.testing.assert_close(seen[0]["position_ids"], expected)
    # encoders are called as before: no position ids, no use_cache
    bert, calls = tiny_dual_encoder(dropout=0.0), []
    bert.query_encoder.register_forward_pre_hook(lambda m, a, kwargs: calls.append(set(kwargs)),
                                                 with_kwargs=True)
    bert(**pair_text_batch(3))
    assert calls and all(keys == {"input_ids", "attention_mask"} for keys in calls)


def test_decoder_detection_and_pooling_defaults(caplog):
    assert all(is_decoder_config(tiny_decoder_config(model_type=t)) for t in DECODERS)
    assert is_decoder_config({"model_type": "qwen3"}) and is_decoder_config({"model_type": "mistral"})
    assert not is_decoder_config(tiny_bert_config()) and not is_decoder_config({"model_type": "xlm-roberta"})
    assert is_decoder_config(BertConfig(is_decoder=True))
    decoder = DualEncoder.from_encoders(tiny_decoder_config(0.0))
    assert (decoder.config.pooling, decoder.config.append_eos) == ("last", True)
    assert decoder.config.encoder_attn_implementation is None
    bert = DualEncoder.from_encoders(tiny_bert_config(0.0))
    assert (bert.config.pooling, bert.config.append_eos) == ("mean", False)
    chosen = DualEncoder.from_encoders(tiny_decoder_config(0.0), pooling="mean")
    assert (chosen.config.pooling, chosen.config.append_eos) == ("mean", False)
    # the config itself keeps its historic default, and says what a decoder usually wants
    with caplog.at_level("WARNING", logger="hf_infcl.models"):
        assert DualEncoderConfig(query_encoder=tiny_decoder_config()).pooling == "mean"
    assert "pooling='last'" in caplog.text
    with pytest.raises(ValueError, match="pooling='cls'.*decoder tower \\(qwen2\\)"):
        DualEncoder.from_encoders(tiny_decoder_config(0.0), pooling="cls")


def test_instructions_and_attention_are_saved_with_the_model(tmp_path, caplog):
    instruction = "Instruct: find the word\nQuery: "
    model = tiny_decoder_dual_encoder(shared=False, dropout=0.0, query_instruction=instruction,
                                      doc_instruction="passage: ", attn_implementation="eager")
    model.save_pretrained(tmp_path)
    saved = (tmp_path / "config.json").read_text()
    assert '"pooling": "last"' in saved and '"query_instruction"' in saved
    with caplog.at_level("WARNING", logger="hf_infcl.models"):
        loaded = AutoModel.from_pretrained(tmp_path)
    assert "pooling not given" not in caplog.text
    assert isinstance(loaded, DualEncoder)
    assert (loaded.config.query_instruction, loaded.config.doc_instruction) == (instruction, "passage: ")
    assert loaded.config.append_eos and loaded.config.pooling == "last"
    assert loaded.config.encoder_attn_implementation == "eager"
    assert {t.config._attn_implementation for t in (loaded.query_encoder, loaded.doc_encoder)} == {"eager"}
    switched = DualEncoder.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert switched.config.encoder_attn_implementation == "sdpa"
    assert switched.query_encoder.config._attn_implementation == "sdpa"
    # tokenize applies the saved instruction per side and ends each text in EOS
    tokenizer = decoder_word_tokenizer()
    queries = loaded.tokenize(tokenizer, ["a small dog", "red"], "query")
    expected = tokenizer([instruction + "a small dog"])["input_ids"][0] + [DECODER_EOS]
    assert queries["input_ids"][0].tolist() == expected
    docs = loaded.tokenize(tokenizer, ["a small dog"], "doc")
    expected = tokenizer(["passage: a small dog"])["input_ids"][0] + [DECODER_EOS]
    assert docs["input_ids"][0].tolist() == expected
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval().encode_queries(**queries),
                                   model.eval().encode_queries(**queries))
    with pytest.raises(ValueError, match="side must be 'query' or 'doc'"):
        loaded.tokenize(tokenizer, ["a"], "passage")
    # "mean" chosen for a decoder is written out too, so loading it warns of nothing
    tiny_decoder_dual_encoder(dropout=0.0, pooling="mean").save_pretrained(tmp_path / "mean")
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_infcl.models"):
        assert DualEncoder.from_pretrained(tmp_path / "mean").config.pooling == "mean"
    assert "pooling not given" not in caplog.text


def test_tokenize_texts_appends_eos_once_and_pads_either_side():
    plain, adds_eos = decoder_word_tokenizer(), decoder_word_tokenizer(add_eos=True)
    texts = ["a small red dog runs", "cat"]
    a, small, red, dog, runs, cat = plain.convert_tokens_to_ids(["a", "small", "red", "dog", "runs", "cat"])
    eos, pad = DECODER_EOS, 0
    for tokenizer in (plain, adds_eos):
        right = tokenize_texts(tokenizer, texts, append_eos=True, padding_side="right")
        left = tokenize_texts(tokenizer, texts, append_eos=True, padding_side="left")
        assert right["input_ids"].tolist() == [[a, small, red, dog, runs, eos], [cat, eos] + [pad] * 4]
        assert left["input_ids"].tolist() == [[a, small, red, dog, runs, eos], [pad] * 4 + [cat, eos]]
        assert right["attention_mask"].tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
        cut = tokenize_texts(tokenizer, texts, append_eos=True, max_length=3)  # the last token becomes EOS
        assert cut["input_ids"].tolist() == [[a, small, eos], [cat, eos, pad]]
    # without append_eos it is the tokenizer's own call
    own = plain(texts, padding=True)["input_ids"]
    assert tokenize_texts(plain, texts)["input_ids"].tolist() == own and own[0][-1] != eos
    no_pad = decoder_word_tokenizer()
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="tokenizer.pad_token"):
        tokenize_texts(no_pad, texts)
    no_eos = decoder_word_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="append_eos=True needs a tokenizer with an eos_token"):
        tokenize_texts(no_eos, texts, append_eos=True)
    with pytest.raises(ValueError, match="padding_side"):
        tokenize_texts(plain, texts, padding_side="middle")
    with pytest.raises(ValueError, match="max_length"):
        tokenize_texts(plain, texts, max_length=0)
    with pytest.raises(TypeError, match="query_instruction"):
        DualEncoderConfig(query_encoder=tiny_decoder_config(), pooling="last", query_instruction=3)


def _loss_grads(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch, return_loss=True).loss.backward()
    return parameter_grads(model)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_gradient_checkpointing_reaches_the_towers_and_keeps_the_gradients(enable):
    batch = decoder_text_batch(6, padding_side="left")
    plain = _loss_grads(tiny_decoder_dual_encoder(shared=False, dropout=0.0), batch)
    model = tiny_decoder_dual_encoder(shared=False, dropout=0.0)
    if not hasattr(model, enable):
        pytest.skip(f"this transformers has no {enable} (the new name came in 5.20)")
    getattr(model, enable)()
    layers = [layer for tower in (model.query_encoder, model.doc_encoder) for layer in tower.layers]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    recomputed = []
    for layer in layers:
        layer.mlp.register_forward_pre_hook(lambda module, args: recomputed.append(module))
    checkpointed = _loss_grads(model, batch)
    assert len(recomputed) == 2 * len(layers)  # each layer ran again in the backward
    assert checkpointed.keys() == plain.keys() and len(plain) > 10
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_sdpa_and_eager_attention_give_the_same_embeddings():
    batch = decoder_text_batch(5, padding_side="left")
    sdpa = tiny_decoder_dual_encoder(dropout=0.0, attn_implementation="sdpa").eval()
    eager = tiny_decoder_dual_encoder(dropout=0.0, attn_implementation="eager").eval()
    assert sdpa.query_encoder.config._attn_implementation == "sdpa"
    assert eager.query_encoder.config._attn_implementation == "eager"
    assert eager.config.encoder_attn_implementation == "eager"
    with torch.no_grad():
        a, b = sdpa(**batch), eager(**batch)
    torch.testing.assert_close(a.query_embeds, b.query_embeds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.doc_embeds, b.doc_embeds, rtol=1e-5, atol=1e-6)


class _FirstStepGrads:
    """A TrainerCallback keeping the gradients of the first optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        self.grads = None
        outer = self

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if outer.grads is None:
                    outer.grads = parameter_grads(model)

        self.callback = Callback()


@pytest.mark.parametrize(("model_type", "checkpointing"),
                         [("qwen2", False), ("qwen2", True), ("gpt2", False)],
                         ids=["qwen2-chunked", "qwen2-chunked-checkpointed", "gpt2-chunked"])
def test_trainer_chunked_decoder_steps_match_the_whole_batch(tmp_path, model_type, checkpointing):
    from hf_infcl import InfCLTrainer

    dataset = PairDataset(decoder_text_batch(16, seed=5, padding_side="left"))
    settings = dict(per_device_train_batch_size=16, max_steps=3, optim="sgd", learning_rate=0.05)
    runs = {}
    chunked = {"chunk_size": 4, CHECKPOINTING_ARGUMENT: checkpointing}
    for name, extra in (("whole", {}), ("chunked", chunked)):
        first = _FirstStepGrads()
        model = tiny_decoder_dual_encoder(shared=False, dropout=0.0, model_type=model_type)
        trainer = InfCLTrainer(model=model,
                               args=trainer_arguments(tmp_path / name, **settings, **extra),
                               train_dataset=dataset, callbacks=[first.callback])
        trainer.train()
        runs[name] = (first.grads, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    if checkpointing:
        assert trainer.model.query_encoder.layers[0].gradient_checkpointing
    (grads, params), (chunk_grads, chunk_params) = runs["whole"], runs["chunked"]
    assert grads.keys() == chunk_grads.keys() and "log_logit_scale" in grads
    for name in grads:
        torch.testing.assert_close(chunk_grads[name], grads[name], rtol=0, atol=1e-5, msg=name)
    for name in params:
        torch.testing.assert_close(chunk_params[name], params[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
def test_dual_encoder_input_embeddings_are_the_query_towers(shared):
    """Accelerate's FSDP2 preparation calls get_input_embeddings (transformers raises for models it
    cannot place): a DualEncoder answers with its query tower's token embeddings."""
    model = tiny_dual_encoder(shared=shared)
    assert model.get_input_embeddings() is model.query_encoder.embeddings.word_embeddings
