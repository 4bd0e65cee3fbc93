"""Worker for the several-process distillation test of InfCLTrainer:
``torchrun --nproc_per_node 2 tests/helpers/trainer_distillation_workers.py OUT``.

For each variant in ``VARIANTS`` (gradient caching with chunks of 4 and offload; no caching) and
each source of the teacher's embeddings (``columns``: precomputed in the batch, without
``teacher_logit_scale`` for the model), each rank trains the same tiny CLIP on its share of 16
rows (DDP over gloo, the distillation loss through the ring) for two SGD steps; rank 0 writes the
parameters to OUT for the test to compare with a float64 loop on all 16 rows. Then the same with
the teacher's columns under FSDP2 (``FSDP_VARIANTS``: uncached, and cached with one gradient
reduction per step), on CPU through ``tests/helpers/trainer_fsdp_workers.py``'s Trainer.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_infcl import InfCLTrainer  # noqa: E402
from hf_infcl.training_args import TEACHER_COLUMNS  # noqa: E402
from tests.helpers.trainer_fixtures import (  # noqa: E402
    PairDataset,
    clip_batch,
    end_worker_process,
    tiny_clip,
    tiny_clip_config,
    trained_parameters,
    trainer_arguments,
)
from tests.helpers.trainer_fsdp_workers import CpuFsdpTrainer, fsdp_variants, full_parameters  # noqa: E402
from tests.helpers.trainer_workers import PAIRS, TWO_PROCESS_SETTINGS, VARIANTS  # noqa: E402

__all__ = ["FSDP_VARIANTS", "SETTINGS", "TEACHER_WIDTH", "VARIANTS", "clip_teacher", "distillation_batch",
           "teacher_columns"]

TEACHER_WIDTH = 5
FSDP_VARIANTS = ("fsdp", "fsdp-chunk-step")
SETTINGS = {**TWO_PROCESS_SETTINGS, "learning_rate": 0.5, "distillation_weight": 0.7,
            "teacher_logit_scale": 20.0}


def teacher_columns(rows: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """A teacher's embeddings of the rows and keys: random, L2-normalised, of their own width."""
    generator = torch.Generator().manual_seed(seed)
    normalize = torch.nn.functional.normalize
    return {column: normalize(torch.randn(rows, TEACHER_WIDTH, generator=generator), dim=-1)
            for column in TEACHER_COLUMNS}


def clip_teacher():
    """A tiny CLIP of another width (6) and with dropout, which the Trainer must switch off."""
    from transformers import CLIPModel

    torch.manual_seed(3)
    config = tiny_clip_config(dropout=0.1)
    config.projection_dim = 6
    with torch.no_grad():
        model = CLIPModel(config)
        model.logit_scale.fill_(3.0)  # its own scale, exp(3), unlike the student's
    return model.train()


def distillation_batch() -> dict[str, torch.Tensor]:
    """``PAIRS`` CLIP pairs with a teacher's embeddings of their rows and keys."""
    return {**clip_batch(PAIRS), **teacher_columns(PAIRS)}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ["WORLD_SIZE"])
    for source in ("columns", "model"):
        batch, settings, teacher = distillation_batch(), dict(SETTINGS), None
        if source == "model":
            batch = {name: value for name, value in batch.items() if name not in TEACHER_COLUMNS}
            settings["teacher_logit_scale"] = None  # the teacher model's own
        for name, (chunk_size, offload, _) in VARIANTS.items():
            args = trainer_arguments(os.path.join(out_dir, f"{source}-{name}"), chunk_size=chunk_size,
                                     per_device_train_batch_size=PAIRS // world_size, offload=offload,
                                     **settings)
            if source == "model":
                teacher = clip_teacher()
            trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=args, train_dataset=PairDataset(batch),
                                   teacher=teacher)
            assert trainer.accelerator.num_processes == world_size, trainer.accelerator.num_processes
            trainer.train()
            if trainer.accelerator.is_main_process:
                torch.save(trained_parameters(trainer),
                           os.path.join(out_dir, f"parameters-{source}-{name}.pt"))
    sharded = fsdp_variants("CLIPEncoderLayer")
    trainer_class = InfCLTrainer if torch.cuda.is_available() else CpuFsdpTrainer
    for name in FSDP_VARIANTS:
        args = trainer_arguments(os.path.join(out_dir, f"columns-{name}"),
                                 per_device_train_batch_size=PAIRS // world_size, **SETTINGS, **sharded[name])
        trainer = trainer_class(model=tiny_clip(dropout=0.0), args=args,
                                train_dataset=PairDataset(distillation_batch()))
        assert trainer.is_fsdp_enabled
        trainer.train()
        parameters = full_parameters(trainer)  # every rank takes part in the gather
        if trainer.accelerator.is_main_process:
            torch.save(parameters, os.path.join(out_dir, f"parameters-columns-{name}.pt"))

if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
