"""Host time of one loss step (forward + backward), against the materialised loss.

At small batches the GPU finishes a step's kernels faster than the host can issue them, so the
step time is the host's: its Python and, mostly, its CUDA launches (tens of microseconds each on
a server CPU). This script measures both sides for one size:

  step        median of ``triton.testing.do_bench`` (what ``bench_loss.py`` reports);
  host        the time to *issue* one step while the GPU is kept busy behind a long queue of
              matrix products, so nothing waits for the GPU. The loss's one host
              synchronisation (the argument check that reads ``logit_scale``) is switched off
              for this measurement only; a few steps are issued, well under CUDA's queue depth.

    python benchmarks/bench_host_time.py --b 8192 --c 512
    python benchmarks/bench_host_time.py --b 8192 --c 512 --loss sigmoid
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--b", type=int, default=8192)
    parser.add_argument("--c", type=int, default=512)
    parser.add_argument("--loss", choices=["softmax", "sigmoid"], default="softmax")
    parser.add_argument("--steps", type=int, default=5, help="steps issued behind the busy GPU")
    args = parser.parse_args()

    import triton

    import hf_infcl.loss as loss_module
    from hf_infcl import contrastive_loss

    q = F.normalize(torch.randn(args.b, args.c, device="cuda"), dim=1).bfloat16().requires_grad_(True)
    k = F.normalize(torch.randn(args.b, args.c, device="cuda"), dim=1).bfloat16().requires_grad_(True)
    sigmoid = args.loss == "sigmoid"
    scale = torch.tensor(10.0 if sigmoid else 1 / 0.07, device="cuda", requires_grad=True)
    bias = torch.tensor(-10.0, device="cuda", requires_grad=True) if sigmoid else None
    parameters = [q, k, scale] + ([bias] if sigmoid else [])
    labels = torch.arange(args.b, device="cuda")

    def ours():
        return torch.autograd.grad(contrastive_loss(q, k, scale, bias, loss=args.loss), parameters)

    def materialised():
        logits = scale.to(q.dtype) * q @ k.T
        if sigmoid:
            signs = 2 * torch.eye(args.b, device="cuda") - 1
            value = -F.logsigmoid(signs * (logits.float() + bias)).sum() / args.b
        else:
            value = (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels)) / 2
        return torch.autograd.grad(value, parameters)

    steps = {}
    for name, step in (("hf_infcl", ours), ("materialised", materialised)):
        for _ in range(3):  # compile, autotune, warm the allocator
            step()
        torch.cuda.synchronize()
        steps[name] = triton.testing.do_bench(step, return_mode="median")

    loss_module._check_values = lambda *arguments: None  # the one synchronisation, off from here
    busy = torch.randn(8192, 8192, device="cuda")
    hosts = {}
    for name, step in (("hf_infcl", ours), ("materialised", materialised)):
        torch.cuda.synchronize()
        for _ in range(25):  # ~0.5 s of GPU work queued ahead of the steps
            busy = busy @ busy
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        hosts[name] = (time.perf_counter() - start) / args.steps * 1e3
    torch.cuda.synchronize()

    print(f"{args.loss} loss, b={args.b}, c={args.c}, bf16, {torch.cuda.get_device_name()}")
    print(f"{'':14s}{'step ms':>10s}{'host ms':>10s}")
    for name in steps:
        print(f"{name:14s}{steps[name]:10.3f}{hosts[name]:10.3f}")


if __name__ == "__main__":
    main()
