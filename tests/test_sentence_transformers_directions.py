"""``directions`` and ``partition_mode`` of ``hf_infcl.losses.InfCLLoss`` (issue 16).

Every combination sentence-transformers' MultipleNegativesRankingLoss accepts, against the float64
oracle (tests/helpers/oracle.py, the formulas of docs/contract.md) on embeddings, and against the installed
MNRL / CachedMNRL on a tiny BERT with dropout on: the loss and every parameter gradient, pairs and
hard-negative columns. The same with every hardness_mode, and with their checks, warning and
assignment. Then their checks and messages, assignment after construction and the config. Two
processes over gloo: here against the oracle, with ranks of different sizes (hardness too);
against MNRL's all-gather in tests/test_sentence_transformers.py (its SCENARIOS).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import re

import numpy as np
import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers import losses as st_losses  # noqa: E402
from sentence_transformers import util  # noqa: E402

from hf_infcl import losses  # noqa: E402
from tests.helpers.oracle import directions_loss  # noqa: E402
from tests.helpers.sentence_transformers_fixtures import (  # noqa: E402
    build_tiny_model_dir,
    load_tiny_model,
    loss_and_gradients,
    st_reference_loss,
    text_columns,
)
from tests.test_sentence_transformers import assert_same_step  # noqa: E402

if "directions" not in inspect.signature(st_losses.MultipleNegativesRankingLoss.__init__).parameters:
    pytest.skip("this sentence-transformers has no MNRL directions", allow_module_level=True)

EXTRA_DIRECTIONS = ("query_to_query", "doc_to_query", "doc_to_doc")
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def accepted_combinations():
    """(directions, partition_mode) for every non-empty set of directions MNRL accepts: query_to_doc
    always, with any of the other three under "joint"; "per_direction" without the same-type ones."""
    for count in range(len(EXTRA_DIRECTIONS) + 1):
        for extra in itertools.combinations(EXTRA_DIRECTIONS, count):
            directions = ("query_to_doc", *extra)
            name = "+".join(extra or ("q2d",))
            yield pytest.param(directions, "joint", id=f"{name}-joint")
            if not set(extra) & {"query_to_query", "doc_to_doc"}:
                yield pytest.param(directions, "per_direction", id=f"{name}-per_direction")


COMBINATIONS = list(accepted_combinations())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_tiny_model(build_tiny_model_dir(tmp_path_factory.mktemp("tiny_bert")))
COLUMNS = [pytest.param(2, id="pairs"), pytest.param(4, id="hard_negatives2")]


def test_every_accepted_combination_is_covered():
    """8 joint sets and the two per_direction ones: what MNRL's constructor accepts."""
    assert len(COMBINATIONS) == 10
    for directions, partition_mode in (case.values for case in COMBINATIONS):
        st_losses.MultipleNegativesRankingLoss(None, directions=directions, partition_mode=partition_mode)


