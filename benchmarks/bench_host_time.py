"""Host time of one loss step (forward + backward), against the materialised loss.

At small batches the GPU finishes a step's kernels faster than the host can issue them, so the
step time is the host's: its Python and, mostly, its CUDA launches (tens of microseconds each on
a server CPU). This script measures both sides for one size:

  step        median of ``triton.testing.do_bench`` of ``bench_loss.py``'s own steps
              (``triton-bf16`` and ``vanilla-bf16``: features normalised in the step, a learnable
              log-scale, and a bias for sigmoid);
  host        the time to *issue* one step while the GPU is kept busy behind a long queue of
              matrix products, so nothing waits for the GPU. The loss's one host
              synchronisation (the argument check that reads ``logit_scale``) is switched off
              for this measurement only; a few steps are issued, well under CUDA's queue depth.

    python benchmarks/bench_host_time.py --b 8192 --c 512
    python benchmarks/bench_host_time.py --b 8192 --c 512 --loss sigmoid
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--b", type=int, default=8192)
    parser.add_argument("--c", type=int, default=512)
    parser.add_argument("--loss", choices=["softmax", "sigmoid"], default="softmax")
    parser.add_argument("--steps", type=int, default=5, help="steps issued behind the busy GPU")
    args = parser.parse_args()

    import triton
    from bench_loss import learnable_parameters, make_step  # this folder is on sys.path

    import hf_infcl.ops.spec as spec_module

    q32 = torch.randn(args.b, args.c, device="cuda")
    k32 = torch.randn(args.b, args.c, device="cuda")
    # The steps bench_loss.py times: hf_infcl by name, and the materialised loss, both bf16.
    steps = {name: make_step(impl, q32, k32, learnable_parameters(args.loss, "cuda"), args.loss)[0]
             for name, impl in (("hf_infcl", "triton-bf16"), ("materialised", "vanilla-bf16"))}
    step_ms = {}
    for name, step in steps.items():
        for _ in range(3):  # compile, autotune, warm the allocator
            step()
        torch.cuda.synchronize()
        step_ms[name] = triton.testing.do_bench(step, return_mode="median")

    # The one synchronisation (the check that reads values), off from here, in every module that
    # imported it: where it runs depends on the route (before the ring, or at the op's start).
    checks = [(module, name) for module in list(sys.modules.values())
              if (module.__name__ or "").startswith("hf_infcl")
              for name, value in vars(module).items() if value is spec_module.check_values]
    if not checks:
        raise RuntimeError("found no check to switch off: the host time would include a synchronisation")
    for module, name in checks:
        setattr(module, name, lambda *arguments: None)
    busy = torch.randn(8192, 8192, device="cuda")
    host_ms = {}
    for name, step in steps.items():
        torch.cuda.synchronize()
        for _ in range(25):  # ~0.5 s of GPU work queued ahead of the steps
            busy = busy @ busy
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        host_ms[name] = (time.perf_counter() - start) / args.steps * 1e3
    torch.cuda.synchronize()

    print(f"{args.loss} loss, b={args.b}, c={args.c}, bf16, {torch.cuda.get_device_name()}")
    print(f"{'':14s}{'step ms':>10s}{'host ms':>10s}")
    for name in steps:
        print(f"{name:14s}{step_ms[name]:10.3f}{host_ms[name]:10.3f}")


if __name__ == "__main__":
    main()
