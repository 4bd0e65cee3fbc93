"""The Gluon kernels of in-batch distillation (``hf_infcl.ops.triton.gluon_distillation``): the symmetric
forward's statistics in one pass, and the backward's G of a super-tile.

CPU: a buffer too small for the column partials is refused, naming it (their merge, a Triton
kernel, is checked against float64 in ``tests/helpers/triton_interpreted.py``);
so is an unknown ``distillation_kernels``, which stays out of the block ops' repr (the name of
the shipped compile plans).

GPU (Hopper): both directions' statistics (the student's and the teacher's log-sum-exps and the
gap) against float64 on the same rounded operands, over whole and partial tiles, a teacher of
another width, one split of the keys and several, rows in one call and in two whose key
statistics merge, logits hundreds apart within a warp's rows (student or teacher), the partials
and the outputs poisoned with NaN; a
super-tile's G and row sums from the backward's kernel against the Triton route's, with and
without the columns' terms and a G factor, the G buffer poisoned with NaN; the
distillation loss through the kernel (counted; rows in several chunks) against float64 in the loss
and every gradient, and against the two passes of ``distillation_kernels="triton"``; asking for
the kernel where it cannot run (fp32 embeddings) is a clear error,
and ``"auto"`` takes the two passes there. Gluon
kernels do not run under ``TRITON_INTERPRET``: on CPU (CI) the GPU tests skip.
"""

from __future__ import annotations

import pytest
import torch

from hf_infcl.ops.distillation import SoftTargetStats
from hf_infcl.ops.triton import TritonBlocks, gluon_distillation
from tests.helpers.gluon import hopper_only, spiked_rows, unit_rows
from tests.helpers.oracle_distillation import soft_target_stats_direct


def test_a_column_partials_buffer_too_small_is_refused_naming_it():
    queries, keys = torch.zeros(200, 16, dtype=torch.bfloat16), torch.zeros(300, 16, dtype=torch.bfloat16)
    scale = torch.tensor(1.0)
    needed = 3 * gluon_distillation.PARTIALS_PER_BLOCK * 2 * 300
    with pytest.raises(ValueError, match=f"column_partials must be a contiguous buffer of at least {needed}"):
        gluon_distillation.soft_target_stats_both(queries, keys, queries, keys, scale, scale,
                                                  torch.empty(needed - 1), torch.empty(3, 200),
                                                  torch.empty(3, 300), accumulate_columns=False)


@pytest.mark.parametrize("row_blocks, key_tiles",
                         [(37, 512), (42, 512), (10, 2048), (9, 2048), (128, 256), (1, 512)])
