"""Worker for the several-process InfCLTrainer tests:
``torchrun --nproc_per_node 2 tests/helpers/trainer_workers.py OUT`` (and two such nodes of 2,
``tests/test_multinode.py``); ``... OUT cuda`` on one GPU per rank.

For each variant in ``VARIANTS`` (gradient caching with chunks of 4 and offload; no caching; on
GPUs ``CUDA_VARIANTS``: the cached step with the default CUDA graphs, with offload, and eager),
each rank trains the same tiny CLIP on its share of 16 pairs (per-device batch 16 / world size,
DDP over gloo or NCCL, no unused-parameter search, the loss through the ring) for two SGD steps;
rank 0 writes the parameters and the log history to OUT for the test to compare with one process
on all 16 pairs.
The variants run in one launch to pay the start-up of the processes once.
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
# name -> (chunk_size, offload, chunk_cuda_graphs)
VARIANTS = {"chunk4-offload": (4, True, None), "uncached": (None, False, None)}
CUDA_VARIANTS = {"chunk4-graphs": (4, False, None), "chunk4-offload-graphs": (4, True, None),
                 "chunk4-eager": (4, False, False)}
# On GPUs: exact fp32 everywhere (no TF32 in the patch convolution, the loss in PyTorch tiles at
# "ieee"), so that the runs compare with one process on the CPU.
CUDA_SETTINGS = dict(use_cpu=False, loss_backend="torch", precision="ieee")


def main(out_dir: str, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ["WORLD_SIZE"])
    on_gpu = device == "cuda"
    if on_gpu:
        torch.backends.cudnn.allow_tf32 = False
    for name, (chunk_size, offload, graphs) in (CUDA_VARIANTS if on_gpu else VARIANTS).items():
        args = trainer_arguments(os.path.join(out_dir, name), per_device_train_batch_size=PAIRS // world_size,
                                 chunk_size=chunk_size, offload=offload, chunk_cuda_graphs=graphs,
                                 **TWO_PROCESS_SETTINGS, **(CUDA_SETTINGS if on_gpu else {}))
        dataset = PairDataset(clip_batch(PAIRS))
        trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=args, train_dataset=dataset)
        assert trainer.accelerator.num_processes == world_size, trainer.accelerator.num_processes
        trainer.train()
        if on_gpu and graphs is None:  # 2 chunks per step: the third call of each pass was captured
            chunk_graphs = trainer._chunk_graphs
            assert chunk_graphs is not None and chunk_graphs.failure is None, (name, chunk_graphs.failure)
            assert chunk_graphs.captured == 2, (name, chunk_graphs.captured)
        if trainer.accelerator.is_main_process:
            torch.save(trained_parameters(trainer), os.path.join(out_dir, f"parameters-{name}.pt"))
            with open(os.path.join(out_dir, f"log_history-{name}.json"), "w") as handle:
                json.dump(trainer.state.log_history, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_worker_process()
