"""Processes of the distillation ring tests (``tests/test_distillation_ring.py``), spawned 2 or 3 at a
time on CPU over gloo.

Each rank computes ``contrastive_distillation_loss`` over the process group on its own uneven slice
of a global float64 batch (a rank may hold no rows), backpropagates, and writes its value and the
gradients of its queries, keys and the student's scale to a file, which the test process compares
with one process on the concatenated batch and with the float64 oracle. The same processes then
provoke every kind of disagreement between ranks and record what each rank raised. Nothing is
asserted here: a failure must reach pytest, not die in a child.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_infcl import TorchTiles, contrastive_distillation_loss, contrastive_loss
from tests.helpers.ring_workers import record_raised, run_rank

FEATURE_WIDTH = 4
SCALE = 1.7
TEACHER_SCALE = 2.3
# Small tiles, so that every block crosses tile boundaries in both directions.
TILES = TorchTiles(tile_rows=2, tile_keys=3)


@dataclass(frozen=True)
class Case:
    """One call of the loss on every rank: its options and the rows/keys each rank holds, per world
    size (keys >= rows: the extras are hard negatives)."""

    symmetric: bool = True
    distillation_weight: float = 1.0
    teacher_width: int = FEATURE_WIDTH
    custom_positives: bool = False
    reduction: str = "mean"
    backend: object = TILES
    dtype: torch.dtype = torch.float64  # of the features (the inputs are drawn in float64)
    rows: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)


CASES = {
    "kl_symmetric": Case(rows={2: (5, 2), 3: (3, 0, 2)}, keys={2: (6, 3), 3: (4, 2, 3)}),
    "kl_one_direction_wider_teacher": Case(
        symmetric=False, teacher_width=7, custom_positives=True,
        rows={2: (0, 4), 3: (2, 3, 1)}, keys={2: (3, 5), 3: (2, 5, 3)},
    ),
    "mixed_symmetric_narrower_teacher": Case(
        distillation_weight=0.4, teacher_width=3, custom_positives=True,
        rows={2: (4, 3), 3: (3, 1, 0)}, keys={2: (6, 4), 3: (4, 3, 2)},
    ),
    "mixed_one_direction": Case(
        symmetric=False, distillation_weight=0.7, backend="torch",
        rows={2: (3, 2), 3: (1, 0, 3)}, keys={2: (5, 2), 3: (3, 1, 4)},
    ),
    "kl_symmetric_sum": Case(
        reduction="sum", teacher_width=5, rows={2: (2, 5), 3: (0, 3, 2)}, keys={2: (4, 5), 3: (2, 3, 4)},
    ),
    "mixed_symmetric_none": Case(
        reduction="none", distillation_weight=0.6, custom_positives=True,
        rows={2: (3, 3), 3: (2, 2, 0)}, keys={2: (5, 4), 3: (3, 4, 1)},
    ),
    # fp32 features: fp32 tiles and accumulators, the statistics still travelling in float64
    "mixed_symmetric_fp32": Case(
        distillation_weight=0.5, teacher_width=6, dtype=torch.float32,
        rows={2: (4, 2), 3: (2, 0, 3)}, keys={2: (5, 4), 3: (3, 2, 4)},
    ),
    # the Triton block ops (interpreted on CPU: the parent sets TRITON_INTERPRET=1 for the ranks)
    "mixed_symmetric_fp32_triton": Case(
        distillation_weight=0.5, teacher_width=6, dtype=torch.float32, custom_positives=True,
        backend="triton-blocks", rows={2: (4, 2), 3: (2, 0, 3)}, keys={2: (5, 4), 3: (3, 2, 4)},
    ),
    # key blocks of one row: the backward's key gradients travel as a single slice
    "one_key_per_rank": Case(
        distillation_weight=0.5, rows={2: (1, 1), 3: (1, 1, 1)}, keys={2: (1, 1), 3: (1, 1, 1)},
    ),
}


def case_inputs(case: Case, world_size: int, seed: int) -> list[dict]:
    """The whole group's float64 inputs, split by rank (``positives`` local, None for keys[:m]):
    fresh random features of a student and of a teacher that half agrees with it."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for m, k in zip(case.rows[world_size], case.keys[world_size]):
        queries = torch.randn(m, FEATURE_WIDTH, generator=gen, dtype=torch.float64)
        keys = torch.randn(k, FEATURE_WIDTH, generator=gen, dtype=torch.float64)
        positives = torch.randperm(k, generator=gen)[:m] if case.custom_positives else None
        at = positives if positives is not None else torch.arange(m)
        keys[at] += 0.5 * queries
        teacher_queries = torch.randn(m, case.teacher_width, generator=gen, dtype=torch.float64)
        teacher_keys = torch.randn(k, case.teacher_width, generator=gen, dtype=torch.float64)
        teacher_keys[at] += 0.8 * teacher_queries
        parts.append(dict(queries=queries, keys=keys, teacher_queries=teacher_queries,
                          teacher_keys=teacher_keys, positives=positives))
    return parts


