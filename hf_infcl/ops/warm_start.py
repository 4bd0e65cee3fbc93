"""Triton's once-per-process setup, started in a background thread at ``import hf_infcl``.

Before a process's first Triton launch, whatever the kernel, Triton hashes its own compiler
(hundreds of MB of ``libtriton``) for its cache keys, finds ``libcuda`` and loads its driver
module; the Triton route's own modules must be imported too. Together that is most of a warm
process's first loss call (the kernels themselves load from Triton's disk cache). None of it needs
the GPU, so it runs in a daemon thread while the user's script goes on building its model.

The thread never initialises CUDA (``CUDA_VISIBLE_DEVICES`` set after ``import hf_infcl`` keeps
working). It is joined where the loss picks the Triton route (:func:`wait`; Triton would
otherwise do the same work twice at once) and before the process forks (a child must not inherit
a half-held import lock). Importing the route's modules meanwhile needs no wait: Python's import
locks make the second importer wait for the first.

A failure in the thread is logged at DEBUG level and changes nothing: the first call then does
the same work itself, as it would without this module. ``HF_INFCL_TRITON_WARM_START=0`` turns it
off.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading

import torch

__all__ = ["start", "wait"]

logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "HF_INFCL_TRITON_WARM_START"

_thread: threading.Thread | None = None
_lock = threading.Lock()


def start() -> bool:
    """Start the setup in a daemon thread, once per process; whether a thread was started.

    Nothing starts on a CPU-only build of torch, without Triton, under the Triton interpreter,
    or with ``HF_INFCL_TRITON_WARM_START=0``."""
    global _thread
    with _lock:
        if _thread is not None or not _wanted():
            return False
        _thread = threading.Thread(target=_warm_start, name="hf_infcl-triton-warm-start", daemon=True)
        _thread.start()
    return True


# The setup takes about a second; a thread still running after this long is stuck on something
# (a lock on Triton's cache held by another process, say) that the caller would meet anyway.
WAIT_SECONDS = 120.0


def wait() -> None:
    """Return once the setup thread (if any) has finished, or after :data:`WAIT_SECONDS` (logged)."""
    thread = _thread
    if thread is None or thread is threading.current_thread():
        return
    thread.join(WAIT_SECONDS)
    if thread.is_alive():
        logger.warning("hf_infcl: Triton's warm start is still running after %g s; going on without it",
                       WAIT_SECONDS)


def _wanted() -> bool:
    if os.environ.get(ENVIRONMENT_VARIABLE, "1") == "0":  # as HF_INFCL_TRITON_AUTOTUNE=0
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the interpreter has nothing to warm
        return False
    # torch.version.cuda, not torch.cuda.is_available(): the latter would initialise CUDA here
    return torch.version.cuda is not None and importlib.util.find_spec("triton") is not None


def _warm_start() -> None:
    try:
        # the Triton route: imports Triton and the kernels' modules
        importlib.import_module(".triton", __package__)
        from triton.runtime import cache, driver

        cache.triton_key()  # cached by Triton for the process: the hash of its compiler
        driver.active.utils  # noqa: B018  (builds or loads Triton's driver module; no CUDA context)
    except Exception:  # the first call does the same work itself
        logger.debug("hf_infcl: Triton's warm start failed", exc_info=True)


# A fork while the thread holds an import lock would leave the child unable to import that module.
if hasattr(os, "register_at_fork"):  # POSIX only; elsewhere there is no fork to wait for
    os.register_at_fork(before=wait)
