"""The false-negative margin of ``hf_infcl.losses.InfCLLoss`` (``margin`` / ``margin_strategy``).

GIST's rule with the model as its own guide: anchor i's candidate j is left out when its detached
similarity exceeds the positive pair's minus the margin (``"relative"``: minus ``|s_ip| * margin``),
the positive kept. The oracle below builds every direction's similarity matrix in float64, masks
the left-out entries with -inf and takes the cross-entropy; autograd gives its gradients. Checked:
every accepted ``directions`` / ``partition_mode`` on embeddings (both similarities, both
strategies, hardness too), a tiny BERT's loss and every parameter gradient (dropout on, cached and
not, inside MatryoshkaLoss), the same loss as GIST with the model's copy as guide, assignment after
construction, the refusals, and two processes over gloo against the oracle on the whole batch.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sentence_transformers")

from sentence_transformers import util  # noqa: E402
from sentence_transformers.base.losses.gradcache import CachedLossMixin  # noqa: E402
from sentence_transformers.base.losses.merged_forward import embed_columns  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

from hf_infcl import losses  # noqa: E402
from tests.helpers.sentence_transformers_fixtures import (  # noqa: E402
    build_tiny_model_dir,
    load_tiny_model,
    loss_and_gradients,
    text_columns,
)

FLOAT64 = {"rtol": 1e-9, "atol": 1e-12}
Q2D, Q2Q, D2Q, D2D = "query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"
MNSRL = {"directions": (Q2D, D2Q), "partition_mode": "per_direction"}


def filtered_combinations():
    """Every (directions, partition_mode) MNRL accepts but the joint ones with doc_to_query
    (refused with a margin: test_joint_doc_to_query_is_refused)."""
    for count in range(3):
        for extra in itertools.combinations((Q2Q, D2D), count):
            yield pytest.param((Q2D, *extra), "joint", id="+".join(extra or ("q2d",)) + "-joint")
    yield pytest.param((Q2D,), "per_direction", id="q2d-per_direction")
    yield pytest.param((Q2D, D2Q), "per_direction", id="doc_to_query-per_direction")


COMBINATIONS = list(filtered_combinations())


def margin_oracle(embeddings, scale, cos, margin, margin_strategy="absolute", directions=(Q2D,),
                  partition_mode="joint", hardness_mode=None, hardness_strength=0.0):
    """MNRL's loss over ``embeddings`` (anchors, positives, negatives columns), materialised, with
    GIST's filter on the model's own detached similarity (``margin`` None: none)."""
    if cos:
        embeddings = [F.normalize(column, p=2, dim=-1) for column in embeddings]
    anchors, positives = embeddings[0], embeddings[1]
    docs = torch.cat(embeddings[1:])
    batch = len(anchors)
    rows = torch.arange(batch)
    owners = rows.repeat(len(embeddings) - 1)  # each document's example
    positive = (anchors * positives).sum(-1)
    score = positive.detach()
    if margin is None:
        threshold = torch.full_like(score, float("inf"))
    else:
        threshold = score - (score.abs() * margin if margin_strategy == "relative" else margin)

    def logits(rows_, keys, excluded, protected, offset=None):
        similarity = rows_ @ keys.T
        dropped = excluded | ((similarity.detach() > threshold[:, None]) & ~protected)
        logit = scale * similarity + (0.0 if offset is None else offset)
        return logit.masked_fill(dropped, float("-inf"))

    none = torch.zeros(batch, batch, dtype=torch.bool)
    own_docs = owners[None, :] == rows[:, None]
    is_positive = own_docs & (torch.arange(len(docs))[None, :] < batch)  # document i of row i
    offset = None
    if hardness_mode is not None and hardness_strength > 0:
        selected = {"in_batch_negatives": ~own_docs, "hard_negatives": own_docs & ~is_positive,
                    "all_negatives": ~is_positive}[hardness_mode]
        offset = hardness_strength * (anchors @ docs.T).detach() * selected
    blocks = {
        Q2D: logits(anchors, docs, torch.zeros_like(own_docs), is_positive, offset),
        Q2Q: logits(anchors, anchors, torch.eye(batch, dtype=torch.bool), none),
        D2Q: logits(positives, anchors, none, torch.eye(batch, dtype=torch.bool)),
        D2D: logits(positives, docs, own_docs, torch.zeros_like(own_docs)),
    }
    chosen = [blocks[direction] for direction in (Q2D, Q2Q, D2Q, D2D) if direction in directions]
    partitions = [torch.cat(chosen, dim=1)] if partition_mode == "joint" else chosen
    row_lse = sum(torch.logsumexp(block, dim=1) for block in partitions) / len(partitions)
    return (row_lse - scale * positive).mean()


class MaterialisedMarginLoss(CachedLossMixin, torch.nn.Module):
    """``margin_oracle`` as a sentence-transformers loss: the model's columns embedded as MNRL does,
    or with ``mini_batch_size`` through sentence-transformers' own GradCache (dropout replayed)."""

    def __init__(self, model, scale=20.0, similarity_fct=util.cos_sim, mini_batch_size=None, **options):
        super().__init__()
        self.model, self.scale, self.options = model, scale, options
        self.cos = similarity_fct is util.cos_sim
        self.mini_batch_size = mini_batch_size
        self.uses_gradient_cache = mini_batch_size is not None

    def forward(self, sentence_features, labels=None):
        if self.mini_batch_size is not None:
            return self.forward_cached(list(sentence_features), labels)
        return margin_oracle(embed_columns(self.model, list(sentence_features)), self.scale, self.cos,
                             **self.options)

    def calculate_loss(self, reps, labels=None, *, with_backward=False):
        loss = margin_oracle([torch.cat(column) for column in reps], self.scale, self.cos, **self.options)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss


