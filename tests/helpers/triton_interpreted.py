"""The Triton kernels under ``TRITON_INTERPRET=1`` on CPU, against the float64 reference.

Not collected by pytest directly (its name does not start with ``test_``): ``tests/test_triton.py``
runs it in a subprocess with the variable set, because it must be set before any kernel is
defined and must not leak into the rest of the suite. Run it by hand with
``TRITON_INTERPRET=1 python -m pytest tests/helpers/triton_interpreted.py -q``.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from hf_infcl import contrastive_loss
from hf_infcl.ops.spec import GroupMask, HardnessOffset, StatsSpec
from hf_infcl.ops.tiled import TorchTiles
from tests.helpers.hardness_cases import with_hardness
from tests.helpers.oracle_distillation import soft_target_stats_direct

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (run through tests/test_triton.py)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hf_infcl.ops.triton import TritonBlocks  # noqa: E402  (after the interpreter check)
from hf_infcl.ops.triton.jit_math import round_to_tf32 as jit_round_to_tf32  # noqa: E402

# Small super-tiles, split statistics and a small column-partial buffer, so that every case
# crosses several tiles of every kernel, several row chunks of the fused forward, and merges
# partial statistics; poison proves every output entry is written.
# fp32 inputs with TF32 precision: the kernels on operands rounded to TF32 (tf32_via_fp16=False).
BLOCKS = TritonBlocks(tile_rows=20, tile_keys=24, stat_splits=2, poison=True, column_buffer_entries=80,
                      tf32_via_fp16=False)
# The default: fp32 inputs multiplied as scaled fp16 copies in the kernels too.
BLOCKS_VIA_FP16 = dataclasses.replace(BLOCKS, tf32_via_fp16=True)
# Every other route: the two-pass softmax forward, and the sigmoid loss's fused one pass.
TWO_PASS = TritonBlocks(tile_rows=20, tile_keys=24, stat_splits=3, poison=True, fused_columns=False,
                        sigmoid_logits="fused")

# Norm-wise relative tolerance per mode. The interpreter multiplies in fp32; for fp16 the
# error is G rounded to fp16 (2^-11) plus the fp16 output of the G K / G^T Q products, which
# d scale (a sum with cancellation) amplifies. fp32: rounding of c = 1 cases where P_ii ~ 1
# and dq_i = s (sum_j P_ij k_j - k_i) cancels to a few ulps reached 2.2e-5 once in 2000 draws.
# fp32-tf32 (tf32_via_fp16=False: kernels on operands rounded to TF32, the backward's GEMMs on
# scaled fp16 copies and fp16 G) and fp32-tf32-fp16 (the default: everything on scaled fp16 copies): the
# operands carry a 10-bit mantissa while the positive logit and the reference use the exact
# inputs; with a single row (m = 1) nothing averages that out: up to 6.2e-3 in 25 draws of every
# shape here (bugs give errors of 0.1-1). (The interpreter's TF32 dot itself is exact fp32.)
TOLERANCE = {"fp32-ieee": 5e-5, "fp32-tf32": 2e-2, "fp32-tf32-fp16": 2e-2, "fp16": 1e-2}
# Input dtype, precision and block ops of each mode.
MODES = {"fp32-ieee": (torch.float32, "ieee", BLOCKS), "fp32-tf32": (torch.float32, "tf32", BLOCKS),
         "fp32-tf32-fp16": (torch.float32, "tf32", BLOCKS_VIA_FP16), "fp16": (torch.float16, "auto", BLOCKS)}


def random_case(m, k, c, *, groups, custom_positives, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, dtype=torch.float64), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(k, c, generator=gen, dtype=torch.float64), dim=1)
    keys[:m] += 0.5 * q  # positives more similar than chance, as in a trained model
    case = dict(
        queries=q, keys=keys,
        scale=float(torch.empty(1).uniform_(2.0, 20.0, generator=gen)),
        bias=float(torch.empty(1).uniform_(-8.0, 1.0, generator=gen)),
        positives=torch.randperm(k, generator=gen)[:m] if custom_positives else None,
        query_groups=None, key_groups=None,
        row_weights=torch.rand(m, generator=gen, dtype=torch.float64) + 0.1,
    )
    if groups:
        n_groups = max(2, m // 3)
        case["query_groups"] = torch.randint(0, n_groups, (m,), generator=gen)
        case["key_groups"] = torch.randint(0, n_groups, (k,), generator=gen)
    return case


def loss_and_grads(case, dtype, backend, *, loss, symmetric, use_bias, precision="ieee", reduction="none"):
    """Weighted sum of per-row losses (arbitrary row weights) and its gradients; with reduction
    "mean" or "sum", that reduction times a random weight (the sigmoid loss's one-pass route:
    gradients computed in the forward, scaled by the upstream gradient in the backward)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q = case["queries"].to(dtype).requires_grad_(True)
    k = case["keys"].to(dtype).requires_grad_(True)
    scale = torch.tensor(case["scale"], dtype=acc, requires_grad=True)
    bias = torch.tensor(case["bias"], dtype=acc, requires_grad=True) if use_bias else None
    # several positives and the score filter (its guide in the features' dtype)
    objectives = {name: value.to(dtype) if torch.is_tensor(value) else value
                  for name, value in case.get("objectives", {}).items()}
    per_row = contrastive_loss(
        q, k, scale, bias, loss=loss, symmetric=symmetric, positives=case["positives"],
        query_groups=case["query_groups"], key_groups=case["key_groups"], reduction=reduction,
        backend=backend, precision=precision, **case.get("hardness", {}),
        label_smoothing=case.get("label_smoothing", 0.0), **objectives,
    )
    if reduction == "none":
        total = (per_row.double() * case["row_weights"]).sum()
    else:
        total = per_row.double() * case["row_weights"][0]
    leaves = [q, k, scale] + ([bias] if use_bias else [])
    grads = torch.autograd.grad(total, leaves)
    named = {n: g.double() for n, g in zip(["dq", "dk", "dscale", "dbias"], grads)}
    return {"loss": per_row.detach().double(), **named}


def relative_error(out, ref):
    """Norm-wise relative error. Below a norm of 1 it turns absolute: with m = k = 1 the loss and
    dq are exactly 0 in exact arithmetic, and fp32 leaves rounding noise of the terms' size."""
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1.0))


def errors_against_reference(case, dtype, blocks, precision, options) -> dict:
    """Each output's :func:`relative_error` against the float64 reference, which sees the same
    rounded inputs, upcast: only the kernels' arithmetic differs."""
    rounded = dict(case, queries=case["queries"].to(dtype).double(), keys=case["keys"].to(dtype).double())
    if "objectives" in case:  # the guide rounded too
        rounded["objectives"] = {name: value.to(dtype).double() if torch.is_tensor(value) else value
                                 for name, value in case["objectives"].items()}
    expected = loss_and_grads(rounded, torch.float64, "reference", **options)
    got = loss_and_grads(case, dtype, blocks, precision=precision, **options)
    assert set(got) == set(expected)
    return {name: relative_error(got[name], expected[name]) for name in expected}


LOSSES = {
    "softmax-sym": dict(loss="softmax", symmetric=True, use_bias=False),
    "softmax-asym": dict(loss="softmax", symmetric=False, use_bias=False),
    "sigmoid-bias": dict(loss="sigmoid", symmetric=False, use_bias=True),
}
# (m, k, c): m = 1, 7, 33; keys = rows plus hard negatives; widths 1, 3, 40 (none a multiple of 16).
# c = 32 is a multiple of the interpreter's BLOCK_K (16): the unmasked loads (EVEN_K), with row
# and key counts that leave blocks partly past the end; the others take the masked loads.
SHAPES = [(1, 1, 3), (1, 6, 40), (7, 7, 1), (7, 19, 40), (33, 33, 3), (33, 71, 40), (19, 45, 32), (1, 17, 32)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"m{m}-k{k}-c{c}" for m, k, c in SHAPES])
def test_loss_and_gradients_match_float64_reference(shape, loss_name, groups, mode):
    m, k, c = shape
    dtype, precision, blocks = MODES[mode]
    # Keep the run short: the reduced-precision modes on alternate shapes, groups only with
    # several rows.
    if mode != "fp32-ieee" and SHAPES.index(shape) % 2 == (0 if mode in ("fp16", "fp32-tf32-fp16") else 1):
        pytest.skip("the reduced-precision modes run on alternate shapes to keep CI short")
    if groups and m == 1:
        pytest.skip("a single row has no false negatives to mask")
    seed = random.randrange(2**31)
    case = random_case(m, k, c, groups=groups, custom_positives=(k > m and m > 1), seed=seed)
    options = LOSSES[loss_name]
    errors = errors_against_reference(case, dtype, blocks, precision, options)
    assert max(errors.values()) < TOLERANCE[mode], (seed, errors)


@pytest.mark.parametrize("loss_name", ["softmax-sym", "sigmoid-bias"])
def test_fp16_copies_of_features_with_an_outlier_are_as_exact_as_tf32(loss_name):
    """fp32 inputs' default route multiplies fp16 copies, each tensor divided by a power of two at or
    above its largest entry: unlike TF32, entries far below that largest one fall into fp16's
    subnormals. With one feature 300x the others (as LLM hidden states have) and three 1e-4x,
    the errors from float64 stay within twice those of the TF32 kernels (tf32_via_fp16=False)."""
    seed = random.randrange(2**31)
    case = random_case(33, 71, 40, groups=False, custom_positives=True, seed=seed)
    for name in ("queries", "keys"):
        case[name][:, 0] *= 300.0
        case[name][:, 1:4] *= 1e-4
    case["scale"] = float(20.0 / (case["queries"] @ case["keys"].T).abs().max())  # logits to 20
    copies, tf32 = (max(errors_against_reference(case, torch.float32, blocks, "tf32",
                                                 LOSSES[loss_name]).values())
                    for blocks in (BLOCKS_VIA_FP16, BLOCKS))
    assert copies < TOLERANCE["fp32-tf32-fp16"] and copies <= 2 * tf32 + 1e-6, (seed, copies, tf32)


# Whole blocks: rows, keys, super-tiles and statistics splits all multiples of the interpreter's
# 16, so that the kernels take their FULL path (no mask tile, no masked store) where no group mask
# is given; with groups the same shapes take the masked path. SHAPES above never divide by 16.
FULL_SHAPE = (32, 48, 32)
FULL_BLOCKS = TritonBlocks(tile_rows=16, tile_keys=32, stat_splits=3, poison=True, column_buffer_entries=96)
FULL_ROUTES = {"fused-columns": FULL_BLOCKS,
               "two-pass": dataclasses.replace(FULL_BLOCKS, fused_columns=False, sigmoid_logits="fused")}


