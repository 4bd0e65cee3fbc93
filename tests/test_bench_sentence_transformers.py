"""``benchmarks/bench_sentence_transformers.py`` in its CPU smoke run (``--device cpu``, the MiniLM
part at 32 pairs, one timed step): both losses step, and ``--no-grad-mini-batch-size`` adds
InfCLLoss with it beside InfCLLoss without; a bad size ends the run before any work."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.offline import offline_env

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_sentence_transformers.py"


def run_bench(out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**offline_env(out), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--csv", str(out / "rows.csv"),
                           *flags], env=env, capture_output=True, text=True, timeout=600)


def test_the_minilm_part_steps_each_loss_and_infcl_with_and_without_larger_no_grad_mini_batches(tmp_path):
    pytest.importorskip("sentence_transformers")
    finished = run_bench(tmp_path, "--parts", "minilm", "--sizes", "32", "--repeats", "1",
                         "--no-grad-mini-batch-size", "16")
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-5000:]
    assert "(hf_infcl's gradient-free pass: 16)" in finished.stdout  # the table's title
    with open(tmp_path / "rows.csv", newline="") as handle:
        rows = {(row["loss"], row["no_grad_mini_batch_size"]): row for row in csv.DictReader(handle)}
    # InfCLLoss both ways, in the same run as CachedMNRL
    assert set(rows) == {("CachedMNRL", ""), ("InfCLLoss", ""), ("InfCLLoss", "16")}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert (row["part"], row["batch"], row["mini_batch_size"]) == ("minilm", "32", "256")
        assert float(row["step_s"]) > 0
    assert finished.stdout.count("MiniLM, seq 64") == 2  # a table per InfCLLoss setting
    # each table compares its InfCLLoss with CachedMNRL: loss-part x | step x (| peak x, nan on CPU)
    assert len(re.findall(r"\d+\.\dx \| +\d+\.\d+x \|", finished.stdout)) == 2, finished.stdout


def test_a_bad_no_grad_mini_batch_size_ends_the_run_before_any_work(tmp_path):
    finished = run_bench(tmp_path, "--no-grad-mini-batch-size", "0")
    assert finished.returncode == 2
    assert "--no-grad-mini-batch-size must be a positive int or None, got 0" in finished.stderr
    assert not (tmp_path / "rows.csv").exists()
