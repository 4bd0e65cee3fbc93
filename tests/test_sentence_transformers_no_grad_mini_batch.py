"""``no_grad_mini_batch_size`` of the cached sentence-transformers losses
(``hf_infcl.no_grad_mini_batches``), offline, on CPU.

A tiny BERT with dropout 0 in training mode draws no random numbers, so a gradient-free pass in
mini-batches of 8 texts under replays of 3 (11 pairs: both passes end on a short mini-batch) must
give the loss and every parameter gradient of the ``mini_batch_size=3`` step and of the uncached
step: in fp32 to 1e-5, in float64 to 1e-9 (``tests.test_gist.assert_same_step``). A forward
pre-hook records the texts of every call of the model (and of GIST's guide, the distillation's
teacher), so that each test also sees the gradient-free pass run in the larger mini-batches. Then:
the warning for dropout active in training, the size equal to ``mini_batch_size`` (dropout
replayed, bit for bit), evaluation, MatryoshkaLoss, assignment, bad input and ``get_config_dict``.
"""

from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch

pytest.importorskip("sentence_transformers")

from hf_infcl import losses  # noqa: E402
from tests.helpers.sentence_transformers_fixtures import (  # noqa: E402
    build_tiny_model_dir,
    features,
    load_tiny_model,
    loss_and_gradients,
    text_columns,
)
from tests.test_gist import assert_same_step  # noqa: E402  (float64: 1e-9 relative; fp32: 1e-5)