@pytest.mark.parametrize("n_columns", COLUMNS)
@pytest.mark.parametrize("directions, partition_mode", COMBINATIONS)
def test_matches_the_float64_oracle(tiny_model, directions, partition_mode, n_columns):
    """On embeddings (dot products), the loss and the gradient of every embedding."""
    generator = torch.Generator().manual_seed(len(directions) + n_columns)
    embeddings = [torch.randn(6, 5, generator=generator, dtype=torch.float64) for _ in range(n_columns)]
    loss = losses.InfCLLoss(tiny_model, scale=0.7, similarity_fct=util.dot_score, directions=directions,
                            partition_mode=partition_mode, backend="torch")
    inputs = [embedding.clone().requires_grad_() for embedding in embeddings]
    value = loss.compute_loss_from_embeddings(inputs)
    value.backward()

    expected, gradients = directions_loss(embeddings[0].numpy(), [e.numpy() for e in embeddings[1:]], 0.7,
                                          directions, partition_mode)
    np.testing.assert_allclose(value.item(), expected, rtol=1e-12)
    np.testing.assert_allclose(inputs[0].grad.numpy(), gradients["queries"], rtol=1e-10, atol=1e-12)
    documents = torch.cat([tensor.grad for tensor in inputs[1:]]).numpy()
    np.testing.assert_allclose(documents, gradients["docs"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mini_batch_size", [None, 4], ids=["mnrl", "cached4"])
@pytest.mark.parametrize("n_columns", COLUMNS)
@pytest.mark.parametrize("directions, partition_mode", COMBINATIONS)
def test_parity_with_sentence_transformers(tiny_model, directions, partition_mode, n_columns,
                                           mini_batch_size):
    """The same step as MNRL / CachedMNRL (10 rows: mini-batches of 4, 4 and 2 when cached)."""
    columns = text_columns(10, n_columns, seed=len(directions) * 7 + n_columns)
    options = {"directions": directions, "partition_mode": partition_mode}
    reference = st_reference_loss(tiny_model, False, mini_batch_size, **options)
    expected = loss_and_gradients(tiny_model, reference, columns, seed=5)
    ours = losses.InfCLLoss(tiny_model, mini_batch_size=mini_batch_size, **options)
    assert_same_step(expected, loss_and_gradients(tiny_model, ours, columns, seed=5))


def test_joint_call_is_linear_in_the_batch(tiny_model, monkeypatch):
    """Every direction at once is one contrastive_loss call over rows [q_i, d_i] and O(b) keys (the
    blocks of docs/contract.md), with group ids to leave out the self pairs; no b x b tensor."""
    from hf_infcl.loss import contrastive_loss

    seen = []

    def recording_loss(queries, keys, **kwargs):
        seen.append((queries.shape, keys.shape, kwargs.get("query_groups"), kwargs.get("key_groups")))
        return contrastive_loss(queries, keys, **kwargs)

    monkeypatch.setattr(losses, "contrastive_loss", recording_loss)
    batch, width, n_columns = 5, 8, 3  # pairs plus two negatives columns: 15 documents
    embeddings = [torch.randn(batch, width) for _ in range(n_columns)]
    losses.InfCLLoss(tiny_model, directions=GTE).compute_loss_from_embeddings(embeddings)
    (rows, keys, query_groups, key_groups), = seen
    documents = batch * (n_columns - 1)
    assert rows == (batch, 2 * width)
    assert keys == (documents + batch + batch + documents, 2 * width)
    assert query_groups.tolist() == list(range(batch))
    examples = list(range(batch))
    assert key_groups.tolist() == [-1] * documents + examples + [-1] * batch + examples * (n_columns - 1)


# --------------------------------------------------------------------------------------------
# Checks and messages, assignment, config, hardness


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"directions": ()}, id="no-direction"),
        pytest.param({"directions": ("query_to_doc", "doc_to_everything")}, id="unknown-direction"),
        pytest.param({"directions": ("doc_to_query",)}, id="without-query_to_doc"),
        pytest.param({"partition_mode": "both"}, id="unknown-partition_mode"),
        pytest.param({"directions": ("query_to_doc", "query_to_query"), "partition_mode": "per_direction"},
                     id="per_direction-query_to_query"),
        pytest.param({"directions": GTE, "partition_mode": "per_direction", "mini_batch_size": 2},
                     id="cached-per_direction-gte"),
        pytest.param({"hardness_mode": "hardest"}, id="unknown-hardness_mode"),
        pytest.param({"hardness_strength": -1.0}, id="negative-hardness_strength"),
    ],
)
def test_errors_carry_the_words_of_multiple_negatives_ranking_loss(tiny_model, kwargs):
    """Where MNRL / CachedMNRL refuse these options, InfCLLoss raises the same error type with
    their message in its own (so code matching it keeps working), then says more. The sets that
    the messages print are compared as sets: a set's order varies with the interpreter's string
    hashing, from one module to the next (frozenset constants) and from one run to the next."""
    cls = (st_losses.CachedMultipleNegativesRankingLoss if "mini_batch_size" in kwargs
           else st_losses.MultipleNegativesRankingLoss)
    with pytest.raises(Exception) as theirs:
        cls(tiny_model, **kwargs)
    with pytest.raises(Exception) as ours:
        losses.InfCLLoss(tiny_model, **kwargs)
    assert type(ours.value) is type(theirs.value)
    theirs, ours = _sorted_sets(str(theirs.value)), _sorted_sets(str(ours.value))
    assert theirs in ours and len(ours) > len(theirs)


def _sorted_sets(message: str) -> str:
    """``message`` with the items of each printed set (``{'b', 'a'}``) in sorted order."""
    return re.sub(r"\{([^{}]*)\}", lambda match: "{" + ", ".join(sorted(match[1].split(", "))) + "}", message)


def test_directions_as_a_string_is_refused(tiny_model):
    """tuple("query_to_doc") would be its letters: say what to write instead."""
    with pytest.raises(ValueError, match=r"directions must be a tuple .*\('query_to_doc',\)"):
        losses.InfCLLoss(tiny_model, directions="query_to_doc")


