"""CUDA graphs for the chunks of a gradient-cached step.

A cached step runs the encoders on many chunks of one shape: a forward without grad per chunk,
then a forward and backward per chunk. With a small model or small chunks the GPU finishes many
of the encoder's kernels before Python has launched the next one, so the chunks run slower per
row than the whole batch does (CLIP ViT-B/32 in chunks of 256 pairs: about three quarters of the
whole batch's speed). A CUDA graph records the kernels of one chunk once and then launches them
all with one call.

:class:`ChunkGraphs` keeps one graph per call site and input signature (shapes, dtypes, grad
mode). The first ``warmup`` calls of a signature run eagerly (libraries initialise lazily and
pick their kernels there), the next one captures a graph, and every later one copies the chunk
into the graph's static inputs and replays it. A graph that backpropagates writes its parameter
gradients into buffers of its own; each replay adds them to ``.grad``, so a step accumulates as
eager backward passes do and ``zero_grad(set_to_none=True)`` stays safe.

Costs: all graphs share one memory pool, which keeps about one chunk's activations (and, per
graph that backpropagates, one gradient buffer per parameter) allocated between steps; a capture
takes a moment once per signature.

Random numbers: a graph reads the CUDA generator's seed and offset when it is replayed, so a
replay under a restored RNG state draws the same dropout masks as an eager call from that state.

Under DDP a graph's backward skips DDP's gradient hooks: run the encoders outside DDP's forward
(e.g. the towers' feature methods), let the step's graphs accumulate the local gradients, and call
:func:`average_gradients` after it, which reduces them as DDP's synchronised backward would. Wrap
the model in DDP while a stream other than the default one is current, and train on it: DDP keeps
each parameter's gradient accumulator, with the stream current at the wrap, and a captured
backward cannot wait on the default stream.

What a graph cannot hold, and what makes :meth:`ChunkGraphs.run` raise while capturing: host
synchronisation in the encoder (``.item()``, ``nonzero``, data-dependent shapes), CPU tensors,
collectives (a DDP or FSDP module's hooks). What a graph holds wrongly, without an error: Python
state the kernels depend on that changes between calls (a layer skipped at random on the host,
as ``layerdrop``), which the graph fixes as it was at the capture. With ``eager_on_failure`` a
failed capture is not an error: that call and every later one run eagerly, with one warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Iterable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from .batch_statistics import listed_names
from .ops.options import check_bool, check_positive_int
from .rng import host_random_draws_in_training

__all__ = ["DEFAULT_MAX_GRAPHS", "ChunkGraphs", "average_gradients", "reason_against_default_graphs"]

logger = logging.getLogger(__name__)


# Graphs a run turns on by default (not asked for): at most this many, enough for both passes over
# whole chunks and a last, shorter one; further shapes (text padded per batch) run eagerly.
DEFAULT_MAX_GRAPHS = 4
# ... and only where the gradient buffers that many graphs could hold (one per replay graph) take at
# most 1/GRAPH_MEMORY_SHARE of the GPU's memory: so a default cannot push a run that fits eagerly
# out of memory, and models too large for that are too slow per chunk for launches to matter.
GRAPH_MEMORY_SHARE = 8


def reason_against_default_graphs(model: torch.nn.Module, device: torch.device, *,
                                  gradient_checkpointing: bool = False) -> str | None:
    """Why a cached step of ``model`` (in the mode it trains in) on the CUDA ``device`` should not
    run CUDA graphs unless asked to, or None: graphs would get its gradients wrong or cost too
    much memory. ``gradient_checkpointing``: the run turns it on (besides the layers' own flags,
    which transformers' ``gradient_checkpointing_enable`` sets). What keeps graphs from running
    at all (several processes' hooks, sharding, a CPU device) is the caller's to check."""
    if gradient_checkpointing or any(getattr(module, "gradient_checkpointing", False) is True
                                     for module in model.modules()):
        return ("gradient checkpointing replays the forward inside the backward, which is not verified "
                "inside a graph")
    host_draws = host_random_draws_in_training(model)
    if host_draws:
        return (f"the model skips layers at random on the host ({listed_names(host_draws)}): a graph "
                "would repeat the skips of its capture")
    trainable = [param for param in model.parameters() if param.requires_grad]
    buffers = DEFAULT_MAX_GRAPHS * sum(param.numel() * param.element_size() for param in trainable)
    memory = torch.cuda.get_device_properties(device).total_memory
    if buffers * GRAPH_MEMORY_SHARE > memory:
        return (f"the graphs' gradient buffers (up to {buffers / 2**30:.1f} GiB) could take more than "
                f"1/{GRAPH_MEMORY_SHARE} of the GPU's memory; a model this large gains little from them")
    if any(param.device.type != "cuda" for param in trainable):
        return "some trainable parameters are not on the GPU"
    return None


class ChunkGraphs:
    """CUDA graphs of an encoder's chunk calls, one per call site and input signature.

    Args:
        parameters: the parameters whose gradients graphed backward passes produce (the model's
            ``parameters()``). Only those with ``requires_grad`` are tracked.
        warmup: eager calls of each signature before it is captured (at least 1).
        max_graphs: at most this many graphs (None: no bound). Each graph that backpropagates
            holds a gradient buffer per parameter, so inputs whose shapes keep changing (text
            padded to each batch's longest) would otherwise add one per new shape; signatures
            past the bound run eagerly (logged once).
        eager_on_failure: a capture that fails runs its call eagerly instead of raising, and so
            does every later call (one warning names the cause): for a default that must never
            stop a run that eager mode would train.

    Keep one instance for the whole training run (graphs are reused across steps) and pass it to
    :func:`hf_infcl.grad_cache.cached_step` as ``chunk_graphs``.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], warmup: int = 2, *, max_graphs: int | None = None,
                 eager_on_failure: bool = False):
        if not torch.cuda.is_available():
            raise ValueError("ChunkGraphs needs a CUDA device: CUDA graphs exist only there")
        check_positive_int("warmup", warmup)
        check_positive_int("max_graphs", max_graphs, optional=True)
        check_bool("eager_on_failure", eager_on_failure)
        unique = {id(p): p for p in parameters if isinstance(p, torch.Tensor) and p.requires_grad}
        self.parameters = list(unique.values())
        for param in self.parameters:
            if param.device.type != "cuda":
                raise ValueError(f"ChunkGraphs: a parameter lives on {param.device}, not on a CUDA device")
            if type(param).__name__ == "DTensor" or hasattr(param, "ds_id"):
                raise ValueError("ChunkGraphs cannot hold parameters sharded by FSDP or DeepSpeed: their "
                                 "gradients are reduced by hooks a graph would skip")
        self.warmup = warmup
        self.max_graphs = max_graphs
        self.eager_on_failure = eager_on_failure
        self.failure: str | None = None  # why the calls run eagerly, after a failed capture
        self._eager_calls: Counter = Counter()
        self._graphs: dict[Hashable, _CapturedCall] = {}
        self._pool = None
        self._told_of_bound = False

    @property
    def captured(self) -> int:
        """How many graphs have been captured so far."""
        return len(self._graphs)

    def run(self, site: Hashable, fn: Callable, *args) -> tuple[torch.Tensor, ...]:
        """``fn(*args)`` through the graph of ``site`` and the signature of ``args``.

        ``args`` may nest tensors in dicts, lists and tuples; their CUDA tensors become the
        graph's static inputs and every other leaf is fixed into it (and into the signature).
        ``fn`` returns a tensor, a tuple of tensors or None; a graphed call returns copies of
        them. Parameter gradients that ``fn`` backpropagates are added to ``.grad``.
        """
        if self.failure is not None:
            return _outputs(fn(*args))
        leaves, spec = tree_flatten(args)
        key = (site, str(spec), torch.is_grad_enabled(), tuple(_leaf_signature(leaf) for leaf in leaves))
        captured = self._graphs.get(key)
        if captured is None:
            if self.max_graphs is not None and len(self._graphs) >= self.max_graphs:
                self._tell_of_bound()
                return _outputs(fn(*args))
            if self._eager_calls[key] < self.warmup:
                self._eager_calls[key] += 1
                return _outputs(fn(*args))
            # The generators as this call found them. The CUDA one's whole state object: a capture
            # that fails never ends, and leaves the state it began in marked as capturing, which
            # would refuse every later eager draw of the process.
            cuda_generator = torch.cuda.default_generators[torch.cuda.current_device()]
            rng_states = torch.get_rng_state(), cuda_generator.clone_state()
            # ... and the current stream: torch.cuda.graph leaves its capture stream current when
            # the capture's end fails
            stream = torch.cuda.current_stream()
            try:
                captured = self._capture(site, fn, leaves, spec)
            except RuntimeError as error:
                torch.cuda.set_stream(stream)
                torch.set_rng_state(rng_states[0])
                cuda_generator.graphsafe_set_state(rng_states[1])
                self._fail(str(error))
                if not self.eager_on_failure:
                    raise
                warnings.warn(f"{error}. The cached step's chunks run eagerly (without CUDA graphs) from now "
                              "on.", stacklevel=2)
                return _outputs(fn(*args))
            self._graphs[key] = captured
            del self._eager_calls[key]
        return captured.replay(leaves)

    def _tell_of_bound(self) -> None:
        if not self._told_of_bound:
            self._told_of_bound = True
            logger.info("ChunkGraphs: %d graphs are held (max_graphs); chunk calls of further input "
                        "shapes run eagerly. Pad the inputs to fixed lengths to keep their shapes few.",
                        self.max_graphs)

    def _fail(self, message: str) -> None:
        """Every later call runs eagerly. The graphs held so far are released: they draw their
        random numbers from the CUDA generator state that the failed capture left behind."""
        self.failure = message
        self._graphs.clear()
        self._eager_calls.clear()

    def _capture(self, site, fn, leaves, spec) -> _CapturedCall:
        static_leaves = [leaf.clone() if _is_input(leaf) else leaf for leaf in leaves]
        saved_grads = [param.grad for param in self.parameters]
        for param in self.parameters:
            param.grad = None
        graph = torch.cuda.CUDAGraph()
        try:
            with _host_checks_off(), torch.cuda.graph(graph, pool=self._pool):
                outputs = _outputs(fn(*tree_unflatten(static_leaves, spec)))
            grads = [(param, param.grad) for param in self.parameters if param.grad is not None]
        except Exception as error:
            raise RuntimeError(
                f"capturing a CUDA graph of the chunk call {site!r} failed: the encoder does something a "
                "graph cannot hold (host synchronisation such as .item() or .tolist(), data-dependent "
                "shapes, CPU tensors, collectives). Run without CUDA graphs (chunk_graphs=None / "
                f"chunk_cuda_graphs=False). Cause: {_first_cause(error)}"
            ) from error
        finally:
            for param, grad in zip(self.parameters, saved_grads):
                param.grad = grad
        self._pool = graph.pool()
        return _CapturedCall(graph, static_leaves, outputs, grads)


def _first_cause(error: BaseException) -> str:
    """The exception a failed capture started with, and where: the capture's own end then fails
    too ("unjoined work"), which says nothing of why."""
    while error.__context__ is not None:
        error = error.__context__
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}{where}"


