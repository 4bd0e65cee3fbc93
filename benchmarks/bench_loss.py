"""Forward + backward time and peak memory of the symmetric softmax (CLIP) loss, or of the sigmoid
(SigLIP) loss, on one GPU.

Every implementation computes the same thing: L2-normalised features q, k of shape [b, c] and a
learnable logit scale s (the exponential of a learnable log-scale, as CLIP and SigLIP train it);
``--loss softmax``: s = 1/0.07, loss = (CE(s q k^T) + CE(s k q^T)) / 2;
``--loss sigmoid``: s = 10 and a learnable bias t = -10,
loss = -(1/b) sum_ij log sigmoid(y_ij (s q_i.k_j + t)), y = +1 on the diagonal and -1 elsewhere;
the gradients of q, k, the log-scale (and the bias).

Times are ``triton.testing.do_bench`` medians (for runs over 0.5 s: the median of a
few event-timed runs, since do_bench would run them a dozen times). Memory is the peak above the
inputs: ``max_memory_allocated`` after a reset, minus what was allocated before the call (the
inputs), so it includes the input gradients the call returns.

Implementations:
  vanilla-fp32 / vanilla-bf16  materialised logits in plain torch (torch's default matmul
                               precision for fp32, i.e. no TF32); "OOM" when they do not fit.
  torch-tiled                  hf_infcl's tile-wise PyTorch backend (bf16 inputs; small b only).
  triton-bf16 / triton-tf32    hf_infcl's Triton backend on bf16 inputs, and on fp32 inputs with
                               precision="tf32" (its default route: scaled fp16 copies).
  triton-tf32-fp16             fp32 inputs as scaled fp16 copies, asked for by name
                               (TritonBlocks(tf32_via_fp16=True): TF32's mantissa at the fp16 rate).
  triton-tf32-kernels          fp32 inputs on TF32 tensor cores in the kernels
                               (TritonBlocks(tf32_via_fp16=False)).
  triton-bf16-gemm             sigmoid only: the one pass with each super-tile's dot products from a
                               cuBLAS GEMM and G from an elementwise kernel
                               (TritonBlocks(sigmoid_logits="gemm")), the default route where the
                               Gluon kernel (the default on Hopper GPUs) cannot run.
  triton-bf16-fused            sigmoid only: the one pass with the dot products computed inside the
                               gradient-tile kernel (TritonBlocks(sigmoid_logits="fused")).
  triton-bf16-stats-triton / triton-bf16-stats-gluon
                               softmax only: the forward's statistics from the Triton kernel or
                               from the Hopper (Gluon) kernel, asked for by name
                               (TritonBlocks(softmax_statistics=...)); "auto" picks by width and
                               work (rows x keys x c).
  inf-cl                       the published inf-cl (``cal_inf_loss`` both ways), when importable,
                               on a torch.distributed world of one process; skipped otherwise.
                               Softmax only.
  siglip-kernel                the published siglip-kernel (``fused_siglip_loss``, its default
                               route: cuBLAS GEMMs over row chunks and a fused Triton
                               elementwise kernel for bf16), when importable. Sigmoid only.
  gemm-bf16                    one bf16 GEMM pass [b, c] x [c, b]. Above b = 64k the b x b output
                               does not fit, so one row panel (output <= 4 GiB) is timed and
                               multiplied by the number of panels.

Each row also gives time / (n x gemm-bf16 of the same shape, same run), n the passes the loss needs
at the least: 4 for softmax (statistics, recompute, G K, G^T Q), 3 for sigmoid (logits, G K, G^T Q).
The Triton kernels are autotuned afresh for every (b, c), as a training run at that size would tune them.

    python benchmarks/bench_loss.py --sizes 32k,128k --widths 512,768 --csv out.csv
    python benchmarks/bench_loss.py --loss sigmoid --sizes 64k,128k --widths 768
"""

from __future__ import annotations

import argparse
import gc
import math
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

