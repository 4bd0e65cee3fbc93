"""Plot bench_loss.py results in the style of the Inf-CL paper's Figure 1: peak memory and time
against batch size, log axes, one line per implementation, for one feature width.

Reads CSV files written by ``bench_loss.py --csv``, or Markdown files holding such rows in
```` ```csv ```` blocks. Later rows of the same (impl, b, c)
replace earlier ones. Rows that did not run (OOM, skipped) are marked on the memory panel's
top edge.

    python benchmarks/plot_loss.py benchmarks/results/bench_loss_softmax_sweep_h100.csv \
        benchmarks/results/bench_loss_h100.csv --width 512 --out loss_512.png
"""

from __future__ import annotations

import argparse
import csv
import io
import math
from pathlib import Path

# Draw order and labels; anything else in the data is drawn after these, under its own name.
LABELS = {
    "vanilla-fp32": "materialised fp32",
    "vanilla-bf16": "materialised bf16",
    "inf-cl": "inf-cl 1.2.1 (fp32→TF32)",
    "torch-tiled": "hf_infcl torch (bf16)",
    "triton-tf32-plain": "hf_infcl Triton, fp32 on TF32 cores",
    "triton-tf32": "hf_infcl Triton, fp32 (TF32 precision)",
    "triton-bf16": "hf_infcl Triton, bf16",
    "gemm-bf16": "one bf16 GEMM pass (reference)",
}


def read_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        text = path.read_text()
        if path.suffix == ".md":
            blocks = text.split("```csv")[1:]
            text = "".join(block.split("```")[0] for block in blocks)
            # Each block repeats the header; keep the first one only.
            lines = text.strip().splitlines()
            header = lines[0]
            text = "\n".join([header] + [line for line in lines[1:] if line != header])
        rows.extend(csv.DictReader(io.StringIO(text)))
    latest = {}
    for row in rows:
        latest[(row["impl"], int(row["b"]), int(row["c"]))] = row
    return list(latest.values())


def _value(row: dict, field: str) -> float:
    try:
        return float(row[field])
    except (KeyError, TypeError, ValueError):
        return math.nan


def plot(rows: list[dict], width: int, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("plotting needs matplotlib: pip install 'hf_infcl[bench]'") from error

    rows = [r for r in rows if int(r["c"]) == width]
    if not rows:
        raise SystemExit(f"no rows with c = {width}")
    impls = [name for name in LABELS if any(r["impl"] == name for r in rows)]
    impls += sorted({r["impl"] for r in rows} - set(impls))

    fig, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl in impls:
        mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: int(r["b"]))
        ran = [r for r in mine if r["status"] == "ok" or impl == "gemm-bf16"]
        sizes = [int(r["b"]) for r in ran]
        label = LABELS.get(impl, impl)
        style = dict(marker="o", linestyle="--" if impl == "gemm-bf16" else "-", label=label)
        if impl != "gemm-bf16":
            memory_axis.plot(sizes, [_value(r, "peak_mib_above_inputs") / 1024 for r in ran], **style)
            failed = [int(r["b"]) for r in mine if r["status"] == "OOM"]
            if failed:
                memory_axis.scatter(failed, [80] * len(failed), marker="x", color="black", zorder=3)
        time_axis.plot(sizes, [_value(r, "time_ms") / 1000 for r in ran], **style)

    for axis, ylabel in ((memory_axis, "peak memory above inputs (GiB)"), (time_axis, "fwd + bwd time (s)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("batch size b")
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
    memory_axis.axhline(80, color="grey", linewidth=0.8)
    memory_axis.text(memory_axis.get_xlim()[0], 80, " 80 GiB (H100); x = OOM", va="bottom", fontsize=8)
    device = rows[0].get("device") or ""
    fig.suptitle(f"Symmetric softmax loss, c = {width}, learnable scale" + (f" — {device}" if device else ""))
    time_axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    print(f"wrote {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="CSV files or Markdown files with ```csv blocks")
    parser.add_argument("--width", type=int, default=512, help="feature width c to plot")
    parser.add_argument("--out", type=Path, default=Path("loss_memory_time.png"))
    args = parser.parse_args(argv)
    plot(read_rows(args.inputs), args.width, args.out)


if __name__ == "__main__":
    main()
