"""Families whose own forward takes the scale, the inputs or the loss otherwise than CLIP: Aimv2
(a clamped log-scale), ALIGN (a temperature and label smoothing 0.1), CLAP (audio-text, a scale
per term of its loss); and the families that stay refused (XCLIP, BridgeTower).

Each against the model's own loss (tiny configs, fp32, CPU, dropout off): the loss value and every
parameter's gradient, and 3 steps of InfCLTrainer, without and with chunk_size, against 3 steps of
the plain Trainer with the model's own loss."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Trainer, TrainingArguments, default_data_collator

from hf_infcl import InfCLTrainer
from hf_infcl.batch_statistics import freeze_batch_norm
from hf_infcl.models import learned_log_scales, model_family
from tests.helpers.trainer_fixtures import (
    TINY_TEXT,
    PairDataset,
    clap_batch,
    clip_batch,
    logit_scale_of,
    one_thread,  # noqa: F401  (a fixture)
    parameter_grads,
    tiny_aimv2,
    tiny_align,
    tiny_clap,
    tiny_clip,
    trained_parameters,
    trainer_arguments,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {
    "aimv2": (tiny_aimv2, clip_batch),
    "align": (tiny_align, clip_batch),
    "clap": (tiny_clap, clap_batch),
}


def clip_loss(logits_per_text: torch.Tensor) -> torch.Tensor:
    """CLIP's loss of a square logit matrix (Aimv2Model has no return_loss; its logits are CLIP's)."""
    labels = torch.arange(logits_per_text.shape[0])
    ce = torch.nn.functional.cross_entropy
    return (ce(logits_per_text, labels) + ce(logits_per_text.T, labels)) / 2


def own_loss(model, batch):
    """The model's own loss on ``batch``: ``return_loss=True``, or CLIP's loss of Aimv2's logits."""
    if type(model).__name__ == "Aimv2Model":
        return clip_loss(model(**batch).logits_per_text)
    return model(**batch, return_loss=True).loss


def loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), parameter_grads(model)


def assert_same_grads(got, expected, tolerance=1e-5, floor=1e-6):
    """Every parameter's gradient, norm-wise relative (fp32 rounding of gradients up to ~100);
    absolute below ``floor`` (gradients that are 0 in exact arithmetic, such as an attention key's
    bias, are rounding noise in both)."""
    assert got.keys() == expected.keys() and len(expected) > 10
    for name in expected:
        difference = float((got[name] - expected[name]).norm())
        assert difference < max(tolerance * float(expected[name].norm()), floor), (name, difference)


def infcl_loss(model, batch, tmp_path, **settings):
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, **settings))
    return trainer.compute_loss(model, dict(batch))


# ---- the loss and every gradient against the model's own ------------------------------------


@pytest.mark.parametrize("log_scale", [None, math.log(100.0) + 0.3, -0.4],
                         ids=["default-scale", "above-the-clamp", "below-the-clamp"])
def test_aimv2_takes_the_clamped_scale_as_its_forward_does(tmp_path, log_scale):
    """Aimv2's forward uses logit_scale.clamp(0, log 100).exp(): at log(100) + 0.3 the loss is the
    model's (the raw parameter would give another), and the scale gets no gradient beyond it."""
    batch = clip_batch(8, seed=3)
    models = [tiny_aimv2(), tiny_aimv2()]
    if log_scale is not None:
        for model in models:
            with torch.no_grad():
                model.logit_scale.fill_(log_scale)
    expected, expected_grads = loss_and_grads(models[0], lambda: own_loss(models[0], batch))
    got, grads = loss_and_grads(models[1], lambda: infcl_loss(models[1], batch, tmp_path))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads, expected_grads)
    clamped = min(max(float(models[1].logit_scale.detach()), 0.0), math.log(100.0))
    assert math.isclose(float(logit_scale_of(models[1]).detach()), math.exp(clamped), rel_tol=1e-6)
    if log_scale is not None:
        assert float(grads["logit_scale"]) == 0.0  # the clamp holds it: no gradient, as in the model
        with torch.no_grad():  # the raw parameter, as before: another loss
            out = models[1](**batch)
            raw = clip_loss(out.text_embeds @ out.image_embeds.T * math.exp(log_scale))
        assert abs(float(raw) - float(expected)) > 0.01


