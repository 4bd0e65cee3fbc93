"""The public loss against the float64 contract: every backend, value and every gradient."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch

import hf_infcl
from hf_infcl import TorchTiles, contrastive_loss
from tests.helpers.hardness_cases import with_hardness
from tests.helpers.oracle import contract_loss, hardness_selection
from tests.helpers.recording_tiles import RecordingTiles

# Small tiles so that every test crosses several tile boundaries in both directions.
SMALL_TILES = TorchTiles(tile_rows=5, tile_keys=7)
# "torch-op" is the backend by name, with its default tiles (what users get: eager, it runs as an
# autograd Function; torch.compile sees the custom op of hf_infcl.ops.custom_ops, which
# test_compile.py checks); "torch" passes a block-ops object with small tiles.
BACKENDS = {"torch": SMALL_TILES, "torch-op": "torch", "reference": "reference"}


def make_case(m, k, c, *, groups=False, custom_positives=False, seed=None, dtype=torch.float64):
    """Fresh random features (never zeros) in the ranges CLIP sees: unit-norm rows plus noise."""
    gen = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2**31))
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, dtype=torch.float64), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(k, c, generator=gen, dtype=torch.float64), dim=1)
    keys[: min(m, k)] += 0.5 * q[: min(m, k)]  # make positives more similar than chance, as trained models do
    case = {
        "queries": q.to(dtype),
        "keys": keys.to(dtype),
        "scale": float(torch.empty(1).uniform_(2.0, 20.0, generator=gen)),
        "bias": float(torch.empty(1).uniform_(-5.0, 1.0, generator=gen)),
        "positives": torch.randperm(k, generator=gen)[:m] if custom_positives else None,
        "query_groups": None,
        "key_groups": None,
    }
    if groups:
        n_groups = max(2, m // 2)
        case["query_groups"] = torch.randint(0, n_groups, (m,), generator=gen)
        case["key_groups"] = torch.randint(0, n_groups, (k,), generator=gen)
    return case


def run_backend(case, backend, *, loss, symmetric, reduction, use_bias):
    """Loss and the gradients of queries, keys, scale, bias (scale and bias as leaf tensors)."""
    q = case["queries"].clone().requires_grad_(True)
    k = case["keys"].clone().requires_grad_(True)
    scale = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(case["bias"], dtype=torch.float64, requires_grad=True) if use_bias else None
    value = contrastive_loss(
        q, k, scale, bias, loss=loss, symmetric=symmetric, positives=case["positives"],
        query_groups=case["query_groups"], key_groups=case["key_groups"], reduction=reduction,
        backend=backend, **case.get("hardness", {}), label_smoothing=case.get("label_smoothing", 0.0),
    )
    total = value.sum() if reduction == "none" else value
    leaves = [q, k, scale] + ([bias] if use_bias else [])
    grads = torch.autograd.grad(total, leaves)
    names = ["queries", "keys", "scale", "bias"]
    return value.detach(), {name: g.double().numpy() for name, g in zip(names, grads)}


def run_oracle(case, *, loss, symmetric, reduction, use_bias):
    as_np = lambda t: None if t is None else t.numpy()  # noqa: E731
    return contract_loss(
        case["queries"].double().numpy(), case["keys"].double().numpy(), case["scale"],
        case["bias"] if use_bias else None, loss=loss, symmetric=symmetric,
        positives=as_np(case["positives"]), query_groups=as_np(case["query_groups"]),
        key_groups=as_np(case["key_groups"]),
        reduction=reduction, label_smoothing=case.get("label_smoothing", 0.0),
        **{name: as_np(value) if torch.is_tensor(value) else value
           for name, value in case.get("hardness", {}).items()},
    )


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def assert_matches_oracle(case, backend, tolerance, **options):
    value, grads = run_backend(case, backend, **options)
    expected_value, expected_grads = run_oracle(case, **options)
    errors = {"loss": relative_error(value.numpy(), expected_value)}
    for name, grad in grads.items():
        errors[name] = relative_error(grad, expected_grads[name])
    if options["loss"] == "softmax" and "bias" in grads:
        # A bias cancels out of every softmax term: its exact gradient is 0, so compare absolutely.
        errors["bias"] = abs(float(grads["bias"]) - expected_grads["bias"])
    worst = max(errors.values())
    assert worst < tolerance, f"relative errors {errors} (tolerance {tolerance})"
    return worst


def _shape_id(shape):
    """Readable parametrize ids: m7-k19-c96."""
    return "m{}-k{}-c{}".format(*shape)


SHAPES = [(1, 1, 1), (7, 7, 3), (7, 19, 96), (129, 129, 3), (13, 40, 1)]
OPTIONS = [
    ("softmax", True),
    ("softmax", False),
    ("sigmoid", True),
]


@pytest.mark.parametrize("backend", list(BACKENDS), ids=lambda b: f"backend-{b}")
@pytest.mark.parametrize("loss,symmetric", OPTIONS, ids=["softmax-sym", "softmax-asym", "sigmoid"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
def test_float64_matches_contract(backend, loss, symmetric, shape, groups):
    m, k, c = shape
    case = make_case(m, k, c, groups=groups, seed=m * 1000 + k * 10 + c)
    assert_matches_oracle(
        case, BACKENDS[backend], 1e-10, loss=loss, symmetric=symmetric, reduction="mean",
        use_bias=loss == "sigmoid",
    )


HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")
HARDNESS_SHAPES = [(1, 6, 3), (7, 19, 96), (33, 70, 3)]


@pytest.mark.parametrize("backend", list(BACKENDS), ids=lambda b: f"backend-{b}")
@pytest.mark.parametrize("mode", HARDNESS_MODES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("shape", HARDNESS_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
def test_hardness_offset_matches_contract(backend, mode, symmetric, shape, groups):
    """The hardness offset (docs/contract.md) with masks, custom positives and hard negatives,
    every gradient through the scaled logits only; and it changes the loss."""
    m, k, c = shape
    seed = m * 1000 + k * 10 + c + HARDNESS_MODES.index(mode)
    case = with_hardness(make_case(m, k, c, groups=groups, custom_positives=True, seed=seed), mode, 3.5, seed)
    options = dict(loss="softmax", symmetric=symmetric, reduction="mean", use_bias=False)
    assert_matches_oracle(case, BACKENDS[backend], 1e-10, **options)
    plain, _ = run_oracle({**case, "hardness": {}}, **options)
    offset, _ = run_oracle(case, **options)
    assert (plain != offset) == offsets_an_allowed_key(case)
    if not groups and m > 1:
        assert plain != offset  # these cases always hold keys to offset


def offsets_an_allowed_key(case) -> bool:
    """Whether the hardness offset selects a key that some row's loss keeps (group masking may
    leave out every selected key of a small case)."""
    hardness = case["hardness"]
    m, k = case["queries"].shape[0], case["keys"].shape[0]
    positive = np.zeros((m, k), dtype=bool)
    positive[np.arange(m), case["positives"].numpy()] = True
    selected = hardness_selection(hardness["hardness_mode"], hardness["query_ids"].numpy(),
                                   hardness["key_owners"].numpy(), positive) > 0
    if case["query_groups"] is not None:
        same_group = case["query_groups"].numpy()[:, None] == case["key_groups"].numpy()[None, :]
        selected &= ~same_group | positive
    return bool(selected.any())


@pytest.mark.parametrize("backend", list(BACKENDS), ids=lambda b: f"backend-{b}")
def test_hardness_strength_zero_is_the_plain_loss(backend):
    case = make_case(9, 20, 4, groups=True, custom_positives=True, seed=5)
    options = dict(loss="softmax", symmetric=True, reduction="none", use_bias=False)
    plain, plain_grads = run_backend(case, BACKENDS[backend], **options)
    zero_case = with_hardness(case, "all_negatives", 0.0, seed=5)
    zero, zero_grads = run_backend(zero_case, BACKENDS[backend], **options)
    assert torch.equal(plain, zero)
    assert all(np.array_equal(plain_grads[name], zero_grads[name]) for name in plain_grads)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("custom_positives", [False, True], ids=["diag", "custom-positives"])
@pytest.mark.parametrize("loss,symmetric", OPTIONS, ids=["softmax-sym", "softmax-asym", "sigmoid"])
def test_reductions_and_positives(reduction, custom_positives, loss, symmetric):
    case = make_case(9, 23, 5, groups=True, custom_positives=custom_positives, seed=11)
    assert_matches_oracle(
        case, SMALL_TILES, 1e-10, loss=loss, symmetric=symmetric, reduction=reduction, use_bias=True
    )


@pytest.mark.parametrize("backend", ["torch", "torch-op"])
@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
@pytest.mark.parametrize("loss,symmetric", OPTIONS, ids=["softmax-sym", "softmax-asym", "sigmoid"])
def test_default_positives_equal_explicit_arange(backend, groups, loss, symmetric):
    """``positives=None`` (keys[:m], taken without an index tensor: no range check, no sort in
    the backward) and the same pairing spelt out as ``arange(m)`` (the indexed route) give the
    same loss and gradients, with hard negatives beyond the m positives."""
    case = make_case(11, 26, 6, groups=groups, seed=random.randrange(2**31))
    default = run_backend(case, BACKENDS[backend], loss=loss, symmetric=symmetric, reduction="mean",
                          use_bias=True)
    explicit = run_backend(dict(case, positives=torch.arange(11)), BACKENDS[backend], loss=loss,
                           symmetric=symmetric, reduction="mean", use_bias=True)
    np.testing.assert_allclose(default[0].numpy(), explicit[0].numpy(), rtol=1e-12, atol=1e-12)
    for name in default[1]:
        np.testing.assert_allclose(default[1][name], explicit[1][name], rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("shape", [(33, 100, 40), (64, 64, 257)], ids=_shape_id)
@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_float32_inputs_within_1e_5(shape, loss):
    m, k, c = shape
    case = make_case(m, k, c, groups=True, seed=5, dtype=torch.float32)
    assert_matches_oracle(
        case, TorchTiles(16, 24), 1e-5, loss=loss, symmetric=True, reduction="mean", use_bias=True
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_inputs_on_cpu(dtype):
    case = make_case(20, 50, 32, seed=3, dtype=dtype)
    assert_matches_oracle(
        case, TorchTiles(8, 16), 1e-2, loss="softmax", symmetric=True, reduction="mean", use_bias=False
    )


def test_positive_shared_by_several_rows():
    """Two rows with the same positive key: the column term's weight adds up for that key."""
    case = make_case(6, 10, 4, seed=21)
    case["positives"] = torch.tensor([0, 0, 3, 3, 3, 9])
    for backend in BACKENDS.values():
        assert_matches_oracle(
            case, backend, 1e-10, loss="softmax", symmetric=True, reduction="mean", use_bias=False
        )


