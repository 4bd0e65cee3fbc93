"""Worker for the DeepSpeed GradCache tests (``tests/test_deepspeed.py``), on CPU over gloo:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/helpers/deepspeed_workers.py OUT

For ZeRO stages 2 and 3 and two models (a tiny CLIP and a Qwen2-style decoder DualEncoder, both
with dropout, the logit scale a 1-element vector), each rank takes two SGD steps (lr 1, so the
parameters move by minus the gradient) on its own 8 pairs per step with the ring loss, twice from
the same start:

* ``uncached``: the chunks embedded with grad through the engine in one graph,
  ``engine.backward(loss)``, ``engine.step()``;
* ``cached``: :func:`cached_step` with ``deepspeed_no_sync`` and the engine's backward, then
  ``engine.step()``.

ZeRO-3 partitions every parameter, the logit scale included (no persistence threshold), which is
kept whole from the forward to the step by ``keep_gathered_under_zero3``. The second step catches
a gradient left over from the first. Rank 0 writes the full parameters at the end to OUT.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_infcl.grad_cache import cached_step, split_batch  # noqa: E402
from hf_infcl.sharding import deepspeed_no_sync, keep_gathered_under_zero3  # noqa: E402
from tests.helpers.fsdp_workers import CHUNK, batch_of, build, encoder, log_scale, loss_fn  # noqa: E402
from tests.helpers.trainer_fixtures import end_worker_process  # noqa: E402

STAGES = (2, 3)
STEPS = 2  # a second step catches gradients left over from the first
KINDS = ("clip", "decoder")


def engine_for(kind: str, stage: int):
    import deepspeed

    model = build(kind, dropout=0.1)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 1.0}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    keep_gathered_under_zero3(engine.module, [log_scale(engine)])  # read after the forward
    return engine


def full_parameters(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=hasattr(parameters[0], "ds_id")):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def steps(kind: str, stage: int, cached: bool, rank: int) -> dict[str, torch.Tensor]:
    engine = engine_for(kind, stage)
    encode = encoder(kind, engine)  # through the engine's forward, which gathers ZeRO-3 shards
    for step in range(STEPS):
        batch = batch_of(kind, rank + 2 * step)
        torch.manual_seed(100 + rank + 2 * step)
        if cached:
            cached_step(encode, batch, loss_fn("auto"), CHUNK, loss_params=[log_scale(engine)],
                        no_sync=lambda: deepspeed_no_sync(engine),
                        backward=lambda total: engine.backward(total, scale_wrt_gas=False))
        else:
            outputs = [encode(chunk) for chunk in split_batch(batch, CHUNK)]
            queries, keys = (torch.cat(parts) for parts in zip(*outputs))
            engine.backward(loss_fn("auto")(queries, keys, log_scale(engine)))
        engine.step()
    return full_parameters(engine)


def main(out_dir: str) -> None:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {}
    for stage in STAGES:
        for kind in KINDS:
            for cached in (False, True):
                results[(stage, kind, "cached" if cached else "uncached")] = steps(kind, stage, cached, rank)
    if rank == 0:
        for kind in KINDS:
            results["start", kind] = {n: p.detach().clone() for n, p in build(kind, 0.1).named_parameters()}
        torch.save(results, os.path.join(out_dir, "parameters.pt"))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