def assert_same_step(expected, actual, tolerance=FLOAT64):
    expected_loss, expected_grads = expected
    actual_loss, actual_grads = actual
    assert actual_loss.dtype == expected_loss.dtype == torch.float64
    torch.testing.assert_close(actual_loss, expected_loss, **tolerance)
    assert actual_grads.keys() == expected_grads.keys() and len(expected_grads) > 0
    for name, expected_grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], expected_grad, **tolerance,
                                   msg=lambda message, n=name: f"{n}: {message}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="module")
def model64(model_dir):
    """A tiny BERT in float64, dropout on (replayed by both losses)."""
    return load_tiny_model(model_dir).double()


def random_embeddings(columns, seed, rows=6, width=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, width, generator=generator, dtype=torch.float64) for _ in range(columns)]


# --------------------------------------------------------------------------------------------
# On embeddings: every partition, both similarities, both strategies

SIMILARITIES = [pytest.param(util.cos_sim, 0.1, id="cos"), pytest.param(util.dot_score, 0.5, id="dot")]
STRATEGIES = [pytest.param("absolute", 1.0, id="absolute"), pytest.param("relative", 0.5, id="relative"),
              pytest.param("absolute", -0.2, id="absolute-negative")]


@pytest.mark.parametrize("n_columns", [2, 3], ids=["pairs", "negatives1"])
@pytest.mark.parametrize("margin_strategy, margin_factor", STRATEGIES)
@pytest.mark.parametrize("similarity_fct, margin", SIMILARITIES)
@pytest.mark.parametrize("directions, partition_mode", COMBINATIONS)
def test_matches_the_materialised_oracle_on_embeddings(directions, partition_mode, similarity_fct, margin,
                                                       margin_strategy, margin_factor, n_columns):
    """The loss and the gradient of every embedding; and the filter left something out."""
    embeddings = random_embeddings(n_columns, seed=len(directions) + 3 * n_columns + int(margin_factor * 10))
    margin = margin * margin_factor
    options = {"directions": directions, "partition_mode": partition_mode}
    loss = losses.InfCLLoss(None, scale=3.0, similarity_fct=similarity_fct, backend="torch",
                            margin_strategy=margin_strategy, margin=margin, **options)
    inputs = [embedding.clone().requires_grad_() for embedding in embeddings]
    value = loss.compute_loss_from_embeddings(inputs)
    actual = torch.autograd.grad(value, inputs)

    references = [embedding.clone().requires_grad_() for embedding in embeddings]
    cos = similarity_fct is util.cos_sim
    expected = margin_oracle(references, 3.0, cos, margin, margin_strategy, **options)
    torch.testing.assert_close(value, expected, **FLOAT64)
    for got, want in zip(actual, torch.autograd.grad(expected, references)):
        torch.testing.assert_close(got, want, **FLOAT64)
    unfiltered = margin_oracle(embeddings, 3.0, cos, None, **options)
    assert not torch.isclose(expected, unfiltered), "the margin filtered nothing"


