"""InfCLTrainer with distillation_weight: the teacher's precomputed embeddings in the batch, trained
against a float64 loop of ``contrastive_distillation_loss``, cached and not; the errors."""

from __future__ import annotations

import os

import pytest
import torch

from hf_infcl import InfCLTrainer, InfCLTrainingArguments, contrastive_distillation_loss
from hf_infcl.models import model_family
from hf_infcl.training_args import TEACHER_COLUMNS
from tests.helpers.offline import run_two_processes
from tests.helpers.trainer_distillation_workers import (
    FSDP_VARIANTS,
    SETTINGS,
    VARIANTS,
    clip_teacher,
    distillation_batch,
    teacher_columns,
)
from tests.helpers.trainer_fixtures import (
    PairDataset,
    clip_batch,
    float64_sgd_steps,
    one_thread,  # noqa: F401  (fixture)
    pair_text_batch,
    tiny_align,
    tiny_clap,
    tiny_clip,
    tiny_dual_encoder,
    tiny_siglip,
    trained_parameters,
    trainer_arguments,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = 16
# SGD without clipping or schedule: the hand-written loop below takes the same steps
STEPS = dict(per_device_train_batch_size=ROWS, max_steps=2, optim="sgd", learning_rate=0.5,
             lr_scheduler_type="constant", max_grad_norm=0.0)
MODELS = {
    "clip": (lambda: tiny_clip(dropout=0.0), lambda: clip_batch(ROWS)),
    "dual-encoder": (lambda: tiny_dual_encoder(shared=False, dropout=0.0), lambda: pair_text_batch(ROWS)),
}


def train(path, model, columns, teacher=None, **settings):
    trainer = InfCLTrainer(model=model, args=trainer_arguments(path, **STEPS, **settings),
                           train_dataset=PairDataset(columns), teacher=teacher)
    trainer.train()
    return trainer


def float64_steps(model, columns, steps: int, learning_rate: float, distillation_weight: float,
                  teacher_logit_scale: float | None, symmetric: bool = True) -> dict[str, torch.Tensor]:
    """``steps`` SGD steps of the float64 model on the whole batch with the materialised
    distillation loss; the student's scale of the step, detached, when the teacher's is None."""

    def loss_of(model, family, batch):
        queries, keys = family.encode_pairs(model, batch)
        scale, _ = family.scale_and_bias(model, *family.scale_parameters(model))
        teacher_scale = scale.detach() if teacher_logit_scale is None else teacher_logit_scale
        return contrastive_distillation_loss(queries, keys, *(batch[column] for column in TEACHER_COLUMNS),
                                             scale, teacher_scale, distillation_weight=distillation_weight,
                                             symmetric=symmetric, backend="reference")

    return float64_sgd_steps(model, columns, loss_of, steps, learning_rate)


def assert_same_parameters(actual, expected, rtol=1e-5, atol=1e-5):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize(("distillation_weight", "teacher_logit_scale", "symmetric"),
                         [(1.0, 20.0, True), (0.7, None, True), (0.7, 20.0, False)],
                         ids=["kl-teacher-scale", "mixed-student-scale", "mixed-one-direction"])
def test_training_with_teacher_embeddings_matches_a_float64_loop(tmp_path, kind, distillation_weight,
                                                                 teacher_logit_scale, symmetric):
    """Two steps, uncached and cached (chunks of 4, with offload), equal two float64 SGD steps of
    contrastive_distillation_loss on the same batch (the teacher of another width)."""
    build, batch = MODELS[kind]
    columns = {**batch(), **teacher_columns(ROWS)}
    settings = dict(distillation_weight=distillation_weight, teacher_logit_scale=teacher_logit_scale,
                    symmetric=symmetric)
    expected = float64_steps(build(), columns, 2, STEPS["learning_rate"], distillation_weight,
                             teacher_logit_scale, symmetric)
    uncached = train(tmp_path / "uncached", build(), columns, **settings)
    assert_same_parameters(trained_parameters(uncached), expected)
    cached = train(tmp_path / "cached", build(), columns, chunk_size=4, offload=True, **settings)
    assert_same_parameters(trained_parameters(cached), expected)
    # the distillation changed the training: without it the parameters differ
    plain = float64_steps(build(), columns, 2, STEPS["learning_rate"], 0.0, None, symmetric)
    assert max((plain[name] - expected[name]).abs().max().item() for name in expected) > 1e-3


def test_without_distillation_weight_the_teacher_columns_change_nothing(tmp_path):
    """distillation_weight=None: today's training exactly, teacher columns or not; weight 0 is the
    contrastive loss."""
    batch, teacher = clip_batch(ROWS), teacher_columns(ROWS)
    today = trained_parameters(train(tmp_path / "today", tiny_clip(dropout=0.0), batch))
    ignored = trained_parameters(train(tmp_path / "ignored", tiny_clip(dropout=0.0), {**batch, **teacher}))
    for name in today:
        assert torch.equal(ignored[name], today[name]), name
    weight_zero = train(tmp_path / "zero", tiny_clip(dropout=0.0), {**batch, **teacher},
                        distillation_weight=0.0)
    assert_same_parameters(trained_parameters(weight_zero), today)


def test_teacher_columns_survive_remove_unused_columns(tmp_path):
    trainer = InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, distillation_weight=0.5))
    trainer._set_signature_columns_if_needed()
    assert set(TEACHER_COLUMNS) <= set(trainer._signature_columns)
    plain = InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path))
    plain._set_signature_columns_if_needed()
    assert not set(TEACHER_COLUMNS) & set(plain._signature_columns)


