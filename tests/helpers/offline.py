"""The tests' subprocesses: the environment of examples and README snippets (offline, a fresh
Hugging Face home so no accelerate config or cached token is found, no launcher variables
inherited from the test run, this checkout importable), and two-process torchrun workers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
    and one thread per process; fails the test with the workers' output unless both succeed.
    ``cuda=False`` hides the GPUs (gloo on CPU); ``env`` adds variables; ``processes`` other than
    two, for a script that must run under torchrun whatever its number of processes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "--master_port", str(port), str(script), *map(str, args)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {}),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not cuda:
        environment["CUDA_VISIBLE_DEVICES"] = ""
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-5000:]
