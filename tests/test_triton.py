"""The Triton backend: kernels under the CPU interpreter (CI) and on a CUDA GPU (``-m gpu``).

CPU: ``tests/helpers/triton_interpreted.py`` runs in a subprocess with ``TRITON_INTERPRET=1``, which must
be set before the kernels are defined and must not leak into the rest of the suite.

GPU: every case compares ``TritonBlocks`` (buffers poisoned with NaN first) with the tile-wise
torch backend on float64 copies of the same rounded inputs, on the GPU, norm-wise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_infcl import contrastive_loss
from hf_infcl.ops.tiled import TorchTiles

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_under_interpreter_match_float64_reference():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "pytest", "tests/helpers/triton_interpreted.py", "-q", "-p",
               "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    # a limit against a hang, well above the suite's time on a small CI machine; it does not time it
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.mark.parametrize("field, value, error, message", [
    ("tile_rows", 0, ValueError, "tile_rows must be a positive int or None, got 0"),
    ("column_buffer_entries", 2.5, ValueError, "column_buffer_entries must be a positive int or None"),
    ("sigmoid_logits", "fast", ValueError, "sigmoid_logits must be one of"),
    ("softmax_statistics", "gemm", ValueError, "softmax_statistics must be one of"),
    ("fused_columns", "yes", TypeError, "fused_columns must be True or False, got 'yes'"),
    ("tf32_via_fp16", None, TypeError, "tf32_via_fp16 must be True or False, got None"),
])
def test_triton_blocks_refuse_bad_settings_naming_them(field, value, error, message):
    pytest.importorskip("triton")
    from hf_infcl.ops.triton import TritonBlocks

    with pytest.raises(error, match=message):
        TritonBlocks(**{field: value})


# ----------------------------------------------------------------------------------------------
# GPU

# Norm-wise relative tolerances (docs/contract.md, "Accuracy").
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "tf32": 3e-3, "ieee": 1e-5}
DTYPES = {"bf16": (torch.bfloat16, "auto"), "fp16": (torch.float16, "auto"),
          "tf32": (torch.float32, "tf32"), "ieee": (torch.float32, "ieee")}
LOSSES = {
    "softmax-sym": dict(loss="softmax", symmetric=True, use_bias=False),
    "softmax-asym": dict(loss="softmax", symmetric=False, use_bias=False),
    "sigmoid": dict(loss="sigmoid", symmetric=False, use_bias=True),
}
# (m, k, c, dtype, loss, groups): hard negatives k = 3m, every width of the issue, each dtype.
GPU_CASES = [
    (1000, 3000, 1, "bf16", "softmax-sym", True),
    (777, 2331, 96, "fp16", "sigmoid", True),
    (1000, 3000, 257, "tf32", "softmax-asym", False),
    (1024, 3072, 512, "bf16", "softmax-sym", True),
    (600, 1800, 768, "ieee", "softmax-sym", True),
    (900, 2700, 1024, "bf16", "sigmoid", False),
    (513, 1539, 512, "tf32", "sigmoid", True),
    (2048, 6144, 768, "fp16", "softmax-sym", False),
    (300, 900, 96, "ieee", "sigmoid", False),
    (5000, 5000, 1024, "tf32", "softmax-sym", True),
]


def _case_id(case):
    m, k, c, dtype, loss, groups = case
    return f"m{m}-k{k}-c{c}-{dtype}-{loss}" + ("-groups" if groups else "")


def _gpu_case(m, k, c, groups, seed, hardness_mode=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, device="cuda"), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(k, c, generator=gen, device="cuda"), dim=1)
    keys[:m] += 0.5 * q
    case = dict(queries=q, keys=keys, scale=14.0 + 2.0 * torch.rand((), generator=gen, device="cuda").item(),
                bias=-10.0 + torch.rand((), generator=gen, device="cuda").item(),
                row_weights=torch.rand(m, generator=gen, device="cuda", dtype=torch.float64) / m,
                query_groups=None, key_groups=None)
    if groups:
        case["query_groups"] = torch.randint(0, m // 3, (m,), generator=gen, device="cuda")
        case["key_groups"] = torch.randint(0, m // 3, (k,), generator=gen, device="cuda")
    if hardness_mode is not None:
        # MNRL's layout: key j belongs to example j mod m (its positive, then one per negatives
        # column), with some keys nobody's (-1, e.g. the joint layout's other blocks).
        owners = torch.arange(k, device="cuda") % m
        owners[torch.rand(k, generator=gen, device="cuda") < 0.1] = -1
        owners[:m] = torch.arange(m, device="cuda")
        case["hardness"] = dict(hardness_mode=hardness_mode, hardness_strength=5.0,
                                query_ids=torch.arange(m, device="cuda"), key_owners=owners)
    return case


def _loss_and_grads(case, dtype, backend, precision, loss, symmetric, use_bias, reduction="none"):
    """The per-row losses weighted by random row weights, or with ``reduction`` "mean" / "sum"
    (the sigmoid loss's one pass) that reduction times a random weight; and the gradients."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q = case["queries"].to(dtype).requires_grad_(True)
    k = case["keys"].to(dtype).requires_grad_(True)
    scale = torch.tensor(case["scale"], dtype=acc, device="cuda", requires_grad=True)
    bias = torch.tensor(case["bias"], dtype=acc, device="cuda", requires_grad=True) if use_bias else None
    objectives = {name: value.to(dtype) if torch.is_tensor(value) else value
                  for name, value in case.get("objectives", {}).items()}
    per_row = contrastive_loss(q, k, scale, bias, loss=loss, symmetric=symmetric, reduction=reduction,
                               query_groups=case["query_groups"], key_groups=case["key_groups"],
                               backend=backend, precision=precision, **case.get("hardness", {}),
                               **objectives)
    if reduction == "none":
        total = (per_row.double() * case["row_weights"]).sum()
    else:
        total = per_row.double() * case["row_weights"][0] * case["row_weights"].numel()
    leaves = [q, k, scale] + ([bias] if use_bias else [])
    grads = torch.autograd.grad(total, leaves)
    named = {n: g.double() for n, g in zip(["dq", "dk", "dscale", "dbias"], grads)}
    return {"loss": per_row.detach().double(), **named}


def _errors(got, expected):
    for name, value in got.items():
        assert torch.isfinite(value).all(), f"{name} has non-finite entries"
    return {n: float((got[n] - expected[n]).norm() / expected[n].norm().clamp_min(1e-30)) for n in expected}


def _check_against_float64(m, k, c, dtype_name, loss_name, groups, backend, hardness_mode=None,
                           reduction="none", objectives=None):
    dtype, precision = DTYPES[dtype_name]
    seed = int(torch.randint(0, 2**31, ()).item())
    case = _gpu_case(m, k, c, groups, seed, hardness_mode)
    if objectives is not None:
        case["objectives"] = objectives(m, k, seed)
    options = dict(LOSSES[loss_name], reduction=reduction)
    rounded = dict(case, queries=case["queries"].to(dtype).double(), keys=case["keys"].to(dtype).double())
    if objectives is not None:
        rounded["objectives"] = {name: value.to(dtype).double() if torch.is_tensor(value) else value
                                 for name, value in case["objectives"].items()}
    expected = _loss_and_grads(rounded, torch.float64, TorchTiles(4096, 4096), "ieee", **options)
    got = _loss_and_grads(case, dtype, backend, precision, **options)
    errors = _errors(got, expected)
    assert max(errors.values()) < TOLERANCE[dtype_name], (seed, errors)
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_case_id(c) for c in GPU_CASES])
def test_gpu_matches_float64_reference(case):
    from hf_infcl.ops.triton import TritonBlocks

    # Small super-tiles and column-partial buffers: several super-tiles and several row chunks of
    # the fused forward per problem, so the accumulation across them is exercised.
    blocks = TritonBlocks(tile_rows=1536, tile_keys=2560, poison=True, column_buffer_entries=2**15)
    _check_against_float64(*case, backend=blocks)