ROWS = 11
REPLAY, NO_GRAD = 3, 8  # texts per replay and per mini-batch of the gradient-free pass
CACHED = {"mini_batch_size": REPLAY}
LARGER = {"mini_batch_size": REPLAY, "no_grad_mini_batch_size": NO_GRAD}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="float64")]
LOSS_CLASSES = ["InfCLLoss", "InfCLGISTLoss", "InfCLDistillLoss"]
WARNINGS_FROM = "hf_infcl.no_grad_mini_batches"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(dropout 0, dropout 0.1, the second model's: other weights)."""
    return (build_tiny_model_dir(tmp_path_factory.mktemp("no_dropout"), dropout=0.0),
            build_tiny_model_dir(tmp_path_factory.mktemp("dropout")),
            build_tiny_model_dir(tmp_path_factory.mktemp("frozen"), seed=1))


def model_without_dropout(model_dirs, dtype=torch.float32):
    """In training mode, as the Trainer runs it; its dropout layers draw nothing (p = 0)."""
    model = load_tiny_model(model_dirs[0]).to(dtype)
    assert model.training
    return model


def frozen_model(model_dirs, dtype=torch.float32):
    """GIST's guide or the distillation's teacher: other weights, eval mode, frozen."""
    return load_tiny_model(model_dirs[2]).to(dtype).eval().requires_grad_(False)


@contextlib.contextmanager
def texts_per_call(model):
    """[(with gradient, texts)] of every call of ``model`` while entered."""
    calls = []

    def record(module, args):
        calls.append((torch.is_grad_enabled(), len(args[0]["input_ids"])))

    handle = model.register_forward_pre_hook(record)
    try:
        yield calls
    finally:
        handle.remove()


def mini_batches(size: int) -> list[int]:
    return [min(size, ROWS - begin) for begin in range(0, ROWS, size)]


def expected_calls(n_columns: int, with_replays: bool = True) -> list[tuple[bool, int]]:
    """The gradient-free pass of every column in mini-batches of NO_GRAD (8, 3), then each column's
    replays in mini-batches of REPLAY (3, 3, 3, 2)."""
    first = [(False, texts) for texts in mini_batches(NO_GRAD)] * n_columns
    return first + ([(True, texts) for texts in mini_batches(REPLAY)] * n_columns if with_replays else [])


def make_loss(loss_class: str, model, frozen, **options):
    if loss_class == "InfCLLoss":
        return losses.InfCLLoss(model, **options)
    if loss_class == "InfCLGISTLoss":
        return losses.InfCLGISTLoss(model, frozen, **options)
    return losses.InfCLDistillLoss(model, teacher=frozen, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_columns", [2, 3], ids=["pairs", "hard_negatives1"])
def test_infcl_loss_equals_the_mini_batch_and_uncached_steps(model_dirs, dtype, n_columns, caplog):
    model = model_without_dropout(model_dirs, dtype)
    columns = text_columns(ROWS, n_columns, seed=n_columns)
    uncached = loss_and_gradients(model, losses.InfCLLoss(model), columns, seed=0)
    cached = loss_and_gradients(model, losses.InfCLLoss(model, **CACHED), columns, seed=0)
    with texts_per_call(model) as calls, caplog.at_level(logging.WARNING, logger=WARNINGS_FROM):
        larger = loss_and_gradients(model, losses.InfCLLoss(model, **LARGER), columns, seed=0)
    assert calls == expected_calls(n_columns)
    assert_same_step(cached, larger)
    assert_same_step(uncached, larger)
    assert not caplog.records  # no dropout draws, nothing to warn of


@pytest.mark.parametrize("loss_class", ["InfCLGISTLoss", "InfCLDistillLoss"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_frozen_model_embeds_the_larger_mini_batches_and_the_step_is_the_same(model_dirs, loss_class,
                                                                                  dtype):
    """GIST's guide and the distillation's teacher embed in the gradient-free pass only, so in its
    mini-batches; the loss and gradients are the mini-batch step's and the uncached step's."""
    model, frozen = model_without_dropout(model_dirs, dtype), frozen_model(model_dirs, dtype)
    columns = text_columns(ROWS, 3, seed=5)
    uncached = loss_and_gradients(model, make_loss(loss_class, model, frozen), columns, seed=0)
    cached = loss_and_gradients(model, make_loss(loss_class, model, frozen, **CACHED), columns, seed=0)
    with texts_per_call(model) as calls, texts_per_call(frozen) as frozen_calls:
        larger = loss_and_gradients(model, make_loss(loss_class, model, frozen, **LARGER), columns, seed=0)
    assert calls == expected_calls(3)
    assert frozen_calls == expected_calls(3, with_replays=False)
    assert_same_step(cached, larger)
    assert_same_step(uncached, larger)


def test_active_dropout_warns_once_that_the_gradients_are_approximate(model_dirs, caplog):
    model = load_tiny_model(model_dirs[1])  # dropout 0.1, training mode
    columns = text_columns(ROWS, 2, seed=7)
    loss = losses.InfCLLoss(model, **LARGER)
    with caplog.at_level(logging.WARNING, logger=WARNINGS_FROM):
        larger = loss_and_gradients(model, loss, columns, seed=0)
        loss_and_gradients(model, loss, columns, seed=1)
    assert len(caplog.records) == 1, caplog.records  # once per loss
    message = caplog.records[0].getMessage()
    assert "no_grad_mini_batch_size=8" in message and "approximate" in message
    # 7 dropout layers, and the two rates of the BERT configuration
    assert "9 source(s)" in message and "0.model.embeddings.dropout" in message
    assert "config.hidden_dropout_prob=0.1" in message
    # and they are: the replays drew other masks than the embeddings the loss saw
    cached = loss_and_gradients(model, losses.InfCLLoss(model, **CACHED), columns, seed=0)
    grad_name = "0.model.encoder.layer.1.output.dense.weight"
    assert not torch.allclose(larger[1][grad_name], cached[1][grad_name], rtol=1e-3, atol=1e-6)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=WARNINGS_FROM):
        loss_and_gradients(model, losses.InfCLLoss(model, **CACHED), columns, seed=0)  # replayed masks
        model.eval()  # no dropout draws in eval mode
        loss_and_gradients(model, losses.InfCLLoss(model, **LARGER), columns, seed=0)
    assert not caplog.records


def test_the_size_of_the_replays_keeps_the_replayed_dropout_bit_for_bit(model_dirs, caplog):
    """``no_grad_mini_batch_size == mini_batch_size`` is the plain cached step: each replay under its
    mini-batch's RNG state, so dropout on, the same step exactly and no warning."""
    model = load_tiny_model(model_dirs[1])
    columns = text_columns(ROWS, 2, seed=9)
    cached = loss_and_gradients(model, losses.InfCLLoss(model, **CACHED), columns, seed=4)
    with caplog.at_level(logging.WARNING, logger=WARNINGS_FROM):
        same = loss_and_gradients(model, losses.InfCLLoss(model, **CACHED, no_grad_mini_batch_size=REPLAY),
                                  columns, seed=4)
    assert torch.equal(cached[0], same[0])
    assert all(torch.equal(cached[1][name], same[1][name]) for name in cached[1])
    assert not caplog.records


@pytest.mark.parametrize("loss_class", LOSS_CLASSES)
def test_evaluation_without_gradients_runs_the_larger_mini_batches_only(model_dirs, loss_class):
    model, frozen = model_without_dropout(model_dirs), frozen_model(model_dirs)
    batch = features(model, text_columns(ROWS, 2, seed=11))
    with torch.no_grad():
        uncached = make_loss(loss_class, model, frozen)([dict(column) for column in batch], None)
        with texts_per_call(model) as calls:
            larger = make_loss(loss_class, model, frozen, **LARGER)([dict(column) for column in batch], None)
    assert calls == expected_calls(2, with_replays=False)
    torch.testing.assert_close(larger, uncached, rtol=1e-5, atol=1e-5)


def test_inside_matryoshka_loss(model_dirs):
    from sentence_transformers.sentence_transformer import losses as st_losses

    model = model_without_dropout(model_dirs, torch.float64)
    columns = text_columns(ROWS, 2, seed=13)
    dims = [32, 16, 8]
    cached = loss_and_gradients(
        model, st_losses.MatryoshkaLoss(model, losses.InfCLLoss(model, **CACHED), matryoshka_dims=dims),
        columns, seed=0)
    with texts_per_call(model) as calls:
        larger = loss_and_gradients(
            model, st_losses.MatryoshkaLoss(model, losses.InfCLLoss(model, **LARGER), matryoshka_dims=dims),
            columns, seed=0)
    assert calls == expected_calls(2)
    assert_same_step(cached, larger)


def test_assigned_after_construction_it_takes_effect_and_is_checked(model_dirs):
    model = model_without_dropout(model_dirs)
    batch = features(model, text_columns(ROWS, 2, seed=15))
    loss = losses.InfCLLoss(model, **CACHED)
    loss.no_grad_mini_batch_size = NO_GRAD
    with texts_per_call(model) as calls:
        loss([dict(column) for column in batch], None).backward()
    assert calls == expected_calls(2)
    with pytest.raises(ValueError, match="no_grad_mini_batch_size must be a positive int or None, got 0"):
        loss.no_grad_mini_batch_size = 0
    assert loss.no_grad_mini_batch_size == NO_GRAD  # a refused value leaves the setting as it was
    loss.mini_batch_size = None  # no cached path left for the size: refused at the next forward
    with pytest.raises(ValueError, match="no_grad_mini_batch_size needs mini_batch_size"):
        loss([dict(column) for column in batch], None)
    loss.no_grad_mini_batch_size = None
    assert torch.isfinite(loss([dict(column) for column in batch], None))


TOKEN_BUDGET = "no_grad_mini_batch_size=8 cannot be combined with mini_batch_num_tokens=20"
BAD_INPUT = [
    *(pytest.param({"mini_batch_size": 3, "no_grad_mini_batch_size": value},
                   f"no_grad_mini_batch_size must be a positive int or None, got {value!r}",
                   id=f"size{value!r}")
      for value in (0, -8, 2.5, True, "8")),
    pytest.param({"no_grad_mini_batch_size": 8}, "no_grad_mini_batch_size needs mini_batch_size",
                 id="without-mini_batch_size"),
    pytest.param({"mini_batch_num_tokens": 20, "no_grad_mini_batch_size": 8}, TOKEN_BUDGET,
                 id="token-budget"),
    pytest.param({"mini_batch_size": 3, "mini_batch_num_tokens": 20, "no_grad_mini_batch_size": 8},
                 TOKEN_BUDGET, id="token-budget-and-size"),
]


@pytest.mark.parametrize("options, message", BAD_INPUT)
@pytest.mark.parametrize("loss_class", LOSS_CLASSES)
def test_bad_input_is_refused_at_construction_naming_the_argument(model_dirs, loss_class, options, message):
    model, frozen = model_without_dropout(model_dirs), frozen_model(model_dirs)
    with pytest.raises(ValueError, match=re.escape(message)):
        make_loss(loss_class, model, frozen, **options)


@pytest.mark.parametrize("loss_class", LOSS_CLASSES)
def test_config_dict_holds_it(model_dirs, loss_class):
    model, frozen = model_without_dropout(model_dirs), frozen_model(model_dirs)
    assert make_loss(loss_class, model, frozen).get_config_dict()["no_grad_mini_batch_size"] is None
    config = make_loss(loss_class, model, frozen, **LARGER).get_config_dict()
    assert (config["mini_batch_size"], config["no_grad_mini_batch_size"]) == (REPLAY, NO_GRAD)
