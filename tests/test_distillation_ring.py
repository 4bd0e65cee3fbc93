"""In-batch distillation across processes (gloo on CPU): every rank's value and the gradients of its
queries, keys and the student's scale equal one process on the concatenated batch and the float64
oracle (tests/helpers/oracle_distillation.py), to 1e-10, over uneven ranks (one without rows),
both directions, the KL alone and mixed with InfoNCE, teachers of another width; ranks that
disagree raise the same error everywhere. The cases of fp32 features (one on the Triton block ops,
interpreted) are held to the fp32 tolerance.

Each world size (2 and 3 processes) is spawned once per session; the processes run every case of
``tests/helpers/distillation_ring_workers.py`` and write their results to files, judged below.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
import torch

from hf_infcl import contrastive_distillation_loss
from tests.helpers import distillation_ring_workers as workers
from tests.helpers.oracle_distillation import distillation_loss
from tests.test_ring import _spawn, assert_same_error_everywhere

WORLD_SIZES = (2, 3)
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
# fp32 features against float64 (docs/contract.md's fp32 tolerance)
FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"n{n}")
def ranks(request):
    """The results of every rank of one spawned group, in rank order."""
    out_dir = tempfile.mkdtemp(prefix=f"distillation-ring-n{request.param}-")
    try:
        yield _spawn(request.param, out_dir, worker=workers.worker)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def one_process(case: workers.Case, batch: dict):
    """Per-row losses of the concatenated batch and the gradients of their sum, from one process's
    torch tiles, in the case's dtype."""
    queries = batch["queries"].to(case.dtype).requires_grad_(True)
    keys = batch["keys"].to(case.dtype).requires_grad_(True)
    scale = torch.tensor(workers.SCALE, dtype=case.dtype, requires_grad=True)
    per_row = contrastive_distillation_loss(
        queries, keys, batch["teacher_queries"].to(case.dtype), batch["teacher_keys"].to(case.dtype), scale,
        workers.TEACHER_SCALE,
        symmetric=case.symmetric, positives=batch["positives"], distillation_weight=case.distillation_weight,
        reduction="none", backend=workers.TILES)
    per_row.sum().backward()
    return per_row.detach().double(), {"queries": queries.grad.double(), "keys": keys.grad.double(),
                                       "scale": scale.grad.double()}


def oracle(case: workers.Case, batch: dict):
    """The same from the float64 NumPy oracle, of the features rounded to the case's dtype."""
    batch = {name: value.to(case.dtype).double() if value.is_floating_point() else value
             for name, value in batch.items()}
    per_row, grads = distillation_loss(
        batch["queries"].numpy(), batch["keys"].numpy(), batch["teacher_queries"].numpy(),
        batch["teacher_keys"].numpy(), workers.SCALE, workers.TEACHER_SCALE, symmetric=case.symmetric,
        positives=batch["positives"].numpy(), distillation_weight=case.distillation_weight, reduction="none")
    grads = {name: torch.as_tensor(np.asarray(grad)) for name, grad in grads.items()}
    return torch.from_numpy(np.asarray(per_row)), grads


