"""Matryoshka in one call (docs/contract.md, "Matryoshka in one call"): ``contrastive_loss(...,
matryoshka_dims=..., matryoshka_weights=...)`` is the weighted sum of the loss on each re-normalised
prefix. The float64 oracle of tests/helpers/oracle_matryoshka.py (the one-pass form) is checked
against finite differences and against the sum of per-prefix losses of the reference backend; every
backend against it on fresh random inputs over the loss kinds and options (value and the gradients
of queries, keys, the scale and the bias); one dim equal to the width is the plain loss on
normalised features; the weights scale each term; ``torch.compile(fullgraph=True)`` gives eager's
numbers; bad input raises before any kernel; two gloo processes with uneven rows equal
one process on the concatenated batch, and ranks that disagree on the dims all raise;
sentence-transformers' ``MatryoshkaLoss`` around our loss or MNRL gives the same loss.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_infcl import TorchTiles, contrastive_loss
from tests.helpers import matryoshka_ring_workers as ring_workers
from tests.helpers.oracle import central_differences
from tests.helpers.oracle_matryoshka import matryoshka_loss
from tests.test_ring import assert_same_error_everywhere

# Small tiles, so that every statistic is merged across tiles in both directions.
SMALL_TILES = TorchTiles(tile_rows=3, tile_keys=4)
BACKENDS = {"reference": "reference", "torch": SMALL_TILES, "torch-named": "torch"}
# name: (m, k, c, dims, weights, positives permuted): the second has hard-negative keys (k > m),
# a first dim below c and a prefix of width 1
SHAPES = {
    "m6-k6-c12-d12.7.3": (6, 6, 12, (12, 7, 3), None, False),
    "m5-k9-c16-d13.8.4.1-weighted": (5, 9, 16, (13, 8, 4, 1), (0.5, 1.0, 2.0, 0.25), True),
}
# name: the options of every term (tensors made per case by ``with_options``)
OPTIONS = {
    "softmax-sym": dict(),
    "softmax-asym": dict(symmetric=False),
    "sigmoid-bias": dict(loss="sigmoid", bias=-1.5),
    "hardness": dict(symmetric=False, hardness_mode="in_batch_negatives", hardness_strength=0.4),
    "groups-masked": dict(groups=True),
    "groups-any": dict(groups=True, group_positives="any"),
    "groups-each-asym": dict(groups=True, group_positives="each", symmetric=False),
    "filter": dict(false_negative_margin=0.05),
    "filter-guide-relative": dict(symmetric=False, false_negative_margin=0.1,
                                  false_negative_strategy="relative", guide=True),
    "label-smoothing": dict(label_smoothing=0.1),
}
REDUCTIONS = ("mean", "sum", "none")


def make_case(m, k, c, dims, weights, permuted, *, seed, affinity=0.3):
    """Fresh random float64 features (not normalised: the loss normalises each prefix), each
    positive nearer its row than chance (``affinity`` of the row added), a scale of a few units,
    and the positives."""
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(m, c, generator=gen, dtype=torch.float64) * 2.0
    keys = torch.randn(k, c, generator=gen, dtype=torch.float64)
    positives = torch.randperm(k, generator=gen)[:m] if permuted else None
    keys[torch.arange(m) if positives is None else positives] += affinity * queries
    scale = float(torch.empty(()).uniform_(3.0, 8.0, generator=gen))
    return dict(queries=queries, keys=keys, positives=positives, scale=scale, dims=dims, weights=weights,
                options={}, bias=None, seed=seed)


def with_options(case, options):
    """``case`` with the options of one OPTIONS entry, its tensors drawn fresh: group ids (each
    positive in its row's group, other keys in random groups, some no row has), the hardness ids,
    a guide of its own width."""
    options = dict(options)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    m, k = case["queries"].shape[0], case["keys"].shape[0]
    positives = torch.arange(m) if case["positives"] is None else case["positives"]
    if options.pop("groups", False):
        query_groups = torch.randint(0, max(m // 2, 1), (m,), generator=gen)
        key_groups = torch.randint(0, m, (k,), generator=gen)
        key_groups[positives] = query_groups
        options.update(query_groups=query_groups, key_groups=key_groups)
    if options.get("hardness_mode") is not None:
        owners = torch.randint(-1, m + 2, (k,), generator=gen)
        owners[positives] = torch.arange(m)
        options.update(query_ids=torch.arange(m), key_owners=owners)
    if options.pop("guide", False):
        guide_queries = torch.randn(m, 5, generator=gen, dtype=torch.float64)
        guide_keys = torch.randn(k, 5, generator=gen, dtype=torch.float64)
        guide_keys[positives] += guide_queries
        options.update(guide_queries=guide_queries, guide_keys=guide_keys)
    bias = options.pop("bias", None)
    return dict(case, options=options, bias=bias)


def run_loss(case, dtype=torch.float64, reduction="mean", **extra):
    """Value and gradients (of the sum for "none") of queries, keys, the scale and the bias, as
    float64 NumPy."""
    queries = case["queries"].to(dtype, copy=True).requires_grad_()
    keys = case["keys"].to(dtype, copy=True).requires_grad_()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scale = torch.tensor(case["scale"], dtype=acc, requires_grad=True)
    bias = None if case["bias"] is None else torch.tensor(case["bias"], dtype=acc, requires_grad=True)
    options = {name: value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value
               for name, value in case["options"].items()}
    value = contrastive_loss(queries, keys, scale, bias, positives=case["positives"], reduction=reduction,
                             matryoshka_dims=case["dims"], matryoshka_weights=case["weights"], **options,
                             **extra)
    value.sum().backward()
    grads = {"queries": queries.grad, "keys": keys.grad, "scale": scale.grad}
    if bias is not None:
        grads["bias"] = bias.grad
    grads = {name: g.double().cpu().numpy() for name, g in grads.items()}
    return value.detach().double().cpu().numpy(), grads


def oracle(case, reduction="mean"):
    options = {name: value.numpy() if torch.is_tensor(value) else value
               for name, value in case["options"].items()}
    positives = None if case["positives"] is None else case["positives"].numpy()
    return matryoshka_loss(case["queries"].numpy(), case["keys"].numpy(), case["scale"], case["bias"],
                           dims=case["dims"], weights=case["weights"], reduction=reduction,
                           positives=positives, **options)


def rounded_to(case, dtype):
    """``case`` with its floating-point tensors (the guide's too) rounded to ``dtype``, held in float64:
    what the oracle must see to be compared with a loss computed in ``dtype``."""
    def rounded(value):
        return value.to(dtype).double() if torch.is_tensor(value) and value.is_floating_point() else value

    return dict({name: rounded(value) for name, value in case.items()},
                options={name: rounded(value) for name, value in case["options"].items()})


def assert_close(actual, expected, rtol, what):
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    error = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12)
    assert error <= rtol, f"{what}: norm-wise relative error {error:.2e} > {rtol:.0e}"


def seed_of(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode())


# --------------------------------------------------------------------------------------------
# The oracle itself


@pytest.mark.parametrize("option", ["softmax-sym", "sigmoid-bias", "groups-any", "filter-guide-relative"])
def test_oracle_gradients_are_the_finite_differences_of_its_value(option):
    case = with_options(make_case(4, 6, 7, (7, 4, 1), (1.0, 0.5, 2.0), True, seed=seed_of("fd", option)),
                        OPTIONS[option])
    _, grads = oracle(case)

    def value(**changed):
        return oracle({**case, **changed})[0]

    for name in ("queries", "keys", "scale", *(("bias",) if case["bias"] is not None else ())):
        assert_close(grads[name], central_differences(value, case, name), 1e-7, name)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", OPTIONS, ids=list(OPTIONS))
def test_oracle_is_the_weighted_sum_of_the_reference_on_normalised_prefixes(option, reduction):
    """The definition, written out: one plain reference-backend call per prefix, autograd through
    F.normalize; the oracle's one-pass form must give the same value and gradients."""
    shape = "m5-k9-c16-d13.8.4.1-weighted"
    case = with_options(make_case(*SHAPES[shape], seed=seed_of("definition", option, reduction)),
                        OPTIONS[option])
    queries = case["queries"].clone().requires_grad_()
    keys = case["keys"].clone().requires_grad_()
    scale = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    total = 0.0
    for dim, weight in zip(case["dims"], case["weights"]):
        total = total + weight * contrastive_loss(
            F.normalize(queries[:, :dim], dim=1), F.normalize(keys[:, :dim], dim=1), scale, case["bias"],
            positives=case["positives"], reduction=reduction, backend="reference", **case["options"])
    total.sum().backward()
    value, grads = oracle(case, reduction)
    assert_close(value, total.detach().numpy(), 1e-12, "loss")
    for name, expected in (("queries", queries.grad), ("keys", keys.grad), ("scale", scale.grad)):
        assert_close(grads[name], expected.numpy(), 1e-11, name)


# --------------------------------------------------------------------------------------------
# Every backend against the oracle


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("backend", BACKENDS, ids=list(BACKENDS))
def test_float64_matches_the_oracle(backend, shape, option, reduction):
    case = with_options(make_case(*SHAPES[shape], seed=seed_of(shape, option, reduction)), OPTIONS[option])
    value, grads = run_loss(case, reduction=reduction, backend=BACKENDS[backend])
    expected_value, expected_grads = oracle(case, reduction)
    assert_close(value, expected_value, 1e-10, "loss")
    for name, grad in grads.items():
        assert np.abs(expected_grads[name]).max() > 1e-6, f"{name}: a vanishing gradient tests nothing"
        assert_close(grad, expected_grads[name], 1e-10, name)


@pytest.mark.parametrize("option", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_float32_at_the_sentence_transformers_scale_is_within_the_fp32_tolerance(backend, option):
    # positives only a little nearer than chance: at scale 20 a well-separated batch makes each
    # row's loss, and the scale's gradient, differences of nearly equal numbers, whose fp32 rounding
    # no tolerance on their own size covers
    case = with_options(make_case(*SHAPES["m5-k9-c16-d13.8.4.1-weighted"], seed=seed_of("fp32", option),
                                  affinity=0.1), OPTIONS[option])
    # No width-1 prefix here: it normalises to +-1, so its exact gradient is zero, and fp32 computes
    # that zero as a difference rounding to ~1e-7 |g| / |Q_i[:1]|, large where that entry is small
    # (docs/contract.md, "Matryoshka in one call").
    case = rounded_to(dict(case, scale=20.0, dims=(13, 8, 4, 2)), torch.float32)
    value, grads = run_loss(case, dtype=torch.float32, backend=BACKENDS[backend])
    expected_value, expected_grads = oracle(case)
    assert_close(value, expected_value, 1e-5, "loss")
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name], 1e-5, name)


# --------------------------------------------------------------------------------------------
# Identities


@pytest.mark.parametrize("backend", BACKENDS, ids=list(BACKENDS))
def test_one_dim_equal_to_the_width_is_the_plain_loss_on_normalised_features(backend):
    case = make_case(6, 9, 11, (11,), None, True, seed=seed_of("full", backend))
    value, grads = run_loss(case, backend=BACKENDS[backend], symmetric=True)
    queries = case["queries"].clone().requires_grad_()
    keys = case["keys"].clone().requires_grad_()
    scale = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    expected = contrastive_loss(F.normalize(queries, dim=1), F.normalize(keys, dim=1), scale,
                                positives=case["positives"], backend=BACKENDS[backend])
    expected.backward()
    # equal to rounding: the one-pass route (the torch tiles) scales the raw dot products by the
    # inverse norms where the plain loss multiplies normalised features
    assert_close(value, expected.item(), 1e-14, "loss")
    for name, grad in (("queries", queries.grad), ("keys", keys.grad), ("scale", scale.grad)):
        assert_close(grads[name], grad.numpy(), 1e-13, name)


def test_weights_scale_each_term_and_zero_drops_it():
    case = make_case(5, 8, 10, (10, 6, 2), None, True, seed=3)

    def loss(dims, weights):
        return run_loss(dict(case, dims=dims, weights=weights), backend=SMALL_TILES, reduction="none")

    weighted, weighted_grads = loss((10, 6, 2), (0.0, 3.0, 0.5))
    parts = [loss((10, 6, 2)[t:t + 1], None) for t in (1, 2)]  # one dim each
    assert_close(weighted, 3.0 * parts[0][0] + 0.5 * parts[1][0], 1e-13, "loss")
    for name in ("queries", "keys", "scale"):
        assert_close(weighted_grads[name], 3.0 * parts[0][1][name] + 0.5 * parts[1][1][name], 1e-13, name)


def test_the_module_takes_the_dims_as_the_function_does():
    import hf_infcl

    case = make_case(5, 8, 10, (10, 6, 2), None, True, seed=4)
    dims, weights = (10, 6, 2), (1.0, 0.5, 2.0)
    module = hf_infcl.InfCLLoss(logit_scale=case["scale"], backend=SMALL_TILES, matryoshka_dims=dims,
                                matryoshka_weights=weights)
    assert "matryoshka_dims=(10, 6, 2), matryoshka_weights=(1.0, 0.5, 2.0)" in repr(module)
    expected = contrastive_loss(case["queries"], case["keys"], case["scale"], positives=case["positives"],
                                backend=SMALL_TILES, matryoshka_dims=dims, matryoshka_weights=weights)
    assert module(case["queries"], case["keys"], positives=case["positives"]).item() == expected.item()
    module.matryoshka_dims = (11, 6, 2)  # assigned later: checked against the width at the call
    with pytest.raises(ValueError, match="has a width above the features' width 10"):
        module(case["queries"], case["keys"], positives=case["positives"])
    with pytest.raises(ValueError, match="^matryoshka_dims must be strictly descending"):
        hf_infcl.InfCLLoss(matryoshka_dims=(2, 4))


def test_compiles_in_one_graph_and_equals_eager():
    """The slices, the normalisation and the weighted sum are traced around each term's custom op
    (``hf_infcl.ops.custom_ops``): no graph break, the values and gradients of eager."""
    case = with_options(make_case(6, 8, 10, (10, 4), (1.0, 0.5), True, seed=21), OPTIONS["softmax-sym"])

    def loss(queries, keys):
        return contrastive_loss(queries, keys, case["scale"], positives=case["positives"], backend="torch",
                                matryoshka_dims=case["dims"], matryoshka_weights=case["weights"])

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        queries, keys = (case[name].clone().requires_grad_() for name in ("queries", "keys"))
        value = fn(queries, keys)
        value.backward()
        results.append((value.detach(), queries.grad, keys.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-14)


class RecordingTiles:
    """SMALL_TILES, recording which of its block ops ran."""

    def __init__(self, prefix: bool = True):
        self.calls = []
        names = ["forward_block", "backward_block"] + (["prefix_forward_block", "prefix_backward_block"]
                                                        if prefix else [])
        for name in names:
            setattr(self, name, self._recording(name))

    def _recording(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            return getattr(SMALL_TILES, name)(*args, **kwargs)
        return call


@pytest.mark.parametrize("option, one_pass", [
    ("softmax-sym", True), ("softmax-asym", True), ("sigmoid-bias", True), ("groups-masked", True),
    ("hardness", False), ("groups-any", False), ("filter", False), ("label-smoothing", False),
])
def test_plain_terms_take_one_pass_and_the_other_options_one_call_per_term(option, one_pass):
    """Block ops with the prefix methods compute every term in one forward and one backward pass
    for the options the one-pass route covers; the others take one forward and backward per term,
    as do block ops without the prefix methods. Both agree with the oracle."""
    case = with_options(make_case(*SHAPES["m5-k9-c16-d13.8.4.1-weighted"], seed=seed_of("route", option)),
                        OPTIONS[option])
    expected_value, expected_grads = oracle(case)
    terms = len(case["dims"])
    for prefix in (True, False):
        tiles = RecordingTiles(prefix)
        value, grads = run_loss(case, backend=tiles)
        if prefix and one_pass:
            assert tiles.calls == ["prefix_forward_block", "prefix_backward_block"]
        else:
            assert tiles.calls == ["forward_block"] * terms + ["backward_block"] * terms
        assert_close(value, expected_value, 1e-10, "loss")
        for name, grad in grads.items():
            assert_close(grad, expected_grads[name], 1e-10, name)


@pytest.mark.parametrize("option", ["softmax-sym", "sigmoid-bias"])
def test_rows_sharing_a_positive_and_an_all_zero_prefix(option):
    """Two rows with the same positive key (its gradient gathers both pairs' terms) and a row whose
    innermost prefix is all zeros (its cosines there are 0, as F.normalize's divisor of 1e-12 makes
    them, and every gradient stays finite), on the one-pass route, against the oracle."""
    case = with_options(make_case(5, 9, 16, (13, 8, 4), None, True, seed=seed_of("shared", option)),
                        OPTIONS[option])
    case["positives"] = torch.tensor([3, 7, 3, 0, 8])
    case["queries"][2, :4] = 0.0
    value, grads = run_loss(case, backend="torch")
    # the definition (the oracle divides by the zero norm)
    queries, keys = (case[name].clone().requires_grad_() for name in ("queries", "keys"))
    scale = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    expected = sum(contrastive_loss(F.normalize(queries[:, :dim], dim=1), F.normalize(keys[:, :dim], dim=1),
                                    scale, case["bias"], positives=case["positives"], backend="reference",
                                    **case["options"]) for dim in case["dims"])
    expected.backward()
    assert_close(value, expected.item(), 1e-12, "loss")
    for name, expected_grad in (("queries", queries.grad), ("keys", keys.grad), ("scale", scale.grad)):
        assert np.isfinite(grads[name]).all(), name
        assert_close(grads[name], expected_grad.numpy(), 1e-11, name)


# --------------------------------------------------------------------------------------------
# Errors: raised before any work, naming the argument


class RefusingBlocks:
    """Block ops that fail if a kernel is ever reached."""

    def forward_block(self, *args, **kwargs):
        raise AssertionError("a kernel ran before the arguments were refused")

    backward_block = forward_block


class RefusingPrefixBlocks(RefusingBlocks):
    """The same, with the one-pass route's block ops too."""

    prefix_forward_block = prefix_backward_block = RefusingBlocks.forward_block


def _arguments(**changed):
    gen = torch.Generator().manual_seed(0)
    arguments = dict(queries=torch.randn(4, 6, generator=gen, dtype=torch.float64),
                     keys=torch.randn(5, 6, generator=gen, dtype=torch.float64), logit_scale=2.0,
                     matryoshka_dims=(6, 3), backend=RefusingBlocks())
    arguments.update(changed)
    return arguments


@pytest.mark.parametrize("changed, error, match", [
    (dict(matryoshka_dims=(3, 6)), ValueError, r"matryoshka_dims must be strictly descending.*\(3, 6\)"),
    (dict(matryoshka_dims=(6, 6, 2)), ValueError, "matryoshka_dims must be strictly descending"),
    (dict(matryoshka_dims=(6, 0)), ValueError, "matryoshka_dims must be widths >= 1"),
    (dict(matryoshka_dims=(6, -2)), ValueError, "matryoshka_dims must be widths >= 1"),
    (dict(matryoshka_dims=(7, 3)), ValueError, "matryoshka_dims .* above the features' width 6"),
    (dict(matryoshka_dims=()), ValueError, "matryoshka_dims is empty"),
    (dict(matryoshka_dims=[]), ValueError, "matryoshka_dims is empty"),
    (dict(matryoshka_weights=(1.0,)), ValueError, "matryoshka_weights has 1 weights but matryoshka_dims has"),
    (dict(matryoshka_weights=(1.0, 2.0, 3.0)), ValueError, "matryoshka_weights has 3 weights"),
    (dict(matryoshka_weights=(1.0, float("nan"))), ValueError, "matryoshka_weights must be finite and"),
    (dict(matryoshka_weights=(float("inf"), 1.0)), ValueError, "matryoshka_weights must be finite"),
    (dict(matryoshka_weights=(1.0, -0.5)), ValueError, "matryoshka_weights must be finite and non-negative"),
    (dict(matryoshka_dims=None, matryoshka_weights=(1.0,)), ValueError,
     "matryoshka_weights was given without matryoshka_dims"),
    (dict(matryoshka_dims=(6, True)), TypeError, "matryoshka_dims must hold ints, got True"),
    (dict(matryoshka_dims=(6.0, 3)), TypeError, "matryoshka_dims must hold ints, got 6.0"),
    (dict(matryoshka_dims=6), TypeError, "matryoshka_dims must be a sequence of ints, got int"),
    (dict(matryoshka_dims="6"), TypeError, "matryoshka_dims must be a sequence of ints, got str"),
    (dict(matryoshka_dims=torch.tensor([6, 3])), TypeError, "matryoshka_dims must be a sequence of ints"),
    (dict(matryoshka_weights=(1.0, "2")), TypeError, "matryoshka_weights must hold numbers"),
    (dict(matryoshka_weights=(1.0, False)), TypeError, "matryoshka_weights must hold numbers"),
    (dict(matryoshka_weights=1.0), TypeError, "matryoshka_weights must be a sequence of numbers"),
    # what slicing to a common prefix would hide: checked on the whole features first
    (dict(keys=torch.randn(5, 8, dtype=torch.float64)), ValueError, "keys have width 8 but queries have"),
    (dict(keys=torch.randn(5, 6, dtype=torch.float32)), TypeError, "keys have dtype"),
    (dict(queries=[[1.0, 2.0]]), TypeError, "queries must be a torch.Tensor"),
    (dict(queries=torch.randn(4, 6, 1, dtype=torch.float64)), ValueError, "queries must be 2-D"),
    # the other options are checked as in any call
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(logit_scale=-1.0), ValueError, "logit_scale must be > 0"),
    (dict(label_smoothing=0.1, loss="sigmoid"), ValueError, "label_smoothing=0.1 needs loss='softmax'"),
    (dict(guide_queries=torch.randn(4, 3, dtype=torch.float64),
          guide_keys=torch.randn(5, 3, dtype=torch.float64)), ValueError, "without false_negative_margin"),
], ids=lambda value: None)
@pytest.mark.parametrize("blocks", [RefusingBlocks, RefusingPrefixBlocks], ids=["per-term", "one-pass"])
def test_bad_arguments_raise_naming_them_before_any_kernel(blocks, changed, error, match):
    with pytest.raises(error, match=match):
        contrastive_loss(**_arguments(backend=blocks(), **changed))


def test_dims_of_numpy_ints_and_lists_are_accepted():
    arguments = _arguments(backend=SMALL_TILES)
    expected = contrastive_loss(**arguments)
    for dims in ([6, 3], np.array([6, 3]).tolist(), tuple(np.array([6, 3]))):
        assert torch.equal(contrastive_loss(**dict(arguments, matryoshka_dims=dims)), expected)


# --------------------------------------------------------------------------------------------
# Two processes (gloo on CPU)

RING_TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(scope="module")
def ranks():
    """The results of both ranks of one spawned group, in rank order."""
    from tests.test_ring import _spawn

    out_dir = tempfile.mkdtemp(prefix="matryoshka-ring-")
    try:
        yield _spawn(2, out_dir, worker=ring_workers.worker)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(ring_workers.CASES))
def test_ring_equals_one_process_on_the_concatenated_batch(ranks, name):
    """Each rank's value is its rows' share of one process's per-row losses (reduced as the case
    says), and its gradients are those of the sum of both ranks' values: one process's gradients of
    the sum of its per-row losses, times n / M for "mean"."""
    case = ring_workers.CASES[name]
    seed = list(ring_workers.CASES).index(name)
    batch = ring_workers.concatenated(ring_workers.case_inputs(case, seed=seed))
    positives = batch.pop("positives")
    one = ring_workers.run_case(dataclasses.replace(case, reduction="none"), batch, process_group=None,
                                positives=positives)
    factor = 2 / sum(case.rows) if case.reduction == "mean" else 1.0
    row_offsets, key_offsets = np.cumsum((0,) + case.rows), np.cumsum((0,) + case.keys)
    for what, expected in one.items():  # fresh random inputs: a zero gradient would be vacuous
        assert expected.abs().max() > 1e-4, f"{what} vanishes"
    shares = {"scale": 0.0, "bias": 0.0}
    for rank, result in enumerate(ranks):
        mine = result["cases"][name]
        own_rows = slice(row_offsets[rank], row_offsets[rank + 1])
        own_keys = slice(key_offsets[rank], key_offsets[rank + 1])
        rows_value = one["value"][own_rows]
        expected_value = rows_value if case.reduction == "none" else factor * rows_value.sum()
        for what, actual, expected in (("value", mine["value"], expected_value),
                                       ("queries", mine["queries"], factor * one["queries"][own_rows]),
                                       ("keys", mine["keys"], factor * one["keys"][own_keys])):
            where = f"{name}, rank {rank}, {what}"
            torch.testing.assert_close(actual, expected, **RING_TOLERANCE,
                                       msg=lambda text, where=where: f"{where}: {text}")
        for what in shares:
            if what in mine:
                shares[what] += float(mine[what])
    # each rank's scale (bias) gradient is its share, from the logits it computed
    for what in ("scale", "bias") if "bias" in one else ("scale",):
        torch.testing.assert_close(shares[what], factor * float(one[what]), **RING_TOLERANCE)


SAME_ERROR_EVERYWHERE = {
    "dims_count": "disagree on the number of matryoshka_dims: rank 0: 2, rank 1: 3",
    "dims_values": "disagree on matryoshka_dims (the prefix width of one term): rank 0: 3, rank 1: 4",
    "first_dim": "disagree on matryoshka_dims (the prefix width of one term): rank 0: 10, rank 1: 9",
    "weights": "disagree on matryoshka_weights (the weight of one term): rank 0: 1.0, rank 1: 2.0",
    "plain_loss_on_one_rank": "disagree on the number of matryoshka_dims: rank 0: none, rank 1: 1",
}


@pytest.mark.parametrize("case", sorted(SAME_ERROR_EVERYWHERE))
def test_ranks_disagreeing_on_the_dims_all_raise_the_same_error(ranks, case):
    assert_same_error_everywhere(ranks, case, SAME_ERROR_EVERYWHERE[case])


def test_one_rank_rejecting_its_dims_stops_every_rank(ranks):
    raised = [result["raised"]["bad_dims_on_one_rank"] for result in ranks]
    assert raised[1][0] == "ValueError" and "matryoshka_dims must be strictly descending" in raised[1][1]
    assert raised[0][0] == "ValueError" and "rank(s) [1]" in raised[0][1], raised[0]


def test_group_still_usable_after_the_errors(ranks):
    queries = torch.cat([ring_workers._features(3, seed=rank) for rank in range(2)])
    keys = [ring_workers._features(4, seed=10 + rank) for rank in range(2)]
    positives = torch.cat([torch.arange(3), torch.arange(3) + 4])
    expected = contrastive_loss(queries, torch.cat(keys), 2.0, positives=positives, reduction="sum",
                                matryoshka_dims=(10, 4), backend="reference")
    for result in ranks:
        torch.testing.assert_close(result["after_errors"], expected, **RING_TOLERANCE)


# --------------------------------------------------------------------------------------------
# sentence-transformers' MatryoshkaLoss


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    from tests.helpers.sentence_transformers_fixtures import build_tiny_model_dir, load_tiny_model

    model = load_tiny_model(build_tiny_model_dir(tmp_path_factory.mktemp("tiny-st")))
    model.eval()  # no dropout: the two losses see the same embeddings
    return model


def _wrapped_loss(tiny_model, wrapped):
    from sentence_transformers import losses as st_losses

    from hf_infcl import losses

    makers = {"InfCLLoss": lambda: losses.InfCLLoss(tiny_model),
              "InfCLLoss-cached": lambda: losses.InfCLLoss(tiny_model, mini_batch_size=4),
              "MultipleNegativesRankingLoss": lambda: st_losses.MultipleNegativesRankingLoss(tiny_model),
              "CachedMultipleNegativesRankingLoss":
                  lambda: st_losses.CachedMultipleNegativesRankingLoss(tiny_model, mini_batch_size=4)}
    return makers[wrapped]()


class CountingCalls:
    """A callable that counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("wrapped", ["InfCLLoss", "InfCLLoss-cached", "MultipleNegativesRankingLoss",
                                     "CachedMultipleNegativesRankingLoss"])
def test_sentence_transformers_matryoshka_loss_is_contrastive_loss_with_dims(tiny_model, wrapped):
    """MatryoshkaLoss truncates the model's embeddings and the wrapped loss re-normalises them (its
    cosine): the loss and every parameter's gradient are ours with matryoshka_dims, scale 20, one
    direction, on the model's full embeddings (anchors as queries, positives then negatives as keys).
    Around the cached InfCLLoss the step is one loss call with every dim (not one per dim)."""
    from sentence_transformers import losses as st_losses

    from tests.helpers.sentence_transformers_fixtures import features, text_columns

    dims, weights = (32, 16, 8, 3), (1.0, 0.5, 2.0, 1.5)
    inner = _wrapped_loss(tiny_model, wrapped)
    matryoshka = st_losses.MatryoshkaLoss(tiny_model, inner, list(dims), list(weights))
    if wrapped == "InfCLLoss-cached":
        one_call = inner.calculate_loss
        one_call.calculate_loss = counting = CountingCalls(one_call.calculate_loss)
    batch = features(tiny_model, text_columns(6, 3, seed=4))

    def parameter_grads(loss):
        tiny_model.zero_grad(set_to_none=True)
        loss.backward()
        return {name: p.grad.clone() for name, p in tiny_model.named_parameters() if p.grad is not None}

    theirs = matryoshka([dict(column) for column in batch], None)
    their_grads = parameter_grads(theirs)
    anchors, positives, negatives = (tiny_model(dict(column))["sentence_embedding"] for column in batch)
    ours = contrastive_loss(anchors, torch.cat([positives, negatives]), 20.0, symmetric=False,
                            matryoshka_dims=dims, matryoshka_weights=weights)
    our_grads = parameter_grads(ours)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    assert their_grads.keys() == our_grads.keys() and their_grads
    if wrapped == "InfCLLoss-cached":
        assert counting.calls == 1
    # fp32 sums in another order: the norm-wise fp32 tolerance over every parameter at once (some,
    # such as the attention's key bias, have an exact gradient of zero and carry rounding only)
    assert_close(torch.cat([grad.flatten() for grad in our_grads.values()]).numpy(),
                 torch.cat([their_grads[name].flatten() for name in our_grads]).numpy(), 1e-5, "parameters")


@pytest.mark.parametrize("n_dims_per_step", [2, -1])
def test_the_cached_loss_draws_the_dims_of_each_step_as_matryoshka_loss_does(tiny_model, n_dims_per_step):
    """With ``n_dims_per_step``, MatryoshkaLoss's decorator samples the dims of each step with
    ``random.sample``; the one call around the cached InfCLLoss draws the same ones from the same
    seed: the loss and gradients of CachedMultipleNegativesRankingLoss's route, step after step."""
    from sentence_transformers import losses as st_losses

    from tests.helpers.sentence_transformers_fixtures import features, text_columns

    dims, weights = [32, 16, 8, 3], [1.0, 0.5, 2.0, 1.5]
    batch = features(tiny_model, text_columns(6, 3, seed=5))
    results = {}
    for wrapped in ("InfCLLoss-cached", "CachedMultipleNegativesRankingLoss"):
        loss = st_losses.MatryoshkaLoss(tiny_model, _wrapped_loss(tiny_model, wrapped), dims, weights,
                                        n_dims_per_step=n_dims_per_step)
        random.seed(11)
        steps = []
        for _ in range(3):
            tiny_model.zero_grad(set_to_none=True)
            value = loss([dict(column) for column in batch], None)
            value.backward()
            grads = torch.cat([p.grad.flatten() for p in tiny_model.parameters() if p.grad is not None])
            steps.append((value.detach(), grads))
        results[wrapped] = steps
    values = [step[0].item() for step in results["InfCLLoss-cached"]]
    if n_dims_per_step == 2:  # the draws differ from step to step: a test of which dims were drawn
        assert len(set(np.round(values, 6))) > 1
    for (ours, our_grads), (theirs, their_grads) in zip(*results.values()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert_close(our_grads.numpy(), their_grads.numpy(), 1e-5, "parameters")


# --------------------------------------------------------------------------------------------
# GPU: "auto" is the Triton backend on CUDA


# The sigmoid loss at scale 20 on the 8-wide prefix (weight 2) magnifies the bf16 rounding of the
# normalised prefixes: given the same bf16 inputs, the torch backend is 2.8e-2 from the float64
# oracle in the queries' gradient (0.9e-2 at width 96 alone), and the Triton route as far.
BF16_TOLERANCE = {"sigmoid-bias": 4e-2}
GPU_CASE = dict(m=300, k=523, c=96, dims=(96, 64, 32, 8), weights=(1.0, 0.5, 0.5, 2.0), seed=9, scale=20.0)


def gpu_case(option):
    """The case of the GPU test below, with the options of ``option``."""
    spec = GPU_CASE
    case = with_options(make_case(spec["m"], spec["k"], spec["c"], spec["dims"], spec["weights"], True,
                                  seed=spec["seed"]), OPTIONS[option])
    case["scale"] = spec["scale"]
    return case


@pytest.mark.parametrize("option", ["softmax-sym", "sigmoid-bias"])
def test_bf16_tolerances_of_the_gpu_test_hold_for_the_torch_backend(option):
    """The GPU test's bf16 tolerances are the rounding of bf16 itself: the torch backend on CPU
    meets them on the same inputs (and needs the looser one: it is not slack for the kernels)."""
    rounded = rounded_to(gpu_case(option), torch.bfloat16)
    value, grads = run_loss(rounded, dtype=torch.bfloat16, backend="torch")
    expected_value, expected_grads = oracle(rounded)
    tolerance = BF16_TOLERANCE.get(option, 1e-2)
    errors = {name: np.linalg.norm(grad - expected_grads[name]) / np.linalg.norm(expected_grads[name])
              for name, grad in grads.items()}
    assert max(errors.values()) <= tolerance, errors
    if option in BF16_TOLERANCE:
        assert max(errors.values()) > 1e-2, errors


ONE_PASS_OPTIONS = ("softmax-sym", "softmax-asym", "sigmoid-bias", "groups-masked")
GPU_ROUTES = [("auto", dtype, option) for dtype in ("fp32-ieee", "bf16")
              for option in ("softmax-sym", "sigmoid-bias", "groups-any", "filter-guide-relative")]
GPU_ROUTES += [("one-pass", dtype, option) for dtype in ("fp32-ieee", "fp32-tf32", "bf16")
               for option in ONE_PASS_OPTIONS]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, dtype, option", GPU_ROUTES, ids=["-".join(route) for route in GPU_ROUTES])
def test_cuda_matches_the_oracle(backend, dtype, option, monkeypatch):
    """On CUDA, autotuning on: ``"auto"`` takes one Triton loss call per width; the one-pass
    kernels (``TritonBlocks(matryoshka_one_pass=True)``) run every width at once for the options
    of the one-pass route (their launches counted)."""
    from hf_infcl.ops.triton import TritonBlocks
    from hf_infcl.ops.triton import matryoshka as triton_matryoshka

    dtype, precision = {"fp32-ieee": (torch.float32, "ieee"), "fp32-tf32": (torch.float32, "tf32"),
                        "bf16": (torch.bfloat16, "auto")}[dtype]
    launches = []
    prefix_stats = triton_matryoshka.prefix_stats
    monkeypatch.setattr(triton_matryoshka, "prefix_stats",
                        lambda *args, **kwargs: launches.append(1) or prefix_stats(*args, **kwargs))
    rounded = rounded_to(gpu_case(option), dtype)
    cuda = dict(rounded, queries=rounded["queries"].cuda(), keys=rounded["keys"].cuda(),
                positives=rounded["positives"].cuda(),
                options={name: value.cuda() if torch.is_tensor(value) else value
                         for name, value in rounded["options"].items()})
    blocks = "auto" if backend == "auto" else TritonBlocks(matryoshka_one_pass=True)
    value, grads = run_loss(cuda, dtype=dtype, precision=precision, backend=blocks)
    assert bool(launches) == (backend == "one-pass")
    expected_value, expected_grads = oracle(rounded)
    tolerance = {"ieee": 1e-5, "tf32": 5e-3}[precision] if dtype == torch.float32 else BF16_TOLERANCE.get(
        option, 1e-2)
    assert_close(value, expected_value, tolerance, "loss")
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name], tolerance, name)