def test_fewer_keys_than_rows_with_explicit_positives():
    case = make_case(8, 3, 4, seed=22, custom_positives=False)
    case["positives"] = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    assert_matches_oracle(case, SMALL_TILES, 1e-10, loss="softmax", symmetric=True,
                          reduction="mean", use_bias=False)


def test_random_contract_cases():
    """Fresh draws on every run (seed printed on failure): shapes, options, groups, positives."""
    seed = int(os.environ.get("HF_INFCL_TEST_SEED", random.randrange(2**31)))
    rng = random.Random(seed)
    worst = 0.0
    for _ in range(12):
        m = rng.randint(1, 40)
        k = m + rng.randint(0, 40)
        c = rng.randint(1, 70)
        case = make_case(m, k, c, groups=rng.random() < 0.5, custom_positives=rng.random() < 0.3,
                         seed=rng.randrange(2**31))
        loss, symmetric = rng.choice(OPTIONS)
        backend = rng.choice([TorchTiles(rng.randint(1, 17), rng.randint(1, 17)), "reference"])
        options = dict(loss=loss, symmetric=symmetric, reduction=rng.choice(["mean", "sum", "none"]),
                       use_bias=rng.random() < 0.5)
        try:
            worst = max(worst, assert_matches_oracle(case, backend, 1e-7, **options))
        except AssertionError as error:
            raise AssertionError(f"seed {seed}, m={m} k={k} c={c} {options} {backend}: {error}") from None
    print(f"random contract cases: seed {seed}, worst relative error {worst:.2e}")


