"""InfCLTrainer on tiny models built from configs: equivalence, two processes, resume, convergence."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import BertModel, TrainerCallback

from hf_infcl import InfCLTrainer, InfCLTrainingArguments, contrastive_loss
from hf_infcl.metrics import retrieval_recalls
from hf_infcl.models import encode_keys, encode_queries
from tests.helpers.offline import run_two_processes
from tests.helpers.trainer_fixtures import (
    DIGIT_WORDS,
    PairDataset,
    caption_tokenizer,
    clip_batch,
    digits_clip,
    digits_image_caption_split,
    logit_scale_of,
    naflex_batch,
    one_thread,  # noqa: F401  (fixture)
    pair_text_batch,
    tiny_bert_config,
    tiny_clip,
    tiny_dual_encoder,
    tiny_groupvit,
    tiny_siglip,
    tiny_siglip2,
    trained_parameters,
    trainer_arguments,
)
from tests.helpers.trainer_workers import CUDA_VARIANTS, PAIRS, TWO_PROCESS_SETTINGS, VARIANTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("one_thread")


def assert_same_parameters(actual, expected, rtol=1e-5, atol=1e-6):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=name)


def train(tmp_path, model, dataset, **overrides):
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, **overrides), train_dataset=dataset)
    trainer.train()
    return trainer


# ---- the cached step inside the Trainer -----------------------------------------------------


@pytest.mark.parametrize(
    ("build", "batch"),
    [(lambda: tiny_clip(dropout=0.0), lambda: clip_batch(16)),
     (lambda: tiny_dual_encoder(shared=False, dropout=0.0), lambda: pair_text_batch(16)),
     (tiny_siglip, lambda: clip_batch(16))],
    ids=["clip", "dual-encoder", "siglip"],
)
def test_chunked_and_offloaded_training_match_the_full_batch(tmp_path, build, batch):
    dataset = PairDataset(batch())
    settings = dict(per_device_train_batch_size=16, max_steps=2, optim="sgd", learning_rate=0.05)
    full = trained_parameters(train(tmp_path / "full", build(), dataset, **settings))
    chunked = train(tmp_path / "chunked", build(), dataset, chunk_size=4, **settings)
    offloaded = train(tmp_path / "offload", build(), dataset, chunk_size=4, offload=True, **settings)
    assert_same_parameters(trained_parameters(chunked), full)
    assert_same_parameters(trained_parameters(offloaded), full)
    # with offload the data loader leaves batches on the host; otherwise it moves them
    assert offloaded.get_train_dataloader().device is None
    assert chunked.get_train_dataloader().device is not None
    scale = "log_logit_scale" if "log_logit_scale" in full else "logit_scale"  # DualEncoder's, CLIP's
    assert not torch.equal(full[scale], getattr(build(), scale).detach())  # the scale was trained
    if "logit_bias" in full:  # SigLIP: the sigmoid loss trains the bias too
        assert chunked.loss_kind == "sigmoid"
        assert not torch.equal(full["logit_bias"], build().logit_bias.detach())
    # per-step logs: loss, logit scale and in-batch accuracy
    logs = [entry for entry in chunked.state.log_history if "loss" in entry]
    assert len(logs) == 2
    assert all({"accuracy", "logit_scale"} <= entry.keys() for entry in logs)
    assert all(0.0 <= entry["accuracy"] <= 1.0 for entry in logs)
    assert math.isclose(logs[0]["logit_scale"], float(logit_scale_of(build()).detach()), rel_tol=1e-5)


def test_larger_no_grad_chunks_train_as_the_replays_chunks(tmp_path):
    """``no_grad_chunk_size``: the cached step's gradient-free pass in chunks of 8, the replays in
    chunks of 4. Without dropout the parameters after two steps are the whole batch's, and the
    image tower saw both chunk sizes."""
    dataset = PairDataset(clip_batch(16))
    settings = dict(per_device_train_batch_size=16, max_steps=2, optim="sgd", learning_rate=0.05)
    full = trained_parameters(train(tmp_path / "full", tiny_clip(dropout=0.0), dataset, **settings))
    model = tiny_clip(dropout=0.0)
    seen = []
    model.vision_model.register_forward_hook(lambda module, inputs, output: seen.append(output[0].shape[0]))
    trainer = train(tmp_path / "cached", model, dataset, chunk_size=4, no_grad_chunk_size=8, **settings)
    assert_same_parameters(trained_parameters(trainer), full)
    assert seen == [8, 8, 4, 4, 4, 4] * 2, seen  # per step: the no-grad pass, then the replays


@pytest.mark.parametrize("kind", ["clip", "dual-encoder"])
def test_larger_no_grad_chunks_match_a_float64_loop(tmp_path, kind):
    """Two SGD steps with the gradient-free pass in chunks of 8 and the replays in chunks of 4
    (dropout 0) equal two float64 steps of the materialised loss on the whole batch."""
    from tests.helpers.trainer_fixtures import float64_sgd_steps
    from tests.test_trainer_distillation import MODELS, STEPS

    build, batch = MODELS[kind]
    columns = batch()

    def loss_of(model, family, batch):
        queries, keys = family.encode_pairs(model, batch)
        reference = functools.partial(contrastive_loss, backend="reference")
        return family.loss(model, reference, queries, keys, *family.loss_parameters(model, "softmax"))

    expected = float64_sgd_steps(build(), columns, loss_of, 2, STEPS["learning_rate"])
    trainer = InfCLTrainer(model=build(), args=trainer_arguments(tmp_path, **STEPS, chunk_size=4,
                                                                 no_grad_chunk_size=8),
                           train_dataset=PairDataset(columns))
    trainer.train()
    actual = trained_parameters(trainer)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_larger_no_grad_chunks_warn_once_of_dropout(tmp_path):
    """With dropout (CLIP's, set through its configuration and applied by functional calls) the
    replays draw other masks than the gradient-free pass: the Trainer says so, once."""
    dataset = PairDataset(clip_batch(16))
    settings = dict(per_device_train_batch_size=16, max_steps=2, optim="sgd", learning_rate=0.05,
                    chunk_size=4, no_grad_chunk_size=8)
    with pytest.warns(UserWarning, match="no_grad_chunk_size=8 with chunk_size=4") as caught:
        train(tmp_path / "dropout", tiny_clip(dropout=0.1), dataset, **settings)
    messages = [str(w.message) for w in caught if "no_grad_chunk_size" in str(w.message)]
    assert len(messages) == 1 and "vision_config.attention_dropout=0.1" in messages[0], messages
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        train(tmp_path / "no-dropout", tiny_clip(dropout=0.0), dataset, **settings)
    assert not [w for w in quiet if "no_grad_chunk_size" in str(w.message)]


def test_two_processes_match_one_process_on_the_concatenated_batch(tmp_path):
    """torchrun, 2 ranks x 8 pairs (DDP, gloo, the ring), cached with offload and uncached ==
    1 process x 16 pairs, uncached: parameters after two steps, logged loss and accuracy."""
    run_two_processes(os.path.join(REPO, "tests", "helpers", "trainer_workers.py"), tmp_path, timeout=300)
    assert_trainer_runs_match_one_process(tmp_path)


@pytest.mark.gpu
def test_ddp_on_two_gpus_with_the_default_cuda_graphs_matches_one_process(tmp_path):
    """torchrun, 2 GPUs x 8 pairs (DDP over NCCL, the ring): the cached step with the default CUDA
    graphs (whose backward DDP's hooks do not see: the gradients are averaged after the step), with
    offload, and eager == 1 process x 16 pairs on the CPU, exact fp32 on both."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    run_two_processes(os.path.join(REPO, "tests", "helpers", "trainer_workers.py"), tmp_path, "cuda",
                      cuda=True, timeout=300)
    assert_trainer_runs_match_one_process(tmp_path, CUDA_VARIANTS)


def assert_trainer_runs_match_one_process(out_dir, variants=VARIANTS) -> None:
    """What ``tests/helpers/trainer_workers.py`` wrote under ``out_dir`` (each of ``variants``:
    parameters after two steps, logged loss and accuracy) equals one process trained on all its
    pairs."""
    single = train(out_dir / "single", tiny_clip(dropout=0.0), PairDataset(clip_batch(PAIRS)),
                   per_device_train_batch_size=PAIRS, **TWO_PROCESS_SETTINGS)
    one_logs = [entry for entry in single.state.log_history if "loss" in entry]
    for variant in variants:
        assert_same_parameters(torch.load(out_dir / f"parameters-{variant}.pt", map_location="cpu"),
                               trained_parameters(single))
        with open(out_dir / f"log_history-{variant}.json") as handle:
            several_logs = [entry for entry in json.load(handle) if "loss" in entry]
        for several, one in zip(several_logs, one_logs, strict=True):
            assert math.isclose(several["loss"], one["loss"], rel_tol=1e-5), variant  # the global mean
            assert math.isclose(several["accuracy"], one["accuracy"], abs_tol=1e-6), variant


# ---- against transformers' own Trainer and the model's own loss -----------------------------


def plain_trainer_parameters(tmp_path, model, dataset, **settings):
    """The parameters after training with transformers' own Trainer and the model's own
    ``return_loss=True`` loss, with the settings of ``trainer_arguments``."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                             save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0,
                             **settings)
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      data_collator=lambda rows: {**default_data_collator(rows), "return_loss": True})
    trainer.train()
    return trained_parameters(trainer)


THREE_STEPS = dict(per_device_train_batch_size=8, max_steps=3, optim="sgd", learning_rate=0.05)


def test_siglip2_trains_like_the_plain_trainer_with_its_own_loss(tmp_path):
    """SigLIP 2 (NaFlex rows of different numbers of valid patches): 3 steps of InfCLTrainer, whole
    batch, in chunks and offloaded chunks, equal 3 steps of the plain Trainer with Siglip2Model's
    own sigmoid loss."""
    dataset = PairDataset(naflex_batch(24, seed=3))
    expected = plain_trainer_parameters(tmp_path / "plain", tiny_siglip2(), dataset, **THREE_STEPS)
    assert not torch.equal(expected["logit_bias"], tiny_siglip2().logit_bias.detach())  # it trained
    for name, extra in {"whole": {}, "chunked": {"chunk_size": 3},
                        "offloaded": {"chunk_size": 3, "offload": True}}.items():
        trainer = train(tmp_path / name, tiny_siglip2(), dataset, **THREE_STEPS, **extra)
        assert trainer.loss_kind == "sigmoid"
        assert_same_parameters(trained_parameters(trainer), expected)
    # evaluation reads every image input too: the whole set's loss is the model's own on it
    eval_batch = naflex_batch(11, seed=4)
    metrics = trainer.evaluate(PairDataset(eval_batch))
    with torch.no_grad():
        own = trainer.model.eval()(**eval_batch, return_loss=True).loss
    assert math.isclose(metrics["eval_whole_set_loss"], float(own), rel_tol=1e-5)


def test_groupvit_batch_norm_is_refused_in_chunks_and_trains_frozen(tmp_path, monkeypatch):
    """GroupViT's projection heads hold BatchNorm1d: chunks would each be normalised alone, so the
    cached step is refused at the first step, naming the layers and the ways out. Without
    chunk_size it trains as the plain Trainer does; with the layers frozen (eval mode through the
    Trainer's model.train()), chunked training does too."""
    from transformers.models.groupvit import modeling_groupvit

    from hf_infcl.batch_statistics import freeze_batch_norm

    # Gumbel noise is drawn per chunk, so no chunked run could draw the whole batch's: the grouping
    # takes its noise-free hard assignment in both runs
    assign = modeling_groupvit.GroupViTAssignAttention.get_attn

    def without_noise(self, attn, gumbel=True, hard=True):
        return assign(self, attn, gumbel=False, hard=hard)

    monkeypatch.setattr(modeling_groupvit.GroupViTAssignAttention, "get_attn", without_noise)
    dataset = PairDataset(clip_batch(24, seed=3))
    model = tiny_groupvit()
    start = {name: value.detach().clone() for name, value in model.named_parameters()}
    with pytest.raises(ValueError) as refused:
        train(tmp_path / "refused", model, dataset, chunk_size=4, **THREE_STEPS)
    message = str(refused.value)
    assert "2 BatchNorm layer(s) of the model (BatchNorm1d)" in message
    assert ": visual_projection.1, text_projection.1." in message
    assert "chunk_size=None" in message and "freeze_batch_norm(model)" in message
    assert_same_parameters(dict(model.named_parameters()), start, rtol=0, atol=0)  # refused before any work

    plain = plain_trainer_parameters(tmp_path / "plain", tiny_groupvit(), dataset, **THREE_STEPS)
    whole = train(tmp_path / "whole", tiny_groupvit(), dataset, **THREE_STEPS)
    assert_same_parameters(trained_parameters(whole), plain)

    frozen_plain_model, frozen_model = tiny_groupvit(), tiny_groupvit()
    for frozen in (frozen_plain_model, frozen_model):
        assert freeze_batch_norm(frozen) == ["visual_projection.1", "text_projection.1"]
    frozen_plain = plain_trainer_parameters(tmp_path / "frozen-plain", frozen_plain_model, dataset,
                                            **THREE_STEPS)
    chunked = train(tmp_path / "frozen-chunked", frozen_model, dataset, chunk_size=4, **THREE_STEPS)
    assert not frozen_model.visual_projection[1].training and frozen_model.training
    assert_same_parameters(trained_parameters(chunked), frozen_plain)
    assert not torch.equal(frozen_plain["visual_projection.1.weight"], start["visual_projection.1.weight"])


# ---- resume ---------------------------------------------------------------------------------


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_from_checkpoint_gives_the_same_losses(tmp_path):
    dataset = PairDataset(clip_batch(48, seed=6))
    settings = dict(per_device_train_batch_size=8, max_steps=6, chunk_size=4, learning_rate=1e-3)

    def losses(trainer):
        return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}

    uninterrupted = train(tmp_path / "a", tiny_clip(dropout=0.2), dataset, **settings)

    args = trainer_arguments(tmp_path / "b", save_strategy="steps", save_steps=3, **settings)
    stopped = InfCLTrainer(model=tiny_clip(dropout=0.2), args=args, train_dataset=dataset,
                           callbacks=[StopAt(3)])
    stopped.train()
    assert stopped.state.global_step == 3
    resumed = InfCLTrainer(model=tiny_clip(dropout=0.2, seed=99), args=args, train_dataset=dataset)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3"))

    expected, got = losses(uninterrupted), losses(resumed)  # the resumed history holds steps 1-3 too
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert math.isclose(got[step], expected[step], rel_tol=1e-6), (step, got[step], expected[step])


# ---- evaluation, logit scale clamp, groups ------------------------------------------------


@pytest.mark.parametrize("with_groups", [False, True], ids=["no-groups", "groups"])
def test_retrieval_recalls_match_a_full_similarity_matrix(with_groups):
    """hf_infcl.metrics' rule, spelled out: a row's rank is the number of keys outside its group
    (other than its positive, without groups) scoring at least as high as its best key inside."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(37, 6, generator=generator, dtype=torch.float64)
    keys = rows + 0.8 * torch.randn(37, 6, generator=generator, dtype=torch.float64)
    groups = torch.randint(0, 9, (37,), generator=generator) if with_groups else torch.arange(37)
    recalls = retrieval_recalls(rows, keys, groups if with_groups else None, ks=(1, 3, 10), block_rows=5)

    sims = (rows.float() @ keys.float().T).double()
    expected = {}
    for k in (1, 3, 10):
        hits = 0
        for i in range(37):
            best = max(sims[i, j] for j in range(37) if groups[j] == groups[i])
            hits += sum(bool(sims[i, j] >= best) for j in range(37) if groups[j] != groups[i]) < k
        expected[k] = hits / 37
    assert recalls == pytest.approx(expected)
    assert 0 < recalls[1] < 1


def test_retrieval_recalls_count_ties_against_the_positive():
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.5, 0.5]])
    # ranks 1, 2, 2: row 0's positive ties key 1, row 1's ties key 0 (key 2 beats it), row 2's ties both
    assert retrieval_recalls(rows, keys, ks=(1, 2, 3)) == {1: 0.0, 2: pytest.approx(1 / 3), 3: 1.0}
    # a constant model: every key ties, every row ranks last
    assert retrieval_recalls(torch.ones(4, 3), torch.ones(4, 3), ks=(1, 3, 4)) == {1: 0.0, 3: 0.0, 4: 1.0}
    # with groups, the tie is with a key of the row's own group: no penalty
    assert retrieval_recalls(rows, keys, torch.tensor([0, 0, 1]), ks=(1,)) == {1: pytest.approx(1 / 3)}


def plain_trainer_eval_loss(tmp_path, model, dataset, **settings):
    """eval_loss of transformers' own Trainer on a CLIP-like model (its loss per eval batch, as
    run_clip.py evaluates with return_loss=True)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                             **settings)
    trainer = Trainer(model=model, args=args, eval_dataset=dataset,
                      data_collator=lambda rows: {**default_data_collator(rows), "return_loss": True})
    return trainer.evaluate()["eval_loss"]


