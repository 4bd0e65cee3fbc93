"""Gradient caching (GradCache): encoders see a large contrastive batch in chunks.

A contrastive loss couples every row of the batch, so the encoders' activations for the whole
batch would normally have to live until the loss is known. Gradient caching (Gao et al., 2021)
splits one optimisation step into three phases:

1. embed every chunk *without* grad, recording the RNG state before each chunk;
2. compute the loss on the full (detached) embeddings and its gradient with respect to them;
3. replay each chunk's forward *with* grad under its recorded RNG state, so dropout draws the
   same masks, and backpropagate the cached embedding gradient through it.

Where the chunks run eagerly, the last chunk is embedded with grad in phase 1 and backpropagated
right after phase 2, its activations kept in between, so it is not replayed: one chunk's forward
less per step.

The parameter gradients are exactly those of the full-batch step; peak activation memory is
that of one chunk. This module knows nothing of the Trainer: it takes encoder callables, the
batch and a loss callable, so it serves the Trainer, an Accelerate loop and plain PyTorch.

Example: one training step of a tiny CLIP under Accelerate (one process, or several with
``accelerate launch``), chunks of 16 pairs of a batch of 64::

    import torch
    from accelerate import Accelerator
    from transformers import CLIPConfig, CLIPModel

    from hf_infcl import contrastive_loss
    from hf_infcl.grad_cache import cached_step

    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(text_config=dict(tower, vocab_size=100, bos_token_id=1, eos_token_id=2),
                        vision_config=dict(tower, image_size=32, patch_size=8), projection_dim=16)
    accelerator = Accelerator()
    model = CLIPModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = {"pixel_values": torch.randn(64, 3, 32, 32), "input_ids": torch.randint(3, 100, (64, 12)),
             "attention_mask": torch.ones(64, 12, dtype=torch.long)}

    def encode(chunk):                      # one chunk of the batch -> per-row embeddings of each tower
        out = model(**chunk)
        return out.image_embeds, out.text_embeds

    def loss_fn(image_embeds, text_embeds, log_scale):
        return contrastive_loss(image_embeds, text_embeds, log_scale.exp(), process_group="auto")

    optimizer.zero_grad()
    result = cached_step(
        encode, batch, loss_fn, chunk_size=16,
        loss_params=[accelerator.unwrap_model(model).logit_scale],  # what the loss uses directly
        offload=True, device=accelerator.device,     # the batch stays on the host, one chunk moves
        no_sync=lambda: accelerator.no_sync(model),  # or model.no_sync for a bare DDP module
        scale_loss=accelerator.scaler.scale if accelerator.scaler else None,  # fp16 loss scaling
    )
    optimizer.step()                        # the parameters' .grad held those of the full batch
    print(result.loss, result.embeddings[0].shape)

Rules that make the gradients exact and DDP efficient:

- The parameters the loss uses directly (a learned logit scale or bias) are passed as
  ``loss_params``, never closed over: their gradient is taken in phase 2 and backpropagated in
  the last replay, so DDP sees it in the one synchronised backward.
- ``no_sync`` (a context-manager factory) wraps every replay but the last, so DDP all-reduces
  once per step. With one DDP module over both towers, encode both towers in one callable
  (rows of both towers are chunked together), or build DDP with ``find_unused_parameters=True``.
- ``scale_loss`` (e.g. ``GradScaler.scale``) scales the loss before the embedding gradients
  are taken, so fp16 gradients in the replays carry the scaler's factor like any backward.
- Autocast: call the encoders inside autocast in your callables, or give ``forward_context``;
  phase 1 and the replays run the same callable, so they agree.
- Layers that normalise with batch statistics (BatchNorm in training mode) would see each chunk
  alone, twice: an encoder that is an ``nn.Module`` holding one is refused; for a plain callable,
  call ``hf_infcl.batch_statistics.check_no_batch_statistics`` on the model it runs.

FSDP2 (``torch.distributed.fsdp.fully_shard``): call the sharded module's ``forward`` in the
encoder callables (FSDP2 gathers the root's own parameters only around it), and pass the loss
parameters as read before the step (sharded DTensors): the loss sees their full value, and their
gradient, averaged over ranks like FSDP2's own, is added to the sharded ``.grad`` after the last
replay. ``fully_shard`` refuses 0-d parameters, so a scalar logit scale is reshaped to ``[1]``
first. Two ways to reduce the encoders' gradients, both exact (the adapters named here are in
:mod:`hf_infcl.sharding`):

- ``no_sync=lambda: fsdp_no_sync(model)``: the replays accumulate unsharded gradients and the
  last one reduce-scatters them: one reduction per step, unsharded gradient memory;
- ``no_sync=None``: every replay's backward reduce-scatters into the sharded gradients: sharded
  gradient memory, one reduce-scatter per chunk.

FSDP2 gathers a unit's parameters for every chunk's forward and again for its backward; inside
``with fsdp_gather_once(model):`` it gathers them once per step, for the memory of the unsharded
parameters.

DeepSpeed ZeRO (stages 1-3): call the engine in the encoder callables, pass
``no_sync=lambda: deepspeed_no_sync(engine)`` (:mod:`hf_infcl.sharding`; the replays accumulate;
the last one is at the engine's accumulation boundary and reduces) and ``backward=lambda t:
engine.backward(t, scale_wrt_gas=False)`` (the engine's own loss scaling), then
``engine.step()``. Under ZeRO-3 the
loss parameters are read outside the model's forward, so register them once after
``deepspeed.initialize``: ``hf_infcl.sharding.keep_gathered_under_zero3(engine.module, [scale])``
(``deepspeed.zero.register_external_parameter``); the loss sees their gathered value.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .batch_statistics import check_no_batch_statistics
from .chunk_graphs import ChunkGraphs
from .ops.options import check_bool, check_chunk_size, check_graphs_chunking
from .rng import RngState
from .sharding import accumulate_sharded_grad, full_value, is_dtensor, is_zero3_parameter

__all__ = ["CachedStepOutput", "cached_step", "split_batch", "to_device"]


@dataclass
class CachedStepOutput:
    """What :func:`cached_step` returns (everything detached, for logging and metrics).

    Attributes:
        loss: the unscaled loss (a detached scalar tensor).
        embeddings: every encoder output over the whole batch, in the order ``loss_fn``
            received them (tower 0's outputs first), detached.
    """

    loss: torch.Tensor
    embeddings: tuple[torch.Tensor, ...]


def cached_step(
    encoders: Callable | Sequence[Callable],
    inputs: Mapping | Sequence[Mapping],
    loss_fn: Callable[..., torch.Tensor],
    chunk_size: int | None,
    *,
    loss_params: Sequence[torch.Tensor] = (),
    offload: bool = False,
    device: torch.device | str | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    no_grad_chunk_size: int | None = None,
    backward: Callable[[torch.Tensor], object] | None = None,
    chunk_graphs: ChunkGraphs | None = None,
    keep_last_chunk: bool = True,
) -> CachedStepOutput:
    """Run one gradient-cached forward/backward; parameter ``.grad`` accumulate as for the full batch.

    Args:
        encoders: one callable per tower, or one callable for all. Each takes a chunk of its
            tower's inputs (a dict of tensors sliced along dim 0, on ``device``) and returns a
            tensor ``[rows, ...]`` or a tuple of them (e.g. image and text embeddings).
        inputs: a dict of tensors per tower (a single dict for a single callable). Tensors with
            a batch dimension are chunked along dim 0; 0-d tensors and non-tensors are passed
            to every chunk unchanged.
        loss_fn: ``loss_fn(*embeddings, *loss_params) -> scalar loss`` over the whole batch, the
            embeddings concatenated over chunks in tower order.
        chunk_size: rows per chunk; ``None`` or a size >= the batch runs one chunk.
        loss_params: tensors ``loss_fn`` uses directly that need gradients (a learned logit
            scale/bias). Their gradient is backpropagated in the last replay.
        offload: keep the batch in (pinned, when CUDA is available) host memory and move one
            chunk at a time to ``device``.
        device: where the encoders run. ``None`` leaves every tensor where it is.
        no_sync: a factory of a context manager (``ddp_model.no_sync``,
            ``lambda: accelerator.no_sync(model)``) entered around every replay but the last.
            A sequence of factories, one per encoder, syncs the last replay of each encoder.
        scale_loss: applied to the loss before its gradients are taken (``GradScaler.scale``).
        forward_context: a factory of a context manager entered around every encoder call
            (e.g. ``lambda: torch.autocast("cuda", torch.bfloat16)``).
        no_grad_chunk_size: rows per chunk of the first, no-grad pass (default: ``chunk_size``).
            That pass keeps no activations, so larger chunks fit and run faster. The replays
            then cannot draw the same random numbers as the first pass: set it only for encoders
            that draw none in training (no dropout, no stochastic depth), where the gradients stay
            exact up to the rounding of different GEMM shapes.
        backward: how each replay's scalar is backpropagated; default ``tensor.backward()``. A
            DeepSpeed engine needs its own: ``lambda t: engine.backward(t, scale_wrt_gas=False)``
            (the loss is scaled by ``scale_loss`` already), with ``no_sync=lambda:
            hf_infcl.sharding.deepspeed_no_sync(engine)`` and ``engine.step()`` after the cached step.
        chunk_graphs: a :class:`hf_infcl.chunk_graphs.ChunkGraphs` kept across steps: the no-grad
            pass and the replays run as CUDA graphs, one per chunk shape, which
            removes the launch overhead that makes small chunks slow. No ``no_sync`` and no
            ``backward`` hook (a graph skips DDP's, FSDP's and DeepSpeed's gradient hooks): under
            DDP, call the encoders outside DDP's forward and
            :func:`hf_infcl.chunk_graphs.average_gradients` after the step. The two passes must
            chunk alike.
        keep_last_chunk: embed the last chunk (of the last encoder) with grad in the first pass and
            backpropagate it right after the loss, instead of replaying it: one chunk's forward
            less per step, for holding that chunk's activations while the loss runs. It applies
            where the two passes chunk alike, without a ``backward`` hook and without
            ``chunk_graphs``, and where that encoder has more than one chunk. ``False`` replays
            every chunk.

    Returns:
        :class:`CachedStepOutput` with the detached loss and embeddings.

    Raises:
        ValueError: an encoder that is an ``nn.Module`` normalises with batch statistics (BatchNorm
            in training mode: each chunk alone, twice); plain callables: see the module docstring.
    """
    towers = _towers(encoders, inputs, no_sync, forward_context, chunk_size, no_grad_chunk_size)
    check_bool("keep_last_chunk", keep_last_chunk)
    loss_params = _checked_loss_params(loss_params)
    device = torch.device(device) if device is not None else None
    if chunk_graphs is not None:
        _check_graphable(chunk_graphs, no_sync, backward, no_grad_chunk_size, chunk_size)
    for tower in towers:
        if isinstance(tower.encode, torch.nn.Module):  # plain callables are the caller's to check
            check_no_batch_statistics(tower.encode, "chunk_size=None")
    # The replays restore each first-pass chunk's RNG state only when the two passes chunk alike.
    replay_rng = no_grad_chunk_size is None or no_grad_chunk_size == chunk_size
    for tower in towers:
        tower.split(chunk_size, None if replay_rng else no_grad_chunk_size, offload, device)
    feed = functools.partial(_on_device, device=device, offload=offload)
    # The kept chunk's backward runs before every replay: never the step's (or, with no_sync per
    # encoder, its encoder's) last, which reduces under DDP; a backward hook (DeepSpeed) keeps its
    # own order. Chunk graphs replay every chunk: a kept chunk needs its forward and its backward
    # as two graphs, which are not built.
    last_site = len(towers) - 1
    keeps = (keep_last_chunk and replay_rng and backward is None and chunk_graphs is None
             and len(towers[-1].chunks) > 1)

    for site, tower in enumerate(towers):
        _embed_first_pass(tower, site, feed, chunk_graphs, keep_last=keeps and site == last_site)
    loss, embeddings, param_grads = _loss_and_embedding_grads(towers, loss_fn, loss_params, scale_loss)
    if keeps:
        _backpropagate_kept(towers[-1])
    _replay(towers, param_grads, feed, replay_rng, backward, chunk_graphs)
    return CachedStepOutput(loss=loss.detach(), embeddings=tuple(e.detach() for e in embeddings))


@dataclass
class _Tower:
    """One encoder of a cached step: its chunks, and what each phase leaves for the next."""

    encode: Callable
    inputs: Mapping
    embed: Callable  # ``encode`` inside the step's forward_context
    no_sync: Callable[[], contextlib.AbstractContextManager] | None  # entered around its unsynced replays
    syncs_last_replay: bool  # whether its last replay runs outside ``no_sync``
    chunks: list[dict] = field(default_factory=list)  # the replays'
    first_pass_chunks: list[dict] = field(default_factory=list)  # the no-grad pass's
    rng_states: list[RngState] = field(default_factory=list)  # phase 1, per first-pass chunk
    outputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # phase 1, per first-pass chunk
    grads: tuple[torch.Tensor | None, ...] = ()  # phase 2: the loss's gradient per output, whole batch
    kept: _KeptChunk | None = None  # phase 1's last chunk, embedded with grad (so not replayed)

    def split(self, chunk_size, no_grad_chunk_size, offload: bool, device) -> None:
        """The batch in (pinned host or device) memory, cut into the chunks of both passes
        (``no_grad_chunk_size`` None: the no-grad pass chunks as the replays)."""
        if offload:
            self.inputs = _pin(self.inputs)
        elif device is not None:
            self.inputs = to_device(self.inputs, device)
        self.chunks = split_batch(self.inputs, chunk_size)
        self.first_pass_chunks = (self.chunks if no_grad_chunk_size is None
                                  else split_batch(self.inputs, no_grad_chunk_size))


def _towers(encoders, inputs, no_sync, forward_context, chunk_size, no_grad_chunk_size) -> list[_Tower]:
    """One :class:`_Tower` per encoder, after the checks of the towers, chunk sizes and ``no_sync``."""
    encoder_list, input_list = _normalise_towers(encoders, inputs)
    check_chunk_size("chunk_size", chunk_size)
    check_chunk_size("no_grad_chunk_size", no_grad_chunk_size)
    factories = _normalise_no_sync(no_sync, len(encoder_list))
    # One factory: a single synchronised replay (the very last). One per encoder: each
    # encoder's last replay synchronises its own DDP module.
    sync_each_tower = no_sync is not None and not callable(no_sync)
    enter = forward_context or contextlib.nullcontext
    last = len(encoder_list) - 1
    return [_Tower(encode, tower_inputs, _in_context(encode, enter), factory, sync_each_tower or site == last)
            for site, (encode, tower_inputs, factory) in enumerate(zip(encoder_list, input_list, factories))]


def _checked_loss_params(loss_params) -> list[torch.Tensor]:
    loss_params = list(loss_params)
    for param in loss_params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"loss_params must hold tensors, got {type(param).__name__}")
        if is_zero3_parameter(param) and not getattr(param, "is_external_param", False):
            raise ValueError(
                "a loss parameter is partitioned by DeepSpeed ZeRO-3 and read outside the model's forward, "
                "where ZeRO-3 frees it: after deepspeed.initialize, call "
                "hf_infcl.sharding.keep_gathered_under_zero3(engine.module, loss_params) "
                "(deepspeed.zero.register_external_parameter)"
            )
    return loss_params


def _embed_first_pass(tower: _Tower, site: int, feed, chunk_graphs: ChunkGraphs | None,
                      keep_last: bool) -> None:
    """Phase 1: embed every chunk without grad, remembering the RNG state each chunk started from;
    ``keep_last``: the last chunk with grad, kept for its backward (:class:`_KeptChunk`)."""
    last = len(tower.first_pass_chunks) - 1
    for index, chunk in enumerate(feed(tower.first_pass_chunks)):
        tower.rng_states.append(RngState.capture(*chunk.values()))
        if keep_last and index == last:
            tower.kept = _KeptChunk.embed(tower, chunk)
            tower.outputs.append(tower.kept.outputs)
            continue
        with torch.no_grad():
            tower.outputs.append(_as_tuple(tower.embed(chunk)) if chunk_graphs is None
                                 else chunk_graphs.run(("embed", site), tower.embed, chunk))


@dataclass
class _KeptChunk:
    """A tower's last chunk, embedded with grad in phase 1. Its backward runs right after the loss,
    before any replay, so it is never a synchronised one: its forward and backward both run inside
    the tower's ``no_sync``."""

    live: tuple[torch.Tensor, ...]  # the encoder's outputs, their autograd graph kept
    outputs: tuple[torch.Tensor, ...]  # the same, detached, for the loss

    @classmethod
    def embed(cls, tower: _Tower, chunk: dict) -> _KeptChunk:
        with _unsynced(tower):
            live = _as_tuple(tower.embed(chunk))
        return cls(live, tuple(output.detach() for output in live))


def _unsynced(tower: _Tower) -> contextlib.AbstractContextManager:
    return tower.no_sync() if tower.no_sync is not None else contextlib.nullcontext()


def _backpropagate_kept(tower: _Tower) -> None:
    """The kept chunk's share of the loss, backpropagated through the graph its forward kept."""
    kept = tower.kept
    starts = [grad.shape[0] - output.shape[0] if grad is not None else 0
              for output, grad in zip(kept.outputs, tower.grads)]
    with _unsynced(tower):
        _backpropagate(kept.live, _grad_slices(kept.outputs, tower.grads, starts))


@dataclass
class _LossParamGrads:
    """The loss parameters' gradients, as (parameter, gradient) pairs, by how each reaches ``.grad``.

    Plain parameters get theirs through the last replay's backward, so DDP reduces it with the
    rest; sharded ones (FSDP2 DTensors) are reduced after that backward (FSDP2 never sees them).
    ZeRO-3 parameters get it through the first replay's: ZeRO-3 overwrites its gradient
    partitions in a step's first backward and adds in the later ones, so a gradient that first
    arrived in a later backward would be added to the previous step's.
    """

    plain: list[tuple[torch.Tensor, torch.Tensor]]
    sharded: list[tuple[torch.Tensor, torch.Tensor]]
    zero3: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def route(cls, with_grads) -> _LossParamGrads:
        kinds = [("sharded" if is_dtensor(param) else "zero3" if is_zero3_parameter(param) else "plain")
                 for param, _ in with_grads]
        return cls(*([pair for pair, kind in zip(with_grads, kinds) if kind == wanted]
                     for wanted in ("plain", "sharded", "zero3")))


def _loss_and_embedding_grads(towers: list[_Tower], loss_fn, loss_params, scale_loss):
    """Phase 2: the loss on the whole batch's detached embeddings, its gradient w.r.t. them (each
    tower's ``grads``) and w.r.t. the loss parameters. Returns (loss, embeddings, loss parameters'
    gradients as :class:`_LossParamGrads`)."""
    # A loss parameter sharded by FSDP2 (or partitioned by ZeRO-3) enters the loss as its full value.
    values = [_loss_value(param) for param in loss_params]
    per_tower = [_joined(tower.outputs) for tower in towers]
    embeddings = [embedding for tower_embeddings in per_tower for embedding in tower_embeddings]
    loss = loss_fn(*embeddings, *values)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn must return a scalar tensor")
    scaled = scale_loss(loss) if scale_loss is not None else loss
    # Only loss_params that require grad are differentiated (a fixed scale may be passed too).
    learned = [(param, value) for param, value in zip(loss_params, values) if param.requires_grad]
    grads = torch.autograd.grad(scaled, [*embeddings, *(value for _, value in learned)], allow_unused=True)
    start = 0
    for tower, tower_embeddings in zip(towers, per_tower):
        tower.grads = grads[start: start + len(tower_embeddings)]
        start += len(tower_embeddings)
    param_grads = [(param, grad) for (param, _), grad in zip(learned, grads[start:]) if grad is not None]
    return loss, embeddings, _LossParamGrads.route(param_grads)


def _loss_value(param: torch.Tensor) -> torch.Tensor:
    """The value the loss sees: the parameter itself, or for a sharded or partitioned one its full
    value (:func:`hf_infcl.sharding.full_value`) as a plain leaf. A ZeRO-3 parameter's gradient
    reaches DeepSpeed through the first replay, where the engine's forward has gathered it and,
    kept gathered by keep_gathered_under_zero3, it stays whole."""
    value = full_value(param)
    return param if value is param else value.detach().requires_grad_(param.requires_grad)


def _joined(outputs: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Each output of an encoder concatenated over its chunks, detached, as a leaf that requires grad."""
    widths = {len(out) for out in outputs}
    if len(widths) != 1:
        raise ValueError("an encoder returned a different number of outputs for different chunks")
    return tuple(torch.cat([out[position] for out in outputs]).detach().requires_grad_()
                 for position in range(widths.pop()))


def _replay(towers: list[_Tower], param_grads: _LossParamGrads, feed, replay_rng: bool, backward,
            chunk_graphs: ChunkGraphs | None) -> None:
    """Phase 3: replay each chunk with grad under its recorded RNG state and backpropagate its
    cached gradient; the loss parameters' gradients ride on the first replay (ZeRO-3) or the last
    (plain), or are added after the replays (sharded; with ``chunk_graphs``, plain too)."""
    for site, tower in enumerate(towers):
        row_starts = [0] * len(tower.grads)
        replayed_chunks = tower.chunks[:-1] if tower.kept is not None else tower.chunks
        last = len(replayed_chunks) - 1
        for index, chunk in enumerate(feed(replayed_chunks)):
            rng = tower.rng_states[index].restored() if replay_rng else contextlib.nullcontext()
            if chunk_graphs is not None:
                # the rows of each output are those the no-grad pass produced for this chunk
                grad_slices = _grad_slices(tower.outputs[index], tower.grads, row_starts)
                with rng:
                    chunk_graphs.run(("replay", site), functools.partial(_graphed_replay, tower.embed),
                                     chunk, grad_slices)
                continue
            last_overall = index == last and site == len(towers) - 1
            synced = index == last and tower.syncs_last_replay
            riding = ((param_grads.plain if last_overall else [])
                      + (param_grads.zero3 if site == index == 0 else []))
            with (_unsynced(tower) if not synced else contextlib.nullcontext()):
                with rng:
                    replayed = _as_tuple(tower.embed(chunk))
                _backpropagate(replayed, _grad_slices(replayed, tower.grads, row_starts), riding, backward)
    if chunk_graphs is not None:
        # one process (no reduction to ride on): the loss parameters' gradient is added directly,
        # so that every replay, the last included, can be a graph
        for param, grad in param_grads.plain:
            grad = grad.to(param.dtype)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad
    for param, grad in param_grads.sharded:
        accumulate_sharded_grad(param, grad)


def split_batch(inputs: Mapping, chunk_size: int | None) -> list[dict]:
    """Split a dict of tensors along dim 0 into chunks of ``chunk_size`` rows (views, no copy).

    0-d tensors and non-tensor values are repeated in every chunk. Every tensor with a batch
    dimension must have the same number of rows.
    """
    sizes = {v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim > 0}
    if not sizes:
        raise ValueError("inputs must contain at least one tensor with a batch dimension")
    if len(sizes) > 1:
        raise ValueError(f"the tensors in one tower's inputs disagree on the batch size: {sorted(sizes)}")
    batch = sizes.pop()
    if batch == 0:
        raise ValueError("inputs have an empty batch")
    step = batch if chunk_size is None else min(chunk_size, batch)
    return [
        {key: (v[start: start + step] if isinstance(v, torch.Tensor) and v.ndim > 0 else v)
         for key, v in inputs.items()}
        for start in range(0, batch, step)
    ]


def to_device(inputs: Mapping, device: torch.device | str, non_blocking: bool = False) -> dict:
    """Move the tensors of a dict to ``device`` (other values unchanged)."""
    return {
        key: (v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v)
        for key, v in inputs.items()
    }


def _on_device(chunks: list[dict], device: torch.device | None, offload: bool):
    """Yield the chunks on ``device``. Offloaded chunks bound for a GPU are copied on a side stream
    one chunk ahead, so the copy of chunk i+1 overlaps the compute of chunk i (two chunks on the
    device at most)."""
    if device is None:
        yield from chunks
        return
    if not (offload and device.type == "cuda" and chunks):
        for chunk in chunks:
            yield to_device(chunk, device, non_blocking=offload)
        return
    compute_stream = torch.cuda.current_stream(device)
    copy_stream = torch.cuda.Stream(device)

    def start_copy(chunk):
        # the copy must not overwrite memory the compute stream may still read
        copy_stream.wait_stream(compute_stream)
        with torch.cuda.stream(copy_stream):
            return to_device(chunk, device, non_blocking=True)

    pending = start_copy(chunks[0])
    for index in range(len(chunks)):
        current = pending
        compute_stream.wait_stream(copy_stream)
        for value in current.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                # memory allocated on the copy stream, used on the compute stream: keep the
                # allocator from handing it out again before the compute stream is done with it
                value.record_stream(compute_stream)
        pending = start_copy(chunks[index + 1]) if index + 1 < len(chunks) else None
        yield current


def _pin(inputs: Mapping) -> dict:
    """The batch on the host, pinned when CUDA can use it, so chunk copies can overlap compute."""
    pin = torch.cuda.is_available()
    moved = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            value = value.cpu()
            if pin and not value.is_pinned():
                value = value.pin_memory()
        moved[key] = value
    return moved


def _normalise_towers(encoders, inputs):
    if callable(encoders):
        if not isinstance(inputs, Mapping):
            raise TypeError("with one encoder callable, inputs must be one dict of tensors")
        return [encoders], [inputs]
    encoder_list = list(encoders)
    if not encoder_list or not all(callable(e) for e in encoder_list):
        raise TypeError("encoders must be a callable or a non-empty sequence of callables")
    if isinstance(inputs, Mapping):
        raise TypeError("with several encoders, inputs must be a sequence of dicts, one per encoder")
    input_list = list(inputs)
    if len(input_list) != len(encoder_list):
        raise ValueError(f"{len(encoder_list)} encoders but {len(input_list)} input dicts")
    for tower_inputs in input_list:
        if not isinstance(tower_inputs, Mapping):
            raise TypeError(f"inputs must be dicts of tensors, got {type(tower_inputs).__name__}")
    return encoder_list, input_list


def _normalise_no_sync(no_sync, n_towers):
    if no_sync is None or callable(no_sync):
        return [no_sync] * n_towers
    factories = list(no_sync)
    if len(factories) != n_towers:
        raise ValueError(f"no_sync has {len(factories)} factories for {n_towers} encoders")
    return factories


def _in_context(encode, enter):
    """The encoder called inside ``forward_context``."""
    def call(chunk):
        with enter():
            return encode(chunk)
    return call


def _grad_slices(outputs, tower_grads, row_starts: list[int]) -> list[torch.Tensor | None]:
    """The cached gradient rows of one chunk's outputs, in order; advances ``row_starts``."""
    slices = []
    for position, output in enumerate(outputs):
        start, rows = row_starts[position], output.shape[0]
        row_starts[position] += rows
        grad = tower_grads[position]
        slices.append(None if grad is None else grad[start: start + rows])
    return slices


def _surrogate_terms(outputs, grad_slices) -> list[torch.Tensor]:
    """sum(output * cached gradient) per output: its backward is the output's share of the loss's."""
    terms = []
    for output, grad in zip(outputs, grad_slices):
        if grad is None or not output.requires_grad:
            continue
        if output.shape[0] != grad.shape[0]:
            raise ValueError(f"a replayed chunk gave {output.shape[0]} rows where the no-grad pass gave "
                             f"{grad.shape[0]}: the encoder must be deterministic in its shapes")
        terms.append((output * grad.to(output.dtype)).sum())
    return terms


def _backpropagate(replayed, grad_slices, riding=(), backward=None) -> None:
    """The backward of a replayed chunk's share of the loss: its outputs' cached gradients, and
    the ``riding`` loss parameters' (``param * grad``), in one backward (``backward`` or
    ``Tensor.backward``)."""
    terms = _surrogate_terms(replayed, grad_slices)
    terms.extend((param * grad.to(param.dtype)).sum() for param, grad in riding)
    if terms:
        total = torch.stack([term.float() for term in terms]).sum()
        if backward is None:
            total.backward()
        else:
            backward(total)


def _graphed_replay(embed, chunk, grad_slices) -> None:
    """One replay inside a CUDA graph: the chunk's forward with grad, then the backward of its
    cached gradient."""
    _backpropagate(_as_tuple(embed(chunk)), grad_slices)


def _check_graphable(chunk_graphs, no_sync, backward, no_grad_chunk_size, chunk_size) -> None:
    if not isinstance(chunk_graphs, ChunkGraphs):
        raise TypeError("chunk_graphs must be a hf_infcl.chunk_graphs.ChunkGraphs, "
                        f"got {type(chunk_graphs).__name__}")
    if no_sync is not None or backward is not None:
        raise ValueError("chunk_graphs runs in one process only: it cannot be combined with no_sync or a "
                         "backward hook (DDP, FSDP and DeepSpeed reduce gradients in hooks a graph skips)")
    check_graphs_chunking(no_grad_chunk_size, chunk_size, graphs=True)


def _as_tuple(output) -> tuple[torch.Tensor, ...]:
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in output):
        return tuple(output)
    raise TypeError(
        f"an encoder must return a tensor or a tuple of tensors, got {type(output).__name__}"
    )