@pytest.mark.parametrize("loss,symmetric", OPTIONS, ids=["softmax-sym", "softmax-asym", "sigmoid"])
def test_gradcheck_torch_backend(loss, symmetric):
    case = make_case(4, 6, 3, groups=True, seed=8)
    q = case["queries"].clone().requires_grad_(True)
    k = case["keys"].clone().requires_grad_(True)
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-0.5, dtype=torch.float64, requires_grad=True)

    def fn(q, k, scale, bias):
        return contrastive_loss(q, k, scale, bias, loss=loss, symmetric=symmetric,
                                query_groups=case["query_groups"], key_groups=case["key_groups"],
                                reduction="none", backend=TorchTiles(3, 4))

    assert torch.autograd.gradcheck(fn, (q, k, scale, bias))


def test_default_backend_on_cpu_is_tiled_torch():
    from hf_infcl.ops.logit_stats import select_block_ops

    assert isinstance(select_block_ops("auto", torch.device("cpu")), TorchTiles)


def test_float_scale_equals_tensor_scale_and_module():
    case = make_case(10, 15, 8, seed=4)
    q, k = case["queries"], case["keys"]
    as_float = contrastive_loss(q, k, 7.5)
    as_tensor = contrastive_loss(q, k, torch.tensor([7.5], dtype=torch.float32))
    module = hf_infcl.InfCLLoss(logit_scale=7.5)(q, k)
    assert torch.allclose(as_float, as_tensor) and torch.allclose(as_float, module)