@pytest.mark.parametrize("mini_batch_size", [None, 4], ids=["mnrl", "cached4"])
def test_assignment_after_construction_takes_effect(tiny_model, mini_batch_size):
    """MNRL's directions and partition_mode are plain attributes (CachedMNRL delegates them): an
    assignment changes the next step's loss, here too."""
    columns = text_columns(8, 3, seed=61)
    reference = st_reference_loss(tiny_model, False, mini_batch_size)
    ours = losses.InfCLLoss(tiny_model, mini_batch_size=mini_batch_size)
    for directions, partition_mode in [(GTE, "joint"), (("query_to_doc", "doc_to_query"), "per_direction")]:
        for loss in (reference, ours):
            loss.directions = directions
            loss.partition_mode = partition_mode
        assert ours.get_config_dict()["directions"] == reference.get_config_dict()["directions"]
        assert_same_step(loss_and_gradients(tiny_model, reference, columns, seed=2),
                         loss_and_gradients(tiny_model, ours, columns, seed=2))
    assert ours.symmetric  # the last pair is MNSRL's


def test_assignment_is_checked_and_a_refused_one_changes_nothing(tiny_model):
    loss = losses.InfCLLoss(tiny_model, directions=GTE)
    with pytest.raises(ValueError, match="per_direction.*ill-defined"):
        loss.partition_mode = "per_direction"  # with query_to_query: assign directions first
    with pytest.raises(ValueError, match="'query_to_doc' direction is required"):
        loss.directions = ("doc_to_query",)
    assert (loss.directions, loss.partition_mode, loss.symmetric) == (GTE, "joint", False)
    loss.hardness_mode = "hard_negatives"  # no effect (MNRL warns) while the strength is 0
    with pytest.raises(ValueError, match="hardness_strength must be non-negative"):
        loss.hardness_strength = -5.0
    with pytest.raises(ValueError, match="hardness_mode must be one of"):
        loss.hardness_mode = "hardest"
    assert (loss.hardness_mode, loss.hardness_strength) == ("hard_negatives", 0.0)


def test_symmetric_stands_for_the_directions_of_mnsrl(tiny_model):
    mnsrl = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}
    loss = losses.InfCLLoss(tiny_model, symmetric=True)
    assert {key: loss.get_config_dict()[key] for key in mnsrl} == mnsrl
    assert losses.InfCLLoss(tiny_model, **mnsrl).symmetric  # the same loss, spelled out
    assert losses.InfCLLoss(tiny_model, symmetric=True, **mnsrl).symmetric
    loss.symmetric = False  # back to MNRL's defaults
    assert (loss.directions, loss.partition_mode) == (("query_to_doc",), "joint")
    loss.directions = GTE
    loss.symmetric = True
    assert (loss.directions, loss.partition_mode) == (mnsrl["directions"], "per_direction")
    with pytest.raises(ValueError, match="symmetric=True is directions=.*give one or the other"):
        losses.InfCLLoss(tiny_model, symmetric=True, directions=GTE)
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        loss.symmetric = "yes"


@pytest.mark.parametrize("mini_batch_size", [None, 8], ids=["mnrl", "cached8"])
@pytest.mark.parametrize("directions, partition_mode", COMBINATIONS[:4])
def test_config_keys_are_a_superset_of_sentence_transformers(tiny_model, directions, partition_mode,
                                                             mini_batch_size):
    options = {"directions": directions, "partition_mode": partition_mode,
               "hardness_mode": "hard_negatives", "hardness_strength": 0.0}
    expected = st_reference_loss(tiny_model, False, mini_batch_size, **options).get_config_dict()
    config = losses.InfCLLoss(tiny_model, mini_batch_size=mini_batch_size, **options).get_config_dict()
    assert {key: config[key] for key in expected} == expected
    assert {"symmetric", "backend", "precision"} <= config.keys()


# --------------------------------------------------------------------------------------------
# Hardness (MNRL's hardness_mode / hardness_strength)

HARDNESS_MODES = ["in_batch_negatives", "hard_negatives", "all_negatives"]


