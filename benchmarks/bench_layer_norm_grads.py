"""LayerNorm's backward at a cached step's chunk sizes: PyTorch's, and with the weight and bias
gradients from ``hf_infcl.ops.layer_norm`` (the Triton kernel over every SM).

Each row times one LayerNorm's forward and backward (input, weight and bias gradients) under
bf16 autocast, as CLIP's towers run it, captured in a CUDA graph as the cached step runs it
(``triton.testing.do_bench_cudagraph``, median), PyTorch's and ours in the same run. The shapes
are a CLIP ViT-B/32's at chunk 256 (256 images x 50 patches, 768 wide; 256 texts x 77 tokens,
512 wide) and at the whole batch of 1,536 pairs, where PyTorch's own backward splits the rows
(above 64 x 1024 rows) and ours is not used. The MiB column is what the backward must at least
read (input, output gradient) and write (input gradient), in fp32.

    python benchmarks/bench_layer_norm_grads.py
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch
from bench_common import (  # this folder is on sys.path
    Column,
    csv_path,
    device_name,
    print_table,
    versions,
    write_csv,
)

SHAPES = {  # name: (rows, width)
    "vision, chunk 256": (256 * 50, 768),
    "text, chunk 256": (256 * 77, 512),
    "vision, batch 1536": (1536 * 50, 768),
    "text, batch 1536": (1536 * 77, 512),
}


def step(x: torch.Tensor, grad: torch.Tensor, norm: torch.nn.LayerNorm, mode) -> None:
    x = x.detach().requires_grad_()
    with mode(), torch.autocast("cuda", torch.bfloat16):
        out = norm(x)
    torch.autograd.backward(out, grad)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()

    import triton

    from hf_infcl.ops.layer_norm import split_affine_grads

    rows = []
    for name, (n_rows, width) in SHAPES.items():
        norm = torch.nn.LayerNorm(width, device="cuda")
        x = torch.randn(n_rows, width, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(n_rows, width, device="cuda")
        times = {}
        for label, mode in (("pytorch", contextlib.nullcontext), ("ours", split_affine_grads)):
            call = functools.partial(step, x, grad, norm, mode)
            times[label] = triton.testing.do_bench_cudagraph(call, return_mode="median")
        megabytes = 3 * n_rows * width * 4 / 2**20
        rows.append({"shape": name, "rows": n_rows, "width": width, "min_read_write_mib": round(megabytes),
                     "pytorch_ms": times["pytorch"], "ours_ms": times["ours"],
                     "speedup": times["pytorch"] / times["ours"], "device": device_name(),
                     **versions("torch", "triton")})
    print(f"LayerNorm forward + backward, bf16 autocast, {device_name()}, {versions('torch', 'triton')}")
    columns = [Column("shape", 20, align="<"), Column("rows", 7), Column("width", 6), Column("MiB", 5),
               Column("PyTorch ms", 11, ".3f"), Column("ours ms", 8, ".3f"), Column("speed-up", 9, ".2f")]
    print_table(columns, [[row["shape"], row["rows"], row["width"], row["min_read_write_mib"],
                           row["pytorch_ms"], row["ours_ms"], row["speedup"]] for row in rows])
    write_csv(csv_path(args.csv, "bench_layer_norm_grads.csv"), rows)


if __name__ == "__main__":
    main()