def test_module_learns_its_own_scale_parameter():
    scale = torch.nn.Parameter(torch.tensor(5.0, dtype=torch.float64))
    criterion = hf_infcl.InfCLLoss(logit_scale=scale, loss="softmax")
    assert any(p is scale for p in criterion.parameters())
    case = make_case(6, 6, 4, seed=9)
    criterion(case["queries"], case["keys"]).backward()
    _, expected = contract_loss(case["queries"].numpy(), case["keys"].numpy(), 5.0)
    assert abs(scale.grad.item() - expected["scale"]) < 1e-10


def test_process_group_auto_without_distributed_is_local():
    case = make_case(5, 9, 4, seed=10)
    local = contrastive_loss(case["queries"], case["keys"], 3.0)
    auto = contrastive_loss(case["queries"], case["keys"], 3.0, process_group="auto")
    assert torch.equal(local, auto)


@pytest.mark.parametrize("backend", list(BACKENDS), ids=lambda b: f"backend-{b}")
@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("where", ["queries", "keys", "scale"])
def test_non_finite_inputs_give_non_finite_loss(backend, poison, where):
    case = make_case(6, 8, 4, seed=12)
    bad = float(poison)
    q, k, scale = case["queries"].clone(), case["keys"].clone(), case["scale"]
    if where == "queries":
        q[2, 1] = bad
    elif where == "keys":
        k[5, 0] = bad
    else:
        scale = bad
    for loss in ["softmax", "sigmoid"]:
        value = contrastive_loss(q, k, scale, loss=loss, backend=BACKENDS[backend])
        assert not torch.isfinite(value), f"{loss} gave a finite loss {value} from a {poison} in {where}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_gradients_when_the_softmax_is_peaked(dtype):
    """At CLIP's end-of-training scale the positive's probability is close to 1, so the
    statistics' gradient at the positive nearly cancels the positive logit's gradient. The two
    must be summed before the cast to half precision, or dQ and dK lose their significant bits."""
    gen = torch.Generator().manual_seed(31)
    m, c = 256, 64
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, dtype=torch.float64), dim=1)
    k = torch.nn.functional.normalize(q + 0.3 * torch.randn(m, c, generator=gen, dtype=torch.float64), dim=1)
    case = {"queries": q.to(dtype), "keys": k.to(dtype), "scale": 100.0, "bias": 0.0,
            "positives": None, "query_groups": None, "key_groups": None}
    # Rounding the gradients once to bf16 gives ~1.7e-3 here; summing two rounded halves gave 3.6e-3.
    assert_matches_oracle(case, TorchTiles(64, 64), 2.5e-3, loss="softmax", symmetric=True,
                          reduction="mean", use_bias=False)