def test_evaluate_reports_loss_and_recalls_both_directions(tmp_path):
    """eval_loss is the Trainer's (the mean over eval batches of 5, 5, 3 rows); the whole set as one
    batch is eval_whole_set_loss; recalls and MRR in both directions."""
    model = tiny_clip(dropout=0.0)
    dataset = PairDataset(clip_batch(13, seed=9))
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, per_device_eval_batch_size=5),
                           eval_dataset=dataset)
    metrics = trainer.evaluate()
    for direction in ("image_to_text", "text_to_image"):
        for k in (1, 5, 10):
            assert 0.0 <= metrics[f"eval_{direction}_recall@{k}"] <= 1.0
        assert 0.0 < metrics[f"eval_{direction}_mrr"] <= 1.0
    with torch.no_grad():
        reference = model(**clip_batch(13, seed=9), return_loss=True).loss  # CLIP's own n x n loss
    assert math.isclose(metrics["eval_whole_set_loss"], float(reference), rel_tol=1e-5)
    expected = plain_trainer_eval_loss(tmp_path / "plain", model, dataset, per_device_eval_batch_size=5)
    assert math.isclose(metrics["eval_loss"], expected, rel_tol=1e-5)
    assert abs(metrics["eval_loss"] - metrics["eval_whole_set_loss"]) > 0.1  # fewer negatives per batch
    # one batch holding the whole set: both are the same loss
    whole = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, per_device_eval_batch_size=13),
                         eval_dataset=dataset).evaluate()
    assert math.isclose(whole["eval_loss"], float(reference), rel_tol=1e-5)


