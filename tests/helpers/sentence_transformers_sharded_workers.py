"""Worker for the sharded sentence-transformers tests (``tests/test_sentence_transformers_sharded.py``).

    torchrun --nproc_per_node 2 tests/helpers/sentence_transformers_sharded_workers.py OUT

``SentenceTransformerTrainer`` trains the tiny BERT of ``sentence_transformers_fixtures`` (dropout
on) for two SGD steps on 6 (anchor, positive) pairs per rank and step with ``losses.InfCLLoss``
(the ring: ``gather_across_devices=True``), and ``losses.InfCLGISTLoss`` with a second tiny model
as its guide, each without and with ``mini_batch_size=2`` (three replays per column and rank):

* ``ddp-*``: the Trainer's DDP (the reference);
* ``fsdp-*``: FSDP2 (``fully_shard`` on each ``BertLayer`` and the root), switched on for CPU as
  ``trainer_fsdp_workers.CpuFsdpMixin`` does.

FSDP2's all-gathers and reduce-scatters (one call per unit each) are counted per optimizer step.
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

from hf_infcl.sharding import full_value  # noqa: E402
from tests.helpers.sentence_transformers_fixtures import (  # noqa: E402
    build_tiny_model_dir,
    load_tiny_model,
    text_columns,
)
from tests.helpers.trainer_fixtures import end_worker_process  # noqa: E402
from tests.helpers.trainer_fsdp_workers import CpuFsdpMixin  # noqa: E402

ROWS_PER_RANK = 6
STEPS = 2
MINI_BATCH = 2
FSDP = dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]})
LOSSES = ("mnrl", "gist")
# name -> (engine arguments, loss, mini_batch_size)
RUNS = {f"{engine}-{loss}{'-cached' if cached else ''}": (arguments, loss, MINI_BATCH if cached else None)
        for engine, arguments in (("ddp", {}), ("fsdp", FSDP)) for loss in LOSSES for cached in (False, True)}


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


def trainer_class():
    from sentence_transformers import SentenceTransformerTrainer

    class CpuFsdpSentenceTransformerTrainer(CpuFsdpMixin, SentenceTransformerTrainer):
        """SentenceTransformerTrainer under FSDP2 on CPU."""

    return CpuFsdpSentenceTransformerTrainer


def build_loss(kind: str, model, guide, mini_batch_size):
    from hf_infcl import losses

    if kind == "gist":
        return losses.InfCLGISTLoss(model, guide, mini_batch_size=mini_batch_size, gather_across_devices=True)
    return losses.InfCLLoss(model, mini_batch_size=mini_batch_size, gather_across_devices=True,
                            backend="torch")


def train(name: str, out_dir: Path, model_dir: Path, guide_dir: Path, dataset, counter) -> dict:
    from sentence_transformers import SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    engine_arguments, kind, mini_batch_size = RUNS[name]
    model = load_tiny_model(model_dir)
    guide = load_tiny_model(guide_dir).eval()
    args = SentenceTransformerTrainingArguments(
        output_dir=str(out_dir / name), max_steps=STEPS, per_device_train_batch_size=ROWS_PER_RANK,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, ddp_find_unused_parameters=True, **engine_arguments,
    )
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
    trainer.train()
    units = sum(1 for module in trainer.model.modules() if hasattr(module, "set_reshard_after_backward"))
    parameters = {key: full_value(value).detach().clone() for key, value in trainer.model.named_parameters()}
    return {"parameters": parameters, "steps": steps, "units": units,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}


def main(out_dir: str) -> None:
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
    counter = CollectiveCounter()
    if rank == 0:
        start = {key: value.detach().clone() for key, value in load_tiny_model(model_dir).named_parameters()}
        torch.save(start, out / "start.pt")
    for name in RUNS:
        result = train(name, out, model_dir, guide_dir, dataset, counter)
        if rank == 0:
            torch.save(result, out / f"{name}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