@pytest.mark.parametrize("route", list(FULL_ROUTES))
@pytest.mark.parametrize("mode", ["fp32-ieee", "fp16"])
@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_whole_blocks_match_float64_reference(loss_name, groups, mode, route):
    from hf_infcl.ops.triton.grad_tile import GRAD_HEURISTICS
    from hf_infcl.ops.triton.stats import STATS_HEURISTICS, STATS_KERNEL

    m, k, c = FULL_SHAPE
    block = STATS_KERNEL.tuner.configs[0].kwargs  # the interpreter's one config
    named = dict(n_outer=m, n_inner=k, inner_per_split=-(-k // 3), n_rows=16, n_keys=32, c=c, **block)
    assert STATS_HEURISTICS["FULL"](named) and GRAD_HEURISTICS["FULL"](named), \
        "the shapes no longer give whole blocks: this test would not reach the FULL path"
    dtype, precision, _ = MODES[mode]
    seed = random.randrange(2**31)
    case = random_case(m, k, c, groups=groups, custom_positives=True, seed=seed)
    options = LOSSES[loss_name]
    errors = errors_against_reference(case, dtype, FULL_ROUTES[route], precision, options)
    assert max(errors.values()) < TOLERANCE[mode], (seed, errors)


# The sigmoid loss's one pass (a mean or sum: gradients computed in the forward) by both routes
# to the dot products: cuBLAS GEMMs and an elementwise kernel (the default), or the fused kernel.
SIGMOID_ROUTES = {"gemm": BLOCKS, "fused": dataclasses.replace(BLOCKS, sigmoid_logits="fused")}
ONE_PASS_SHAPES = [(1, 6, 40), (7, 19, 3), (33, 71, 40), (19, 45, 32)]


@pytest.mark.parametrize("route", list(SIGMOID_ROUTES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
@pytest.mark.parametrize("shape", ONE_PASS_SHAPES, ids=[f"m{m}-k{k}-c{c}" for m, k, c in ONE_PASS_SHAPES])
def test_sigmoid_one_pass_matches_float64_reference(shape, groups, reduction, route):
    """Every precision mode in turn, so that each meets both routes (the interpreter's dots are
    exact fp32; what differs between the routes is who computes them)."""
    m, k, c = shape
    if groups and m == 1:
        pytest.skip("a single row has no false negatives to mask")
    index = ONE_PASS_SHAPES.index(shape) + 2 * groups + (reduction == "sum")
    mode = list(MODES)[index % len(MODES)]
    dtype, precision, _ = MODES[mode]
    blocks = SIGMOID_ROUTES[route]
    if mode == "fp32-tf32-fp16":
        blocks = dataclasses.replace(blocks, tf32_via_fp16=True)
    seed = random.randrange(2**31)
    case = random_case(m, k, c, groups=groups, custom_positives=k > m > 1, seed=seed)
    options = dict(LOSSES["sigmoid-bias"], reduction=reduction)
    errors = errors_against_reference(case, dtype, blocks, precision, options)
    assert max(errors.values()) < TOLERANCE[mode], (seed, mode, errors)


def test_sigmoid_logits_is_checked():
    with pytest.raises(ValueError, match="sigmoid_logits"):
        TritonBlocks(sigmoid_logits="cublas")


def test_gluon_route_refuses_without_a_hopper_gpu():
    """The Gluon kernel runs on Hopper GPUs only: asked for by name it says what it needs; the
    default ("auto") takes the cuBLAS route instead, as every other test here does."""
    case = random_case(5, 9, 16, groups=False, custom_positives=False, seed=0)
    q, k = case["queries"].float(), case["keys"].float()
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    with pytest.raises(ValueError, match="sigmoid_logits='gluon' needs a Hopper GPU"):
        contrastive_loss(q.requires_grad_(), k, scale, bias, loss="sigmoid",
                         backend=TritonBlocks(sigmoid_logits="gluon"))
    assert TritonBlocks().sigmoid_logits == "auto"


def test_gluon_statistics_refuse_without_a_hopper_gpu():
    """Likewise the symmetric softmax forward's Gluon kernel: by name it says what it needs; the
    default takes the statistics kernel of .stats."""
    case = random_case(5, 9, 16, groups=False, custom_positives=False, seed=0)
    q, k = case["queries"].float(), case["keys"].float()
    with pytest.raises(ValueError, match="softmax_statistics='gluon' needs a Hopper GPU"):
        contrastive_loss(q, k, torch.tensor(10.0), backend=TritonBlocks(softmax_statistics="gluon"))
    assert TritonBlocks().softmax_statistics == "auto"


def _gluon_stats_in_torch(queries, keys, scale, row_out, column_partials, splits, score_filter=None):
    """What ``gluon_stats.row_and_column_stats`` (a ``stats_launch``) writes, in torch: each split's
    row log-sum-exps, and per 128-row block four column log-sum-exps, over the rows r with (r mod
    64) div 16 = warp;
    with ``score_filter``, over the entries its thresholds (made from its bounds) keep, and -inf for
    the keys that are nobody's positive."""
    from hf_infcl.ops.triton import gluon_stats

    rows, n_keys = queries.shape[0], keys.shape[0]
    per_split = gluon_stats.BLOCK_N * triton.cdiv(triton.cdiv(n_keys, gluon_stats.BLOCK_N), splits)
    used = triton.cdiv(n_keys, per_split)
    dots = queries.double() @ keys.double().T
    z = column_z = scale.double() * dots
    if score_filter is not None:
        def thresholds(bounds):
            bounds = bounds.double()
            return bounds - (score_filter.margin + score_filter.relative_margin * bounds.abs())

        candidates = score_filter.positives.long()[:, None] != torch.arange(n_keys)[None, :]
        z = z.masked_fill((dots > thresholds(score_filter.row_bounds)[:, None]) & candidates, float("-inf"))
        column_z = column_z.masked_fill((dots > thresholds(score_filter.key_bounds)[None, :]) & candidates,
                                        float("-inf"))
        # keys that are nobody's positive (bound 0; no positive pair scores exactly 0 here): every
        # row left out, the worst their columns may give, since those are not the loss's
        column_z[:, score_filter.key_bounds == 0] = float("-inf")
    for split in range(used):
        row_out[split] = torch.logsumexp(z[:, split * per_split:(split + 1) * per_split], 1)
    blocks = triton.cdiv(rows, gluon_stats.BLOCK_M)
    padded = torch.full((blocks * gluon_stats.BLOCK_M, n_keys), float("-inf"), dtype=torch.float64)
    padded[:rows] = column_z
    by_warp = padded.view(blocks, 2, 4, 16, n_keys).permute(0, 2, 1, 3, 4).reshape(blocks * 4, 32, n_keys)
    column_partials[: blocks * 4] = torch.logsumexp(by_warp, 1)
    return used


def _route_gluon_statistics_through_torch(monkeypatch, record) -> list:
    """The Gluon statistics route on this machine, where Gluon does not run: the kernel taken as
    usable and compiled, its outputs made in torch (:func:`_gluon_stats_in_torch`); returns the
    list into which each launch puts ``record(launch arguments)``."""
    from hf_infcl.ops.triton import gluon_stats

    records = []
    monkeypatch.setattr(gluon_stats, "usable", lambda queries, keys: True)
    monkeypatch.setattr(gluon_stats, "ready", lambda wait: True)
    monkeypatch.setattr(gluon_stats, "stats_launch",
                        lambda *args: lambda: records.append(record(args)) or _gluon_stats_in_torch(*args))
    return records


def test_the_gluon_statistics_route_walks_row_chunks_and_merges_them(monkeypatch):
    """The Gluon statistics route's host side, with the kernel's outputs made in torch (Gluon does
    not run here): rows in several chunks of whole row blocks, each with two splits of the keys,
    the last chunk partial; the loss and every gradient match float64."""
    calls = _route_gluon_statistics_through_torch(monkeypatch, lambda args: args[0].shape[0])
    case = random_case(300, 400, 16, groups=False, custom_positives=False, seed=3)
    blocks = TritonBlocks(tile_rows=128, tile_keys=160, stat_splits=2, poison=True,
                          column_buffer_entries=4 * 400, softmax_statistics="gluon")
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", LOSSES["softmax-sym"])
    assert calls == [128, 128, 44], calls
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], errors


@pytest.mark.parametrize("strategy, margin", [("absolute", 0.1), ("absolute", 0.0), ("relative", 0.3),
                                              ("absolute", -0.1)])
def test_the_gluon_statistics_route_takes_the_own_score_filter(monkeypatch, strategy, margin):
    """The score filter without a guide through the Gluon statistics route (the kernel's outputs
    made in torch from the arguments it gets): each row's and key's bound from its threshold (with
    a negative margin, halfway to its positive), the positives as indices into the keys (custom
    ones, hard-negative keys that are nobody's), rows in chunks; the loss and every gradient match
    float64."""
    filters = _filters_of_gluon_statistics_at_any_size(monkeypatch)
    case = _own_score_filter_case(256, 384, margin, strategy)
    blocks = TritonBlocks(tile_rows=128, tile_keys=160, poison=True, column_buffer_entries=4 * 384)
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", LOSSES["softmax-sym"])
    assert len(filters) == 2 and all(f is not None for f in filters), filters
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], errors


@pytest.mark.parametrize("strategy, margin", [("relative", -0.1), ("absolute", -0.6)])
def test_the_gluon_statistics_route_leaves_filters_whose_bounds_may_not_hold_to_stats(monkeypatch, strategy,
                                                                                      margin):
    """A negative relative margin and one below -0.5: "auto" takes .stats (the loss and every
    gradient still match float64), and "gluon" refuses, naming what it needs."""
    filters = _filters_of_gluon_statistics_at_any_size(monkeypatch)
    case = _own_score_filter_case(130, 200, margin, strategy)
    blocks = TritonBlocks(tile_rows=128, tile_keys=160, poison=True, column_buffer_entries=4 * 200)
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", LOSSES["softmax-sym"])
    assert not filters and max(errors.values()) < TOLERANCE["fp32-ieee"], errors
    with pytest.raises(ValueError, match="without a guide or groups, of margin >= -0.5"):
        errors_against_reference(case, torch.float32, TritonBlocks(softmax_statistics="gluon"), "ieee",
                                 LOSSES["softmax-sym"])


def _filters_of_gluon_statistics_at_any_size(monkeypatch) -> list:
    """:func:`_route_gluon_statistics_through_torch` with "auto" taking the kernel at any width and
    work; returns the list of the score filters its launches get."""
    from hf_infcl.ops.triton import gluon_stats

    monkeypatch.setattr(gluon_stats, "AUTO_MIN_WIDTH", 16)
    monkeypatch.setattr(gluon_stats, "AUTO_MIN_WORK", 0)
    return _route_gluon_statistics_through_torch(monkeypatch, lambda args: args[-1])


def _own_score_filter_case(m: int, k: int, margin: float, strategy: str) -> dict:
    """A softmax case of custom positives with the own-score filter: the first 40 rows' positives
    near-copies of the next 40's (false negatives the filter leaves out)."""
    case = random_case(m, k, 16, groups=False, custom_positives=True, seed=7)
    positives = case["positives"]
    case["keys"][positives[:40]] = case["keys"][positives[40:80]] + 0.01 * case["keys"][positives[:40]]
    return dict(case, objectives=dict(false_negative_margin=margin, false_negative_strategy=strategy))


@pytest.mark.parametrize("strategy, margin", [("absolute", 0.1), ("absolute", -0.05), ("relative", 0.3),
                                              ("relative", 0.0)])
@pytest.mark.parametrize("m, k, offset", [(300, 200, 0), (100, 500, 40), (128, 128, 0)],
                         ids=["more-rows", "more-keys-offset", "one-block"])
def test_the_own_score_bounds_kernel_inverts_thresholds_and_bounds_each_block_s_positives(strategy, margin,
                                                                                          m, k, offset):
    """The Gluon statistics kernel's filter arguments from one launch (own_score_bounds): each
    bound the positive's score its threshold was made from (float64 inverse; 0 for keys that are
    nobody's positive), the positives as indices into the block's keys from ``offset`` on (-1
    where outside), and each 128-row block's smallest and largest of them (an empty range for a
    block without any), of which a chunk of rows from a whole block on has its blocks' slice."""
    from hf_infcl.ops.triton.own_score_bounds import own_score_filter

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    scores = torch.randn(m, generator=gen, dtype=torch.float64)
    positive_keys = torch.randint(-50, k + offset + 60, (m,), generator=gen)
    if m > 256:
        positive_keys[256:] = -7  # the last block: no positive among the keys
    if strategy == "absolute":
        row_thresholds = scores - margin
    else:
        row_thresholds = scores - scores.abs() * margin
    key_thresholds = torch.full((k,), float("inf"), dtype=torch.float64)
    key_scores = torch.randn(k, generator=gen, dtype=torch.float64)
    some = torch.randperm(k, generator=gen)[: k // 2]
    key_thresholds[some] = (key_scores - margin if strategy == "absolute"
                            else key_scores - key_scores.abs() * margin)[some]
    result = own_score_filter(row_thresholds.float(), key_thresholds.float(), positive_keys, offset, k,
                              margin, strategy)
    torch.testing.assert_close(result.row_bounds.double(), scores, rtol=1e-6, atol=1e-6)
    expected_keys = torch.where(key_thresholds == float("inf"), 0.0, key_scores)
    torch.testing.assert_close(result.key_bounds.double(), expected_keys, rtol=1e-6, atol=1e-6)
    local = positive_keys - offset
    inside = (local >= 0) & (local < k)
    assert torch.equal(result.positives, torch.where(inside, local, -1).int())
    margins = (margin, 0.0) if strategy == "absolute" else (0.0, margin)
    assert (result.margin, result.relative_margin) == margins
    low, high = result.ranges
    assert low.dtype == high.dtype == torch.int32 and low.shape == high.shape == (-(-m // 128),)
    for block, (first, last) in enumerate(zip(low.tolist(), high.tolist())):
        found = [p for p in result.positives[128 * block: 128 * (block + 1)].tolist() if p >= 0]
        if found:
            assert (first, last) == (min(found), max(found))
        else:
            assert first > last  # empty: no key tile meets it
    if m > 128:
        chunk = own_score_filter(row_thresholds[128:].float(), key_thresholds.float(), positive_keys[128:],
                                 offset, k, margin, strategy)
        assert torch.equal(chunk.ranges[0], low[1:]) and torch.equal(chunk.ranges[1], high[1:])
    with pytest.raises(ValueError, match="key_thresholds must have"):
        own_score_filter(row_thresholds.float(), key_thresholds[1:].float(), positive_keys, offset, k, margin,
                         strategy)


@pytest.mark.parametrize("m, k, c, takes", [(256, 256, 32, True), (128, 256, 32, False), (128, 256, 64, True),
                                           (256, 256, 16, False), (200, 256, 32, False)],
                         ids=["enough-work", "too-little-work", "wider", "too-narrow", "partial-tiles"])
def test_auto_takes_the_gluon_statistics_by_width_and_work(monkeypatch, m, k, c, takes):
    """``softmax_statistics="auto"`` takes the Gluon kernel for whole tiles whose width and work
    (rows x keys x c) reach the module's thresholds, here scaled down (width 32, work 256 x 256 x 32)."""
    from hf_infcl.ops.triton import gluon_stats

    monkeypatch.setattr(gluon_stats, "AUTO_MIN_WIDTH", 32)
    monkeypatch.setattr(gluon_stats, "AUTO_MIN_WORK", 256 * 256 * 32)
    calls = _route_gluon_statistics_through_torch(monkeypatch, lambda args: args[0].shape[0])
    case = random_case(m, k, c, groups=False, custom_positives=False, seed=5)
    blocks = TritonBlocks(tile_rows=128, tile_keys=128, poison=True)
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", LOSSES["softmax-sym"])
    assert bool(calls) == takes, calls
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], errors


HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")
HARDNESS_SHAPES = [(1, 6, 40), (7, 19, 40), (33, 71, 3), (19, 45, 32)]


@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
@pytest.mark.parametrize("loss_name", ["softmax-sym", "softmax-asym"])
@pytest.mark.parametrize("shape", HARDNESS_SHAPES, ids=[f"m{m}-k{k}-c{c}" for m, k, c in HARDNESS_SHAPES])
@pytest.mark.parametrize("hardness_mode", HARDNESS_MODES)
def test_hardness_offset_matches_float64_reference(hardness_mode, shape, loss_name, groups):
    """The kernels' in-kernel hardness offset (row statistic only; the column statistic and G's
    column part of the plain logits) against the materialised reference. Each case runs in one of
    the precision modes, in turn, so that every mode meets every hardness mode."""
    index = (HARDNESS_MODES.index(hardness_mode) + HARDNESS_SHAPES.index(shape) + 2 * groups
             + (loss_name == "softmax-sym"))
    mode = list(MODES)[index % len(MODES)]
    dtype, precision, blocks = MODES[mode]
    seed = random.randrange(2**31)
    case = random_case(*shape, groups=groups, custom_positives=shape[1] > shape[0] > 1, seed=seed)
    case = with_hardness(case, hardness_mode, 4.0, seed)
    options = LOSSES[loss_name]
    errors = errors_against_reference(case, dtype, blocks, precision, options)
    assert max(errors.values()) < TOLERANCE[mode], (seed, mode, errors)


@pytest.mark.parametrize("loss_name", ["softmax-sym", "softmax-asym"])
@pytest.mark.parametrize("shape", [(1, 6, 40), (7, 19, 40), (33, 71, 3), (19, 45, 32)],
                         ids=["m1-k6-c40", "m7-k19-c40", "m33-k71-c3", "m19-k45-c32"])
def test_label_smoothing_matches_float64_reference(shape, loss_name):
    """Label smoothing (added outside the kernels, from the mean key and query) over the Triton
    statistics: hard negatives, custom positives, each case in one of the precision modes."""
    index = [(1, 6, 40), (7, 19, 40), (33, 71, 3), (19, 45, 32)].index(shape) + (loss_name == "softmax-sym")
    mode = list(MODES)[index % len(MODES)]
    dtype, precision, blocks = MODES[mode]
    seed = random.randrange(2**31)
    case = random_case(*shape, groups=False, custom_positives=shape[0] > 1, seed=seed)
    case["label_smoothing"] = 0.1 + 0.8 * random.Random(seed).random()
    errors = errors_against_reference(case, dtype, blocks, precision, LOSSES[loss_name])
    assert max(errors.values()) < TOLERANCE[mode], (seed, mode, errors)


@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
@pytest.mark.parametrize("shape", [(7, 19, 40), (33, 71, 3)], ids=["m7-k19-c40", "m33-k71-c3"])
def test_two_pass_forward_with_hardness_matches_reference(shape, groups):
    """The column-major column pass (fused_columns=False) must not offset the columns."""
    seed = random.randrange(2**31)
    case = random_case(*shape, groups=groups, custom_positives=True, seed=seed)
    case = with_hardness(case, "all_negatives", 4.0, seed)
    expected = loss_and_grads(case, torch.float64, "reference", **LOSSES["softmax-sym"])
    got = loss_and_grads(case, torch.float32, TWO_PASS, **LOSSES["softmax-sym"])
    errors = {name: relative_error(got[name], expected[name]) for name in expected}
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)


@pytest.mark.parametrize("groups", [False, True], ids=["nogroups", "groups"])
@pytest.mark.parametrize("shape", [(7, 19, 40), (33, 71, 3)], ids=["m7-k19-c40", "m33-k71-c3"])
def test_two_pass_forward_matches_reference(shape, groups):
    """The column statistic from its own column-major pass (fused_columns=False)."""
    seed = random.randrange(2**31)
    case = random_case(*shape, groups=groups, custom_positives=True, seed=seed)
    expected = loss_and_grads(case, torch.float64, "reference", **LOSSES["softmax-sym"])
    got = loss_and_grads(case, torch.float32, TWO_PASS, **LOSSES["softmax-sym"])
    errors = {name: relative_error(got[name], expected[name]) for name in expected}
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)


@pytest.mark.parametrize("hardness_mode", [None, *HARDNESS_MODES])
def test_block_ops_with_key_offset_add_into_accumulators(hardness_mode):
    """The ring's use: a key block at a global offset, complete statistics, accumulators that
    already hold other blocks' sums (with the hardness offset, its owners those of the block).
    Compared with TorchTiles in float64."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    m, k, c, offset = 9, 21, 17, 30
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, dtype=torch.float64), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(k, c, generator=gen, dtype=torch.float64), dim=1)
    positives = offset + torch.randperm(k, generator=gen)[:m]
    positives[::3] = 5  # some rows' positives live in another key block
    mask = GroupMask(torch.randint(0, 3, (m,), generator=gen), torch.randint(0, 3, (k,), generator=gen),
                     positives, key_offset=offset)
    scale = torch.tensor(7.5, dtype=torch.float64)
    spec = StatsSpec("softmax", columns=True, precision="ieee")
    hardness = None
    if hardness_mode is not None:
        owners = torch.randint(-1, m + 2, (k,), generator=gen)
        owners[positives[positives >= offset] - offset] = torch.arange(m)[positives >= offset]
        hardness = HardnessOffset(hardness_mode, 2.5, torch.arange(m), owners, positives, key_offset=offset)

    ref_row, ref_col = TorchTiles(4, 5).forward_block(spec, q, keys, scale, None, mask, hardness=hardness)
    for blocks in (BLOCKS, TWO_PASS):
        row, col = blocks.forward_block(spec, q.float(), keys.float(), scale.float(), None, mask,
                                        hardness=hardness)
        assert relative_error(row.double(), ref_row) < 1e-6
        assert relative_error(col.double(), ref_col) < 1e-6

    # Complete statistics of a bigger problem: the block's own plus some other keys' mass.
    full_row, full_col = ref_row + 0.3, ref_col + 0.2
    row_w = torch.rand(m, generator=gen, dtype=torch.float64)
    col_w = torch.rand(k, generator=gen, dtype=torch.float64)
    start_q = torch.randn(m, c, generator=gen, dtype=torch.float64)
    start_k = torch.randn(k, c, generator=gen, dtype=torch.float64)
    ref_dq, ref_dk = start_q.clone(), start_k.clone()
    ref_sums = TorchTiles(4, 5).backward_block(spec, q, keys, scale, None, mask, full_row, full_col,
                                               row_w, col_w, ref_dq, ref_dk, hardness=hardness)
    # Exact fp32; fp32 with TF32 (fp16 GEMMs) and fully as scaled fp16 copies; fp16. All but the
    # first divide and re-multiply the accumulators, which must leave the sums already there intact.
    for name, precision, dtype, blocks, tolerance in (
        ("ieee", "ieee", torch.float32, BLOCKS, 1e-5),
        ("tf32", "tf32", torch.float32, BLOCKS, 3e-3),
        ("tf32-fp16", "tf32", torch.float32, BLOCKS_VIA_FP16, 3e-3),
        ("fp16", "auto", torch.float16, BLOCKS, 1e-2),
    ):
        block_spec = StatsSpec("softmax", columns=True, precision=precision)
        dq, dk = start_q.float(), start_k.float()
        sums = blocks.backward_block(block_spec, q.to(dtype), keys.to(dtype), scale.float(), None, mask,
                                     full_row.float(), full_col.float(), row_w.float(), col_w.float(), dq, dk,
                                     hardness=hardness)
        assert relative_error(dq.double() - start_q, ref_dq - start_q) < tolerance, name
        assert relative_error(dk.double() - start_k, ref_dk - start_k) < tolerance, name
        assert relative_error(sums.double(), ref_sums) < tolerance, name


def test_non_finite_input_gives_nan_not_a_finite_number():
    q = torch.randn(5, 8)
    k = torch.randn(7, 8)
    q[2, 3] = float("nan")
    loss = contrastive_loss(q, k, 3.0, backend=BLOCKS)
    assert torch.isnan(loss)


def test_float64_inputs_fall_back_to_torch_tiles():
    case = random_case(6, 9, 5, groups=False, custom_positives=False, seed=random.randrange(2**31))
    expected = loss_and_grads(case, torch.float64, "reference", **LOSSES["softmax-sym"])
    got = loss_and_grads(case, torch.float64, BLOCKS, **LOSSES["softmax-sym"])
    assert max(relative_error(got[n], expected[n]) for n in expected) < 1e-10


@pytest.mark.parametrize("scale", [60.0, 400.0], ids=["scale60", "scale400"])
def test_large_scales_match_reference(scale):
    """Logits spread by hundreds (past CLIP's clamp of 100 at 400): the statistics and both
    directions' probabilities stay exact, and the forward's column partials (``_column_lse``)
    keep every row's terms."""
    seed = random.randrange(2**31)
    case = random_case(33, 71, 40, groups=False, custom_positives=True, seed=seed)
    case["scale"] = scale
    expected = loss_and_grads(case, torch.float64, "reference", **LOSSES["softmax-sym"])
    got = loss_and_grads(case, torch.float32, BLOCKS, precision="ieee", **LOSSES["softmax-sym"])
    errors = {name: relative_error(got[name], expected[name]) for name in expected}
    # fp32 logits of size ~scale carry an absolute rounding error of ~scale * 2^-24.
    assert max(errors.values()) < 5e-5 * scale / 20, (seed, errors)


def _owned_tensors(loss):
    """What a caller hands the loss: fp32 features, the scale and bias as outputs of autograd ops
    (a model's ``logit_scale.exp()``), positives and groups."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    m, k, c = 11, 23, 20
    log_scale = torch.tensor(2.3, requires_grad=True)
    raw_bias = torch.tensor(-4.0, requires_grad=True)
    owned = dict(
        queries=torch.randn(m, c, generator=gen).requires_grad_(True),
        keys=torch.randn(k, c, generator=gen).requires_grad_(True),
        logit_scale=log_scale.exp(),
        logit_bias=raw_bias * 1.0 if loss == "sigmoid" else None,
        positives=torch.randperm(k, generator=gen)[:m],
        query_groups=torch.randint(0, 4, (m,), generator=gen),
        key_groups=torch.randint(0, 4, (k,), generator=gen),
    )
    leaves = [owned["queries"], owned["keys"], log_scale] + ([raw_bias] if loss == "sigmoid" else [])
    return owned, leaves


@pytest.mark.parametrize("blocks_name", ["fused", "two-pass"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_kernels_never_write_into_the_callers_tensors(loss_name, blocks_name, monkeypatch):
    """Every pointer a kernel writes, or that its autotuner restores or zeroes around each trial
    (``restore_value`` / ``reset_to_zero``), is a buffer of the backend's own, never a tensor the
    caller passed. The interpreter runs one config, so it never autotunes; this checks the
    arguments of every launch instead. (A caller's logit scale once sat in an unused written slot,
    and the GPU's first, tuning call copied into it: autograd then refused the backward.)"""
    from hf_infcl.ops.triton import combine_rows, grad_tile, sigmoid_from_dots, stats

    written_by_kernel = {stats.STATS_KERNEL.tuner: ("out_ptr", "col_partial_ptr"),
                         grad_tile.GRAD_TILE_KERNEL.tuner: ("g_ptr", "row_sums_ptr", "softplus_sums_ptr"),
                         sigmoid_from_dots._sigmoid_from_dots_kernel: ("g_ptr", "row_sums_ptr",
                                                                       "softplus_sums_ptr"),
                         combine_rows._combine_rows_kernel: ("out_ptr", "dots_ptr")}
    launches = []
    for tuner, written in written_by_kernel.items():
        # The plain JIT kernel has no autotuner, so nothing restored or zeroed.
        around_trials = (*getattr(tuner, "restore_value", ()), *getattr(tuner, "reset_to_zero", ()))
        touched = set(written) | set(around_trials)

        def run(*args, _tuner=tuner, _touched=touched, _run=tuner.run, **kwargs):
            named = {**dict(zip(_tuner.arg_names, args)), **kwargs}
            launches.append({name: named[name] for name in _touched})
            return _run(*args, **kwargs)

        monkeypatch.setattr(tuner, "run", run)

    options = LOSSES[loss_name]
    owned, leaves = _owned_tensors(options["loss"])
    versions = {name: t._version for name, t in owned.items() if t is not None}
    blocks = BLOCKS if blocks_name == "fused" else TWO_PASS
    value = contrastive_loss(**owned, loss=options["loss"], symmetric=options["symmetric"], backend=blocks)
    torch.autograd.grad(value, leaves)  # raises if a tensor saved for backward was modified

    assert {name: owned[name]._version for name in versions} == versions
    caller_storages = {t.untyped_storage().data_ptr() for t in owned.values() if t is not None}
    # The sigmoid loss computes its gradients in the forward: one launch, no backward kernel.
    assert len(launches) >= (1 if options["loss"] == "sigmoid" else 2)
    for launch in launches:
        for name, tensor in launch.items():
            assert tensor.untyped_storage().data_ptr() not in caller_storages, (
                f"{name} of a kernel launch is a tensor the caller owns")


COMBINE_CASES = {
    # rows, width, one entry per row (else sorted entry rows, some outside [0, rows)), accumulator,
    # weight ("row", "common" or None), source weights, output, dot products
    "rows-r37-c50": (37, 50, True, True, "row", True, True, True),
    "logits-r23-c130": (23, 130, True, False, None, False, False, True),
    "keys-r41-c3": (41, 3, False, True, "common", True, True, False),
    "keys-noweight-r9-c70": (9, 70, False, True, None, True, True, True),
    "keys-noacc-r5-c16": (5, 16, False, False, None, False, True, False),
    # The row weights a mean's backward hands in: one value expanded (stride 0).
    "rows-expanded-r12-c33": (12, 33, True, True, "expanded", True, True, True),
    # No source index (positives=None: row i takes source i): more sources than rows (dQ, the
    # positive logits), fewer (a key slice reaching past the last row: rows without an entry),
    # none (a slice of hard negatives only), and source weights expanded (stride 0).
    "identity-more-r19-c40": (19, 40, True, True, "row", True, True, True, 25),
    "identity-fewer-r21-c24": (21, 24, True, True, "common", "expanded", True, False, 8),
    "identity-none-r6-c16": (6, 16, True, True, None, True, True, True, 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(COMBINE_CASES))
def test_combine_rows_kernel_matches_float64(case, dtype):
    """The epilogues' row kernel (``TritonBlocks.combine_rows``) against the same sum in float64,
    and against the torch version it replaces: rows with no entry, several entries, entries
    outside the rows (the ring's key slices), every optional operand absent in some case."""
    from hf_infcl.ops.key_blocks import combine_rows

    (rows, width, one_per_row, has_acc, weight_kind, has_source_weight, has_out, has_dots,
     *identity_sources) = COMBINE_CASES[case]
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n_sources = identity_sources[0] if identity_sources else rows + 13
    sources = torch.randn(n_sources, width, generator=gen).to(dtype)
    if identity_sources:
        entries = min(rows, n_sources)
        entry_rows = None
        target = torch.arange(entries)
    elif one_per_row:
        entries = rows
        entry_rows = None
        target = torch.arange(rows)
    else:
        entries = 3 * rows
        entry_rows = torch.sort(torch.randint(-2, rows + 3, (entries,), generator=gen)).values
        target = entry_rows
    if identity_sources:
        source_index, picked = None, torch.arange(entries)
    else:
        source_index = picked = torch.randint(0, n_sources, (entries,), generator=gen)
    source_weight = torch.randn(entries, generator=gen) if has_source_weight else None
    if has_source_weight == "expanded":
        source_weight = torch.randn((), generator=gen).expand(n_sources)  # read for t < entries
    accumulator = torch.randn(rows, width, generator=gen) if has_acc else None
    weight = {"row": torch.randn(rows, generator=gen), "common": torch.randn((), generator=gen),
              "expanded": torch.randn((), generator=gen).expand(rows), None: None}[weight_kind]
    scale = torch.rand((), generator=gen) + 0.5
    dot_with = torch.randn(rows, width, generator=gen).to(dtype) if has_dots else None

    expected = torch.zeros(rows, width, dtype=torch.float64)
    if accumulator is not None:
        factor = 1.0 if weight is None else weight.double() if weight.dim() == 0 else weight.double()[:, None]
        expected += accumulator.double() * factor
    added = sources.double()[picked]
    if source_weight is not None:
        added = added * source_weight.double()[:entries, None]
    inside = (target >= 0) & (target < rows)
    expected.index_add_(0, target[inside], added[inside])

    results = {}
    for name, combine in (("triton", BLOCKS.combine_rows), ("torch", combine_rows)):
        out = torch.full((rows, width), float("nan"), dtype=dtype) if has_out else None
        dots = combine(rows=rows, sources=sources, source_index=source_index, source_weight=source_weight,
                       entry_rows=entry_rows, accumulator=accumulator, weight=weight, out=out, scale=scale,
                       dot_with=dot_with)
        results[name] = (out, dots)
        tolerance = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
        if has_out:
            torch.testing.assert_close(out.double(), expected * scale.double(), **tolerance, msg=name)
        if has_dots:
            torch.testing.assert_close(dots.double(), (expected * dot_with.double()).sum(1), rtol=1e-5,
                                       atol=1e-4, msg=name)
        else:
            assert dots is None


@pytest.mark.parametrize("bias", [-3.0, -45.0], ids=["bias-3", "bias-45"])
@pytest.mark.parametrize("in_place", [False, True], ids=["separate", "in-place"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("shape", [(32, 128), (19, 75)], ids=["full-r32-k128", "ragged-r19-k75"])
def test_sigmoid_from_dots_kernel_matches_float64(shape, masked, in_place, bias):
    """The elementwise kernel of the sigmoid one pass on its own: G, its row sums and the
    softplus row sums against float64. Logits from -43 to 37 reach every branch of sigmoid and
    softplus; from -85 to -5, the softplus sums are sums of small e^z whose relative accuracy
    needs the rounding error of 1 + e^z. Full blocks take the kernel's unmasked path, ragged
    ones its masked one; in place, G overwrites the fp16 dot products it reads."""
    from hf_infcl.ops.triton.sigmoid_from_dots import sigmoid_from_dots

    rows, keys = shape
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    dots = (torch.rand(rows, keys, generator=gen) * 2 - 1).to(torch.float16)
    scale, bias = torch.tensor(40.0), torch.tensor(bias)
    groups = {}
    allowed = torch.ones(rows, keys, dtype=torch.bool)
    if masked:
        positive = torch.randint(0, keys, (rows,), generator=gen)
        row_groups = torch.randint(0, 3, (rows,), generator=gen)
        key_groups = torch.randint(0, 3, (keys,), generator=gen)
        groups = dict(row_groups=row_groups, key_groups=key_groups, positive_keys=positive)
        is_positive = positive[:, None] == torch.arange(keys)[None, :]
        allowed = (row_groups[:, None] != key_groups[None, :]) | is_positive
    z = dots.double() * 40.0 + bias.double()
    expected_g = torch.where(allowed, torch.sigmoid(z), 0.0)
    expected_softplus = torch.where(allowed, torch.nn.functional.softplus(z), 0.0).sum(1)

    g = dots.view(torch.float16) if in_place else torch.full((rows, keys), float("nan"), dtype=torch.float16)
    dots_read = dots if in_place else dots.clone()
    row_sums, softplus_sums = torch.zeros(rows), torch.zeros(rows)
    sigmoid_from_dots(dots_read, g, row_sums, softplus_sums, scale, bias, None, **groups)
    torch.testing.assert_close(g.double(), expected_g, rtol=2e-3, atol=1e-7)
    torch.testing.assert_close(row_sums.double(), expected_g.sum(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(softplus_sums.double(), expected_softplus, rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("previous", [False, True], ids=["alone", "with-previous"])
@pytest.mark.parametrize("log_sum_exp", [True, False], ids=["lse", "sum"])
@pytest.mark.parametrize("shape", [(1, 7), (9, 40), (37, 5)], ids=["p1-n7", "p9-n40", "p37-n5"])
def test_merge_partials_kernel_matches_float64(shape, log_sum_exp, previous):
    """The forward's merge of partial statistics on its own, against float64: parts that are not
    a multiple of the kernel's block, columns of -inf only (no row reached them), -inf among
    finite values, partials 60 apart (exp underflows but must not turn into NaN), a previous
    value of -inf (with a column of -inf too), and a strided view (the statistics kernel's split buffer)."""
    from hf_infcl.ops.triton.stats import merge_partials

    parts, n = shape
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    buffer = torch.randn(parts, n + 3, generator=gen) * 30
    partials = buffer[:, 1 : n + 1]  # row stride n + 3
    if log_sum_exp:
        partials[:, 0] = float("-inf")  # a column no row block wrote
        partials[torch.rand(parts, n, generator=gen) < 0.3] = float("-inf")
    before = torch.randn(n, generator=gen) * 30
    if log_sum_exp:
        before[-1] = float("-inf")
        partials[:, -1] = float("-inf")  # -inf merged with -inf: -inf, not NaN
    expected = partials.double().logsumexp(0) if log_sum_exp else partials.double().sum(0)
    if previous:
        expected = torch.logaddexp(expected, before.double()) if log_sum_exp else expected + before.double()
    out = before.clone() if previous else None
    result = merge_partials(partials, log_sum_exp=log_sum_exp, previous=out, out=out)
    assert result.shape == (n,) and (out is None or result is out)
    # fp32 sums of up to 37 terms of size ~30: a few 1e-5 of rounding.
    torch.testing.assert_close(result.double(), expected, rtol=1e-6, atol=2e-4)


def test_merge_partials_kernel_propagates_nan():
    """A NaN partial (from a NaN input) gives a NaN statistic, in the partials and in ``previous``,
    never a finite number."""
    from hf_infcl.ops.triton.stats import merge_partials

    partials = torch.randn(6, 4)
    partials[2, 1] = float("nan")
    previous = torch.randn(4)
    previous[3] = float("nan")
    result = merge_partials(partials, log_sum_exp=True, previous=previous)
    assert result[1].isnan() and result[3].isnan()
    assert result[[0, 2]].isfinite().all()


def test_reset_autotuning_clears_every_autotuner_and_the_loss_still_matches(monkeypatch):
    """hf_infcl.ops.reset_autotuning() (what bench_loss calls between sizes) empties the cache of
    every autotuned kernel, so that the next call tunes afresh. The interpreter runs one config and
    never fills the caches itself: an entry is planted in each, and a loss computed after the reset
    still matches the tiled backend."""
    from hf_infcl.ops import reset_autotuning
    from hf_infcl.ops.triton import launch
    from hf_infcl.ops.triton.grad_tile import GRAD_TILE_KERNEL
    from hf_infcl.ops.triton.stats import STATS_KERNEL

    tuners = [kernel.tuner for kernel in launch.TUNED_KERNELS]
    assert {STATS_KERNEL.tuner, GRAD_TILE_KERNEL.tuner} <= set(tuners)
    for tuner in tuners:
        monkeypatch.setitem(tuner.cache, ("planted",), tuner.configs[0])
    reset_autotuning()
    assert all(not tuner.cache for tuner in tuners)

    gen = torch.Generator().manual_seed(3)
    queries, keys = torch.randn(30, 8, generator=gen), torch.randn(40, 8, generator=gen)
    expected = contrastive_loss(queries, keys, 10.0, backend=TorchTiles(), precision="ieee")
    value = contrastive_loss(queries, keys, 10.0, backend=BLOCKS, precision="ieee")
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tiny_tunes", [True, False], ids=["tuned", "tiny-untuned"])
def test_a_kernel_key_launched_before_skips_the_autotuner(monkeypatch, tmp_path, tiny_tunes):
    """With autotuning on (as on a GPU), the first launch of each kernel and tuning key goes
    through the tuning store and the autotuner; later launches with that key go straight to the
    JIT function with the configuration chosen then (host time). Problems of the tiny size class
    never go through the autotuner (``tiny-untuned``; these test shapes are tiny, so ``tuned``
    gives the class no special case). Both calls' loss and gradients match the tiled backend."""
    from hf_infcl.ops.triton import launch
    from hf_infcl.ops.triton.grad_tile import GRAD_TILE_KERNEL
    from hf_infcl.ops.triton.stats import STATS_KERNEL
    from hf_infcl.ops.triton.tuning_store import TuningStore

    # What launch() does on a GPU, under the interpreter (whose autotuners hold one config).
    monkeypatch.setattr(launch, "_tunes", lambda: True)
    if tiny_tunes:
        monkeypatch.setattr(launch, "TINY", -1)  # no size class is "tiny"
    monkeypatch.setattr(launch, "_UNTUNED_CONFIGS", {})
    monkeypatch.setattr(launch, "device_name", lambda device: "interpreter")
    monkeypatch.setattr(launch, "TUNING_STORE", TuningStore(tmp_path))
    monkeypatch.setattr(launch, "_CHOSEN", {})
    runs = {}
    for name, kernel in (("_stats_kernel", STATS_KERNEL), ("_grad_tile_kernel", GRAD_TILE_KERNEL)):
        tuner = kernel.tuner

        def counted(*args, _run=tuner.run, _name=name, **kwargs):
            runs[_name] = runs.get(_name, 0) + 1
            return _run(*args, **kwargs)

        monkeypatch.setattr(tuner, "run", counted)

    gen = torch.Generator().manual_seed(5)
    tiles = TritonBlocks(tile_rows=20, tile_keys=24)  # several super-tiles: several grad launches
    for _ in range(2):
        queries = torch.randn(50, 24, generator=gen).requires_grad_(True)
        keys = torch.randn(60, 24, generator=gen).requires_grad_(True)
        results = []
        for backend in (tiles, TorchTiles()):
            # TF32: exact fp32 ("ieee") runs one configuration and never meets the autotuner
            loss = contrastive_loss(queries, keys, 7.0, backend=backend, precision="tf32")
            results.append((loss, *torch.autograd.grad(loss, [queries, keys])))
        for value, expected in zip(*results):  # TF32 operands (and the Triton route's fp16 G): norm-wise
            assert (value - expected).norm() <= 1e-2 * expected.norm(), (value, expected)
    assert runs == ({"_stats_kernel": 1, "_grad_tile_kernel": 1} if tiny_tunes else {})


@pytest.mark.parametrize("route", ["softmax", "softmax-two-pass", "sigmoid-one-pass", "positives",
                                   "filter-positives", "filter-shared-positive"])
def test_value_checks_raise_before_the_first_kernel(route, monkeypatch):
    """The Triton block ops make one process's value checks (scale > 0, positives in range)
    after preparing their operands, just before the loss's first kernel (for the statistics
    kernel: in its launch, just before the kernel): the error names the argument, and no
    kernel of the loss (statistics, gradient tiles, the sigmoid one pass's GEMM) has run. The
    score filter's thresholds come before the check, from the positives clamped into the keys:
    an index past them would end the process on a GPU."""
    from hf_infcl.ops.triton import blocks, stats, super_tiles

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel of the loss ran before the values were checked")

    combine_rows = blocks.combine_rows

    def thresholds_only(**arguments):  # the filter's thresholds: the positives' scores, indices in range
        index = arguments["source_index"]
        assert route.startswith("filter") and arguments["dot_with"] is not None, "a loss kernel ran first"
        assert index is None or 0 <= int(index.min()) <= int(index.max()) < arguments["sources"].shape[0]
        return combine_rows(**arguments)

    class NoKernel:  # the statistics kernel's autotuner: launched as tuner[grid](...)
        def __getitem__(self, grid):
            return no_kernel

    monkeypatch.setattr(stats, "STATS_KERNEL", dataclasses.replace(stats.STATS_KERNEL, tuner=NoKernel()))
    monkeypatch.setattr(stats, "merge_partials", no_kernel)
    for name in ("grad_tile", "sigmoid_from_dots", "add_product"):
        monkeypatch.setattr(super_tiles, name, no_kernel)
    monkeypatch.setattr(blocks, "combine_rows", thresholds_only)
    gen = torch.Generator().manual_seed(11)
    queries = torch.randn(9, 8, generator=gen).requires_grad_(True)
    keys = torch.randn(12, 8, generator=gen).requires_grad_(True)
    arguments = dict(logit_scale=torch.tensor(-3.0), backend=BLOCKS, precision="ieee")
    named = "logit_scale"
    if route == "softmax-two-pass":
        arguments["backend"] = TWO_PASS
    elif route == "sigmoid-one-pass":
        arguments.update(loss="sigmoid", logit_bias=-2.0)
    elif route == "positives":
        arguments.update(logit_scale=5.0, positives=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 12]))
        named = "positives"
    elif route == "filter-positives":
        arguments.update(logit_scale=5.0, positives=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 12]),
                         false_negative_margin=0.1)
        named = "positives"
    elif route == "filter-shared-positive":
        arguments.update(logit_scale=5.0, positives=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 7]),
                         false_negative_margin=0.1)
        named = "positives: two rows share a positive key"
    with pytest.raises(ValueError, match=named):
        contrastive_loss(queries, keys, **arguments)


def test_a_key_no_row_may_pair_with_gives_no_nan():
    """Every row in group 0 and a non-positive key in group 0 too: that key is a negative of no
    row, so its column statistic is -inf; the backward's column probability for it is then
    inf times a zero weight and must be dropped, not turned into NaN."""
    case = random_case(6, 9, 40, groups=False, custom_positives=False, seed=random.randrange(2**31))
    case["query_groups"] = torch.zeros(6, dtype=torch.int64)
    case["key_groups"] = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1])  # key 6: nobody's negative
    expected = loss_and_grads(case, torch.float64, "reference", **LOSSES["softmax-sym"])
    got = loss_and_grads(case, torch.float32, BLOCKS, precision="ieee", **LOSSES["softmax-sym"])
    for name in expected:
        assert relative_error(got[name], expected[name]) < 5e-5, name


@pytest.mark.parametrize("n_outer, n_inner", [(32768, 32768), (65536, 65536), (9, 4000), (8192, 8192)])
def test_automatic_splits_are_whole_blocks(n_outer, n_inner):
    """The statistics launch's automatic splits cover the inner range in ranges of whole blocks of
    the widest config (each split's tiles are then whole where the problem's are: the FULL path);
    an explicit split count is kept as asked."""
    from hf_infcl.ops.triton.stats import STATS_KERNEL, inner_splits

    widest = max(config.kwargs["BLOCK_N"] for config in STATS_KERNEL.tuner.configs)
    splits, per_split = inner_splits(n_outer, n_inner, torch.device("cpu"))
    assert per_split % widest == 0
    assert (splits - 1) * per_split < n_inner <= splits * per_split
    assert inner_splits(n_outer, n_inner, torch.device("cpu"), 3) == (3, -(-n_inner // 3))


@pytest.mark.parametrize("case", ["softmax-columns-groups-hardness-r37-k45-c20-fp32",
                                  "sigmoid-one-pass-scaled-r32-k64-c32-fp16"])
def test_launch_past_the_autotuner_equals_a_plain_launch(case):
    """The interpreter's side of ``test_gpu_launch_past_the_autotuner_equals_a_plain_launch``:
    a launch with the configuration a plain launch (``tuner[grid](...)``) returned goes through
    the JIT function with the heuristics and the config's pre-hook applied by ``launch`` itself
    (the compiled kernel's launcher is GPU-only: nothing is kept for it here) and writes exactly
    what the plain launch wrote."""
    from hf_infcl.ops.triton import launch
    from tests.test_triton import LAUNCH_CASES, assert_same_launch, grad_tile_launcher

    assert case in LAUNCH_CASES
    run = grad_tile_launcher(case, "cpu")
    plain = run(None)
    past_the_tuner = run(plain[3])
    assert_same_launch(past_the_tuner, plain, exact=True)
    assert not launch._COMPILED


# ------------------------------------------------------------------------------------------------
# Several positives per row and the score filter (docs/contract.md): the positive parts outside the
# kernels, the filter's row and column masks inside (FILTER, GUIDE, GROUP_POSITIVES).

# name: (margin, strategy, guide width or None)
OBJECTIVE_FILTERS = {"nofilter": (None, "absolute", None), "absolute": (0.05, "absolute", None),
                     "negative-relative": (-0.2, "relative", None), "guide": (0.1, "absolute", 24)}
OBJECTIVE_CASES = [(loss_name, mode, name) for loss_name in LOSSES for mode in (None, "any", "each")
                   for name in OBJECTIVE_FILTERS if (mode, name) != (None, "nofilter")]
OBJECTIVE_SHAPES = [(7, 19, 40), (33, 71, 3), (19, 45, 32), (13, 13, 20)]


def with_objectives(case, dtype, mode, filter_name, seed):
    """``case`` with several positives and the filter under ``case["objectives"]``; for the TF32
    modes the features (and the guide) already TF32 values that the fp16 route also holds exactly,
    so that the kernels' rounding changes nothing and the float64 reference takes the filter's
    decisions from the same scores."""
    from hf_infcl.ops.triton.operands import round_to_tf32

    margin, strategy, guide_width = OBJECTIVE_FILTERS[filter_name]
    gen = torch.Generator().manual_seed(seed)
    m, k = case["queries"].shape[0], case["keys"].shape[0]
    objectives = dict(group_positives=mode, false_negative_margin=margin, false_negative_strategy=strategy)
    if guide_width is not None:
        objectives.update(guide_queries=torch.randn(m, guide_width, generator=gen, dtype=torch.float64),
                          guide_keys=torch.randn(k, guide_width, generator=gen, dtype=torch.float64))
    case = dict(case, objectives=objectives)
    if dtype == "tf32":
        def tf32(tensor):
            # Also exact in the fp16 route (tf32_via_fp16), which divides each operand by its largest
            # magnitude and rounds to fp16: that magnitude a power of two, and nothing left below
            # fp16's normal range once divided. A rounded score could otherwise fall on the other
            # side of a threshold than the reference's, and one entry decide the errors.
            values = round_to_tf32(tensor.float()).double()
            largest = values.abs().max()
            top = 2.0 ** torch.ceil(torch.log2(largest))
            values[values.abs() < top * 2.0**-14] = 0.0
            values.view(-1)[values.abs().argmax()] = top * values.view(-1)[values.abs().argmax()].sign()
            return values

        case.update(queries=tf32(case["queries"]), keys=tf32(case["keys"]))
        for name in ("guide_queries", "guide_keys"):
            if name in objectives:
                objectives[name] = tf32(objectives[name])
    return case


def _distinct_groups(m, k, seed):
    """Groups with several rows and keys each (ids beyond the rows' too, so some keys are nobody's)."""
    gen = torch.Generator().manual_seed(seed)
    n_groups = max(2, m // 3)
    query_groups = torch.randint(0, n_groups, (m,), generator=gen)
    return query_groups, torch.randint(0, n_groups + 2, (k,), generator=gen)


@pytest.mark.parametrize("loss_name,mode,filter_name", OBJECTIVE_CASES,
                         ids=[f"{lo}-{mo}-{f}" for lo, mo, f in OBJECTIVE_CASES])
def test_objectives_match_float64_reference(loss_name, mode, filter_name):
    """Each case in one of the precision modes and shapes, in turn, so that every mode meets every
    option; groups that hold several rows and keys, custom positives, hard negatives; the sigmoid
    loss's cases alternate between per-row losses and a mean (its one pass, which the filter routes
    through the fused kernel)."""
    index = OBJECTIVE_CASES.index((loss_name, mode, filter_name))
    mode_name = list(MODES)[index % len(MODES)]
    dtype, precision, blocks = MODES[mode_name]
    shape = OBJECTIVE_SHAPES[index % len(OBJECTIVE_SHAPES)]
    seed = random.randrange(2**31)
    case = random_case(*shape, groups=False, custom_positives=True, seed=seed)
    case["query_groups"], case["key_groups"] = _distinct_groups(*shape[:2], seed)
    case = with_objectives(case, "tf32" if "tf32" in mode_name else dtype, mode, filter_name, seed)
    options = dict(LOSSES[loss_name])
    if loss_name.startswith("sigmoid") and index % 2:
        options["reduction"] = "mean"
    errors = errors_against_reference(case, dtype, blocks, precision, options)
    assert max(errors.values()) < TOLERANCE[mode_name], (seed, mode_name, errors)


@pytest.mark.parametrize("loss_name,mode", [("softmax-sym", "any"), ("softmax-asym", "each"),
                                            ("sigmoid-bias", "any")])
def test_group_positives_take_the_ranges_route(monkeypatch, loss_name, mode):
    """The Triton block ops walk the positive pairs as ranges: never the list (whose length the
    host must read), forward or backward; the result matches the float64 reference."""
    from hf_infcl.ops import key_blocks, positive_pairs

    def no_list(*args, **kwargs):
        raise AssertionError("the pairs were listed")

    for module in (key_blocks, positive_pairs):
        monkeypatch.setattr(module, "count_pairs", no_list)
    seed = random.randrange(2**31)
    case = random_case(19, 45, 32, groups=False, custom_positives=True, seed=seed)
    case["query_groups"], case["key_groups"] = _distinct_groups(19, 45, seed)
    case = with_objectives(case, torch.float32, mode, "nofilter", seed)
    errors = errors_against_reference(case, torch.float32, BLOCKS, "ieee", LOSSES[loss_name])
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)


def test_group_ranges_route_only_where_the_kernels_take_it():
    """The ranges' kernels hold a whole vector per program: wider ones, and float64 (which the
    block ops hand to the PyTorch tiles), take the list of pairs."""
    from hf_infcl.ops.positive_pairs import takes_group_ranges
    from hf_infcl.ops.triton import group_pairs

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert takes_group_ranges(BLOCKS, torch.empty(3, group_pairs.MAX_WIDTH, dtype=dtype))
    assert not takes_group_ranges(BLOCKS, torch.empty(3, group_pairs.MAX_WIDTH + 1))
    assert not takes_group_ranges(BLOCKS, torch.empty(3, 8, dtype=torch.float64))
    assert not takes_group_ranges(TorchTiles(), torch.empty(3, 8))


@pytest.mark.parametrize("route", list(FULL_ROUTES))
@pytest.mark.parametrize("mode", [None, "each"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_whole_blocks_with_the_filter_match_float64_reference(loss_name, mode, route):
    """The FULL path (no tile past an end, no group mask: no ``allowed`` tile at all) with the
    filter's masks, a guide, both forward routes."""
    m, k, c = FULL_SHAPE
    seed = random.randrange(2**31)
    case = random_case(m, k, c, groups=False, custom_positives=True, seed=seed)
    if mode is not None:
        case["query_groups"], case["key_groups"] = _distinct_groups(m, k, seed)
    case = with_objectives(case, torch.float32, mode, "guide", seed)
    errors = errors_against_reference(case, torch.float32, FULL_ROUTES[route], "ieee", LOSSES[loss_name])
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)


DEFAULT_POSITIVE_ROUTES = {"blocks": (BLOCKS, (45, 83, 20)), "two-pass": (TWO_PASS, (45, 83, 20)),
                           "whole-blocks": (FULL_ROUTES["fused-columns"], FULL_SHAPE)}


@pytest.mark.parametrize("route", list(DEFAULT_POSITIVE_ROUTES))
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_the_filter_with_the_default_positives_matches_reference(loss_name, route):
    """The default positives (``keys[:m]``, no indices): the filter spares them across row panels,
    key tiles, splits and row chunks, in tiles with and without positives (near-duplicates of the
    positives, among the rows' own keys and the extra ones, put left-out entries into both). The
    same positives given as indices give the same numbers, bit for bit."""
    blocks, (m, k, c) = DEFAULT_POSITIVE_ROUTES[route]
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    case = random_case(m, k, c, groups=False, custom_positives=False, seed=seed)
    keys = case["keys"].clone()
    for duplicate in torch.randperm(k, generator=gen)[: k // 4].tolist():
        source = int(torch.randint(0, m, (1,), generator=gen))
        keys[duplicate] = keys[source] + 0.02 * torch.randn(c, generator=gen, dtype=torch.float64)
    case = with_objectives(dict(case, keys=keys), torch.float32, None, "absolute", seed)
    options = LOSSES[loss_name]
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", options)
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)
    default = loss_and_grads(case, torch.float32, blocks, precision="ieee", **options)
    as_indices = loss_and_grads(dict(case, positives=torch.arange(m)), torch.float32, blocks,
                                precision="ieee", **options)
    for name, value in default.items():
        assert torch.equal(value, as_indices[name]), (seed, name)


@pytest.mark.parametrize("guided", [False, True], ids=["own", "guide"])
@pytest.mark.parametrize("route", ["blocks", "whole-blocks"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_the_filter_s_tiles_without_left_out_entries_skip_its_masks(loss_name, route, guided):
    """The backward's tiles with no score above any of their thresholds run without the filter's
    masks (``may_leave_out``), the others with them. Positives far above every other score, and
    near-copies planted: an extra key close to row 3's positive (a false negative of row 3), a row
    close to row 2 (it leaves key 2 out, and key 2's column leaves it out). Those tiles and the
    diagonal ones (the positives score above their thresholds) take the masks, most others not. A
    tile wrongly taken as without left-out entries keeps a near-copy: the comparison with float64
    fails."""
    blocks, (m, k, c) = DEFAULT_POSITIVE_ROUTES[route]
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)

    def near(x):
        return x + 0.01 * torch.randn(c, generator=gen, dtype=torch.float64)

    queries = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, dtype=torch.float64), dim=1)
    queries[m - 1] = near(queries[2])
    keys = 0.3 * torch.nn.functional.normalize(torch.randn(k, c, generator=gen, dtype=torch.float64), dim=1)
    keys[:m] += queries  # each positive scores about 1, any other key about 0.3 / sqrt(c) * N(0, 1)
    keys[k - 2] = near(keys[3])
    case = dict(queries=queries, keys=keys, scale=float(torch.empty(1).uniform_(2.0, 5.0, generator=gen)),
                bias=-3.0, positives=None, query_groups=None, key_groups=None,
                row_weights=torch.rand(m, generator=gen, dtype=torch.float64) + 0.1)
    objectives = dict(false_negative_margin=0.2)
    if guided:  # the same features a little apart: the same entries left out
        blocks = dataclasses.replace(blocks, listed_row_share=0.0)  # else the softmax loss lists them
        noise = 1e-3 * torch.randn(m + k, c, generator=gen, dtype=torch.float64)
        objectives.update(guide_queries=queries + noise[:m], guide_keys=keys + noise[m:])
    case["objectives"] = objectives
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", LOSSES[loss_name])
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)

    # the premise: the interpreter's 16 x 16 tiles, off the diagonal, with and without left-out entries
    scores = queries @ keys.T
    thresholds = scores.diagonal() - 0.2
    over = scores > thresholds[:, None]
    over[:, :m] |= scores[:, :m] > thresholds[None, :]
    over[range(m), range(m)] = False
    tiles = torch.nn.functional.max_pool2d(over.double()[None], 16, ceil_mode=True)[0]
    assert 0 < tiles.sum() < tiles.numel() - 2, (seed, tiles)


@pytest.mark.parametrize("filter_name", ["absolute", "guide"])
@pytest.mark.parametrize("mode", [None, "any"])
def test_two_pass_forward_with_the_filter_matches_reference(mode, filter_name):
    """The column-major column pass (fused_columns=False) takes the keys' thresholds, and the
    guide in its (keys, rows) roles."""
    seed = random.randrange(2**31)
    case = random_case(33, 71, 20, groups=False, custom_positives=True, seed=seed)
    case["query_groups"], case["key_groups"] = _distinct_groups(33, 71, seed)
    case = with_objectives(case, torch.float32, mode, filter_name, seed)
    errors = errors_against_reference(case, torch.float32, TWO_PASS, "ieee", LOSSES["softmax-sym"])
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)


# The guided score filter's left-out entries (hf_infcl.ops.triton.left_out): listed, the backward's
# tiles run unmasked and the listed entries' terms are taken back; where no rows may be listed, or
# more rows have left-out entries than the share that may, the backward filters every tile.
# (loss, group_positives, false_negative_strategy, block ops)
LEFT_OUT_SHARES = {"listed": 1.0, "no-list": 0.0, "too-many-rows": 1e-6}
LEFT_OUT_CASES = [("softmax-sym", None, "absolute", BLOCKS), ("softmax-sym", "each", "absolute", BLOCKS),
                  ("softmax-asym", "any", "relative", BLOCKS), ("softmax-sym", None, "relative", TWO_PASS),
                  ("softmax-sym", "any", "absolute", BLOCKS_VIA_FP16)]


@pytest.mark.parametrize("share", list(LEFT_OUT_SHARES))
@pytest.mark.parametrize("case_index", range(len(LEFT_OUT_CASES)),
                         ids=[f"{lo}-{mo}-{f}-{i}" for i, (lo, mo, f, _) in enumerate(LEFT_OUT_CASES)])
def test_the_filter_s_left_out_list_matches_float64_reference(monkeypatch, case_index, share):
    """Both backward routes of the filter against float64 (the fused forward's row chunks, the
    two-pass forward, several positives, a guide, the fp16 copies), and the route each takes: the
    unmasked, clamped tiles and the take-back of every left-out entry when the list holds them all,
    the masked tiles otherwise."""
    from hf_infcl.ops.triton import blocks as triton_blocks
    from hf_infcl.ops.triton import super_tiles

    loss_name, mode, strategy, blocks = LEFT_OUT_CASES[case_index]
    # the features leave out many entries: no bound on their number
    blocks = dataclasses.replace(blocks, listed_row_share=LEFT_OUT_SHARES[share],
                                 listed_entries_per_vector=10**6)
    launches, counts = [], []
    original_tile, original_take_back = super_tiles.grad_tile, triton_blocks.take_back_left_out

    def tile(*args, **kwargs):
        launches.append((kwargs["clamp_exponents"], kwargs.get("row_thresholds") is not None))
        return original_tile(*args, **kwargs)

    def take_back(left_out, *args):
        counts.append(int(left_out.count))
        return original_take_back(left_out, *args)

    monkeypatch.setattr(super_tiles, "grad_tile", tile)
    monkeypatch.setattr(triton_blocks, "take_back_left_out", take_back)
    seed = random.randrange(2**31)
    case = random_case(33, 71, 20, groups=False, custom_positives=True, seed=seed)
    if mode is not None:
        case["query_groups"], case["key_groups"] = _distinct_groups(33, 71, seed)
    precision = "tf32" if blocks.tf32_via_fp16 else "ieee"
    case = with_objectives(case, "tf32" if blocks.tf32_via_fp16 else torch.float32, mode, "guide", seed)
    case["objectives"]["false_negative_strategy"] = strategy
    errors = errors_against_reference(case, torch.float32, blocks, precision, LOSSES[loss_name])
    tolerance = TOLERANCE["fp32-tf32-fp16" if blocks.tf32_via_fp16 else "fp32-ieee"]
    assert max(errors.values()) < tolerance, (seed, errors)
    if share == "listed":
        assert launches and all(clamped and not filtered for clamped, filtered in launches), launches
        assert counts and counts[0] > 0, counts  # the filter left entries out, and they were taken back
    else:
        assert launches and all(filtered and not clamped for clamped, filtered in launches), launches
        assert not counts


@pytest.mark.parametrize("route", ["blocks", "two-pass"])
@pytest.mark.parametrize("loss_name", ["softmax-sym", "softmax-asym"])
def test_the_guided_forward_takes_the_plain_kernel_for_rows_without_left_out_entries(monkeypatch, loss_name,
                                                                                       route):
    """A guide that leaves out entries of three rows of fifty (their positive's key copied to a key
    nobody owns): those rows and the remainder of a whole row block take the filtering statistics
    launch, the other rows the plain one, and the loss and its gradients match float64."""
    from hf_infcl.ops.triton import blocks as triton_blocks
    from hf_infcl.ops.triton import stats

    launches, original = [], stats.logit_stats

    def recording(outer, inner, *args, **kwargs):
        filtered = kwargs.get("row_thresholds") is not None or kwargs.get("key_thresholds") is not None
        launches.append((outer.shape[0], kwargs["columns"], filtered))
        return original(outer, inner, *args, **kwargs)

    monkeypatch.setattr(stats, "logit_stats", recording)
    m, k, whole = 50, 90, triton_blocks._WHOLE_ROWS
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    case = with_objectives(random_case(m, k, 20, groups=False, custom_positives=True, seed=seed),
                           torch.float32, None, "guide", seed)
    positives = case["positives"]
    guide_queries = torch.randn(m, 24, generator=gen, dtype=torch.float64)
    guide_keys = 0.1 * torch.randn(k, 24, generator=gen, dtype=torch.float64)
    guide_keys[positives] = 3 * guide_queries  # every positive far above the row's other keys
    nobody_s = [key for key in range(k) if key not in set(positives.tolist())][:3]
    for row, key in zip((4, 21, 37), nobody_s):
        guide_keys[key] = guide_keys[positives[row]]
    case["objectives"].update(guide_queries=guide_queries, guide_keys=guide_keys)
    blocks = BLOCKS if route == "blocks" else TWO_PASS
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", LOSSES[loss_name])
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)
    plain_rows = (m - 3) // whole * whole
    rows_by_filter = {False: 0, True: 0}
    for rows, columns, filtered in launches:  # the fused route launches row chunks
        if not columns:
            rows_by_filter[filtered] += rows
    assert rows_by_filter == {False: plain_rows, True: m - plain_rows}, launches


def test_too_many_left_out_entries_keep_the_masks(monkeypatch):
    """A list longer than its bound per row and key (here 0: any entry) is not made: the backward
    filters every tile, whatever the share of rows."""
    from hf_infcl.ops.triton import blocks as triton_blocks
    from hf_infcl.ops.triton import super_tiles

    launches, original_tile = [], super_tiles.grad_tile

    def tile(*args, **kwargs):
        launches.append((kwargs["clamp_exponents"], kwargs.get("row_thresholds") is not None))
        return original_tile(*args, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("left-out entries were listed")

    monkeypatch.setattr(super_tiles, "grad_tile", tile)
    monkeypatch.setattr(triton_blocks, "empty_list", never)
    seed = random.randrange(2**31)
    case = with_objectives(random_case(33, 71, 20, groups=False, custom_positives=True, seed=seed),
                           torch.float32, None, "guide", seed)
    blocks = dataclasses.replace(BLOCKS, listed_row_share=1.0, listed_entries_per_vector=0)
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", LOSSES["softmax-sym"])
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)
    assert launches and all(filtered and not clamped for clamped, filtered in launches), launches


def test_the_filter_without_a_guide_keeps_its_masks_in_the_backward(monkeypatch):
    """The model's own scores: the masks cost the backward's tiles less than counting the left-out
    entries would cost the forward's, so nothing is counted or listed, whatever the share."""
    from hf_infcl.ops.triton import blocks as triton_blocks
    from hf_infcl.ops.triton import super_tiles

    def never(*args, **kwargs):
        raise AssertionError("left-out entries were counted or listed")

    launches, original_tile = [], super_tiles.grad_tile

    def tile(*args, **kwargs):
        launches.append((kwargs["clamp_exponents"], kwargs.get("row_thresholds") is not None))
        return original_tile(*args, **kwargs)

    monkeypatch.setattr(super_tiles, "grad_tile", tile)
    monkeypatch.setattr(triton_blocks, "zero_counts", never)
    seed = random.randrange(2**31)
    case = with_objectives(random_case(33, 71, 20, groups=False, custom_positives=True, seed=seed),
                           torch.float32, None, "absolute", seed)
    blocks = dataclasses.replace(BLOCKS, listed_row_share=1.0)
    errors = errors_against_reference(case, torch.float32, blocks, "ieee", LOSSES["softmax-sym"])
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)
    assert launches and all(filtered and not clamped for clamped, filtered in launches), launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_statistics_launches_find_the_shipped_choices(monkeypatch, dtype):
    """A tuning key lists the dtype of every tensor argument of the launch, so a kernel argument
    added without the shipped files' keys following would make every first call on a known GPU
    tune again: a plain launch's dtypes are those of shipped keys (every shipped file). Only the
    launches' keys matter here, not the interpreter's (bf16) numbers."""
    import ast
    import json

    from hf_infcl.ops.triton import stats
    from hf_infcl.ops.triton.tuning_store import SHIPPED_DIRECTORY, tuning_key

    launched, original = [], stats.launch

    def recording(kernel, grid, device, *args, **kwargs):
        launched.append(tuning_key(kernel.tuner, args, kwargs)[2:])  # past (c, size_class)
        return original(kernel, grid, device, *args, **kwargs)

    monkeypatch.setattr(stats, "launch", recording)
    case = random_case(7, 19, 40, groups=False, custom_positives=False, seed=0)
    loss_and_grads(case, dtype, BLOCKS, loss="softmax", symmetric=True, use_bias=False, precision="auto")
    files = sorted(SHIPPED_DIRECTORY.glob("*.json"))
    assert launched and files
    for path in files:
        shipped = {ast.literal_eval(key)[2:] for key in json.loads(path.read_text())[stats.STATS_KERNEL.name]}
        assert set(launched) <= shipped, (path.name, launched)


