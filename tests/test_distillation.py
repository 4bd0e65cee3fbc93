"""In-batch distillation (docs/contract.md, "Distillation over the batch") through the public
``contrastive_distillation_loss``: the float64 oracle of tests/helpers/oracle_distillation.py checked
against finite differences, every backend against it on fresh random inputs (value and the gradients
of queries, keys and the scale), its identities (kl_div, teacher = student, weight 0 = InfoNCE), the
teacher's lack of gradient, and the errors.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hf_infcl
from hf_infcl import TorchTiles, contrastive_distillation_loss, contrastive_loss
from tests.helpers.oracle import central_differences
from tests.helpers.oracle_distillation import distillation_loss

# Small tiles, so that every statistic is merged across tiles in both directions.
SMALL_TILES = TorchTiles(tile_rows=3, tile_keys=4)
BACKENDS = {"reference": "reference", "torch": SMALL_TILES, "torch-named": "torch"}
# name: (m, k, c, teacher width, positives permuted)
SHAPES = {"m6-k6-c5-t5": (6, 6, 5, 5, False), "m5-k11-c17-t3": (5, 11, 17, 3, True),
          "m7-k9-c33-t20": (7, 9, 33, 20, True)}
REDUCTIONS = ("mean", "sum", "none")


def make_case(m, k, c, teacher_width, permuted, *, seed):
    """Fresh random float64 features of a student and of a teacher that half agrees with it
    (positives more similar than chance for both), scales of a few units, and positives."""
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(m, c, generator=gen, dtype=torch.float64)
    keys = torch.randn(k, c, generator=gen, dtype=torch.float64)
    positives = torch.randperm(k, generator=gen)[:m] if permuted else torch.arange(m)
    keys[positives] += 0.5 * queries
    teacher_queries = torch.randn(m, teacher_width, generator=gen, dtype=torch.float64)
    teacher_keys = torch.randn(k, teacher_width, generator=gen, dtype=torch.float64)
    teacher_keys[positives] += 0.8 * teacher_queries
    scale = float(torch.empty(()).uniform_(0.5, 1.5, generator=gen))
    teacher_scale = float(torch.empty(()).uniform_(0.5, 2.0, generator=gen))
    return dict(queries=queries, keys=keys, teacher_queries=teacher_queries, teacher_keys=teacher_keys,
                scale=scale, teacher_scale=teacher_scale, positives=positives if permuted else None)


def run_loss(case, dtype=torch.float64, **options):
    """Value and gradients (of the sum for "none") of queries, keys and the scale, as float64 NumPy."""
    queries = case["queries"].to(dtype, copy=True).requires_grad_()
    keys = case["keys"].to(dtype, copy=True).requires_grad_()
    scale = torch.tensor(case["scale"], dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                         requires_grad=True)
    value = contrastive_distillation_loss(queries, keys, case["teacher_queries"].to(dtype),
                                          case["teacher_keys"].to(dtype), scale, case["teacher_scale"],
                                          positives=case["positives"], **options)
    value.sum().backward()
    grads = {"queries": queries.grad, "keys": keys.grad, "scale": scale.grad}
    return value.detach().double().numpy(), {name: g.double().numpy() for name, g in grads.items()}


def oracle(case, **options):
    positives = None if case["positives"] is None else case["positives"].numpy()
    return distillation_loss(case["queries"].numpy(), case["keys"].numpy(), case["teacher_queries"].numpy(),
                             case["teacher_keys"].numpy(), case["scale"], case["teacher_scale"],
                             positives=positives, **options)


def assert_close(actual, expected, rtol, what):
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    error = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12)
    assert error <= rtol, f"{what}: norm-wise relative error {error:.2e} > {rtol:.0e}"


# --------------------------------------------------------------------------------------------
# The oracle itself


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("weight", [1.0, 0.3], ids=["kl", "mixed"])
def test_oracle_gradients_are_the_finite_differences_of_its_value(symmetric, weight):
    case = make_case(4, 6, 3, 2, True, seed=11)
    options = dict(symmetric=symmetric, distillation_weight=weight, reduction="mean")
    _, grads = oracle(case, **options)

    def value(**changed):
        return oracle({**case, **changed}, **options)[0]

    for name in ("queries", "keys", "scale"):
        assert_close(grads[name], central_differences(value, case, name), 1e-7, name)


# --------------------------------------------------------------------------------------------
# Every backend against the oracle


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weight", [1.0, 0.3, 0.0], ids=["kl", "mixed", "nce"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("backend", BACKENDS, ids=list(BACKENDS))
def test_float64_matches_the_oracle(backend, shape, symmetric, weight, reduction):
    case = make_case(*SHAPES[shape], seed=zlib.crc32(f"{shape}-{symmetric}-{weight}-{reduction}".encode()))
    options = dict(symmetric=symmetric, distillation_weight=weight, reduction=reduction)
    value, grads = run_loss(case, backend=BACKENDS[backend], **options)
    expected_value, expected_grads = oracle(case, **options)
    assert_close(value, expected_value, 1e-12, "loss")
    for name in ("queries", "keys", "scale"):
        assert_close(grads[name], expected_grads[name], 1e-11, name)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_float32_at_a_large_scale_is_within_the_fp32_tolerance(backend, symmetric):
    """CLIP-sized logits (L2-normalised features, scale near 100): the statistics keep fp32 inputs
    within docs/contract.md's 1e-5 of float64."""
    case = make_case(9, 14, 40, 24, True, seed=5)
    for name in ("queries", "keys", "teacher_queries", "teacher_keys"):
        case[name] = F.normalize(case[name], dim=1)
    case.update(scale=80.0, teacher_scale=60.0)
    options = dict(symmetric=symmetric, distillation_weight=0.7)
    value, grads = run_loss(case, dtype=torch.float32, backend=BACKENDS[backend], **options)
    expected_value, expected_grads = oracle(case, **options)
    assert_close(value, expected_value, 1e-5, "loss")
    for name in ("queries", "keys", "scale"):
        assert_close(grads[name], expected_grads[name], 1e-5, name)


