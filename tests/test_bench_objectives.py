"""``benchmarks/bench_objectives.py``'s steps on CPU: every variant's step runs (a dry run of what the
GPU benchmark times) and computes what it names."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_objectives  # noqa: E402  (benchmarks/ is put on the path above)


@pytest.mark.parametrize("variant", bench_objectives.VARIANTS + bench_objectives.EXTRA_VARIANTS
                         + ("distill-tiles16", "matryoshka-tiles16"))
def test_every_variant_steps_on_cpu(variant):
    step = bench_objectives.make_step(variant, 40, 24, device="cpu", dtype=torch.float32)
    grads = step()
    assert len(grads) == 3 and all(torch.isfinite(grad).all() for grad in grads)
    assert grads[0].shape == (40, 24)


def test_the_matryoshka_widths_are_five_descending_from_c():
    assert bench_objectives.matryoshka_widths(768) == (768, 512, 256, 128, 64)
    assert bench_objectives.matryoshka_widths(512) == (512, 341, 170, 85, 42)


@pytest.mark.parametrize("variant", ["distill", "matryoshka"])
def test_the_same_loss_on_other_tiles(variant):
    """``distill-tilesN`` and ``matryoshka-tilesN`` time the same function on tiles of N (several
    tiles here, at 40 rows)."""
    on_cpu = dict(device="cpu", dtype=torch.float32)
    default = bench_objectives.make_step(variant, 40, 24, **on_cpu)()
    small_tiles = bench_objectives.make_step(f"{variant}-tiles16", 40, 24, **on_cpu)()
    for ours, theirs in zip(small_tiles, default):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit):
        bench_objectives.main(["--variants", f"{variant}-tiles0"])


def test_matryoshka_per_width_is_the_same_loss_as_the_one_pass():
    """The two Matryoshka variants time the same loss by two routes."""
    on_cpu = dict(device="cpu", dtype=torch.float32)
    one_pass = bench_objectives.make_step("matryoshka", 40, 24, **on_cpu)()
    per_width = bench_objectives.make_step("matryoshka-per-width", 40, 24, **on_cpu)()
    for ours, theirs in zip(per_width, one_pass):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_variants_differ_from_plain():
    plain = bench_objectives.make_step("plain", 40, 24, device="cpu", dtype=torch.float32)()
    for variant in bench_objectives.VARIANTS[1:] + bench_objectives.EXTRA_VARIANTS:
        other = bench_objectives.make_step(variant, 40, 24, device="cpu", dtype=torch.float32)()
        assert not torch.allclose(other[0], plain[0]), variant


def test_a_trace_of_no_steps_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        bench_objectives.main(["--trace", "unused", "--trace-steps", "0"])
    assert "--trace-steps must be at least 1, got 0" in capsys.readouterr().err
