"""Host time of one gradient-tile launch past the autotuner, on any machine (no GPU needed).

What a backward's super-tile pays on the host besides the driver: ``grad_tile``'s argument list,
``launch``'s heuristics and pre-hook, and the compiled kernel's key (``launch._launch_cached``). The
compiled kernel's own launcher is replaced by a function that only gathers its arguments, and every
key is reported as compiled, so nothing reaches a driver; the operands are CPU tensors of a
super-tile's shape. Medians of ``--calls`` calls; ``--profile`` adds a cProfile of them.

    python benchmarks/bench_launch_path.py
    python benchmarks/bench_launch_path.py --profile
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time

import torch


@contextlib.contextmanager
def stubbed_compiled_launches():
    """Within: every launch key is found compiled, and its launch only gathers the launcher's
    arguments (the module's own table and launcher are put back on exit)."""
    from hf_infcl.ops.triton import launch

    class AlwaysCompiled(dict):
        def get(self, key, default=None):
            return (None, None)

    def gather(body, compiled, grid, named):
        [named[name] for name in body.arg_names]
        return grid(named) if callable(grid) else grid

    saved = launch._COMPILED, launch._launch_compiled
    launch._COMPILED, launch._launch_compiled = AlwaysCompiled(), gather
    try:
        yield
    finally:
        launch._COMPILED, launch._launch_compiled = saved


def grad_tile_call(rows: int = 8192, keys: int = 8192, c: int = 512):
    """A function that makes one super-tile's gradient-tile launch (bf16 operands, TMA descriptors,
    the symmetric softmax loss's statistics), with a configuration given, as the walk passes it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from hf_infcl.ops.triton import grad_tile

    queries, keys_ = torch.randn(rows, c, dtype=torch.bfloat16), torch.randn(keys, c, dtype=torch.bfloat16)
    g = torch.empty(rows, keys, dtype=torch.bfloat16)
    row_sums, stat, weight = torch.zeros(rows), torch.zeros(max(rows, keys)), torch.ones(max(rows, keys))
    scale = torch.tensor(14.0)
    shape = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}
    config = grad_tile.GRAD_TILE_KERNEL.make_config(shape, num_warps=8, num_stages=3)
    descriptors = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])
                        for t in (queries, keys_))

    def call():
        grad_tile.grad_tile(queries, keys_, g, row_sums, scale, None, None, stat[:rows], stat[:keys],
                            weight[:rows], weight[:keys], sigmoid=False, precision="auto", size_class=2,
                            config=config, descriptors=descriptors)

    return call


def median_microseconds(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the timed calls")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    with stubbed_compiled_launches():
        call = grad_tile_call()
        for _ in range(min(200, args.calls)):
            call()
        print(f"gradient-tile launch path, driver left out: {median_microseconds(call, args.calls):.1f} us "
              f"(median of {args.calls})")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                call()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)

if __name__ == "__main__":
    main()
