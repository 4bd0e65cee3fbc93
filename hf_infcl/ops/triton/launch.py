"""Launching the kernels: :func:`autotuned` wraps a kernel with its candidate configurations,
:func:`launch` launches it; :func:`launch_jit` launches a kernel without an autotuner (a Gluon
kernel, a kernel of fixed blocks) past its JIT function's look-ups, as below.

The first launch of a kernel and tuning key goes through Triton's autotuner, with the choice
loaded from or saved to the machine's tuning store (:mod:`.tuning_store`); a launch that tunes
compiles its candidates in parallel first (:func:`.compile_plans.compile_candidates`). Tiny
problems (:data:`TINY`) and exact fp32 dots never tune, and run one configuration (a saved one,
for tiny problems, where there is one). Every later launch with that key goes straight to the
kernel with the configuration chosen then, because the autotuner's and the JIT function's Python
cost more host time per launch than the GPU work of a backward's super-tile. That fast path
evaluates the kernel's heuristics itself, and once the JIT function has compiled a launch's
specialisation it calls the compiled kernel's own launcher, as ``JITFunction.run`` does after its
look-ups: it relies on Triton internals (the compiled kernel's ``run``, ``function``,
``packed_metadata``, ``launch_metadata``) and falls back to the JIT function where a Triton lacks
them, and under the interpreter.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from ..value_check import run_deferred_check
from . import compile_plans
from .device import INTERPRET, device_name
from .tuning_store import TuningStore, tuning_key

# HF_INFCL_TRITON_AUTOTUNE=0 uses one safe config per kernel: GPU tests compile many
# specialisations (dtype x loss x mask) and need not autotune each of them.
AUTOTUNE = os.environ.get("HF_INFCL_TRITON_AUTOTUNE", "1") != "0"
_UNTUNED = (128, 128, 32, 4, 3)  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
# The autotuning candidates of most kernels; each adds its own (autotuned's ``shapes``).
BASE_SHAPES = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
               (128, 128, 32, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2), (128, 128, 128, 8, 3)]

# Part of the names under which the tuning store saves configurations: raise it when a kernel
# changes in a way that can change which configuration is fastest.
KERNEL_REVISION = 5

# Tuned configurations persist on disk: tuning is paid once per machine.
TUNING_STORE = TuningStore()

# Keys of the autotuners: the width c and a coarse size class (tiny / medium / large problems),
# so a small first call does not fix the configuration of large ones. The autotuner adds the
# dtypes of tensor arguments to the key by itself.
TUNE_KEY = ["c", "size_class"]


def problem_size_class(n_outer: int, n_inner: int) -> int:
    entries = n_outer * n_inner
    return 0 if entries < 2**22 else (1 if entries < 2**28 else 2)


# The size class (problem_size_class's) of problems too small for tuning to pay: a few
# microseconds of GPU work, which no configuration changes by more than the seconds it takes to
# compile the candidates. They run a saved choice where there is one (shipped or tuned before),
# else the untuned configuration.
TINY = 0


# Every kernel made by autotuned(), for reset_autotuning().
TUNED_KERNELS: list[TunedKernel] = []


@dataclass(frozen=True)
class TunedKernel:
    """A kernel under Triton's autotuner, with what :func:`launch`'s fast path needs of it."""

    name: str  # its name in the tuning store, with the kernel revision
    body: triton.runtime.JITFunction  # the kernel under the autotuner and the heuristics
    heuristics: dict[str, Callable[[dict], object]]  # constexpr name -> its value from the arguments
    tuner: triton.runtime.Autotuner
    make_config: Callable[..., triton.Config]  # triton.Config with the kernel's pre-hook


def autotuned(body, name: str, shapes: list[tuple], heuristics: dict, pre_hook=None,
              **options) -> TunedKernel:
    """``body`` under ``triton.heuristics(heuristics)`` and an autotuner over ``shapes`` ((BLOCK_M,
    BLOCK_N, BLOCK_K, warps, stages) candidates, usually :data:`BASE_SHAPES` and a few more) keyed
    by :data:`TUNE_KEY`; ``pre_hook`` runs before every launch with a config's arguments;
    ``options`` go to ``triton.autotune``."""
    make_config = functools.partial(triton.Config, pre_hook=pre_hook)
    tuner = triton.autotune(configs=configs(shapes, make_config), key=TUNE_KEY,
                            prune_configs_by={"early_config_prune": candidates_for_width}, **options)(
        triton.heuristics(heuristics)(body))
    kernel = TunedKernel(f"{name}-r{KERNEL_REVISION}", body, heuristics, tuner, make_config)
    TUNED_KERNELS.append(kernel)
    return kernel


def configs(shapes: list[tuple], make_config=triton.Config) -> list[triton.Config]:
    """The autotuner's configs: one small fixed config under the interpreter, one safe config
    with HF_INFCL_TRITON_AUTOTUNE=0, else every candidate shape."""
    if INTERPRET:
        return [make_config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1)]
    if not AUTOTUNE:
        shapes = [_UNTUNED]
    return [make_config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in shapes]


def candidates_for_width(configs: list[triton.Config], named_args: dict, **_) -> list[triton.Config]:
    """The candidates worth timing for a launch's feature width (the larger of ``c`` and the
    guide's ``c_guide``): none whose K step is wider than the width rounded up to a power of two
    (at least 32), which would only multiply masked loads and compile slowest. At least one is
    kept: those of the smallest K step, if every candidate's is wider."""
    width = max(int(named_args.get("c", 0)), int(named_args.get("c_guide", 0) or 0))
    limit = max(32, triton.next_power_of_2(max(width, 1)))
    kept = [config for config in configs if config.kwargs["BLOCK_K"] <= limit]
    if kept:
        return kept
    smallest = min(config.kwargs["BLOCK_K"] for config in configs)
    return [config for config in configs if config.kwargs["BLOCK_K"] == smallest]