SIGMOID_CASES = [case for case in GPU_CASES if case[4] == "sigmoid"]


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["auto", "gemm", "fused"])
@pytest.mark.parametrize("case", SIGMOID_CASES, ids=[_case_id(c) for c in SIGMOID_CASES])
def test_gpu_sigmoid_one_pass_matches_float64_reference(case, route):
    """The sigmoid loss's one pass (a mean: gradients computed in the forward) by each route to
    the dot products: the default (the Gluon kernel on Hopper for half-precision inputs without a
    mask, else cuBLAS), cuBLAS and the elementwise kernel, or the fused kernel."""
    from hf_infcl.ops.triton import TritonBlocks

    blocks = TritonBlocks(tile_rows=1536, tile_keys=2560, poison=True, sigmoid_logits=route)
    for reduction in ("mean", "sum"):
        _check_against_float64(*case, backend=blocks, reduction=reduction)


# (m, k, c, dtype, loss, groups, hardness_mode): the hardness offset in every dtype, both
# directions, with and without groups; softmax only (it offsets softmax logits).
HARDNESS_CASES = [
    (1000, 3000, 1, "bf16", "softmax-sym", True, "in_batch_negatives"),
    (777, 2331, 96, "fp16", "softmax-asym", False, "hard_negatives"),
    (1000, 3000, 257, "tf32", "softmax-sym", False, "all_negatives"),
    (1024, 3072, 512, "bf16", "softmax-asym", True, "hard_negatives"),
    (600, 1800, 768, "ieee", "softmax-sym", True, "in_batch_negatives"),
    (2048, 6144, 1024, "fp16", "softmax-sym", False, "all_negatives"),
    (513, 1539, 512, "tf32", "softmax-asym", True, "in_batch_negatives"),
]


def _check_other_routes(problem, **options):
    """The same problem through the TF32 kernels (``tf32_via_fp16=False``) and the two-pass forward,
    where they apply."""
    from hf_infcl.ops.triton import TritonBlocks

    if problem[3] == "tf32":
        _check_against_float64(*problem, backend=TritonBlocks(poison=True, tf32_via_fp16=False), **options)
    if problem[4] == "softmax-sym":
        _check_against_float64(*problem, backend=TritonBlocks(poison=True, fused_columns=False), **options)


@pytest.mark.gpu
@pytest.mark.parametrize("case", HARDNESS_CASES,
                         ids=[_case_id(c[:6]) + f"-{c[6]}" for c in HARDNESS_CASES])
