"""Forward + backward time and peak memory of the symmetric softmax (CLIP) loss on one GPU.

Every implementation computes the same thing: L2-normalised features q, k of shape [b, c], a
learnable logit scale s = 1/0.07, loss = (CE(s q k^T) + CE(s k q^T)) / 2, and the gradients of
q, k and s. Times are ``triton.testing.do_bench`` medians (for runs over 0.5 s: the median of a
few event-timed runs, since do_bench would run them a dozen times). Memory is the peak above the
inputs: ``max_memory_allocated`` after a reset, minus what was allocated before the call (the
inputs), so it includes the input gradients the call returns.

Implementations:
  vanilla-fp32 / vanilla-bf16  materialised logits in plain torch (torch's default matmul
                               precision for fp32, i.e. no TF32); "OOM" when they do not fit.
  torch-tiled                  hf_infcl's tile-wise PyTorch backend (bf16 inputs; small b only).
  triton-bf16 / triton-tf32    hf_infcl's Triton backend on bf16 inputs, and on fp32 inputs with
                               precision="tf32" (the default: TF32 tensor cores).
  triton-tf32-fp16             fp32 inputs as scaled fp16 copies (TritonBlocks(tf32_via_fp16=True),
                               opt-in: TF32's mantissa at the fp16 rate).
  inf-cl                       the published inf-cl (``cal_inf_loss`` both ways), when importable,
                               on a torch.distributed world of one process; skipped otherwise.
  gemm-bf16                    one bf16 GEMM pass [b, c] x [c, b]. Above b = 64k the b x b output
                               does not fit, so one row panel (output <= 4 GiB) is timed and
                               multiplied by the number of panels.

Each row also gives time / (4 x gemm-bf16 of the same shape, same run). The Triton kernels are
autotuned afresh for every (b, c), as a training run at that size would tune them.

    python benchmarks/bench_loss.py --sizes 32k,128k --widths 512,768 --csv out.csv
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from bench_common import (  # this folder is on sys.path
    Column,
    CsvLog,
    device_name,
    format_count,
    is_out_of_memory,
    parse_count,
    peak_above,
    print_table,
    versions,
)

from hf_infcl.ops import reset_autotuning

IMPLEMENTATIONS = ("vanilla-fp32", "vanilla-bf16", "torch-tiled", "triton-bf16", "triton-tf32",
                   "triton-tf32-fp16", "inf-cl")
DEFAULT_SIZES = "8k,32k,64k,128k,1m"
DEFAULT_WIDTHS = "512,768,1024"
LOGIT_SCALE = 1 / 0.07


# ----------------------------------------------------------------------------------------------
# The losses under test: each returns a callable doing forward + backward.


def vanilla_step(q, k, scale):
    def step():
        qn, kn = F.normalize(q, dim=1), F.normalize(k, dim=1)
        logits = scale.to(qn.dtype) * qn @ kn.T
        labels = torch.arange(q.shape[0], device=q.device)
        loss = (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels)) / 2
        return torch.autograd.grad(loss, [q, k, scale])

    return step


def hf_infcl_step(q, k, scale, backend, precision="auto"):
    from hf_infcl import contrastive_loss

    def step():
        loss = contrastive_loss(F.normalize(q, dim=1), F.normalize(k, dim=1), scale, backend=backend,
                                precision=precision)
        return torch.autograd.grad(loss, [q, k, scale])

    return step


def inf_cl_step(q, k, scale):
    import torch.distributed as dist
    from inf_cl import cal_inf_loss  # an ImportError here means: not installed, skip

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)

    def step():
        qn, kn = F.normalize(q, dim=1), F.normalize(k, dim=1)
        loss = (cal_inf_loss(qn, kn, scale=scale) + cal_inf_loss(kn, qn, scale=scale)) / 2
        return torch.autograd.grad(loss, [q, k, scale])

    return step


def make_step(impl, q32, k32, scale):
    """(callable, input bytes) for an implementation, or raise ImportError to skip it."""
    half = q32.to(torch.bfloat16).requires_grad_(True), k32.to(torch.bfloat16).requires_grad_(True)
    full = q32.detach().clone().requires_grad_(True), k32.detach().clone().requires_grad_(True)
    if impl == "vanilla-fp32":
        return vanilla_step(*full, scale), full
    if impl == "vanilla-bf16":
        return vanilla_step(*half, scale), half
    if impl == "torch-tiled":
        return hf_infcl_step(*half, scale, "torch"), half
    if impl == "triton-bf16":
        return hf_infcl_step(*half, scale, "triton"), half
    if impl == "triton-tf32":
        return hf_infcl_step(*full, scale, "triton", precision="tf32"), full
    if impl == "triton-tf32-fp16":
        from hf_infcl.ops.triton_blocks import TritonBlocks

        return hf_infcl_step(*full, scale, TritonBlocks(tf32_via_fp16=True), precision="tf32"), full
    if impl == "inf-cl":
        return inf_cl_step(*full, scale), full
    raise ValueError(f"unknown implementation {impl!r}")


# ----------------------------------------------------------------------------------------------
# Measurement


def time_ms(fn) -> float:
    """Median time of fn in ms, after one warm-up call (compilation, autotuning)."""
    import triton

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = start.elapsed_time(end)
    if once < 500:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    times = [once]
    for _ in range(2 if once < 5000 else 0):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib_above_inputs(fn) -> float:
    gc.collect()
    return peak_above(fn)[0] / 2**20


def gemm_pass_ms(b: int, c: int, device) -> tuple[float, str]:
    """One bf16 GEMM pass of [b, c] x [c, b]; by row panels when the output exceeds 4 GiB."""
    import triton

    panel = min(b, max(1024, (4 * 2**30) // (2 * b)))
    a = torch.randn(panel, c, device=device, dtype=torch.bfloat16)
    bt = torch.randn(c, b, device=device, dtype=torch.bfloat16)
    out = torch.empty(panel, b, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: torch.matmul(a, bt, out=out), warmup=25, rep=100,
                                 return_mode="median")
    panels = b / panel
    how = "whole" if panel == b else f"panel {panel} rows x {panels:g}"
    return float(ms) * panels, how


def run(sizes, widths, impls, tiled_max, csv_path, max_b_for_all):
    device = torch.device("cuda")
    meta = dict(device=device_name(device), **versions("torch", "triton"))
    rows = []
    fields = ["device", "torch", "triton", "impl", "b", "c", "time_ms", "peak_mib_above_inputs",
              "input_grad_mib", "x_4gemm", "gemm_ms", "status"]
    with CsvLog(csv_path, fields) as log:
        sweep(sizes, widths, impls, tiled_max, max_b_for_all, device, meta, rows, log)
    print_results(rows, meta)
    return rows


def sweep(sizes, widths, impls, tiled_max, max_b_for_all, device, meta, rows, log):
    for b in sizes:
        for c in widths:
            # Each size tuned for itself, as a training run at that size would be (the tuning keys
            # are coarse: 64k and 128k would otherwise reuse the configs tuned at 32k).
            reset_autotuning()
            gemm_ms, how = gemm_pass_ms(b, c, device)
            record(rows, log, meta, "gemm-bf16", b, c, gemm_ms, float("nan"), float("nan"), gemm_ms, how)
            gen = torch.Generator(device=device).manual_seed(b + c)
            q32 = torch.randn(b, c, device=device, generator=gen)
            k32 = torch.randn(b, c, device=device, generator=gen)
            for impl in impls:
                if impl == "torch-tiled" and b > tiled_max:
                    continue
                if b > max_b_for_all and impl not in ("triton-bf16",):
                    continue
                scale = torch.tensor(LOGIT_SCALE, device=device, requires_grad=True)
                status, ms, mib, grad_mib = "ok", float("nan"), float("nan"), float("nan")
                try:
                    step, inputs = make_step(impl, q32, k32, scale)
                    grad_mib = sum(x.numel() * x.element_size() for x in inputs) / 2**20
                    ms = time_ms(step)
                    mib = peak_mib_above_inputs(step)
                except ImportError as error:
                    status = f"skipped: {error}"
                except Exception as error:  # noqa: BLE001 - an OOM is a result
                    if not is_out_of_memory(error):
                        raise
                    status = "OOM"
                finally:
                    step = inputs = None
                    gc.collect()
                    torch.cuda.empty_cache()
                record(rows, log, meta, impl, b, c, ms, mib, grad_mib, gemm_ms, status)
            del q32, k32
            gc.collect()
            torch.cuda.empty_cache()


def record(rows, log, meta, impl, b, c, ms, mib, grad_mib, gemm_ms, status):
    row = dict(meta, impl=impl, b=b, c=c, time_ms=round(ms, 3), peak_mib_above_inputs=round(mib, 1),
               input_grad_mib=round(grad_mib, 1), x_4gemm=round(ms / (4 * gemm_ms), 2) if gemm_ms else "",
               gemm_ms=round(gemm_ms, 3), status=status)
    rows.append(row)
    log.write(row)
    print(f"[{time.strftime('%H:%M:%S')}] {impl:13s} b={format_count(b):>5s} c={c:<5d} "
          f"{ms:10.3f} ms {mib:10.1f} MiB  x4gemm={row['x_4gemm']}  {status}", file=sys.stderr, flush=True)


def print_results(rows, meta):
    columns = [Column("impl", 13, align="<"), Column("b", 5), Column("c", 5), Column("ms", 10, ".2f"),
               Column("MiB>in", 9, ".0f"), Column("grad MiB", 9, ".0f"), Column("x4gemm", 7),
               Column("status", align="<", gap="  ")]
    print_table(columns, [(r["impl"], format_count(r["b"]), r["c"], r["time_ms"], r["peak_mib_above_inputs"],
                           r["input_grad_mib"], str(r["x_4gemm"]), r["status"]) for r in rows],
                title=f"\n{meta['device']} | torch {meta['torch']} | triton {meta['triton']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="batch sizes b, e.g. 8k,32k,1m")
    parser.add_argument("--widths", default=DEFAULT_WIDTHS, help="feature widths c")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS), help="implementations to run")
    parser.add_argument("--tiled-max", default="8k", help="largest b for the (slow) torch-tiled backend")
    parser.add_argument("--all-max", default="128k",
                        help="above this b only triton-bf16 runs (the others OOM or take minutes)")
    parser.add_argument("--csv", default=None, help="write CSV rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = set(impls) - set(IMPLEMENTATIONS)
    if unknown:
        parser.error(f"unknown implementations {sorted(unknown)}; choose from {IMPLEMENTATIONS}")
    run([parse_count(s) for s in args.sizes.split(",")], [int(w) for w in args.widths.split(",")], impls,
        parse_count(args.tiled_max), args.csv, parse_count(args.all_max))


if __name__ == "__main__":
    main()
