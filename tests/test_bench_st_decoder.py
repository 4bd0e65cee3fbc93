"""``benchmarks/bench_st_decoder.py`` in its CPU dry run (``--cpu``: the qwen3-tiny preset, a few
pairs): the step part times InfCLLoss and CachedMNRL, the sharded part trains under torchrun (one
process, gloo) with each engine, every row appended to one CSV; and the batches it builds are what
the preset's model reads (exact length, EOS last)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.offline import offline_env, run_two_processes

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_st_decoder.py"
ENGINES = ("none", "fsdp2", "zero3")


@pytest.fixture(scope="module")
def dry_run_rows(tmp_path_factory) -> list[dict]:
    pytest.importorskip("sentence_transformers")
    out = tmp_path_factory.mktemp("bench_st_decoder")
    rows = out / "rows.csv"
    env = {**offline_env(out), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    finished = subprocess.run([sys.executable, str(BENCH), "step", "--cpu", "--csv", str(rows)], env=env,
                              capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-5000:]
    assert "InfCLLoss" in finished.stdout and "x Cached step" in finished.stdout  # the table
    for engine in ENGINES:
        if engine == "zero3" and importlib_missing("deepspeed"):
            continue
        run_two_processes(BENCH, "sharded", "--cpu", "--engine", engine, "--csv", rows, processes=1,
                          env={"DS_ACCELERATOR": "cpu"} if engine == "zero3" else None)
    with open(rows, newline="") as handle:
        return list(csv.DictReader(handle))


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def test_the_step_part_times_both_losses_on_the_same_batches(dry_run_rows):
    rows = {row["loss"]: row for row in dry_run_rows if row["part"] == "step"}
    assert set(rows) == {"InfCLLoss", "CachedMNRL"}
    for row in rows.values():
        assert row["status"] == "ok", row
        settings = (row["pairs"], row["tokens"], row["mini_batch_size"], row["preset"])
        assert settings == ("48", "64", "16", "qwen3-tiny")
        assert float(row["step_s"]) > 0 and row["steps"] == "1" and math.isfinite(float(row["loss_value"]))
        assert row["device"] == "cpu" and row["torch"] == torch.__version__
    ours, theirs = rows["InfCLLoss"], rows["CachedMNRL"]
    ratio = float(ours["step_s"]) / float(theirs["step_s"])
    assert float(ours["step_vs_cached"]) == pytest.approx(ratio, rel=0.02)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_sharded_part_trains_under_each_engine(dry_run_rows, engine):
    if engine == "zero3" and importlib_missing("deepspeed"):
        pytest.skip("deepspeed is not installed")
    rows = [row for row in dry_run_rows if row["part"] == "sharded" and row["engine"] == engine]
    assert len(rows) == 1, rows  # one row per run, appended to the step part's file
    row = rows[0]
    assert row["status"] == "ok", row
    assert (row["processes"], row["pairs"], row["steps"], row["loss"]) == ("1", "24", "2", "InfCLLoss")
    assert float(row["step_s"]) > 0 and math.isfinite(float(row["loss_value"]))


def test_the_batches_are_the_presets_length_and_end_in_eos():
    """Random token ids of exactly the preset's length with EOS last (what last-token pooling reads),
    and random texts the trained tokenizer cuts to that length (the Trainer's batches)."""
    pytest.importorskip("sentence_transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_st_decoder as bench

    script_args, args = bench.preset_arguments("qwen3-tiny", cpu=True)
    model = bench.build_model(script_args, "cpu")
    assert type(model[0].model).__name__ == "Qwen3Model" and model[1].pooling_mode == "lasttoken"
    generator = torch.Generator().manual_seed(0)
    columns = bench.token_columns(model, 5, script_args.max_seq_length, generator, "cpu")
    eos, vocabulary = model.tokenizer.eos_token_id, model[0].config.vocab_size
    assert len(columns) == 2 and not torch.equal(columns[0]["input_ids"], columns[1]["input_ids"])
    for column in columns:
        assert column["input_ids"].shape == (5, 64) and bool((column["attention_mask"] == 1).all())
        assert bool((column["input_ids"][:, -1] == eos).all()) and int(column["input_ids"].max()) < vocabulary
    with torch.no_grad():
        embeddings = model(dict(columns[0]))["sentence_embedding"]
    assert embeddings.shape == (5, 64) and torch.allclose(embeddings.norm(dim=-1), torch.ones(5))
    texts = bench.random_texts(4, script_args.max_seq_length + 16, seed=0)
    encoded = model.preprocess(texts)["input_ids"]
    assert encoded.shape == (4, 64) and bool((encoded[:, -1] == eos).all())  # cut to 64, EOS kept


def test_a_sharded_run_outside_torchrun_is_refused_before_any_work():
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK")}
    finished = subprocess.run([sys.executable, str(BENCH), "sharded", "--cpu"], env=env, capture_output=True,
                              text=True, timeout=120)
    assert finished.returncode == 2 and "runs under torchrun" in finished.stderr
