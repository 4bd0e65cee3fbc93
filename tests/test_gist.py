"""``hf_infcl.losses.InfCLGISTLoss`` against sentence-transformers' GISTEmbedLoss and
CachedGISTEmbedLoss, offline, on CPU.

Parity: a tiny BERT (dropout on, replayed by both) trained under a frozen tiny guide (eval mode,
other weights); the same seed before each loss; the loss value and every parameter gradient must
equal theirs, for every option GIST has (``gather_across_devices`` over two gloo processes too),
in float64 (the same function, to rounding) and in fp32 (1e-5), at GIST's default temperature 0.01
too, where the logits are about 100: that needs the tiled backend's log-sum-exps kept finer than
fp32 (an fp32 one near 100 is off by up to 4e-6 and scales its whole row's probabilities).
Then their checks, config and citation.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

from hf_infcl import losses  # noqa: E402
from tests.helpers.sentence_transformers_fixtures import (  # noqa: E402
    SPECIAL_TOKENS,
    WORDS,
    build_tiny_model_dir,
    load_tiny_model,
    loss_and_gradients,
    replay_tolerance,
    text_columns,
)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32
FLOAT64 = {"rtol": 1e-9, "atol": 1e-12}
ROWS = 8


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return (build_tiny_model_dir(tmp_path_factory.mktemp("model")),
            build_tiny_model_dir(tmp_path_factory.mktemp("guide"), seed=1))


@pytest.fixture(scope="module")
def tiny_model(model_dirs):
    return load_tiny_model(model_dirs[0])


@pytest.fixture(scope="module")
def guide(model_dirs):
    """The same tokenizer, other weights, frozen and in eval mode (as a loaded guide is)."""
    return load_tiny_model(model_dirs[1]).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model64(model_dirs):
    return load_tiny_model(model_dirs[0]).double()


@pytest.fixture(scope="module")
def guide64(model_dirs):
    return load_tiny_model(model_dirs[1]).double().eval().requires_grad_(False)


@pytest.fixture(scope="module")
def retokenizing_guide(tmp_path_factory):
    """A guide whose vocabulary numbers the words differently: the texts must be re-tokenised."""
    from transformers import BertTokenizerFast

    folder = build_tiny_model_dir(tmp_path_factory.mktemp("other_vocab"), seed=2)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS[::-1])}
    BertTokenizerFast(vocab=vocab).save_pretrained(folder)
    return load_tiny_model(folder).double().eval().requires_grad_(False)


def theirs(model, guide, mini_batch_size, **options):
    if mini_batch_size is None:
        return st_losses.GISTEmbedLoss(model, guide, **options)
    return st_losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=mini_batch_size, **options)


def assert_same_step(expected, actual, tolerance=None):
    tolerance = tolerance or (replay_tolerance(FLOAT64) if expected[0].dtype == torch.float64 else TOLERANCE)
    expected_loss, expected_grads = expected
    actual_loss, actual_grads = actual
    assert actual_loss.dtype == expected_loss.dtype
    torch.testing.assert_close(actual_loss, expected_loss, **tolerance)
    assert actual_grads.keys() == expected_grads.keys() and len(expected_grads) > 0
    for name, expected_grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], expected_grad, **tolerance,
                                   msg=lambda message, n=name: f"{n}: {message}")


def assert_parity(model, guide, columns, mini_batch_size, seed=7, tolerance=None, **options):
    """Ours equals theirs, and their filter removed something (the guide mattered)."""
    expected = loss_and_gradients(model, theirs(model, guide, mini_batch_size, **options), columns, seed)
    actual = loss_and_gradients(model, losses.InfCLGISTLoss(model, guide, mini_batch_size=mini_batch_size,
                                                            **options), columns, seed)
    assert_same_step(expected, actual, tolerance)
    unfiltered = {**options, "margin": -10.0, "margin_strategy": "absolute"}
    plain = loss_and_gradients(model, theirs(model, guide, mini_batch_size, **unfiltered), columns, seed)
    assert not torch.allclose(plain[0], expected[0], **TOLERANCE), "the margin filtered nothing"


CACHED = [pytest.param(None, id="GISTEmbedLoss"), pytest.param(4, id="CachedGISTEmbedLoss")]


@pytest.mark.parametrize("mini_batch_size", CACHED)
@pytest.mark.parametrize("negative_columns", [0, 1])
@pytest.mark.parametrize("margin_strategy, margin", [("absolute", 0.1), ("relative", 0.05)])
def test_parity(model64, guide64, mini_batch_size, negative_columns, margin_strategy, margin):
    columns = text_columns(ROWS, 2 + negative_columns, seed=11 + negative_columns)
    assert_parity(model64, guide64, columns, mini_batch_size, margin_strategy=margin_strategy, margin=margin)


@pytest.mark.parametrize("mini_batch_size", CACHED)
@pytest.mark.parametrize("temperature", [0.05, 0.01], ids=["temperature0.05", "temperature0.01"])
def test_parity_in_fp32(tiny_model, guide, mini_batch_size, temperature):
    columns = text_columns(ROWS, 3, seed=13)
    assert_parity(tiny_model, guide, columns, mini_batch_size, margin=0.1, temperature=temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.01], ids=["temperature1", "temperature0.01"])
def test_parity_at_any_temperature_the_positive_rows_decoys_weigh_nothing(model64, guide64, temperature):
    """The positive rows' call carries a decoy positive whose logit sits a fixed gap (41 in
    float64) below the anchor-positive logit at every temperature (docs/contract.md, "GIST", the
    two-call form): at temperature 1 a fixed multiple of the scale would sit within a few logits
    of the cosines and show in the loss."""
    columns = text_columns(ROWS, 2, seed=17)
    assert_parity(model64, guide64, columns, None, margin=0.1, temperature=temperature)


def test_bf16_embeddings_give_the_float64_oracle_of_the_same_values(tiny_model, guide):
    """bf16 embeddings (the positive rows' decoys d_i = a_i - (gap / s) p_i then rounded to bf16,
    docs/contract.md, "GIST", the two-call form) give GIST's loss and gradients, by the contract's
    float64 oracle on the same values, to bf16's accuracy."""
    from tests.helpers.oracle_objectives import gist_loss

    gen = torch.Generator().manual_seed(21)
    anchors, positives, guide_anchors, guide_positives = (torch.randn(48, 40, generator=gen).bfloat16()
                                                          for _ in range(4))
    positives, guide_positives = positives + 0.7 * anchors, guide_positives + 0.7 * guide_anchors
    ours = [column.clone().requires_grad_() for column in (anchors, positives)]
    loss = losses.InfCLGISTLoss(tiny_model, guide, margin=0.1, temperature=0.05)
    value = loss.compute_loss_from_embeddings(ours, [guide_anchors, guide_positives])
    value.backward()
    theirs = [column.double().requires_grad_() for column in (anchors, positives)]
    expected = gist_loss(*theirs, [], guide_anchors.double(), guide_positives.double(), [], temperature=0.05,
                         margin=0.1)
    expected.backward()
    assert abs(value.double() - expected) <= 1e-2 * abs(expected)
    for column, reference in zip(ours, theirs):
        assert (column.grad.double() - reference.grad).norm() <= 2e-2 * reference.grad.norm()