def _owned_inputs(case, *, loss):
    """Every tensor a caller hands the loss, the scale and bias as outputs of autograd ops (as a
    model's ``logit_scale.exp()`` is), so that an in-place write into any of them breaks backward."""
    q = case["queries"].clone().requires_grad_(True)
    k = case["keys"].clone().requires_grad_(True)
    log_scale = torch.tensor(math.log(case["scale"]), dtype=torch.float64, requires_grad=True)
    raw_bias = torch.tensor(case["bias"], dtype=torch.float64, requires_grad=True)
    inputs = dict(queries=q, keys=k, logit_scale=log_scale.exp(),
                  logit_bias=raw_bias * 1.0 if loss == "sigmoid" else None,
                  positives=case["positives"], query_groups=case["query_groups"],
                  key_groups=case["key_groups"])
    return inputs, [q, k, log_scale] + ([raw_bias] if loss == "sigmoid" else [])


@pytest.mark.parametrize("backend", list(BACKENDS), ids=lambda b: f"backend-{b}")
@pytest.mark.parametrize("loss,symmetric", OPTIONS, ids=["softmax-sym", "softmax-asym", "sigmoid"])
def test_no_input_is_modified_in_place(backend, loss, symmetric):
    """No tensor the caller owns changes its version counter across forward and backward: not the
    features, not the scale or bias (outputs of autograd ops here), not positives or groups."""
    case = make_case(9, 14, 5, groups=True, custom_positives=True)
    inputs, leaves = _owned_inputs(case, loss=loss)
    versions = {name: t._version for name, t in inputs.items() if torch.is_tensor(t)}
    value = contrastive_loss(**inputs, loss=loss, symmetric=symmetric, backend=BACKENDS[backend])
    grads = torch.autograd.grad(value, leaves)  # raises if a saved tensor was modified
    assert all(torch.isfinite(g).all() for g in grads)
    after = {name: inputs[name]._version for name in versions}
    assert after == versions


def test_precision_auto_has_one_meaning():
    """"auto" is TF32 exactly where TF32 exists (fp32 inputs on CUDA), in every backend; an
    explicit choice is kept."""
    from hf_infcl.ops.spec import resolve_precision

    assert resolve_precision("auto", torch.float32, torch.device("cuda")) == "tf32"
    assert resolve_precision("auto", torch.float32, torch.device("cpu")) == "ieee"
    assert resolve_precision("auto", torch.float64, torch.device("cuda")) == "ieee"
    for explicit in ("tf32", "ieee"):
        for device in ("cpu", "cuda"):
            assert resolve_precision(explicit, torch.float32, torch.device(device)) == explicit


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sigmoid_loss_computes_its_gradients_in_the_forward(reduction):
    """Where every row's statistic gets the same gradient (mean, sum) and a gradient is wanted,
    the sigmoid loss makes one pass over the tiles (statistic and gradients together) and the
    backward computes no tile; values and gradients still equal the float64 contract, also when
    the graph is backpropagated twice (the forward's gradients are read, not used up)."""
    case = make_case(9, 23, 5, groups=True, custom_positives=True, seed=5)
    ops = RecordingTiles()
    value, grads = run_backend(case, ops, loss="sigmoid", symmetric=False, reduction=reduction, use_bias=True)
    assert ops.events == ["forward_backward_block"]
    expected_value, expected_grads = run_oracle(case, loss="sigmoid", symmetric=False, reduction=reduction,
                                                use_bias=True)
    assert relative_error(value.numpy(), expected_value) < 1e-12
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) < 1e-12, name

    q = case["queries"].clone().requires_grad_(True)
    scale = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    loss = contrastive_loss(q, case["keys"], scale, case["bias"], loss="sigmoid", positives=case["positives"],
                            reduction=reduction, backend="torch")
    first = torch.autograd.grad(loss, [q, scale], retain_graph=True)
    second = torch.autograd.grad(3.0 * loss, [q, scale])
    for a, b in zip(first, second):
        torch.testing.assert_close(3.0 * a, b, rtol=1e-13, atol=0)


