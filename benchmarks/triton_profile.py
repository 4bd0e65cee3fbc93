"""Where the Triton backend's time goes (a GPU script, not a test): forward and backward timed
apart, and a per-kernel table from torch.profiler, for one size. It reads one internal,
``hf_infcl.ops.triton.launch.TUNED_KERNELS``, to print the configuration each kernel was tuned to.

    python benchmarks/triton_profile.py --b 32768 --c 512 --dtype bf16
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from bench_common import one_size_parser  # this folder is on sys.path

from hf_infcl import contrastive_loss


def main():
    parser = one_size_parser(__doc__, rows=32768)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--tile-rows", type=int, default=None, help="backward super-tile rows")
    parser.add_argument("--tile-keys", type=int, default=None, help="backward super-tile keys")
    parser.add_argument("--sigmoid-logits", choices=["gemm", "fused"], default="gemm",
                        help="the sigmoid one pass's dot products: cuBLAS, or the fused kernel")
    parser.add_argument("--no-table", action="store_true", help="timings only")
    parser.add_argument("--rows", type=int, default=12, help="kernels listed in the table")
    parser.add_argument("--gaps", action="store_true",
                        help="also the GPU's idle time in one fwd+bwd, and its largest gaps")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    q = F.normalize(torch.randn(args.b, args.c, device="cuda"), dim=1).to(dtype).requires_grad_(True)
    k = F.normalize(torch.randn(args.b, args.c, device="cuda"), dim=1).to(dtype).requires_grad_(True)
    sigmoid = args.loss == "sigmoid"
    scale = torch.tensor(10.0 if sigmoid else 1 / 0.07, device="cuda", requires_grad=True)
    bias = torch.tensor(-10.0, device="cuda", requires_grad=True) if sigmoid else None
    parameters = [q, k, scale] + ([bias] if sigmoid else [])

    from hf_infcl.ops.triton import TritonBlocks

    blocks = TritonBlocks(tile_rows=args.tile_rows, tile_keys=args.tile_keys,
                          sigmoid_logits=args.sigmoid_logits)

    def forward():
        return contrastive_loss(q, k, scale, bias, loss=args.loss, backend=blocks, precision="tf32")

    def both():
        return torch.autograd.grad(forward(), parameters)

    both()  # compile and autotune
    fwd = triton.testing.do_bench(forward, return_mode="median")
    total = triton.testing.do_bench(both, return_mode="median")
    flops = 2 * args.b * args.b * args.c
    print(f"{args.loss} b={args.b} c={args.c} {args.dtype}: forward {fwd:.2f} ms, fwd+bwd {total:.2f} ms, "
          f"backward ~{total - fwd:.2f} ms; one GEMM pass at 700 TFLOP/s = {flops / 700e9:.2f} ms; "
          f"super-tile {args.tile_rows}x{args.tile_keys}"
          + (f", sigmoid dot products: {args.sigmoid_logits}" if sigmoid else ""))
    if args.no_table:
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        both()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    if args.gaps:
        print_gaps(both)
    from hf_infcl.ops.triton.launch import TUNED_KERNELS

    for kernel in TUNED_KERNELS:
        tuner = kernel.tuner
        print(kernel.name, {key: str(config) for key, config in getattr(tuner, "cache", {}).items()})
        timings = getattr(tuner, "configs_timings", None) or {}  # of the last tuning
        for config, times in sorted(timings.items(), key=lambda item: item[1][0]):
            print(f"    {times[0]:8.4f} ms  {config}")


def print_gaps(step, top: int = 12) -> None:
    """Where the GPU waits in one call of ``step``: the sum of the idle intervals between its
    kernels and the largest of them, each with the kernels on either side (a host-bound loop shows
    many small gaps; a host synchronisation, one gap after the kernel it waited for)."""
    import json
    import tempfile

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        with open(trace.name) as handle:
            events = json.load(handle)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if not kernels:
        print("no GPU events recorded")
        return
    gaps = []
    end = kernels[0]["ts"] + kernels[0]["dur"]
    for before, after in zip(kernels, kernels[1:]):
        if after["ts"] > end:
            gaps.append((after["ts"] - end, before["name"][:50], after["name"][:50]))
        end = max(end, after["ts"] + after["dur"])
    span = end - kernels[0]["ts"]
    busy = span - sum(g[0] for g in gaps)
    small = sum(g[0] for g in gaps if g[0] < 20)
    print(f"GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms in "
          f"{len(gaps)} gaps ({small / 1e3:.2f} ms in gaps under 20 us); {len(kernels)} GPU events")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap:9.1f} us  after {before}  before {after}")


if __name__ == "__main__":
    main()