def test_metric_for_best_model_eval_loss_picks_the_trainers_eval_loss(tmp_path):
    """load_best_model_at_end with metric_for_best_model="eval_loss" keeps the checkpoint of the
    lowest per-batch eval_loss, as with the Trainer; "whole_set_loss" is minimised too."""
    for metric in ("eval_loss", "whole_set_loss"):
        args = trainer_arguments(tmp_path / metric, per_device_train_batch_size=8,
                                 per_device_eval_batch_size=4, max_steps=3, learning_rate=0.05, optim="sgd",
                                 eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                                 load_best_model_at_end=True, metric_for_best_model=metric)
        assert args.greater_is_better is False
        trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=args,
                               train_dataset=PairDataset(clip_batch(8)),
                               eval_dataset=PairDataset(clip_batch(10, seed=5)))
        trainer.train()
        name = metric if metric.startswith("eval_") else f"eval_{metric}"
        evaluations = {entry["step"]: entry[name] for entry in trainer.state.log_history if name in entry}
        assert sorted(evaluations) == [1, 2, 3]
        best_step = min(evaluations, key=evaluations.get)
        assert trainer.state.best_metric == pytest.approx(evaluations[best_step])
        assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")


EVAL_WORKER = """
import json, os, sys
import numpy as np
import torch
from transformers import Trainer, TrainingArguments, default_data_collator
from hf_infcl import InfCLTrainer
from tests.helpers.trainer_fixtures import (PairDataset, clip_batch, end_worker_process, tiny_clip,
                                           trainer_arguments)

torch.set_num_threads(1)
out = sys.argv[1]
model, dataset = tiny_clip(dropout=0.0), PairDataset(clip_batch(13, seed=9))
args = trainer_arguments(os.path.join(out, "infcl"), per_device_eval_batch_size=3)
trainer = InfCLTrainer(model=model, args=args)
assert trainer.accelerator.num_processes == 2
metrics = trainer.evaluate(dataset)
prediction = trainer.predict(dataset)
plain = Trainer(model=model, args=TrainingArguments(output_dir=os.path.join(out, "plain"), use_cpu=True,
                                                    report_to="none", per_device_eval_batch_size=3),
                data_collator=lambda rows: {**default_data_collator(rows), "return_loss": True})
plain_loss = plain.evaluate(dataset)["eval_loss"]
if trainer.accelerator.is_main_process:
    with open(os.path.join(out, "eval.json"), "w") as handle:
        json.dump({"metrics": metrics, "plain_loss": plain_loss, "test_metrics": prediction.metrics}, handle)
    if prediction.predictions is not None:
        np.save(os.path.join(out, "rows.npy"), prediction.predictions[0])
        np.save(os.path.join(out, "keys.npy"), prediction.predictions[1])
end_worker_process()
"""


