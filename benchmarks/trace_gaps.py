"""Where a step's GPU waits: the idle gaps between kernels in a torch.profiler Chrome trace (such as
``bench_objectives.py --trace DIR`` writes), grouped by what the host was doing when it launched
the kernel that ended each gap.

A gap is the time from the end of one kernel (or copy) on the GPU to the start of the next. The
launch that ended it is found through the profiler's correlation ids, and the host's operator at
that moment is the outermost one that is not a plain ``aten::`` operator (an autograd Function's
forward, its backward, or a profiler step), or "outside the loss" if there is none. Gaps shorter
than ``--min-us`` are summed per operator as "short gaps".

Where the trace marks its steps (``ProfilerStep#i`` ranges, as ``bench_objectives.py --trace`` and
a profiler schedule write), ``--skip-steps K`` leaves out the kernels and gaps launched in the
first K steps: the first starts from an idle GPU, the later ones show the steady state.

    python benchmarks/trace_gaps.py DIR/filter-32k-512.json --steps 3
    python benchmarks/trace_gaps.py DIR/plain-32k-512.json --steps 5 --skip-steps 1
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
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


_STEP = re.compile(r"ProfilerStep#(\d+)$")


def step_ranges(events: list[dict]) -> list[tuple[float, float, int]]:
    """(start, end, number) of the trace's ``ProfilerStep#number`` host ranges."""
    ranges = []
    for event in events:
        match = _STEP.match(event.get("name", ""))
        if match and event.get("cat") in ("cpu_op", "user_annotation"):
            ranges.append((event["ts"], event["ts"] + event["dur"], int(match.group(1))))
    return sorted(ranges)


def launched_in_skipped_step(ranges: list[tuple[float, float, int]], time: float, skip_steps: int) -> bool:
    return any(start <= time <= end and number < skip_steps for start, end, number in ranges)


def launch_times(events: list[dict]) -> dict:
    """The host time of each launch, by its correlation id."""
    return {event["args"]["correlation"]: event["ts"] for event in events
            if event.get("cat") == "cuda_runtime" and "correlation" in event.get("args", {})}


def kept_gpu_events(events: list[dict], skip_steps: int = 0) -> list[dict]:
    """The kernels and copies in time order, less those launched in the first ``skip_steps`` steps."""
    gpu = sorted((event for event in events if event.get("cat") in GPU_CATEGORIES),
                 key=lambda event: event["ts"])
    if not skip_steps:
        return gpu
    ranges, launches = step_ranges(events), launch_times(events)
    if not ranges:
        raise ValueError("--skip-steps needs a trace whose steps are marked (ProfilerStep#i ranges)")
    return [event for event in gpu if not launched_in_skipped_step(
        ranges, launches.get(event.get("args", {}).get("correlation"), event["ts"]), skip_steps)]


def gaps(events: list[dict], min_us: float, skip_steps: int = 0) -> dict[tuple[str, str], list[float]]:
    """{(host region, next kernel or "(short gaps)"): [gap µs, ...]} over the trace, less the
    kernels launched in the first ``skip_steps`` marked steps and the gaps before them."""
    launches = launch_times(events)
    regions = host_regions(events)
    starts = [region[0] for region in regions]
    found: dict[tuple[str, str], list[float]] = defaultdict(list)
    busy_until = None
    for event in kept_gpu_events(events, skip_steps):
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
    parser.add_argument("--skip-steps", type=int, default=0,
                        help="leave out the first K marked steps (figures are per step of the rest)")
    args = parser.parse_args(argv)
    if not 0 <= args.skip_steps < args.steps:
        parser.error(f"--skip-steps must lie in [0, --steps), got {args.skip_steps}")
    steps = args.steps - args.skip_steps
    for path in args.traces:
        events = load_events(path)
        kernel_us = sum(event["dur"] for event in kept_gpu_events(events, args.skip_steps)
                        if event.get("cat") == "kernel")
        found = gaps(events, args.min_us, args.skip_steps)
        idle_us = sum(sum(values) for values in found.values())
        print(f"== {path}: {kernel_us / steps / 1e3:.2f} ms of kernels and "
              f"{idle_us / steps / 1e3:.2f} ms idle per step")
        ranked = sorted(found.items(), key=lambda item: -sum(item[1]))[: args.rows]
        for (region, kernel), values in ranked:
            per_step = sum(values) / steps
            print(f"   {per_step:8.0f} us  x{len(values) / steps:4.1f}  {region} -> {kernel}")


if __name__ == "__main__":
    main()