def test_gpu_hardness_offset_matches_float64_reference(case):
    """The in-kernel hardness offset (HARDNESS specialisations of both kernels) against the tiled
    float64 backend, fused and two-pass forwards and the TF32 emulation through scaled fp16."""
    from hf_infcl.ops.triton import TritonBlocks

    *problem, hardness_mode = case
    blocks = TritonBlocks(tile_rows=1536, tile_keys=2560, poison=True, column_buffer_entries=2**15)
    _check_against_float64(*problem, backend=blocks, hardness_mode=hardness_mode)
    _check_other_routes(problem, hardness_mode=hardness_mode)


def _objectives(mode, filter_name):
    """``contrastive_loss``'s several-positives and filter arguments for a GPU case. "guide": a guide
    of small integers (exact in every dtype, its dot products exact in fp32) with a margin of
    0.5, so that no score lies near a threshold and every backend leaves out the same entries;
    "own": the model's own scores, margin 0.05 (a score within rounding of its threshold may fall
    either way: bf16 and fp16 only, whose tolerance covers a few such entries)."""
    def make(m, k, seed):
        arguments = dict(group_positives=mode)
        if filter_name == "own":
            arguments.update(false_negative_margin=0.05)
        elif filter_name == "guide":
            gen = torch.Generator(device="cuda").manual_seed(seed + 1)

            def small_integers(rows):
                return torch.randint(-2, 3, (rows, 16), generator=gen, device="cuda").double()

            arguments.update(false_negative_margin=0.5, guide_queries=small_integers(m),
                             guide_keys=small_integers(k))
        return arguments
    return make


# (m, k, c, dtype, loss, group_positives, filter): several positives (groups of about 3 rows and 9
# keys) and the score filter in every dtype, both losses and directions.
OBJECTIVE_GPU_CASES = [
    (1000, 3000, 512, "bf16", "softmax-sym", "any", "own"),
    (777, 2331, 96, "fp16", "sigmoid", "each", "guide"),
    (1024, 3072, 256, "tf32", "softmax-asym", "each", "guide"),
    (900, 2700, 768, "bf16", "softmax-sym", None, "guide"),
    (600, 1800, 128, "ieee", "softmax-sym", "any", "guide"),
    (2048, 6144, 768, "bf16", "sigmoid", "any", None),
    (1536, 4608, 1024, "fp16", "softmax-asym", None, "own"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", OBJECTIVE_GPU_CASES,
                         ids=[_case_id((*c[:5], False)) + f"-{c[5]}-{c[6]}" for c in OBJECTIVE_GPU_CASES])
def test_gpu_objectives_match_float64_reference(case, monkeypatch):
    """Several positives per row and the filter's masks (FILTER, GUIDE, GROUP_POSITIVES) against
    the tiled float64 backend: fused and two-pass forwards, the TF32 emulation, the sigmoid one
    pass (a mean) through the fused kernel. The softmax loss's guided filter also with its
    left-out entries listed whatever the share of rows that has any and their number (the guide
    here leaves entries out of most rows: by default, the backward then filters every tile)."""
    from hf_infcl.ops.triton import TritonBlocks

    *problem, mode, filter_name = case
    problem = (*problem, True)  # groups
    objectives = _objectives(mode, filter_name)
    blocks = TritonBlocks(tile_rows=1536, tile_keys=2560, poison=True, column_buffer_entries=2**15)
    _check_against_float64(*problem, backend=blocks, objectives=objectives)
    if filter_name == "guide" and problem[4] != "sigmoid":
        from hf_infcl.ops.triton import blocks as triton_blocks

        counts, take_back = [], triton_blocks.take_back_left_out

        def counted(left_out, *args):
            counts.append(int(left_out.count))
            return take_back(left_out, *args)

        monkeypatch.setattr(triton_blocks, "take_back_left_out", counted)
        listed = dataclasses.replace(blocks, listed_row_share=1.0, listed_entries_per_vector=10**6)
        _check_against_float64(*problem, backend=listed, objectives=objectives)
        assert counts and counts[0] > 0, counts  # the backward took the listed entries back
    if problem[4] == "sigmoid":
        _check_against_float64(*problem, backend=blocks, objectives=objectives, reduction="mean")
    _check_other_routes(problem, objectives=objectives)


TWO_PASS_CASES = [
    (1024, 3072, 512, "bf16", "softmax-sym", True),
    (600, 1800, 768, "ieee", "softmax-sym", False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", TWO_PASS_CASES, ids=[_case_id(c) for c in TWO_PASS_CASES])
def test_gpu_two_pass_forward_matches_float64_reference(case):
    """The column statistic from its own column-major pass (fused_columns=False)."""
    from hf_infcl.ops.triton import TritonBlocks

    _check_against_float64(*case, backend=TritonBlocks(poison=True, fused_columns=False))


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
def test_gpu_tf32_kernels_match_float64_reference(groups):
    """fp32 inputs on TF32 tensor cores in the kernels (tf32_via_fp16=False; the default multiplies
    scaled fp16 copies)."""
    from hf_infcl.ops.triton import TritonBlocks

    _check_against_float64(1000, 3000, 257, "tf32", "softmax-sym", groups,
                           backend=TritonBlocks(poison=True, tf32_via_fp16=False))


@pytest.mark.gpu
def test_gpu_first_call_that_autotunes_is_correct(tmp_path, monkeypatch):
    """The call that autotunes must already be right: tuning runs every config on the live
    buffers (the column partials, the row sums). A width no other test uses makes this call the
    first of its tuning key in this process, and an empty tuning store (``HF_INFCL_CACHE``) the
    first on this machine. Meaningful when run without HF_INFCL_TRITON_AUTOTUNE=0."""
    from hf_infcl.ops.triton import TritonBlocks

    monkeypatch.setenv("HF_INFCL_CACHE", str(tmp_path))

    _check_against_float64(6000, 9000, 200, "bf16", "softmax-sym", True, backend=TritonBlocks())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["bf16", "ieee"])
def test_gpu_clip_scale_100_matches_float64_reference(dtype_name):
    """CLIP's largest logit scale (100) with confident and unconfident rows: logits spread over
    ~200, so some tiles take the kernels' exact paths (a second exponential) and others the
    one-exponential shortcut; both must agree with float64."""
    from hf_infcl.ops.triton import TritonBlocks

    dtype, precision = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ()).item()))
    m, c = 3000, 256
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, device="cuda"), dim=1)
    # Half the pairs nearly identical (row LSE ~ 100), half unrelated (row LSE ~ 20).
    noise = torch.where(torch.arange(m, device="cuda")[:, None] % 2 == 0, 0.1, 10.0)
    keys = torch.nn.functional.normalize(q + noise * torch.randn(m, c, generator=gen, device="cuda"), dim=1)
    case = dict(queries=q, keys=keys, scale=100.0, bias=0.0, query_groups=None, key_groups=None,
                row_weights=torch.rand(m, generator=gen, device="cuda", dtype=torch.float64) / m)
    options = LOSSES["softmax-sym"]
    rounded = dict(case, queries=q.to(dtype).double(), keys=keys.to(dtype).double())
    expected = _loss_and_grads(rounded, torch.float64, TorchTiles(4096, 4096), "ieee", **options)
    got = _loss_and_grads(case, dtype, TritonBlocks(poison=True), precision, **options)
    errors = _errors(got, expected)
    # fp32 logits near 100 carry an absolute rounding error of ~100 * 2^-24 each.
    tolerance = TOLERANCE[dtype_name] * (10 if dtype_name == "ieee" else 1)
    assert max(errors.values()) < tolerance, errors


