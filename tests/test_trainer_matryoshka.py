"""``InfCLTrainingArguments.matryoshka_dims`` / ``matryoshka_weights``: InfCLTrainer trains on the
weighted sum of the loss on each L2-normalised prefix of the embeddings
(``contrastive_loss(matryoshka_dims=...)``, docs/contract.md, "Matryoshka in one call").

Two SGD steps of tiny CLIP, SigLIP and text dual-encoder models, uncached and cached (chunks with
offload), equal two float64 steps of the materialised Matryoshka loss on the same batch; the
arguments are checked when they are built, and the widths against the embeddings' at the first loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_infcl import InfCLTrainer, InfCLTrainingArguments, contrastive_loss
from hf_infcl.models import model_family
from tests.helpers.trainer_fixtures import (
    PairDataset,
    clip_batch,
    float64_sgd_steps,
    one_thread,  # noqa: F401  (fixture)
    tiny_clip,
    tiny_siglip,
    trained_parameters,
    trainer_arguments,
)
from tests.test_trainer_distillation import MODELS as DISTILLATION_MODELS
from tests.test_trainer_distillation import ROWS, STEPS, train

pytestmark = pytest.mark.usefixtures("one_thread")

# The same steps and models as the distillation tests (SGD without clipping or schedule, so that the
# float64 loop below takes the same steps), and SigLIP for the sigmoid loss.
MODELS = {**DISTILLATION_MODELS, "siglip": (tiny_siglip, lambda: clip_batch(ROWS))}
# The tiny CLIP embeds in 8 dimensions, SigLIP and the dual encoder in 16.
DIMS, WEIGHTS = [8, 4, 2], [1.0, 0.5, 2.0]


def float64_steps(model, columns, dims, weights, steps: int = 2, learning_rate: float = 0.5):
    """``steps`` SGD steps of the float64 model on the whole batch, the loss the definition: the
    weighted sum of the materialised loss on each L2-normalised prefix, inside the model's own loss
    (its scale and bias, as ``ModelFamily.loss`` takes them)."""

    def loss_of(model, family, batch):
        loss_kind = "sigmoid" if family.bias(model) is not None else "softmax"

        def matryoshka(rows, cols, scale, bias, symmetric=True):
            return sum(weight * contrastive_loss(F.normalize(rows[:, :dim], dim=1),
                                                 F.normalize(cols[:, :dim], dim=1), scale, bias,
                                                 loss=loss_kind, symmetric=symmetric, backend="reference")
                       for dim, weight in zip(dims, weights))

        queries, keys = family.encode_pairs(model, batch)
        return family.loss(model, matryoshka, queries, keys, *family.loss_parameters(model, loss_kind))

    return float64_sgd_steps(model, columns, loss_of, steps, learning_rate)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("chunked", [False, True], ids=["uncached", "cached"])
def test_training_matches_a_float64_loop(tmp_path, kind, chunked):
    build, batch = MODELS[kind]
    columns = batch()
    expected = float64_steps(build(), columns, DIMS, WEIGHTS)
    chunking = dict(chunk_size=4, offload=True) if chunked else {}
    trainer = train(tmp_path, build(), columns, matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS, **chunking)
    actual = trained_parameters(trainer)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)
    # the prefixes changed the steps: the plain loss moves the parameters elsewhere
    plain = float64_steps(build(), columns, [DIMS[0]], [1.0])
    assert any(not torch.allclose(plain[name], expected[name], rtol=1e-4, atol=1e-4) for name in expected)


def test_one_width_of_the_whole_embedding_is_the_plain_loss_of_a_normalising_model(tmp_path):
    """CLIP normalises its embeddings, so one prefix of its whole width (8) is its plain loss, to
    rounding: the one-pass route (the torch tiles on CPU) scales the raw dot products by the inverse
    norms, which rounds differently at fp32's 1e-7, and the first step (learning rate 0.5, gradient
    norm about 70) carries that into the parameters at a few 1e-6."""
    columns = clip_batch(ROWS)
    plain = trained_parameters(train(tmp_path / "plain", tiny_clip(dropout=0.0), columns))
    one = trained_parameters(train(tmp_path / "one", tiny_clip(dropout=0.0), columns, matryoshka_dims=[8]))
    for name in plain:
        torch.testing.assert_close(one[name], plain[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(("settings", "error", "message"), [
    (dict(matryoshka_dims=[8, 16]), ValueError, "^matryoshka_dims must be strictly descending"),
    (dict(matryoshka_dims=[16, 0]), ValueError, "^matryoshka_dims must be widths >= 1"),
    (dict(matryoshka_dims=[]), ValueError, "^matryoshka_dims is empty"),
    (dict(matryoshka_dims=[16, 8.0]), TypeError, "^matryoshka_dims must hold ints"),
    (dict(matryoshka_weights=[1.0]), ValueError, "^matryoshka_weights was given without matryoshka_dims"),
    (dict(matryoshka_dims=[16, 8], matryoshka_weights=[1.0]), ValueError,
     "^matryoshka_weights has 1 weights but matryoshka_dims has 2"),
    (dict(matryoshka_dims=[16, 8], matryoshka_weights=[1.0, -1.0]), ValueError,
     "^matryoshka_weights must be finite and non-negative"),
], ids=["ascending", "zero", "empty", "float", "weights-alone", "weights-length", "negative-weight"])
def test_arguments_are_checked_when_built(tmp_path, settings, error, message):
    with pytest.raises(error, match=message):
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **settings)


def test_a_width_above_the_embeddings_is_refused_at_the_first_loss(tmp_path):
    trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=trainer_arguments(tmp_path, **STEPS,
                                                                               matryoshka_dims=[32, 4]),
                           train_dataset=PairDataset(clip_batch(ROWS)))
    with pytest.raises(ValueError, match="matryoshka_dims \\(32, 4\\) has a width above the features' "
                                         "width 8"):
        trainer.train()


def test_the_command_line_takes_the_widths(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(InfCLTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--matryoshka_dims", "64", "32", "--matryoshka_weights", "1", "0.5"])
    assert (args.matryoshka_dims, args.matryoshka_weights) == ([64, 32], [1.0, 0.5])


def test_evaluation_reports_each_widths_retrieval_metrics(tmp_path):
    """Beside the whole embeddings' metrics, each width's, of the L2-normalised prefixes: what the
    width serves at inference."""
    from hf_infcl.metrics import retrieval_metrics

    model, columns = tiny_clip(dropout=0.0), clip_batch(ROWS, seed=5)
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, **STEPS, matryoshka_dims=[8, 4, 2]),
                           eval_dataset=PairDataset(columns))
    metrics = trainer.evaluate()
    with torch.no_grad():
        images, texts = model_family(model).encode_pairs(model, columns)
    ids = torch.arange(ROWS)
    for dim in (8, 4, 2):
        expected = retrieval_metrics(F.normalize(images[:, :dim], dim=1), F.normalize(texts[:, :dim], dim=1),
                                     ids, ids, prefix=f"eval_image_to_text_dim{dim}_")
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value), name
        assert f"eval_text_to_image_dim{dim}_mrr" in metrics
    # the narrowest prefix ranks differently from the whole embedding (the metrics say something)
    assert any(metrics[f"eval_image_to_text_dim2_{name}"] != metrics[f"eval_image_to_text_{name}"]
               for name in ("mrr", "recall@1"))
