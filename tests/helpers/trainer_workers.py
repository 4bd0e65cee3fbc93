"""Worker for the several-process InfCLTrainer tests:
``torchrun --nproc_per_node 2 tests/helpers/trainer_workers.py OUT`` (and two such nodes of 2,
``tests/test_multinode.py``).

For each variant in ``VARIANTS`` (gradient caching with chunks of 4 and offload; no caching),
each rank trains the same tiny CLIP on its share of 16 pairs (per-device batch 16 / world size,
DDP over gloo, no unused-parameter search, the loss through the ring) for two SGD steps; rank 0
writes the parameters and the log history to OUT for the test to compare with one process on all
16 pairs.
Both variants run in one launch to pay the start-up of two processes once.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_infcl import InfCLTrainer  # noqa: E402
from tests.helpers.trainer_fixtures import (  # noqa: E402
    PairDataset,
    clip_batch,
    end_worker_process,
    tiny_clip,
    trained_parameters,
    trainer_arguments,
)

TWO_PROCESS_SETTINGS = dict(max_steps=2, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                            ddp_find_unused_parameters=False, max_grad_norm=0.0)


PAIRS = 16  # the global batch, split evenly over the processes
# name -> (chunk_size, offload)
VARIANTS = {"chunk4-offload": (4, True), "uncached": (None, False)}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ["WORLD_SIZE"])
    for name, (chunk_size, offload) in VARIANTS.items():
        args = trainer_arguments(os.path.join(out_dir, name), per_device_train_batch_size=PAIRS // world_size,
                                 chunk_size=chunk_size, offload=offload, **TWO_PROCESS_SETTINGS)
        dataset = PairDataset(clip_batch(PAIRS))
        trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=args, train_dataset=dataset)
        assert trainer.accelerator.num_processes == world_size, trainer.accelerator.num_processes
        trainer.train()
        if trainer.accelerator.is_main_process:
            torch.save(trained_parameters(trainer), os.path.join(out_dir, f"parameters-{name}.pt"))
            with open(os.path.join(out_dir, f"log_history-{name}.json"), "w") as handle:
                json.dump(trainer.state.log_history, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