def test_sigmoid_loss_without_a_shared_row_gradient_takes_two_passes():
    """reduction="none" (the caller may weight rows unevenly) and calls without gradients keep the
    statistics pass, and the gradients of an uneven weighting equal the materialised loss's."""
    case = make_case(9, 23, 5, groups=True, seed=6)
    weights = torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.1

    def weighted(backend):
        q = case["queries"].clone().requires_grad_(True)
        k = case["keys"].clone().requires_grad_(True)
        scale = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
        bias = torch.tensor(case["bias"], dtype=torch.float64, requires_grad=True)
        per_row = contrastive_loss(q, k, scale, bias, loss="sigmoid", reduction="none",
                                   query_groups=case["query_groups"], key_groups=case["key_groups"],
                                   backend=backend)
        return torch.autograd.grad((weights * per_row).sum(), [q, k, scale, bias])

    ops = RecordingTiles()
    for got, expected in zip(weighted(ops), weighted("reference")):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert ops.events == ["forward_block", "backward_block"]

    ops = RecordingTiles()
    with torch.no_grad():
        contrastive_loss(case["queries"], case["keys"], case["scale"], case["bias"], loss="sigmoid",
                         backend=ops)
    assert ops.events == ["forward_block"]


@pytest.mark.parametrize("backend, backward_inside",
                         [("torch", False), ("torch", True), ("reference", False)],
                         ids=["torch", "torch-backward-inside", "reference"])
@pytest.mark.parametrize("loss, symmetric", [("softmax", True), ("softmax", False), ("sigmoid", False)])
def test_autocast_does_not_change_the_loss_or_its_gradients(backend, backward_inside, loss, symmetric):
    """Under a bf16 autocast (as the Trainers run a model's forward, and often the loss with it) the
    loss still computes in its inputs' dtype: fp32 embeddings give the fp32 loss and gradients.
    The backward usually runs after the autocast region; the fused backends' backward also keeps
    its precision inside it (on the CPU the backward runs in the caller's thread, under its
    autocast). The materialised reference is plain autograd there, so it is checked outside."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q = torch.nn.functional.normalize(torch.randn(70, 24, generator=gen), dim=1)
    k = torch.nn.functional.normalize(torch.randn(90, 24, generator=gen), dim=1)
    bias = torch.tensor(-3.0) if loss == "sigmoid" else None

    def loss_and_grads(autocast: bool):
        qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        scale = torch.tensor(30.0, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = contrastive_loss(qq, kk, scale, bias, loss=loss, symmetric=symmetric, backend=backend)
            if backward_inside:
                value.backward()
        if not backward_inside:
            value.backward()
        return value.detach(), qq.grad, kk.grad, scale.grad

    plain, under_autocast = loss_and_grads(False), loss_and_grads(True)
    assert under_autocast[0].dtype == torch.float32
    for expected, got in zip(plain, under_autocast):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    # The comparison can fail: the same logits computed under the autocast (a bf16 matmul) are off
    # by far more than its tolerance.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_logits = 30.0 * (q @ k.T)
    assert (autocast_logits.float() - 30.0 * (q @ k.T)).abs().max() > 1e-3


# ---- label smoothing ------------------------------------------------------------------------

SMOOTHING_SHAPES = [(1, 4, 3), (7, 7, 5), (9, 23, 6), (13, 40, 1)]


def cross_entropy_loss(case, symmetric, label_smoothing, reduction, use_bias):
    """torch.nn.functional.cross_entropy with label_smoothing on the materialised float64 logits:
    rows over every key, columns (symmetric) over every row at each row's positive key."""
    q = case["queries"].double().clone().requires_grad_(True)
    k = case["keys"].double().clone().requires_grad_(True)
    scale = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(case["bias"], dtype=torch.float64, requires_grad=True) if use_bias else None
    m = q.shape[0]
    positives = torch.arange(m) if case["positives"] is None else case["positives"]
    logits = scale * q @ k.T + (0.0 if bias is None else bias)
    per_row = torch.nn.functional.cross_entropy(logits, positives, reduction="none",
                                                label_smoothing=label_smoothing)
    if symmetric:
        columns = torch.nn.functional.cross_entropy(logits[:, positives].T, torch.arange(m), reduction="none",
                                                    label_smoothing=label_smoothing)
        per_row = (per_row + columns) / 2
    value = {"none": per_row, "sum": per_row.sum(), "mean": per_row.mean()}[reduction]
    leaves = [q, k, scale] + ([bias] if use_bias else [])
    grads = torch.autograd.grad(value.sum(), leaves)
    return value.detach(), dict(zip(["queries", "keys", "scale", "bias"], (g.numpy() for g in grads)))


