"""The tests' subprocesses: the environment of examples and README snippets (offline, a fresh
Hugging Face home so no accelerate config or cached token is found, no launcher variables
inherited from the test run, this checkout importable), two-process torchrun workers, and
several torchrun launches side by side as the nodes of one job."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LAUNCHER_VARIABLES = ("ACCELERATE_", "WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_")


def offline_env(tmp_path) -> dict:
    env = dict(os.environ)
    env.update(
        HF_HOME=str(Path(tmp_path) / "hf_home"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    for name in [n for n in env if n.startswith(_LAUNCHER_VARIABLES)]:
        env.pop(name)
    return env


def run_two_processes(script, *args, timeout: int = 600, cuda: bool = False, env: dict | None = None,
                      processes: int = 2) -> None:
    """``torchrun --nproc_per_node 2 script *args`` on a free port with this checkout importable
    and one thread per process; fails the test with the workers' output unless all succeed.
    ``cuda=False`` hides the GPUs (gloo on CPU); ``env`` adds variables; ``processes`` other than
    two, for a script that must run under torchrun whatever its number of processes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "--master_port", str(_free_port()), str(script), *map(str, args)]
    finished = subprocess.run(command, env=_worker_environment(cuda, env), capture_output=True, text=True,
                              timeout=timeout)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-5000:]


def run_nodes(script, *args, nodes: int = 2, processes_per_node: int = 2, timeout: int = 600) -> None:
    """``nodes`` torchrun launches of ``processes_per_node`` CPU processes each, side by side on this
    machine as the nodes of one job (``--nnodes``, ``--node_rank``, one static rendezvous on
    127.0.0.1); fails the test with every launch's output unless all succeed within ``timeout``
    seconds (together), killing the ones still running."""
    port = _free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node",
               str(processes_per_node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    with contextlib.ExitStack() as files:
        # Files, not pipes: a launch that fills its pipe while another is being waited for would stall.
        logs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(nodes)]
        launches = [subprocess.Popen([*command, "--node_rank", str(node), str(script), *map(str, args)],
                                     env=_worker_environment(cuda=False), stdout=log,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # a session per launch: see below
                    for node, log in enumerate(logs)]
        deadline = time.monotonic() + timeout
        report, succeeded = [], True
        for node, (launch, log) in enumerate(zip(launches, logs)):
            try:
                launch.wait(timeout=max(1.0, deadline - time.monotonic()))
                status = f"exit {launch.returncode}"
                succeeded = succeeded and launch.returncode == 0
            except subprocess.TimeoutExpired:
                # torchrun and its workers: they would outlive a killed torchrun
                os.killpg(launch.pid, signal.SIGKILL)
                launch.wait()
                status, succeeded = f"killed after {timeout} s", False
            log.seek(0)
            report.append(f"--- node {node}: {status}\n{log.read()[-4000:]}")
    assert succeeded, "\n".join(report)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _worker_environment(cuda: bool, env: dict | None = None) -> dict:
    """The launched workers' environment: offline, one thread each, this checkout importable, and
    without GPUs unless ``cuda``."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {}),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not cuda:
        environment["CUDA_VISIBLE_DEVICES"] = ""
    return environment
