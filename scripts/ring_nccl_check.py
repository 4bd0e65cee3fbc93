"""NCCL parity check of the ring on GPUs, against the float64 reference of the whole batch.

Run on a machine with 2 (or more) GPUs:

    torchrun --standalone --nproc_per_node 2 scripts/ring_nccl_check.py

(``tests/test_ring.py::test_nccl_ring_parity_script`` runs it when two GPUs are visible;
``--cpu`` runs the same checks over gloo on CPU, a dry run of the script itself; ``--only A,B``
runs the cases whose names contain A or B, e.g. ``--only filter,positives`` after a kernel change
of the score filter, where a cold machine tunes every new kernel key first; ``--tf32-via-fp16``
runs the fp32 cases' kernels on scaled fp16 copies, ``TritonBlocks(tf32_via_fp16=True)``, ring and
one process alike.)

Each rank holds its own uneven slice of a global batch (one case gives a rank no rows at all),
with the options of each case (hard negatives, groups, the hardness offset, several positives per
row, the score filter by the model's own scores or by a guide's, Matryoshka widths; or in-batch
distillation from a teacher, ``contrastive_distillation_loss``), calls
``contrastive_loss(..., process_group=WORLD)`` with the Triton backend when it is
importable (else the tiled PyTorch one) in fp32 and bf16, and backpropagates. Every rank
compares its gradients of its queries and keys, and the group's total gradient of the scale and
bias, with float64 autograd through the materialised reference on the concatenated batch (the
same bf16-rounded inputs), and with one process on the concatenated batch with the same backend
and dtype, whose own rounding error is the most the ring can be asked for. Prints one line per
check, then ``ALL PASSED``, or exits with status 1.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torchrun puts this script's folder, not the repository, on sys.path: make the package
# importable from a plain checkout too (an installed one is found either way).
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_infcl import contrastive_distillation_loss, contrastive_loss  # noqa: E402
from hf_infcl.ops import ring  # noqa: E402

# Relative (to the largest entry) max error allowed per dtype. fp32 runs with TF32 ("auto").
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 2e-2}
LOGIT_SCALE = 1 / 0.07
HARDNESS_STRENGTH = 5.0
GROUP_COUNT = 50


@dataclass(frozen=True)
class Case:
    width: int
    rows: tuple[int, ...]  # per rank, cycled if there are more ranks
    keys: tuple[int, ...]
    loss: str = "softmax"
    symmetric: bool = True
    bias: bool = False
    groups: bool = False
    custom_positives: bool = False
    slice_bytes: int | None = None  # force the backward's key gradients into several slices
    hardness: str | None = None  # a hardness_mode, with strength HARDNESS_STRENGTH
    group_positives: str | None = None
    margin: float | None = None  # false_negative_margin
    strategy: str = "absolute"  # false_negative_strategy
    guide_width: int | None = None  # guide embeddings of this width for the score filter
    matryoshka: tuple[int, ...] | None = None  # matryoshka_dims (weights 1)
    teacher_width: int | None = None  # contrastive_distillation_loss with a teacher of this width
    listed: bool = False  # the Triton backend lists every left-out entry, whatever their rows and number


CASES = {
    "symmetric-hard_negatives": Case(256, rows=(1500, 1100), keys=(1800, 1100)),
    "symmetric-sliced": Case(128, rows=(900, 1300), keys=(1000, 1400), slice_bytes=300 * 128 * 4),
    "one_direction": Case(256, rows=(800, 1000), keys=(900, 1000), symmetric=False),
    "groups-custom_positives-c96": Case(96, rows=(700, 513), keys=(700, 600), groups=True,
                                        custom_positives=True),
    "sigmoid-bias": Case(256, rows=(1024, 900), keys=(1024, 1000), loss="sigmoid", bias=True),
    "zero_row_rank": Case(768, rows=(1200, 0), keys=(1200, 257)),
    # The options added to the ring since the cases above; width 256 keeps the tuning keys few.
    "hardness-in_batch-groups": Case(256, rows=(1000, 700), keys=(1200, 800), groups=True,
                                     custom_positives=True, hardness="in_batch_negatives"),
    "hardness-hard_negatives-one_direction": Case(256, rows=(700, 900), keys=(1100, 1000), symmetric=False,
                                                  hardness="hard_negatives"),
    "group_positives-any": Case(256, rows=(900, 600), keys=(1000, 800), groups=True, group_positives="any"),
    "group_positives-each": Case(256, rows=(600, 900), keys=(700, 1100), groups=True, custom_positives=True,
                                 group_positives="each"),
    "sigmoid-group_positives": Case(256, rows=(800, 700), keys=(900, 700), loss="sigmoid", bias=True,
                                    groups=True, group_positives="any"),
    # Positives score about 0.7, other keys about 0 +- 0.06 (0.12 for the guide): these margins leave
    # out several percent of the keys, so that the filter is at work.
    "filter-absolute": Case(256, rows=(1000, 700), keys=(1100, 900), margin=0.6),
    "filter-relative-one_direction": Case(256, rows=(700, 800), keys=(900, 800), symmetric=False,
                                          margin=0.85, strategy="relative"),
    "filter-guide-c64": Case(256, rows=(900, 600), keys=(1000, 700), margin=0.5, guide_width=64),
    # The same with each key block's left-out entries listed in the backward, whatever the share of
    # rows that has any and their number (most rows here: by default the backward filters every tile).
    "filter-guide-listed-c64": Case(256, rows=(900, 600), keys=(1000, 700), margin=0.5, guide_width=64,
                                    listed=True),
    # The sigmoid loss's one pass (its key gradients travel in the forward): a rank without rows,
    # the key gradients in several slices.
    "sigmoid-zero_row_rank-sliced": Case(256, rows=(1000, 0), keys=(1100, 300), loss="sigmoid", bias=True,
                                         slice_bytes=300 * 256 * 4),
    "matryoshka-symmetric": Case(256, rows=(900, 700), keys=(1000, 700), matryoshka=(256, 128, 64)),
    "matryoshka-sigmoid": Case(256, rows=(700, 900), keys=(800, 900), loss="sigmoid", bias=True,
                               matryoshka=(256, 96, 32)),
    # In-batch distillation (half KL, half InfoNCE), its teacher of another width.
    "distillation-c128": Case(256, rows=(900, 600), keys=(1000, 700), teacher_width=128),
}
DISTILLATION_WEIGHT = 0.5
TEACHER_SCALE = 20.0


def global_case(case: Case, world_size: int, seed: int):
    """The whole batch in float64 on CPU (the same on every rank), split per rank."""
    gen = torch.Generator().manual_seed(seed)
    rows = [case.rows[r % len(case.rows)] for r in range(world_size)]
    parts = []
    for r in range(world_size):
        m, k = rows[r], case.keys[r % len(case.keys)]
        queries = F.normalize(torch.randn(m, case.width, generator=gen, dtype=torch.float64), dim=1)
        keys = F.normalize(torch.randn(k, case.width, generator=gen, dtype=torch.float64), dim=1)
        positives = torch.randperm(k, generator=gen)[:m] if case.custom_positives else torch.arange(m)
        keys[positives] = F.normalize(keys[positives] + queries, dim=1)  # positives look alike
        parts.append({
            "queries": queries,
            "keys": keys,
            "positives": positives if case.custom_positives else None,
            "query_groups": torch.randint(0, GROUP_COUNT, (m,), generator=gen) if case.groups else None,
            "key_groups": torch.randint(0, GROUP_COUNT, (k,), generator=gen) if case.groups else None,
        })
        if case.hardness is not None:
            # Row ids unique in the whole group; each key owned by a row of any rank, or by nobody
            # (-1); a row's positive is its own.
            start = sum(rows[:r])
            owners = torch.randint(-1, max(1, sum(rows)), (k,), generator=gen)
            owners[positives] = torch.arange(start, start + m)
            parts[-1].update(query_ids=torch.arange(start, start + m), key_owners=owners)
        if case.guide_width is not None:
            guide_queries, guide_keys = (
                F.normalize(torch.randn(n, case.guide_width, generator=gen, dtype=torch.float64), dim=1)
                for n in (m, k))
            guide_keys[positives] = F.normalize(guide_keys[positives] + guide_queries, dim=1)
            parts[-1].update(guide_queries=guide_queries, guide_keys=guide_keys)
        if case.teacher_width is not None:  # a teacher that mostly agrees with the student
            teacher_queries, teacher_keys = (
                F.normalize(torch.randn(n, case.teacher_width, generator=gen, dtype=torch.float64), dim=1)
                for n in (m, k))
            teacher_keys[positives] = F.normalize(teacher_keys[positives] + teacher_queries, dim=1)
            parts[-1].update(teacher_queries=teacher_queries, teacher_keys=teacher_keys)
    return parts


FP16_COPIES = "--tf32-via-fp16" in sys.argv  # fp32 through scaled fp16 copies in the kernels too
DTYPES = (torch.float32,) if FP16_COPIES else (torch.float32, torch.bfloat16)  # the copies are fp32's only


def loss_of(case: Case, queries, keys, scale, bias, batch: dict, dtype, device, backend, **arguments):
    """The case's loss: ``contrastive_loss`` with its options, or, with a teacher,
    ``contrastive_distillation_loss`` on the same backend."""
    blocks = {}
    if backend == "triton" and case.listed:
        blocks.update(listed_row_share=1.0, listed_entries_per_vector=10**6)
    if backend == "triton" and FP16_COPIES and dtype == torch.float32:
        blocks.update(tf32_via_fp16=True)
    if blocks:
        from hf_infcl.ops.triton import TritonBlocks

        backend = TritonBlocks(**blocks)
    if case.teacher_width is None:
        return contrastive_loss(queries, keys, scale, bias, loss=case.loss, symmetric=case.symmetric,
                                backend=backend, **arguments, **option_arguments(case, batch, dtype, device))
    teacher = [batch[name].to(device=device, dtype=dtype) for name in ("teacher_queries", "teacher_keys")]
    return contrastive_distillation_loss(queries, keys, *teacher, scale, TEACHER_SCALE,
                                         symmetric=case.symmetric, distillation_weight=DISTILLATION_WEIGHT,
                                         backend=backend, **arguments)


def option_arguments(case: Case, batch: dict, dtype, device) -> dict:
    """``contrastive_loss``'s hardness, several-positives and score-filter arguments for a batch (a
    rank's part or the concatenated batch), the guide in ``dtype`` as the loss requires."""
    arguments = dict(group_positives=case.group_positives, false_negative_margin=case.margin,
                     false_negative_strategy=case.strategy, matryoshka_dims=case.matryoshka)
    if case.hardness is not None:
        arguments.update(hardness_mode=case.hardness, hardness_strength=HARDNESS_STRENGTH,
                         query_ids=batch["query_ids"].to(device), key_owners=batch["key_owners"].to(device))
    if case.guide_width is not None:
        arguments.update({name: batch[name].to(device=device, dtype=dtype)
                          for name in ("guide_queries", "guide_keys")})
    return arguments