@pytest.mark.parametrize("hardness_mode", ["in_batch_negatives", "hard_negatives", "all_negatives"])
@pytest.mark.parametrize("directions, partition_mode", [COMBINATIONS[0], COMBINATIONS[3], COMBINATIONS[5]])
def test_with_hardness_the_offset_applies_to_the_candidates_left(directions, partition_mode, hardness_mode):
    """The filter reads the plain similarity; MNRL's hardness offset goes on the negatives it keeps."""
    embeddings = random_embeddings(3, seed=17)
    options = {"directions": directions, "partition_mode": partition_mode, "hardness_mode": hardness_mode,
               "hardness_strength": 2.0}
    loss = losses.InfCLLoss(None, scale=3.0, backend="torch", margin=0.1, **options)
    inputs = [embedding.clone().requires_grad_() for embedding in embeddings]
    value = loss.compute_loss_from_embeddings(inputs)
    references = [embedding.clone().requires_grad_() for embedding in embeddings]
    expected = margin_oracle(references, 3.0, True, 0.1, **options)
    torch.testing.assert_close(value, expected, **FLOAT64)
    for got, want in zip(torch.autograd.grad(value, inputs), torch.autograd.grad(expected, references)):
        torch.testing.assert_close(got, want, **FLOAT64)


# --------------------------------------------------------------------------------------------
# A tiny BERT: the loss and every parameter gradient, dropout on

CACHED = [pytest.param(None, id="plain"), pytest.param(4, id="cached4")]


@pytest.mark.parametrize("mini_batch_size", CACHED)
@pytest.mark.parametrize("margin_strategy, margin", [("absolute", 0.1), ("relative", 0.05)])
def test_model_step_matches_the_oracle(model64, mini_batch_size, margin_strategy, margin):
    """(anchor, positive, negative) triplets, 10 rows: mini-batches of 4, 4 and 2 when cached."""
    columns = text_columns(10, 3, seed=5 + len(margin_strategy))
    options = {"margin_strategy": margin_strategy, "margin": margin}
    expected = loss_and_gradients(model64, MaterialisedMarginLoss(model64, mini_batch_size=mini_batch_size,
                                                                  **options), columns, 7)
    ours = losses.InfCLLoss(model64, mini_batch_size=mini_batch_size, **options)
    assert_same_step(expected, loss_and_gradients(model64, ours, columns, 7))
    unfiltered = loss_and_gradients(model64, MaterialisedMarginLoss(model64, mini_batch_size=mini_batch_size,
                                                                    margin=None), columns, 7)
    assert not torch.isclose(unfiltered[0], expected[0]), "the margin filtered nothing"


