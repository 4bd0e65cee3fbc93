"""``hf_infcl.losses.InfCLDistillLoss``: in-batch distillation in sentence-transformers, offline, on CPU.

Every loss and gradient of the model's parameters is checked against a float64 computation from
the materialised logits (``F.kl_div`` over the normalised embeddings' cosines, every key of the
batch) on the very embeddings the model produced: the teacher's embeddings from the label column
and from a teacher model (of another width, in eval mode), with another tokenizer too, without and
with gradient caching (dropout on, replayed: the reference embeds the same mini-batches under the
same seed), inside MatryoshkaLoss; then the config, the errors, and a SentenceTransformerTrainer run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

sentence_transformers = pytest.importorskip("sentence_transformers")

from sentence_transformers.base.losses.gradcache import _create_minibatch  # noqa: E402
from sentence_transformers.base.losses.merged_forward import embed_columns  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

from hf_infcl import losses  # noqa: E402
from tests.helpers.sentence_transformers_fixtures import (  # noqa: E402
    HIDDEN,
    SPECIAL_TOKENS,
    WORDS,
    build_tiny_model_dir,
    features,
    load_tiny_model,
    replay_tolerance,
    text_columns,
)
from tests.test_gist import assert_same_step as assert_same_gist_step  # noqa: E402

FLOAT64 = {"rtol": 1e-9, "atol": 1e-12}
# float64 steps at fp32's precision under a sentence-transformers that replays in fp32, else test_gist's
FLOAT64_STEP = replay_tolerance(None)


def assert_same_step(expected, actual):
    """test_gist's comparison (float64: 1e-9 relative; fp32: 1e-5), at FLOAT64_STEP for float64."""
    assert_same_gist_step(expected, actual, FLOAT64_STEP if expected[0].dtype == torch.float64 else None)


ROWS = 8
TEACHER_DIM = 48
CACHED = [pytest.param(None, id="uncached"), pytest.param(3, id="mini_batch_size3")]


def with_width(model, width: int, seed: int):
    """``model`` followed by a Dense projection to ``width``: a teacher of another embedding width."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense

    torch.manual_seed(seed)
    return SentenceTransformer(modules=[model[0], model[1], Dense(HIDDEN, width)], device="cpu")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return (build_tiny_model_dir(tmp_path_factory.mktemp("student")),
            build_tiny_model_dir(tmp_path_factory.mktemp("teacher"), seed=1))


@pytest.fixture()
def student(model_dirs):
    """float64, dropout on (training mode), fresh for each test (training runs change it)."""
    return load_tiny_model(model_dirs[0]).double()


@pytest.fixture(scope="module")
def teacher(model_dirs):
    """Another model of another width (48), in eval mode: deterministic targets."""
    return with_width(load_tiny_model(model_dirs[1]), TEACHER_DIM, seed=5).double().eval()


@pytest.fixture(scope="module")
def retokenizing_teacher(tmp_path_factory):
    """A teacher whose vocabulary numbers the words differently: the texts must be re-tokenised."""
    from transformers import BertTokenizerFast

    folder = build_tiny_model_dir(tmp_path_factory.mktemp("other_vocab"), seed=2)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS[::-1])}
    BertTokenizerFast(vocab=vocab).save_pretrained(folder)
    return with_width(load_tiny_model(folder), TEACHER_DIM, seed=6).double().eval()


def batch_on(model, columns) -> list[dict]:
    """Tokenised features of each column on the model's device (the Trainer moves them there)."""
    from sentence_transformers.util import batch_to_device

    return [batch_to_device(column, model.device) for column in features(model, columns)]


def teacher_labels(teacher, columns) -> torch.Tensor:
    """The teacher's embeddings of every text, [rows, columns, dim], tokenised by the teacher itself
    (as a dataset's label column precomputed with ``teacher.encode`` holds them)."""
    with torch.no_grad():
        batches = batch_on(teacher, columns)
        return torch.stack([teacher(batch)["sentence_embedding"] for batch in batches], dim=1)


