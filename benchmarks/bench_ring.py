r"""The ring across GPUs: time and per-GPU memory of the symmetric softmax loss (or the sigmoid loss,
``--loss``) at a global batch, against one GPU at the same global batch, and how much of the
communication the compute hides.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_ring.py   # ring on 2 GPUs + 1-GPU rows
    torchrun --standalone --nproc_per_node 1 benchmarks/bench_ring.py   # 1-GPU rows only
    torchrun --standalone --nproc_per_node 4 benchmarks/bench_ring.py --sizes 256k,1m,4m \
        --one-gpu-max 1m --compute-max 1m                                # 4 GPUs, 4M without the slow rows
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_ring.py --loss both   # softmax and sigmoid

Every rank holds b/n L2-normalised rows and their b/n positive keys (bf16, c=768 by default) and
runs forward + backward of ``contrastive_loss(..., process_group=WORLD)`` (symmetric softmax, or
sigmoid with bias -10; scale 1/0.07; gradients of queries, keys, scale and bias). Rows of the
table, per loss and global b (the CSV's ``loss_kind``; ``loss`` is the loss's value):

  ring        one step on n GPUs: wall time (slowest rank), peak memory above the inputs (the
              largest over ranks; it includes the returned input gradients).
  compute     the same step with the ring's transfers switched off (``ring.schedule(transfer=
              False)``): every block computation, on blocks of the same shapes, no communication.
  comm        the same step with the block computations switched off (``ring.schedule(compute=
              False)``): the ring's transfers alone, the same batches of sends/receives.
  one-gpu     rank 0 alone on the whole global batch (``process_group=None``), same backend;
              the other ranks wait.

``exposed = ring - compute`` is the communication time the compute did not hide, and
``hidden = 1 - exposed / comm``. ``ring/one-gpu`` is the speed-up bar (<= 0.6 at b = 128k on two
GPUs) and ``mem ring/one-gpu`` the memory one (about 0.5). The ring and one-GPU losses are also
compared (the same global batch): ``loss_rel_diff``.

Times are medians of ``--iters`` steps after ``--warmup``. Sizes whose one-GPU step exceeds the
time budget are cut short (fewer iterations), so the whole run stays within a few minutes. CSV
rows go to ``$OUT/bench_ring.csv`` when ``OUT`` is set (or to ``--csv``); the table is printed last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torchrun puts this script's folder, not the repository, on sys.path: make the package
# importable from a plain checkout too (an installed one is found either way).
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import (  # this folder is on sys.path
    Column,
    device_name,
    format_count,
    parse_count,
    peak_above,
    print_table,
    time_steps,
    write_csv,
)

from hf_infcl import contrastive_loss  # noqa: E402
from hf_infcl.ops import ring  # noqa: E402
from hf_infcl.ops.logit_stats import select_block_ops  # noqa: E402

LOGIT_SCALE = 1 / 0.07
DEVICE = torch.device("cuda")  # "--cpu" (a dry run of this script over gloo) switches it
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SIGMOID_BIAS = -10.0  # SigLIP's initial bias
LOSS_CHOICES = {"softmax": ("softmax",), "sigmoid": ("sigmoid",), "both": ("softmax", "sigmoid")}


def timed(step, iters: int, warmup: int, group=None) -> list[float]:
    """Wall seconds of ``step`` per iteration, the slowest rank's, synchronised before and after."""
    return time_steps(step, iters, warmup, group=group, device=DEVICE)