def ring_gradients(case: Case, part: dict, dtype, device, backend):
    queries = part["queries"].to(device=device, dtype=dtype).requires_grad_(True)
    keys = part["keys"].to(device=device, dtype=dtype).requires_grad_(True)
    scale = torch.tensor(LOGIT_SCALE, device=device, requires_grad=True)
    bias = torch.tensor(-10.0, device=device, requires_grad=True) if case.bias else None
    moved = {name: None if part[name] is None else part[name].to(device)
             for name in ("positives", "query_groups", "key_groups")}
    if case.teacher_width is not None:
        moved = {"positives": moved["positives"]}  # distillation has no groups
    value = loss_of(case, queries, keys, scale, bias, part, dtype, device, backend, reduction="mean",
                    process_group=dist.group.WORLD, **moved)
    value.backward()
    grads = {"queries": queries.grad, "keys": keys.grad, "scale": scale.grad}
    if case.bias:
        grads["bias"] = bias.grad
    return value.detach(), grads


def one_process_gradients(case: Case, parts: list[dict], dtype, device, backend):
    """One process on the concatenated batch, of the sum of the ranks' ``mean`` losses,
    (n / M) * sum of all rows: what the ring differentiates.

    ``backend="reference"`` in float64 (on the ``dtype``-rounded inputs) is the oracle; the same
    backend and dtype as the ring's is the single-GPU baseline, whose own rounding error bounds
    what the ring may be expected to reach.
    """
    world_size = len(parts)
    compute_dtype = torch.float64 if backend == "reference" else dtype
    rounded = [{name: part[name].to(dtype).to(compute_dtype) for name in ("queries", "keys")}
               for part in parts]
    queries = torch.cat([p["queries"] for p in rounded]).to(device).requires_grad_(True)
    keys = torch.cat([p["keys"] for p in rounded]).to(device).requires_grad_(True)
    offsets, positives = 0, []
    for part in parts:
        local = part["positives"] if part["positives"] is not None else torch.arange(part["queries"].shape[0])
        positives.append(local + offsets)
        offsets += part["keys"].shape[0]
    groups = {}
    if case.groups:
        groups = {name: torch.cat([p[name] for p in parts]).to(device)
                  for name in ("query_groups", "key_groups")}
    # The ids, and the guide rounded to ``dtype`` as the ring's is (then computed in compute_dtype).
    whole = {name: torch.cat([p[name] for p in parts])
             for name in ("query_ids", "key_owners") if name in parts[0]}
    whole.update({name: torch.cat([p[name] for p in parts]).to(dtype).to(compute_dtype)
                  for name in ("guide_queries", "guide_keys", "teacher_queries", "teacher_keys")
                  if name in parts[0]})
    scalar_dtype = torch.float64 if backend == "reference" else torch.float32
    scale = torch.tensor(LOGIT_SCALE, dtype=scalar_dtype, device=device, requires_grad=True)
    bias = torch.tensor(-10.0, dtype=scalar_dtype, device=device, requires_grad=True) if case.bias else None
    total = loss_of(case, queries, keys, scale, bias, whole, compute_dtype, device, backend,
                    positives=torch.cat(positives).to(device), reduction="sum", **groups)
    total = total * (world_size / queries.shape[0])
    total.backward()
    grads = {"queries": queries.grad, "keys": keys.grad, "scale": scale.grad}
    if case.bias:
        grads["bias"] = bias.grad
    return total.detach() / world_size, grads  # (global mean, gradients)