@pytest.mark.parametrize("mini_batch_size", CACHED)
@pytest.mark.parametrize("options", [
    pytest.param(MNSRL, id="symmetric"),
    pytest.param({"directions": (Q2D, Q2Q, D2D), "partition_mode": "joint"}, id="q2q+d2d-joint"),
    pytest.param({"hardness_mode": "all_negatives", "hardness_strength": 3.0}, id="hardness"),
])
def test_model_step_with_other_partitions(model64, mini_batch_size, options):
    columns = text_columns(10, 3, seed=23)
    common = {"scale": 10.0, "mini_batch_size": mini_batch_size, "margin": 0.1, **options}
    expected = loss_and_gradients(model64, MaterialisedMarginLoss(model64, **common), columns, 3)
    ours = losses.InfCLLoss(model64, **common)
    assert_same_step(expected, loss_and_gradients(model64, ours, columns, 3))


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_inside_matryoshka_loss(model64, mini_batch_size):
    """MatryoshkaLoss shrinks the embeddings before the filter: each dimension filters its own cosines."""
    columns = text_columns(8, 3, seed=43)
    dims = [32, 16, 8]
    oracle = MaterialisedMarginLoss(model64, mini_batch_size=mini_batch_size, margin=0.1)
    reference = st_losses.MatryoshkaLoss(model64, oracle, matryoshka_dims=dims)
    ours = st_losses.MatryoshkaLoss(
        model64, losses.InfCLLoss(model64, mini_batch_size=mini_batch_size, margin=0.1), matryoshka_dims=dims
    )
    assert_same_step(loss_and_gradients(model64, reference, columns, 13),
                     loss_and_gradients(model64, ours, columns, 13))


@pytest.mark.parametrize("gist", ["InfCLGISTLoss", "GISTEmbedLoss"])
@pytest.mark.parametrize("margin_strategy, margin", [("absolute", 0.1), ("relative", 0.05)])
def test_equals_gist_with_a_copy_of_the_model_as_guide(model_dir, gist, margin_strategy, margin):
    """GIST without its anchor-anchor and positive-positive blocks, guided by the model itself (dropout
    off, so that the copy embeds the same), is InfCLLoss with ``scale = 1 / temperature``."""
    model = load_tiny_model(model_dir).double().eval()
    guide = copy.deepcopy(model).requires_grad_(False)
    gist_class = losses.InfCLGISTLoss if gist == "InfCLGISTLoss" else st_losses.GISTEmbedLoss
    options = {"margin_strategy": margin_strategy, "margin": margin}
    reference = gist_class(model, guide, temperature=0.05, contrast_anchors=False, contrast_positives=False,
                           **options)
    columns = text_columns(8, 3, seed=31)
    expected = loss_and_gradients(model, reference, columns, 0)
    ours = losses.InfCLLoss(model, scale=1 / 0.05, **options)
    assert_same_step(expected, loss_and_gradients(model, ours, columns, 0))
    plain = loss_and_gradients(model, losses.InfCLLoss(model, scale=1 / 0.05), columns, 0)
    assert not torch.isclose(plain[0], expected[0]), "the margin filtered nothing"


# --------------------------------------------------------------------------------------------
# Defaults, assignment, config, refusals


def test_defaults_keep_mnrl_and_the_new_options_come_last():
    parameters = list(inspect.signature(losses.InfCLLoss.__init__).parameters.values())
    # each option added after the margin's comes after it: no positional argument moves
    assert [p.name for p in parameters[-3:]] == ["margin_strategy", "margin", "no_grad_mini_batch_size"]
    assert (parameters[-3].default, parameters[-2].default) == ("absolute", None)
    embeddings = random_embeddings(3, seed=2)
    value = losses.InfCLLoss(None, backend="torch").compute_loss_from_embeddings(embeddings)
    torch.testing.assert_close(value, margin_oracle(embeddings, 20.0, True, None), **FLOAT64)


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_assignment_after_construction_takes_effect(model64, mini_batch_size):
    columns = text_columns(8, 3, seed=61)
    ours = losses.InfCLLoss(model64, mini_batch_size=mini_batch_size)
    settings = [(0.1, "absolute"), (0.05, "relative"), (None, "relative"), (-0.05, "absolute")]
    for margin, margin_strategy in settings:
        ours.margin, ours.margin_strategy = margin, margin_strategy
        config = ours.get_config_dict()
        assert (config["margin"], config["margin_strategy"]) == (margin, margin_strategy)
        reference = MaterialisedMarginLoss(model64, mini_batch_size=mini_batch_size, margin=margin,
                                           margin_strategy=margin_strategy)
        assert_same_step(loss_and_gradients(model64, reference, columns, 3),
                         loss_and_gradients(model64, ours, columns, 3))


