"""Where a step's GPU waits: the idle gaps between kernels in a torch.profiler Chrome trace (such as
``bench_objectives.py --trace DIR`` writes), grouped by what the host was doing when it launched
the kernel that ended each gap.

A gap is the time from the end of one kernel (or copy) on the GPU to the start of the next. The
launch that ended it is found through the profiler's correlation ids, and the host's operator at
that moment is the outermost one that is not a plain ``aten::`` operator (an autograd Function's
forward, its backward, or a profiler step), or "outside the loss" if there is none. Gaps shorter
than ``--min-us`` are summed per operator as "short gaps".

    python benchmarks/trace_gaps.py DIR/filter-32k-512.json --steps 3
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str) -> list[dict]:
    with open(path) as handle:
        trace = json.load(handle)
    return [event for event in trace["traceEvents"] if event.get("ph") == "X"]


def host_regions(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of the host operators a launch is attributed to, outermost first."""
    regions = []
    for event in events:
        name = event.get("name", "")
        if event.get("cat") != "cpu_op" or name.startswith("aten::") or name.startswith("cuda"):
            continue
        regions.append((event["ts"], event["ts"] + event["dur"], name))
    regions.sort(key=lambda region: (region[0], -region[1]))
    return regions


def region_at(regions: list[tuple[float, float, str]], starts: list[float], time: float) -> str:
    """The outermost region holding ``time``, "outside the loss" if none does."""
    index = bisect.bisect_right(starts, time)
    holding = [region for region in regions[:index] if region[1] >= time]
    if not holding:
        return "outside the loss"
    outermost = min(holding, key=lambda region: region[0])
    name = outermost[2]
    if name.startswith("ProfilerStep") and len(holding) > 1:
        name = sorted(holding, key=lambda region: region[0])[1][2]
    return name.replace("autograd::engine::evaluate_function: ", "")


def gaps(events: list[dict], min_us: float) -> dict[tuple[str, str], list[float]]:
    """{(host region, next kernel or "(short gaps)"): [gap µs, ...]} over the trace."""
    launches = {event["args"]["correlation"]: event["ts"] for event in events
                if event.get("cat") == "cuda_runtime" and "correlation" in event.get("args", {})}
    gpu = sorted((event for event in events if event.get("cat") in GPU_CATEGORIES),
                 key=lambda event: event["ts"])
    regions = host_regions(events)
    starts = [region[0] for region in regions]
    found: dict[tuple[str, str], list[float]] = defaultdict(list)
    busy_until = None
    for event in gpu:
        if busy_until is not None and event["ts"] > busy_until:
            idle = event["ts"] - busy_until
            launched = launches.get(event.get("args", {}).get("correlation"), event["ts"])
            region = region_at(regions, starts, launched)
            kernel = event["name"][:40] if idle >= min_us else "(short gaps)"
            found[(region, kernel)].append(idle)
        end = event["ts"] + event["dur"]
        busy_until = end if busy_until is None else max(busy_until, end)
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="Chrome trace files")
    parser.add_argument("--steps", type=int, default=3, help="steps in each trace (figures are per step)")
    parser.add_argument("--min-us", type=float, default=30.0, help="gaps shorter than this are summed")
    parser.add_argument("--rows", type=int, default=8, help="rows per trace")
    args = parser.parse_args(argv)
    for path in args.traces:
        events = load_events(path)
        kernel_us = sum(event["dur"] for event in events if event.get("cat") == "kernel")
        found = gaps(events, args.min_us)
        idle_us = sum(sum(values) for values in found.values())
        print(f"== {path}: {kernel_us / args.steps / 1e3:.2f} ms of kernels and "
              f"{idle_us / args.steps / 1e3:.2f} ms idle per step")
        ranked = sorted(found.items(), key=lambda item: -sum(item[1]))[: args.rows]
        for (region, kernel), values in ranked:
            per_step = sum(values) / args.steps
            print(f"   {per_step:8.0f} us  x{len(values) / args.steps:4.1f}  {region} -> {kernel}")


if __name__ == "__main__":
    main()