def launch(kernel: TunedKernel, grid, device: torch.device, *args, config: triton.Config | None = None,
           **kwargs) -> triton.Config:
    """``kernel.tuner[grid](*args, **kwargs)``; returns the configuration it ran.

    ``config``: what an earlier launch with the same tuning key returned, for a caller that
    launches one key many times: launched without even the look-up of the key. A pending
    one-process value check (:mod:`hf_infcl.ops.value_check`) runs just before the launch."""
    if config is None and kwargs.get("PRECISION") == "ieee" and _tunes():
        config = _untuned_config(kernel)
        run_deferred_check()
    if config is not None:
        _launch_with(kernel, config, grid, args, kwargs)
        return config
    key = tuning_key(kernel.tuner, args, kwargs) if _tunes() else None
    chosen = _CHOSEN.get((kernel.name, key))
    run_deferred_check()
    if chosen is not None:
        _launch_with(kernel, chosen, grid, args, kwargs)
        return chosen
    if key is None:  # one config: nothing is tuned
        kernel.tuner[grid](*args, **kwargs)
        return kernel.tuner.best_config
    if _size_class(kernel, key) == TINY:
        chosen = TUNING_STORE.saved(kernel.name, key, device_name(device), triton.__version__,
                                    kernel.make_config) or _untuned_config(kernel)
        _CHOSEN[(kernel.name, key)] = chosen
        _launch_with(kernel, chosen, grid, args, kwargs)
        return chosen
    with TUNING_STORE.tuned(kernel.tuner, kernel.name, key, device_name(device), triton.__version__,
                            kernel.make_config) as tunes:
        if tunes:  # the candidates compiled in parallel, not one by one as the autotuner times them
            compile_plans.compile_candidates(kernel, grid, args, kwargs, device)
        kernel.tuner[grid](*args, **kwargs)
    _CHOSEN[(kernel.name, key)] = kernel.tuner.best_config
    return kernel.tuner.best_config


def _untuned_config(kernel: TunedKernel) -> triton.Config:
    """The configuration of launches kept out of the autotuner: tiny problems without a saved
    choice (:data:`TINY`), and exact fp32 dots (``precision="ieee"``), which run on CUDA cores,
    where ptxas takes minutes over each of the candidates' large unrolled tiles, and are there for
    exactness, not speed (the tuner's key has no place for the precision either: a TF32 launch of
    the same shapes tunes on its own)."""
    # one object per kernel: _launch_with finds its compilations by the config's id
    if kernel.name not in _UNTUNED_CONFIGS:
        bm, bn, bk, warps, stages = _UNTUNED
        _UNTUNED_CONFIGS[kernel.name] = kernel.make_config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                                                           num_warps=warps, num_stages=stages)
    return _UNTUNED_CONFIGS[kernel.name]


_UNTUNED_CONFIGS: dict[str, triton.Config] = {}


def _size_class(kernel: TunedKernel, key: tuple) -> int | None:
    """The ``size_class`` in a launch's tuning key (see :func:`problem_size_class`), None without one."""
    return dict(zip(kernel.tuner.keys, key)).get("size_class")


def reset_autotuning() -> None:
    """Forget the configurations the autotuners chose, and the launches made with them, so that
    the next launch of each kernel tunes afresh (and saves its new choice): also the saved ones,
    for the rest of this process."""
    for kernel in TUNED_KERNELS:
        kernel.tuner.cache.clear()
    _CHOSEN.clear()
    _COMPILED.clear()
    TUNING_STORE.retune()


def _tunes() -> bool:
    """Whether the autotuners have several configurations to choose from (see :func:`configs`)."""
    return AUTOTUNE and not INTERPRET


# The configuration each (kernel name, tuning key) ran with in this process, once tuned or loaded.
_CHOSEN: dict[tuple, triton.Config] = {}

# Compiled kernels by (JIT function, id of the configuration, the launch's names, their values or
# facts: see _launch_cached): the same key again launches the compiled kernel through its own
# launcher.
_COMPILED: dict[tuple, tuple] = {}
# Each launched JIT function's parameters that are not constexprs, by name.
_RUNTIME_NAMES: dict = {}
_COMPILED_KERNEL_API = ("run", "function", "packed_metadata", "launch_metadata")


