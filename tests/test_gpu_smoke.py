"""The GPU smoke suite (``pytest -m gpu``): every case of ``tests/helpers/gpu_smoke.py`` in a fresh
process, with the defaults users get. ``HF_INFCL_TRITON_AUTOTUNE`` is removed from the case's
environment and each case gets an empty tuning store (``HF_INFCL_CACHE``), so its first loss call
autotunes, as a user's first call on a new machine does; a switch that makes tests faster must
not hide what users hit (it once hid an autograd error on the first sigmoid step). A second
process with the same store loads the tuned configurations instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.gpu_smoke import CASES

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_smoke_case_in_a_fresh_process(case, tmp_path):
    _run_case(case, tmp_path)


@pytest.mark.gpu
def test_a_second_process_loads_the_tuned_configurations(tmp_path):
    """What the first process tuned is saved; the next process on the machine loads it and tunes
    nothing (no tuning log line). The softmax loss: the sigmoid loss's one pass runs cuBLAS and an
    untuned elementwise kernel, so it has nothing to tune."""
    assert "hf_infcl: autotuning" in _run_case("loss-softmax-sym-bf16", tmp_path)
    assert "hf_infcl: autotuning" not in _run_case("loss-softmax-sym-bf16", tmp_path)


def _run_case(case: str, store) -> str:
    """Run one smoke case in a fresh process with the tuning store ``store``; its output."""
    env = {name: value for name, value in os.environ.items() if name != "HF_INFCL_TRITON_AUTOTUNE"}
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_INFCL_CACHE"] = str(store)
    result = subprocess.run([sys.executable, "-m", "tests.helpers.gpu_smoke", case], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and f"SMOKE OK {case}" in result.stdout, output[-8000:]
    print(result.stdout.strip().splitlines()[-1])
    return output


def test_case_list_covers_every_model_family_and_option():
    """The smoke suite keeps what the issue that created it asked for (this part runs on CPU)."""
    names = set(CASES)
    models = ["clip", "siglip", "siglip2", "dual-encoder", "align", "clap"]
    for model in models:
        assert {f"trainer-{model}-whole-batch", f"trainer-{model}-chunk16",  # the default: CUDA graphs
                f"trainer-{model}-chunk16-eager"} <= names
    for loss in ("softmax-sym", "softmax-asym", "sigmoid"):
        assert {f"loss-{loss}-{dtype}" for dtype in ("bf16", "fp16", "fp32")} <= names
    assert {"accelerate-example", "compile-softmax-sym", "compile-sigmoid"} <= names