@pytest.mark.parametrize("backend", list(BACKENDS), ids=lambda b: f"backend-{b}")
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("shape", SMOOTHING_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("custom_positives", [False, True], ids=["diag", "custom-positives"])
def test_label_smoothing_is_cross_entropys(backend, symmetric, shape, custom_positives):
    """contrastive_loss(label_smoothing=eps) is torch's cross_entropy(label_smoothing=eps) over the
    materialised float64 logits, hard negatives among the row's candidates: the value and every
    gradient (queries, keys, scale; the bias, which cancels, too); and the closed-form oracle."""
    m, k, c = shape
    seed = m * 1000 + k * 10 + c + 7 * custom_positives
    case = make_case(m, k, c, custom_positives=custom_positives, seed=seed)
    case["label_smoothing"] = 0.1 + 0.5 * random.Random(seed).random()
    for reduction in ("mean", "none"):
        value, grads = run_backend(case, BACKENDS[backend], loss="softmax", symmetric=symmetric,
                                   reduction=reduction, use_bias=True)
        expected, expected_grads = cross_entropy_loss(case, symmetric, case["label_smoothing"], reduction,
                                                      use_bias=True)
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
        for name in ("queries", "keys", "scale"):
            assert relative_error(grads[name], expected_grads[name]) < 1e-10, name
        assert abs(float(grads["bias"])) < 1e-10 and abs(float(expected_grads["bias"])) < 1e-10
    assert_matches_oracle(case, BACKENDS[backend], 1e-10, loss="softmax", symmetric=symmetric,
                          reduction="sum", use_bias=False)
    plain, _ = run_backend(dict(case, label_smoothing=0.0), BACKENDS[backend], loss="softmax",
                           symmetric=symmetric, reduction="mean", use_bias=False)
    smoothed, _ = run_backend(case, BACKENDS[backend], loss="softmax", symmetric=symmetric, reduction="mean",
                              use_bias=False)
    if m > 1:
        assert abs(float(smoothed) - float(plain)) > 1e-3  # the smoothing changed the loss


def test_label_smoothing_edges_and_the_module():
    """eps = 0 is the plain loss bit for bit; eps = 1 is cross_entropy's all-uniform target; the
    module takes label_smoothing like the function."""
    case = make_case(8, 15, 4, custom_positives=True, seed=31)
    for backend in BACKENDS.values():
        plain = run_backend(case, backend, loss="softmax", symmetric=True, reduction="none", use_bias=False)
        zero = run_backend(dict(case, label_smoothing=0.0), backend, loss="softmax", symmetric=True,
                           reduction="none", use_bias=False)
        assert torch.equal(plain[0], zero[0])
        value, _ = run_backend(dict(case, label_smoothing=1.0), backend, loss="softmax", symmetric=True,
                               reduction="mean", use_bias=False)
        expected, _ = cross_entropy_loss(case, True, 1.0, "mean", use_bias=False)
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    module = hf_infcl.InfCLLoss(case["scale"], label_smoothing=0.2, symmetric=False, backend=SMALL_TILES)
    assert "label_smoothing=0.2" in repr(module)
    expected, _ = cross_entropy_loss(case, False, 0.2, "mean", use_bias=False)
    torch.testing.assert_close(module(case["queries"], case["keys"], positives=case["positives"]), expected,
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_label_smoothing_in_low_precision(dtype, monkeypatch):
    """fp32 within 1e-5 and bf16 within 1e-2 of the float64 oracle; bf16 rows are taken to fp32 a
    slice at a time (slices of 5 rows here), both in the forward and in the backward."""
    from hf_infcl.ops import label_smoothing

    monkeypatch.setattr(label_smoothing, "_SLICE_ROWS", 5)
    case = make_case(23, 41, 16, custom_positives=True, seed=9, dtype=dtype)
    case["label_smoothing"] = 0.1
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert_matches_oracle(case, TorchTiles(8, 16), tolerance, loss="softmax", symmetric=True,
                          reduction="mean", use_bias=False)


def test_label_smoothing_under_autocast_keeps_fp32():
    """A bf16 autocast around the loss and its backward changes nothing (the mean logits too)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.nn.functional.normalize(torch.randn(30, 16, generator=gen), dim=1)
    k = torch.nn.functional.normalize(torch.randn(45, 16, generator=gen), dim=1)

    def loss_and_grads(autocast):
        qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        scale = torch.tensor(30.0, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = contrastive_loss(qq, kk, scale, label_smoothing=0.1)
            value.backward()
        return value.detach(), qq.grad, kk.grad, scale.grad

    for expected, got in zip(loss_and_grads(False), loss_and_grads(True)):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("arguments, error, message", [
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
    (dict(label_smoothing=-0.1), ValueError, r"label_smoothing must be in \[0, 1\]"),
    (dict(label_smoothing=float("nan")), ValueError, r"label_smoothing must be in \[0, 1\]"),
    (dict(label_smoothing="0.1"), TypeError, "label_smoothing must be a float"),
    (dict(label_smoothing=True), TypeError, "label_smoothing must be a float"),
    (dict(label_smoothing=0.1, loss="sigmoid"), ValueError, "label_smoothing=0.1 needs loss='softmax'"),
    (dict(label_smoothing=0.1, query_groups=torch.arange(4), key_groups=torch.arange(6)), ValueError,
     "label_smoothing=0.1 is not defined with query_groups/key_groups"),
    (dict(label_smoothing=0.1, hardness_mode="all_negatives", hardness_strength=1.0,
          query_ids=torch.arange(4), key_owners=torch.arange(6)),
     ValueError, "label_smoothing=0.1 is not defined with a hardness offset"),
], ids=["above-one", "negative", "nan", "string", "bool", "sigmoid", "groups", "hardness"])
def test_label_smoothing_refuses_what_it_does_not_define(arguments, error, message):
    q, k = torch.randn(4, 3), torch.randn(6, 3)
    with pytest.raises(error, match=message):
        contrastive_loss(q, k, 2.0, **arguments)
    module_options = {name: arguments[name] for name in ("label_smoothing", "loss") if name in arguments}
    if len(module_options) == len(arguments):  # the module takes no groups or hardness ids at init
        with pytest.raises(error, match=message):
            hf_infcl.InfCLLoss(2.0, **module_options)