@pytest.mark.gpu
def test_gpu_backend_name_with_mean_reduction():
    """backend="triton" through the public API, learnable scale, default mean reduction."""
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ()).item()))
    q = torch.randn(3000, 512, generator=gen, device="cuda")
    k = torch.randn(4000, 512, generator=gen, device="cuda")
    results = []
    for backend, dtype in (("triton", torch.bfloat16), (TorchTiles(), torch.float64)):
        qq = q.to(torch.bfloat16).to(dtype).requires_grad_(True)
        kk = k.to(torch.bfloat16).to(dtype).requires_grad_(True)
        scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        scale = torch.tensor(1 / 0.07, device="cuda", dtype=scale_dtype, requires_grad=True)
        normalize = torch.nn.functional.normalize
        loss = contrastive_loss(normalize(qq, dim=1), normalize(kk, dim=1), scale, backend=backend)
        results.append([loss.double()] + [g.double() for g in torch.autograd.grad(loss, [qq, kk, scale])])
    for got, expected in zip(*results):
        assert float((got - expected).detach().norm() / expected.detach().norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("loss_name", ["softmax-sym", "sigmoid"])
def test_gpu_a_bad_scale_read_behind_queued_work_raises_and_the_next_call_is_exact(loss_name):
    """The scale is read after the statistics are queued (hf_infcl.ops.value_check): made on the
    GPU behind a long product, its value must still be the one checked, and the call must raise
    before it returns, leaving the device fit for the next call."""
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ()).item()))
    q = torch.randn(2000, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2500, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    options = {name: value for name, value in LOSSES[loss_name].items() if name != "use_bias"}
    bias = -10.0 if loss_name == "sigmoid" else None
    for bad in (-(1.0 + torch.rand((), generator=gen, device="cuda")), torch.zeros((), device="cuda")):
        busy = torch.randn(8192, 8192, generator=gen, device="cuda")
        scale = (busy @ busy)[0, 0] * 0.0 + bad  # the scale's value is ready only after the product
        with pytest.raises(ValueError, match="logit_scale must be > 0"):
            contrastive_loss(q, k, scale, bias, **options)
    _check_against_float64(1000, 3000, 257, "bf16", loss_name, False, backend="auto")


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_70k_by_70k_bf16():
    """m * k = 4.9e9 > 2^31 logits: int64 indexing, many super-tiles, split-free row blocks."""
    from hf_infcl.ops.triton import TritonBlocks

    _check_against_float64(70_000, 70_000, 64, "bf16", "softmax-sym", True, backend=TritonBlocks(poison=True))


def test_fp16_copies_round_every_slice_as_the_whole_tensor():
    """The fp16 copies of fp32 inputs (the kernels' and GEMMs' operands by default): each value
    rounds to fp16 as to TF32, whatever tensor it sits in, so a slice of the keys (the ring's
    backward takes key blocks in slices) multiplies exactly the values the whole block's forward
    did. Divided by its own largest entry, a slice rounded otherwise, and the ring's gradients
    were further from float64 than one process's (CPU, no kernel runs)."""
    from hf_infcl.ops.triton.operands import round_to_tf32, scaled_fp16

    gen = torch.Generator().manual_seed(7)
    queries = torch.nn.functional.normalize(torch.randn(40, 32, generator=gen), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(300, 32, generator=gen), dim=1)

    def values(operands):  # what the copies stand for, in fp32 (exact: the factors are powers of two)
        return (operands.queries.float() * operands.queries_factor,
                operands.keys.float() * operands.keys_factor)

    whole_queries, whole_keys = values(scaled_fp16(queries, keys))
    for lo, hi in ((0, 64), (64, 200), (200, 300), (17, 18)):
        slice_queries, slice_keys = values(scaled_fp16(queries, keys[lo:hi]))
        assert torch.equal(slice_keys, whole_keys[lo:hi]), (lo, hi)
        assert torch.equal(slice_queries, whole_queries)
    # above fp16's subnormals, the same values as TF32's rounding to nearest
    normal = whole_keys.abs() >= 2.0**-14 * float(scaled_fp16(queries, keys).keys_factor)
    assert torch.equal(whole_keys[normal], round_to_tf32(keys)[normal])
    assert normal.float().mean() > 0.99


@pytest.mark.parametrize("via_fp16", [True, False], ids=["fp16-copies", "tf32-kernels"])
def test_sigmoid_dot_products_of_fp32_inputs_stay_fp32(via_fp16):
    """The sigmoid one pass's cuBLAS dot products: fp32 inputs keep fp32 dot products of their fp16
    copies on both routes (only half-precision inputs take fp16 dot products), with a scale
    that undoes the copies' factors exactly (CPU, no kernel runs)."""
    from hf_infcl.ops.spec import StatsSpec
    from hf_infcl.ops.triton.operands import dot_operands, gemm_operands, kernel_operands

    gen = torch.Generator().manual_seed(3)
    queries, keys = 40 * torch.randn(5, 24, generator=gen), 0.01 * torch.randn(9, 24, generator=gen)
    spec = StatsSpec("sigmoid", columns=False, precision="tf32")
    kernel = kernel_operands(spec, queries, keys, torch.tensor(7.0), via_fp16)
    gemm = gemm_operands(spec, queries, keys, kernel, via_fp16)
    dot_queries, dot_keys, scale, product_dtype = dot_operands(gemm, kernel, kernel.scale)
    assert product_dtype == torch.float32 and dot_queries.dtype == torch.float16
    logits = scale * (dot_queries.double() @ dot_keys.double().T)
    expected = 7.0 * (queries.double() @ keys.double().T)
    assert torch.allclose(logits, expected, rtol=0, atol=2e-3 * float(expected.abs().max()))


def test_round_to_tf32_rounds_to_nearest():
    """The pre-rounding that makes Triton's truncating TF32 dot unbiased (CPU: no kernel runs)."""
    from hf_infcl.ops.triton.operands import round_to_tf32

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(100_000, generator=gen) * torch.logspace(-30, 30, 100_000).to(torch.float32)
    rounded = round_to_tf32(x)
    assert (rounded.view(torch.int32) & 0x1FFF == 0).all(), "more than 10 mantissa bits left"
    # Nearest: no TF32 value is closer (the neighbours differ by one unit of the 10th bit).
    unit = (rounded.view(torch.int32) + 0x2000).view(torch.float32) - rounded
    error = (x.double() - rounded.double()).abs()
    assert (error <= unit.double().abs() / 2 * (1 + 1e-6)).all()
    assert (x.sign() == rounded.sign()).all()
    # Unbiased where truncation is not: the mean relative change is ~0, not -2^-11.
    relative = ((rounded.double() - x.double()) / x.double().abs())
    assert abs(float(relative.mean())) < 2e-5 < float(relative.abs().mean())
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.0])
    assert torch.equal(round_to_tf32(special), special)
    assert torch.isnan(round_to_tf32(torch.tensor([float("nan")]))).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fp16-copies", "tf32-kernels"])