def test_align_loss_is_its_own_temperature_and_label_smoothing(tmp_path):
    """AlignModel: logits / temperature and cross_entropy(label_smoothing=0.1) both ways; the
    temperature (moved off its init, so 1/t differs from t) gets its gradient."""
    batch = clip_batch(8, seed=4)
    models = [tiny_align(), tiny_align()]
    for model in models:
        with torch.no_grad():
            model.temperature.fill_(0.3)
    expected, expected_grads = loss_and_grads(models[0], lambda: own_loss(models[0], batch))
    got, grads = loss_and_grads(models[1], lambda: infcl_loss(models[1], batch, tmp_path))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads, expected_grads)
    assert abs(float(grads["temperature"])) > 1e-3
    assert math.isclose(float(logit_scale_of(models[1]).detach()), 1 / 0.3, rel_tol=1e-6)
    # label_smoothing=0.0 set by the user: not the model's own loss any more
    plain = infcl_loss(models[1], batch, tmp_path / "plain", label_smoothing=0.0)
    assert abs(float(plain.detach()) - float(expected)) > 1e-3


def test_clap_loss_is_its_own_with_both_scales(tmp_path):
    """ClapModel: two terms, each with its own log-scale, value and every gradient (both scales,
    set apart by the fixture so that swapping them would show)."""
    batch = clap_batch(8, seed=5)
    models = [tiny_clap(), tiny_clap()]
    expected, expected_grads = loss_and_grads(models[0], lambda: own_loss(models[0], batch))
    got, grads = loss_and_grads(models[1], lambda: infcl_loss(models[1], batch, tmp_path))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads, expected_grads)
    assert abs(float(grads["logit_scale_a"])) > 1e-4 and abs(float(grads["logit_scale_t"])) > 1e-4
    assert abs(float(grads["logit_scale_a"]) - float(grads["logit_scale_t"])) > 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_element_scales_as_sharding_holds_them(tmp_path, family):
    """FSDP2 and DeepSpeed train 0-d parameters as 1-element vectors (vectorise_scalar_parameters):
    each family's transform of its scale parameters takes them so, and cached_step's loss too."""
    from hf_infcl.grad_cache import cached_step
    from hf_infcl.sharding import vectorise_scalar_parameters

    build, make_batch = FAMILIES[family]
    batch = make_batch(8, seed=7)
    models = [build(), build()]
    vectorised = vectorise_scalar_parameters(models[1])
    assert vectorised, "the family has no 0-d parameter"
    expected, expected_grads = loss_and_grads(models[0], lambda: own_loss(models[0], batch))
    got, grads = loss_and_grads(models[1], lambda: infcl_loss(models[1], batch, tmp_path))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads({name: grad.reshape(expected_grads[name].shape) for name, grad in grads.items()},
                      expected_grads)
    # the cached step (chunks of 8: BatchNorm sees the whole batch) with the 1-element parameters
    trainer = InfCLTrainer(model=models[1], args=trainer_arguments(tmp_path / "cached"))
    models[1].zero_grad(set_to_none=True)
    def loss_fn(rows, keys, *values):
        return trainer._contrastive(models[1], rows, keys, None, *values)

    result = cached_step(lambda chunk: trainer.family.encode_pairs(models[1], chunk), dict(batch), loss_fn, 8,
                         loss_params=trainer._loss_params(models[1]))
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads({name: grad.reshape(expected_grads[name].shape)
                       for name, grad in parameter_grads(models[1]).items()}, expected_grads)


def test_families_are_recognised_with_their_inputs_and_names():
    assert (model_family(tiny_clap()).rows, model_family(tiny_clap()).keys) == ("audio", "text")
    assert model_family(tiny_clap()).inputs.query == ("input_features", "is_longer")
    assert model_family(tiny_align()).label_smoothing == 0.1
    assert model_family(tiny_clip()).label_smoothing == 0.0
    assert [p.shape for p in learned_log_scales(tiny_clap())] == [(), ()]
    assert learned_log_scales(tiny_align()) == []  # a temperature, not a log-scale
    with pytest.raises(TypeError, match="logit_scale_a, logit_scale_t"):
        logit_scale_of(tiny_clap())


# ---- three Trainer steps against the plain Trainer with the model's own loss ------------------


