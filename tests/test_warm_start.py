"""Triton's once-per-process setup in a background thread (hf_infcl.ops.warm_start): when it
starts, that it waits out forks, never initialises CUDA, and that a failure in it changes nothing."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import hf_infcl
from hf_infcl.ops import warm_start

ROOT = Path(__file__).resolve().parent.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (the checkout on its path); its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("setting, cuda_build, interpret, wanted", [
    ("1", "12.8", "0", True),
    (None, "12.8", None, True),
    ("0", "12.8", "0", False),
    ("1", None, "0", False),  # a CPU-only build of torch
    ("1", "12.8", "1", False),  # the interpreter
], ids=["on", "default", "off", "cpu-build", "interpreter"])
def test_the_thread_starts_only_on_a_cuda_build_with_triton_unless_turned_off(
        monkeypatch, setting, cuda_build, interpret, wanted):
    for name, value in ((warm_start.ENVIRONMENT_VARIABLE, setting), ("TRITON_INTERPRET", interpret)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    assert warm_start._wanted() is (wanted and HAS_TRITON)


def test_nothing_starts_at_import_on_this_cpu_build():
    """``import hf_infcl`` on a CPU-only torch: no thread, and wait() returns at once."""
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: the thread is wanted here")
    out = run_python("""
        import threading, hf_infcl
        from hf_infcl.ops import warm_start
        warm_start.wait()
        print(warm_start._thread, [t.name for t in threading.enumerate()])
    """)
    assert out.strip() == "None ['MainThread']"


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_the_thread_imports_the_route_warms_triton_and_a_fork_waits_for_it():
    """Forced on (as on a CUDA build): the thread imports the Triton route and computes Triton's
    compiler hash; a fork right after the start waits until it is done (the parent sees it
    finished when fork returns); CUDA stays uninitialised; the driver's failure on a machine
    without one is swallowed; a second start() starts nothing."""
    out = run_python("""
        import os, sys, threading
        import torch
        from hf_infcl.ops import warm_start
        warm_start._wanted = lambda: True
        assert warm_start.start()
        thread = warm_start._thread
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        alive_after_fork = thread.is_alive()
        os.waitpid(pid, 0)
        warm_start.wait()
        from triton.runtime import cache
        print("route imported", "hf_infcl.ops.triton" in sys.modules)
        print("key cached", cache.triton_key.cache_info().currsize == 1)
        print("alive after fork", alive_after_fork)
        print("cuda initialised", torch.cuda.is_initialized())
        print("second start", warm_start.start())
    """)
    assert out.splitlines() == ["route imported True", "key cached True", "alive after fork False",
                                "cuda initialised False", "second start False"]


def test_a_failing_warm_start_is_logged_and_the_loss_still_runs(monkeypatch, caplog):
    """An error in the thread is logged at DEBUG level, never raised; the loss runs as before."""
    def failing_import(name, package=None):
        raise RuntimeError("no driver here")

    monkeypatch.setattr(warm_start, "_thread", None)
    monkeypatch.setattr(warm_start, "_wanted", lambda: True)
    monkeypatch.setattr(warm_start.importlib, "import_module", failing_import)
    with caplog.at_level("DEBUG", logger=warm_start.__name__):
        assert warm_start.start()
        warm_start.wait()
    assert "Triton's warm start failed" in caplog.text and "no driver here" in caplog.text
    queries, keys = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    loss = hf_infcl.contrastive_loss(queries, keys, 2.0)
    assert torch.isfinite(loss)


def test_the_module_imports_where_os_has_no_register_at_fork(monkeypatch):
    """Windows has no fork and no ``os.register_at_fork``: importing the module must not fail."""
    monkeypatch.delattr(os, "register_at_fork")
    importlib.reload(warm_start)  # raised AttributeError before the guard
    warm_start.wait()


def test_wait_gives_up_on_a_stuck_thread_with_a_warning(monkeypatch, caplog):
    """A warm start that never ends (a stuck lock, say) holds the caller up for WAIT_SECONDS only."""
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    stuck.start()
    monkeypatch.setattr(warm_start, "_thread", stuck)
    monkeypatch.setattr(warm_start, "WAIT_SECONDS", 0.2)
    with caplog.at_level("WARNING", logger=warm_start.__name__):
        warm_start.wait()
    release.set()
    assert "still running after 0.2 s" in caplog.text


def test_reset_autotuning_waits_for_a_thread_still_importing_the_launch_module(monkeypatch):
    """``hf_infcl.ops.reset_autotuning()`` right after ``import hf_infcl`` met the launch module half
    imported by the thread (in sys.modules, its functions not yet defined) and raised
    AttributeError (a benchmark on an H200 did); it waits for the thread first."""
    import types

    from hf_infcl import ops

    name = "hf_infcl.ops.triton.launch"
    resets = []
    half_imported = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, half_imported)

    def finish_the_import():
        threading.Event().wait(0.2)
        half_imported.reset_autotuning = lambda: resets.append(1)

    thread = threading.Thread(target=finish_the_import, daemon=True)
    thread.start()
    monkeypatch.setattr(warm_start, "_thread", thread)
    ops.reset_autotuning()
    assert resets == [1]


@pytest.mark.gpu
def test_on_a_gpu_the_thread_runs_at_import_and_leaves_cuda_uninitialised():
    """A fresh process on a CUDA machine: ``import hf_infcl`` starts the thread; once it is done,
    CUDA is still uninitialised, so CUDA_VISIBLE_DEVICES set afterwards still decides the devices."""
    out = run_python("""
        import os, torch, hf_infcl
        from hf_infcl.ops import warm_start
        started = warm_start._thread is not None
        warm_start.wait()
        initialised = torch.cuda.is_initialized()
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        print(started, initialised, torch.cuda.device_count())
    """)
    assert out.split() == ["True", "False", "0"]