def test_the_listed_bounds_are_checked():
    for wrong in (-0.1, 1.5, "all", True):
        message = f"^listed_row_share must be a number from 0 to 1, got {wrong!r}$"
        with pytest.raises(ValueError, match=message):
            TritonBlocks(listed_row_share=wrong)
    for wrong in (-1, 2.5, True):
        message = f"^listed_entries_per_vector must be a non-negative integer, got {wrong!r}$"
        with pytest.raises(ValueError, match=message):
            TritonBlocks(listed_entries_per_vector=wrong)


@pytest.mark.parametrize("hardness_mode", HARDNESS_MODES)
def test_hardness_offset_with_group_positives_matches_reference(hardness_mode):
    """GROUP_POSITIVES in the hardness offset: no key of a row's group is offset."""
    seed = random.randrange(2**31)
    case = random_case(19, 45, 32, groups=False, custom_positives=True, seed=seed)
    case["query_groups"], case["key_groups"] = _distinct_groups(19, 45, seed)
    case = with_hardness(case, hardness_mode, 4.0, seed)
    case = with_objectives(case, torch.float32, "any", "absolute", seed)
    errors = errors_against_reference(case, torch.float32, BLOCKS, "ieee", LOSSES["softmax-sym"])
    assert max(errors.values()) < TOLERANCE["fp32-ieee"], (seed, errors)


