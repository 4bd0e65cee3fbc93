"""Plot bench_ring.py results: how the ring scales with the number of GPUs.

One figure, two panels against the number of GPUs n (log 2): the peak memory per GPU above the
inputs, and the fwd + bwd step time. One line per global batch b (and per loss and per device when
the files hold several): the one-GPU row of a run is its point at n = 1, each "ring" row its point
at its world size. The dashed line of the same colour is the ideal, the one-GPU time / n. CSV
files from several runs (and machines) may be given together; a later row of the same (device,
loss, b, n) replaces an earlier one. Rows written before bench_ring had ``--loss`` are softmax.

    python benchmarks/plot_ring.py benchmarks/results/bench_ring_*.csv --out ring_scaling.png
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from pathlib import Path

sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # bench_common, run from anywhere

from bench_common import format_count  # noqa: E402


def read_points(paths: list[Path]) -> dict[tuple, dict[int, dict]]:
    """(device, loss kind, b) -> {n: row} from the "ring" (n = world size) and "one-gpu" (n = 1)
    rows of the files, later rows replacing earlier ones."""
    lines: dict[tuple, dict[int, dict]] = {}
    for path in paths:
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                if row["what"] not in ("ring", "one-gpu"):
                    continue
                n = 1 if row["what"] == "one-gpu" else int(row["world_size"])
                key = (row["device"], row.get("loss_kind") or "softmax", int(row["b"]))
                lines.setdefault(key, {})[n] = row
    return lines


def _value(row: dict, field: str) -> float:
    try:
        return float(row[field])
    except (KeyError, TypeError, ValueError):
        return math.nan


def plot(lines: dict[tuple, dict[int, dict]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("plotting needs matplotlib: pip install 'hf_infcl[bench]'") from error
    if not lines:
        raise SystemExit("no ring or one-gpu rows in the files")

    devices = sorted({device for device, _, _ in lines})
    losses = sorted({loss for _, loss, _ in lines})
    fig, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, ((device, loss, b), points) in enumerate(sorted(lines.items())):
        gpus = sorted(points)
        label = f"b = {format_count(b)}"
        if len(losses) > 1:
            label += f", {loss}"
        if len(devices) > 1:
            label += f", {device}"
        style = dict(color=colours[index % len(colours)], marker="o", label=label)
        memory_axis.plot(gpus, [_value(points[n], "peak_gib") for n in gpus], **style)
        time_axis.plot(gpus, [_value(points[n], "ms") / 1000 for n in gpus], **style)
        if 1 in points and len(gpus) > 1:  # the ideal: one GPU's time split n ways
            one_gpu = _value(points[1], "ms") / 1000
            time_axis.plot(gpus, [one_gpu / n for n in gpus], color=style["color"], linestyle="--",
                           linewidth=1)

    largest = max(n for points in lines.values() for n in points)
    for axis, ylabel in ((memory_axis, "peak memory per GPU above inputs (GiB)"),
                         (time_axis, "fwd + bwd step time (s); dashed: 1-GPU time / n")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        ticks = [2**i for i in range(int(math.log2(largest)) + 1)]
        axis.set_xticks(ticks, [str(t) for t in ticks])
        axis.set_xlabel("GPUs n (the global batch b split n ways)")
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
    dtypes = sorted({row["dtype"] for points in lines.values() for row in points.values()})
    widths = sorted({row["width"] for points in lines.values() for row in points.values()})
    fig.suptitle(f"The ring across GPUs: {' / '.join(losses)} loss, c = {', '.join(widths)}, "
                 f"{', '.join(dtypes)} — {'; '.join(devices)}")
    time_axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(out, dpi=150, bbox_inches="tight")
    print(f"wrote {out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="CSV files written by bench_ring.py")
    parser.add_argument("--out", type=Path, default=Path("ring_scaling.png"))
    args = parser.parse_args(argv)
    plot(read_points(args.inputs), args.out)


if __name__ == "__main__":
    main()
