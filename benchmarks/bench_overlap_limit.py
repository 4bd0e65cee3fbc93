"""How much of the tensor cores' rate a kernel keeps while it takes an exponential per logit.

The softmax loss's passes, like attention's forward, multiply tiles and then run an elementwise
epilogue (exponentials, maxima, sums) on each logit. Whether that epilogue can hide under the
next tile's MMAs decides how close to the GEMM floor such a kernel can get. This script measures
it on the GPU at hand, in TFLOP/s of tensor-core work, all in one process:

  gemm          one bf16 GEMM 8192 x 8192 x 8192: the rate with no epilogue;
  attention     ``scaled_dot_product_attention``'s forward (bf16, no mask) through cuDNN and
                through FlashAttention-2 as torch ships them, at head widths d (one exponential
                per logit, 2d multiply-adds per logit: QK^T and PV);
  unfused       the same two products as two batched GEMMs with the logits written out;
  statistics    hf_infcl's forward of the softmax loss (its statistics pass: one product per
                logit, c multiply-adds; two exponentials per logit when symmetric, one otherwise).

"MACs/exp" is the multiply-adds per exponential: the fewer, the heavier the epilogue against the
MMAs. A kernel that hides its epilogue keeps near the GEMM rate even at few MACs per exponential.
Medians of ``triton.testing.do_bench``.

    python benchmarks/bench_overlap_limit.py [--heads 32 --sequence 8192 --head-widths 64,128,256]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from bench_common import Column, csv_path, device_name, parse_count, print_table, versions, write_csv

from hf_infcl import contrastive_loss


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def gemm_row() -> tuple:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = bench_ms(lambda: a @ b)
    return ("gemm", "8192^3", None, ms, 2 * 8192**3 / ms / 1e9)


def attention_rows(heads: int, sequence: int, head_width: int) -> list[tuple]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(1, heads, sequence, head_width, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flops = 4 * heads * sequence * sequence * head_width
    shape = f"{heads}x{sequence}, d={head_width}"
    rows = []
    for name, backend in (("attention, cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("attention, FA2", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ms = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v))
        except RuntimeError as error:  # a backend this build or GPU lacks
            print(f"{name}, {shape}: not run ({str(error).splitlines()[0][:100]})")
            continue
        rows.append((name, shape, 2 * head_width, ms, flops / ms / 1e9))
    flat = [t.reshape(heads, sequence, head_width) for t in (q, k, v)]
    logits = torch.empty(heads, sequence, sequence, device="cuda", dtype=torch.bfloat16)
    ms = (bench_ms(lambda: torch.bmm(flat[0], flat[1].transpose(1, 2), out=logits))
          + bench_ms(lambda: torch.bmm(logits, flat[2])))
    rows.append(("unfused QK^T, PV", shape, None, ms, flops / ms / 1e9))
    return rows


def statistics_row(rows: int, width: int, symmetric: bool) -> tuple:
    queries, keys = (F.normalize(torch.randn(rows, width, device="cuda"), dim=1).bfloat16() for _ in range(2))
    with torch.no_grad():
        ms = bench_ms(lambda: contrastive_loss(queries, keys, 20.0, symmetric=symmetric))
    name = "statistics, " + ("symmetric" if symmetric else "one direction")
    return (name, f"{rows // 1024}k x {width}", width // 2 if symmetric else width, ms,
            2 * rows * rows * width / ms / 1e9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32, help="attention heads (batch 1)")
    parser.add_argument("--sequence", type=parse_count, default=8192, help="attention sequence length")
    parser.add_argument("--head-widths", default="64,128,256")
    parser.add_argument("--b", type=parse_count, default=32768, help="the loss's rows and keys")
    parser.add_argument("--widths", default="128,512,768", help="the loss's feature widths")
    parser.add_argument("--csv", default=None, help="CSV path (default: $OUT/bench_overlap_limit.csv)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    table = [gemm_row()]
    for head_width in (int(w) for w in args.head_widths.split(",")):
        table += attention_rows(args.heads, args.sequence, head_width)
    for width in (int(w) for w in args.widths.split(",")):
        table += [statistics_row(args.b, width, symmetric) for symmetric in (True, False)]
    peak = table[0][4]
    info = versions("torch", "triton")
    print(f"{device_name()} | torch {info['torch']} | Triton {info['triton']} "
          f"| cuDNN {torch.backends.cudnn.version()}")
    columns = [Column("kernel", 26, align="<"), Column("shape", 18, align="<"), Column("MACs/exp", 8),
               Column("ms", 8, ".3f"), Column("TFLOP/s", 7, ".0f"), Column("x gemm", 6, ".0%")]
    print_table(columns, [(*row, row[4] / peak) for row in table])
    fields = ["device", "kernel", "shape", "macs_per_exp", "ms", "tflops", "of_gemm"]
    write_csv(csv_path(args.csv, "bench_overlap_limit.csv"),
              [dict(zip(fields, (device_name(), *row, row[4] / peak))) for row in table], fields)


if __name__ == "__main__":
    main()