def test_two_process_evaluation_gathers_every_row_once(tmp_path):
    """torchrun, 2 ranks, 13 eval rows in batches of 3 (the last batches padded by Accelerate):
    eval_loss is the plain Trainer's in the same two processes; the whole-set loss and the
    retrieval metrics are one process's."""
    script = tmp_path / "eval_worker.py"
    script.write_text(EVAL_WORKER)
    run_two_processes(script, tmp_path, timeout=300)
    with open(tmp_path / "eval.json") as handle:
        two = json.load(handle)
    model, dataset = tiny_clip(dropout=0.0), PairDataset(clip_batch(13, seed=9))
    one = InfCLTrainer(model=model, args=trainer_arguments(tmp_path / "one", per_device_eval_batch_size=3),
                       eval_dataset=dataset).evaluate()
    assert math.isclose(two["metrics"]["eval_loss"], two["plain_loss"], rel_tol=1e-5)
    retrieval = [name for name in one if "recall" in name or "mrr" in name]
    assert len(retrieval) == 8
    for name in ["eval_whole_set_loss", *retrieval]:
        assert math.isclose(two["metrics"][name], one[name], rel_tol=1e-5, abs_tol=1e-7), name
    # predict(): every row once, in dataset order, as one process predicts them
    import numpy as np

    single = InfCLTrainer(model=model, args=trainer_arguments(tmp_path / "one", per_device_eval_batch_size=3))
    rows, keys = single.predict(dataset).predictions
    np.testing.assert_allclose(np.load(tmp_path / "rows.npy"), rows, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "keys.npy"), keys, rtol=1e-5, atol=1e-6)
    assert two["test_metrics"]["test_loss"] == pytest.approx(two["metrics"]["eval_loss"])