def relative_error(value: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0 if value.numel() == 0 else float("inf")
    scale = expected.abs().max().clamp_min(1e-30)
    return float((value.double() - expected).abs().max() / scale)


def selected_cases(arguments: list[str]) -> set[str]:
    """The case names to run: all, or with ``--only A,B`` those containing A or B (an error naming
    ``--only`` if none does)."""
    if "--only" not in arguments:
        return set(CASES)
    position = arguments.index("--only")
    if position + 1 == len(arguments):
        raise SystemExit("--only needs a comma-separated list of parts of case names")
    parts = arguments[position + 1].split(",")
    wanted = {name for name in CASES if any(part and part in name for part in parts)}
    if not wanted:
        raise SystemExit(f"--only {arguments[position + 1]!r} matches no case; the cases: {', '.join(CASES)}")
    return wanted


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_cpu = "--cpu" in sys.argv  # a dry run of this script over gloo, without GPUs
    if on_cpu:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        device, backend = torch.device("cpu"), "torch"
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timedelta(seconds=120))
        device = torch.device("cuda", local_rank)
        try:
            import hf_infcl.ops.triton  # noqa: F401

            backend = "triton"
        except ImportError:
            backend = "torch"
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"ring NCCL check: {world_size} ranks, backend={backend}"
              f"{', fp32 via fp16 copies' if FP16_COPIES else ''}, torch {torch.__version__}, "
              f"{'cpu (gloo)' if on_cpu else torch.cuda.get_device_name()}", flush=True)

    failures = []
    started = time.perf_counter()
    default_slice_bytes = ring._MAX_SLICE_BYTES
    wanted = selected_cases(sys.argv[1:])
    for index, (name, case) in enumerate(CASES.items()):
        if name not in wanted:
            continue
        parts = global_case(case, world_size, seed=100 + index)
        for dtype in DTYPES:
            ring._MAX_SLICE_BYTES = case.slice_bytes or default_slice_bytes
            try:
                value, grads = ring_gradients(case, parts[rank], dtype, device, backend)
            finally:
                ring._MAX_SLICE_BYTES = default_slice_bytes
            expected_mean, expected = one_process_gradients(case, parts, dtype, device, "reference")
            single_mean, single = one_process_gradients(case, parts, dtype, device, backend)
            # Rank r's slices of the one-process query and key gradients.
            row0 = sum(p["queries"].shape[0] for p in parts[:rank])
            key0 = sum(p["keys"].shape[0] for p in parts[:rank])
            for whole in (expected, single):
                whole["queries"] = whole["queries"][row0: row0 + parts[rank]["queries"].shape[0]]
                whole["keys"] = whole["keys"][key0: key0 + parts[rank]["keys"].shape[0]]
            # Scale and bias: the group's total (what DDP's average times n would give).
            for shared in ("scale", "bias"):
                if shared in grads:
                    dist.all_reduce(grads[shared])
            logged = value.float().clone()
            dist.all_reduce(logged)
            errors = {key: relative_error(grads[key], expected[key]) for key in grads}
            errors["logged_loss"] = relative_error(logged / world_size, expected_mean.reshape(()))
            baseline = {key: relative_error(single[key], expected[key]) for key in grads}
            baseline["logged_loss"] = relative_error(single_mean.reshape(()), expected_mean.reshape(()))
            # The ring must meet the dtype's tolerance, or be no worse than one GPU is: bf16
            # gradients of peaked softmaxes lose digits to cancellation whatever computes them.
            ok = all(error <= max(TOLERANCE[dtype], 1.5 * baseline.get(key, 0.0))
                     for key, error in errors.items())
            flags = torch.tensor([0.0 if ok else 1.0], device=device)
            dist.all_reduce(flags)
            line = " ".join(f"{key}={error:.1e}" for key, error in errors.items())
            line += " | one GPU: " + " ".join(f"{key}={error:.1e}" for key, error in baseline.items())
            print(f"[rank {rank}] {name:38s} {str(dtype):15s} {'ok' if ok else 'FAIL'}  {line}", flush=True)
            if flags.item() > 0:
                failures.append((name, str(dtype)))
    dist.barrier()
    if rank == 0:
        seconds = time.perf_counter() - started
        print(f"checked {len(wanted) * len(DTYPES)} cases in {seconds:.1f} s", flush=True)
        print("ALL PASSED" if not failures else f"FAILED: {sorted(set(failures))}", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
