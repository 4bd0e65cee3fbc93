"""Processes of the 2-process gloo test of ``hf_infcl.losses.InfCLGISTLoss`` (CPU, float64).

Each rank loads the same tiny model and guide, takes its own half of a batch of text columns and
runs one forward/backward with GISTEmbedLoss / CachedGISTEmbedLoss (``gather_across_devices=True``:
their all-gather) and one with InfCLGISTLoss (the hf_infcl ring), dropout seeded the same way for
both, and saves both losses and gradients. Nothing is asserted here: the test process compares.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.sentence_transformers_fixtures import load_tiny_model, loss_and_gradients, text_columns
from tests.helpers.sentence_transformers_workers import rank_process

# name -> (columns per example, mini_batch_size, GIST options)
GIST_SCENARIOS = {
    "pairs": (2, None, {"margin": 0.1}),
    "negatives-relative": (3, None, {"margin": 0.05, "margin_strategy": "relative"}),
    "negatives-no_anchors": (3, None, {"margin": 0.1, "contrast_anchors": False}),
    "negatives-cached3": (3, 3, {"margin": 0.1}),
    "negatives-no_positives-cached3": (3, 3, {"margin": 0.1, "contrast_positives": False}),
}
ROWS_PER_RANK = 5


def run_gist_rank(rank: int, world_size: int, init_file: str, model_dir: str, guide_dir: str,
                  out_dir: str) -> None:
    from sentence_transformers.sentence_transformer import losses as st_losses

    from hf_infcl import losses

    with rank_process(rank, world_size, init_file, Path(out_dir) / f"rank{rank}.pt") as results:
        model = load_tiny_model(Path(model_dir)).double()
        guide = load_tiny_model(Path(guide_dir)).double().eval().requires_grad_(False)
        for name, (n_columns, mini_batch_size, options) in GIST_SCENARIOS.items():
            columns = text_columns(ROWS_PER_RANK * world_size, n_columns, seed=len(name))
            local = [column[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK] for column in columns]
            if mini_batch_size is None:
                reference = st_losses.GISTEmbedLoss(model, guide, gather_across_devices=True, **options)
            else:
                reference = st_losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=mini_batch_size,
                                                          gather_across_devices=True, **options)
            ours = losses.InfCLGISTLoss(model, guide, mini_batch_size=mini_batch_size,
                                        gather_across_devices=True, **options)
            seed = 1000 + rank
            results[name] = {"sentence_transformers": loss_and_gradients(model, reference, local, seed),
                             "infcl": loss_and_gradients(model, ours, local, seed)}