class OwnClipLossTrainer(Trainer):
    """The plain Trainer with CLIP's loss of the model's logits (for Aimv2Model, which has none)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = clip_loss(outputs.logits_per_text)
        return (loss, outputs) if return_outputs else loss


def plain_trainer_parameters(tmp_path, model, dataset, settings):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                             save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0,
                             **settings)
    if type(model).__name__ == "Aimv2Model":
        trainer = OwnClipLossTrainer(model=model, args=args, train_dataset=dataset)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=dataset,
                          data_collator=lambda rows: {**default_data_collator(rows), "return_loss": True})
    trainer.train()
    return trained_parameters(trainer)


@pytest.mark.parametrize("chunk_size", [None, 4], ids=["whole-batch", "chunk4"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_three_steps_match_the_plain_trainer_with_the_models_own_loss(tmp_path, family, chunk_size):
    """SGD, 3 steps of 8 pairs out of 24. With chunk_size the BatchNorm layers of ALIGN and CLAP are
    held in eval mode in both runs (chunks would otherwise normalise with their own statistics)."""
    build, make_batch = FAMILIES[family]
    dataset = PairDataset(make_batch(24, seed=6))
    settings = dict(per_device_train_batch_size=8, max_steps=3, optim="sgd", learning_rate=0.05)

    def model():
        built = build()
        if chunk_size:
            freeze_batch_norm(built)
        return built

    expected = plain_trainer_parameters(tmp_path / "plain", model(), dataset, settings)
    trainer = InfCLTrainer(model=model(), args=trainer_arguments(tmp_path / "infcl", chunk_size=chunk_size,
                                                                 **settings),
                           train_dataset=dataset)
    trainer.train()
    got = trained_parameters(trainer)
    assert got.keys() == expected.keys()
    initial = dict(build().named_parameters())
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=3e-6, msg=name)
    scales = [name for name in expected if name.split(".")[-1] in ("logit_scale", "logit_scale_a",
                                                                   "logit_scale_t", "temperature")]
    assert scales and all(not torch.equal(got[name], initial[name].detach()) for name in scales)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    logged = {"clap": ("logit_scale_audio", "logit_scale_text")}.get(family, ("logit_scale",))
    assert all(set(logged) <= entry.keys() for entry in logs)
    initial = {name: float(value.detach()) for name, value in initial.items() if value.ndim == 0}
    if family == "align":
        first_scale = 1 / initial["temperature"]
    else:
        first_scale = math.exp(initial["logit_scale_a" if family == "clap" else "logit_scale"])
    assert math.isclose(logs[0][logged[0]], first_scale, rel_tol=1e-5)  # the scale of the first step


def test_clap_evaluation_names_audio_and_text_and_is_its_own_loss(tmp_path):
    """Recall in both directions under the family's names; the whole-set loss is the model's own
    on the whole set, eval_loss the plain Trainer's."""
    model = tiny_clap().eval()
    batch = clap_batch(13, seed=9)
    dataset = PairDataset(batch)
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, per_device_eval_batch_size=5),
                           eval_dataset=dataset)
    metrics = trainer.evaluate()
    assert {"eval_audio_to_text_recall@1", "eval_text_to_audio_recall@10", "eval_audio_to_text_mrr"} <= (
        metrics.keys())
    assert metrics["eval_audio_to_text_recall@10"] > metrics["eval_audio_to_text_recall@1"] >= 0.0
    with torch.no_grad():
        reference = model(**batch, return_loss=True).loss
    assert math.isclose(metrics["eval_whole_set_loss"], float(reference), rel_tol=1e-5)
    plain = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "plain"), use_cpu=True,
                                                        report_to="none", per_device_eval_batch_size=5),
                    data_collator=lambda rows: {**default_data_collator(rows), "return_loss": True})
    assert math.isclose(metrics["eval_loss"], plain.evaluate(dataset)["eval_loss"], rel_tol=1e-5)


def test_clamp_applies_to_clap_scales_not_to_align_temperature(tmp_path):
    clap = tiny_clap()
    with torch.no_grad():
        clap.logit_scale_a.fill_(math.log(250.0))
        clap.logit_scale_t.fill_(math.log(300.0))
    args = dict(per_device_train_batch_size=8, max_steps=1, logit_scale_max=100.0)
    InfCLTrainer(model=clap, args=trainer_arguments(tmp_path / "clap", **args),
                 train_dataset=PairDataset(clap_batch(8))).train()
    assert float(clap.logit_scale_a.detach()) == pytest.approx(math.log(100.0))
    assert float(clap.logit_scale_t.detach()) == pytest.approx(math.log(100.0))
    align = tiny_align()
    with torch.no_grad():
        align.temperature.fill_(0.001)  # a scale of 1000: beyond logit_scale_max, left as the model has it
    InfCLTrainer(model=align, args=trainer_arguments(tmp_path / "align", learning_rate=0.0, **args),
                 train_dataset=PairDataset(clip_batch(8))).train()
    assert float(align.temperature.detach()) == pytest.approx(0.001)


