"""Worker for the FSDP2 GradCache tests: ``torchrun --nproc_per_node 2 tests/helpers/fsdp_workers.py OUT``.

Each rank wraps a tiny model (CLIP, a BERT DualEncoder, a Qwen2-style decoder DualEncoder) with
``fully_shard`` (each encoder or decoder layer, then the root) on CPU over
gloo, and takes one step on its own 8 pairs with the ring loss, in several ways:

* ``uncached``: every chunk embedded with grad in one graph, one backward (the reference; the
  same chunks as the cached step, so that dropout draws the same masks);
* ``cached-per-step``: :func:`cached_step` with ``fsdp_no_sync``: one reduce-scatter per step;
* ``cached-per-replay``: :func:`cached_step` without it: a reduce-scatter after every replay;
* ``...-gather-once``: each of the two inside :func:`fsdp_gather_once`, which must gather each
  unit's parameters once per step (the all-gathers are counted for every cached variant).

Rank 0 writes the full (unsharded) gradients of every variant to OUT. With dropout off it also
writes the gradients of one process without FSDP on the concatenation of both ranks' pairs, which
the sharded steps must equal (the loss's mean over the group, and the logit scale's gradient
averaged over ranks like every other gradient).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_infcl import contrastive_loss  # noqa: E402
from hf_infcl.grad_cache import cached_step, split_batch  # noqa: E402
from hf_infcl.models import model_family  # noqa: E402
from hf_infcl.sharding import fsdp_gather_once, fsdp_no_sync, full_value  # noqa: E402
from tests.helpers.trainer_fixtures import (  # noqa: E402
    clip_batch,
    decoder_text_batch,
    end_worker_process,
    pair_text_batch,
    tiny_clip,
    tiny_decoder_dual_encoder,
    tiny_dual_encoder,
)

ROWS_PER_RANK = 8
CHUNK = 3  # uneven: chunks of 3, 3, 2
# What big models are trained with, on the decoder DualEncoder: bf16 parameters with fp32
# gradient reduction, activation checkpointing of every decoder layer, parameters offloaded to
# the host between uses.
SETTINGS = ("bf16", "checkpointing", "offload")
CACHED_VARIANTS = ("cached-per-step", "cached-per-replay", "cached-per-step-gather-once",
                   "cached-per-replay-gather-once")


def scale_name(kind: str) -> str:
    """The name of the model's learned log-scale: CLIP's logit_scale, DualEncoder's log_logit_scale."""
    return "logit_scale" if kind == "clip" else "log_logit_scale"


def log_scale(model) -> torch.nn.Parameter:
    """The model's learned log-scale parameter, as the model holds it now."""
    return model_family(model).log_scale(model)


def build(kind: str, dropout: float):
    """The model with its logit scale as a 1-element vector: fully_shard refuses 0-d parameters
    (CLIP's exp(logit_scale) broadcasts the same either way)."""
    if kind == "clip":
        model = tiny_clip(dropout=dropout, seed=0)
    elif kind == "decoder":
        model = tiny_decoder_dual_encoder(dropout=dropout, seed=0)
    else:
        model = tiny_dual_encoder(dropout=dropout, seed=0)
    name = scale_name(kind)
    setattr(model, name, torch.nn.Parameter(getattr(model, name).detach().reshape(1)))
    return model


def batch_of(kind: str, rank: int, rows: int = ROWS_PER_RANK):
    if kind == "clip":
        return clip_batch(rows, seed=10 + rank)
    if kind == "decoder":  # left padding, as decoder embedders batch their inputs
        return decoder_text_batch(rows, seed=10 + rank)
    return pair_text_batch(rows, seed=10 + rank)


def encoder(kind: str, model):
    if kind == "clip":
        def encode(chunk):
            out = model(**chunk)
            return out.image_embeds, out.text_embeds
    else:
        # Through forward, not encode_queries/encode_docs: FSDP2 gathers the root's own
        # parameters (embeddings, the scale) only around the root module's forward.
        def encode(chunk):
            out = model(**chunk)
            return out.query_embeds, out.doc_embeds
    return encode