def test_predict_returns_the_embeddings_of_both_towers(tmp_path):
    """predict(): predictions (image rows, text keys) as numpy in dataset order, the batches'
    labels as label_ids, evaluate's metrics with the test_ prefix."""
    import numpy as np

    model = tiny_clip(dropout=0.0).eval()
    batch = clip_batch(13, seed=9)
    labels = torch.arange(13) % 4
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, per_device_eval_batch_size=5))
    output = trainer.predict(PairDataset({**batch, "label": labels}))  # the collator makes it "labels"
    rows, keys = output.predictions
    assert isinstance(rows, np.ndarray) and isinstance(keys, np.ndarray)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(rows), encode_queries(model, batch), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(keys), encode_keys(model, batch), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(output.label_ids, labels.numpy())
    evaluated = trainer.evaluate(PairDataset(batch))
    assert {"test_loss", "test_whole_set_loss", "test_image_to_text_recall@1", "test_text_to_image_mrr"} <= (
        output.metrics.keys())
    for name, value in evaluated.items():
        if name.startswith("eval_") and not name.endswith(("_runtime", "_per_second")):
            assert output.metrics["test_" + name[5:]] == pytest.approx(value), name
    assert trainer.predict(PairDataset(batch)).label_ids is None  # no labels in the batches


def test_compute_metrics_gets_the_embeddings_and_labels(tmp_path):
    """compute_metrics is called once per evaluation with an EvalPrediction of (rows, keys) and the
    labels; its results join the metrics with the eval_ (or test_) prefix."""
    import numpy as np

    model = tiny_clip(dropout=0.0).eval()
    batch = clip_batch(13, seed=9)
    labels = torch.arange(13) % 4
    calls = []

    def compute_metrics(prediction):
        calls.append(prediction)
        rows, keys = prediction.predictions
        return {"agreement": float((rows * keys).sum(1).mean()), "rows": np.int64(rows.shape[0])}

    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, per_device_eval_batch_size=5,
                                                               include_for_metrics=["loss"]),
                           compute_metrics=compute_metrics)
    metrics = trainer.evaluate(PairDataset({**batch, "label": labels}))
    assert len(calls) == 1
    with torch.no_grad():
        rows, keys = encode_queries(model, batch), encode_keys(model, batch)
    torch.testing.assert_close(torch.from_numpy(calls[0].predictions[0]), rows, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(calls[0].predictions[1]), keys, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(calls[0].label_ids, labels.numpy())
    assert calls[0].losses.mean() == pytest.approx(metrics["eval_loss"])
    assert metrics["eval_agreement"] == pytest.approx(float((rows * keys).sum(1).mean()), rel=1e-5)
    assert metrics["eval_rows"] == 13 and type(metrics["eval_rows"]) is int
    assert "eval_image_to_text_recall@1" in metrics and "eval_whole_set_loss" in metrics
    tested = trainer.predict(PairDataset(batch)).metrics
    assert calls[1].label_ids is None and tested["test_rows"] == 13
    trainer.args.batch_eval_metrics = True
    with pytest.raises(ValueError, match="batch_eval_metrics=False"):
        trainer.evaluate(PairDataset(batch))


def test_evaluate_dual_encoder_names_query_and_doc(tmp_path):
    model = tiny_dual_encoder(dropout=0.0, learn_scale=False)
    batch = pair_text_batch(9, seed=8)
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, per_device_eval_batch_size=4),
                           eval_dataset=PairDataset(batch))
    metrics = trainer.evaluate()
    assert {"eval_query_to_doc_recall@1", "eval_doc_to_query_recall@10"} <= metrics.keys()
    assert metrics["eval_query_to_doc_recall@10"] == 1.0  # 9 documents: the positive is always in the top 10
    with torch.no_grad():
        reference = model.eval()(**batch, return_loss=True).loss
    assert math.isclose(metrics["eval_whole_set_loss"], float(reference), rel_tol=1e-5)
    expected = plain_trainer_eval_loss(tmp_path / "plain", model, PairDataset(batch),
                                       per_device_eval_batch_size=4)
    assert math.isclose(metrics["eval_loss"], expected, rel_tol=1e-5)


