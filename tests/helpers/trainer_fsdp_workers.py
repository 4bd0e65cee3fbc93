"""Worker for the InfCLTrainer-under-FSDP2 and -DeepSpeed tests (``tests/test_trainer_fsdp.py``).

    torchrun --nproc_per_node 2 tests/helpers/trainer_fsdp_workers.py OUT [fsdp|deepspeed] [clip|siglip2]

Each variant trains a tiny CLIPModel (whose ``logit_scale`` is 0-d, which ``fully_shard`` refuses),
or with ``siglip2`` a tiny Siglip2Model on NaFlex batches (the sigmoid loss with its bias, image
rows of different numbers of patches), for two SGD steps on 8 pairs per rank and saves the model
(rank 0 writes the full parameters and the saved directory to OUT):

* ``ddp``: no FSDP (the reference);
* ``fsdp``: FSDP2 without chunking;
* ``fsdp-chunk-step`` / ``fsdp-chunk-chunk``: FSDP2 with ``chunk_size=3`` and each
  ``chunk_gradient_sync`` (parameters gathered once per step, the default);
* ``fsdp-chunk-step-gather-chunk``: the same with ``chunk_parameter_gather="chunk"``;
* with ``deepspeed``: ``zero2``, ``zero2-chunk``, ``zero3`` and ``zero3-chunk`` instead of the
  FSDP2 runs (on CPU through DeepSpeed's CPU accelerator, ``DS_ACCELERATOR=cpu``).

The logit scale is clamped (``logit_scale_max``) after the first step, which under DeepSpeed
must reach the optimizer's fp32 master copy.

On CUDA the Trainer's own ``fsdp`` arguments are used. Accelerate enables FSDP only on GPUs, so
on CPU the worker switches the Trainer's Accelerator to FSDP2 after it is built (the same plugin
the Trainer would have made): the rest of the Trainer's FSDP2 code path then runs unchanged.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import CLIPModel, Siglip2Model
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_infcl import InfCLTrainer  # noqa: E402
from hf_infcl.sharding import full_value  # noqa: E402
from tests.helpers.trainer_fixtures import (  # noqa: E402
    PairDataset,
    clip_batch,
    end_worker_process,
    naflex_batch,
    tiny_clip,
    tiny_siglip2,
    trainer_arguments,
)

# logit_scale_max: the scale (14.29 at the start) is clamped after the first step
SETTINGS = dict(max_steps=2, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                max_grad_norm=1.0, per_device_train_batch_size=8, save_strategy="no", logit_scale_max=14.2)
# family -> (the model class, a tiny model, its batch, the layer class FSDP2 wraps)
FAMILIES = {
    "clip": (CLIPModel, lambda: tiny_clip(dropout=0.0), clip_batch, "CLIPEncoderLayer"),
    "siglip2": (Siglip2Model, tiny_siglip2, naflex_batch, "Siglip2EncoderLayer"),
}


def fsdp_variants(layer: str) -> dict[str, dict]:
    """name -> extra arguments of the FSDP2 runs, sharding each ``layer`` (a class name)."""
    fsdp = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [layer]})
    return {
        "ddp": {},
        "fsdp": fsdp,
        "fsdp-chunk-step": {**fsdp, "chunk_size": 3, "chunk_gradient_sync": "step"},
        "fsdp-chunk-chunk": {**fsdp, "chunk_size": 3, "chunk_gradient_sync": "chunk"},
        "fsdp-chunk-step-gather-chunk": {**fsdp, "chunk_size": 3, "chunk_parameter_gather": "chunk"},
    }


# name -> extra arguments
DEEPSPEED_VARIANTS = {
    "ddp": {},
    **{f"zero{stage}{suffix}": {"chunk_size": chunk, "deepspeed": {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        # nothing persists under ZeRO-3: the logit scale is freed like every parameter; the
        # saved model is gathered whole, as transformers needs for save_model under ZeRO-3
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True}}}
       for stage in (2, 3) for suffix, chunk in (("", None), ("-chunk", 3))},
}


class CpuFsdpMixin:
    """Put before a transformers Trainer class: its Accelerator runs FSDP2 on CPU (Accelerate
    itself allows it on GPUs only)."""

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


class CpuFsdpTrainer(CpuFsdpMixin, InfCLTrainer):
    """InfCLTrainer whose Accelerator runs FSDP2 on CPU."""


def full_parameters(trainer) -> dict[str, torch.Tensor]:
    """Every parameter whole: FSDP2 DTensors gathered, ZeRO-3 partitions gathered."""
    parameters = dict(trainer.model.named_parameters())
    if trainer.is_deepspeed_enabled:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(parameters.values())):
            return {key: value.detach().clone().cpu() for key, value in parameters.items()}
    return {key: full_value(value).detach().clone().cpu() for key, value in parameters.items()}


def main(out_dir: str, engine: str = "fsdp", family: str = "clip") -> None:
    torch.set_num_threads(1)
    model_class, build, make_batch, layer = FAMILIES[family]
    variants = fsdp_variants(layer) if engine == "fsdp" else DEEPSPEED_VARIANTS
    on_gpu = torch.cuda.is_available()
    trainer_class = InfCLTrainer if on_gpu or engine == "deepspeed" else CpuFsdpTrainer
    rank = int(os.environ["RANK"])
    # Every run starts from these weights (the tiny model is seeded: each rank saves the same ones, so no
    # process waits on another; saved before any process group exists, which would make only
    # rank 0 write).
    start = os.path.join(out_dir, f"start-rank{rank}")
    build().save_pretrained(start)
    if engine == "deepspeed":
        # On CPU, TrainingArguments leaves DeepSpeed's own communication uninitialised, so
        # DeepSpeed's configuration would count one process.
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    for name, extra in variants.items():
        output_dir = os.path.join(out_dir, name)
        arguments = {**SETTINGS, **extra}
        if on_gpu:  # fp32 everywhere, so that DDP and FSDP2 agree to rounding
            arguments.update(use_cpu=False, precision="ieee")
        # Built before its arguments: DeepSpeed's zero.Init, which from_pretrained uses once ZeRO-3
        # arguments exist, cannot partition CLIP's 0-d logit_scale (the README says so). A
        # script makes one run; here the previous run's ZeRO-3 arguments are forgotten first.
        unset_hf_deepspeed_config()
        model = model_class.from_pretrained(start).train()
        args = trainer_arguments(output_dir, **arguments)
        dataset = PairDataset(make_batch(16))
        trainer = trainer_class(model=model, args=args, train_dataset=dataset)
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