def test_config_holds_the_filter():
    config = losses.InfCLLoss(None, margin_strategy="relative", margin=0.05).get_config_dict()
    assert (config["margin_strategy"], config["margin"]) == ("relative", 0.05)
    config = losses.InfCLLoss(None).get_config_dict()
    assert (config["margin_strategy"], config["margin"]) == ("absolute", None)


JOINT_DOC_TO_QUERY = [(Q2D, D2Q), (Q2D, Q2Q, D2Q, D2D)]


@pytest.mark.parametrize("directions", JOINT_DOC_TO_QUERY, ids=["doc_to_query", "all"])
def test_joint_doc_to_query_is_refused(directions):
    """The joint softmax with doc_to_query holds the positive pair twice; its second copy scores exactly
    the positive's score, so the filter could not decide it but by rounding."""
    message = "margin=0.0 is not defined with partition_mode='joint' and 'doc_to_query' in directions"
    with pytest.raises(ValueError, match=message):
        losses.InfCLLoss(None, directions=directions, margin=0.0)
    loss = losses.InfCLLoss(None, directions=directions)  # without a margin: MNRL's loss
    with pytest.raises(ValueError, match=message):
        loss.margin = 0.0
    assert loss.margin is None
    loss = losses.InfCLLoss(None, margin=0.1)
    with pytest.raises(ValueError, match="margin=0.1 is not defined"):
        loss.directions = directions
    loss = losses.InfCLLoss(None, margin=0.1, **MNSRL)
    with pytest.raises(ValueError, match="margin=0.1 is not defined"):
        loss.partition_mode = "joint"
    assert (loss.directions, loss.partition_mode, loss.margin) == ((Q2D, D2Q), "per_direction", 0.1)
    loss.symmetric = False  # MNRL's default partition: fine
    assert loss.margin == 0.1 and loss.directions == (Q2D,)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"margin": float("nan")}, ValueError, "margin must be finite, got nan"),
    ({"margin": float("inf")}, ValueError, "margin must be finite, got inf"),
    ({"margin": "0.1"}, TypeError, "margin must be a finite float or None, got str"),
    ({"margin": True}, TypeError, "margin must be a finite float or None, got bool"),
    ({"margin_strategy": "proportional"}, ValueError,
     "margin_strategy must be one of 'absolute', 'relative'; got 'proportional'"),
])
def test_bad_margins_are_refused_at_construction_and_assignment(kwargs, error, match):
    with pytest.raises(error, match=match):
        losses.InfCLLoss(None, **kwargs)
    loss = losses.InfCLLoss(None, margin=0.1)
    (name, value), = kwargs.items()
    with pytest.raises(error, match=match):
        setattr(loss, name, value)
    assert (loss.margin, loss.margin_strategy) == (0.1, "absolute")


# --------------------------------------------------------------------------------------------
# Two processes over gloo: the ranks' losses and gradients are the oracle's on the whole batch

RING_SETS = {
    "negatives-absolute": {"margin": 0.1},
    "mnsrl-relative": {"margin": 0.05, "margin_strategy": "relative", **MNSRL},
    "q2q+d2d": {"margin": 0.1, "directions": (Q2D, Q2Q, D2D)},
    "in_batch_hardness": {"margin": 0.2, "hardness_mode": "in_batch_negatives", "hardness_strength": 2.0},
}
UNEQUAL_ROWS = (3, 5)


def ring_embeddings():
    return random_embeddings(3, seed=16, rows=sum(UNEQUAL_ROWS), width=6)


