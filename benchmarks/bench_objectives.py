"""The objectives beyond plain InfoNCE on one GPU: several positives per row and the false-negative
score filter, against the plain loss of the same shape, in one run.

Every variant is the symmetric softmax loss on L2-normalised bf16 features [b, c] with a learnable
log-scale (scale 1/0.07), forward + backward with the gradients of both feature tensors and the
log-scale, through the public ``hf_infcl.contrastive_loss``:

  plain        no groups, no filter
  groups-any   ``group_positives="any"``: groups of 5 rows and their 5 keys (COCO's five captions)
  groups-each  ``group_positives="each"``, the same groups
  filter       ``false_negative_margin=0.1`` on the model's own (detached) similarities
  filter-guide the same with a guide of the same width (a second, frozen embedding of the batch)
  filter-every-tile  ``false_negative_margin=2.5``: every key but the positive left out, so every
               tile pays for the filter's masks (its worst case; not run by default)
  filter-qwen3 ``false_negative_margin=-0.1``: Qwen3-Embedding's rule, a negative left out where it
               scores above its row's positive plus 0.1 (not run by default)

and, named in ``--variants`` only (not run by default):

  distill      ``contrastive_distillation_loss`` against a teacher of the same width, half KL and
               half InfoNCE (``distillation_weight=0.5``), ``backend="auto"`` (its Triton kernels
               on CUDA)
  distill-tilesN  the same on ``TorchTiles(N, N)`` (``backend="torch"`` takes 4096 on CUDA; smaller
               tiles leave the GPU waiting on the host's launches); e.g. ``distill-tiles1024``
  distill-materialised  the same loss as the published recipes write it (NeMo's
               ``infonce_distill_loss``, FlagEmbedding's in-batch ``kd_loss``): the student's and
               the teacher's b x b logits materialised, fp32 log-softmax of each in both directions,
               ``kl_div`` and ``cross_entropy``; "OOM" where it does not fit
  distill-triton  the same on ``backend=TritonBlocks()``
  distill-triton-kernels  the same on the Triton kernels (``TritonBlocks(distillation_kernels="triton")``),
               not the Gluon ones that ``"auto"`` takes on Hopper
  filter-stats-triton  ``filter`` with the forward's statistics from the Triton kernel with masks
               (``TritonBlocks(softmax_statistics="triton")``) instead of the Gluon kernel, which
               "auto" takes where it can: the A/B of the two, in one run
  filter-guide-masked  ``filter-guide`` with the forward and the backward filtering every tile
               (``TritonBlocks(listed_row_share=0)``), as they do where many rows have left-out
               entries: the A/B of finding those entries first, in one run
  matryoshka   ``matryoshka_dims`` of five widths, c, 2c/3, c/3, c/6 and c/12 (768, 512, 256, 128
               and 64 at c = 768; ``--matryoshka-dims`` sets others), ``backend="auto"`` (on CUDA
               one Triton loss call per width)
  matryoshka-per-width  the same loss as the sum of one ``contrastive_loss`` call per re-normalised
               prefix (what sentence-transformers' ``MatryoshkaLoss`` does around a loss)
  matryoshka-one-pass  the same on ``TritonBlocks(matryoshka_one_pass=True)``: every width in one
               pass of the Triton kernels (CUDA only)
  matryoshka-tilesN  the same on ``TorchTiles(N, N)``: every width in one pass per tile

The features are shaped like a trained model's: each positive key at cosine about 0.6 to its query,
the other keys near 0, and 1 % of the pairs near-copies of another pair (so that each copy's key is
a false negative of the original's row, and the other way round: what the filter is for); the
guide is the same batch with a little noise. Most tiles then hold no score above the filter's
thresholds, as in training, and skip its masks.

Times are medians of event-synchronised steps after warm-up (the kernels are autotuned in the
warm-up, as a training run's first step tunes them); memory is the peak above the inputs. The
ratio column is each variant's time over ``plain``'s at the same (b, c), measured in the same run.
``issue ms`` is the median time the host takes to issue a step from an idle GPU: where it nears
the step's time, the host, not the GPU, sets the pace.
No published contrastive kernel has these objectives; the materialised way (a b x b logit and mask
matrix) does not fit at these sizes. A variant that runs out of memory gets a row with status "OOM";
``loss`` is each variant's loss value on the same features (equal for ``distill`` and
``distill-materialised`` up to rounding).

    python benchmarks/bench_objectives.py --sizes 32k,128k --widths 512,768 --csv out.csv
    python benchmarks/bench_objectives.py --sizes 32k --widths 512 --profile   # kernels of one step

``--profile`` prints, per variant, one step's GPU time by kernel and its sum next to the step's
time (their difference is time the GPU waited for the host). ``--trace DIR`` writes, per variant,
a Chrome trace of three steps (``--trace-steps``), queued back to back, with the host's operators
beside the kernels (open it in Perfetto, or read it with ``trace_gaps.py``), to find what the GPU
waits for. ``--trace-kernels-only`` leaves the host's operators out of it: the profiler's host
bookkeeping then no longer slows the host, so the gaps are those of an unprofiled run (and
``trace_gaps.py`` names only the kernels around each).
"""