def test_a_datasets_table_keeps_the_teacher_columns(tmp_path):
    """A datasets.Dataset with the teacher's embeddings as list columns and a column the model does
    not take: remove_unused_columns drops that one only, the default collator stacks the rest, and
    the training equals the float64 loop."""
    datasets = pytest.importorskip("datasets")
    columns = {**clip_batch(ROWS), **teacher_columns(ROWS)}
    table = datasets.Dataset.from_dict({**{name: value.tolist() for name, value in columns.items()},
                                        "caption": [f"caption {i}" for i in range(ROWS)]})
    expected = float64_steps(tiny_clip(dropout=0.0), columns, 2, STEPS["learning_rate"], 1.0, 20.0)
    trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), train_dataset=table,
                           args=trainer_arguments(tmp_path, distillation_weight=1.0, teacher_logit_scale=20.0,
                                                  **STEPS))
    trainer.train()
    assert_same_parameters(trained_parameters(trainer), expected)


def test_two_processes_with_teacher_embeddings_match_one_process(tmp_path):
    """torchrun, 2 ranks x 8 rows (DDP, gloo, the distillation ring), cached and uncached, the
    teacher's embeddings in the batch or from a teacher model, and under FSDP2 == the float64 loop
    on all 16 rows."""
    run_two_processes(os.path.join(REPO, "tests", "helpers", "trainer_distillation_workers.py"), tmp_path,
                      timeout=300)
    batch = distillation_batch()
    teacher_embeds, teacher_scale = float64_teacher_columns(clip_teacher(), batch)
    sources = {"columns": (batch, SETTINGS["teacher_logit_scale"]),
               "model": ({**batch, **teacher_embeds}, teacher_scale)}
    for source, (columns, scale) in sources.items():
        expected = float64_steps(tiny_clip(dropout=0.0), columns, SETTINGS["max_steps"],
                                 SETTINGS["learning_rate"], SETTINGS["distillation_weight"], scale)
        for variant in (*VARIANTS, *(FSDP_VARIANTS if source == "columns" else ())):
            actual = torch.load(tmp_path / f"parameters-{source}-{variant}.pt")
            # FSDP2 trains the 0-d logit_scale as a 1-element vector
            actual = {name: value.reshape(expected[name].shape) for name, value in actual.items()}
            assert_same_parameters(actual, expected)


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "error", "message"), [
    ("distillation_weight", 1.5, ValueError, "^distillation_weight must be in \\[0, 1\\], got 1.5"),
    ("distillation_weight", "0.5", TypeError, "^distillation_weight must be a float in \\[0, 1\\], got str"),
    ("teacher_logit_scale", 0.0, ValueError, "^teacher_logit_scale must be a float > 0 or None, got 0.0"),
    ("teacher_logit_scale", True, TypeError, "^teacher_logit_scale must be a float > 0 or None, got bool"),
])
def test_arguments_check_the_distillation_fields(tmp_path, field, value, error, message):
    with pytest.raises(error, match=message):
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{field: value})