def test_the_automatic_splits_keep_the_busiest_consumer_near_an_even_share(monkeypatch, row_blocks,
                                                                           key_tiles):
    """On 132 SMs (an H100 or H200: 264 consumers), for the row chunks the loss launches at 32k
    and 128k keys and a few others: the automatic split divides the key tiles, and the consumer
    with the most items has at most 15 % more tiles than an even share of all of them (the
    launch's length). Given splits are kept, down to the number of key tiles."""
    monkeypatch.setattr(gluon_distillation, "sm_count", lambda device: 132)
    n_rows, n_keys = row_blocks * gluon_distillation.BLOCK_M, key_tiles * gluon_distillation.BLOCK_N
    splits = gluon_distillation.splits_for(n_rows, n_keys, torch.device("cpu"))
    assert key_tiles % splits == 0
    busiest = -(-row_blocks * splits // 264) * (key_tiles // splits)
    assert busiest <= 1.15 * row_blocks * key_tiles / 264, (splits, busiest)
    assert gluon_distillation.splits_for(n_rows, n_keys, torch.device("cpu"), splits=3) == 3
    assert gluon_distillation.splits_for(n_rows, n_keys, torch.device("cpu"), splits=10**6) == key_tiles


def test_an_unknown_distillation_kernels_is_refused_naming_it_and_the_option_is_out_of_the_repr():
    with pytest.raises(ValueError, match="distillation_kernels must be one of"):
        TritonBlocks(distillation_kernels="cublas")
    assert repr(TritonBlocks(distillation_kernels="triton")) == repr(TritonBlocks())
    assert TritonBlocks(distillation_kernels="triton") != TritonBlocks()


# (rows, keys, c, teacher c, dtype, splits): whole and partial 128 x 64 tiles, widths that are and
# are not multiples of the kernel's 64-wide chunks, a teacher narrower and wider than the student,
# one split and several (the last one partly past the keys).
STATS_CASES = [
    (1024, 2048, 512, 768, torch.bfloat16, 2),
    (1000, 3000, 200, 72, torch.bfloat16, 3),
    (777, 2331, 72, 128, torch.float16, 1),
    (4096, 8192, 384, 384, torch.float16, 4),
    (130, 129, 1024, 64, torch.bfloat16, 2),
    (1, 5, 8, 16, torch.bfloat16, 1),
]


def _case_id(case):
    m, k, c, teacher_c, dtype, splits = case
    return f"m{m}-k{k}-c{c}-t{teacher_c}-{str(dtype)[6:]}-s{splits}"


def _errors_against_float64(rows, columns, z, t):
    """{(direction, statistic): largest absolute error} of the kernel's statistics (``rows`` [3, m],
    ``columns`` [3, k]) against float64 from the student's logits ``z`` and the teacher's ``t``."""
    return {(direction, name): float((a.double() - b).abs().max())
            for direction, got, dim in (("rows", rows, 1), ("columns", columns, 0))
            for name, a, b in zip(SoftTargetStats._fields, got, soft_target_stats_direct(z, t, dim))}


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("case", STATS_CASES, ids=[_case_id(c) for c in STATS_CASES])
def test_gpu_both_directions_statistics_match_float64(case):
    m, k, c, teacher_c, dtype, splits = case
    seed, generator, queries, keys = unit_rows(m, k, c, dtype)
    _, _, teacher_queries, teacher_keys = unit_rows(m, k, teacher_c, dtype)
    keys[: min(m, k)] += 0.3 * queries[: min(m, k)]  # positives above the rest, as a loss sees them
    teacher_keys[: min(m, k)] += 0.3 * teacher_queries[: min(m, k)]
    scale = 10.0 + 90.0 * torch.rand((), device="cuda", generator=generator)
    teacher_scale = 10.0 + 40.0 * torch.rand((), device="cuda", generator=generator)
    row_blocks = -(-m // gluon_distillation.BLOCK_M)
    partials = torch.full((3 * gluon_distillation.PARTIALS_PER_BLOCK * row_blocks * k,), float("nan"),
                          device="cuda")
    z = scale.double() * (queries.double() @ keys.double().T)
    t = teacher_scale.double() * (teacher_queries.double() @ teacher_keys.double().T)
    # all rows in one call, then (where there are two row blocks) in two whose key statistics the
    # second merges into the first's
    middle = min(m, -(-row_blocks // 2) * gluon_distillation.BLOCK_M)
    for chunks in ([(0, m)], [(0, middle), (middle, m)]) if middle < m else ([(0, m)],):
        rows, columns = (torch.full((3, n), float("nan"), device="cuda") for n in (m, k))
        for r0, r1 in chunks:
            partials.fill_(float("nan"))
            gluon_distillation.soft_target_stats_both(
                queries[r0:r1], keys, teacher_queries[r0:r1], teacher_keys, scale, teacher_scale, partials,
                rows[:, r0:r1], columns, accumulate_columns=r0 > 0, splits=splits)
            used = 3 * gluon_distillation.PARTIALS_PER_BLOCK * -(-(r1 - r0) // gluon_distillation.BLOCK_M) * k
            assert not torch.isnan(partials[:used]).any(), (seed, "a column partial left unwritten")
        # fp32 statistics of fp32 dot products, logits up to +-100
        errors = _errors_against_float64(rows, columns, z, t)
        assert max(errors.values()) < 1e-4, (seed, len(chunks), errors)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("spiked", ["student", "teacher"])
def test_gpu_logits_far_apart_within_a_warps_rows_match_float64(spiked):
    """Every 16th row's logit with its own key at 4 x the scale, in the student or in the teacher:
    the other keys' logits in that warp's rows lie hundreds below it. Each column partial is
    shifted by the column's own maxima, so none underflows: against float64, with two row blocks,
    where a lost partial would move a column's statistics far past the bound."""
    m, k, c, teacher_c = 256, 512, 64, 128
    student_spiked = spiked == "student"
    seed, _, *spiky = spiked_rows(m, k, c if student_spiked else teacher_c, torch.bfloat16)
    _, _, *plain = unit_rows(m, k, teacher_c if student_spiked else c, torch.bfloat16)
    (queries, keys), (teacher_queries, teacher_keys) = (spiky, plain) if student_spiked else (plain, spiky)
    scale, teacher_scale = (torch.tensor(value, device="cuda") for value in (100.0, 50.0))
    partials = torch.full((3 * gluon_distillation.PARTIALS_PER_BLOCK * 2 * k,), float("nan"), device="cuda")
    rows, columns = (torch.full((3, n), float("nan"), device="cuda") for n in (m, k))
    gluon_distillation.soft_target_stats_both(queries, keys, teacher_queries, teacher_keys, scale,
                                              teacher_scale, partials, rows, columns,
                                              accumulate_columns=False, splits=2)
    z = scale.double() * (queries.double() @ keys.double().T)
    t = teacher_scale.double() * (teacher_queries.double() @ teacher_keys.double().T)
    # logits up to 400: fp32 statistics to a few ulps of that
    errors = _errors_against_float64(rows, columns, z, t)
    assert max(errors.values()) < 4e-4, (seed, spiked, errors)


# (rows, keys, c, teacher c, columns, G factor): whole and partial 128 x 64 tiles, a teacher of
# another width, the columns' terms or not, G stored divided by a factor (fp16) or not.
ROUTE_CASES = [
    (1024, 2048, 512, 768, True, False),
    (1000, 1500, 200, 72, True, True),
    (384, 640, 128, 128, False, False),
    (130, 129, 64, 64, False, True),
]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("case", ROUTE_CASES, ids=[
    f"m{c[0]}-k{c[1]}-c{c[2]}-t{c[3]}-cols{int(c[4])}-scaled{int(c[5])}" for c in ROUTE_CASES])
def test_gpu_a_super_tile_of_the_backward_matches_the_triton_route(case):
    """One super-tile's G (into a NaN-poisoned buffer whose row stride is padded, as the walk's) and row
    sums from the Gluon route, against the Triton route's on the same operands and statistics."""
    from hf_infcl.ops.distillation import SoftTargetGradients, TeacherLogits
    from hf_infcl.ops.triton import distillation

    m, k, c, teacher_c, columns, scaled = case
    dtype = torch.float16 if scaled else torch.bfloat16
    seed, generator, queries, keys = unit_rows(m, k, c, dtype)
    _, _, teacher_queries, teacher_keys = unit_rows(m, k, teacher_c, dtype)
    scale = torch.tensor(30.0, device="cuda")
    teacher = TeacherLogits(teacher_queries, teacher_keys, torch.tensor(20.0, device="cuda"))

    def statistics(n, lse_scale):
        lse = lse_scale * (1 + torch.rand(n, device="cuda", generator=generator))
        weights = torch.rand(n, device="cuda", generator=generator) / n
        return SoftTargetGradients(lse, lse + torch.randn(n, device="cuda", generator=generator), weights,
                                   weights * torch.rand(n, device="cuda", generator=generator))

    rows = statistics(m, 30.0)
    cols = statistics(k, 30.0) if columns else None
    inv_g_scale = torch.tensor(1 / 3e-4, device="cuda") if scaled else None
    results = []
    for route_class in (gluon_distillation.GluonSoftTargetRoute, distillation.SoftTargetRoute):
        row_sums = torch.zeros(m, device="cuda")
        extra = () if route_class is gluon_distillation.GluonSoftTargetRoute else ("auto",)
        route = route_class(queries, keys, scale, teacher, rows, cols, row_sums, inv_g_scale, *extra)
        buffer = torch.full((m, -(-k // 8) * 8 + 8), float("nan"), dtype=dtype, device="cuda")
        g = buffer[:, :k]
        route.write(route.row_panel(0, m), route.key_tile(0, k), g)
        torch.cuda.synchronize()
        assert not torch.isnan(g).any(), (seed, route_class.__name__, "G left unwritten")
        results.append((g.float(), row_sums))
    (g, sums), (expected_g, expected_sums) = results
    assert float((g - expected_g).abs().max()) <= 2e-2 * float(expected_g.abs().max()), seed
    torch.testing.assert_close(sums, expected_sums, rtol=1e-3, atol=1e-5 * float(expected_sums.abs().max()))


def _distillation_loss_and_grads(queries, keys, teacher_queries, teacher_keys, backend):
    from hf_infcl import contrastive_distillation_loss

    queries, keys = queries.clone().requires_grad_(True), keys.clone().requires_grad_(True)
    dtype = torch.float64 if queries.dtype == torch.float64 else torch.float32
    scale = torch.tensor(1 / 0.07, dtype=dtype, device="cuda", requires_grad=True)
    loss = contrastive_distillation_loss(queries, keys, teacher_queries, teacher_keys, logit_scale=scale,
                                         teacher_logit_scale=20.0, distillation_weight=0.5, backend=backend,
                                         precision="ieee" if dtype == torch.float64 else "auto")
    grads = torch.autograd.grad(loss, (queries, keys, scale))
    return [loss.detach().double()] + [grad.double() for grad in grads]


@pytest.mark.gpu
@hopper_only
def test_gpu_symmetric_distillation_takes_the_gluon_kernel_and_matches_float64(monkeypatch):
    """What a user's symmetric distillation runs on a Hopper GPU with bf16 embeddings: the forward's
    statistics from the Gluon kernel (counted; a small column buffer makes two row chunks) and the
    backward's G from the other (one super-tile), the loss and every gradient against float64 and
    against the Triton kernels (``distillation_kernels="triton"``)."""
    from hf_infcl.ops.tiled import TorchTiles

    calls, writes = [], []
    kernel = gluon_distillation.soft_target_stats_both
    monkeypatch.setattr(gluon_distillation, "soft_target_stats_both",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    write = gluon_distillation.GluonSoftTargetRoute.write
    monkeypatch.setattr(gluon_distillation.GluonSoftTargetRoute, "write",
                        lambda self, *a: writes.append(1) or write(self, *a))
    m, k, c, teacher_c = 2048, 4096, 256, 384
    seed, _, queries, keys = unit_rows(m, k, c, torch.bfloat16)
    _, _, teacher_queries, teacher_keys = unit_rows(m, k, teacher_c, torch.bfloat16)
    keys[:m] += 0.5 * queries
    teacher_keys[:m] += 0.5 * teacher_queries
    operands = (queries, keys, teacher_queries, teacher_keys)
    chunked = TritonBlocks(column_buffer_entries=3 * 4 * 8 * k)  # 1024 rows a chunk
    got = _distillation_loss_and_grads(*operands, chunked)
    assert len(calls) == 2, "the forward's statistics did not come from the Gluon kernel"
    assert writes, "the backward's G did not come from the Gluon kernel"
    two_passes = _distillation_loss_and_grads(*operands, TritonBlocks(distillation_kernels="triton"))
    assert len(calls) == 2 and len(writes) == 1
    expected = _distillation_loss_and_grads(*(x.double() for x in operands), TorchTiles(1024, 1024))
    for name, a, b, t in zip(("loss", "dq", "dk", "dscale"), got, expected, two_passes):
        error = float((a - b).norm() / b.norm())
        assert error < 1e-2, (seed, name, error)
        assert float((a - t).norm() / t.norm()) < 1e-3, (seed, name, "against the two passes")


@pytest.mark.gpu
@hopper_only
def test_gpu_gluon_distillation_refuses_fp32_embeddings(monkeypatch):
    """distillation_kernels='gluon' names what it needs where it cannot run (fp32 student and
    teacher embeddings, which the kernel does not multiply); "auto" takes the two passes there, and
    the loss is finite."""
    from hf_infcl import contrastive_distillation_loss

    calls = []
    kernel = gluon_distillation.soft_target_stats_both
    monkeypatch.setattr(gluon_distillation, "soft_target_stats_both",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    _, _, queries, keys = unit_rows(128, 128, 64, torch.float32)
    _, _, teacher_queries, teacher_keys = unit_rows(128, 128, 64, torch.float32)
    scale = torch.tensor(10.0, device="cuda")
    with pytest.raises(ValueError, match="distillation_kernels='gluon' needs"):
        contrastive_distillation_loss(queries, keys, teacher_queries, teacher_keys, scale,
                                      backend=TritonBlocks(distillation_kernels="gluon"))
    loss = contrastive_distillation_loss(queries, keys, teacher_queries, teacher_keys, scale,
                                         backend=TritonBlocks())
    assert torch.isfinite(loss) and not calls