def test_gpu_fp32_loss_is_unbiased_on_a_peaked_softmax(variant):
    """CLIP at scale 1/0.07 with confident positives: the positive logit (~14) is exact fp32, so
    logits that a truncating TF32 dot shrinks shift the loss one way. Random rounding averages out
    over 4096 rows and 8192 keys, a bias does not: on an H100 the mean loss was 1.9e-4 from
    float64 without the round-to-nearest of the operands and 1.5e-7 with it (gradients 1.8e-4 and
    2.4e-5)."""
    from hf_infcl.ops.triton import TritonBlocks

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ()).item()))
    m, c = 4096, 256
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, device="cuda"), dim=1)
    keys = torch.nn.functional.normalize(q + 0.15 * torch.randn(m, c, generator=gen, device="cuda"), dim=1)
    negatives = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, device="cuda"), dim=1)
    keys = torch.cat([keys, negatives])

    def loss_and_grads(dtype, backend, precision):
        qq, kk = q.to(dtype).requires_grad_(True), keys.to(dtype).requires_grad_(True)
        scale = torch.tensor(1 / 0.07, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                             device="cuda", requires_grad=True)
        value = contrastive_loss(qq, kk, scale, backend=backend, precision=precision)
        return [value.detach().double(), *(g.double() for g in torch.autograd.grad(value, [qq, kk, scale]))]

    expected = loss_and_grads(torch.float64, TorchTiles(4096, 4096), "ieee")
    got = loss_and_grads(torch.float32, TritonBlocks(tf32_via_fp16=variant == "fp16-copies"), "tf32")
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(got, expected)]
    print(variant, "loss, queries, keys, scale relative errors:", errors)
    assert errors[0] < 2e-5 and max(errors[1:]) < 1e-4, errors