def reference_loss(student_columns, teacher_columns, scale, teacher_scale, symmetric=False,
                   distillation_weight=1.0):
    """The float64 loss from the materialised logits: KL(softmax t || softmax z) per anchor over every
    key of the batch (``F.kl_div``), mixed with InfoNCE, averaged over the anchors."""
    student = [F.normalize(column.double(), dim=-1) for column in student_columns]
    teacher = [F.normalize(column.double(), dim=-1) for column in teacher_columns]
    z = scale * student[0] @ torch.cat(student[1:]).T
    t = teacher_scale * teacher[0] @ torch.cat(teacher[1:]).T
    m = z.shape[0]

    def kl(student_logits, teacher_logits):
        return F.kl_div(F.log_softmax(student_logits, 1), F.log_softmax(teacher_logits, 1), log_target=True,
                        reduction="none").sum(1)

    targets = torch.arange(m, device=z.device)
    distillation = kl(z, t)
    contrastive = F.cross_entropy(z, targets, reduction="none")
    if symmetric:  # the column term: over the anchors, at each anchor's positive key
        distillation = (distillation + kl(z[:, :m].T, t[:, :m].T)) / 2
        contrastive = (contrastive + F.cross_entropy(z[:, :m].T, targets, reduction="none")) / 2
    return (distillation_weight * distillation + (1 - distillation_weight) * contrastive).mean()


def step(model, compute_loss, seed):
    """(loss, every parameter gradient) of one seeded forward/backward of ``compute_loss()``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = compute_loss()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def embed_in_mini_batches(model, batch, mini_batch_size):
    """Every column embedded with gradient in the mini-batches GradCache cuts, in its order (so the
    same dropout masks under the same seed)."""
    columns = []
    for column in batch:
        rows = len(column["input_ids"])
        columns.append(torch.cat([model(_create_minibatch(column, begin, begin + mini_batch_size))
                                  ["sentence_embedding"] for begin in range(0, rows, mini_batch_size)]))
    return columns


def reference_step(model, teacher_columns, columns, mini_batch_size, seed, **options):
    """The reference's loss and gradients on the embeddings the model gives under ``seed``."""
    def compute():
        batch = batch_on(model, columns)
        if mini_batch_size is None:
            embeddings = embed_columns(model, batch)
        else:
            embeddings = embed_in_mini_batches(model, batch, mini_batch_size)
        return reference_loss(embeddings, teacher_columns, **options)
    return step(model, compute, seed)


def loss_step(model, loss_module, columns, seed, labels=None):
    return step(model, lambda: loss_module(batch_on(model, columns), labels), seed)


OPTIONS = [
    pytest.param({}, id="kl"),
    pytest.param({"symmetric": True, "teacher_scale": 7.0}, id="symmetric-teacher_scale7"),
    pytest.param({"distillation_weight": 0.3, "scale": 10.0}, id="weight0.3-scale10"),
]


def resolved(options):
    """The reference's arguments for the loss's options (its defaults filled in)."""
    scale = options.get("scale", 20.0)
    return {"scale": scale, "teacher_scale": options.get("teacher_scale", scale),
            "symmetric": options.get("symmetric", False),
            "distillation_weight": options.get("distillation_weight", 1.0)}


@pytest.mark.parametrize("mini_batch_size", CACHED)
@pytest.mark.parametrize("negative_columns", [0, 2])
@pytest.mark.parametrize("options", OPTIONS)
def test_teacher_embeddings_from_labels_against_float64(student, teacher, mini_batch_size, negative_columns,
                                                         options):
    columns = text_columns(ROWS, 2 + negative_columns, seed=11)
    labels = teacher_labels(teacher, columns)
    expected = reference_step(student, labels.unbind(1), columns, mini_batch_size, 3, **resolved(options))
    loss = losses.InfCLDistillLoss(student, mini_batch_size=mini_batch_size, **options)
    assert_same_step(expected, loss_step(student, loss, columns, 3, labels))


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_fp32_model_against_float64(model_dirs, teacher, mini_batch_size):
    """An fp32 model (labels in the collator's fp32): the loss computes in fp32, within 1e-5 of float64
    on the same embeddings."""
    model = load_tiny_model(model_dirs[0])
    columns = text_columns(ROWS, 3, seed=22)
    labels = teacher_labels(teacher, columns).float()
    options = {"symmetric": True, "distillation_weight": 0.5}
    expected = reference_step(model, labels.unbind(1), columns, mini_batch_size, 8, **resolved(options))
    actual = loss_step(model, losses.InfCLDistillLoss(model, mini_batch_size=mini_batch_size, **options),
                       columns, 8, labels)
    assert actual[0].dtype == torch.float32
    assert_same_step((expected[0].float(), expected[1]), actual)  # fp32: 1e-5


