"""Worker for the sharded sentence-transformers tests (``tests/test_sentence_transformers_sharded.py``).

    torchrun --nproc_per_node 2 tests/helpers/sentence_transformers_sharded_workers.py OUT [fsdp|deepspeed]

``SentenceTransformerTrainer`` trains the tiny BERT of ``sentence_transformers_fixtures`` (dropout
on) for two SGD steps on 6 (anchor, positive) pairs per rank and step with ``losses.InfCLLoss``
(the ring: ``gather_across_devices=True``), ``losses.InfCLGISTLoss`` with a second tiny model
as its guide, and ``losses.InfCLDistillLoss`` with that model as its teacher, each without and
with ``mini_batch_size=2`` (three replays per column and rank), and ``InfCLLoss`` cached again
with two micro-batches of 3 pairs per step (``-accumulate``):

* ``ddp-*``: the Trainer's DDP (the reference);
* ``fsdp-*``: FSDP2 (``fully_shard`` on each ``BertLayer`` and the root), switched on for CPU as
  ``trainer_fsdp_workers.CpuFsdpMixin`` does;
* with ``deepspeed``, ``zero2-*`` and ``zero3-*`` instead (DeepSpeed's CPU accelerator,
  ``DS_ACCELERATOR=cpu``), ``InfCLLoss`` cached with accumulation too.

On CUDA (``cuda`` in the test) the Trainer's own FSDP2 runs, the losses in exact fp32.

FSDP2's all-gathers and reduce-scatters (one call per unit each) are counted per optimizer step,
and in a step after a cached forward whose backward never ran (``abandoned_forward``); under
DeepSpeed, the elements that ZeRO's reductions (``torch.distributed`` all-reduces and
reduce-scatters) carry per optimizer step.
Rank 0 writes the starting parameters, and each run's full parameters, logged losses, counts and
number of FSDP2 units, to OUT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.sentence_transformers_fixtures import (  # noqa: E402
    build_tiny_model_dir,
    load_tiny_model,
    text_columns,
)
from tests.helpers.trainer_fixtures import end_worker_process  # noqa: E402
from tests.helpers.trainer_fsdp_workers import CpuFsdpMixin, full_parameters  # noqa: E402

ROWS_PER_RANK = 6
STEPS = 2
MINI_BATCH = 2
FSDP = dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]})
LOSSES = ("mnrl", "gist", "distill")


def zero(stage: int) -> dict:
    """The Trainer's ``deepspeed`` argument for ZeRO ``stage`` (nothing persists under ZeRO-3)."""
    return {"deepspeed": {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}}


ENGINES = {"fsdp": {"fsdp": FSDP}, "deepspeed": {"zero2": zero(2), "zero3": zero(3)}}


# two micro-batches of half the rows per optimizer step
ACCUMULATE = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": ROWS_PER_RANK // 2}


def runs(engine: str) -> dict[str, tuple[dict, str, int | None]]:
    """name -> (the Trainer's arguments, loss, mini_batch_size) of DDP's runs, then ``engine``'s
    (after a DeepSpeed run Accelerate's state keeps its plugin, so DDP goes first)."""
    named = {}
    for name, arguments in {"ddp": {}, **ENGINES[engine]}.items():
        named.update({f"{name}-{loss}{'-cached' if cached else ''}":
                      (arguments, loss, MINI_BATCH if cached else None)
                      for loss in LOSSES for cached in (False, True)})
        # several cached micro-batches per optimizer step
        named[f"{name}-mnrl-cached-accumulate"] = ({**arguments, **ACCUMULATE}, "mnrl", MINI_BATCH)
    return named