def features(rows: int, width: int, dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    queries = F.normalize(torch.randn(rows, width, device=DEVICE, generator=gen), dim=1)
    keys = F.normalize(torch.randn(rows, width, device=DEVICE, generator=gen) + queries, dim=1)
    return queries.to(dtype), keys.to(dtype)


def loss_step(queries, keys, backend, group, loss_kind):
    """One forward + backward of the ``loss_kind`` loss ("softmax" or "sigmoid"); returns its value."""
    q = queries.detach().requires_grad_(True)
    k = keys.detach().requires_grad_(True)
    scale = torch.tensor(LOGIT_SCALE, device=DEVICE, requires_grad=True)
    bias = torch.tensor(SIGMOID_BIAS, device=DEVICE, requires_grad=True) if loss_kind == "sigmoid" else None
    loss = contrastive_loss(q, k, scale, bias, loss=loss_kind, process_group=group, backend=backend)
    grads = torch.autograd.grad(loss, [t for t in (q, k, scale, bias) if t is not None])
    del grads
    return loss.detach()


def compute_only_step(queries, keys, backend, group, loss_kind):
    """The ring's forward + backward with its transfers left out (``ring.schedule``): every block
    computation of the real schedule, on blocks of the real shapes."""
    with ring.schedule(transfer=False):
        return loss_step(queries, keys, backend, group, loss_kind)


def comm_only_step(queries, keys, backend, group, loss_kind):
    """The ring's forward + backward with its block computations left out: every transfer of the
    real schedule, with its sizes and order."""
    with ring.schedule(compute=False):
        return loss_step(queries, keys, backend, group, loss_kind)


_WARMED_UP = set()  # (loss, on one GPU, rows per process) of the steps whose first run has run


def measure_step(step, args, group=None, loss_kind="softmax", rows=0) -> tuple[list[float], int, float]:
    """(seconds per step, peak bytes above the inputs, loss) of ``step`` (which returns the loss),
    whose process holds ``rows`` rows.

    The first step gives all three. A step slower than ``--slow-step-s`` is not repeated (the
    large sizes would otherwise take minutes each); faster ones get ``--warmup`` + ``--iters``.
    """
    key = (loss_kind, group is None, rows)
    if key not in _WARMED_UP:
        # The first step of each loss and size compiles and autotunes its kernels (seconds per
        # kernel, tens of seconds on several processes). Each size is warmed up on its own: a larger
        # one may need other kernels (another tuning size class, or a recompilation where a
        # block's rows x keys passes 2^31), and a slow size's only timed step is its first. One
        # GPU and the ring run other kernels (the sigmoid loss on one GPU: the Gluon logits kernel).
        step()
        _WARMED_UP.add(key)
    first = []  # (peak bytes, loss) of the first measured step
    first_time = timed(lambda: first.append(peak_above(step)), 1, 0, group)
    peak, loss = first[0]
    if first_time[0] > args.slow_step_s:
        return first_time, peak, float(loss)
    return timed(step, args.iters, args.warmup, group), peak, float(loss)


def measure_ring(queries, keys, args, group, world_size: int, with_compute: bool,
                 loss_kind: str) -> list[dict]:
    """Rows "ring", "compute" (when ``with_compute``) and "comm" for one global batch."""
    def step(run):
        return lambda: run(queries, keys, args.backend, group, loss_kind)
    times, peak, loss = measure_step(step(loss_step), args, group, loss_kind, rows=queries.shape[0])
    memory = torch.tensor([peak], device=DEVICE, dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    ring_loss = torch.tensor([loss], device=DEVICE)
    dist.all_reduce(ring_loss)
    rows = [dict(what="ring", ms=1e3 * statistics.median(times), peak_gib=float(memory) / 2**30,
                 loss=float(ring_loss) / world_size)]
    iters, warmup = (1, 0) if len(times) == 1 else (args.iters, args.warmup)
    if with_compute:
        compute = timed(step(compute_only_step), iters, warmup, group)
        rows.append(dict(what="compute", ms=1e3 * statistics.median(compute)))
    comm = timed(step(comm_only_step), max(iters, 3), 1, group)
    rows.append(dict(what="comm", ms=1e3 * statistics.median(comm)))
    return rows


def measure_one_gpu(all_queries, all_keys, args, loss_kind: str) -> dict:
    """Row "one-gpu": the whole global batch on this GPU alone."""
    times, peak, loss = measure_step(lambda: loss_step(all_queries, all_keys, args.backend, None, loss_kind),
                                     args, loss_kind=loss_kind, rows=all_queries.shape[0])
    return dict(what="one-gpu", ms=1e3 * statistics.median(times), peak_gib=peak / 2**30, loss=loss)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=None,
                        help="global batch sizes b (default 64k,128k,256k; with --cpu 256,512)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--backend", default="auto", help="auto, triton or torch")
    parser.add_argument("--loss", choices=sorted(LOSS_CHOICES), default="softmax",
                        help="the symmetric softmax loss, the sigmoid loss (bias -10), or both in turn")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--slow-step-s", type=float, default=4.0,
                        help="a size whose first step takes longer than this is timed once")
    parser.add_argument("--no-one-gpu", action="store_true", help="skip the one-GPU rows")
    parser.add_argument("--one-gpu-max", default=None, help="largest b with a one-GPU row (default: all)")
    parser.add_argument("--compute-max", default=None,
                        help="largest b with a compute-only row (default: all; it costs one more step)")
    parser.add_argument("--csv", default=None, help="CSV path (default: $OUT/bench_ring.csv when OUT is set)")
    parser.add_argument("--cpu", action="store_true", help="dry run over gloo on CPU (tiny sizes)")
    args = parser.parse_args()
    if args.sizes is None:
        args.sizes = "256,512" if args.cpu else "64k,128k,256k"

    global DEVICE
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu:
        DEVICE = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        DEVICE = torch.device("cuda", local_rank)
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
    group = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    backend_name = type(select_block_ops(args.backend, DEVICE)).__name__
    csv_path = args.csv
    if csv_path is None and os.environ.get("OUT"):
        csv_path = os.path.join(os.environ["OUT"], "bench_ring.csv")
    device = device_name(DEVICE)
    rows = []

    sizes = [parse_count(s) for s in args.sizes.split(",")]
    for b in sizes:
        if b % world_size:
            raise SystemExit(f"global batch {b} is not divisible by {world_size} processes")
    for loss_kind, b in ((loss_kind, b) for loss_kind in LOSS_CHOICES[args.loss] for b in sizes):
        queries, keys = features(b // world_size, args.width, dtype, seed=rank)
        with_compute = args.compute_max is None or b <= parse_count(args.compute_max)
        measured = []
        if world_size > 1:
            measured = measure_ring(queries, keys, args, group, world_size, with_compute, loss_kind)
        if not args.no_one_gpu and (args.one_gpu_max is None or b <= parse_count(args.one_gpu_max)):
            # The same global batch on rank 0 alone: gather the ranks' features there.
            gathered_q = [torch.empty_like(queries) for _ in range(world_size)]
            gathered_k = [torch.empty_like(keys) for _ in range(world_size)]
            dist.all_gather(gathered_q, queries)
            dist.all_gather(gathered_k, keys)
            del queries, keys
            if rank == 0:
                all_queries, all_keys = torch.cat(gathered_q), torch.cat(gathered_k)
                del gathered_q, gathered_k
                single = measure_one_gpu(all_queries, all_keys, args, loss_kind)
                if measured:
                    single["loss_rel_diff"] = abs(measured[0]["loss"] - single["loss"]) / abs(single["loss"])
                measured.append(single)
                del all_queries, all_keys
            else:
                del gathered_q, gathered_k
            dist.barrier()
        for row in measured:
            rows.append(dict(b=b, world_size=world_size, width=args.width, dtype=args.dtype,
                             loss_kind=loss_kind, backend=backend_name, device=device,
                             torch=torch.__version__, **row))
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()

    if rank == 0:
        if write_csv(csv_path, rows):
            print(f"wrote {csv_path}", flush=True)
        for loss_kind in LOSS_CHOICES[args.loss]:
            print_results([row for row in rows if row["loss_kind"] == loss_kind], world_size)
    dist.destroy_process_group()
    return 0


def ratio(row, baseline, key):
    if not row or not baseline or not baseline.get(key):
        return None
    return row[key] / baseline[key]


def print_results(rows, world_size: int):
    by_size = {}
    for row in rows:
        by_size.setdefault(row["b"], {})[row["what"]] = row
    device = rows[0]["device"] if rows else "?"
    backend = rows[0]["backend"] if rows else "?"
    title = (f"\nring benchmark, {rows[0]['loss_kind'] if rows else '?'} loss: {world_size} x {device}, "
             f"backend {backend}, "
             f"c={rows[0]['width'] if rows else '?'}, {rows[0]['dtype'] if rows else '?'}")
    columns = [Column("b", 6)] + [
        Column(name, width, spec, missing="-")
        for name, width, spec in (("ring ms", 9, ".1f"), ("1-GPU ms", 9, ".1f"), ("ring/1GPU", 9, ".3f"),
                                  ("ring GiB", 9, ".3f"), ("1-GPU GiB", 9, ".3f"), ("mem ratio", 9, ".3f"),
                                  ("compute ms", 10, ".1f"), ("comm ms", 8, ".1f"), ("exposed ms", 10, ".1f"),
                                  ("hidden", 7, ".2f"), ("loss diff", 9, ".1e"))
    ]
    lines = []
    for b, entry in by_size.items():
        ring_row, single = entry.get("ring"), entry.get("one-gpu")
        compute, comm = entry.get("compute"), entry.get("comm")
        exposed = ring_row["ms"] - compute["ms"] if ring_row and compute else None
        hidden = None
        if exposed is not None and comm and comm["ms"] > 0:
            hidden = min(1.0, max(0.0, 1 - exposed / comm["ms"]))
        lines.append([
            format_count(b), ring_row and ring_row["ms"], single and single["ms"],
            ratio(ring_row, single, "ms"), ring_row and ring_row["peak_gib"], single and single["peak_gib"],
            ratio(ring_row, single, "peak_gib"), compute and compute["ms"], comm and comm["ms"], exposed,
            hidden, single and single.get("loss_rel_diff"),
        ])
    print_table(columns, lines, title=title)

if __name__ == "__main__":
    sys.exit(main())