@pytest.mark.parametrize("mini_batch_size", CACHED)
@pytest.mark.parametrize("options", OPTIONS[:2])
def test_teacher_model_equals_its_labels(student, teacher, mini_batch_size, options):
    columns = text_columns(ROWS, 3, seed=12)
    labels = teacher_labels(teacher, columns)
    from_labels = loss_step(student, losses.InfCLDistillLoss(student, mini_batch_size=mini_batch_size,
                                                             **options), columns, 4, labels)
    from_model = loss_step(student, losses.InfCLDistillLoss(student, teacher=teacher,
                                                            mini_batch_size=mini_batch_size, **options),
                           columns, 4)
    assert_same_step(from_labels, from_model)
    expected = reference_step(student, labels.unbind(1), columns, mini_batch_size, 4, **resolved(options))
    assert_same_step(expected, from_model)


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_a_teacher_of_another_tokenizer_retokenises(student, retokenizing_teacher, mini_batch_size):
    loss = losses.InfCLDistillLoss(student, teacher=retokenizing_teacher, mini_batch_size=mini_batch_size)
    assert loss.must_retokenize
    columns = text_columns(ROWS, 3, seed=13)
    labels = teacher_labels(retokenizing_teacher, columns)  # tokenised by the teacher's own vocabulary
    assert_same_step(reference_step(student, labels.unbind(1), columns, mini_batch_size, 5, **resolved({})),
                     loss_step(student, loss, columns, 5))


def test_the_same_tokenizer_does_not_retokenise(student, teacher):
    assert not losses.InfCLDistillLoss(student, teacher=teacher).must_retokenize


def test_cached_equals_uncached_without_dropout(model_dirs, teacher):
    model = load_tiny_model(model_dirs[0]).double().eval()
    columns = text_columns(ROWS, 3, seed=14)
    labels = teacher_labels(teacher, columns)
    options = {"symmetric": True, "distillation_weight": 0.5}
    uncached = loss_step(model, losses.InfCLDistillLoss(model, **options), columns, 6, labels)
    for cache in ({"mini_batch_size": 3}, {"mini_batch_num_tokens": 20}):
        assert_same_step(uncached, loss_step(model, losses.InfCLDistillLoss(model, **options, **cache),
                                             columns, 6, labels))


def test_dropout_is_replayed_not_switched_off(student, teacher):
    """The cached step's gradients are those of its own (dropout) embeddings: another seed differs."""
    columns = text_columns(ROWS, 2, seed=15)
    labels = teacher_labels(teacher, columns)
    loss = losses.InfCLDistillLoss(student, mini_batch_size=3)
    first, again, other = (loss_step(student, loss, columns, seed, labels) for seed in (7, 7, 8))
    assert_same_step(first, again)
    assert not torch.allclose(first[0], other[0])


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_inside_matryoshka_loss(student, teacher, mini_batch_size):
    """Each dimension truncates (and re-normalises) the student's embeddings; the teacher's stay whole."""
    columns = text_columns(ROWS, 3, seed=16)
    labels = teacher_labels(teacher, columns)
    dims, weights = [32, 16, 8], [1.0, 0.5, 0.25]

    def compute():
        batch = features(student, columns)
        embeddings = (embed_columns(student, batch) if mini_batch_size is None
                      else embed_in_mini_batches(student, batch, mini_batch_size))
        return sum(weight * reference_loss([column[:, :dim] for column in embeddings], labels.unbind(1),
                                           **resolved({"symmetric": True}))
                   for dim, weight in zip(dims, weights))

    expected = step(student, compute, 9)
    for source in ({"teacher": teacher}, {}):
        inner = losses.InfCLDistillLoss(student, symmetric=True, mini_batch_size=mini_batch_size, **source)
        matryoshka = st_losses.MatryoshkaLoss(student, inner, matryoshka_dims=dims,
                                              matryoshka_weights=weights)
        assert_same_step(expected, loss_step(student, matryoshka, columns, 9, None if source else labels))