# ----------------------------------------------------------------------------------------------
# The launch past the autotuner (hf_infcl.ops.triton.launch): every launch of the gradient-tile
# kernel after a super-tile's first takes it, so it must write what a plain launch writes.

# (rows, keys, c, dtype, options): ragged tiles with every label and both directions, whole tiles
# (the unmasked FULL / EVEN_K specialisations) of the sigmoid one pass with G scaled.
LAUNCH_CASES = {
    "softmax-columns-groups-hardness-r37-k45-c20-fp32": (37, 45, 20, torch.float32, "softmax"),
    "sigmoid-one-pass-scaled-r32-k64-c32-fp16": (32, 64, 32, torch.float16, "one-pass"),
}


def grad_tile_launcher(case: str, device: str):
    """A launch of the gradient-tile kernel for ``case`` of :data:`LAUNCH_CASES` on fresh random
    inputs: ``launch(config)`` writes into fresh buffers (G poisoned with NaN) and returns (G, row
    sums, softplus sums, the configuration the launch returned)."""
    from hf_infcl.ops.triton.grad_tile import grad_tile

    rows, keys, c, dtype, route = LAUNCH_CASES[case]
    gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, ()).item()))

    def uniform(*shape, low=0.0, high=1.0):
        return low + (high - low) * torch.rand(*shape, generator=gen, device=device)

    queries = torch.randn(rows, c, generator=gen, device=device).to(dtype)
    keys_ = torch.randn(keys, c, generator=gen, device=device).to(dtype)
    scale, bias = uniform((), low=2.0, high=4.0), uniform((), low=-2.0, high=-1.0)
    options = dict(row_stat=uniform(rows, low=3.0, high=6.0), row_weight=uniform(rows), col_stat=None,
                   col_weight=None, sigmoid=route != "softmax", precision="ieee")
    if route == "softmax":
        groups = dict(row_groups=torch.randint(0, 4, (rows,), generator=gen, device=device),
                      key_groups=torch.randint(0, 4, (keys,), generator=gen, device=device))
        options.update(col_stat=uniform(keys, low=3.0, high=6.0), col_weight=uniform(keys),
                       positive_keys=torch.arange(rows, device=device), key_offset=0, **groups,
                       query_ids=torch.arange(rows, device=device),
                       key_owners=torch.arange(keys, device=device) % rows, hardness=1,
                       hardness_strength=torch.tensor(0.5, device=device))
    inv_g_scale = torch.tensor(4.0, device=device) if route == "one-pass" else None

    def launch(config):
        g = torch.full((rows, keys), float("nan"), dtype=dtype, device=device)
        row_sums = torch.zeros(rows, device=device)
        softplus_sums = torch.zeros(rows, device=device) if route == "one-pass" else None
        chosen = grad_tile(queries, keys_, g, row_sums, scale, bias, inv_g_scale, softplus_sums=softplus_sums,
                           config=config, **options)
        return g, row_sums, softplus_sums, chosen

    return launch


def assert_same_launch(got, expected, exact: bool):
    """G equal to the last bit; the row sums (atomic adds, in any order on a GPU) to rounding."""
    assert torch.equal(got[0], expected[0]) and not got[0].isnan().any()
    for value, reference in zip(got[1:3], expected[1:3]):
        if reference is not None:
            if exact:
                assert torch.equal(value, reference)
            else:
                torch.testing.assert_close(value, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(LAUNCH_CASES))
def test_gpu_launch_past_the_autotuner_equals_a_plain_launch(case, monkeypatch):
    """The first launch of a key through the autotuner (``tuner[grid](...)``), then the same
    launch with the configuration it returned: through the JIT function with the heuristics
    evaluated by ``launch``, then through the compiled kernel's own launcher. All three write the
    same G and row sums."""
    from hf_infcl.ops.triton import launch

    monkeypatch.setattr(launch, "_tunes", lambda: False)  # the first launch: a plain tuner[grid](...)
    monkeypatch.setattr(launch, "_COMPILED", {})
    compiled_launches = []
    launch_compiled = launch._launch_compiled

    def counted(*arguments):
        compiled_launches.append(1)
        launch_compiled(*arguments)

    monkeypatch.setattr(launch, "_launch_compiled", counted)
    run = grad_tile_launcher(case, "cuda")
    plain = run(None)
    through_jit = run(plain[3])
    assert len(launch._COMPILED) == 1 and not compiled_launches
    through_compiled = run(plain[3])
    assert compiled_launches == [1]
    torch.cuda.synchronize()
    assert_same_launch(through_jit, plain, exact=False)
    assert_same_launch(through_compiled, plain, exact=False)