def test_kernels_without_the_options_are_unchanged():
    """The new switches are compile-time constants that are off by default: a launch without them
    passes FILTER, GUIDE, GROUP_POSITIVES and the left-out entries' CLAMP off, so Triton compiles the
    same kernel as before."""
    from hf_infcl.ops.triton import grad_tile, stats

    switches = {stats: ("FILTER", "GUIDE", "GROUP_POSITIVES"),
                grad_tile: ("FILTER", "GUIDE", "GROUP_POSITIVES", "CLAMP")}
    seen = []
    for module, names in switches.items():
        kernel = stats.STATS_KERNEL.body if module is stats else grad_tile.GRAD_TILE_KERNEL.body
        assert set(names) <= set(kernel.arg_names)
    originals = {module: module.launch for module in switches}

    def recording(module):
        def launch(kernel, grid, device, *args, **kwargs):
            seen.append({name: kwargs[name] for name in switches[module]})
            return originals[module](kernel, grid, device, *args, **kwargs)
        return launch

    for module in switches:
        module.launch = recording(module)
    try:
        case = random_case(7, 19, 40, groups=True, custom_positives=True, seed=1)
        loss_and_grads(case, torch.float32, BLOCKS, loss="softmax", symmetric=True, use_bias=False)
    finally:
        for module, original in originals.items():
            module.launch = original
    assert len(seen) >= 2 and all(not any(flags.values()) for flags in seen)