def test_the_teacher_is_frozen_and_gets_no_gradient(student, model_dirs):
    fresh_teacher = load_tiny_model(model_dirs[1]).double()
    loss = losses.InfCLDistillLoss(student, teacher=fresh_teacher, mini_batch_size=4)
    assert not any(p.requires_grad for p in fresh_teacher.parameters())
    loss_step(student, loss, text_columns(ROWS, 2, seed=17), 1)
    assert all(p.grad is None for p in fresh_teacher.parameters())


def test_evaluation_without_gradients(student, teacher):
    columns = text_columns(ROWS, 3, seed=18)
    labels = teacher_labels(teacher, columns)
    with torch.no_grad():
        torch.manual_seed(2)
        expected = reference_loss(embed_in_mini_batches(student, features(student, columns), 3),
                                  labels.unbind(1), **resolved({}))
        for loss in (losses.InfCLDistillLoss(student, teacher=teacher, mini_batch_size=3),
                     losses.InfCLDistillLoss(student, mini_batch_size=3)):
            torch.manual_seed(2)
            actual = loss(features(student, columns), None if loss.teacher is not None else labels)
            torch.testing.assert_close(actual, expected, **FLOAT64)


def test_config_and_citation(student, teacher):
    loss = losses.InfCLDistillLoss(student, teacher=teacher, scale=10.0, distillation_weight=0.5,
                                   mini_batch_size=4)
    assert loss.get_config_dict() == {
        "teacher": teacher, "scale": 10.0, "teacher_scale": 10.0, "distillation_weight": 0.5,
        "symmetric": False, "mini_batch_size": 4, "mini_batch_num_tokens": None,
        "no_grad_mini_batch_size": None, "backend": "auto", "precision": "auto",
        "gather_across_devices": False,
    }
    assert losses.InfCLDistillLoss(student, teacher_scale=50.0).get_config_dict()["teacher"] is None
    assert losses.InfCLDistillLoss(student, teacher_scale=50.0).get_config_dict()["teacher_scale"] == 50.0
    assert "Breaking the Memory Barrier" in loss.citation
    assert loss.uses_gradient_cache and not losses.InfCLDistillLoss(student).uses_gradient_cache


@pytest.mark.parametrize(("labels_shape", "error", "match"), [
    pytest.param((ROWS, TEACHER_DIM), ValueError, r"\[batch, columns, teacher_dim\] = \[8, 3", id="2d"),
    pytest.param((ROWS, 2, TEACHER_DIM), ValueError, r"got \[8, 2, 48\]", id="columns"),
    pytest.param((ROWS - 1, 3, TEACHER_DIM), ValueError, r"got \[7, 3, 48\]", id="rows"),
    pytest.param((ROWS, 3, 0), ValueError, r"got \[8, 3, 0\]", id="width0"),
])
@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_labels_of_another_layout_are_refused_before_any_forward(student, mini_batch_size, labels_shape,
                                                                  error, match):
    forwards = []
    handle = student.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        loss = losses.InfCLDistillLoss(student, mini_batch_size=mini_batch_size)
        batch = features(student, text_columns(ROWS, 3, seed=19))
        with pytest.raises(error, match=match):
            loss(batch, torch.randn(labels_shape, dtype=torch.float64))
        with pytest.raises(TypeError, match="labels must be a floating-point tensor"):
            loss(batch, torch.ones(ROWS, 3, 4, dtype=torch.long))
    finally:
        handle.remove()
    assert not forwards


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_one_source_of_the_teacher(student, teacher, mini_batch_size):
    batch = features(student, text_columns(ROWS, 2, seed=20))
    with pytest.raises(ValueError, match="labels: .* got no labels"):
        losses.InfCLDistillLoss(student, mini_batch_size=mini_batch_size)(batch, None)
    with pytest.raises(ValueError, match="labels were given and so was a teacher model"):
        losses.InfCLDistillLoss(student, teacher=teacher, mini_batch_size=mini_batch_size)(
            batch, torch.randn(ROWS, 2, TEACHER_DIM, dtype=torch.float64))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    pytest.param({"scale": 0.0}, ValueError, "Scale must be a positive value", id="scale"),
    pytest.param({"teacher_scale": -1.0}, ValueError, "teacher_scale must be a positive value",
                 id="teacher_scale"),
    pytest.param({"teacher_scale": "1"}, TypeError, "teacher_scale must be a positive float",
                 id="teacher_type"),
    pytest.param({"distillation_weight": 1.5}, ValueError, r"distillation_weight must be in \[0, 1\]",
                 id="weight"),
    pytest.param({"symmetric": 1}, TypeError, "symmetric", id="symmetric"),
    pytest.param({"gather_across_devices": "yes"}, TypeError, "gather_across_devices", id="gather"),
    pytest.param({"backend": "nope"}, ValueError, "backend", id="backend"),
    pytest.param({"mini_batch_size": 0}, ValueError, "mini_batch_size must be a positive integer",
                 id="mini_batch_size"),
    pytest.param({"teacher": "all-MiniLM-L6-v2"}, TypeError, "teacher must be a SentenceTransformer",
                 id="teacher_name"),
])
def test_bad_arguments_are_refused_at_construction(student, kwargs, error, match):
    with pytest.raises(error, match=match):
        losses.InfCLDistillLoss(student, **kwargs)