@pytest.mark.parametrize(("build", "settings", "message"), [
    (tiny_clip, dict(teacher_logit_scale=10.0), "^teacher_logit_scale=10.0 needs distillation_weight"),
    (tiny_siglip, dict(distillation_weight=0.5),
     "^distillation_weight=0.5 distils the teacher's softmax over the keys, but the loss is 'sigmoid'"),
    (tiny_clip, dict(distillation_weight=0.5, contrastive_loss="sigmoid"), "but the loss is 'sigmoid'"),
    (tiny_clip, dict(distillation_weight=0.5, group_column="group"),
     "^distillation_weight=0.5 is not defined with group_column"),
    (tiny_clip, dict(distillation_weight=0.5, false_negative_margin=0.1), "with false_negative_margin"),
    (tiny_clip, dict(distillation_weight=0.5, label_smoothing=0.1), "label_smoothing smooths by 0.1\\): set "
                                                                    "label_smoothing=0.0"),
    (tiny_align, dict(distillation_weight=0.5), "AlignModel's own loss \\(label_smoothing=None\\) smooths by "
                                                "0.1"),
    (tiny_clap, dict(distillation_weight=0.5), "^distillation_weight=0.5 is not defined for ClapModel"),
    (tiny_clip, dict(distillation_weight=0.5, matryoshka_dims=[16, 8]), "with matryoshka_dims"),
], ids=["scale-alone", "siglip", "sigmoid", "groups", "filter", "smoothing", "align", "clap", "matryoshka"])
def test_what_distillation_cannot_combine_with_is_refused(tmp_path, build, settings, message):
    with pytest.raises(ValueError, match=message):
        InfCLTrainer(model=build(), args=trainer_arguments(tmp_path, **settings))


def test_align_distils_with_its_temperature_once_label_smoothing_is_off(tmp_path):
    """ALIGN with label_smoothing=0.0: compute_loss is the float64 reference at scale 1 / temperature."""
    model = tiny_align().eval()
    columns = {**clip_batch(ROWS), **teacher_columns(ROWS)}
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, distillation_weight=0.5,
                                                               label_smoothing=0.0))
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(columns))
        out = model(**{name: value for name, value in columns.items() if name not in TEACHER_COLUMNS})
        scale = 1.0 / model.temperature.double()
        expected = contrastive_distillation_loss(
            out.image_embeds.double(), out.text_embeds.double(),
            *(columns[column].double() for column in TEACHER_COLUMNS), scale, scale,
            distillation_weight=0.5, backend="reference")
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_a_batch_without_the_teacher_columns_is_refused(tmp_path, chunk_size):
    batch = {**clip_batch(8), TEACHER_COLUMNS[0]: teacher_columns(8)[TEACHER_COLUMNS[0]]}
    trainer = InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, distillation_weight=0.5,
                                                                     chunk_size=chunk_size))
    with pytest.raises(KeyError, match=f"{TEACHER_COLUMNS[1]} missing"):
        trainer.training_step(trainer.model, batch)


def test_teacher_embeddings_of_other_row_counts_are_refused(tmp_path):
    batch = {**clip_batch(8), **teacher_columns(7)}
    trainer = InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, distillation_weight=0.5))
    with pytest.raises(ValueError, match="^teacher_queries has 7 rows but queries has 8"):
        trainer.compute_loss(trainer.model, batch)



# ---- a teacher model ------------------------------------------------------------------------


TEACHERS = {
    "clip": (lambda: tiny_clip(dropout=0.0), lambda: clip_batch(ROWS), clip_teacher),
    "dual-encoder": (lambda: tiny_dual_encoder(shared=False, dropout=0.0), lambda: pair_text_batch(ROWS),
                     lambda: tiny_dual_encoder(shared=True, dropout=0.1, seed=3)),
}


def float64_teacher_columns(teacher, batch) -> tuple[dict[str, torch.Tensor], float]:
    """The teacher model's float64 embeddings of the batch in eval mode, and its own scale."""
    teacher = teacher.double().eval()
    family = model_family(teacher)
    with torch.no_grad():
        embeds = family.encode_pairs(teacher, {name: value.double() if value.is_floating_point() else value
                                               for name, value in batch.items()})
        scale = family.scale_and_bias(teacher, *family.scale_parameters(teacher))[0]
    return dict(zip(TEACHER_COLUMNS, embeds)), float(scale)


