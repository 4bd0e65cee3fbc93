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


def test_the_materialised_distillation_is_the_same_loss_as_ours():
    """``distill-materialised`` times the recipes' way of the loss ``distill`` times: the same loss,
    the same gradients (the teacher is drawn alike for both)."""
    on_cpu = dict(device="cpu", dtype=torch.float32)
    ours_step = bench_objectives.make_step("distill", 40, 24, **on_cpu)
    materialised_step = bench_objectives.make_step("distill-materialised", 40, 24, **on_cpu)
    ours, materialised = ours_step(), materialised_step()
    torch.testing.assert_close(materialised_step.loss, ours_step.loss, rtol=1e-5, atol=1e-6)
    assert ours_step.loss > 0.1  # a KL and an InfoNCE term of random features, not a trivial zero
    for theirs, mine in zip(materialised, ours):
        torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-6)


def test_a_variant_out_of_memory_is_a_row_of_status_oom(monkeypatch):
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(bench_objectives, "measure", out_of_memory)
    row = bench_objectives.measure_or_oom("distill-materialised", 40, 24, None, None)
    assert row["status"] == "OOM" and row["ms"] != row["ms"]  # NaN

    def broken(*args):
        raise RuntimeError("not a memory error")

    monkeypatch.setattr(bench_objectives, "measure", broken)
    with pytest.raises(RuntimeError, match="not a memory error"):
        bench_objectives.measure_or_oom("distill", 40, 24, None, None)


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


def test_kernels_only_is_refused_without_a_trace_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        bench_objectives.main(["--trace-kernels-only"])
    assert "--trace-kernels-only needs --trace DIR" in capsys.readouterr().err


def _trace_events(tmp_path, device: str, kernels_only: bool) -> list[dict]:
    import json

    step = bench_objectives.make_step("plain", 40, 24, device=device, dtype=torch.float32)
    path = tmp_path / f"{kernels_only}.json"
    bench_objectives.trace(step, str(path), steps=2, kernels_only=kernels_only)
    return json.loads(path.read_text())["traceEvents"]


def _host_operators(events: list[dict]) -> list[dict]:
    return [event for event in events if event.get("cat") in ("cpu_op", "user_annotation")]


def test_a_full_trace_holds_the_host_operators_and_the_step_ranges(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)  # (on the CPU: nothing to wait for)
    host = _host_operators(_trace_events(tmp_path, "cpu", kernels_only=False))
    assert {"ProfilerStep#0", "ProfilerStep#1"} <= {event["name"] for event in host}


@pytest.mark.gpu
def test_gpu_a_kernels_only_trace_holds_kernels_and_no_host_operators(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    events = _trace_events(tmp_path, "cuda", kernels_only=True)
    assert not _host_operators(events)
    assert any(event.get("cat") == "kernel" for event in events)
