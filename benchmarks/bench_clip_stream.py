"""The CLIP example at real scale: does the input pipeline keep the GPU busy?

Builds parquet shards of JPEG images the size of real web images (256 x 256, cropped to 224 by the
model's processor; drawn from scikit-learn's digits, coloured, with noise so that the files are as
large as photographs of that size), then trains a ViT-B/32-sized CLIP built from its config with
``accelerate launch examples/train_clip.py --streaming`` at a global batch of 32k pairs, gradient
caching in chunks of 256, bf16. The images are decoded and transformed in the DataLoader workers.

Reported, from the run's own ``eval_results.json`` (one point per step, ``--logging_steps 1``):
- pairs/s over the steps after the first (the first pays for compilation and autotuning);
- the data wait: the seconds the training loop was blocked waiting for the next batch, against the
  step time (the input pipeline is not the bottleneck when this is near 0);
- peak GPU memory (the run's final line).

    python benchmarks/bench_clip_stream.py                       # one H100: about 5 minutes
    python benchmarks/bench_clip_stream.py --tiny                # CPU smoke run of the whole script

Writes ``bench_clip_stream.csv`` (and the run's log) under $OUT when that is set (or --csv).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import CsvLog, csv_path, device_name, format_count, parse_count, versions

REPO = Path(__file__).resolve().parent.parent
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ["a photo of the number {}", "the digit {} written by hand", "a handwritten {}",
             "{} drawn in ink on paper", "a picture showing a {}"]

# CLIP ViT-B/32 (openai/clip-vit-base-patch32's architecture).
VIT_B_32 = {
    "projection_dim": 512,
    "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 12, "image_size": 224, "patch_size": 32},
    "text_config": {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                    "num_attention_heads": 8, "max_position_embeddings": 77},
}
TINY = {
    "projection_dim": 32,
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "image_size": 32, "patch_size": 16},
    "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "max_position_embeddings": 16},
}


def _shard(task) -> str:
    """One parquet shard of ``rows`` (JPEG bytes, caption) pairs, written to ``path``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    from sklearn.datasets import load_digits

    path, first_row, rows, size = task
    digits = load_digits()
    rng = np.random.default_rng(first_row)
    images, captions = [], []
    for row in range(first_row, first_row + rows):
        index = row % len(digits.images)
        ink = digits.images[index] / 16.0  # 8 x 8 in [0, 1]
        shape = np.asarray(Image.fromarray((ink * 255).astype(np.uint8)).resize((size, size), Image.BICUBIC))
        background = rng.uniform(0, 255, 3) * np.linspace(0.6, 1.0, size)[:, None, None]
        colour = rng.uniform(0, 255, 3)
        alpha = shape[..., None] / 255.0
        pixels = (1 - alpha) * background + alpha * colour + rng.normal(0, 12, (size, size, 3))
        encoded = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(encoded, format="JPEG", quality=90)
        images.append(encoded.getvalue())
        number = NUMBERS[digits.target[index]]
        captions.append(TEMPLATES[row % len(TEMPLATES)].format(number))
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "caption": captions}), path)
    return path