@pytest.mark.parametrize("kind", ["clip", "dual_encoder"])
def test_model_card_of_the_trainer(tmp_path, kind):
    """push_to_hub's card is hf_infcl's: the run's contrastive settings, the latest evaluation,
    Hub metadata that huggingface_hub parses back."""
    from huggingface_hub import ModelCard

    if kind == "clip":
        model, batch = tiny_clip(dropout=0.0), clip_batch(12, seed=3)
    else:
        model, batch = tiny_dual_encoder(dropout=0.0), pair_text_batch(12, seed=3)
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, per_device_train_batch_size=6,
                                                               chunk_size=3),
                           train_dataset=PairDataset(batch), eval_dataset=PairDataset(batch))
    trainer.train()
    trainer.evaluate()
    trainer.create_model_card(model_name="tiny-infcl", dataset="toy-pairs")
    card = ModelCard.load(tmp_path / "README.md")
    assert "inf-cl" in card.data.tags
    assert card.data.model_name == "tiny-infcl"
    assert card.data.eval_results, "the latest evaluation goes into the model-index"
    assert "encoder chunk (GradCache)" in card.text and "| 3 |" in card.text.replace("  ", " ")


def test_logit_scale_is_clamped_after_each_step(tmp_path):
    model = tiny_clip(dropout=0.0)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(250.0))
    train(tmp_path, model, PairDataset(clip_batch(8)), per_device_train_batch_size=8, max_steps=1,
          logit_scale_max=100.0)
    assert float(model.logit_scale.detach()) == pytest.approx(math.log(100.0))


def test_group_column_masks_false_negatives(tmp_path):
    """Duplicate pairs share a group id: the Trainer's loss is the float64 reference with masking."""
    batch = clip_batch(6, seed=4)
    duplicated = {name: torch.cat([values, values[:2]]) for name, values in batch.items()}
    groups = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])
    model = tiny_clip(dropout=0.0).eval()
    trainer = InfCLTrainer(model=model, args=trainer_arguments(tmp_path, group_column="group"))
    trainer._set_signature_columns_if_needed()
    assert "group" in trainer._signature_columns  # the column survives remove_unused_columns
    with torch.no_grad():
        loss = trainer.compute_loss(model, {**duplicated, "group": groups})
        out = model(**duplicated)
        scale = model.logit_scale.exp().double()
        masked = contrastive_loss(out.image_embeds.double(), out.text_embeds.double(), scale,
                                  query_groups=groups, key_groups=groups, backend="reference")
        unmasked = contrastive_loss(out.image_embeds.double(), out.text_embeds.double(), scale,
                                    backend="reference")
    torch.testing.assert_close(loss.double(), masked, rtol=1e-5, atol=1e-6)
    assert abs(float(masked) - float(unmasked)) > 1e-3  # the masking changed the loss


def test_convergence_on_digits_zero_shot(tmp_path):
    """A few hundred cached steps on sklearn digits as image-caption pairs, duplicates grouped by
    digit: held-out zero-shot classification against "a photo of the digit <word>" beats chance
    (10 %) by far."""
    tokenizer = caption_tokenizer()
    dataset, images, labels = digits_image_caption_split(tokenizer)
    model = digits_clip(len(tokenizer))
    trainer = train(tmp_path, model, dataset, per_device_train_batch_size=64, max_steps=200, chunk_size=32,
                    learning_rate=3e-3, warmup_steps=10, weight_decay=0.0, group_column="label",
                    logging_steps=50)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[-1]["loss"] < 0.5 * logs[0]["loss"]
    assert len(logs) == 4 and logs[-1]["accuracy"] > 0.5  # only logged steps measure it (every 50th)
    model.eval()
    prompts = tokenizer([f"a photo of the digit {word}" for word in DIGIT_WORDS], padding="max_length",
                        max_length=10, return_tensors="pt")
    with torch.no_grad():
        class_embeddings = encode_keys(model, dict(prompts))
        image_embeddings = encode_queries(model, {"pixel_values": images})
    accuracy = float(((image_embeddings @ class_embeddings.T).argmax(dim=1) == labels).float().mean())
    assert accuracy > 0.7, accuracy


# ---- argument checks ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 4], ids=["whole-batch", "chunked"])
def test_precision_reaches_every_loss_call(tmp_path, monkeypatch, chunk_size):
    """--precision goes to the training loss (plain and cached steps) and the evaluation loss, as an
    option InfCLTrainingArguments checked (the loss does not check it again on every call)."""
    import hf_infcl.trainer
    from hf_infcl.loss import _contrastive_loss
    from hf_infcl.ops.options import PRECISIONS

    seen = []

    def recording_loss(*args, **kwargs):
        assert kwargs["options_checked"] is True
        seen.append(kwargs.get("precision"))
        return _contrastive_loss(*args, **kwargs)

    monkeypatch.setattr(hf_infcl.trainer, "_contrastive_loss", recording_loss)
    args = trainer_arguments(tmp_path, precision="ieee", per_device_train_batch_size=8, max_steps=2,
                             chunk_size=chunk_size)
    assert args.precision == "ieee" and "ieee" in PRECISIONS
    batch = clip_batch(16)
    trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=args, train_dataset=PairDataset(batch),
                           eval_dataset=PairDataset(batch))
    trainer.train()
    trainer.evaluate()
    assert len(seen) >= 3 and set(seen) == {"ieee"}
    assert InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True).precision == "auto"