def _launch_with(kernel: TunedKernel, config: triton.Config, grid, args: tuple, kwargs: dict) -> None:
    """The launch of ``kernel`` with ``config``, past the autotuner: the heuristics evaluated here,
    then the compiled kernel's launcher if an earlier launch compiled this specialisation, else
    the JIT function (whose compiled kernel is kept for the next time)."""
    body = kernel.body
    named = {**dict(zip(body.arg_names, args)), **kwargs, **config.kwargs}
    if config.pre_hook is not None:
        config.pre_hook(named)
    constexprs = {name: heuristic(named) for name, heuristic in kernel.heuristics.items()}
    named.update(constexprs)
    _launch_cached(body, config, grid, args, lambda: {**kwargs, **config.all_kwargs(), **constexprs}, named)


def launch_jit(body, grid, *args, **kwargs) -> None:
    """``body[grid](*args, **kwargs)`` for a JIT function launched without an autotuner (a Triton or
    a Gluon kernel): once a launch of the same specialisation has compiled it, through the compiled
    kernel's own launcher, as :func:`launch` does past the autotuner. The JIT function's look-ups
    cost more host time than its launch, and where the GPU waits for the launch (just after a host
    synchronisation) that time is the GPU's too."""
    _launch_cached(body, None, grid, args, lambda: kwargs, {**dict(zip(body.arg_names, args)), **kwargs})


def _launch_cached(body, config: triton.Config | None, grid, args: tuple, jit_kwargs: Callable[[], dict],
                   named: dict) -> None:
    """``body[grid](*args, **jit_kwargs())``, or the compiled kernel an earlier such launch with the same
    ``config`` and the same facts (:func:`_fact`) of the ``named`` values returned. A constexpr,
    and a launch option such as ``num_warps``, counts by its value (each value is another kernel:
    an integer's divisibility, which is all an argument's specialisation holds, would take a
    kernel of SPLITS=2 for SPLITS=4); a float that is not one by its type alone (Triton passes
    it as an fp32 value), so that a margin that changes every step does not add a key every step.
    ``jit_kwargs`` makes the JIT function's keyword arguments, which only a compile needs."""
    if INTERPRET:  # no compiled kernels to keep
        body[grid](*args, **jit_kwargs())
        return
    runtime = _RUNTIME_NAMES.get(body)
    if runtime is None:
        runtime = frozenset(param.name for param in body.params if not param.is_constexpr)
        _RUNTIME_NAMES[body] = runtime
    # the names in their order, then a constexpr or a launch option (no parameter at all) by its
    # value and an argument by its facts
    key = (body, id(config), tuple(named),
           tuple(_fact(value) if name in runtime else value for name, value in named.items()))
    compiled = _COMPILED.get(key)
    if compiled is not None:
        _launch_compiled(body, compiled[1], grid, named)
        return
    compiled = body[grid](*args, **jit_kwargs())
    if all(hasattr(compiled, name) for name in _COMPILED_KERNEL_API):
        _COMPILED[key] = (config, compiled)  # the config kept alive, so that its id stays its own


def _fact(value):
    """What a compiled kernel depends on of one argument value: a superset of what Triton
    specialises on (a tensor's dtype and 16-byte alignment; an integer's width, divisibility by 16
    and being 1; a float by its type alone; a tensor descriptor's dtype, alignment, shape, strides
    and block, and a Gluon one's shared layout), so that two launches with one key never need two
    compilations. The converse (a new key for a kernel Triton already has) only costs one launch
    through the JIT function."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    if isinstance(value, float):
        return float
    if isinstance(value, TensorDescriptor) or _is_gluon_descriptor(value):
        return (type(value), value.base.dtype, value.base.data_ptr() % 16 == 0, tuple(value.shape),
                tuple(value.strides), tuple(value.block_shape), value.padding,
                repr(getattr(value, "layout", None)))
    return value


def _is_gluon_descriptor(value) -> bool:
    """Whether ``value`` is a Gluon tensor descriptor (a host-side TMA descriptor with its shared
    layout), by its fields: Gluon is an experimental part of Triton, whose module paths move."""
    return all(hasattr(value, name) for name in ("base", "shape", "strides", "block_shape", "layout"))


def _launch_compiled(body, compiled, grid, named: dict) -> None:
    """Launch ``compiled`` (a kernel of ``body`` that JITFunction.run compiled and returned for
    the same specialisation) as JITFunction.run does after its look-ups: the grid, the current
    stream, the launch hooks, and every parameter's value in the signature's order."""
    values = [named[name] for name in body.arg_names]
    grid = grid(named) if callable(grid) else grid
    device = triton.runtime.driver.active.get_current_device()
    stream = triton.runtime.driver.active.get_current_stream(device)
    hooks = knobs.runtime  # the launch hooks (proton, users' profilers), read per launch as Triton does
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, compiled.launch_metadata(grid, stream, *values),
                 hooks.launch_enter_hook, hooks.launch_exit_hook, *values)