class _CapturedCall:
    """One captured graph: its static inputs, outputs and parameter-gradient buffers."""

    def __init__(self, graph, static_leaves, outputs, grads):
        self.graph = graph
        self.static_leaves = static_leaves
        self.outputs = outputs
        self.grads = grads

    def replay(self, leaves) -> tuple[torch.Tensor, ...]:
        for static, leaf in zip(self.static_leaves, leaves):
            if _is_input(static):
                static.copy_(leaf, non_blocking=True)
        self.graph.replay()
        if self.grads:
            fresh = [(param, grad) for param, grad in self.grads if param.grad is None]
            accumulated = [(param, grad) for param, grad in self.grads if param.grad is not None]
            if accumulated:
                totals = [param.grad for param, _ in accumulated]
                torch._foreach_add_(totals, [grad for _, grad in accumulated])
            for param, grad in fresh:
                param.grad = grad.clone()
        return tuple(output.clone() for output in self.outputs)


@contextlib.contextmanager
def _host_checks_off():
    """transformers' value checks (``torch_compilable_check``, e.g. on SigLIP 2's ``spatial_shapes``)
    read a tensor on the host even while a graph is being captured, which a capture cannot hold.
    Their documented switch turns them off for the capture only: the eager warm-up calls of the
    signature ran them, and a graph's replays run no Python checks anyway."""
    name = "TRANSFORMERS_DISABLE_TORCH_CHECK"
    previous = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def _is_input(leaf) -> bool:
    return isinstance(leaf, torch.Tensor)