def test_plain_training_arguments_are_converted(tmp_path):
    """InfCLTrainer(model, args=TrainingArguments(...)): every field as set, our defaults added."""
    from dataclasses import dataclass, field, fields

    from transformers import TrainingArguments

    defaults = InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True)  # (resets Accelerate)
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", learning_rate=0.05,
                              per_device_train_batch_size=8, per_device_eval_batch_size=3, max_steps=2,
                              eval_strategy="steps", eval_steps=1, seed=7, optim="sgd", save_strategy="no",
                              metric_for_best_model="eval_loss", weight_decay=0.25, logging_steps=1)
    trainer = InfCLTrainer(tiny_clip(dropout=0.0), args=plain, train_dataset=PairDataset(clip_batch(8)),
                           eval_dataset=PairDataset(clip_batch(6, seed=2)))
    assert type(trainer.args) is InfCLTrainingArguments
    for name in (f.name for f in fields(TrainingArguments) if f.init):
        assert getattr(trainer.args, name) == getattr(plain, name), name
    for name in ("chunk_size", "offload", "loss_backend", "precision", "contrastive_loss", "symmetric",
                 "logit_scale_max", "group_column", "chunk_gradient_sync", "eval_block_rows"):
        assert getattr(trainer.args, name) == getattr(defaults, name), name
    trainer.train()
    assert [entry["step"] for entry in trainer.state.log_history if "eval_loss" in entry] == [1, 2]

    @dataclass
    class WithMore(TrainingArguments):
        beam_width: int = field(default=4)

    with pytest.raises(TypeError, match="beam_width"):
        InfCLTrainer(tiny_clip(), args=WithMore(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    with pytest.raises(TypeError, match="got dict"):
        InfCLTrainer(tiny_clip(), args={"output_dir": str(tmp_path)})


def test_bad_arguments_and_combinations_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="offload=True needs chunk_size"):
        InfCLTrainingArguments(output_dir=str(tmp_path), offload=True, use_cpu=True)
    with pytest.raises(ValueError, match="chunk_size"):
        InfCLTrainingArguments(output_dir=str(tmp_path), chunk_size=0, use_cpu=True)
    with pytest.raises(ValueError, match="chunk_cuda_graphs=True needs chunk_size"):
        InfCLTrainingArguments(output_dir=str(tmp_path), chunk_cuda_graphs=True, use_cpu=True)
    with pytest.raises(ValueError, match="no_grad_chunk_size needs chunk_size"):
        InfCLTrainingArguments(output_dir=str(tmp_path), no_grad_chunk_size=8, use_cpu=True)
    with pytest.raises(ValueError, match="no_grad_chunk_size must be a positive int or None, got 0"):
        InfCLTrainingArguments(output_dir=str(tmp_path), chunk_size=4, no_grad_chunk_size=0, use_cpu=True)
    with pytest.raises(ValueError, match="chunk_cuda_graphs=True needs the no-grad pass to chunk like"):
        InfCLTrainingArguments(output_dir=str(tmp_path), chunk_size=4, no_grad_chunk_size=8,
                               chunk_cuda_graphs=True, use_cpu=True)
    with pytest.raises(ValueError, match="^chunk_cuda_graphs=True cannot run here: this run trains on cpu"):
        graphed = trainer_arguments(tmp_path, chunk_size=4, chunk_cuda_graphs=True)
        InfCLTrainer(model=tiny_clip(), args=graphed)
    with pytest.raises(ValueError, match="contrastive_loss"):
        InfCLTrainingArguments(output_dir=str(tmp_path), contrastive_loss="triplet", use_cpu=True)
    with pytest.raises(ValueError, match="loss_backend"):
        InfCLTrainingArguments(output_dir=str(tmp_path), loss_backend="cuda", use_cpu=True)
    with pytest.raises(ValueError, match="logit_scale_max"):
        InfCLTrainingArguments(output_dir=str(tmp_path), logit_scale_max=0.0, use_cpu=True)
    with pytest.raises(ValueError, match="chunk_gradient_sync must be one of 'step', 'chunk'; got 'layer'"):
        InfCLTrainingArguments(output_dir=str(tmp_path), chunk_gradient_sync="layer", use_cpu=True)
    for precision in ("fp8", "TF32", None, ""):
        with pytest.raises(ValueError, match="precision must be one of 'auto', 'tf32', 'ieee'"):
            InfCLTrainingArguments(output_dir=str(tmp_path), precision=precision, use_cpu=True)
    with pytest.raises(TypeError, match="not a supported contrastive model"):
        InfCLTrainer(model=BertModel(tiny_bert_config()), args=trainer_arguments(tmp_path))
    with pytest.raises(ValueError, match="compute_loss_func"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path), compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, label_smoothing_factor=0.1))
    with pytest.warns(UserWarning, match="gradient accumulation does not add negatives"):
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, gradient_accumulation_steps=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path))


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_bf16_chunked_offloaded_training_on_gpu(tmp_path):
    """bf16 mixed precision, chunks of 4 with offload, on CUDA: finite losses, the scale trains,
    and batches reach the step on the host."""
    if torch.cuda.device_count() > 1:
        pytest.skip("one process sees several GPUs, so the Trainer would use DataParallel, which "
                    "InfCLTrainer refuses; run with CUDA_VISIBLE_DEVICES=0")
    seen_devices = []

    class RecordBatchDevice(TrainerCallback):
        def on_step_begin(self, args, state, control, train_dataloader=None, **kwargs):
            seen_devices.append(train_dataloader.device)

    model = tiny_clip(dropout=0.1)
    before = model.logit_scale.detach().clone()
    args = trainer_arguments(tmp_path, use_cpu=False, bf16=True, chunk_size=4, offload=True,
                             per_device_train_batch_size=16, max_steps=3, learning_rate=1e-2)
    trainer = InfCLTrainer(model=model, args=args, train_dataset=PairDataset(clip_batch(48)),
                           callbacks=[RecordBatchDevice()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert not torch.equal(model.logit_scale.detach().cpu(), before)
    assert next(model.parameters()).device.type == "cuda"
    assert seen_devices and all(device is None for device in seen_devices)  # no whole-batch transfer


def test_what_the_sharded_engines_cannot_do_is_rejected(tmp_path):
    """The Trainer enables FSDP and DeepSpeed only in distributed runs, so the engine is set by
    hand here (FSDP2 and ZeRO-2/3 with chunk_size run in tests/test_trainer_fsdp.py)."""
    trainer = InfCLTrainer(model=tiny_clip(), args=trainer_arguments(tmp_path, chunk_size=4))
    trainer.is_fsdp_enabled = True
    trainer._is_fsdp2 = lambda: False  # FSDP1
    with pytest.raises(ValueError, match="chunk_size .* under FSDP2 only.*'version': 2"):
        trainer._check_combinations()
    trainer.is_fsdp_enabled = False
    trainer.args.deepspeed = {"zero_optimization": {"stage": 2}}
    trainer.args.chunk_gradient_sync = "chunk"
    with pytest.raises(ValueError, match="chunk_gradient_sync='chunk' does not apply to DeepSpeed"):
        trainer._check_combinations()


def test_the_default_chunk_cuda_graphs_stay_off_where_they_would_not_be_exact_and_say_why(
        tmp_path, monkeypatch, caplog):
    """chunk_cuda_graphs=None (the default) turns the cached step's CUDA graphs on only where they
    give the eager step's gradients and their buffers fit; elsewhere the first cached step says
    why, once, and trains eagerly. (That they turn on, capture and train on a GPU: the GPU smoke
    cases ``trainer-*-chunk16``.)"""
    assert InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True).chunk_cuda_graphs is None
    with pytest.raises(TypeError, match="^chunk_cuda_graphs must be a bool or None, got str$"):
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, chunk_size=4, chunk_cuda_graphs="yes")

    model = tiny_clip()
    args = trainer_arguments(tmp_path, chunk_size=4, per_device_train_batch_size=8, max_steps=2)
    trainer = InfCLTrainer(model=model, args=args, train_dataset=PairDataset(clip_batch(16)))
    with caplog.at_level(logging.INFO, logger="hf_infcl.trainer"):
        trainer.train()
    said = [record.getMessage() for record in caplog.records if "without CUDA graphs" in record.getMessage()]
    assert said == ["InfCLTrainer: the cached step runs its chunks without CUDA graphs: this run trains on "
                    "cpu, not on a CUDA GPU (chunk_cuda_graphs=None decided so; True asks for them)."]
    assert trainer._chunk_graphs is None

    # What keeps them from running at all (an explicit True is refused for it). Several processes
    # under DDP do not: the gradients are averaged after the graphs, unless each replay must reduce.
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda _: 2))
    trainer.args.chunk_gradient_sync = "chunk"
    assert trainer._why_graphs_cannot_run().startswith("chunk_gradient_sync='chunk' reduces the gradients")
    trainer.args.chunk_gradient_sync = "step"
    assert trainer._why_graphs_cannot_run() == "this run trains on cpu, not on a CUDA GPU"
    trainer.is_fsdp_enabled = True
    assert trainer._why_graphs_cannot_run().startswith("FSDP and DeepSpeed reduce (and shard) gradients")
    trainer.is_fsdp_enabled = False

    # What the default weighs once a GPU is there (stood in for: the device checks pass, and the
    # GPU's memory is as given).
    trainer._why_graphs_cannot_run = lambda: None
    memory = {"total_memory": 2**40}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(**memory))
    model.train()
    assert trainer._why_no_graphs(model) == "some trainable parameters are not on the GPU"
    gradient_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    memory["total_memory"] = 8 * 4 * gradient_bytes - 1  # four graphs' buffers just above 1/8 of it
    assert trainer._why_no_graphs(model).startswith("the graphs' gradient buffers (up to ")
    memory["total_memory"] = 2**40
    model.config.text_config.layerdrop = 0.1
    assert trainer._why_no_graphs(model) == (
        "the model skips layers at random on the host (config.text_config.layerdrop=0.1): a graph would "
        "repeat the skips of its capture")
    model.eval()  # no draws outside training
    assert trainer._why_no_graphs(model) == "some trainable parameters are not on the GPU"
    model.train()
    model.text_model.encoder.gradient_checkpointing = True  # as gradient_checkpointing_enable() sets it
    assert trainer._why_no_graphs(model).startswith("gradient checkpointing replays the forward")
    model.text_model.encoder.gradient_checkpointing = False
    trainer.args.gradient_checkpointing = True
    assert trainer._why_no_graphs(model).startswith("gradient checkpointing replays the forward")
    trainer.args.no_grad_chunk_size = 8
    assert trainer._why_no_graphs(model) == ("no_grad_chunk_size chunks the gradient-free pass otherwise "
                                             "than the replays")