IMPLEMENTATIONS = ("vanilla-fp32", "vanilla-bf16", "torch-tiled", "triton-bf16", "triton-bf16-gemm",
                   "triton-bf16-fused", "triton-bf16-stats-triton", "triton-bf16-stats-gluon", "triton-tf32",
                   "triton-tf32-fp16", "triton-tf32-kernels", "inf-cl", "siglip-kernel")
# Implementations that compute only one of the losses.
ONLY_FOR = {"inf-cl": "softmax", "siglip-kernel": "sigmoid",
            "triton-bf16-gemm": "sigmoid", "triton-bf16-fused": "sigmoid",
            "triton-bf16-stats-triton": "softmax", "triton-bf16-stats-gluon": "softmax"}
# The least number of GEMM passes each loss needs (the "floor").
FLOOR_PASSES = {"softmax": 4, "sigmoid": 3}
DEFAULT_SIZES = "8k,32k,64k,128k,1m"
DEFAULT_WIDTHS = "512,768,1024"
LOGIT_SCALE = {"softmax": 1 / 0.07, "sigmoid": 10.0}
SIGMOID_BIAS = -10.0


# ----------------------------------------------------------------------------------------------
# The losses under test: each returns a callable doing forward + backward.


def vanilla_step(q, k, params, loss_kind):
    def step():
        qn, kn = F.normalize(q, dim=1), F.normalize(k, dim=1)
        logits = params[0].exp().to(qn.dtype) * qn @ kn.T
        if loss_kind == "sigmoid":
            logits = logits.float() + params[1]
            signs = 2 * torch.eye(q.shape[0], device=q.device) - 1
            loss = -F.logsigmoid(signs * logits).sum() / q.shape[0]
        else:
            labels = torch.arange(q.shape[0], device=q.device)
            loss = (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels)) / 2
        return torch.autograd.grad(loss, [q, k, *params])

    return step


def hf_infcl_step(q, k, params, loss_kind, backend, precision="auto"):
    from hf_infcl import contrastive_loss

    def step():
        loss = contrastive_loss(F.normalize(q, dim=1), F.normalize(k, dim=1), params[0].exp(),
                                params[1] if loss_kind == "sigmoid" else None, loss=loss_kind,
                                backend=backend, precision=precision)
        return torch.autograd.grad(loss, [q, k, *params])

    return step


def inf_cl_step(q, k, params):
    import torch.distributed as dist
    from inf_cl import cal_inf_loss  # an ImportError here means: not installed, skip

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)

    def step():
        qn, kn = F.normalize(q, dim=1), F.normalize(k, dim=1)
        scale = params[0].exp()
        loss = (cal_inf_loss(qn, kn, scale=scale) + cal_inf_loss(kn, qn, scale=scale)) / 2
        return torch.autograd.grad(loss, [q, k, *params])

    return step


def siglip_kernel_step(q, k, params):
    from siglip_kernel import fused_siglip_loss  # an ImportError here means: not installed, skip

    def step():
        # Its log_temperature argument is the log-scale; its loss is already divided by b.
        loss = fused_siglip_loss(F.normalize(q, dim=1), F.normalize(k, dim=1), params[0], params[1])
        return torch.autograd.grad(loss, [q, k, *params])

    return step


def make_step(impl, q32, k32, params, loss_kind):
    """(callable, input tensors) for an implementation, or raise ImportError to skip it."""
    half = q32.to(torch.bfloat16).requires_grad_(True), k32.to(torch.bfloat16).requires_grad_(True)
    full = q32.detach().clone().requires_grad_(True), k32.detach().clone().requires_grad_(True)
    if impl == "vanilla-fp32":
        return vanilla_step(*full, params, loss_kind), full
    if impl == "vanilla-bf16":
        return vanilla_step(*half, params, loss_kind), half
    if impl == "torch-tiled":
        return hf_infcl_step(*half, params, loss_kind, "torch"), half
    if impl == "triton-bf16":
        return hf_infcl_step(*half, params, loss_kind, "triton"), half
    if impl in ("triton-bf16-gemm", "triton-bf16-fused"):
        from hf_infcl import TritonBlocks

        route = impl.rsplit("-", 1)[1]
        return hf_infcl_step(*half, params, loss_kind, TritonBlocks(sigmoid_logits=route)), half
    if impl in ("triton-bf16-stats-triton", "triton-bf16-stats-gluon"):
        from hf_infcl import TritonBlocks

        blocks = TritonBlocks(softmax_statistics=impl.rsplit("-", 1)[1])
        return hf_infcl_step(*half, params, loss_kind, blocks), half
    if impl == "triton-tf32":
        return hf_infcl_step(*full, params, loss_kind, "triton", precision="tf32"), full
    if impl in ("triton-tf32-fp16", "triton-tf32-kernels"):
        from hf_infcl import TritonBlocks

        blocks = TritonBlocks(tf32_via_fp16=impl == "triton-tf32-fp16")
        return hf_infcl_step(*full, params, loss_kind, blocks, precision="tf32"), full
    if impl == "inf-cl":
        return inf_cl_step(*full, params), full
    if impl == "siglip-kernel":
        return siglip_kernel_step(*half, params), half
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