@pytest.mark.parametrize("hardness_mode", HARDNESS_MODES)
@pytest.mark.parametrize("n_columns", COLUMNS)
@pytest.mark.parametrize("directions, partition_mode", COMBINATIONS)
def test_hardness_matches_the_float64_oracle(tiny_model, directions, partition_mode, n_columns,
                                             hardness_mode):
    """On embeddings (dot products): the loss and the gradient of every embedding, the offset
    added pair by pair in the oracle (never through a gradient), and different from the loss
    without it wherever the mode selects anything."""
    generator = torch.Generator().manual_seed(3 * len(directions) + n_columns)
    embeddings = [torch.randn(6, 5, generator=generator, dtype=torch.float64) for _ in range(n_columns)]
    loss = losses.InfCLLoss(tiny_model, scale=0.7, similarity_fct=util.dot_score, directions=directions,
                            partition_mode=partition_mode, hardness_mode=hardness_mode, hardness_strength=1.3,
                            backend="torch")
    inputs = [embedding.clone().requires_grad_() for embedding in embeddings]
    value = loss.compute_loss_from_embeddings(inputs)
    value.backward()

    numpy_columns = [e.numpy() for e in embeddings[1:]]
    expected, gradients = directions_loss(embeddings[0].numpy(), numpy_columns, 0.7, directions,
                                          partition_mode, hardness_mode, 1.3)
    np.testing.assert_allclose(value.item(), expected, rtol=1e-12)
    np.testing.assert_allclose(inputs[0].grad.numpy(), gradients["queries"], rtol=1e-10, atol=1e-12)
    documents = torch.cat([tensor.grad for tensor in inputs[1:]]).numpy()
    np.testing.assert_allclose(documents, gradients["docs"], rtol=1e-10, atol=1e-12)
    plain, _ = directions_loss(embeddings[0].numpy(), numpy_columns, 0.7, directions, partition_mode)
    selects_nothing = hardness_mode == "hard_negatives" and n_columns == 2  # pairs: no own negatives
    assert (plain == expected) == selects_nothing


@pytest.mark.parametrize("mini_batch_size", [None, 4], ids=["mnrl", "cached4"])
@pytest.mark.parametrize("hardness_mode", HARDNESS_MODES)
@pytest.mark.parametrize("directions, partition_mode", COMBINATIONS)
def test_hardness_parity_with_sentence_transformers(tiny_model, directions, partition_mode, hardness_mode,
                                                    mini_batch_size):
    """The same step as MNRL / CachedMNRL with the hardness weighting, two hard-negative columns
    (10 rows: mini-batches of 4, 4 and 2 when cached)."""
    columns = text_columns(10, 4, seed=len(directions) * 5 + HARDNESS_MODES.index(hardness_mode))
    options = {"directions": directions, "partition_mode": partition_mode, "hardness_mode": hardness_mode,
               "hardness_strength": 5.0}
    reference = st_reference_loss(tiny_model, False, mini_batch_size, **options)
    expected = loss_and_gradients(tiny_model, reference, columns, seed=7)
    ours = losses.InfCLLoss(tiny_model, mini_batch_size=mini_batch_size, **options)
    assert_same_step(expected, loss_and_gradients(tiny_model, ours, columns, seed=7))


@pytest.mark.parametrize("mini_batch_size", [None, 4], ids=["mnrl", "cached4"])
@pytest.mark.parametrize("hardness_mode", HARDNESS_MODES)
def test_hardness_parity_on_pairs(tiny_model, hardness_mode, mini_batch_size):
    """(anchor, positive) pairs: the in-batch negatives are the other examples' positives."""
    columns = text_columns(10, 2, seed=29)
    options = {"hardness_mode": hardness_mode, "hardness_strength": 9.0}
    reference = st_reference_loss(tiny_model, False, mini_batch_size, **options)
    expected = loss_and_gradients(tiny_model, reference, columns, seed=4)
    ours = losses.InfCLLoss(tiny_model, mini_batch_size=mini_batch_size, **options)
    assert_same_step(expected, loss_and_gradients(tiny_model, ours, columns, seed=4))


@pytest.mark.parametrize("mini_batch_size", [None, 4], ids=["mnrl", "cached4"])
def test_hardness_assignment_after_construction_takes_effect(tiny_model, mini_batch_size):
    """MNRL's hardness_mode and hardness_strength are plain attributes (CachedMNRL delegates
    them): ``loss.hardness_strength = 5.0`` changes the next step's loss, here too."""
    columns = text_columns(8, 3, seed=71)
    reference = st_reference_loss(tiny_model, False, mini_batch_size)
    ours = losses.InfCLLoss(tiny_model, mini_batch_size=mini_batch_size)
    settings = [("hard_negatives", 5.0), ("in_batch_negatives", 9.0), (None, 9.0), ("all_negatives", 2.0)]
    for mode, strength in settings:
        for loss in (reference, ours):
            loss.hardness_mode = mode
            loss.hardness_strength = strength
        assert (ours.hardness_mode, ours.hardness_strength) == (mode, strength)
        assert_same_step(loss_and_gradients(tiny_model, reference, columns, seed=3),
                         loss_and_gradients(tiny_model, ours, columns, seed=3))


