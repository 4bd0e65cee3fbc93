"""benchmarks/trace_gaps.py on a small hand-made Chrome trace: each gap is attributed to the host
operator that launched the kernel ending it."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import trace_gaps  # noqa: E402


def _trace(tmp_path):
    def launch(ts, correlation):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": ts, "dur": 1,
                "args": {"correlation": correlation}}

    events = [
        {"ph": "X", "cat": "cpu_op", "name": "KeyBlockLogitStats", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 5},
        launch(12, 1),
        launch(90, 2),
        launch(150, 3),
        {"ph": "X", "cat": "kernel", "name": "first", "ts": 20, "dur": 10, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "second", "ts": 95, "dur": 10, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "third", "ts": 110, "dur": 10, "args": {"correlation": 3}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_gaps_are_attributed_to_the_launching_operator(tmp_path):
    found = trace_gaps.gaps(trace_gaps.load_events(str(_trace(tmp_path))), min_us=30)
    # 30 -> 95: launched inside KeyBlockLogitStats; 105 -> 110: short, launched outside any operator
    assert found == {("KeyBlockLogitStats", "second"): [65], ("outside the loss", "(short gaps)"): [5]}


def test_main_prints_a_line_per_gap(tmp_path, capsys):
    trace_gaps.main([str(_trace(tmp_path)), "--steps", "1"])
    out = capsys.readouterr().out
    assert "0.03 ms of kernels and 0.07 ms idle per step" in out
    assert "65 us  x 1.0  KeyBlockLogitStats -> second" in out


def _two_step_trace(tmp_path):
    """Two marked steps, each launching two kernels: a 50 µs gap in the first, 40 µs in the second."""
    def launch(ts, correlation):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": ts, "dur": 1,
                "args": {"correlation": correlation}}

    def kernel(name, ts, correlation):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": 10,
                "args": {"correlation": correlation}}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "KeyBlockLogitStats", "ts": 0, "dur": 200},
        launch(5, 1), launch(60, 2), launch(110, 3), launch(150, 4),
        kernel("a", 10, 1), kernel("b", 70, 2), kernel("c", 115, 3), kernel("d", 165, 4),
    ]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_skipping_the_first_marked_step_keeps_the_steady_state(tmp_path, capsys):
    events = trace_gaps.load_events(str(_two_step_trace(tmp_path)))
    # every step: 20 -> 70 in the first, 80 -> 115 (launched in the second) and 125 -> 165
    assert trace_gaps.gaps(events, min_us=30) == {("KeyBlockLogitStats", "b"): [50],
                                                   ("KeyBlockLogitStats", "c"): [35],
                                                   ("KeyBlockLogitStats", "d"): [40]}
    # the first step's kernels left out: only the gap between the second step's two kernels
    assert trace_gaps.gaps(events, min_us=30, skip_steps=1) == {("KeyBlockLogitStats", "d"): [40]}
    trace_gaps.main([str(_two_step_trace(tmp_path)), "--steps", "2", "--skip-steps", "1"])
    assert "0.02 ms of kernels and 0.04 ms idle per step" in capsys.readouterr().out


def test_skipping_steps_needs_marked_steps(tmp_path):
    with pytest.raises(ValueError, match="ProfilerStep"):
        trace_gaps.gaps(trace_gaps.load_events(str(_trace(tmp_path))), min_us=30, skip_steps=1)


def test_skipping_every_step_is_refused_naming_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit):
        trace_gaps.main([str(_two_step_trace(tmp_path)), "--steps", "2", "--skip-steps", "2"])
    assert "--skip-steps must lie in [0, --steps), got 2" in capsys.readouterr().err