def build_shards(folder: Path, unique_rows: int, copies: int, rows_per_shard: int, size: int, workers: int):
    """``unique_rows`` pairs in shards, each shard also linked ``copies - 1`` more times under other
    names: the stream reads and decodes every copy anew, as it would other data."""
    folder.mkdir(parents=True, exist_ok=True)
    tasks = [(str(folder / f"part-{start // rows_per_shard:05d}.parquet"), start,
              min(rows_per_shard, unique_rows - start), size)
             for start in range(0, unique_rows, rows_per_shard)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        paths = pool.map(_shard, tasks)
    for copy in range(1, copies):
        for path in paths:
            os.link(path, path.replace("part-", f"copy{copy}-part-"))
    return sum(os.path.getsize(p) for p in paths) / unique_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="32k", help="global contrastive batch (one process)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--unique-rows", default="64k", help="distinct pairs written to the shards")
    parser.add_argument("--copies", type=int, default=4, help="times each shard is listed (linked)")
    parser.add_argument("--image-size", type=int, default=256, help="stored JPEG size (the model crops 224)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="DataLoader workers (default: CPU cores less two)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, batch 64, 3 steps")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.chunk_size, args.steps, args.unique_rows, args.copies = "64", 16, 3, "1024", 2
        args.image_size, args.workers = 40, 2
    batch, unique_rows = parse_count(args.batch), parse_count(args.unique_rows)
    if unique_rows * args.copies < batch * (args.steps + 1):
        sys.exit(f"--unique-rows x --copies must hold at least {args.steps + 1} batches")

    work = Path(tempfile.mkdtemp(prefix="bench_clip_stream_"))
    started = time.perf_counter()
    bytes_per_image = build_shards(work / "shards", unique_rows, args.copies, 2048 if not args.tiny else 64,
                                   args.image_size, workers=os.cpu_count() or 2)
    print(f"shards: {unique_rows} pairs x {args.copies} copies, {bytes_per_image / 1024:.1f} KiB per JPEG, "
          f"built in {time.perf_counter() - started:.0f} s", flush=True)
    config = work / "clip_config.json"
    config.write_text(json.dumps(TINY if args.tiny else VIT_B_32))

    output_dir = work / "run"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
        "--mixed_precision", "no" if args.tiny else "bf16",
        str(REPO / "examples" / "train_clip.py"),
        "--config_name", str(config), "--dataset", str(work / "shards"), "--image_column", "image",
        "--caption_column", "caption", "--streaming", "--max_steps", str(args.steps),
        "--per_device_train_batch_size", str(batch), "--chunk_size", str(args.chunk_size),
        "--dataloader_num_workers", str(args.workers), "--logging_steps", "1",
        "--output_dir", str(output_dir), "--seed", "0",
    ]
    if args.tiny:
        command += ["--use_cpu"]
    print(" ".join(command), flush=True)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    run = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_text = run.stdout
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_clip_stream_run.log").write_text(log_text)
    print(log_text[-6000:])
    if run.returncode != 0:
        sys.exit(f"train_clip.py failed with exit code {run.returncode}")

    points = json.loads((output_dir / "eval_results.json").read_text())["train"]
    # Cumulative training seconds at each step, from the cumulative pairs/s the run logs.
    elapsed = [point["step"] * batch / point["pairs_per_second"] for point in points]
    waits = [point["data_wait_seconds"] for point in points]
    step_seconds = [b - a for a, b in zip(elapsed, elapsed[1:])]
    step_waits = [b - a for a, b in zip(waits, waits[1:])]
    steady = statistics.median(step_seconds)
    peak = re.search(r"peak GPU memory ([\d.]+) GiB", log_text)
    row = {
        "device": device_name(), **versions("torch", "transformers", "datasets"),
        "batch": batch, "chunk_size": args.chunk_size, "workers": args.workers, "steps": len(points),
        "kib_per_jpeg": round(bytes_per_image / 1024, 1), "first_step_s": round(elapsed[0], 2),
        "step_s": round(steady, 3), "pairs_per_s": round(batch / steady), "data_wait_s": round(
            statistics.median(step_waits), 3), "data_wait_first_s": round(waits[0], 2),
        "peak_gpu_gib": float(peak.group(1)) if peak else None,
    }
    print(json.dumps(row))
    with CsvLog(csv_path(args.csv, "bench_clip_stream.csv"), list(row)) as log:
        log.write(row)
    print(f"\n{format_count(batch)} pairs per step, {args.workers} workers: {row['step_s']} s per step "
          f"after the first ({row['pairs_per_s']} pairs/s), waiting {row['data_wait_s']} s of it for data "
          f"({row['data_wait_s'] / steady:.0%}); first step {row['first_step_s']} s; peak GPU memory "
          f"{row['peak_gpu_gib']} GiB")


if __name__ == "__main__":
    main()
