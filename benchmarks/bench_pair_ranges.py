"""GPU time of several positives' pair work alone, on one process: the ranges that the Triton
block ops walk (``hf_infcl/ops/triton/group_pairs.py``) against the list of pairs that the other
block ops use, for the symmetric ``group_positives="any"`` loss on L2-normalised bf16 features
with groups of ``--group`` rows and their keys (each row's own positive in its group).

  ranges build   the sorts and binary searches that make the ranges (host work included: the
                 events time the stream, which waits on the host where it is slower)
  forward        the rows' and keys' positive parts from the ranges, by warps per program
  backward       the pairs' gradients added into dQ, dK and the row sums, by warps per program
  list route     count, list (one host synchronisation), parts and gradients of the list

Medians of CUDA events over ``--steps`` calls, after one untimed call.

    python benchmarks/bench_pair_ranges.py --b 32768 --widths 512,768
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_common import parse_count  # this folder is on sys.path


def event_microseconds(fn, steps: int) -> float:
    """Median microseconds of ``fn()`` between two CUDA events, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_width(c: int, b: int, group: int, warps_to_time: list[int], steps: int) -> None:
    """Print the pair work's times at width ``c`` (module docstring)."""
    from hf_infcl.ops import positive_pairs
    from hf_infcl.ops.key_blocks import row_combiner
    from hf_infcl.ops.spec import StatsSpec
    from hf_infcl.ops.triton import TritonBlocks, group_pairs

    ops, combine = TritonBlocks(), row_combiner(TritonBlocks())
    spec = StatsSpec(loss="softmax", columns=True, group_positives="any")
    groups = torch.arange(b, device="cuda") // group
    positives = torch.arange(b, device="cuda")
    scale = torch.tensor(1 / 0.07, device="cuda")
    weight = torch.full((b,), -1.0 / b, device="cuda")
    queries, keys = (torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=1).bfloat16()
                     for _ in range(2))
    grad_queries, grad_keys = torch.zeros(b, c, device="cuda"), torch.zeros(b, c, device="cuda")
    row_sums = torch.zeros(b, device="cuda")

    build = event_microseconds(lambda: positive_pairs.group_ranges(groups, positives, groups), steps)
    print(f"c={c}: ranges build {build:.0f} us")
    ranges = positive_pairs.group_ranges(groups, positives, groups)
    parts = ops.group_positive_parts(spec, queries, keys, scale, None, ranges)

    def forward():
        ops.group_positive_parts(spec, queries, keys, scale, None, ranges)

    def backward():
        ops.add_group_pair_gradients(spec, queries, keys, scale, None, ranges, parts.rows, weight,
                                     parts.columns, weight, grad_queries, grad_keys, row_sums)

    def listed_route():
        pairs = positive_pairs.listed(positive_pairs.count_pairs(groups, positives, groups, 0,
                                                                 positives_in_block=True))
        listed = positive_pairs.block_positive_parts(spec, queries, keys, scale, None, pairs, combine,
                                                     torch.float32)
        positive_pairs.add_pair_gradients(spec, queries, keys, scale, None, pairs, listed.rows, weight,
                                          listed.columns, weight, grad_queries, grad_keys, row_sums, combine)

    default_warps = group_pairs._warps
    try:
        for warps in warps_to_time:
            group_pairs._warps = lambda block, warps=warps: warps
            print(f"  ranges, {warps} warps: forward {event_microseconds(forward, steps):.0f} us, "
                  f"backward {event_microseconds(backward, steps):.0f} us")
    finally:
        group_pairs._warps = default_warps
    print(f"  list route (count, list, parts, gradients): {event_microseconds(listed_route, steps):.0f} us")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=parse_count, default=32768, help="rows = keys (default 32k)")
    parser.add_argument("--widths", default="512,768", help="comma-separated c")
    parser.add_argument("--group", type=int, default=5, help="rows and keys per group")
    parser.add_argument("--warps", default="1,2,4,8", help="warps per program to time the ranges with")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, b={args.b}, groups of {args.group}, symmetric \"any\", bf16")
    for c in map(int, args.widths.split(",")):
        time_width(c, args.b, args.group, [int(w) for w in args.warps.split(",")], args.steps)


if __name__ == "__main__":
    main()