def test_hardness_mode_without_strength_warns_as_mnrl(tiny_model, caplog):
    """MNRL logs one warning when a mode is set with strength 0 (no effect): the same words here."""
    messages = {}
    for name, cls in (("theirs", st_losses.MultipleNegativesRankingLoss), ("ours", losses.InfCLLoss)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            cls(tiny_model, hardness_mode="hard_negatives")
            cls(tiny_model, hardness_mode="hard_negatives", hardness_strength=5.0)  # no warning
            cls(tiny_model, hardness_strength=5.0)  # no mode: no warning either (and no effect)
        messages[name] = [record.getMessage() for record in caplog.records
                          if record.levelno == logging.WARNING]
    assert len(messages["theirs"]) == 1
    assert messages["ours"] == messages["theirs"]


def test_hardness_strength_of_the_wrong_type_is_refused(tiny_model):
    with pytest.raises(TypeError, match="hardness_strength must be a non-negative float"):
        losses.InfCLLoss(tiny_model, hardness_strength="5")


@pytest.mark.parametrize("options", [{"hardness_strength": 9.0}, {"hardness_mode": "all_negatives"}],
                         ids=["strength-without-mode", "mode-without-strength"])
def test_hardness_settings_without_effect_give_mnrl_loss(tiny_model, options):
    """MNRL applies no hardness weighting unless a mode has a positive strength: these settings are
    its plain loss, which InfCLLoss computes (and reports them as given)."""
    columns = text_columns(6, 3, seed=67)
    reference = st_reference_loss(tiny_model, False, None, **options)
    expected = loss_and_gradients(tiny_model, reference, columns, 3)
    ours = losses.InfCLLoss(tiny_model, **options)
    assert_same_step(expected, loss_and_gradients(tiny_model, ours, columns, 3))
    assert all(ours.get_config_dict()[key] == value for key, value in options.items())


# --------------------------------------------------------------------------------------------
# Two processes (the parity with MNRL's all-gather: SCENARIOS of test_sentence_transformers.py)


def test_two_processes_of_different_sizes_equal_one_process_on_the_concatenated_batch(tmp_path):
    """query_to_query, doc_to_doc and all four directions, joint (and the hardness modes, on
    joint and per_direction sets), over the gloo ring with 3 and 5 examples per rank: the ranks'
    losses add up to the oracle's on the whole batch and each rank's embedding gradients are its
    slice of the oracle's (times the world size: DDP averages them). Group ids (or document
    owners) that collided across ranks would leave out (or offset) another rank's keys and fail
    this."""

    from tests.helpers.sentence_transformers_workers import (
        DIRECTION_SETS,
        DIRECTIONS_SCALE,
        UNEQUAL_ROWS,
        direction_embeddings,
        run_directions_rank,
        spawn_ranks,
    )

    world_size = len(UNEQUAL_ROWS)
    ranks = spawn_ranks(run_directions_rank, world_size, tmp_path, results="directions-rank")
    columns = [column.numpy() for column in direction_embeddings()]
    for name, options in DIRECTION_SETS.items():
        expected, gradients = directions_loss(columns[0], columns[1:], DIRECTIONS_SCALE, **options)
        total = sum(result[name][0].item() for result in ranks) / world_size
        np.testing.assert_allclose(total, expected, rtol=1e-12, err_msg=name)
        documents = gradients["docs"].reshape(len(columns) - 1, sum(UNEQUAL_ROWS), -1)
        expected_slices = [gradients["queries"], *documents]
        for rank, result in enumerate(ranks):
            rows = slice(sum(UNEQUAL_ROWS[:rank]), sum(UNEQUAL_ROWS[:rank + 1]))
            for column, (actual, expected_column) in enumerate(zip(result[name][1], expected_slices)):
                np.testing.assert_allclose(actual.numpy() / world_size, expected_column[rows], rtol=1e-10,
                                           atol=1e-12, err_msg=f"{name}, rank {rank}, column {column}")