@triton.jit
def _rounded_copy(source_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = the kernels' rounding to TF32 of source (what dot_tile's ROUND_TF32 applies)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n
    tl.store(out_ptr + offsets, jit_round_to_tf32(tl.load(source_ptr + offsets, mask=valid)), mask=valid)


def test_kernel_rounding_to_tf32_equals_the_operand_copies():
    """dot_tile's ROUND_TF32 (the score filter's guide, rounded as the kernels load it) gives the
    bits of operands.round_to_tf32 (the kernels' rounded operand copies), on random magnitudes and
    halfway cases, where truncating would differ."""
    from hf_infcl.ops.triton.operands import round_to_tf32

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4096, generator=gen) * torch.logspace(-20, 20, 4096).to(torch.float32)
    halfway = torch.randint(0, 2**20, (512,), generator=gen, dtype=torch.int32) * 0x2000 + 0x1000 + 0x3F000000
    x = torch.cat([x, halfway.view(torch.float32), -halfway.view(torch.float32)])
    out = torch.full_like(x, float("nan"))
    _rounded_copy[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    assert torch.equal(out.view(torch.int32), round_to_tf32(x).view(torch.int32))
    assert not torch.equal(out, (x.view(torch.int32) & -0x2000).view(torch.float32)), "truncation would pass"


# In-batch distillation (docs/contract.md, "Distillation over the batch") on the Triton block ops:
# the statistics kernel in both directions (split inner ranges merged), the gradient route over
# several poisoned super-tiles, against the float64 oracle on the same rounded inputs.

# (m, k, c, teacher width): teachers narrower and wider than the student, widths on and off BLOCK_K
DISTILLATION_SHAPES = [(7, 19, 40, 24), (33, 71, 3, 32), (19, 45, 32, 5), (1, 17, 32, 16)]
DISTILLATION_MODES = ("fp32-ieee", "fp32-tf32", "fp16")


def distillation_case(m, k, c, teacher_width, seed):
    """Unit-norm student and teacher features that half agree (each positive pulled towards its row),
    positives permuted when there are more keys than rows."""
    gen = torch.Generator().manual_seed(seed)

    def unit(rows, width):
        return torch.nn.functional.normalize(torch.randn(rows, width, generator=gen, dtype=torch.float64),
                                             dim=1)

    queries, keys = unit(m, c), unit(k, c)
    teacher_queries, teacher_keys = unit(m, teacher_width), unit(k, teacher_width)
    positives = torch.randperm(k, generator=gen)[:m] if k > m else torch.arange(m)
    keys[positives] = torch.nn.functional.normalize(keys[positives] + queries, dim=1)
    teacher_keys[positives] = torch.nn.functional.normalize(teacher_keys[positives] + 2 * teacher_queries,
                                                            dim=1)
    return dict(queries=queries, keys=keys, teacher_queries=teacher_queries, teacher_keys=teacher_keys,
                positives=positives)


@pytest.mark.parametrize("mode", DISTILLATION_MODES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("shape", DISTILLATION_SHAPES,
                         ids=[f"m{m}-k{k}-c{c}-t{t}" for m, k, c, t in DISTILLATION_SHAPES])
def test_distillation_matches_float64_oracle(shape, symmetric, mode):
    from hf_infcl import contrastive_distillation_loss
    from tests.helpers.oracle_distillation import distillation_loss

    dtype, precision, blocks = MODES[mode]
    seed = random.randrange(2**31)
    case = distillation_case(*shape, seed)
    weight = 1.0 if seed % 2 else 0.5  # the KL alone, or mixed with InfoNCE
    if mode == "fp32-tf32":  # TF32 values, so that the kernels' rounding changes nothing
        from hf_infcl.ops.triton.operands import round_to_tf32

        case = {name: round_to_tf32(value.float()).double() if value.is_floating_point() else value
                for name, value in case.items()}
    inputs = {name: value.to(dtype) if value.is_floating_point() else value for name, value in case.items()}
    queries = inputs["queries"].clone().requires_grad_()
    keys = inputs["keys"].clone().requires_grad_()
    scale = torch.tensor(7.0, requires_grad=True)
    loss = contrastive_distillation_loss(queries, keys, inputs["teacher_queries"], inputs["teacher_keys"],
                                         scale, 5.0, symmetric=symmetric, positives=inputs["positives"],
                                         distillation_weight=weight, backend=blocks, precision=precision)
    loss.backward()
    rounded = {name: inputs[name].double().numpy()
               for name in ("queries", "keys", "teacher_queries", "teacher_keys")}
    expected, expected_grads = distillation_loss(
        rounded["queries"], rounded["keys"], rounded["teacher_queries"], rounded["teacher_keys"], 7.0, 5.0,
        symmetric=symmetric, positives=case["positives"].numpy(), distillation_weight=weight)
    errors = {
        "loss": relative_error(loss.detach().double().reshape(1), torch.tensor([float(expected)])),
        "queries": relative_error(queries.grad.double(), torch.from_numpy(expected_grads["queries"])),
        "keys": relative_error(keys.grad.double(), torch.from_numpy(expected_grads["keys"])),
        "scale": relative_error(scale.grad.double().reshape(1),
                                torch.tensor([float(expected_grads["scale"])])),
    }
    assert max(errors.values()) < TOLERANCE[mode], (seed, weight, errors)


def test_distillation_statistics_merge_split_inner_ranges():
    """soft_target_stats with the inner range split over programs (each split's partial statistics
    merged by merge_soft_target_parts) equals it in one range, and both equal float64."""
    from hf_infcl.ops.triton.distillation import soft_target_stats

    case = distillation_case(9, 53, 20, 12, seed=3)
    f32 = {name: value.float() for name, value in case.items() if value.is_floating_point()}
    scale, teacher_scale = torch.tensor(6.0), torch.tensor(4.0)
    operands = (f32["queries"], f32["keys"], f32["teacher_queries"], f32["teacher_keys"], scale,
                teacher_scale)
    whole = soft_target_stats(*operands, precision="ieee", splits=1)
    split = soft_target_stats(*operands, precision="ieee", splits=4)
    z = 6.0 * case["queries"] @ case["keys"].T
    t = 4.0 * case["teacher_queries"] @ case["teacher_keys"].T
    expected = soft_target_stats_direct(z, t, dim=1)
    for got in (whole, split):
        for part, reference in zip(got, expected):
            assert torch.allclose(part.double(), reference, rtol=1e-5, atol=1e-5)


def _stacked_soft_target_stats(z: torch.Tensor, t: torch.Tensor, dim: int) -> torch.Tensor:
    """[3, n]: :func:`soft_target_stats_direct` stacked, as the merge kernel holds them."""
    return torch.stack(soft_target_stats_direct(z, t, dim))


@pytest.mark.parametrize("previous", [False, True], ids=["alone", "with-previous"])
@pytest.mark.parametrize("sets", [1, 6, 11], ids=lambda sets: f"sets{sets}")
def test_soft_target_parts_merge_into_the_statistics_over_every_key(sets, previous):
    """merge_soft_target_parts (the splits' and the Gluon kernel's column partials' merge) against
    float64: numbers of sets that are and are not a multiple of the kernel's block, logits ~30
    wide (shares that underflow), a set of no keys (-inf, -inf, gap 0) that counts for nothing, a
    column with no key at all (gap 0, not NaN), running statistics merged in place, and a strided
    view as the output (a chunk of a longer buffer) whose neighbours stay untouched."""
    from hf_infcl.ops.triton.distillation import merge_soft_target_parts

    generator = torch.Generator().manual_seed(random.randrange(2**31))
    n, per_set, earlier = 21, 5, 4
    z, t = (30 * torch.randn(sets * per_set + earlier, n, dtype=torch.float64, generator=generator)
            for _ in range(2))
    starts = range(0, sets * per_set, per_set)
    parts = torch.stack([_stacked_soft_target_stats(z[r:r + per_set], t[r:r + per_set], 0) for r in starts],
                        dim=1)
    nothing = torch.tensor([float("-inf"), float("-inf"), 0.0], dtype=torch.float64)
    empty_set = sets // 2 if sets > 1 else None  # its keys are left out of the oracle too
    if empty_set is not None:
        parts[:, empty_set] = nothing[:, None]
    parts[:, :, 3] = nothing[:, None]  # column 3 reached no key in any set
    counted = [r for index, r in enumerate(starts) if index != empty_set]
    rows = torch.cat([torch.arange(r, r + per_set) for r in counted])
    buffer = torch.full((3, n + 7), float("nan"))
    out, running = buffer[:, 2 : n + 2], None
    if previous:  # the last keys as an earlier chunk's running statistics
        rows = torch.cat([rows, torch.arange(sets * per_set, sets * per_set + earlier)])
        out.copy_(_stacked_soft_target_stats(z[-earlier:], t[-earlier:], 0))
        out[:, 3] = nothing
        running = out
    expected = _stacked_soft_target_stats(z[rows], t[rows], 0)
    expected[:, 3] = nothing
    result = merge_soft_target_parts(parts.float(), previous=running, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert buffer[:, :2].isnan().all() and buffer[:, n + 2:].isnan().all()
    # fp32 merges of fp32 statistics of size ~100
    torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-4)
    assert result[:, 3].tolist() == [float("-inf"), float("-inf"), 0.0]


def test_soft_target_parts_merge_propagates_nan():
    """A NaN statistic in a set or in the running statistics gives NaN, never a finite number."""
    from hf_infcl.ops.triton.distillation import merge_soft_target_parts

    parts = torch.randn(3, 5, 4)
    parts[0, 2, 1] = float("nan")  # a student log-sum-exp
    parts[1, 3, 2] = float("nan")  # a teacher log-sum-exp: its share, and so the gap, too
    previous = torch.randn(3, 4)
    previous[2, 3] = float("nan")  # a running gap
    result = merge_soft_target_parts(parts, previous=previous.clone())
    assert result[0, 1].isnan() and result[1, 2].isnan() and result[2, 2].isnan() and result[2, 3].isnan()
    assert result[:, 0].isfinite().all()


# Matryoshka in one pass (docs/contract.md, "Matryoshka in one call"; hf_infcl.ops.triton.matryoshka):
# the prefix statistics kernel in both directions (split inner ranges merged) and the prefix route
# over several poisoned super-tiles, against the float64 oracle on the same rounded inputs.

# (m, k, c, dims): prefixes off and on BLOCK_K (16 here; the second shape's are all multiples: the
# unmasked loads), a widest prefix below the width, a prefix of width 2, one row, hard-negative keys.
# (A prefix of width 1 is left to the float64 tests: its normalised value is a sign, whose gradient
# is 0 as a difference of two terms of size |G| / |x_0|, so low precision leaves noise that grows
# without bound as a feature's first entry nears 0.)
MATRYOSHKA_SHAPES = [(33, 45, 40, (40, 27, 16, 3)), (19, 45, 48, (48, 32, 16)), (7, 19, 40, (24, 5)),
                     (1, 17, 32, (32, 31, 2))]
MATRYOSHKA_OPTIONS = {
    "softmax-sym": dict(loss="softmax", symmetric=True),
    "softmax-asym": dict(loss="softmax", symmetric=False),
    "sigmoid-bias": dict(loss="sigmoid", symmetric=False, bias=-2.5),
    "softmax-sym-groups": dict(loss="softmax", symmetric=True, groups=True),
}


class _CountedPrefixKernels:
    """Counts the launches of the one-pass Matryoshka kernels (statistics, gradient super-tiles)."""

    def __init__(self, monkeypatch):
        from hf_infcl.ops.triton import matryoshka

        self.stats = self.tiles = 0
        stats, write = matryoshka.prefix_stats, matryoshka.PrefixRoute.write

        def counted_stats(*args, **kwargs):
            self.stats += 1
            return stats(*args, **kwargs)

        def counted_write(route, *args, **kwargs):
            self.tiles += 1
            return write(route, *args, **kwargs)

        monkeypatch.setattr(matryoshka, "prefix_stats", counted_stats)
        monkeypatch.setattr(matryoshka.PrefixRoute, "write", counted_write)


@pytest.mark.parametrize("mode", ["fp32-ieee", "fp32-tf32", "fp16", "fp32-ieee-two-pass"])
@pytest.mark.parametrize("option", list(MATRYOSHKA_OPTIONS))
@pytest.mark.parametrize("shape", MATRYOSHKA_SHAPES,
                         ids=[f"m{m}-k{k}-c{c}-d{'.'.join(map(str, d))}" for m, k, c, d in MATRYOSHKA_SHAPES])
def test_matryoshka_one_pass_matches_float64_oracle(shape, option, mode, monkeypatch):
    from hf_infcl.ops.triton.matryoshka import MIN_BLOCK_M
    from hf_infcl.ops.triton.operands import round_to_tf32
    from tests.helpers.oracle_matryoshka import matryoshka_loss

    m, k, c, dims = shape
    options = dict(MATRYOSHKA_OPTIONS[option])
    two_pass = mode.endswith("-two-pass")
    mode = mode.removesuffix("-two-pass")
    dtype, precision, blocks = MODES[mode]
    if two_pass:  # the column statistic from a column-major pass of its own
        blocks = TWO_PASS
    blocks = dataclasses.replace(blocks, matryoshka_one_pass=True)
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    # raw features (the loss normalises each prefix), positives pulled towards their rows
    queries = torch.randn(m, c, generator=gen, dtype=torch.float64) * 2.0
    keys = torch.randn(k, c, generator=gen, dtype=torch.float64)
    positives = torch.randperm(k, generator=gen)[:m]
    keys[positives] += 0.4 * queries
    if mode == "fp32-tf32":  # TF32 values, so that the kernels' rounding changes nothing
        queries, keys = (round_to_tf32(x.float()).double() for x in (queries, keys))
    queries, keys = queries.to(dtype), keys.to(dtype)
    weights = tuple(float(w) for w in torch.rand(len(dims), generator=gen) + 0.25)
    groups = {}
    if options.pop("groups", False):
        query_groups = torch.randint(0, max(m // 2, 1), (m,), generator=gen)
        key_groups = torch.randint(0, m, (k,), generator=gen)
        key_groups[positives] = query_groups
        groups = dict(query_groups=query_groups, key_groups=key_groups)
    bias_value = options.pop("bias", None)
    scale_value = float(torch.empty(()).uniform_(3.0, 12.0, generator=gen))
    counted = _CountedPrefixKernels(monkeypatch)

    q, kk = queries.clone().requires_grad_(), keys.clone().requires_grad_()
    scale = torch.tensor(scale_value, requires_grad=True)
    bias = None if bias_value is None else torch.tensor(bias_value, requires_grad=True)
    value = contrastive_loss(q, kk, scale, bias, positives=positives, matryoshka_dims=dims,
                             matryoshka_weights=weights, backend=blocks, precision=precision, **groups,
                             **options)
    value.backward()
    if not (options["symmetric"] and options["loss"] == "softmax"):
        assert counted.stats == 1
    elif two_pass:
        assert counted.stats == 2
    else:  # rows in chunks whose column partials fit the buffer
        chunk_rows = max(1, blocks.column_buffer_entries // k) * MIN_BLOCK_M
        assert counted.stats == -(-m // chunk_rows)
    assert counted.tiles == -(-m // blocks.tile_rows) * -(-k // blocks.tile_keys)

    expected, expected_grads = matryoshka_loss(
        queries.double().numpy(), keys.double().numpy(), scale_value, bias_value, dims=dims, weights=weights,
        positives=positives.numpy(), **{name: value.numpy() for name, value in groups.items()}, **options)
    got = {"loss": value.detach().double().reshape(1), "queries": q.grad.double(), "keys": kk.grad.double(),
           "scale": scale.grad.double().reshape(1)}
    wanted = {"loss": torch.tensor([float(expected)]), "queries": torch.from_numpy(expected_grads["queries"]),
              "keys": torch.from_numpy(expected_grads["keys"]),
              "scale": torch.tensor([float(expected_grads["scale"])])}
    if bias is not None:
        got["bias"] = bias.grad.double().reshape(1)
        wanted["bias"] = torch.tensor([float(expected_grads["bias"])])
    errors = {name: relative_error(got[name], wanted[name]) for name in wanted}
    # One fp16 row (m = 1) averages nothing: its query gradient is one vector, a sum over the keys
    # with cancellation, which the 2-wide prefix's normalisation scales by 1 / |q[:2]|, from G
    # rounded to fp16. 600 draws of the sigmoid case: median 1.0e-3, 99th percentile 8.3e-3,
    # largest 1.8e-2 (300 of each softmax case: up to 1.2e-2). Bugs give 0.1-1.
    tolerance = 3e-2 if mode == "fp16" and m == 1 else TOLERANCE[mode]
    assert max(errors.values()) < tolerance, (seed, errors)


def test_matryoshka_statistics_merge_split_inner_ranges():
    """prefix_stats with the inner range split over programs (each split's partial statistics
    merged) equals it in one range, and both equal float64, for both losses and directions."""
    from hf_infcl.ops.triton.matryoshka import prefix_stats

    gen = torch.Generator().manual_seed(5)
    dims = (20, 9, 4)
    queries, keys = torch.randn(9, 20, generator=gen), torch.randn(53, 20, generator=gen)
    norms = [torch.stack([1 / x[:, :d].norm(dim=1) for d in dims]) for x in (queries, keys)]
    scale, bias = torch.tensor(6.0), torch.tensor(-1.0)
    exact = torch.stack([6.0 * (norms[0][t, :, None] * queries[:, :d].double() @ keys[:, :d].double().T)
                         * norms[1][t, None, :] for t, d in enumerate(dims)])
    for sigmoid, columns in ((False, False), (False, True), (True, False)):
        outer, inner, outer_norms, inner_norms = ((keys, queries, norms[1], norms[0]) if columns
                                                  else (queries, keys, *norms))
        logits = exact.transpose(1, 2) if columns else exact
        if sigmoid:
            logits = logits - 1.0
            expected = torch.nn.functional.softplus(logits).sum(dim=2)
        else:
            expected = torch.logsumexp(logits, dim=2)
        for splits in (1, 4):
            got = prefix_stats(outer, inner, outer_norms, inner_norms, scale, bias if sigmoid else None, dims,
                               sigmoid=sigmoid, columns=columns, precision="ieee", splits=splits)
            assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5), (sigmoid, columns, splits)


def test_matryoshka_one_pass_in_float64_matches_the_oracle(monkeypatch):
    """``matryoshka_one_pass=True`` with float64 features: the prefix blocks (called once) hand them
    to the torch tiles (no tensor-core path), which match the float64 oracle to float64 rounding."""
    from tests.helpers.oracle_matryoshka import matryoshka_loss

    calls = []
    forward_block = TritonBlocks.prefix_forward_block
    monkeypatch.setattr(TritonBlocks, "prefix_forward_block",
                        lambda self, *args: calls.append(1) or forward_block(self, *args))

    gen = torch.Generator().manual_seed(11)
    dims, weights = (24, 13, 5), (1.0, 0.5, 2.0)
    queries = torch.randn(9, 24, generator=gen, dtype=torch.float64)
    keys = torch.randn(14, 24, generator=gen, dtype=torch.float64)
    keys[:9] += 0.4 * queries
    q, k = queries.clone().requires_grad_(), keys.clone().requires_grad_()
    value = contrastive_loss(q, k, 6.0, matryoshka_dims=dims, matryoshka_weights=weights,
                             backend=TritonBlocks(matryoshka_one_pass=True))
    value.backward()
    assert calls == [1]
    expected, grads = matryoshka_loss(queries.numpy(), keys.numpy(), 6.0, dims=dims, weights=weights)
    expected = torch.tensor([float(expected)], dtype=torch.float64)
    assert relative_error(value.detach().reshape(1), expected) < 1e-12
    assert relative_error(q.grad, torch.from_numpy(grads["queries"])) < 1e-10
    assert relative_error(k.grad, torch.from_numpy(grads["keys"])) < 1e-10


def test_matryoshka_one_pass_is_opt_in():
    """``TritonBlocks()`` leaves ``matryoshka_dims`` to one loss call per width (measured faster);
    ``matryoshka_one_pass=True`` takes the one-pass kernels; the flag is checked."""
    from hf_infcl.ops.matryoshka import prefix_block_ops

    assert prefix_block_ops(TritonBlocks()) is None
    one_pass = TritonBlocks(matryoshka_one_pass=True)
    assert prefix_block_ops(one_pass) is one_pass
    with pytest.raises(TypeError, match="matryoshka_one_pass must be True or False"):
        TritonBlocks(matryoshka_one_pass="yes")
