"""The GPU smoke suite (``pytest -m gpu``): every case of ``tests/gpu_smoke.py`` in a fresh
process, with the defaults users get. ``HF_INFCL_TRITON_AUTOTUNE`` is removed from the case's
environment, so its first loss call autotunes, as a user's does; a switch that makes tests faster
must not hide what users hit (it once hid an autograd error on the first sigmoid step)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_smoke import CASES

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_smoke_case_in_a_fresh_process(case):
    env = {name: value for name, value in os.environ.items() if name != "HF_INFCL_TRITON_AUTOTUNE"}
    env["PYTHONUNBUFFERED"] = "1"
    result = subprocess.run([sys.executable, "-m", "tests.gpu_smoke", case], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and f"SMOKE OK {case}" in result.stdout, output[-8000:]
    print(result.stdout.strip().splitlines()[-1])


def test_case_list_covers_every_model_family_and_option():
    """The smoke suite keeps what the issue that created it asked for (this part runs on CPU)."""
    names = set(CASES)
    for model in ("clip", "siglip", "dual-encoder"):
        assert {f"trainer-{model}-whole-batch", f"trainer-{model}-chunk16"} <= names
    for loss in ("softmax-sym", "softmax-asym", "sigmoid"):
        assert {f"loss-{loss}-{dtype}" for dtype in ("bf16", "fp16", "fp32")} <= names
    assert {"accelerate-example", "compile-softmax-sym", "compile-sigmoid"} <= names