# --------------------------------------------------------------------------------------------
# Identities


@pytest.mark.parametrize("backend", BACKENDS, ids=list(BACKENDS))
def test_equals_kl_div_on_the_materialised_logits(backend):
    case = make_case(8, 8, 6, 4, False, seed=3)
    z = case["scale"] * case["queries"] @ case["keys"].T
    t = case["teacher_scale"] * case["teacher_queries"] @ case["teacher_keys"].T

    def kl_div(student, teacher):
        return F.kl_div(F.log_softmax(student, 1), F.log_softmax(teacher, 1), log_target=True,
                        reduction="none").sum(1)

    rows = kl_div(z, t)
    for symmetric, expected in ((False, rows), (True, (rows + kl_div(z.T, t.T)) / 2)):
        value, _ = run_loss(case, backend=BACKENDS[backend], symmetric=symmetric, reduction="none")
        assert_close(value, expected.numpy(), 1e-12, f"symmetric={symmetric}")


@pytest.mark.parametrize("backend", BACKENDS, ids=list(BACKENDS))
def test_a_teacher_equal_to_the_student_gives_zero_loss_and_gradient(backend):
    case = make_case(6, 9, 7, 7, True, seed=8)
    case.update(teacher_queries=case["queries"].clone(), teacher_keys=case["keys"].clone(),
                teacher_scale=case["scale"])
    value, grads = run_loss(case, backend=BACKENDS[backend], reduction="none")
    assert np.abs(value).max() < 1e-13
    for name in ("queries", "keys", "scale"):
        assert np.abs(grads[name]).max() < 1e-13, name
    # the teacher's own temperature counts: the same embeddings at another scale disagree
    case["teacher_scale"] = 2 * case["scale"]
    value, _ = run_loss(case, backend=BACKENDS[backend], reduction="none")
    assert value.min() > 1e-6


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_weight_zero_is_contrastive_loss(symmetric):
    case = make_case(5, 11, 17, 3, True, seed=2)
    value, grads = run_loss(case, backend=SMALL_TILES, symmetric=symmetric, distillation_weight=0.0)
    queries = case["queries"].clone().requires_grad_()
    keys = case["keys"].clone().requires_grad_()
    expected = contrastive_loss(queries, keys, case["scale"], symmetric=symmetric,
                                positives=case["positives"], backend="reference")
    expected.backward()
    assert_close(value, expected.item(), 1e-12, "loss")
    assert_close(grads["queries"], queries.grad.numpy(), 1e-11, "queries")
    assert_close(grads["keys"], keys.grad.numpy(), 1e-11, "keys")


