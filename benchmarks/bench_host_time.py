"""Host time of one loss step (forward + backward), against the materialised loss.

At small batches the GPU finishes a step's kernels faster than the host can issue them, so the
step time is the host's: its Python and, mostly, its CUDA launches (tens of microseconds each on
a server CPU). This script measures both sides for one size:

  step        median of ``triton.testing.do_bench`` of ``bench_loss.py``'s own steps
              (``triton-bf16`` and ``vanilla-bf16``: features normalised in the step, a learnable
              log-scale, and a bias for sigmoid);
  host        the median time to *issue* one step, from an idle GPU until the step returns
              (its kernels may still be running then). It includes the loss's one host
              synchronisation (the argument check that reads ``logit_scale``), which waits only
              for the few kernels queued before it (the features' normalisation and the scale's
              exponential), so the figure is the host's work, not the GPU's.

    python benchmarks/bench_host_time.py --b 8192 --c 512
    python benchmarks/bench_host_time.py --b 8192 --c 512 --loss sigmoid

``--host-profile N`` then issues N more hf_infcl steps, each from an idle GPU, under cProfile and
prints where the host's time went (by own time and by cumulative time). cProfile slows Python
down, so read its shares, not its absolute times.
"""

from __future__ import annotations

import torch
from bench_common import median_issue_seconds, one_size_parser  # this folder is on sys.path


def main():
    parser = one_size_parser(__doc__, rows=8192)
    parser.add_argument("--steps", type=int, default=20, help="steps whose issue time is measured")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also profile the host while it issues N hf_infcl steps (cProfile)")
    parser.add_argument("--profile-lines", type=int, default=30, help="functions listed per ordering")
    args = parser.parse_args()

    import triton
    from bench_loss import learnable_parameters, make_step  # this folder is on sys.path

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

    # from an idle GPU: the check's synchronisation waits for this step's first kernels only
    host_ms = {name: median_issue_seconds(step, args.steps) * 1e3 for name, step in steps.items()}

    print(f"{args.loss} loss, b={args.b}, c={args.c}, bf16, {torch.cuda.get_device_name()}")
    print(f"{'':14s}{'step ms':>10s}{'host ms':>10s}")
    for name in steps:
        print(f"{name:14s}{step_ms[name]:10.3f}{host_ms[name]:10.3f}")
    if args.host_profile:
        print_host_profile(steps["hf_infcl"], args.host_profile, args.profile_lines)


def print_host_profile(step, steps: int, lines: int) -> None:
    """cProfile of the host issuing ``steps`` steps, each from an idle GPU (as ``host`` above)."""
    import cProfile
    import pstats

    from bench_common import synchronize

    profiler = cProfile.Profile()
    for _ in range(steps):
        synchronize()
        profiler.enable()
        step()
        profiler.disable()
    synchronize()
    stats = pstats.Stats(profiler)
    stats.strip_dirs()
    for order in ("tottime", "cumulative"):
        print(f"\nhost profile of {steps} steps, by {order}:")
        stats.sort_stats(order).print_stats(lines)


if __name__ == "__main__":
    main()
