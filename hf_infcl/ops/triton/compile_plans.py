"""Compile plans: the kernels a first call compiles, compiled in parallel before it.

On a machine whose Triton cache is empty, a process's first loss call spends seconds compiling
its kernels one after the other: the statistics kernel, the merges, the gradient tile and the
row combiners of a softmax call, each through Triton, ``ptxas`` and (Triton 3.6) ``gcc`` for its
launcher. None of that needs the one before it. A *plan* lists those kernels' specialisations
(Triton's serialised signature, constants, alignment facts and options) for one kind of call, and
the first launch of that kind compiles them all at once, one thread each, so the call finds them
built and the wait is the longest single compile instead of their sum.

The package ships plans recorded on the GPUs the project is measured on, or on a GPU of the same
architecture and SM count under the other's name (``shipped_compile_plans/`` beside this file, one
gzipped JSON file per device name and Triton version, named as the tuned configurations' files;
``scripts/record_compile_plans.py`` records them). A plan's key (:func:`plan_key`) holds everything
of a call that decides which kernels it compiles: the block ops' settings, the loss's spec, the
dtypes, the width, the problem's size class, whether its row and key counts are multiples of 16,
whether it has a bias and which label arguments it gives. A call of another kind finds no plan and
compiles as before.

A plan is used only where the tuned configurations it was recorded with are the ones the call will
load, that is where this machine has tuned nothing of its own for the device (else the Triton
cache most likely holds the kernels anyway), and each kernel only while its own source is the one
recorded (:func:`source_digest`): after a kernel changes, its stale entry is skipped.

Whatever goes wrong in a plan (a Triton whose internals differ, a failed compile) is logged at
DEBUG level and changes nothing: the call compiles what it needs itself.
``HF_INFCL_COMPILE_PLANS=0`` turns plans off.

A kernel whose call has another route to take meanwhile (:func:`compiles_in_background`: the
Gluon kernels of the sigmoid loss and of the softmax forward's statistics, each of whose compiles
alone takes longer than all the others together) is compiled in a background thread instead:
the plan's other kernels are built before the call goes on, and the call takes the other route
while :func:`compiling` says the kernel is not ready. A fork, and the process's exit, wait for
that thread.

The same idea serves a launch that tunes (no saved choice: :func:`compile_candidates`): Triton's
autotuner compiles each candidate configuration as it times it, one after the other, so the
candidates are compiled first, all at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import importlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton

from .device import INTERPRET, device_name
from .tuning_store import file_name

logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "HF_INFCL_COMPILE_PLANS"
SHIPPED_DIRECTORY = Path(__file__).with_name("shipped_compile_plans")

# Plan keys met in this process: each is prepared once.
_PREPARED: set[tuple] = set()
_LOCK = threading.Lock()
# While a recording runs (:func:`recording`): the plan keys met and the kernels compiled, in order.
_RECORDING: dict | None = None
# The shipped plan files read so far, by path.
_SHIPPED: dict[Path, dict] = {}
# JIT functions that plans compile in the background (:func:`compiles_in_background`), and the
# threads compiling them now, by the kernel's id: hashing a JIT function computes Triton's hash of
# it, which under Triton 3.6 would change other kernels' hashes (see source_digest).
_BACKGROUND_KERNELS: list = []
_BACKGROUND_THREADS: dict[int, list[threading.Thread]] = {}


def plan_key(blocks, spec, queries: torch.Tensor, kernel_queries: torch.Tensor, rows: int, keys: int,
             width: int, has_bias: bool, labels: dict) -> tuple:
    """What of a call decides the kernels it compiles (see the module docstring). ``blocks``: the
    block ops object (its settings pick kernels and tiles); ``spec``: the resolved statistics
    spec; ``kernel_queries``: the queries as the kernels take them (fp32 inputs' fp16 copies);
    ``labels``: the launchers' label arguments, of which only the names given count."""
    from .launch import problem_size_class

    given = tuple(sorted(name for name, value in labels.items() if value is not None))
    # hashable values whose reprs are stable: the repr is taken once per key (prepare)
    return (blocks, spec, queries.dtype, kernel_queries.dtype, width, problem_size_class(rows, keys),
            rows % 16 == 0, keys % 16 == 0, has_bias, given)


def prepare(key: tuple, device: torch.device) -> None:
    """Before the first launch of a call of kind ``key`` in this process: compile its plan's
    kernels in parallel, if there is a plan and it applies here (see the module docstring)."""
    if key in _PREPARED:
        return
    with _LOCK:
        if key in _PREPARED:
            return
        _PREPARED.add(key)
    if _RECORDING is not None:
        _RECORDING["keys"].append(repr(key))
        return
    if not _wanted(device):
        return
    try:
        entries = shipped_plan(device_name(device), triton.__version__, repr(key))
        if entries:
            _compile_in_parallel(entries, device)
    except Exception:  # the call compiles what it needs itself
        logger.debug("hf_infcl: the compile plan of %s failed", key, exc_info=True)


def _wanted(device: torch.device) -> bool:
    from .launch import TUNING_STORE, _tunes

    if os.environ.get(ENVIRONMENT_VARIABLE, "1") == "0" or INTERPRET or not _tunes():
        return False
    # a machine that tuned for itself may load other configurations than the plan was recorded with
    return not TUNING_STORE.path(device_name(device), triton.__version__).exists()


def shipped_plan(device: str, triton_version: str, key: str,
                 directory: Path = SHIPPED_DIRECTORY) -> list[dict]:
    """The kernels of the plan for ``key`` (a :func:`plan_key`'s repr) shipped for this device and
    Triton version: each a dict of ``module``, ``name``, ``digest`` (:func:`source_digest` when
    recorded) and ``specialization`` (older entries also hold ``source``, unused); empty
    where there is none."""
    path = plan_path(directory, device, triton_version)
    if path not in _SHIPPED:  # read once per process
        _SHIPPED[path] = _read(path)
    table = _SHIPPED[path]
    kernels = table.get("kernels", {})
    return [kernels[entry_id] for entry_id in table.get("plans", {}).get(key, []) if entry_id in kernels]


def plan_path(directory: Path, device: str, triton_version: str) -> Path:
    """The plan file of one device name and Triton version in ``directory``."""
    return Path(directory) / (file_name(device, triton_version) + ".gz")


def compiles_in_background(kernel):
    """Mark a JIT function whose callers have another route for the time it compiles: a plan
    compiles it in a background thread and returns without it; callers ask :func:`compiling`
    before they launch it. Returns the kernel (usable as a decorator)."""
    if not _in_background(kernel):
        _BACKGROUND_KERNELS.append(kernel)
    return kernel


def _in_background(kernel) -> bool:
    return any(kernel is marked for marked in _BACKGROUND_KERNELS)


def compiling(kernel) -> bool:
    """Whether a plan is compiling ``kernel`` in the background now (its launch would compile it
    again, in the caller's thread)."""
    return any(thread.is_alive() for thread in _BACKGROUND_THREADS.get(id(kernel), ()))


def launchable(kernel, wait: bool) -> bool:
    """Whether ``kernel`` can launch without compiling it again while a plan compiles it in the
    background; with ``wait``, wait for that compile first (True)."""
    if wait:
        wait_for_background(kernel)
    return not compiling(kernel)


def wait_for_background(kernel=None, timeout: float | None = None) -> None:
    """Return once the background compile of ``kernel`` (every one's, for None) is done."""
    kernels = list(_BACKGROUND_THREADS) if kernel is None else [id(kernel)]
    for thread in [thread for key in kernels for thread in _BACKGROUND_THREADS.get(key, ())]:
        if thread is not threading.current_thread():
            thread.join(timeout)


def _compile_in_parallel(entries: list[dict], device: torch.device) -> None:
    """Compile every entry that still matches its kernel's source, one thread each, and build its
    launcher, so that the launches that follow find them in Triton's in-memory cache. Entries of
    kernels that compile in the background are started first, in a thread of their own that this
    does not wait for."""
    kernels = [(kernel, entry["specialization"]) for kernel, entry in
               ((_jit_function(entry), entry) for entry in entries) if kernel is not None]
    if not kernels:
        return

    def build(kernel_and_specialization):
        kernel, specialization = kernel_and_specialization
        torch.cuda.set_device(device)  # Triton compiles for, and loads onto, the current device
        _load(kernel.preload(specialization))

    _make_device_caches([kernel for kernel, _ in kernels], device)
    for kernel in [kernel for kernel in _BACKGROUND_KERNELS if any(kernel is item[0] for item in kernels)]:
        # not a daemon: a process that ends meanwhile finishes the compile (into Triton's cache)
        thread = threading.Thread(target=_in_threads, name="hf_infcl-background-compile",
                                  args=(build, [item for item in kernels if item[0] is kernel]))
        threads = _BACKGROUND_THREADS.setdefault(id(kernel), [])
        threads[:] = [*(earlier for earlier in threads if earlier.is_alive()), thread]
        thread.start()
    _in_threads(build, [item for item in kernels if not _in_background(item[0])])


def compile_candidates(kernel, grid, args: tuple, kwargs: dict, device: torch.device) -> None:
    """Before the autotuner times a launch's candidate configurations of ``kernel`` (a
    :class:`~.launch.TunedKernel`), compile them all at once, one thread each: the autotuner
    compiles them one after the other as it times them, which is most of a tuning's time on a
    machine whose Triton cache lacks them. Each candidate is compiled for the arguments the
    autotuner will launch it with (its pre-hook and the heuristics applied to a copy of them,
    tensor descriptors included), so its runs find every one compiled. A failure is logged at
    DEBUG level; the autotuner then compiles that candidate itself."""
    try:
        _compile_candidates(kernel, grid, args, kwargs, device)
    except Exception:  # the autotuner compiles what it needs itself
        logger.debug("hf_infcl: compiling the candidates of %s in parallel failed", kernel.name,
                     exc_info=True)


def _compile_candidates(kernel, grid, args: tuple, kwargs: dict, device: torch.device) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .launch import candidates_for_width

    named = {**dict(zip(kernel.body.arg_names, args)), **kwargs}
    configs = candidates_for_width(kernel.tuner.configs, named)
    if len(configs) < 2:  # nothing to time
        return

    def build(config):
        torch.cuda.set_device(device)
        # its own descriptors: a pre-hook sets their block shapes, part of the specialisation
        arguments = {name: dataclasses.replace(value) if isinstance(value, TensorDescriptor) else value
                     for name, value in named.items()}
        arguments.update(config.kwargs)
        if config.pre_hook is not None:
            config.pre_hook(arguments)
        arguments.update({name: heuristic(arguments) for name, heuristic in kernel.heuristics.items()})
        _load(kernel.body.warmup(grid=grid, **{**arguments, **config.all_kwargs()}))

    _make_device_caches([kernel.body], device)
    _in_threads(build, configs)


def _load(compiled) -> None:
    """Build a just-compiled kernel's launcher and load its module (else done at its first launch),
    after waiting for it where Triton compiled it asynchronously."""
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    compiled._init_handles()


def _in_threads(build, items: list) -> None:
    """``build(item)`` for every item, one thread each (at most one per CPU core); each failure
    logged at DEBUG level."""
    if not items:
        return
    with ThreadPoolExecutor(min(len(items), os.cpu_count() or 1)) as pool:
        for failure in [future.exception() for future in [pool.submit(build, item) for item in items]]:
            if failure is not None:
                logger.debug("hf_infcl: a kernel failed to compile ahead of its launch", exc_info=failure)


def _make_device_caches(kernels: list, device: torch.device) -> None:
    """Each kernel's cache for ``device`` made here, once: two threads compiling entries of one
    kernel could otherwise each make it, and one of their compiled kernels would be lost."""
    with torch.cuda.device(device):
        index = triton.runtime.driver.active.get_current_device()
        for kernel in kernels:
            kernel.device_caches[index]  # noqa: B018  (made on first access)


def _jit_function(entry: dict):
    """The JIT function an entry names, or None where it is gone or its own source changed. (A
    change in a helper it calls leaves the entry usable: the specialisation still fits, and the
    compile takes the current sources.)"""
    kernel = getattr(importlib.import_module(entry["module"]), entry["name"], None)
    if not isinstance(kernel, triton.runtime.JITFunction) or entry.get("digest") != source_digest(kernel):
        logger.debug("hf_infcl: skipping the stale compile plan entry %s.%s", entry["module"], entry["name"])
        return None
    return kernel


@contextlib.contextmanager
def recording():
    """Record what this process compiles inside the block: yields a dict whose ``keys`` are the
    plan keys met (their reprs, in order) and ``kernels`` the entries compiled, as
    :func:`shipped_plan` returns them. Run it around a fresh process's first call, with plans off
    for that call by the recording itself."""
    from triton import knobs

    global _RECORDING
    recorded = {"keys": [], "kernels": []}

    def record(**hook):
        kernel = hook["fn"].jit_function
        recorded["kernels"].append({"module": kernel.fn.__module__, "name": kernel.fn.__name__,
                                    "digest": source_digest(kernel),
                                    "specialization": hook["compile"]["specialization_data"]})

    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = record
    _RECORDING = recorded
    try:
        yield recorded
    finally:
        _RECORDING = None
        knobs.runtime.jit_post_compile_hook = previous


def source_digest(kernel) -> str:
    """A hash of a JIT function's own source and first line, the same under every Triton release
    (so a test without the recording's Triton can tell that a kernel changed after its plans were
    recorded) and in every process. Triton's own hash of a kernel also covers the functions it
    calls, but it differs between releases, and under Triton 3.6 it even depends on which kernels
    the process hashed before (a Gluon kernel hashed first changes the hash of every Triton
    kernel that shares a helper with it)."""
    return hashlib.sha1(f"{kernel.starting_line_number}\n{kernel.src}".encode()).hexdigest()[:16]


def add_plan(path: Path, key: str, kernels: list[dict]) -> None:
    """Write the plan of ``key`` (replacing an older one) into the plan file ``path``: the file's
    ``kernels`` hold each entry once, under an id (a hash of the entry), however many plans list
    it, and its ``plans`` list each key's entry ids."""
    table = _read(path)
    stored = table.setdefault("kernels", {})
    entry_ids = []
    for entry in kernels:
        entry_ids.append(entry_id(entry))
        stored[entry_ids[-1]] = entry
    table.setdefault("plans", {})[key] = entry_ids
    listed = {listed_id for plan in table["plans"].values() for listed_id in plan}
    table["kernels"] = {stored_id: entry for stored_id, entry in stored.items() if stored_id in listed}
    write_table(path, table)


def write_table(path: Path, table: dict) -> None:
    """Write a plan file's table (``kernels``, ``plans``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same plans give the same bytes
    path.write_bytes(gzip.compress(json.dumps(table, indent=0, sort_keys=True).encode() + b"\n", mtime=0))


def entry_id(entry: dict) -> str:
    """The id a plan file stores ``entry`` under: a hash of it."""
    return hashlib.sha1(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:16]


def _read(path: Path) -> dict:
    """A plan file's table, or an empty one where there is none or it cannot be read."""
    try:
        table = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, ValueError, EOFError):
        return {}
    return table if isinstance(table, dict) else {}


# A fork while a background compile holds an import lock (or Triton's) would leave the child stuck.
if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(before=wait_for_background)
