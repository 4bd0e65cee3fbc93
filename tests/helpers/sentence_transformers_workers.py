"""Processes of the 2-process gloo test of ``hf_infcl.losses.InfCLLoss`` (CPU).

Each rank loads the same tiny model, takes its own half of a batch of text columns and runs one
forward/backward with sentence-transformers' loss (``gather_across_devices`` as the scenario says:
the all-gather of the embeddings) and one with InfCLLoss (the hf_infcl ring), dropout seeded the
same way for both. Each rank saves both losses and both sets of parameter gradients; the test
process compares them. ``run_directions_rank`` runs MNRL's directions on fixed embeddings, the
ranks holding different numbers of examples (which MNRL's all-gather cannot). Nothing is asserted
here: a failure must reach pytest, not die in a child.
"""

from __future__ import annotations

import contextlib
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.sentence_transformers_fixtures import (
    load_tiny_model,
    loss_and_gradients,
    st_reference_loss,
    text_columns,
)

GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
# name -> (columns per example, InfCLLoss options, mini_batch_size, gather_across_devices)
SCENARIOS = {
    "pairs": (2, {}, None, True),
    "hard_negatives-symmetric": (3, {"symmetric": True}, None, True),
    "hard_negatives-cached3": (4, {}, 3, True),
    "pairs-local_negatives": (2, {}, None, False),
    "pairs-query_to_query": (2, {"directions": ("query_to_doc", "query_to_query")}, None, True),
    "hard_negatives-doc_to_doc": (3, {"directions": ("query_to_doc", "doc_to_doc")}, None, True),
    "hard_negatives-all_directions-cached3": (3, {"directions": GTE}, 3, True),
}
ROWS_PER_RANK = 5


@contextlib.contextmanager
def rank_process(rank: int, world_size: int, init_file: str, out_file: Path):
    """One rank's gloo group around the body; yields the results dict, which is saved to
    ``out_file`` whatever happens (with the traceback under "error" if the body raised)."""
    torch.set_num_threads(1)
    results = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        yield results
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, out_file)
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(target, world_size: int, out_dir: Path, *arguments, results: str = "rank") -> list[dict]:
    """``target(rank, world_size, init_file, *arguments, out_dir)`` on ``world_size`` forked processes
    (the children inherit the imported libraries); each rank's results dict, read from
    ``out_dir / f"{results}{rank}.pt"`` (what :func:`rank_process` saves), after failing the test
    with the traceback of any rank that raised."""
    import torch.multiprocessing as mp

    mp.start_processes(target, args=(world_size, str(out_dir / "init"), *map(str, arguments), str(out_dir)),
                       nprocs=world_size, join=True, start_method="fork")
    ranks = [torch.load(out_dir / f"{results}{rank}.pt", weights_only=False) for rank in range(world_size)]
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return ranks


