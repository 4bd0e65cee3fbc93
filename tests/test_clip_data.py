"""``examples/train_clip.py`` on real-data layouts: parquet and webdataset shards of the bundled
digits, streamed (``--streaming``) and in memory, in one process and in two (gloo); which rows
each process trained on is recorded by ``tests/clip_rows_worker.py``."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.clip_rows_worker import read_rows
from tests.offline import run_two_processes
from tests.test_examples import _digit_shards

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
WORKER = ROOT / "tests" / "clip_rows_worker.py"
BAD_ROWS = {"image does not decode": 1, "empty caption": 1}  # what _digit_shards puts in shard 0

pytest.importorskip("datasets")


# ---- in memory: every row once per epoch -------------------------------------------------------


@pytest.mark.parametrize("rows", [64, 51, 49, 33])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("equal_shares", [False, True])
def test_rank_batches_give_every_row_once_per_epoch(rows, world, equal_shares):
    from train_clip import RankBatches

    per_device = 16 // world + 1
    samplers = [RankBatches(rows, per_device, rank, world, seed=3, equal_shares=equal_shares)
                for rank in range(world)]
    orders = []
    for epoch in range(2):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        steps = [list(sampler) for sampler in samplers]
        assert len({len(s) for s in steps}) == 1 and len(steps[0]) == len(samplers[0])  # ranks in step
        shares = [[len(batch) for batch in rank_steps] for rank_steps in steps]
        for step_shares in zip(*shares):
            assert min(step_shares) >= 1 and max(step_shares) - min(step_shares) <= (0 if equal_shares else 1)
        seen = [row for rank_steps in steps for batch in rank_steps for row in batch]
        assert len(seen) == len(set(seen))  # nothing repeated
        left_out = rows - len(seen)
        assert left_out == (rows % world if equal_shares else 0), left_out  # nothing dropped
        orders.append(sorted(seen, key=seen.index))
    assert orders[0] != orders[1]  # each epoch is reshuffled
    resumed = RankBatches(rows, per_device, 0, world, seed=3, equal_shares=equal_shares)
    resumed.set_epoch(1, skip_batches=1)
    samplers[0].set_epoch(1)
    assert list(resumed) == list(samplers[0])[1:]


def test_two_processes_in_memory_train_on_every_row_once_per_epoch(tmp_path):
    """Parquet shards in memory, 2 gloo processes, 2 epochs: within each epoch the processes' rows
    are disjoint and together the whole train split; the last step's shares are uneven (51 rows,
    batches of 16: 3 + 3 rows split 2 + 1)."""
    parquet, _ = _digit_shards(tmp_path)
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    run_two_processes(WORKER, "--dataset", parquet, "--image_column", "image", "--output_dir", out,
                      "--max_train_samples", "51", "--global_batch_size", "16", "--max_steps", "8",
                      "--eval_steps", "0", env={"CLIP_ROWS_DIR": str(rows_dir)}, timeout=300)
    recorded = read_rows(rows_dir)
    for epoch in (0, 1):
        by_rank = [[r["index"] for r in recorded if (r["epoch"], r["rank"]) == (epoch, rank)]
                   for rank in (0, 1)]
        assert not set(by_rank[0]) & set(by_rank[1])
        together = by_rank[0] + by_rank[1]
        assert sorted(together) == list(range(51)), epoch
    results = json.loads((out / "eval_results.json").read_text())
    assert results["skipped_rows"] == BAD_ROWS


# ---- streaming -------------------------------------------------------------------------------


def stream_args(source, out, steps):
    parquet, tars = source
    data = (["--dataset", str(parquet), "--image_column", "image"] if steps[0] == "parquet"
            else ["--dataset", str(tars), "--image_column", "png", "--caption_column", "txt"])
    # 2 rows held out, so that the bad rows 3 and 5 of shard 0 reach the DataLoader workers
    return [*data, "--streaming", "--held_out_samples", "2", "--max_steps", str(steps[1]),
            "--per_device_train_batch_size", "4", "--shuffle_buffer_size", "8", "--eval_steps", "0",
            "--dataloader_num_workers", "2", "--output_dir", str(out)]


@pytest.mark.parametrize("layout", ["parquet", "webdataset"])
def test_streaming_one_process_reads_each_row_once_per_pass_and_counts_bad_rows(tmp_path, layout,
                                                                               monkeypatch):
    import train_clip

    from tests.clip_rows_worker import install

    source = _digit_shards(tmp_path)
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    monkeypatch.setenv("CLIP_ROWS_DIR", str(rows_dir))
    install(monkeypatch.setattr)  # DataLoader workers fork from this process: they record too
    # 2 shards of 30 rows, 2 held out, 2 bad: 56 good rows in 2 workers' batches of 4 = 13 full
    # batches a pass (each worker's last 2 rows wait for the next pass); 14 steps end in pass 2.
    train_clip.main(stream_args(source, out, (layout, 14)))
    recorded = read_rows(rows_dir)
    first_pass = [r["caption"] for r in recorded if r["epoch"] == 0]
    assert len(first_pass) == 13 * 4 and len(set(first_pass)) == len(first_pass)
    assert not any(caption.endswith((", row 0", ", row 1")) for caption in first_pass)  # held out
    results = json.loads((out / "eval_results.json").read_text())
    assert results["skipped_rows"] == BAD_ROWS
    assert len(results["train"]) >= 1 and results["final"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parquet", "webdataset"])
def test_streaming_two_processes_read_different_rows_and_count_bad_rows_once(tmp_path, layout):
    source = _digit_shards(tmp_path)
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    # one shard per process: 28 (26 good) and 30 rows, batches of 4, 8 steps cover a pass each
    run_two_processes(WORKER, *stream_args(source, out, (layout, 8)), env={"CLIP_ROWS_DIR": str(rows_dir)},
                      timeout=300)
    recorded = read_rows(rows_dir)
    by_rank = [{r["caption"] for r in recorded if r["rank"] == rank} for rank in (0, 1)]
    assert by_rank[0] and by_rank[1] and not by_rank[0] & by_rank[1]
    first_pass = Counter(r["caption"] for r in recorded if r["epoch"] == 0)
    assert max(first_pass.values()) == 1
    results = json.loads((out / "eval_results.json").read_text())
    assert results["skipped_rows"] == BAD_ROWS  # counted by one worker of one process, summed once
