"""Worker for the two-process InfCLTrainer test: ``torchrun --nproc_per_node 2 tests/trainer_workers.py OUT``.

Each rank trains the same tiny CLIP on its half of 16 pairs (per-device batch 8, gradient caching
with chunks of 4, DDP over gloo, no unused-parameter search) for two SGD steps; rank 0 writes the
parameters and the log history to OUT for the test to compare with one process on all 16 pairs.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_infcl import InfCLTrainer  # noqa: E402
from tests.trainer_fixtures import (  # noqa: E402
    PairDataset,
    clip_batch,
    tiny_clip,
    trained_parameters,
    trainer_arguments,
)

TWO_PROCESS_SETTINGS = dict(max_steps=2, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                            ddp_find_unused_parameters=False, max_grad_norm=0.0)


def main(out_dir: str, chunk_size: int | None, offload: bool) -> None:
    torch.set_num_threads(1)
    args = trainer_arguments(os.path.join(out_dir, "run"), per_device_train_batch_size=8,
                             chunk_size=chunk_size, offload=offload, **TWO_PROCESS_SETTINGS)
    trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=args, train_dataset=PairDataset(clip_batch(16)))
    assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
    trainer.train()
    if trainer.accelerator.is_main_process:
        torch.save(trained_parameters(trainer), os.path.join(out_dir, "parameters.pt"))
        with open(os.path.join(out_dir, "log_history.json"), "w") as handle:
            json.dump(trainer.state.log_history, handle)


if __name__ == "__main__":
    chunk = None if sys.argv[2] == "none" else int(sys.argv[2])
    main(sys.argv[1], chunk, offload=sys.argv[3] == "offload")