class _TunerReached(Exception):
    """Raised by the stand-in autotuner below when a launch reaches it."""


class _UntouchableTuner:
    arg_names = ["x_ptr", "c"]
    keys = ["c"]

    def __getattribute__(self, name):
        raise _TunerReached(name)


def test_exact_fp32_launches_run_one_config_past_the_autotuner(monkeypatch):
    """``precision="ieee"`` dots take minutes per candidate to compile, so with autotuning on they
    launch the one untuned configuration, never the autotuner; TF32 launches still tune."""
    from hf_infcl.ops.triton import launch

    launched = []
    monkeypatch.setattr(launch, "_tunes", lambda: True)
    monkeypatch.setattr(launch, "_launch_with", lambda kernel, config, *rest: launched.append(config))
    monkeypatch.setattr(launch, "_UNTUNED_CONFIGS", {})
    kernel = launch.TunedKernel("stand-in-r0", None, {}, _UntouchableTuner(), launch.triton.Config)
    for _ in range(2):
        chosen = launch.launch(kernel, (1,), torch.device("cpu"), None, 96, PRECISION="ieee")
    assert launched == [chosen, chosen]  # one object: its compilation is found again by its id
    bm, bn, bk, warps, stages = launch._UNTUNED
    assert chosen.kwargs == {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    assert (chosen.num_warps, chosen.num_stages) == (warps, stages)
    with pytest.raises(_TunerReached):
        launch.launch(kernel, (1,), torch.device("cpu"), None, 96, PRECISION="tf32")


class _KeyOnlyTuner:
    """A stand-in autotuner that forms tuning keys but raises if a launch goes through it."""

    arg_names = ["x_ptr", "c", "size_class"]
    keys = ["c", "size_class"]
    cache: dict = {}

    def __getitem__(self, grid):
        raise _TunerReached("launch")


def test_tiny_problems_run_a_saved_choice_or_the_untuned_config_never_the_autotuner(monkeypatch, tmp_path):
    """Size class 0 (a few microseconds of GPU work) does not wait for tuning: it loads a saved
    choice where the store has one, else runs the untuned configuration; class 1 still tunes."""
    from hf_infcl.ops.triton import launch
    from hf_infcl.ops.triton.tuning_store import TuningStore, file_name

    launched = []
    monkeypatch.setattr(launch, "_tunes", lambda: True)
    monkeypatch.setattr(launch, "_launch_with", lambda kernel, config, *rest: launched.append(config))
    monkeypatch.setattr(launch, "_UNTUNED_CONFIGS", {})
    monkeypatch.setattr(launch, "_CHOSEN", {})
    store = TuningStore(tmp_path / "store", shipped=tmp_path / "shipped")
    monkeypatch.setattr(launch, "TUNING_STORE", store)
    monkeypatch.setattr(launch, "device_name", lambda device: "Stand-in GPU")
    kernel = launch.TunedKernel("stand-in-r0", None, {}, _KeyOnlyTuner(), launch.triton.Config)
    cpu = torch.device("cpu")

    untuned = launch.launch(kernel, (1,), cpu, None, 96, 0)
    assert untuned.kwargs["BLOCK_K"] == launch._UNTUNED[2] and launched == [untuned]
    assert launch.launch(kernel, (1,), cpu, None, 96, size_class=0) is untuned  # remembered per key
    assert not list(tmp_path.rglob("*.json")), "nothing tuned, so nothing saved"

    # A saved choice of the same kernel and key (here a shipped one) wins over the untuned config.
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    saved_choice = {"kwargs": {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16}, "num_warps": 2, "num_stages": 2}
    (shipped / file_name("Stand-in GPU", launch.triton.__version__)).write_text(
        json.dumps({"stand-in-r0": {repr((128, 0)): saved_choice}}))
    saved = launch.launch(kernel, (1,), cpu, None, 128, 0)
    assert (saved.kwargs, saved.num_warps, saved.num_stages) == (saved_choice["kwargs"], 2, 2)
    assert launched[-1] is saved

    with pytest.raises(_TunerReached):
        launch.launch(kernel, (1,), cpu, None, 96, 1)


@pytest.mark.parametrize(("width", "guide_width", "kept_k_steps"), [
    (17, 0, {32}), (32, 0, {32}), (33, 0, {32, 64}), (96, 0, {32, 64, 128}), (768, 0, {32, 64, 128}),
    (17, 100, {32, 64, 128}),  # the guide's width counts: its dots run in the same K steps
])
def test_the_autotuner_times_no_candidate_wider_than_the_width(width, guide_width, kept_k_steps):
    from hf_infcl.ops.triton import launch

    candidates = [launch.triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                                       num_stages=stages)
                  for bm, bn, bk, warps, stages in launch.BASE_SHAPES]
    kept = launch.candidates_for_width(candidates, {"c": width, "c_guide": guide_width})
    assert {config.kwargs["BLOCK_K"] for config in kept} == kept_k_steps
    assert all(config in candidates for config in kept)


