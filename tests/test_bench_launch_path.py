"""benchmarks/bench_launch_path.py runs on a machine without a GPU, refuses a count below one naming it,
and leaves the launch module's table of compiled kernels and its launcher as it found them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_launch_path  # noqa: E402


def test_it_times_the_launch_path_on_the_cpu_and_puts_the_launcher_back(capsys):
    from hf_infcl.ops.triton import launch

    before = launch._COMPILED, launch._launch_compiled
    bench_launch_path.main(["--calls", "3"])
    assert "gradient-tile launch path, driver left out:" in capsys.readouterr().out
    assert (launch._COMPILED, launch._launch_compiled) == before


def test_a_count_below_one_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        bench_launch_path.main(["--calls", "0"])
    assert "--calls must be at least 1, got 0" in capsys.readouterr().err