def loss_fn(process_group):
    def loss(queries, keys, log_scale):
        return contrastive_loss(queries, keys, log_scale.reshape(()).exp(), process_group=process_group)
    return loss


def shard(kind: str, model, setting: str | None = None):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {}
    if setting == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif setting == "offload":
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif setting == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if kind == "clip":
        layers = [*model.text_model.encoder.layers, *model.vision_model.encoder.layers]
    else:
        towers = [model.query_encoder] + ([model.doc_encoder] if model.doc_encoder is not None else [])
        layers = [layer for tower in towers
                  for layer in (tower.layers if kind == "decoder" else tower.encoder.layer)]
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def full_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grads[name] = full_value(param.grad).detach().clone()
    return grads


def uncached_step(kind, model, batch, seed):
    """The reference: the same chunks with grad in one graph and one backward. After the root's
    forward FSDP2 holds the root's parameters unsharded, so the loss uses the scale as the module
    holds it then, and FSDP2's own reduce-scatter averages its gradient with the rest."""
    torch.manual_seed(seed)
    encode = encoder(kind, model)
    outputs = [encode(chunk) for chunk in split_batch(batch, CHUNK)]
    queries, keys = (torch.cat(parts) for parts in zip(*outputs))
    assert not hasattr(log_scale(model), "full_tensor"), "expected the unsharded scale after forward"
    loss_fn("auto")(queries, keys, log_scale(model)).backward()


def run_variant(kind, variant, dropout, rank, setting=None):
    model = shard(kind, build(kind, dropout), setting)
    batch = batch_of(kind, rank)
    seed = 100 + rank
    if variant == "uncached":
        uncached_step(kind, model, batch, seed)
        return full_grads(model)
    torch.manual_seed(seed)
    no_sync = (lambda: fsdp_no_sync(model)) if variant.startswith("cached-per-step") else None
    gather = fsdp_gather_once(model) if variant.endswith("gather-once") else contextlib.nullcontext()
    with gather, counting_all_gathers() as all_gathers:
        cached_step(encoder(kind, model), batch, loss_fn("auto"), CHUNK, loss_params=[log_scale(model)],
                    no_sync=no_sync)
    return {**full_grads(model), "all-gathers": torch.tensor(all_gathers[0])}


@contextlib.contextmanager
def counting_all_gathers():
    """Count FSDP2's parameter all-gathers (the collective its default all-gather calls:
    torch.distributed.all_gather_single from torch 2.12, all_gather_into_tensor before)."""
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original = getattr(dist, name)
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)
    setattr(dist, name, counted)
    try:
        yield count
    finally:
        setattr(dist, name, original)


def one_process_reference(kind, world_size):
    """No FSDP, one process, every rank's pairs concatenated, dropout off."""
    model = build(kind, dropout=0.0)
    parts = [batch_of(kind, rank) for rank in range(world_size)]
    batch = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
    encode = encoder(kind, model)
    queries, keys = encode(batch)
    loss_fn(None)(queries, keys, log_scale(model)).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (world_size,))
    results = {}
    for kind in ("clip", "dual-encoder", "decoder"):
        for dropout in (0.1, 0.0):
            for variant in ("uncached", *CACHED_VARIANTS):
                results[(kind, dropout, variant)] = run_variant(kind, variant, dropout, rank)
        if rank == 0:
            results[(kind, 0.0, "one-process")] = one_process_reference(kind, world_size)
    for setting in SETTINGS:
        for variant in ("uncached", *CACHED_VARIANTS):
            grads = run_variant("decoder", variant, 0.1, rank, setting)
            results[(f"decoder-{setting}", 0.1, variant)] = grads
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "grads.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker_process()
