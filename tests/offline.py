"""The environment of the tests' subprocesses (examples, README snippets): offline, a fresh
Hugging Face home (so no accelerate config or cached token is found), no launcher variables
inherited from the test run, and this checkout importable."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