@pytest.mark.parametrize("kind", list(TEACHERS))
@pytest.mark.parametrize("chunk_size", [None, 4], ids=["uncached", "cached"])
def test_training_with_a_teacher_model_matches_a_float64_loop(tmp_path, kind, chunk_size):
    """A teacher model (eval mode, frozen, its own scale) embeds each batch, whole or in the cached
    chunks: two steps equal the float64 loop on its float64 embeddings."""
    build, batch, build_teacher = TEACHERS[kind]
    batch = batch()
    teacher_embeds, teacher_scale = float64_teacher_columns(build_teacher(), batch)
    expected = float64_steps(build(), {**batch, **teacher_embeds}, 2, STEPS["learning_rate"], 0.7,
                             teacher_scale)
    teacher = build_teacher()
    before = {name: param.detach().clone() for name, param in teacher.named_parameters()}
    rows_seen = []
    teacher.register_forward_hook(lambda module, args, kwargs, output: rows_seen.append(
        next(value.shape[0] for value in kwargs.values() if torch.is_tensor(value))), with_kwargs=True)
    trainer = train(tmp_path, build(), batch, distillation_weight=0.7, chunk_size=chunk_size,
                    offload=chunk_size is not None, teacher=teacher)
    assert_same_parameters(trained_parameters(trainer), expected)
    assert rows_seen == ([ROWS] * 2 if chunk_size is None else [chunk_size] * (2 * ROWS // chunk_size))
    assert not teacher.training and not any(param.requires_grad for param in teacher.parameters())
    for name, param in teacher.named_parameters():
        assert torch.equal(param, before[name]), name  # the teacher stays as it was


def test_teacher_logit_scale_overrides_the_teacher_models_own(tmp_path):
    batch = clip_batch(ROWS)
    teacher_embeds, _ = float64_teacher_columns(clip_teacher(), batch)
    expected = float64_steps(tiny_clip(dropout=0.0), {**batch, **teacher_embeds}, 2, STEPS["learning_rate"],
                             1.0, 15.0)
    trainer = train(tmp_path, tiny_clip(dropout=0.0), batch, distillation_weight=1.0,
                    teacher_logit_scale=15.0, teacher=clip_teacher())
    assert_same_parameters(trained_parameters(trainer), expected)


def test_what_a_teacher_model_cannot_do_is_refused(tmp_path):
    with pytest.raises(ValueError, match="^teacher needs distillation_weight"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path), teacher=clip_teacher())
    with pytest.raises(ValueError, match="^teacher must embed the student's batch as one of its kind does: a "
                                         "DualEncoder cannot teach a CLIPModel"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, distillation_weight=0.5),
                     teacher=tiny_dual_encoder())
    with pytest.raises(TypeError, match="is not a supported contrastive model"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, distillation_weight=0.5),
                     teacher=torch.nn.Linear(2, 2))
    trainer = InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, distillation_weight=0.5),
                           teacher=clip_teacher())
    trainer._set_signature_columns_if_needed()
    assert not set(TEACHER_COLUMNS) & set(trainer._signature_columns)  # the teacher model gives them
    with pytest.raises(ValueError, match="^the batch carries teacher_query_embeds, teacher_key_embeds and "
                                         "InfCLTrainer has a teacher model"):
        trainer.compute_loss(trainer.model, {**clip_batch(8), **teacher_columns(8)})


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_teacher_model_on_gpu_matches_float64_and_bf16_trains(tmp_path):
    """On CUDA: exact fp32 (precision='ieee'; a text dual encoder, no TF32 convolutions), cached
    with offload and a teacher model, equals the float64 loop on the host; bf16 mixed precision
    gives finite losses (the teacher's embeddings cast to the student's dtype)."""
    if torch.cuda.device_count() > 1:
        pytest.skip("one process sees several GPUs, so the Trainer would use DataParallel, which "
                    "InfCLTrainer refuses; run with CUDA_VISIBLE_DEVICES=0")
    build, batch, build_teacher = TEACHERS["dual-encoder"]
    batch = batch()
    teacher_embeds, teacher_scale = float64_teacher_columns(build_teacher(), batch)
    expected = float64_steps(build(), {**batch, **teacher_embeds}, 2, STEPS["learning_rate"], 0.7,
                             teacher_scale)
    trainer = train(tmp_path / "fp32", build(), batch, teacher=build_teacher(), use_cpu=False,
                    precision="ieee", distillation_weight=0.7, chunk_size=4, offload=True)
    assert next(trainer.teacher.parameters()).device.type == "cuda"
    actual = {name: value.cpu() for name, value in trained_parameters(trainer).items()}
    assert_same_parameters(actual, expected, rtol=1e-4, atol=1e-5)
    bf16 = train(tmp_path / "bf16", build(), batch, teacher=build_teacher(), use_cpu=False, bf16=True,
                 distillation_weight=0.7, chunk_size=4, offload=True)
    losses = [entry["loss"] for entry in bf16.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(loss)) for loss in losses)
