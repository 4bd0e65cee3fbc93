"""One super-tile of the sigmoid loss's one pass, by each route, against one cuBLAS GEMM pass.

A super-tile of ``--rows x --keys`` logits at width ``--width`` (bf16, L2-normalised, scale 10,
bias -10) becomes G = sigmoid(z) in a bf16 buffer plus the row sums of G and of softplus(z):

  gluon   the Hopper kernel of ``hf_infcl.ops.triton.gluon_sigmoid`` (logits, G and sums in one
          kernel);
  gemm    a cuBLAS GEMM of fp16 copies into a buffer, then ``sigmoid_from_dots`` (the route
          ``TritonBlocks(sigmoid_logits="gemm")`` takes, and the default off Hopper);
  cublas  one plain bf16 GEMM [rows, c] x [c, keys] into the same buffer: the floor.

Medians of ``triton.testing.do_bench``, each route timed twice, interleaved, in one process.
It times internal kernels (``gluon_sigmoid.sigmoid_tile``, ``sigmoid_from_dots``) on their own
because the choice between the routes is made per super-tile: the loss's timings mix in the GEMMs
that follow.

    python benchmarks/bench_sigmoid_tile.py [--rows 8192 --keys 8192 --widths 512,768,1024]
"""

from __future__ import annotations

import argparse

import torch
import triton
from bench_common import Column, device_name, print_table  # this folder is on sys.path

from hf_infcl.ops.triton import gluon_sigmoid
from hf_infcl.ops.triton.sigmoid_from_dots import sigmoid_from_dots


def routes(rows: int, keys: int, width: int) -> dict:
    torch.manual_seed(0)
    queries = torch.nn.functional.normalize(torch.randn(rows, width, device="cuda"), dim=1).bfloat16()
    keys_ = torch.nn.functional.normalize(torch.randn(keys, width, device="cuda"), dim=1).bfloat16()
    scale, bias = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
    g = torch.empty((rows, keys), dtype=torch.bfloat16, device="cuda")
    row_sums, softplus_sums = torch.zeros(rows, device="cuda"), torch.zeros(rows, device="cuda")
    descriptors = (gluon_sigmoid.make_descriptor(queries, gluon_sigmoid.BLOCK_M),
                   gluon_sigmoid.make_descriptor(keys_, gluon_sigmoid.BLOCK_N))
    # The gemm route's operands: fp16 copies divided by 2 (|x| <= 1 here), G over the dot products.
    q16, k16 = (queries / 2).half(), (keys_ / 2).half()
    dots = torch.empty((rows, keys), dtype=torch.float16, device="cuda")

    def gluon():
        gluon_sigmoid.sigmoid_tile(queries, keys_, g, row_sums, softplus_sums, scale, bias, None,
                                   descriptors=descriptors)

    def gemm():
        torch.mm(q16, k16.T, out=dots)
        sigmoid_from_dots(dots, dots.view(torch.bfloat16), row_sums, softplus_sums, scale * 4, bias, None)

    def cublas():
        torch.mm(queries, keys_.T, out=g)

    return {"gluon": gluon, "gemm": gemm, "cublas": cublas}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--keys", type=int, default=8192)
    parser.add_argument("--widths", default="512,768,1024")
    args = parser.parse_args()
    if not (torch.cuda.is_available() and gluon_sigmoid.usable(
            torch.empty(1, 8, dtype=torch.bfloat16, device="cuda"),
            torch.empty(1, 8, dtype=torch.bfloat16, device="cuda"), has_mask=False)):
        raise SystemExit("needs a Hopper GPU and a Triton with Gluon")
    table = []
    for width in (int(w) for w in args.widths.split(",")):
        fns = routes(args.rows, args.keys, width)
        times = {name: [] for name in fns}
        for _ in range(2):
            for name, fn in fns.items():
                times[name].append(triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median"))
        floor = min(times["cublas"])
        for name, runs in times.items():
            table.append((width, name, 1e3 * min(runs), 1e3 * max(runs), min(runs) / floor))
    columns = [Column("c", 5), Column("route", 7, align="<"), Column("us", 8, ".1f"),
               Column("us, other run", 13, ".1f"), Column("x cublas", 9, ".2f")]
    print_table(columns, table, title=f"{device_name()}: one {args.rows} x {args.keys} super-tile, bf16")


if __name__ == "__main__":
    main()