def run(sizes, widths, impls, tiled_max, csv_path, max_b_for_all, loss_kind="softmax"):
    device = torch.device("cuda")
    meta = dict(device=device_name(device), **versions("torch", "triton"), loss=loss_kind)
    rows = []
    fields = ["device", "torch", "triton", "loss", "impl", "b", "c", "time_ms", "peak_mib_above_inputs",
              "input_grad_mib", "x_floor", "gemm_ms", "status"]
    impls = [impl for impl in impls if ONLY_FOR.get(impl, loss_kind) == loss_kind]
    with CsvLog(csv_path, fields) as log:
        sweep(sizes, widths, impls, tiled_max, max_b_for_all, device, meta, rows, log)
    print_results(rows, meta)
    return rows


def learnable_parameters(loss_kind: str, device) -> list[torch.Tensor]:
    """[log-scale] for softmax, [log-scale, bias] for sigmoid: fresh leaves for each run."""
    params = [torch.tensor(math.log(LOGIT_SCALE[loss_kind]), device=device, requires_grad=True)]
    if loss_kind == "sigmoid":
        params.append(torch.tensor(SIGMOID_BIAS, device=device, requires_grad=True))
    return params


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
                params = learnable_parameters(meta["loss"], device)
                status, ms, mib, grad_mib = "ok", float("nan"), float("nan"), float("nan")
                try:
                    step, inputs = make_step(impl, q32, k32, params, meta["loss"])
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
    floor = FLOOR_PASSES[meta["loss"]] * gemm_ms
    row = dict(meta, impl=impl, b=b, c=c, time_ms=round(ms, 3), peak_mib_above_inputs=round(mib, 1),
               input_grad_mib=round(grad_mib, 1), x_floor=round(ms / floor, 2) if gemm_ms else "",
               gemm_ms=round(gemm_ms, 3), status=status)
    rows.append(row)
    log.write(row)
    print(f"[{time.strftime('%H:%M:%S')}] {impl:13s} b={format_count(b):>5s} c={c:<5d} "
          f"{ms:10.3f} ms {mib:10.1f} MiB  x_floor={row['x_floor']}  {status}", file=sys.stderr, flush=True)


def print_results(rows, meta):
    columns = [Column("impl", 13, align="<"), Column("b", 5), Column("c", 5), Column("ms", 10, ".2f"),
               Column("MiB>in", 9, ".0f"), Column("grad MiB", 9, ".0f"), Column("x floor", 7),
               Column("status", align="<", gap="  ")]
    print_table(columns, [(r["impl"], format_count(r["b"]), r["c"], r["time_ms"], r["peak_mib_above_inputs"],
                           r["input_grad_mib"], str(r["x_floor"]), r["status"]) for r in rows],
                title=f"\n{meta['loss']} loss | {meta['device']} | torch {meta['torch']} "
                      f"| triton {meta['triton']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", choices=tuple(FLOOR_PASSES), default="softmax",
                        help="softmax (symmetric InfoNCE) or sigmoid (SigLIP)")
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
        parse_count(args.tiled_max), args.csv, parse_count(args.all_max), args.loss)


if __name__ == "__main__":
    main()