def test_the_triton_backend_is_a_name_as_in_infcl_loss(student, teacher):
    """``backend="triton"`` is taken at construction and saved with the config, as InfCLLoss takes it
    (it needs CUDA tensors when the loss runs)."""
    loss = losses.InfCLDistillLoss(student, teacher=teacher, backend="triton")
    assert loss.get_config_dict()["backend"] == "triton"


def test_the_model_as_its_own_teacher_is_refused(student):
    with pytest.raises(ValueError, match="teacher is the model being trained"):
        losses.InfCLDistillLoss(student, teacher=student)
    assert all(p.requires_grad for p in student.parameters())


@pytest.mark.parametrize("source", ["labels", "teacher"])
def test_trainer_run(model_dirs, teacher, tmp_path, source):
    """Two SentenceTransformerTrainer steps, gradient caching on: the collator hands the label column
    to the loss as ``labels`` [batch, 2, dim]; the student trains, the teacher does not."""
    datasets = pytest.importorskip("datasets")
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = load_tiny_model(model_dirs[0])
    float_teacher = with_width(load_tiny_model(model_dirs[1]), TEACHER_DIM, seed=5).eval()
    anchors, positives = text_columns(16, 2, seed=21)
    data = {"anchor": anchors, "positive": positives}
    if source == "labels":
        data["label"] = teacher_labels(float_teacher, [anchors, positives]).tolist()
        loss = losses.InfCLDistillLoss(model, teacher_scale=30.0, mini_batch_size=3)
    else:
        loss = losses.InfCLDistillLoss(model, teacher=float_teacher, teacher_scale=30.0, mini_batch_size=3)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    teacher_before = {name: p.detach().clone() for name, p in float_teacher.named_parameters()}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, use_cpu=True, disable_tqdm=True,
    )
    train_dataset = datasets.Dataset.from_dict(data)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, loss=loss)
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(0 < value < float("inf") for value in logged)
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(torch.equal(p, teacher_before[name]) for name, p in float_teacher.named_parameters())
    assert not float_teacher.training  # the Trainer switches the model's mode, not the teacher's
    model.save(str(tmp_path / "model"))
    card = (tmp_path / "model" / "README.md").read_text()
    assert "hf_infcl.losses.InfCLDistillLoss" in card and '"teacher_scale": 30.0' in card