def test_the_width_pruning_keeps_the_narrowest_candidates_when_all_are_wider():
    from hf_infcl.ops.triton import launch

    wide = [launch.triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": k}, num_warps=4, num_stages=3)
            for k in (128, 64, 64)]
    assert launch.candidates_for_width(wide, {"c": 8}) == wide[1:]


def test_the_launch_key_of_a_gluon_descriptor_holds_its_layout():
    """``launch_jit`` finds a compiled kernel by the launch's specialisation facts: two Gluon
    descriptors (recognised by their fields) of the same tensor shape and block but other shared
    layouts give two keys, so that a launch never takes a kernel compiled for another layout."""
    import types

    from hf_infcl.ops.triton import launch

    def descriptor(base, layout):
        return types.SimpleNamespace(base=base, shape=list(base.shape), strides=list(base.stride()),
                                     block_shape=[128, 64], layout=layout, padding="zero")

    first, second = torch.zeros(256, 64, dtype=torch.bfloat16), torch.ones(256, 64, dtype=torch.bfloat16)
    same = launch._fact(descriptor(first, "swizzle 128"))
    assert launch._fact(descriptor(second, "swizzle 128")) == same
    assert launch._fact(descriptor(second, "swizzle 64")) != same
    assert launch._fact(descriptor(second[:128], "swizzle 128")) != same


def test_a_launch_key_counts_a_runtime_float_by_its_type_and_a_constexpr_by_its_value(monkeypatch):
    """A float argument (a margin) is compiled as an fp32 value: launches that differ only in it
    share one compiled kernel, whatever the value; a constexpr's value picks the kernel, and so
    does a launch option's."""
    import types

    from hf_infcl.ops.triton import launch

    body = types.SimpleNamespace(params=[types.SimpleNamespace(name="margin", is_constexpr=False),
                                         types.SimpleNamespace(name="BLOCK", is_constexpr=True)])
    compiled = types.SimpleNamespace(**{name: None for name in launch._COMPILED_KERNEL_API})
    jit_launches = []

    class Body:
        params = body.params
        arg_names = ["margin", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: jit_launches.append(args) or compiled

    kernel = Body()
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "_launch_compiled", lambda body, compiled, grid, named: None)
    launch.launch_jit(kernel, (1,), 0.1, BLOCK=64)
    launch.launch_jit(kernel, (1,), 0.25, BLOCK=64)
    assert len(jit_launches) == 1 and len(launch._COMPILED) == 1
    launch.launch_jit(kernel, (1,), 0.25, BLOCK=128)
    assert len(jit_launches) == 2 and len(launch._COMPILED) == 2
    # a launch option is no parameter: by its value too (4 and 8 warps share every integer fact)
    launch.launch_jit(kernel, (1,), 0.25, BLOCK=128, num_warps=4)
    launch.launch_jit(kernel, (1,), 0.25, BLOCK=128, num_warps=8)
    launch.launch_jit(kernel, (1,), 0.5, BLOCK=128, num_warps=8)
    assert len(jit_launches) == 4 and len(launch._COMPILED) == 4


def test_a_launch_key_counts_a_tensor_by_dtype_and_alignment_and_an_integer_by_its_facts():
    """Two launches share a compiled kernel exactly when every argument has the same facts: a
    tensor's dtype and 16-byte alignment (not its address), an integer's being 1, divisibility by
    16 and 32-bit width (not its value); a subclass (a Parameter) counts as its base type."""
    from hf_infcl.ops.triton import launch

    base = torch.zeros(64, dtype=torch.float32)
    def facts(values):
        return [launch._fact(value) for value in values]

    assert facts([base, 32]) == facts([base[4:], 48])  # 16 bytes further on, another multiple of 16
    assert facts([base, 32]) != facts([base[1:], 32])  # 4 bytes: not aligned
    assert facts([base, 32]) != facts([base.to(torch.float16), 32])
    assert facts([base, 32]) != facts([base, 33]) != facts([base, 1])
    assert facts([base, 32]) != facts([base, 2**32])
    assert facts([torch.nn.Parameter(base), 32]) == facts([base, 32])
    assert facts([0.5, None, True]) == facts([0.25, None, True]) != facts([0.5, None, False])


def test_a_launch_makes_its_jit_keyword_arguments_only_when_it_compiles(monkeypatch):
    """Past the autotuner, the JIT function's keyword arguments (the config's and the heuristics')
    are made only for a launch that goes through the JIT function: host time per launch."""
    import types

    from hf_infcl.ops.triton import launch

    compiled = types.SimpleNamespace(**{name: None for name in launch._COMPILED_KERNEL_API})
    jit_launches, made = [], []

    class Body:
        params = [types.SimpleNamespace(name="n", is_constexpr=False)]
        arg_names = ["n"]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: jit_launches.append(kwargs) or compiled

    def kwargs():
        made.append(1)
        return {"num_warps": 4}

    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "_launch_compiled", lambda body, compiled, grid, named: None)
    body = Body()
    for n in (32, 64, 96):
        launch._launch_cached(body, None, (1,), (n,), kwargs, {"n": n})
    assert jit_launches == [{"num_warps": 4}] and made == [1]
