"""Processes of the 2-process gloo test of ``hf_infcl.losses.InfCLLoss`` (CPU).

Each rank loads the same tiny model, takes its own half of a batch of text columns and runs one
forward/backward with sentence-transformers' loss (``gather_across_devices`` as the scenario says:
the all-gather of the embeddings) and one with InfCLLoss (the hf_infcl ring), dropout seeded the
same way for both. Each rank saves both losses and both sets of parameter gradients; the test
process compares them. Nothing is asserted here: a failure must reach pytest, not die in a child.
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.sentence_transformers_fixtures import (
    load_tiny_model,
    loss_and_gradients,
    st_reference_loss,
    text_columns,
)

# name -> (columns per example, symmetric, mini_batch_size, gather_across_devices)
SCENARIOS = {
    "pairs": (2, False, None, True),
    "hard_negatives-symmetric": (3, True, None, True),
    "hard_negatives-cached3": (4, False, 3, True),
    "pairs-local_negatives": (2, False, None, False),
}
ROWS_PER_RANK = 5


def run_rank(rank: int, world_size: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Entry point of one rank (``torch.multiprocessing`` passes ``rank`` first)."""
    from hf_infcl import losses

    torch.set_num_threads(1)
    results = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        model = load_tiny_model(Path(model_dir))
        for name, (n_columns, symmetric, mini_batch_size, gather) in SCENARIOS.items():
            # The same global batch on every rank; each rank keeps its own contiguous slice.
            columns = text_columns(ROWS_PER_RANK * world_size, n_columns, seed=len(name))
            local = [column[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK] for column in columns]
            seed = 1000 + rank  # different dropout per rank, the same for both losses
            reference = st_reference_loss(model, symmetric, mini_batch_size, gather_across_devices=gather)
            ours = losses.InfCLLoss(
                model, symmetric=symmetric, mini_batch_size=mini_batch_size, gather_across_devices=gather,
                backend="torch",
            )
            results[name] = {
                "sentence_transformers": loss_and_gradients(model, reference, local, seed),
                "infcl": loss_and_gradients(model, ours, local, seed),
            }
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()
