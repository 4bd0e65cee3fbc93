"""CPU smoke tests of the ring benchmark: ``bench_ring.py --cpu`` (two gloo processes, both losses)
writes its CSV rows, and ``plot_ring.py`` reads such files (old ones without ``loss_kind`` too)
into one line per (device, loss, b) and draws the figure."""

from __future__ import annotations

import csv
import importlib.util
import os
import sys

import pytest

from tests.helpers.offline import run_two_processes

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import plot_ring  # noqa: E402  (benchmarks/ is put on the path above)

FIELDS = ("b", "backend", "device", "dtype", "loss", "loss_rel_diff", "ms", "peak_gib", "torch", "what",
          "width", "world_size")


def write_rows(path, rows, fields=FIELDS):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({field: row.get(field, "") for field in fields})


def row(b, what, n, ms, peak, device="GPU A", **extra):
    return dict(b=b, backend="TritonBlocks", device=device, dtype="bf16", loss=3.0, ms=ms, peak_gib=peak,
                torch="2.11", what=what, width=768, world_size=n, **extra)


def test_points_per_line_with_the_one_gpu_row_at_one(tmp_path):
    old = tmp_path / "old.csv"  # before --loss: no loss_kind column, softmax
    write_rows(old, [row(1024, "ring", 2, 60.0, 0.6), row(1024, "compute", 2, 55.0, ""),
                     row(1024, "one-gpu", 2, 100.0, 1.1), row(1024, "ring", 4, 99.0, 0.4)])
    new = tmp_path / "new.csv"  # a later run on another machine, with both losses
    write_rows(new, [row(1024, "ring", 4, 40.0, 0.3, loss_kind="softmax"),
                     row(1024, "ring", 4, 30.0, 0.2, device="GPU B", loss_kind="sigmoid"),
                     row(1024, "one-gpu", 4, 90.0, 0.9, device="GPU B", loss_kind="sigmoid")],
               fields=(*FIELDS, "loss_kind"))
    lines = plot_ring.read_points([old, new])
    assert sorted(lines) == [("GPU A", "softmax", 1024), ("GPU B", "sigmoid", 1024)]
    softmax = lines[("GPU A", "softmax", 1024)]
    assert sorted(softmax) == [1, 2, 4]
    assert float(softmax[1]["ms"]) == 100.0 and float(softmax[4]["ms"]) == 40.0  # the later row wins
    assert sorted(lines[("GPU B", "sigmoid", 1024)]) == [1, 4]
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the figure is not drawn")
    out = tmp_path / "ring.png"
    plot_ring.main([str(old), str(new), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_dry_run_of_both_losses_writes_rows_the_plot_reads(tmp_path):
    out = tmp_path / "bench_ring.csv"
    run_two_processes(os.path.join(BENCHMARKS, "bench_ring.py"), "--cpu", "--loss", "both", "--sizes", "64",
                      "--width", "32", "--iters", "1", "--warmup", "0", "--csv", out, timeout=300)
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["loss_kind"], r["what"]) for r in rows} == {
        (loss, what) for loss in ("softmax", "sigmoid") for what in ("ring", "compute", "comm", "one-gpu")}
    for r in rows:
        if r["what"] == "one-gpu":  # the ring and one process on the same global batch agree
            assert float(r["loss_rel_diff"]) < 1e-5, r
    lines = plot_ring.read_points([out])
    assert sorted(lines) == [("cpu", "sigmoid", 64), ("cpu", "softmax", 64)]
    assert all(sorted(points) == [1, 2] for points in lines.values())