class CollectiveCounter:
    """Counts FSDP2's per-unit all-gathers and reduce-scatters (patched where FSDP2 calls them)."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        for key, name in (("all_gather", "foreach_all_gather"), ("reduce_scatter", "foreach_reduce")):
            original = getattr(_fsdp_param_group, name)

            def counted(*args, _original=original, _key=key, **kwargs):
                self.counts[_key] += 1
                return _original(*args, **kwargs)
            setattr(_fsdp_param_group, name, counted)

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, {key: 0 for key in self.counts}
        return counts


class ReductionCounter:
    """Counts the elements that gradient reductions (``torch.distributed`` all-reduces and
    reduce-scatters of more than one element, where DeepSpeed's communication calls them) carry;
    gathers, broadcasts and the ring's point-to-point transfers are not counted."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_reduce_coalesced", "reduce")

    def __init__(self):
        self.counts = {"reduced": 0}
        for name in self.NAMES:
            original = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
                lists = [value for value in (*args, *kwargs.values()) if isinstance(value, list)]
                # the input, the largest tensor (a reduce-scatter's output is a part of it)
                reduced = (max(tensor.numel() for tensor in tensors) if tensors
                           else sum(tensor.numel() for tensor in lists[-1]))
                if reduced > 1:  # not the one-element checks (ZeRO's overflow test, the logged loss)
                    self.counts["reduced"] += reduced
                return _original(*args, **kwargs)
            setattr(dist, name, counted)

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, {"reduced": 0}
        return counts


def trainer_class():
    from sentence_transformers import SentenceTransformerTrainer

    if torch.cuda.is_available():  # the Trainer's own FSDP2
        return SentenceTransformerTrainer

    class CpuFsdpSentenceTransformerTrainer(CpuFsdpMixin, SentenceTransformerTrainer):
        """SentenceTransformerTrainer under FSDP2 on CPU."""

    return CpuFsdpSentenceTransformerTrainer


def build_loss(kind: str, model, guide, mini_batch_size):
    from hf_infcl import losses

    # On CUDA in exact fp32, so that the engines agree to rounding: in TF32 a rounding difference of
    # the first step (the engines clip and reduce in different orders) flips guide decisions.
    numerics = {"backend": "auto", "precision": "ieee"} if torch.cuda.is_available() else {"backend": "torch"}
    if kind == "gist":
        return losses.InfCLGISTLoss(model, guide, mini_batch_size=mini_batch_size, gather_across_devices=True,
                                    **numerics)
    if kind == "distill":  # the guide as a frozen teacher; each process distils over its own batch
        return losses.InfCLDistillLoss(model, teacher=guide, mini_batch_size=mini_batch_size,
                                       distillation_weight=0.5, **numerics)
    return losses.InfCLLoss(model, mini_batch_size=mini_batch_size, gather_across_devices=True, **numerics)


def train(name: str, run, out_dir: Path, model_dir: Path, guide_dir: Path, dataset, counter) -> dict:
    from sentence_transformers import SentenceTransformerTrainingArguments
    from transformers import TrainerCallback
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    arguments, kind, mini_batch_size = run
    # the previous run's ZeRO-3 arguments would make loading partition the model (zero.Init)
    unset_hf_deepspeed_config()
    model = load_tiny_model(model_dir)
    guide = load_tiny_model(guide_dir).eval()
    on_gpu = torch.cuda.is_available()
    if on_gpu:  # where the features are; FSDP2 moves the model only when it is prepared
        guide.to(torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    settings = dict(
        output_dir=str(out_dir / name), max_steps=STEPS, per_device_train_batch_size=ROWS_PER_RANK,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, use_cpu=not on_gpu,
        report_to="none", save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, ddp_find_unused_parameters=True,
    )
    args = SentenceTransformerTrainingArguments(**{**settings, **arguments})
    steps = []

    class CountPerStep(TrainerCallback):
        def on_step_begin(self, *unused, **also_unused):
            counter.take()

        def on_step_end(self, *unused, **also_unused):
            steps.append(counter.take())

    loss = build_loss(kind, model, guide, mini_batch_size)
    trainer = trainer_class()(model=model, args=args, train_dataset=dataset, loss=loss,
                              callbacks=[CountPerStep()])
    assert trainer.is_fsdp_enabled == name.startswith("fsdp"), name
    assert trainer.is_deepspeed_enabled == name.startswith("zero"), name
    trainer.train()
    units = sum(1 for module in trainer.model.modules() if hasattr(module, "set_reshard_after_backward"))
    parameters = full_parameters(trainer)
    return {"parameters": parameters, "steps": steps, "units": units,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}


def abandoned_forward(model_dir: Path, counter) -> dict:
    """A cached forward under FSDP2 whose backward never runs (an exception between them, or a
    forward for logging), then a whole step: that step must still reduce-scatter once per unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_infcl import losses
    from tests.helpers.sentence_transformers_fixtures import features

    model = load_tiny_model(model_dir)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model[0].auto_model.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss = losses.InfCLLoss(model, mini_batch_size=MINI_BATCH, backend="torch")
    batch = features(model, text_columns(ROWS_PER_RANK, 2, seed=10 + dist.get_rank()))
    loss([dict(column) for column in batch], None)  # no backward
    counter.take()
    loss([dict(column) for column in batch], None).backward()
    return counter.take()


def main(out_dir: str, engine: str = "fsdp") -> None:
    from datasets import Dataset

    torch.set_num_threads(1)
    out = Path(out_dir)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    # each rank writes its own copy of the same seeded models, so that no rank waits on another
    model_dir = build_tiny_model_dir(out / f"model-rank{rank}", seed=0)
    guide_dir = build_tiny_model_dir(out / f"guide-rank{rank}", seed=1)
    anchors, positives = text_columns(ROWS_PER_RANK * world_size * STEPS, 2, seed=3)
    dataset = Dataset.from_dict({"anchor": anchors, "positive": positives})
    counter = ReductionCounter() if engine == "deepspeed" else CollectiveCounter()
    if engine == "deepspeed":
        # On CPU, TrainingArguments leaves DeepSpeed's own communication uninitialised.
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if rank == 0:
        start = {key: value.detach().clone() for key, value in load_tiny_model(model_dir).named_parameters()}
        torch.save(start, out / "start.pt")
    for name, run in runs(engine).items():
        result = train(name, run, out, model_dir, guide_dir, dataset, counter)
        if rank == 0:
            torch.save(result, out / f"{name}.pt")
        dist.barrier()
    if engine == "fsdp" and not torch.cuda.is_available():
        counts = abandoned_forward(model_dir, counter)
        if rank == 0:
            torch.save(counts, out / "abandoned_forward.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_worker_process()