@pytest.mark.parametrize("backend", BACKENDS, ids=list(BACKENDS))
def test_the_teacher_gets_no_gradient(backend):
    case = make_case(5, 7, 4, 3, False, seed=4)
    teacher_queries = case["teacher_queries"].clone().requires_grad_()
    teacher_keys = case["teacher_keys"].clone().requires_grad_()
    teacher_scale = torch.tensor(case["teacher_scale"], dtype=torch.float64, requires_grad=True)
    queries = case["queries"].clone().requires_grad_()
    loss = contrastive_distillation_loss(queries, case["keys"], teacher_queries, teacher_keys, case["scale"],
                                         teacher_scale, backend=BACKENDS[backend])
    loss.backward()
    assert queries.grad is not None and queries.grad.abs().max() > 0
    assert teacher_queries.grad is None and teacher_keys.grad is None and teacher_scale.grad is None


def test_top_level_export():
    assert hf_infcl.contrastive_distillation_loss is contrastive_distillation_loss
    assert "contrastive_distillation_loss" in hf_infcl.__all__


# --------------------------------------------------------------------------------------------
# Errors: raised before any work, naming the argument


def _arguments(**changed):
    case = make_case(4, 6, 5, 3, False, seed=0)
    arguments = dict(queries=case["queries"], keys=case["keys"], teacher_queries=case["teacher_queries"],
                     teacher_keys=case["teacher_keys"], logit_scale=1.0, teacher_logit_scale=1.0)
    arguments.update(changed)
    return arguments


def _teacher(rows, width=3, dtype=torch.float64):
    return torch.randn(rows, width, dtype=dtype)