@pytest.mark.gpu
@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_on_cuda_against_float64(model_dirs, mini_batch_size):
    """On CUDA (the default route: the tiled PyTorch distillation) the loss and gradients are the
    float64 reference's, with the teacher from labels and from a model."""
    student = load_tiny_model(model_dirs[0]).double().cuda()
    cuda_teacher = with_width(load_tiny_model(model_dirs[1]), TEACHER_DIM, seed=5).double().cuda().eval()
    columns = text_columns(ROWS, 3, seed=91)
    labels = teacher_labels(cuda_teacher, columns)
    options = {"symmetric": True, "distillation_weight": 0.5, "teacher_scale": 30.0}
    expected = reference_step(student, labels.unbind(1), columns, mini_batch_size, 2, **resolved(options))
    options["mini_batch_size"] = mini_batch_size
    from_labels = loss_step(student, losses.InfCLDistillLoss(student, **options), columns, 2, labels)
    assert from_labels[0].device.type == "cuda"
    assert_same_step(expected, from_labels)
    from_model = losses.InfCLDistillLoss(student, teacher=cuda_teacher, **options)
    assert_same_step(expected, loss_step(student, from_model, columns, 2))


# --------------------------------------------------------------------------------------------
# gather_across_devices: two gloo processes of different sizes against the whole batch

RING_ROWS = (3, 5)
RING_OPTIONS = {
    "kl": {"scale": 3.0, "teacher_scale": 5.0},
    "symmetric-mixed": {"scale": 2.0, "symmetric": True, "distillation_weight": 0.6},
}


def ring_columns(seed: int, width: int):
    """Anchor, positive and one negatives column of the whole batch, float64."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(RING_ROWS), width, generator=generator, dtype=torch.float64) for _ in range(3)]


def run_distillation_rank(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    from pathlib import Path

    from tests.helpers.sentence_transformers_workers import rank_process

    with rank_process(rank, world_size, init_file, Path(out_dir) / f"distill-rank{rank}.pt") as results:
        rows = slice(sum(RING_ROWS[:rank]), sum(RING_ROWS[:rank + 1]))
        student = [column[rows].requires_grad_() for column in ring_columns(21, width=6)]
        teacher = [column[rows] for column in ring_columns(22, width=4)]
        for name, options in RING_OPTIONS.items():
            loss = losses.InfCLDistillLoss(None, gather_across_devices=True, backend="torch", **options)
            value = loss.compute_loss_from_embeddings(student, teacher)
            results[name] = (value.detach(), torch.autograd.grad(value, student))


def test_gather_across_devices_runs_over_every_process_candidates(tmp_path):
    """Each anchor's distributions over every process's positives and negatives (the ring), the
    processes holding 3 and 5 examples: the mean of the processes' losses is the float64 loss of the
    whole batch, and each process's gradient (times 1 / processes, DDP's average) its rows' part."""
    from tests.helpers.sentence_transformers_workers import spawn_ranks

    world_size = len(RING_ROWS)
    ranks = spawn_ranks(run_distillation_rank, world_size, tmp_path, results="distill-rank")
    for name, options in RING_OPTIONS.items():
        student = [column.requires_grad_() for column in ring_columns(21, width=6)]
        teacher = ring_columns(22, width=4)
        expected = reference_loss(student, teacher, options["scale"],
                                  options.get("teacher_scale", options["scale"]),
                                  options.get("symmetric", False), options.get("distillation_weight", 1.0))
        gradients = torch.autograd.grad(expected, student)
        torch.testing.assert_close(sum(result[name][0] for result in ranks) / world_size, expected.detach(),
                                   **FLOAT64, msg=name)
        for rank, result in enumerate(ranks):
            rows = slice(sum(RING_ROWS[:rank]), sum(RING_ROWS[:rank + 1]))
            for column, (actual, want) in enumerate(zip(result[name][1], gradients, strict=True)):
                torch.testing.assert_close(actual / world_size, want[rows], **FLOAT64,
                                           msg=f"{name}, rank {rank}, column {column}")


@pytest.mark.parametrize("loss_class", [losses.InfCLLoss, losses.InfCLDistillLoss])
def test_a_single_column_is_refused_naming_the_loss(student, loss_class):
    one_column = batch_on(student, text_columns(ROWS, 1, seed=24))
    with pytest.raises(ValueError, match=f"got 1: {loss_class.__name__} needs the columns"):
        loss_class(student)(one_column, None)