def run_rank(rank: int, world_size: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Entry point of one rank (``torch.multiprocessing`` passes ``rank`` first)."""
    from hf_infcl import losses

    with rank_process(rank, world_size, init_file, Path(out_dir) / f"rank{rank}.pt") as results:
        model = load_tiny_model(Path(model_dir))
        for name, (n_columns, options, mini_batch_size, gather) in SCENARIOS.items():
            # The same global batch on every rank; each rank keeps its own contiguous slice.
            columns = text_columns(ROWS_PER_RANK * world_size, n_columns, seed=len(name))
            local = [column[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK] for column in columns]
            seed = 1000 + rank  # different dropout per rank, the same for both losses
            st_options = {key: value for key, value in options.items() if key != "symmetric"}
            reference = st_reference_loss(model, options.get("symmetric", False), mini_batch_size,
                                          gather_across_devices=gather, **st_options)
            ours = losses.InfCLLoss(model, mini_batch_size=mini_batch_size, gather_across_devices=gather,
                                    backend="torch", **options)
            results[name] = {
                "sentence_transformers": loss_and_gradients(model, reference, local, seed),
                "infcl": loss_and_gradients(model, ours, local, seed),
            }


DDP_MINI_BATCH = 2  # three mini-batches per rank: three replays


def run_ddp_rank(rank: int, world_size: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """One cached step of ``InfCLLoss`` on a SentenceTransformer wrapped in DDP, as
    sentence-transformers' Trainer runs it (the loss holds the wrapped model). A DDP communication
    hook counts the gradient reductions. Dropout is off, so that rank 0 can repeat the step in one
    process on the concatenated batch."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from hf_infcl import losses

    with rank_process(rank, world_size, init_file, Path(out_dir) / f"ddp-rank{rank}.pt") as results:
        columns = text_columns(ROWS_PER_RANK * world_size, 2, seed=7)
        local = [column[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK] for column in columns]
        model = load_tiny_model(Path(model_dir)).eval()
        # One bucket (the model is tiny): one reduction per synchronised backward. Mean pooling
        # leaves BERT's pooler unused, as sentence-transformers' Trainer finds it
        # (ddp_find_unused_parameters).
        wrapped = DistributedDataParallel(model, bucket_cap_mb=1024, find_unused_parameters=True)
        reductions = [0]

        def counting_hook(state, bucket):
            reductions[0] += 1
            return allreduce_hook(state, bucket)
        wrapped.register_comm_hook(None, counting_hook)
        loss = losses.InfCLLoss(model, mini_batch_size=DDP_MINI_BATCH, gather_across_devices=True,
                                backend="torch")
        loss.model = wrapped  # what sentence-transformers' Trainer does under DDP
        value, gradients = loss_and_gradients(model, loss, local, seed=0)
        results["ddp"] = {"loss": value, "gradients": gradients, "reductions": reductions[0]}
        # DDP's reducer goes while its process group is alive: left to the end of the function,
        # it was destroyed after destroy_process_group, and once (of many runs) a rank hung there.
        del loss, wrapped
        if rank == 0:
            alone = load_tiny_model(Path(model_dir)).eval()
            reference = losses.InfCLLoss(alone, mini_batch_size=DDP_MINI_BATCH, backend="torch")
            value, gradients = loss_and_gradients(alone, reference, columns, seed=0)
            results["one_process"] = {"loss": value, "gradients": gradients}


# MNRL's joint directions (and its hardness modes) on embeddings, the two ranks holding 3 and 5
# examples: the options of InfCLLoss, which are also the oracle's (tests/helpers/oracle.py).
DIRECTION_SETS = {
    "query_to_query": dict(directions=("query_to_doc", "query_to_query"), partition_mode="joint"),
    "doc_to_doc": dict(directions=("query_to_doc", "doc_to_doc"), partition_mode="joint"),
    "all": dict(directions=GTE, partition_mode="joint"),
    "all_in_batch_hardness": dict(directions=GTE, partition_mode="joint", hardness_mode="in_batch_negatives",
                                  hardness_strength=2.0),
    "mnsrl_hard_negatives_hardness": dict(directions=("query_to_doc", "doc_to_query"),
                                          partition_mode="per_direction", hardness_mode="hard_negatives",
                                          hardness_strength=5.0),
    "all_negatives_hardness": dict(directions=("query_to_doc",), partition_mode="joint",
                                   hardness_mode="all_negatives", hardness_strength=1.5),
}
UNEQUAL_ROWS = (3, 5)
DIRECTIONS_SCALE = 0.7


def direction_embeddings() -> list[torch.Tensor]:
    """The whole batch: float64 anchors, positives and one negatives column, the same on every rank."""
    generator = torch.Generator().manual_seed(16)
    return [torch.randn(sum(UNEQUAL_ROWS), 6, generator=generator, dtype=torch.float64) for _ in range(3)]


def run_directions_rank(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Each direction set's loss over the ring and the gradients of this rank's embeddings."""
    from sentence_transformers import util

    from hf_infcl import losses

    with rank_process(rank, world_size, init_file, Path(out_dir) / f"directions-rank{rank}.pt") as results:
        start = sum(UNEQUAL_ROWS[:rank])
        local = [column[start:start + UNEQUAL_ROWS[rank]].requires_grad_()
                 for column in direction_embeddings()]
        for name, options in DIRECTION_SETS.items():
            # compute_loss_from_embeddings never reads the model: none is loaded
            loss = losses.InfCLLoss(None, scale=DIRECTIONS_SCALE, similarity_fct=util.dot_score,
                                    gather_across_devices=True, backend="torch", **options)
            value = loss.compute_loss_from_embeddings(local)
            results[name] = (value.detach(), torch.autograd.grad(value, local))