@pytest.mark.parametrize("changed, error, match", [
    (dict(teacher_keys=None), ValueError, "teacher_queries was given without teacher_keys"),
    (dict(teacher_queries=None), ValueError, "teacher_keys was given without teacher_queries"),
    (dict(teacher_queries=None, teacher_keys=None), TypeError, "teacher_queries and teacher_keys must be"),
    (dict(teacher_queries=_teacher(5)), ValueError, "teacher_queries has 5 rows but queries has 4"),
    (dict(teacher_keys=_teacher(4)), ValueError, "teacher_keys has 4 rows but keys has 6"),
    (dict(teacher_keys=_teacher(6, width=2)), ValueError, "teacher_queries have width 3 but teacher_keys"),
    (dict(teacher_queries=_teacher(4, 0), teacher_keys=_teacher(6, 0)), ValueError, "width 0"),
    (dict(teacher_queries=_teacher(4, dtype=torch.float32)), TypeError, "teacher_queries has dtype"),
    (dict(teacher_keys=_teacher(6).to("meta")), ValueError, "teacher_keys is on meta"),
    (dict(teacher_queries=torch.randn(4, 3, 1, dtype=torch.float64)), ValueError,
     "teacher_queries must be 2-D"),
    (dict(teacher_keys=torch.ones(6, 3, dtype=torch.long)), TypeError, "teacher_keys must be a floating"),
    (dict(teacher_logit_scale=0.0), ValueError, "teacher_logit_scale must be > 0"),
    (dict(teacher_logit_scale=torch.tensor(-2.0)), ValueError, "teacher_logit_scale must be > 0"),
    (dict(teacher_logit_scale=torch.ones(2)), ValueError, "teacher_logit_scale must be a scalar"),
    (dict(teacher_logit_scale=True), TypeError, "teacher_logit_scale must be a float"),
    (dict(teacher_logit_scale="1"), TypeError, "teacher_logit_scale must be a float"),
    (dict(logit_scale=-1.0), ValueError, "logit_scale must be > 0"),
    (dict(distillation_weight=1.5), ValueError, "distillation_weight must be in"),
    (dict(distillation_weight=True), TypeError, "distillation_weight must be a float"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(backend="triton"), ValueError, "backend='triton' needs CUDA tensors"),
    (dict(backend=object()), TypeError, "backend must be a name or a block-ops object"),
    (dict(positives=torch.tensor([0, 1, 2, 9])), ValueError, "positives must index keys"),
], ids=lambda value: None)
def test_bad_arguments_raise_naming_them(changed, error, match):
    with pytest.raises(error, match=match):
        contrastive_distillation_loss(**_arguments(**changed))


def test_block_ops_without_distillation_are_refused():
    class NoDistillation:  # block ops of the contrastive loss only
        forward_block = backward_block = staticmethod(lambda *args, **kwargs: None)

    with pytest.raises(TypeError, match="backend NoDistillation has no distillation_forward_block"):
        contrastive_distillation_loss(**_arguments(backend=NoDistillation()))


def test_process_group_auto_outside_torch_distributed_is_this_process():
    """Several processes run the ring (tests/test_distillation_ring.py); "auto" without
    torch.distributed is this process's rows and keys, bit for bit."""
    arguments = _arguments(symmetric=True, distillation_weight=0.4, backend=SMALL_TILES)
    local = contrastive_distillation_loss(**arguments)
    assert torch.equal(contrastive_distillation_loss(**arguments, process_group="auto"), local)

# --------------------------------------------------------------------------------------------
# GPU: "auto" runs the torch tiles on CUDA until the Triton kernels are measured there; the kernels
# (TritonBlocks' distillation_*_block) run when a TritonBlocks object is passed


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_auto_matches_the_oracle(dtype, backend):
    if backend == "triton-blocks":
        from hf_infcl.ops.triton import TritonBlocks

        backend = TritonBlocks()
    case = make_case(300, 523, 96, 64, True, seed=9)
    for name in ("queries", "keys", "teacher_queries", "teacher_keys"):
        case[name] = F.normalize(case[name], dim=1)
    case.update(scale=50.0, teacher_scale=40.0)
    cuda = {name: value.cuda() if torch.is_tensor(value) else value for name, value in case.items()}
    queries = cuda["queries"].to(dtype).requires_grad_()
    keys = cuda["keys"].to(dtype).requires_grad_()
    loss = contrastive_distillation_loss(queries, keys, cuda["teacher_queries"].to(dtype),
                                         cuda["teacher_keys"].to(dtype), cuda["scale"], cuda["teacher_scale"],
                                         positives=cuda["positives"], distillation_weight=0.5,
                                         precision="ieee", backend=backend)
    loss.backward()
    expected_value, expected_grads = oracle(
        {name: value.to(dtype).double() if torch.is_tensor(value) and value.is_floating_point() else value
         for name, value in case.items()}, distillation_weight=0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(loss.item(), expected_value, tolerance, "loss")
    assert_close(queries.grad.double().cpu().numpy(), expected_grads["queries"], tolerance, "queries")
    assert_close(keys.grad.double().cpu().numpy(), expected_grads["keys"], tolerance, "keys")
