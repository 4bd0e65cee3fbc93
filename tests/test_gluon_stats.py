"""The Gluon kernel of the symmetric softmax loss's forward statistics (``hf_infcl.ops.triton.gluon_stats``).

GPU (Hopper): the kernel's row and column log-sum-exps against float64 on the same rounded operands,
over whole and partial tiles, one and several splits of the keys, logits hundreds apart within a
warp's rows, with the output buffers poisoned with NaN (every entry written); the loss's default
route on such a GPU goes through the kernel and matches float64 in the loss and every gradient, and
the statistics kernel of ``.stats`` (``softmax_statistics="triton"``) to rounding; so does the score
filter on the model's own scores through the kernel (its bounds instead of maxima, positives in and
out of order, hard negatives, both strategies); asking for the kernel where it cannot run (a group
mask, a negative margin) is a clear error. Gluon kernels do not run under ``TRITON_INTERPRET``: on
CPU (CI) these skip, and ``tests/helpers/triton_interpreted.py`` checks the refusal and the route's
host side there.
"""

from __future__ import annotations

import pytest
import torch

from hf_infcl import contrastive_loss
from hf_infcl.ops.triton import TritonBlocks, gluon_stats, stats
from tests.helpers.gluon import hopper_only, loss_and_grads, paired_rows, spiked_rows, unit_rows

# (rows, keys, c, dtype, splits): whole and partial 128 x 128 tiles, widths that are and are not
# multiples of the kernel's 64-wide chunks, one split and several (the last one partly past the keys).
STATS_CASES = [
    (1024, 2048, 768, torch.bfloat16, 2),
    (1000, 3000, 200, torch.bfloat16, 3),
    (777, 2331, 72, torch.float16, 1),
    (4096, 8192, 512, torch.float16, 4),
    (130, 129, 1024, torch.bfloat16, 2),
    (1, 5, 8, torch.bfloat16, 1),
]


def _case_id(case):
    m, k, c, dtype, splits = case
    return f"m{m}-k{k}-c{c}-{str(dtype)[6:]}-s{splits}"


def test_row_and_column_stats_refuse_buffers_the_kernel_would_misaddress():
    """The kernel writes split s's rows at s * rows and partial p at p * keys: a view with longer
    rows (a wider buffer's first columns) is refused, naming it, before anything runs; so is a
    score filter's vector of another length."""
    queries, keys = torch.zeros(100, 8), torch.zeros(300, 8)
    scale = torch.tensor(1.0)
    partials = torch.empty(4, 300)
    with pytest.raises(ValueError, match="row_out must hold contiguous rows of 100 entries"):
        gluon_stats.row_and_column_stats(queries, keys, scale, torch.empty(2, 128)[:, :100], partials, 2)
    with pytest.raises(ValueError, match="column_partials must hold contiguous rows of 300 entries"):
        narrow_partials = torch.empty(4, 320)[:, :300]
        gluon_stats.row_and_column_stats(queries, keys, scale, torch.empty(2, 100), narrow_partials, 2)
    bounds = gluon_stats.OwnScoreFilter(row_bounds=torch.zeros(100), positives=torch.zeros(100).int(),
                                        key_bounds=torch.zeros(299), margin=0.1, relative_margin=0.0,
                                        ranges=(torch.zeros(1).int(), torch.zeros(1).int()))
    with pytest.raises(ValueError, match="score_filter.key_bounds must be a contiguous vector of 300"):
        gluon_stats.row_and_column_stats(queries, keys, scale, torch.empty(2, 100), partials, 2, bounds)
    wrong_ranges = bounds._replace(key_bounds=torch.zeros(300),
                                   ranges=(torch.zeros(2).int(), torch.zeros(1).int()))
    with pytest.raises(ValueError, match=r"score_filter.ranges\[0\] must be a contiguous vector of 1 "):
        gluon_stats.row_and_column_stats(queries, keys, scale, torch.empty(2, 100), partials, 2, wrong_ranges)


