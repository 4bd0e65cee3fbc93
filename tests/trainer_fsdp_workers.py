"""Worker for the InfCLTrainer-under-FSDP2 and -DeepSpeed tests (``tests/test_trainer_fsdp.py``).

    torchrun --nproc_per_node 2 tests/trainer_fsdp_workers.py OUT [fsdp|deepspeed]

Each variant trains a tiny CLIPModel (whose ``logit_scale`` is 0-d, which ``fully_shard`` refuses)
for two SGD steps on 8 pairs per rank and saves the model (rank 0 writes the full parameters and
the saved directory to OUT):

* ``ddp``: no FSDP (the reference);
* ``fsdp``: FSDP2 without chunking;
* ``fsdp-chunk-step`` / ``fsdp-chunk-chunk``: FSDP2 with ``chunk_size=3`` and each
  ``chunk_gradient_sync``;
* with ``deepspeed``: ``zero2`` and ``zero2-chunk`` instead of the FSDP2 runs (on CPU through
  DeepSpeed's CPU accelerator, ``DS_ACCELERATOR=cpu``; the Trainer refuses ZeRO-3).

On CUDA the Trainer's own ``fsdp`` arguments are used. Accelerate enables FSDP only on GPUs, so
on CPU the worker switches the Trainer's Accelerator to FSDP2 after it is built (the same plugin
the Trainer would have made): the rest of the Trainer's FSDP2 code path then runs unchanged.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_infcl import InfCLTrainer  # noqa: E402
from hf_infcl.sharding import full_value  # noqa: E402
from tests.trainer_fixtures import (  # noqa: E402
    PairDataset,
    clip_batch,
    end_worker_process,
    tiny_clip,
    trainer_arguments,
)

SETTINGS = dict(max_steps=2, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                max_grad_norm=1.0, per_device_train_batch_size=8, save_strategy="no")
FSDP = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["CLIPEncoderLayer"]})
# engine -> name -> extra arguments
VARIANTS = {
    "fsdp": {
        "ddp": {},
        "fsdp": FSDP,
        "fsdp-chunk-step": {**FSDP, "chunk_size": 3, "chunk_gradient_sync": "step"},
        "fsdp-chunk-chunk": {**FSDP, "chunk_size": 3, "chunk_gradient_sync": "chunk"},
    },
    "deepspeed": {
        "ddp": {},
        **{f"zero{stage}{suffix}": {"chunk_size": chunk, "deepspeed": {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10}}}
           for stage in (2,) for suffix, chunk in (("", None), ("-chunk", 3))},
    },
}


class CpuFsdpTrainer(InfCLTrainer):
    """InfCLTrainer whose Accelerator runs FSDP2 on CPU (Accelerate itself allows it on GPUs only)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is None:
            return
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        # the process-wide state too, which Accelerate consults again later
        for shared in (state.__dict__, PartialState._shared_state):
            shared["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True


def full_parameters(trainer) -> dict[str, torch.Tensor]:
    """Every parameter whole: FSDP2 DTensors gathered, ZeRO-3 partitions gathered."""
    parameters = dict(trainer.model.named_parameters())
    if trainer.is_deepspeed_enabled:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(parameters.values())):
            return {key: value.detach().clone().cpu() for key, value in parameters.items()}
    return {key: full_value(value).detach().clone().cpu() for key, value in parameters.items()}


def main(out_dir: str, engine: str = "fsdp") -> None:
    torch.set_num_threads(1)
    on_gpu = torch.cuda.is_available()
    trainer_class = InfCLTrainer if on_gpu or engine == "deepspeed" else CpuFsdpTrainer
    rank = int(os.environ["RANK"])
    for name, extra in VARIANTS[engine].items():
        output_dir = os.path.join(out_dir, name)
        arguments = {**SETTINGS, **extra}
        if on_gpu:  # fp32 everywhere, so that DDP and FSDP2 agree to rounding
            arguments.update(use_cpu=False, precision="ieee")
        args = trainer_arguments(output_dir, **arguments)
        dataset = PairDataset(clip_batch(16))
        trainer = trainer_class(model=tiny_clip(dropout=0.0), args=args, train_dataset=dataset)
        assert trainer.is_fsdp_enabled == ("fsdp" in name), (name, trainer.is_fsdp_enabled)
        assert trainer.is_deepspeed_enabled == ("zero" in name), (name, trainer.is_deepspeed_enabled)
        trainer.train()
        parameters = full_parameters(trainer)
        trainer.save_model(output_dir)
        if rank == 0:
            torch.save({"parameters": parameters, "log_history": trainer.state.log_history},
                       os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_worker_process()