def run_margin_rank(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    from tests.helpers.sentence_transformers_workers import rank_process

    with rank_process(rank, world_size, init_file, Path(out_dir) / f"margin-rank{rank}.pt") as results:
        start = sum(UNEQUAL_ROWS[:rank])
        local = [column[start:start + UNEQUAL_ROWS[rank]].requires_grad_() for column in ring_embeddings()]
        for name, options in RING_SETS.items():
            loss = losses.InfCLLoss(None, scale=3.0, gather_across_devices=True, backend="torch", **options)
            value = loss.compute_loss_from_embeddings(local)
            results[name] = (value.detach(), torch.autograd.grad(value, local))


def test_two_processes_of_different_sizes_equal_the_oracle_on_the_whole_batch(tmp_path):
    from tests.helpers.sentence_transformers_workers import spawn_ranks

    world_size = len(UNEQUAL_ROWS)
    ranks = spawn_ranks(run_margin_rank, world_size, tmp_path, results="margin-rank")
    for name, options in RING_SETS.items():
        embeddings = [column.requires_grad_() for column in ring_embeddings()]
        expected = margin_oracle(embeddings, 3.0, True, **options)
        gradients = torch.autograd.grad(expected, embeddings)
        total = sum(result[name][0] for result in ranks) / world_size
        torch.testing.assert_close(total, expected.detach(), **FLOAT64, msg=name)
        for rank, result in enumerate(ranks):
            rows = slice(sum(UNEQUAL_ROWS[:rank]), sum(UNEQUAL_ROWS[:rank + 1]))
            for column, (actual, want) in enumerate(zip(result[name][1], gradients)):
                # DDP averages the ranks' gradients: each rank's is world_size times its share
                torch.testing.assert_close(actual / world_size, want[rows], **FLOAT64,
                                           msg=f"{name}, rank {rank}, column {column}")


# --------------------------------------------------------------------------------------------
# CUDA: the default route (Triton when it imports)


def threshold_gap(embeddings, margin):
    """The smallest distance of any cosine of any direction from its row's absolute threshold."""
    anchors, positives = (F.normalize(column, p=2, dim=-1) for column in embeddings[:2])
    docs = torch.cat([F.normalize(column, p=2, dim=-1) for column in embeddings[1:]])
    threshold = (anchors * positives).sum(-1, keepdim=True) - margin
    scores = torch.cat([anchors @ docs.T, anchors @ anchors.T, positives @ anchors.T, positives @ docs.T], 1)
    return (scores - threshold).abs().min().item()


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    pytest.param({}, id="q2d"), pytest.param(MNSRL, id="symmetric"),
    pytest.param({"directions": (Q2D, Q2Q, D2D)}, id="q2q+d2d-joint"),
])
def test_on_cuda_through_the_default_route(options):
    """fp32 embeddings on CUDA, exact fp32 products, against the float64 oracle on the same (rounded)
    embeddings; drawn so that no score lies within 1e-5 of its threshold, where rounding could decide."""
    for seed in range(100):
        embeddings = [column.float().double() for column in random_embeddings(3, seed, rows=64, width=32)]
        if threshold_gap(embeddings, 0.1) > 1e-5:
            break
    else:
        raise AssertionError("no seed keeps every score 1e-5 from its threshold")
    loss = losses.InfCLLoss(None, scale=20.0, precision="ieee", margin=0.1, **options)
    inputs = [column.float().cuda().requires_grad_() for column in embeddings]
    value = loss.compute_loss_from_embeddings(inputs)
    actual = torch.autograd.grad(value, inputs)
    references = [column.clone().requires_grad_() for column in embeddings]
    expected = margin_oracle(references, 20.0, True, 0.1, **options)
    torch.testing.assert_close(value.double().cpu(), expected.detach(), rtol=1e-4, atol=1e-5)
    for got, want in zip(actual, torch.autograd.grad(expected, references)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5)