def _leaf_signature(leaf):
    if isinstance(leaf, torch.Tensor):
        if leaf.device.type != "cuda":
            raise ValueError(f"a graphed chunk call got a tensor on {leaf.device}: "
                             "its inputs must be on the GPU")
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        # keyed by identity, a fresh object per call would never reach a capture and would grow
        # the eager-call counts without bound
        raise TypeError(f"a graphed chunk call got an unhashable {type(leaf).__name__} among its inputs: "
                        "pass tensors, or values fixed into the graph that can be hashed") from None
    return ("value", leaf)


def _outputs(result) -> tuple[torch.Tensor, ...]:
    if result is None:
        return ()
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        return tuple(result)
    raise TypeError(f"a graphed chunk call must return tensors or None, got {type(result).__name__}")


# Gradients are averaged in flat buffers of at most this many bytes: few collectives, little extra memory.
_BUCKET_BYTES = 64 * 2**20


def average_gradients(parameters: Iterable[torch.Tensor], process_group=None) -> None:
    """Average the ``.grad`` of ``parameters`` over the ranks of ``process_group`` (default: the
    world), as DDP's synchronised backward does: what a cached step whose chunks ran as CUDA graphs
    (which DDP's hooks do not see) needs before the optimizer step. Every rank calls it with the
    same parameters in the same order; a parameter without a gradient on every rank is skipped,
    and ranks that disagree on which have one get a ValueError, not a hang."""
    with_grads = [param for param in parameters if param.requires_grad]
    if not with_grads:
        return
    present = torch.tensor([param.grad is not None for param in with_grads], dtype=torch.int32,
                           device=with_grads[0].device)
    # one collective gives every rank the minimum and the maximum, so all decide alike
    extremes = torch.cat([present, -present])
    dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=process_group)
    if not torch.equal(extremes[: len(present)], -extremes[len(present):]):
        raise ValueError("average_gradients: the ranks disagree on which parameters have a gradient")
    grads = [param.grad for param in with_grads if param.grad is not None]
    world = dist.get_world_size(process_group)
    for bucket in _buckets(grads):
        flat = torch.cat([grad.reshape(-1) for grad in bucket]).div_(world)
        dist.all_reduce(flat, group=process_group)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` in order, cut into runs of one dtype and device of at most :data:`_BUCKET_BYTES`
    (a larger gradient alone)."""
    buckets, size = [], 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        last = buckets[-1] if buckets else None
        if (last is None or (last[0].dtype, last[0].device) != (grad.dtype, grad.device)
                or size + nbytes > _BUCKET_BYTES):
            buckets.append([grad])
            size = nbytes
        else:
            last.append(grad)
            size += nbytes
    return buckets