from __future__ import annotations

import argparse
import functools
import sys
from math import nan
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import (  # this folder is on sys.path
    Column,
    csv_path,
    device_name,
    format_count,
    free_memory,
    is_out_of_memory,
    median_issue_seconds,
    median_seconds,
    parse_count,
    peak_above,
    print_table,
    versions,
    write_csv,
)

from hf_infcl import TorchTiles, contrastive_distillation_loss, contrastive_loss

VARIANTS = ("plain", "groups-any", "groups-each", "filter", "filter-guide")
# run when named (and tiled variants)
EXTRA_VARIANTS = ("distill", "distill-materialised", "matryoshka", "matryoshka-per-width",
                  "filter-every-tile", "filter-qwen3")
# when named, on CUDA
GPU_ONLY_VARIANTS = ("distill-triton", "distill-triton-kernels", "filter-guide-masked", "filter-stats-triton",
                     "matryoshka-one-pass")
GROUP_SIZE = 5
POSITIVE_COSINE = 0.6  # a positive's expected cosine to its query
NEAR_COPIES = 0.01  # the share of (query, key) pairs that are near-copies of another pair


def matryoshka_widths(c: int) -> tuple[int, ...]:
    """Five descending widths from c: 768, 512, 256, 128, 64 at c = 768."""
    return tuple(dict.fromkeys(max(1, c * share // 12) for share in (12, 8, 4, 2, 1)))


def _tiles(variant: str) -> int | None:
    """N of a ``distill-tilesN`` or ``matryoshka-tilesN`` variant, None for any other name."""
    tiles = variant.split("-tiles", 1)[1] if "-tiles" in variant else ""
    return int(tiles) if tiles.isdigit() and int(tiles) > 0 else None


def trained_features(b: int, c: int, generator: torch.Generator, device: str):
    """fp32 (queries, keys) [b, c] shaped like a trained model's features (the module docstring says
    how)."""
    q = F.normalize(torch.randn(b, c, device=device, generator=generator), dim=1)
    noise = F.normalize(torch.randn(b, c, device=device, generator=generator), dim=1)
    k = POSITIVE_COSINE * q + (1 - POSITIVE_COSINE**2) ** 0.5 * noise
    copies = torch.randperm(b, device=device, generator=generator)[: int(NEAR_COPIES * b)]
    originals = torch.randint(0, b, (len(copies),), device=device, generator=generator)
    for x in (q, k):  # near-duplicate pairs: each copy's key is a false negative of the original's row
        noise = torch.randn(len(copies), c, device=device, generator=generator)
        x[copies] = x[originals] + 0.05 * noise / c**0.5
    return q, k


def materialised_distillation(queries, keys, teacher_queries, teacher_keys, logit_scale,
                               teacher_logit_scale: float, distillation_weight: float) -> torch.Tensor:
    """``contrastive_distillation_loss`` (symmetric, mean, ``keys[i]`` row i's positive) as the
    published recipes compute it: both b x b logit matrices materialised in the features' dtype, then
    fp32 log-softmax, ``kl_div`` and ``cross_entropy`` over rows and over columns."""
    student = logit_scale * (queries @ keys.T).float()
    with torch.no_grad():
        teacher = teacher_logit_scale * (teacher_queries @ teacher_keys.T).float()
    labels = torch.arange(student.shape[0], device=student.device)
    total = 0.0
    for student_logits, teacher_logits in ((student, teacher), (student.T, teacher.T)):
        log_student = F.log_softmax(student_logits, dim=1)
        log_teacher = F.log_softmax(teacher_logits, dim=1)
        kl = F.kl_div(log_student, log_teacher, log_target=True, reduction="batchmean")
        total = total + distillation_weight * kl + (1 - distillation_weight) * F.nll_loss(log_student, labels)
    return total / 2


def make_step(variant: str, b: int, c: int, seed: int = 0, device: str = "cuda", dtype=torch.bfloat16,
              matryoshka_dims: tuple[int, ...] | None = None):
    """One forward + backward of ``variant`` at (b, c); ``matryoshka_dims``: the Matryoshka
    variants' widths (None: :func:`matryoshka_widths`)."""
    matryoshka_dims = matryoshka_dims or matryoshka_widths(c)
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k = trained_features(b, c, generator, device)
    if variant.startswith("filter-guide"):  # the same batch with a little noise, frozen
        guide = [F.normalize(x + 0.1 * torch.randn(b, c, device=device, generator=generator) / c**0.5, dim=1)
                 for x in (q, k)]
    q = q.to(dtype).requires_grad_()
    k = k.to(dtype).requires_grad_()
    log_scale = torch.tensor(2.6593, device=device, requires_grad=True)  # log(1/0.07)
    options = {}
    if variant.startswith("groups"):
        groups = torch.arange(b, device=device) // GROUP_SIZE
        options = dict(query_groups=groups, key_groups=groups, group_positives=variant.split("-")[1])
    elif variant.startswith("filter"):
        margins = {"filter-every-tile": 2.5, "filter-qwen3": -0.1}
        options = dict(false_negative_margin=margins.get(variant, 0.1))
        if variant.startswith("filter-guide"):
            options.update(guide_queries=guide[0].to(dtype), guide_keys=guide[1].to(dtype))
        if variant == "filter-guide-masked":
            from hf_infcl.ops.triton import TritonBlocks

            options.update(backend=TritonBlocks(listed_row_share=0.0))
        if variant == "filter-stats-triton":
            from hf_infcl.ops.triton import TritonBlocks

            options.update(backend=TritonBlocks(softmax_statistics="triton"))
    elif variant.startswith("matryoshka") and variant != "matryoshka-per-width":
        options = dict(matryoshka_dims=matryoshka_dims)
        if _tiles(variant):
            options.update(backend=TorchTiles(_tiles(variant), _tiles(variant)))
        if variant == "matryoshka-one-pass":
            from hf_infcl.ops.triton import TritonBlocks

            options.update(backend=TritonBlocks(matryoshka_one_pass=True))
    loss_fn = functools.partial(contrastive_loss, **options)
    if variant.startswith("distill"):
        teacher = F.normalize(torch.randn(2, b, c, device=device, dtype=dtype, generator=generator), dim=-1)
        tiles = _tiles(variant)
        backend = TorchTiles(tiles, tiles) if tiles else "auto"
        if variant in ("distill-triton", "distill-triton-kernels"):
            from hf_infcl.ops.triton import TritonBlocks

            kernels = "triton" if variant == "distill-triton-kernels" else "auto"
            backend = TritonBlocks(distillation_kernels=kernels)
        loss_fn = functools.partial(contrastive_distillation_loss, teacher_queries=teacher[0],
                                    teacher_keys=teacher[1], teacher_logit_scale=20.0,
                                    distillation_weight=0.5, backend=backend)
        if variant == "distill-materialised":
            def loss_fn(queries, keys, logit_scale):
                return materialised_distillation(queries, keys, *teacher, logit_scale, 20.0, 0.5)

    if variant == "matryoshka-per-width":
        def loss_fn(queries, keys, logit_scale):
            return sum(contrastive_loss(F.normalize(queries[:, :dim], dim=1),
                                        F.normalize(keys[:, :dim], dim=1), logit_scale=logit_scale)
                       for dim in matryoshka_dims)

    def step():
        loss = loss_fn(F.normalize(q, dim=1), F.normalize(k, dim=1), logit_scale=log_scale.exp())
        step.loss = loss.detach()  # the last step's value, for the table
        return torch.autograd.grad(loss, [q, k, log_scale])

    return step


def profile(step, name: str, ms: float, rows: int = 10) -> None:
    """One more step under torch.profiler: its GPU time by kernel."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_ms = sum(event.self_device_time_total for event in events) / 1e3
    print(f"\n# {name}: {kernel_ms:.2f} ms of kernels in a {ms:.2f} ms step")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))


def trace(step, path: str, steps: int = 3, kernels_only: bool = False) -> None:
    """``steps`` more steps under torch.profiler, host operators and kernels, as a Chrome trace:
    queued back to back as training queues them, each in a ``ProfilerStep#i`` range (what a
    profiler schedule marks), so that ``trace_gaps.py --skip-steps`` can leave the first out.
    ``kernels_only``: the GPU's activity alone (no host operators, no step ranges)."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] if kernels_only else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch_profile(activities=activities) as prof:
        for index in range(steps):
            with record_function(f"ProfilerStep#{index}"):
                step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="32k,128k", help="batch sizes b, e.g. 32k,128k")
    parser.add_argument("--widths", default="512,768", help="feature widths c (one per size, or one for all)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="variants to run")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--csv", default=None, help="write CSV rows here")
    parser.add_argument("--profile", action="store_true", help="print each variant's kernels (one step)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="write each variant's Chrome trace of --trace-steps steps into DIR")
    parser.add_argument("--trace-steps", type=int, default=3, help="steps in each trace")
    parser.add_argument("--trace-kernels-only", action="store_true",
                        help="trace the GPU's activity alone, without the host's operators")
    parser.add_argument("--matryoshka-dims", default=None,
                        help="the Matryoshka variants' widths, e.g. 2048,1024,512,256,128")
    args = parser.parse_args(argv)
    if args.trace_kernels_only and not args.trace:
        parser.error("--trace-kernels-only needs --trace DIR")
    if args.trace_steps < 1:
        parser.error(f"--trace-steps must be at least 1, got {args.trace_steps}")
    matryoshka_dims = None
    if args.matryoshka_dims:
        matryoshka_dims = tuple(int(dim) for dim in args.matryoshka_dims.split(","))
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    sizes = [parse_count(text) for text in args.sizes.split(",")]
    widths = [int(text) for text in args.widths.split(",")]
    if len(widths) == 1:
        widths *= len(sizes)
    if len(widths) != len(sizes):
        parser.error("--widths takes one width, or one per size")
    variants = args.variants.split(",")
    known = VARIANTS + EXTRA_VARIANTS + GPU_ONLY_VARIANTS
    unknown = sorted(variant for variant in variants if variant not in known and not _tiles(variant))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {known}")

    meta = {"device": device_name(), **versions("torch", "triton", "hf_infcl")}
    path = csv_path(args.csv, "bench_objectives.csv")
    rows = []
    for b, c in zip(sizes, widths):
        plain_ms = None
        for variant in variants:
            row = measure_or_oom(variant, b, c, args, matryoshka_dims)
            free_memory()
            if variant == "plain":
                plain_ms = row["ms"]
            row = {"variant": variant, "b": b, "c": c, **row,
                   "vs_plain": row["ms"] / plain_ms if plain_ms else nan}
            rows.append(row)
            # each row as it comes, so that a run cut short by its time limit keeps what it measured
            print(f"{variant} {format_count(b)}/{c}: {row['ms']:.2f} ms ({row['host_ms']:.2f} ms to issue), "
                  f"{row['peak_mib']:.0f} MiB, loss {row['loss']:.6f}, {row['status']}",
                  file=sys.stderr, flush=True)
            write_csv(path, [{**meta, **row} for row in rows])
    columns = [Column("variant", 13, align="<"), Column("b", 5), Column("c", 5), Column("ms", 9, ".2f"),
               Column("issue ms", 9, ".2f"), Column("MiB", 7, ".0f"), Column("x plain", 8, ".3f"),
               Column("loss", 10, ".6f"), Column("status", 7, align="<")]
    print_table(columns, [(r["variant"], format_count(r["b"]), r["c"], r["ms"], r["host_ms"], r["peak_mib"],
                           r["vs_plain"], r["loss"], r["status"])
                          for r in rows], title=" | ".join(str(value) for value in meta.values()))


def measure_or_oom(variant: str, b: int, c: int, args, matryoshka_dims) -> dict:
    """:func:`measure`, or a row of status "OOM" where the variant does not fit."""
    try:
        return measure(variant, b, c, args, matryoshka_dims)
    except Exception as error:  # noqa: BLE001 - an OOM is a result
        if not is_out_of_memory(error):
            raise
    return {"ms": nan, "host_ms": nan, "peak_mib": nan, "loss": nan, "status": "OOM"}


def measure(variant: str, b: int, c: int, args, matryoshka_dims) -> dict:
    """One variant at (b, c): its step's median time, the host's time to issue it, its peak memory
    above the inputs and its loss (and ``--profile`` / ``--trace``'s output)."""
    step = make_step(variant, b, c, matryoshka_dims=matryoshka_dims)
    step()  # the first call tunes the kernels of this shape
    ms = median_seconds(step, args.steps, warmup=2) * 1e3
    host_ms = median_issue_seconds(step, args.steps) * 1e3
    peak, _ = peak_above(step)
    if args.profile:
        profile(step, f"{variant} {format_count(b)}/{c}", ms)
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        trace(step, str(Path(args.trace) / f"{variant}-{format_count(b)}-{c}.json"), args.trace_steps,
              args.trace_kernels_only)
    return {"ms": ms, "host_ms": host_ms, "peak_mib": peak / 2**20, "loss": float(step.loss), "status": "ok"}


if __name__ == "__main__":
    main()