def test_the_normalisation_keeping_its_output_equals_f_normalize():
    """GIST's keys are normalised by a Function whose backward keeps the output, not the input:
    forward bit for bit F.normalize's, backward F.normalize's to float64 rounding, rows whose
    norm is clamped (a zero row, a tiny one) included."""
    from hf_infcl.losses import _NormalizedRows

    rows = torch.randn(9, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rows[2] = 0.0
    rows[5] *= 1e-14  # norm below F.normalize's eps
    grad = torch.randn(9, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ours, theirs = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    normalized = _NormalizedRows.apply(ours)
    assert torch.equal(normalized, torch.nn.functional.normalize(theirs, p=2, dim=-1))
    normalized.backward(grad)
    torch.nn.functional.normalize(theirs, p=2, dim=-1).backward(grad)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(_NormalizedRows.apply, (rows[[0, 1, 3]].clone().requires_grad_(),))


CONTRASTS = list(itertools.product([True, False], repeat=2))


@pytest.mark.parametrize("mini_batch_size", CACHED)
@pytest.mark.parametrize("contrast_anchors, contrast_positives", CONTRASTS)
def test_parity_of_the_contrast_flags(model64, guide64, mini_batch_size, contrast_anchors,
                                      contrast_positives):
    columns = text_columns(ROWS, 3, seed=21)
    assert_parity(model64, guide64, columns, mini_batch_size, margin=0.1,
                  contrast_anchors=contrast_anchors, contrast_positives=contrast_positives)


def test_cached_parity_with_two_negatives_columns_and_uneven_mini_batches(model64, guide64):
    columns = text_columns(ROWS, 4, seed=31)
    assert_parity(model64, guide64, columns, 3, margin=0.1)


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_parity_with_a_guide_of_another_tokenizer(model64, retokenizing_guide, mini_batch_size):
    import sentence_transformers
    from packaging.version import Version

    if mini_batch_size is not None and Version(sentence_transformers.__version__) < Version("6.2"):
        pytest.skip("CachedGISTEmbedLoss of sentence-transformers before 6.2 fails on a guide with another "
                    "tokenizer ('str' object has no attribute 'to'): no reference to compare with")
    loss = losses.InfCLGISTLoss(model64, retokenizing_guide)
    assert loss.must_retokenize and not losses.InfCLGISTLoss(model64, model64).must_retokenize
    columns = text_columns(ROWS, 3, seed=41)
    assert_parity(model64, retokenizing_guide, columns, mini_batch_size, margin=0.1)


def test_a_guide_with_shorter_texts_retokenises(tiny_model, tmp_path):
    short = load_tiny_model(build_tiny_model_dir(tmp_path, seed=3)).eval()
    short.max_seq_length = 16
    assert losses.InfCLGISTLoss(tiny_model, short).must_retokenize
    assert theirs(tiny_model, short, None).must_retokenize


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_inside_matryoshka_loss(model64, guide64, mini_batch_size):
    columns = text_columns(ROWS, 3, seed=51)
    dims = [32, 16, 8]
    reference = st_losses.MatryoshkaLoss(model64, theirs(model64, guide64, mini_batch_size, margin=0.1),
                                         matryoshka_dims=dims)
    ours = st_losses.MatryoshkaLoss(
        model64, losses.InfCLGISTLoss(model64, guide64, mini_batch_size=mini_batch_size, margin=0.1),
        matryoshka_dims=dims,
    )
    assert_same_step(loss_and_gradients(model64, reference, columns, 5),
                     loss_and_gradients(model64, ours, columns, 5))


ASSIGNED = {"margin": 0.2, "margin_strategy": "relative", "temperature": 0.05, "contrast_anchors": False,
            "contrast_positives": False}


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_hyperparameters_assigned_after_construction_take_effect(model64, guide64, mini_batch_size):
    columns = text_columns(ROWS, 3, seed=61)
    reference = theirs(model64, guide64, mini_batch_size)
    ours = losses.InfCLGISTLoss(model64, guide64, mini_batch_size=mini_batch_size)
    before = loss_and_gradients(model64, ours, columns, 3)
    for name, value in ASSIGNED.items():
        setattr(reference, name, value)
        setattr(ours, name, value)
    expected = loss_and_gradients(model64, reference, columns, 3)
    assert_same_step(expected, loss_and_gradients(model64, ours, columns, 3))
    assert not torch.allclose(before[0], expected[0], **TOLERANCE)
    if mini_batch_size is not None:  # and the mini-batch size: 8 rows in mini-batches of 3
        reference.mini_batch_size = ours.mini_batch_size = 3
        assert_same_step(loss_and_gradients(model64, reference, columns, 3),
                         loss_and_gradients(model64, ours, columns, 3))


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_evaluation_without_gradients(model64, guide64, mini_batch_size):
    from tests.helpers.sentence_transformers_fixtures import features

    columns = text_columns(ROWS, 2, seed=71)
    values = []
    for loss in (theirs(model64, guide64, mini_batch_size, margin=0.1),
                 losses.InfCLGISTLoss(model64, guide64, mini_batch_size=mini_batch_size, margin=0.1)):
        torch.manual_seed(0)
        with torch.no_grad():
            values.append(loss(features(model64, columns), None))
    assert not values[1].requires_grad
    torch.testing.assert_close(values[1], values[0], **TOLERANCE)


def test_the_guide_gets_no_gradient(tiny_model, tmp_path):
    trainable_guide = load_tiny_model(build_tiny_model_dir(tmp_path, seed=4))
    for mini_batch_size in (None, 4):
        loss_and_gradients(tiny_model, losses.InfCLGISTLoss(tiny_model, trainable_guide,
                                                            mini_batch_size=mini_batch_size),
                           text_columns(ROWS, 2, seed=81), 1)
        assert all(p.grad is None for p in trainable_guide.parameters())


def test_the_guide_follows_the_features_to_their_device(tiny_model, model_dirs):
    """The Trainer moves the loss (the guide inside it) to the model's device when it is built, which
    under FSDP2 and DeepSpeed is still the CPU: the guide moves to the features' device when it
    embeds them (here ``meta``, the one other device a CPU has)."""
    guide_model = load_tiny_model(model_dirs[1]).eval().requires_grad_(False)
    loss = losses.InfCLGISTLoss(tiny_model, guide_model)
    loss._follow_features({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    assert guide_model.device.type == "cpu"
    loss._follow_features({"input_ids": torch.zeros(2, 3, dtype=torch.long, device="meta")})
    assert {p.device.type for p in guide_model.parameters()} == {"meta"}


# --------------------------------------------------------------------------------------------
# Their defaults, config, citation and errors


def test_defaults_are_theirs(tiny_model, guide):
    import inspect

    ours = inspect.signature(losses.InfCLGISTLoss).parameters
    for cls in (st_losses.GISTEmbedLoss, st_losses.CachedGISTEmbedLoss):
        for name, parameter in inspect.signature(cls).parameters.items():
            if name != "mini_batch_size":  # None: GISTEmbedLoss; an integer: the cached one
                assert ours[name].default == parameter.default, name
    assert ours["mini_batch_size"].default is None


def test_their_positional_arguments_mean_the_same_here():
    """CachedGISTEmbedLoss's parameters, in their order, begin ours: a positional call means the
    same; what we add comes after them."""
    import inspect

    theirs = list(inspect.signature(st_losses.CachedGISTEmbedLoss).parameters)
    ours = list(inspect.signature(losses.InfCLGISTLoss).parameters)
    assert ours[:len(theirs)] == theirs, (ours, theirs)


@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_config_dict_and_citation_are_theirs(tiny_model, guide, mini_batch_size):
    options = dict(temperature=0.02, margin_strategy="relative", margin=0.05, contrast_anchors=False)
    reference = theirs(tiny_model, guide, mini_batch_size, **options)
    ours = losses.InfCLGISTLoss(tiny_model, guide, mini_batch_size=mini_batch_size, **options)
    expected, actual = reference.get_config_dict(), ours.get_config_dict()
    assert expected.keys() <= actual.keys()
    assert {key: actual[key] for key in expected} == expected
    assert ours.citation == st_losses.GISTEmbedLoss.citation.fget(reference)
    assert ours.uses_gradient_cache == (mini_batch_size is not None)


def test_backend_and_precision_are_checked_and_passed_on(tiny_model, guide, model64, guide64):
    with pytest.raises(ValueError, match="precision"):
        losses.InfCLGISTLoss(tiny_model, guide, precision="fp8")
    with pytest.raises(ValueError, match="backend"):
        losses.InfCLGISTLoss(tiny_model, guide, backend="cuda-graphs")
    columns = text_columns(ROWS, 2, seed=94)
    expected = loss_and_gradients(model64, losses.InfCLGISTLoss(model64, guide64, margin=0.1), columns, 5)
    exact = losses.InfCLGISTLoss(model64, guide64, margin=0.1, backend="reference", precision="ieee")
    actual = loss_and_gradients(model64, exact, columns, 5)
    assert_same_step(expected, actual)
    config = losses.InfCLGISTLoss(tiny_model, guide, precision="ieee").get_config_dict()
    assert (config["backend"], config["precision"]) == ("auto", "ieee")


def test_their_errors_with_their_words(tiny_model, guide):
    for kwargs in ({"margin_strategy": "cosine"}, {"mini_batch_size": 4, "margin_strategy": "cosine"}):
        with pytest.raises(ValueError, match="margin_strategy must be 'absolute' or 'relative'."):
            losses.InfCLGISTLoss(tiny_model, guide, **kwargs)
    with pytest.raises(ValueError, match="mini_batch_num_tokens must be a positive integer or None."):
        losses.InfCLGISTLoss(tiny_model, guide, mini_batch_num_tokens=0)

    class NoTokenizer(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="must have a tokenizer attribute"):
        losses.InfCLGISTLoss(tiny_model, NoTokenizer())
    with pytest.raises(ValueError, match="Expected 2 or 3 embeddings, got 4"):
        losses.InfCLGISTLoss(tiny_model, guide)(
            [dict(tiny_model.tokenize(column)) for column in text_columns(4, 4, seed=1)], None)


def test_static_embedding_is_refused_as_they_refuse_it(guide):
    import re

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import StaticEmbedding
    from transformers import BertTokenizerFast

    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(SPECIAL_TOKENS + ["alpha"])})
    model = SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=8)], device="cpu")
    for mini_batch_size in (None, 4):
        with pytest.raises(ValueError) as their_error:
            theirs(model, guide, mini_batch_size)
        with pytest.raises(ValueError, match=re.escape(str(their_error.value))):
            losses.InfCLGISTLoss(model, guide, mini_batch_size=mini_batch_size)


