"""Processes of the Matryoshka ring tests (``tests/test_matryoshka.py``), spawned two at a time on CPU
over gloo.

Each rank computes ``contrastive_loss(..., matryoshka_dims=...)`` over the process group on its own
uneven slice of a global float64 batch (a rank may hold no rows), backpropagates, and writes its
value and the gradients of its queries, keys, the scale and the bias to a file, which the test
process compares with one process on the concatenated batch. The same processes then pass
disagreeing dims or weights and record what each rank raised. Nothing is asserted here: a failure
must reach pytest, not die in a child.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_infcl import TorchTiles, contrastive_loss
from tests.helpers.ring_workers import record_raised, run_rank

FEATURE_WIDTH = 10
SCALE = 4.0
# Small tiles, so that every block crosses tile boundaries in both directions.
TILES = TorchTiles(tile_rows=2, tile_keys=3)


@dataclass(frozen=True)
class Case:
    """One call on every rank: its options and the rows/keys each rank holds (two ranks)."""

    dims: tuple = (10, 6, 3)
    weights: tuple | None = None
    options: dict = field(default_factory=dict)
    bias: float | None = None
    grouped: bool = False
    reduction: str = "mean"
    rows: tuple = (5, 2)
    keys: tuple = (6, 4)


CASES = {
    "softmax_symmetric": Case(weights=(1.0, 0.5, 2.0)),
    "softmax_one_direction_no_rows_on_rank_0": Case(dims=(8, 2), options=dict(symmetric=False),
                                                    rows=(0, 4), keys=(3, 5)),
    "sigmoid_bias_none": Case(dims=(10, 5, 1), options=dict(loss="sigmoid"), bias=-2.0, reduction="none",
                              rows=(3, 3), keys=(4, 5)),
    "groups_any_filtered_sum": Case(dims=(9, 4), weights=(0.7, 1.3), grouped=True, reduction="sum",
                                    options=dict(group_positives="any", false_negative_margin=0.1,
                                                 symmetric=False)),
}


def case_inputs(case: Case, seed: int) -> list[dict]:
    """The whole group's float64 inputs, split by rank (positives are keys[:m] on each rank): fresh
    random features with each positive near its row, and group ids shared across ranks."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for m, k in zip(case.rows, case.keys):
        queries = torch.randn(m, FEATURE_WIDTH, generator=gen, dtype=torch.float64)
        keys = torch.randn(k, FEATURE_WIDTH, generator=gen, dtype=torch.float64)
        keys[:m] += 0.7 * queries
        part = dict(queries=queries, keys=keys)
        if case.grouped:
            part["query_groups"] = torch.randint(0, 4, (m,), generator=gen)
            part["key_groups"] = torch.randint(0, 6, (k,), generator=gen)
        parts.append(part)
    return parts


def concatenated(parts: list[dict]) -> dict:
    """One process's view of the whole batch: rows and keys in rank order, positives global."""
    offsets, positives = 0, []
    for part in parts:
        positives.append(torch.arange(part["queries"].shape[0]) + offsets)
        offsets += part["keys"].shape[0]
    batch = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
    batch["positives"] = torch.cat(positives)
    return batch


def run_case(case: Case, part: dict, process_group="auto", positives=None) -> dict:
    """The value and the gradients of (the sum of) it, float64."""
    queries = part["queries"].clone().requires_grad_(True)
    keys = part["keys"].clone().requires_grad_(True)
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    bias = None if case.bias is None else torch.tensor(case.bias, dtype=torch.float64, requires_grad=True)
    groups = {name: part[name] for name in ("query_groups", "key_groups") if name in part}
    value = contrastive_loss(queries, keys, scale, bias, positives=positives, reduction=case.reduction,
                             process_group=process_group, backend=TILES, matryoshka_dims=case.dims,
                             matryoshka_weights=case.weights, **groups, **case.options)
    value.sum().backward()
    results = {"value": value.detach(), "queries": queries.grad, "keys": keys.grad, "scale": scale.grad}
    if bias is not None:
        results["bias"] = bias.grad
    return results


def _features(m, width=FEATURE_WIDTH, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, width, generator=gen, dtype=torch.float64)


def _matryoshka(rank, **options):
    return contrastive_loss(_features(3, seed=rank), _features(4, seed=10 + rank), 2.0, process_group="auto",
                            backend=TILES, **options)


def disagreement_cases(rank: int):
    return {
        "dims_count": lambda: _matryoshka(rank, matryoshka_dims=(10, 5) if rank == 0 else (10, 5, 2)),
        "dims_values": lambda: _matryoshka(rank, matryoshka_dims=(10, 5, 3 + rank)),
        "first_dim": lambda: _matryoshka(rank, matryoshka_dims=(10 - rank, 5)),
        "weights": lambda: _matryoshka(rank, matryoshka_dims=(10, 5), matryoshka_weights=(1.0, 1.0 + rank)),
        "plain_loss_on_one_rank": lambda: _matryoshka(rank, matryoshka_dims=None if rank == 0 else (10,)),
        # rank 1's own dims fail their check: it raises its own error, rank 0 is told
        "bad_dims_on_one_rank": lambda: _matryoshka(rank,
                                                    matryoshka_dims=(10, 5) if rank == 0 else (5, 10)),
    }


def run_disagreements(rank: int):
    raised = record_raised(disagreement_cases(rank))
    # The group must still be in step afterwards: a correct loss right after all those errors.
    after = _matryoshka(rank, matryoshka_dims=(10, 4), reduction="sum")
    dist.all_reduce(after)
    return raised, after


def worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank; writes its results (or its traceback) under out_dir."""
    run_rank(rank, world_size, init_file, out_dir, collect_results)


def collect_results(rank: int, world_size: int) -> dict:
    results = {"cases": {name: run_case(case, case_inputs(case, seed=index)[rank])
                         for index, (name, case) in enumerate(CASES.items())}}
    results["raised"], results["after_errors"] = run_disagreements(rank)
    return results