def _stats_errors(seed, queries, keys, scale, splits):
    """The kernel's row and column log-sum-exps (every output entry written: the buffers start as
    NaN) against float64 on the same rounded operands: the largest absolute errors."""
    m, k = queries.shape[0], keys.shape[0]
    row_out = torch.full((splits, m), float("nan"), device="cuda")
    partials = torch.full((gluon_stats.PARTIALS_PER_BLOCK * -(-m // gluon_stats.BLOCK_M), k), float("nan"),
                          device="cuda")
    used = gluon_stats.row_and_column_stats(queries, keys, scale, row_out, partials, splits)
    assert 1 <= used <= splits
    assert torch.isfinite(row_out[:used]).all() and not torch.isnan(partials).any(), (seed, "unwritten")
    rows = stats.merge_partials(row_out[:used], log_sum_exp=True)
    columns = stats.merge_partials(partials, log_sum_exp=True)
    z = scale.double() * (queries.double() @ keys.double().T)
    return [float((got.double() - expected).abs().max())
            for got, expected in ((rows, torch.logsumexp(z, 1)), (columns, torch.logsumexp(z, 0)))]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("case", STATS_CASES, ids=[_case_id(c) for c in STATS_CASES])
def test_gpu_row_and_column_stats_match_float64(case):
    m, k, c, dtype, splits = case
    seed, gen, queries, keys = unit_rows(m, k, c, dtype)
    keys[: min(m, k)] += 0.3 * queries[: min(m, k)]  # positives above the rest, as a loss sees them
    scale = 10.0 + 90.0 * torch.rand((), device="cuda", generator=gen)  # CLIP's range, logits to +-100
    # fp32 statistics of fp32 dot products: log-sum-exps to a few ulps of |z| <= 100
    assert max(_stats_errors(seed, queries, keys, scale, splits)) < 1e-4, seed


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("m, k, c, splits", [(128, 256, 64, 1), (1000, 3000, 200, 3)],
                         ids=["m128-k256-c64-s1", "m1000-k3000-c200-s3"])
def test_gpu_logits_far_apart_within_a_warps_rows_match_float64(m, k, c, splits):
    """Every 16th row's logit with its own key at 4 x the scale (400): the other keys' logits in
    that warp's rows lie hundreds below it. Each column partial is shifted by the column's own
    maximum, so none of them underflows: against float64, with so few row blocks that one lost
    partial would move a column's log-sum-exp far past the bound."""
    seed, _, queries, keys = spiked_rows(m, k, c, torch.bfloat16)
    # logits up to 400: fp32 log-sum-exps to a few ulps of that
    assert max(_stats_errors(seed, queries, keys, torch.tensor(100.0, device="cuda"), splits)) < 4e-4, seed


@pytest.mark.gpu
@hopper_only
def test_gpu_a_launch_past_the_jit_function_equals_a_launch_through_it(monkeypatch):
    """``launch_jit``: the first launch of a specialisation goes through the JIT function and keeps
    its compiled kernel; the next one, with new tensors and descriptors of the same shapes, goes
    through that kernel's launcher and writes the same statistics, bit for bit; another shape is
    another specialisation, through the JIT function again."""
    from hf_infcl.ops.triton import launch

    monkeypatch.setattr(launch, "_COMPILED", {})
    compiled_launches = []
    launch_compiled = launch._launch_compiled
    monkeypatch.setattr(launch, "_launch_compiled",
                        lambda *arguments: (compiled_launches.append(1), launch_compiled(*arguments)))
    seed, gen, queries, keys = unit_rows(1024, 2048, 512, torch.bfloat16)
    scale = torch.tensor(20.0, device="cuda")

    def statistics(queries, keys):
        row_out = torch.full((2, queries.shape[0]), float("nan"), device="cuda")
        partials = torch.full((gluon_stats.PARTIALS_PER_BLOCK * -(-queries.shape[0] // gluon_stats.BLOCK_M),
                               keys.shape[0]), float("nan"), device="cuda")
        used = gluon_stats.row_and_column_stats(queries, keys, scale, row_out, partials, 2)
        return row_out[:used], partials

    through_jit = statistics(queries, keys)
    assert len(launch._COMPILED) == 1 and not compiled_launches
    past_jit = statistics(queries.clone(), keys.clone())
    assert compiled_launches == [1]
    for got, expected in zip(past_jit, through_jit):
        assert torch.equal(got, expected), seed
    statistics(queries[:512], keys)
    assert len(launch._COMPILED) == 2 and compiled_launches == [1]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_default_symmetric_softmax_statistics_are_the_gluon_kernel(monkeypatch, dtype):
    """What a user's CLIP loss runs on a Hopper GPU: the forward's statistics from the Gluon kernel
    (counted; rows in several chunks), the loss and every gradient matching float64 and the
    statistics kernel of .stats. fp32 inputs (TF32 precision) take it too, as fp16 copies."""
    calls = []
    kernel = gluon_stats.stats_launch
    monkeypatch.setattr(gluon_stats, "stats_launch", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    m, k, c = 32768, 32768, 384  # "auto" takes the kernel from 32k x 32k at c = 384 on
    seed, queries, keys = paired_rows(m, k, c)

    def loss_and_grads_of(q, kk, backend, precision):
        return loss_and_grads(q, kk, backend, precision, 1 / 0.07)

    # the default buffer holds the column partials of 16k rows: two chunks
    blocks = TritonBlocks(poison=True)
    got = loss_and_grads_of(queries.to(dtype), keys.to(dtype), blocks, "auto")
    assert len(calls) == 2, "the forward's statistics did not come from the Gluon kernel"
    triton_route = loss_and_grads_of(queries.to(dtype), keys.to(dtype),
                                     TritonBlocks(poison=True, softmax_statistics="triton"), "auto")
    rounded = (queries.to(dtype).double(), keys.to(dtype).double())
    from hf_infcl.ops.tiled import TorchTiles

    expected = loss_and_grads_of(*rounded, TorchTiles(4096, 4096), "ieee")
    for name, a, b, t in zip(("loss", "dq", "dk", "dscale"), got, expected, triton_route):
        error = float((a - b).norm() / b.norm())
        assert error < (3e-3 if dtype == torch.float32 else 1e-2), (seed, name, error)
        assert float((a - t).norm() / t.norm()) < 1e-3, (seed, name, "against the .stats route")


@pytest.mark.gpu
@hopper_only
def test_gpu_gluon_statistics_refuse_a_group_mask():
    """softmax_statistics='gluon' names what it needs where it cannot run (a group mask here; the
    interpreted tests check a machine without a GPU); "auto" takes .stats there."""
    q = torch.nn.functional.normalize(torch.randn(128, 16, device="cuda"), dim=1).bfloat16().requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(128, 16, device="cuda"), dim=1).bfloat16()
    groups = torch.arange(128, device="cuda") // 2
    scale = torch.tensor(10.0, device="cuda")
    with pytest.raises(ValueError, match="softmax_statistics='gluon' needs"):
        contrastive_loss(q, k, scale, backend=TritonBlocks(softmax_statistics="gluon"), query_groups=groups,
                         key_groups=groups)
    loss = contrastive_loss(q, k, scale, backend=TritonBlocks(), query_groups=groups, key_groups=groups)
    assert torch.isfinite(loss)


# (rows, keys, c, margin, strategy, custom positives): whole and partial tiles, hard-negative keys,
# positives in and out of order, both strategies, margins 0 (GIST's default) and above.
FILTER_CASES = [
    (1024, 2048, 768, 0.1, "absolute", False),
    (1024, 1024, 512, 0.0, "absolute", False),
    (1000, 1500, 200, 0.05, "relative", True),
    (2048, 2048, 384, 0.02, "absolute", True),
    (1024, 2048, 512, -0.1, "absolute", False),  # Qwen3-Embedding's rule
]


def _filter_case_id(case):
    m, k, c, margin, strategy, custom = case
    return f"m{m}-k{k}-c{c}-{strategy}{margin}" + ("-permuted" if custom else "")


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", FILTER_CASES, ids=[_filter_case_id(c) for c in FILTER_CASES])
def test_gpu_own_score_filter_statistics_from_the_gluon_kernel_match_float64(monkeypatch, case, dtype):
    """The score filter without a guide through the Gluon kernel (counted): its bounds instead of
    running maxima, its positive test in the tiles that may hold a positive, keys that are nobody's
    positive; the loss and every gradient against float64 and against the masked statistics kernel
    of .stats. A tenth of the keys are near-copies of other rows' positives, so the filter leaves
    entries out in every row block."""
    m, k, c, margin, strategy, custom = case
    calls = []
    kernel = gluon_stats.stats_launch
    monkeypatch.setattr(gluon_stats, "stats_launch",
                        lambda *a, **kw: calls.append(a[-1] is not None) or kernel(*a, **kw))
    seed, queries, keys = paired_rows(m, k, c)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    options = dict(false_negative_margin=margin, false_negative_strategy=strategy)
    positives = torch.arange(m, device="cuda")
    if custom:
        positives = options["positives"] = torch.randperm(k, device="cuda", generator=generator)[:m]
        keys[positives] += 0.5 * queries
    copies = torch.randperm(k, device="cuda", generator=generator)[: k // 10]
    owners = torch.randint(0, m, (k // 10,), device="cuda", generator=generator)
    originals = positives[owners]
    noise = torch.randn(k // 10, c, device="cuda", generator=generator)
    keys[copies] = keys[originals] + 0.02 * noise / c**0.5
    # A copy scoring within rounding of its owner's threshold is left out or kept by the order of
    # accumulation (fp32 in every route, float64 in the reference): moved 4e-3 off the tie.
    rounded_queries, rounded_keys = queries.to(dtype).double(), keys.to(dtype).double()
    positive_scores = (rounded_queries[owners] * rounded_keys[originals]).sum(1)
    thresholds = positive_scores - (margin if strategy == "absolute" else positive_scores.abs() * margin)
    gaps = (rounded_queries[owners] * rounded_keys[copies]).sum(1) - thresholds
    near = gaps.abs() < 1e-3
    keys[copies[near]] += 4e-3 * torch.where(gaps[near] >= 0, 1.0, -1.0)[:, None] * queries[owners[near]]

    got = loss_and_grads(queries.to(dtype), keys.to(dtype),
                         TritonBlocks(poison=True, softmax_statistics="gluon"), "auto", 1 / 0.07, **options)
    assert calls and all(calls), "the filtered statistics did not come from the Gluon kernel"
    triton_route = loss_and_grads(queries.to(dtype), keys.to(dtype),
                                  TritonBlocks(poison=True, softmax_statistics="triton"), "auto", 1 / 0.07,
                                  **options)
    from hf_infcl.ops.tiled import TorchTiles

    rounded = (queries.to(dtype).double(), keys.to(dtype).double())
    expected = loss_and_grads(*rounded, TorchTiles(1024, 1024), "ieee", 1 / 0.07, **options)
    for name, a, b, t in zip(("loss", "dq", "dk", "dscale"), got, expected, triton_route):
        assert float((a - b).norm() / b.norm()) < 1e-2, (seed, name, "against float64")
        assert float((a - t).norm() / t.norm()) < 1e-3, (seed, name, "against the .stats route")


@pytest.mark.gpu
@hopper_only
def test_gpu_a_negative_margin_at_a_large_scale_stays_finite():
    """With a negative margin the kernel's bounds sit halfway between each positive and its
    threshold: at scale 300, keys 0.4 above their rows' positives (kept: the threshold is 0.5 above)
    give terms of e^45 there, where a positive's bound would give e^120, past fp32. The loss and
    every gradient against float64 and the masked statistics kernel of .stats."""
    seed, queries, keys = paired_rows(1024, 1024, 512)
    keys[512:576] = 0.9 * queries[:64]  # rows 0-63 score them about 0.4 above their positives
    operands = (queries.bfloat16(), keys.bfloat16())

    def loss_and_grads_of(q, kk, backend, precision):
        return loss_and_grads(q, kk, backend, precision, 300.0, false_negative_margin=-0.5)

    got = loss_and_grads_of(*operands, TritonBlocks(poison=True, softmax_statistics="gluon"), "auto")
    masked = loss_and_grads_of(*operands, TritonBlocks(poison=True, softmax_statistics="triton"), "auto")
    from hf_infcl.ops.tiled import TorchTiles

    expected = loss_and_grads_of(*(x.double() for x in operands), TorchTiles(1024, 1024), "ieee")
    for name, a, b, t in zip(("loss", "dq", "dk", "dscale"), got, expected, masked):
        assert torch.isfinite(a).all(), (seed, name)
        assert float((a - b).norm() / b.norm()) < 1e-2, (seed, name, "against float64")
        # (at scale 300 a dot product's rounding moves a logit 300 times as far)
        assert float((a - t).norm() / t.norm()) < 5e-3, (seed, name, "against the .stats route")


@pytest.mark.gpu
@hopper_only
def test_gpu_gluon_statistics_refuse_a_margin_whose_bounds_may_not_hold():
    """A negative "relative" margin (its thresholds' distance to the positives unbounded) or an
    "absolute" one below -0.5: softmax_statistics='gluon' refuses, naming the score filter; "auto"
    takes .stats there."""
    q = torch.nn.functional.normalize(torch.randn(128, 64, device="cuda"), dim=1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(128, 64, device="cuda"), dim=1).bfloat16()
    scale = torch.tensor(10.0, device="cuda")
    for options in (dict(false_negative_margin=-0.1, false_negative_strategy="relative"),
                    dict(false_negative_margin=-0.6)):
        with pytest.raises(ValueError, match="without a guide or groups, of margin >= -0.5"):
            contrastive_loss(q, k, scale, backend=TritonBlocks(softmax_statistics="gluon"), **options)
        loss = contrastive_loss(q, k, scale, backend=TritonBlocks(), **options)
        assert torch.isfinite(loss)