def test_two_processes_match_gist_gathered_across_devices(model_dirs, tmp_path):
    """gather_across_devices=True over gloo: each rank's loss and gradients equal GIST's all-gather
    (float64), the anchor-anchor block staying local."""
    from tests.helpers.gist_workers import GIST_SCENARIOS, run_gist_rank
    from tests.helpers.sentence_transformers_workers import spawn_ranks

    ranks = spawn_ranks(run_gist_rank, 2, tmp_path, *model_dirs)
    assert all(results.keys() == GIST_SCENARIOS.keys() for results in ranks)
    for (rank, results), name in itertools.product(enumerate(ranks), GIST_SCENARIOS):
        step = results[name]
        try:
            assert_same_step(step["sentence_transformers"], step["infcl"])
        except AssertionError as error:
            raise AssertionError(f"rank {rank}, scenario {name}: {error}") from None


def test_gather_across_devices_in_one_process_is_the_local_loss(model64, guide64):
    columns = text_columns(ROWS, 3, seed=23)
    assert_parity(model64, guide64, columns, None, margin=0.1, gather_across_devices=True)


def cuda_step(model, loss_module, columns, seed: int):
    """``loss_and_gradients`` with the features on the model's GPU (the Trainer moves them there)."""
    from sentence_transformers.util import batch_to_device

    from tests.helpers.sentence_transformers_fixtures import features

    model.zero_grad(set_to_none=True)
    batch = [batch_to_device(column, model.device) for column in features(model, columns)]
    torch.manual_seed(seed)
    loss = loss_module(batch, None)
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.gpu
@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_on_cuda_through_the_default_route(model_dirs, mini_batch_size):
    """On CUDA the default route (Triton when it imports; TF32 products) trains and stays close to
    GIST's fp32 loss on the same GPU (normwise: TF32 may flip a guide decision at the threshold)."""
    model = load_tiny_model(model_dirs[0]).cuda()
    guide_model = load_tiny_model(model_dirs[1]).cuda().eval().requires_grad_(False)
    columns = text_columns(ROWS, 3, seed=91)
    options = dict(mini_batch_size=mini_batch_size, margin=0.1, temperature=0.05)
    expected = cuda_step(model, theirs(model, guide_model, **options), columns, 2)
    actual = cuda_step(model, losses.InfCLGISTLoss(model, guide_model, **options), columns, 2)
    assert actual[0].device.type == "cuda"
    torch.testing.assert_close(actual[0], expected[0], rtol=2e-2, atol=2e-2)
    assert actual[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        assert torch.isfinite(actual[1][name]).all(), name
        assert (actual[1][name] - grad).norm() <= 5e-2 * grad.norm() + 1e-6, name


@pytest.mark.gpu
@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_on_cuda_in_exact_fp32_equals_gist(model_dirs, mini_batch_size):
    """``precision="ieee"`` multiplies fp32 embeddings exactly, as GIST's matmul does on CUDA: the
    same loss and gradients at fp32's tolerance, the guide's decisions the same."""
    model = load_tiny_model(model_dirs[0]).cuda()
    guide_model = load_tiny_model(model_dirs[1]).cuda().eval().requires_grad_(False)
    columns = text_columns(ROWS, 3, seed=93)
    options = dict(mini_batch_size=mini_batch_size, margin=0.1, temperature=0.05)
    expected = cuda_step(model, theirs(model, guide_model, **options), columns, 4)
    exact = losses.InfCLGISTLoss(model, guide_model, precision="ieee", **options)
    actual = cuda_step(model, exact, columns, 4)
    assert_same_step(expected, actual, {"rtol": 1e-4, "atol": 1e-5})


@pytest.mark.gpu
@pytest.mark.parametrize("mini_batch_size", CACHED)
def test_a_guide_left_on_the_cpu_follows_the_model_to_cuda(model_dirs, mini_batch_size):
    """A guide still on the CPU (where FSDP2 and DeepSpeed leave the loss) embeds on the features'
    GPU, with the same loss and gradients as a guide put there by hand."""
    model = load_tiny_model(model_dirs[0]).cuda()
    columns = text_columns(ROWS, 3, seed=92)
    options = dict(mini_batch_size=mini_batch_size, margin=0.1, temperature=0.05)
    on_gpu = load_tiny_model(model_dirs[1]).cuda().eval().requires_grad_(False)
    expected = cuda_step(model, losses.InfCLGISTLoss(model, on_gpu, **options), columns, 3)
    on_cpu = load_tiny_model(model_dirs[1]).eval().requires_grad_(False)
    actual = cuda_step(model, losses.InfCLGISTLoss(model, on_cpu, **options), columns, 3)
    assert on_cpu.device.type == "cuda"
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-4, atol=1e-5)
    for name, grad in expected[1].items():
        torch.testing.assert_close(actual[1][name], grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda message, n=name: f"{n}: {message}")
