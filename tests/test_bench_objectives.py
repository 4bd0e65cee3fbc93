"""``benchmarks/bench_objectives.py``'s steps on CPU: every variant's step runs (a dry run of what the
GPU benchmark times) and computes what it names."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_objectives  # noqa: E402  (benchmarks/ is put on the path above)


@pytest.mark.parametrize("variant", bench_objectives.VARIANTS + bench_objectives.EXTRA_VARIANTS)
def test_every_variant_steps_on_cpu(variant):
    step = bench_objectives.make_step(variant, 40, 24, device="cpu", dtype=torch.float32)
    grads = step()
    assert len(grads) == 3 and all(torch.isfinite(grad).all() for grad in grads)
    assert grads[0].shape == (40, 24)


def test_the_matryoshka_widths_are_five_descending_from_c():
    assert bench_objectives.matryoshka_widths(768) == (768, 512, 256, 128, 64)
    assert bench_objectives.matryoshka_widths(512) == (512, 341, 170, 85, 42)


def test_the_variants_differ_from_plain():
    plain = bench_objectives.make_step("plain", 40, 24, device="cpu", dtype=torch.float32)()
    for variant in bench_objectives.VARIANTS[1:] + bench_objectives.EXTRA_VARIANTS:
        other = bench_objectives.make_step(variant, 40, 24, device="cpu", dtype=torch.float32)()
        assert not torch.allclose(other[0], plain[0]), variant