def test_clap_model_card_is_an_audio_text_card(tmp_path):
    from huggingface_hub import ModelCard

    batch = clap_batch(8, seed=3)
    trainer = InfCLTrainer(model=tiny_clap(), args=trainer_arguments(tmp_path, per_device_train_batch_size=8,
                                                                     max_steps=1),
                           train_dataset=PairDataset(batch), eval_dataset=PairDataset(batch))
    trainer.train()
    trainer.evaluate()
    trainer.create_model_card(model_name="tiny-clap")
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.pipeline_tag == "zero-shot-audio-classification"
    assert "audio-text" in card.data.tags and "ClapModel.from_pretrained" in card.text
    assert any(result.metric_name == "audio_to_text_recall@1" for result in card.data.eval_results)


# ---- what is refused ----------------------------------------------------------------------------


def test_label_smoothing_options_the_trainer_refuses(tmp_path):
    from tests.helpers.trainer_fixtures import tiny_siglip

    with pytest.raises(ValueError, match="label_smoothing=0.1 needs loss='softmax'"):
        InfCLTrainer(model=tiny_siglip(), args=trainer_arguments(tmp_path, label_smoothing=0.1))
    with pytest.raises(ValueError, match="label_smoothing=0.2 is not defined with group_column"):
        InfCLTrainer(model=tiny_clip(),
                     args=trainer_arguments(tmp_path, label_smoothing=0.2, group_column="g"))
    with pytest.raises(ValueError, match="AlignModel's own loss smooths its labels by 0.1.*group_column.*"
                                         "label_smoothing=0.0"):
        InfCLTrainer(model=tiny_align(), args=trainer_arguments(tmp_path, group_column="g"))
    align = InfCLTrainer(model=tiny_align(),
                         args=trainer_arguments(tmp_path, group_column="g", label_smoothing=0.0))
    assert align.label_smoothing == 0.0
    assert InfCLTrainer(model=tiny_align(), args=trainer_arguments(tmp_path)).label_smoothing == 0.1
    # ALIGN with the sigmoid loss: the model's own smoothing belongs to its softmax loss
    sigmoid = InfCLTrainer(model=tiny_align(), args=trainer_arguments(tmp_path, contrastive_loss="sigmoid"))
    assert sigmoid.label_smoothing == 0.0
    for wrong in (dict(symmetric=False), dict(contrastive_loss="sigmoid")):
        with pytest.raises(ValueError, match="ClapModel trains with its own loss"):
            InfCLTrainer(model=tiny_clap(), args=trainer_arguments(tmp_path, **wrong))
    with pytest.raises(ValueError, match="label_smoothing_factor .* contrastive loss's is label_smoothing"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, label_smoothing_factor=0.1))
    for value, error in ((1.5, ValueError), ("0.1", TypeError)):
        with pytest.raises(error, match="label_smoothing"):
            trainer_arguments(tmp_path, label_smoothing=value)


def tiny_xclip():
    from transformers import XCLIPConfig, XCLIPModel

    text = dict(TINY_TEXT, max_position_embeddings=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=8, patch_size=4, num_frames=2, mit_hidden_size=16, mit_intermediate_size=32,
                  mit_num_hidden_layers=1, mit_num_attention_heads=2)
    return XCLIPModel(XCLIPConfig(text_config=text, vision_config=vision, projection_dim=8,
                                  prompt_layers=1, prompt_num_attention_heads=2))


def tiny_bridgetower():
    from transformers import BridgeTowerConfig, BridgeTowerForContrastiveLearning

    text = dict(TINY_TEXT, max_position_embeddings=16)
    vision = dict(hidden_size=64, num_hidden_layers=1, image_size=8, patch_size=4)  # one head of 64
    return BridgeTowerForContrastiveLearning(BridgeTowerConfig(
        text_config=text, vision_config=vision, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, contrastive_hidden_size=8, logit_scale_init_value=2.6592))


@pytest.mark.parametrize("build, reason", [
    (tiny_xclip, "XCLIPModel is not a supported contrastive model: its text embeddings are conditioned on "
                 "the video"),
    (tiny_bridgetower, "BridgeTowerForContrastiveLearning is not a supported contrastive model: its image "
                       "and text embeddings come out of cross-modal layers"),
], ids=["xclip", "bridgetower"])
def test_families_that_cannot_be_supported_are_refused_with_the_reason(tmp_path, build, reason):
    model = build()
    for call in (lambda: model_family(model),
                 lambda: InfCLTrainer(model=model, args=trainer_arguments(tmp_path))):
        with pytest.raises(TypeError, match=reason):
            call()