def assert_ranks_match(ranks: list[dict], name: str, per_row: torch.Tensor, grads: dict, source: str) -> None:
    """Each rank's value is its rows' share of ``per_row`` (reduced as the case says), and its
    gradients are those of the sum of every rank's value: ``grads`` (of the sum of ``per_row``) times
    the reduction's factor, n / M for "mean"."""
    case = workers.CASES[name]
    tolerance = TOLERANCE if case.dtype == torch.float64 else FP32_TOLERANCE
    world_size = len(ranks)
    rows, keys = case.rows[world_size], case.keys[world_size]
    factor = world_size / sum(rows) if case.reduction == "mean" else 1.0
    row_offsets = np.cumsum((0,) + rows)
    key_offsets = np.cumsum((0,) + keys)
    for what, expected in grads.items():  # fresh random inputs: a zero gradient would be vacuous
        assert expected.abs().max() > 1e-4, f"{source}: {what} has a vanishing gradient"
    scale_total = 0.0
    if any(result["cases"][name] is None for result in ranks):
        pytest.skip("Triton cannot be imported here")
    for rank, result in enumerate(ranks):
        mine = result["cases"][name]
        own_rows_at = slice(row_offsets[rank], row_offsets[rank + 1])
        own_keys_at = slice(key_offsets[rank], key_offsets[rank + 1])
        own_rows = per_row[own_rows_at]
        expected_value = own_rows if case.reduction == "none" else factor * own_rows.sum()
        for what, actual, expected in (("value", mine["value"], expected_value),
                                       ("queries", mine["queries"], factor * grads["queries"][own_rows_at]),
                                       ("keys", mine["keys"], factor * grads["keys"][own_keys_at])):
            where = f"{source}, {name}, rank {rank}, {what}"
            torch.testing.assert_close(actual, expected, **tolerance,
                                       msg=lambda text, where=where: f"{where}: {text}")
        scale_total += float(mine["scale"])
    # each rank's scale gradient is its share (from the logits it computed)
    torch.testing.assert_close(scale_total, factor * float(grads["scale"]), **tolerance)


@pytest.mark.parametrize("name", sorted(workers.CASES))
def test_ring_equals_one_process_on_the_concatenated_batch(ranks, name):
    case = workers.CASES[name]
    batch = workers.concatenated(workers.case_inputs(case, len(ranks), seed=list(workers.CASES).index(name)))
    assert_ranks_match(ranks, name, *one_process(case, batch), source="one process")


@pytest.mark.parametrize("name", sorted(workers.CASES))
def test_ring_equals_the_float64_oracle(ranks, name):
    case = workers.CASES[name]
    batch = workers.concatenated(workers.case_inputs(case, len(ranks), seed=list(workers.CASES).index(name)))
    assert_ranks_match(ranks, name, *oracle(case, batch), source="oracle")


SAME_ERROR_EVERYWHERE = {
    "width": "feature width c",
    "teacher_width": "width of teacher_queries/teacher_keys",
    "dtype": "dtype of the features",
    "distillation_weight": "disagree on distillation_weight",
    "symmetric": "symmetric",
    "reduction": "disagree on reduction",
    "contrastive_loss_on_one_rank": "width of teacher_queries/teacher_keys",
    "no_rows_anywhere": "no rank of the process group has any rows",
}


@pytest.mark.parametrize("case", sorted(SAME_ERROR_EVERYWHERE))
def test_disagreeing_ranks_raise_the_same_error_on_every_rank(ranks, case):
    assert_same_error_everywhere(ranks, case, SAME_ERROR_EVERYWHERE[case])


def test_one_rank_rejecting_its_teacher_stops_every_rank(ranks):
    raised = [result["raised"]["bad_teacher_on_one_rank"] for result in ranks]
    assert raised[1][0] == "ValueError" and "teacher_queries has 4 rows" in raised[1][1]
    for rank, error in enumerate(raised):
        if rank != 1:
            assert error[0] == "ValueError" and "rank(s) [1]" in error[1], error


def test_group_still_usable_after_the_errors(ranks):
    parts = [workers.after_errors_inputs(rank) for rank in range(len(ranks))]
    queries, keys, teacher_queries, teacher_keys = (torch.cat(tensors) for tensors in zip(*parts))
    key_offsets = np.cumsum([0] + [part[1].shape[0] for part in parts])
    positives = torch.cat([torch.arange(part[0].shape[0]) + int(offset)
                           for part, offset in zip(parts, key_offsets)])
    expected = contrastive_distillation_loss(queries, keys, teacher_queries, teacher_keys, 2.0, 3.0,
                                             positives=positives, distillation_weight=0.5, reduction="sum",
                                             backend="reference")
    for result in ranks:
        torch.testing.assert_close(result["after_errors"], expected, **TOLERANCE)