def concatenated(parts: list[dict]) -> dict:
    """One process's view of the whole batch: rows and keys in rank order, positives global."""
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + part["keys"].shape[0])
    positives = [(torch.arange(part["queries"].shape[0]) if part["positives"] is None else part["positives"])
                 + offset for part, offset in zip(parts, offsets)]
    batch = {name: torch.cat([part[name] for part in parts])
             for name in ("queries", "keys", "teacher_queries", "teacher_keys")}
    batch["positives"] = torch.cat(positives)
    return batch


def triton_blocks():
    """The Triton block ops with super-tiles small enough that every block crosses several, NaN
    poisoning their scratch buffers; None where Triton cannot be imported."""
    try:
        from hf_infcl.ops.triton import TritonBlocks
    except ImportError:
        return None
    return TritonBlocks(tile_rows=2, tile_keys=4, poison=True)


def run_case(case: Case, part: dict) -> dict | None:
    """This rank's value and the gradients of (the sum of) it; None for a Triton case without Triton."""
    backend = triton_blocks() if case.backend == "triton-blocks" else case.backend
    if backend is None:
        return None
    queries = part["queries"].to(case.dtype).requires_grad_(True)
    keys = part["keys"].to(case.dtype).requires_grad_(True)
    scale = torch.tensor(SCALE, dtype=case.dtype, requires_grad=True)
    value = contrastive_distillation_loss(
        queries, keys, part["teacher_queries"].to(case.dtype), part["teacher_keys"].to(case.dtype), scale,
        TEACHER_SCALE,
        symmetric=case.symmetric, positives=part["positives"], distillation_weight=case.distillation_weight,
        reduction=case.reduction, process_group="auto", backend=backend,
    )
    value.sum().backward()
    results = {"value": value.detach(), "queries": queries.grad, "keys": keys.grad, "scale": scale.grad}
    return {name: tensor.double() for name, tensor in results.items()}


# --------------------------------------------------------------------------------------------
# Ranks that disagree: each case gives every rank its own arguments; every rank records what it
# raised.


def _features(m, width=FEATURE_WIDTH, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, width, generator=gen, dtype=dtype)


def _distill(rank, width=FEATURE_WIDTH, teacher_width=3, dtype=torch.float64, teacher_rows=3, **options):
    return contrastive_distillation_loss(
        _features(3, width, dtype, seed=rank), _features(3, width, dtype, seed=10 + rank),
        _features(teacher_rows, teacher_width, dtype, seed=20 + rank),
        _features(3, teacher_width, dtype, seed=30 + rank), 2.0, 3.0, process_group="auto", **options)


def disagreement_cases(rank: int, world_size: int):
    last = world_size - 1
    return {
        "width": lambda: _distill(rank, width=4 + (rank == 0)),
        "teacher_width": lambda: _distill(rank, teacher_width=3 + (rank == last)),
        "dtype": lambda: _distill(rank, dtype=torch.float32 if rank == last else torch.float64),
        "distillation_weight": lambda: _distill(rank, distillation_weight=0.5 if rank == 0 else 1.0),
        "symmetric": lambda: _distill(rank, symmetric=rank != 0),
        "reduction": lambda: _distill(rank, reduction="sum" if rank == last else "mean"),
        # One rank calls the contrastive loss, the others distil: the teacher's width tells them apart.
        "contrastive_loss_on_one_rank": lambda: (
            contrastive_loss(_features(3, seed=rank), _features(3, seed=10 + rank), process_group="auto")
            if rank == 0 else _distill(rank)),
        # One rank's own argument check fails: it raises its own error, the others are told.
        "bad_teacher_on_one_rank": lambda: _distill(rank, teacher_rows=4 if rank == 1 else 3),
        "no_rows_anywhere": lambda: contrastive_distillation_loss(
            _features(0), _features(0), _features(0, 3), _features(0, 3), process_group="auto"),
    }


def after_errors_inputs(rank: int) -> tuple[torch.Tensor, ...]:
    """(queries, keys, teacher queries, teacher keys) of the loss run after the errors."""
    m, k = 2 + rank, 3 + rank
    return (_features(m, seed=40 + rank), _features(k, seed=50 + rank), _features(m, 3, seed=60 + rank),
            _features(k, 3, seed=70 + rank))


def run_disagreements(rank: int, world_size: int):
    raised = record_raised(disagreement_cases(rank, world_size))
    # The group must still be in step afterwards: a correct loss right after all those errors.
    after = contrastive_distillation_loss(*after_errors_inputs(rank), 2.0, 3.0, distillation_weight=0.5,
                                          reduction="sum", process_group="auto", backend=TILES)
    dist.all_reduce(after)
    return raised, after


def worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank; writes its results (or its traceback) under out_dir."""
    run_rank(rank, world_size, init_file, out_dir, collect_results)


def collect_results(rank: int, world_size: int) -> dict:
    results = {"cases": {name: run_case(case, case_inputs(case, world_size, seed=index)[rank])
                         for index, (name, case) in enumerate(CASES.items())}}
    results["raised"], results["after_errors"] = run_disagreements(rank, world_size)
    return results
