"""The ring across processes (gloo on CPU): one DDP step of a tiny dual encoder on uneven
per-rank batches equals one process on the concatenated batch, to 1e-6 in float64.

Each world size (2 and 3 processes) is spawned once per session; the processes run every
scenario of ``tests/helpers/ring_workers.py`` and write their results to files, which the tests below
judge. A hang cannot stall the suite: the processes have a 60 s collective timeout and are
killed after ``SPAWN_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hf_infcl import contrastive_loss
from tests.helpers import ring_workers

WORLD_SIZES = (2, 3)
SPAWN_TIMEOUT_S = 150
TOLERANCE = {"rtol": 1e-6, "atol": 1e-9}
REPO = Path(__file__).resolve().parents[1]


def _spawn(world_size: int, out_dir: str, worker=ring_workers.worker) -> list[dict]:
    """Run ``worker(rank, world_size, init_file, out_dir)`` in ``world_size`` spawned processes; return
    what each wrote to ``out_dir/rank{r}.pt``, or fail with what they raised (or that they hung)."""
    context = mp.get_context("spawn")
    init_file = os.path.join(out_dir, "init")
    processes = [
        context.Process(target=worker, args=(rank, world_size, init_file, out_dir))
        for rank in range(world_size)
    ]
    # The Triton block ops run in Triton's interpreter on CPU, which Triton reads when it is first
    # imported: in a spawned rank that is while it unpickles its target (importing hf_infcl
    # imports torch's compiler stack, and with it Triton), so the variable must be in the
    # environment the ranks start with. Only theirs: the test process keeps its own.
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for process in processes:
            process.start()
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    for process in processes:
        process.join(timeout=SPAWN_TIMEOUT_S)
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in hung:
        processes[rank].kill()
        processes[rank].join()
    errors = {
        rank: Path(out_dir, f"rank{rank}.error").read_text()
        for rank in range(world_size)
        if Path(out_dir, f"rank{rank}.error").exists()
    }
    exit_codes = [process.exitcode for process in processes]
    if hung or errors or any(exit_codes):
        details = "\n".join(f"--- rank {rank}:\n{text}" for rank, text in errors.items())
        pytest.fail(f"ring processes (n={world_size}): hung {hung}, exit codes {exit_codes}:\n{details}")
    return [
        torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)
    ]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"n{n}")
def ranks(request):
    """The results of every rank of one spawned group, in rank order."""
    out_dir = tempfile.mkdtemp(prefix=f"ring-n{request.param}-")
    try:
        yield _spawn(request.param, out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def assert_step_matches_one_process(ranks: list[dict], scenario: str) -> None:
    """Every rank's gradients and updated parameters after the DDP step of ``scenario`` equal those
    of one process on the concatenated batch (rank 0's float64 reference)."""
    reference = ranks[0]["scenarios"][scenario]
    for rank, result in enumerate(ranks):
        mine = result["scenarios"][scenario]
        assert mine["ring_grads"].keys() == reference["reference_grads"].keys()
        for name, expected in reference["reference_grads"].items():
            # Fresh random inputs: a zero gradient would make the comparison vacuous.
            assert expected.abs().max() > 1e-4, f"{name} has a vanishing reference gradient"
            torch.testing.assert_close(
                mine["ring_grads"][name], expected, **TOLERANCE,
                msg=lambda text, name=name, rank=rank: f"grad of {name} on rank {rank}: {text}",
            )
        for name, expected in reference["reference_params"].items():
            torch.testing.assert_close(mine["ring_params"][name], expected, **TOLERANCE)


def assert_logged_loss_is_the_global_mean(ranks: list[dict], scenario: str) -> None:
    reference_loss = ranks[0]["scenarios"][scenario]["reference_loss"]
    for result in ranks:
        torch.testing.assert_close(result["scenarios"][scenario]["logged_loss"], reference_loss, **TOLERANCE)
    # The ranks' values differ (uneven batches): the comparison is not of one number.
    per_rank = ranks[0]["scenarios"][scenario]["per_rank_losses"]
    assert len(set(per_rank.tolist())) == len(ranks)


@pytest.mark.parametrize("scenario", sorted(ring_workers.SCENARIOS))
def test_ddp_step_equals_one_process_on_the_concatenated_batch(ranks, scenario):
    assert_step_matches_one_process(ranks, scenario)


@pytest.mark.parametrize("scenario", sorted(ring_workers.SCENARIOS))
def test_logged_loss_is_the_global_mean(ranks, scenario):
    assert_logged_loss_is_the_global_mean(ranks, scenario)


SAME_ERROR_EVERYWHERE = {
    "width": "feature width c",
    "dtype": "dtype of the features",
    "symmetric": "symmetric",
    "loss": "disagree on loss",
    "bias_given": "logit_bias",
    "groups_given": "query_groups/key_groups",
    "reduction": "disagree on reduction",
    "hardness_mode": "disagree on hardness_mode",
    "hardness_strength": "disagree on hardness_strength",
    "label_smoothing": "disagree on label_smoothing",
    "group_positives": "disagree on group_positives",
    "false_negative_margin": "disagree on false_negative_margin",
    "margin_given": "whether false_negative_margin is given",
    "false_negative_strategy": "disagree on false_negative_strategy",
    "guide_width": "width of guide_queries/guide_keys",
    "gradient_wanted": "whether a gradient is wanted",
    "no_rows_anywhere": "no rank of the process group has any rows",
}


def assert_same_error_everywhere(ranks: list[dict], case: str, fragment: str) -> None:
    """Every rank raised the same ValueError for disagreement ``case``, its message holding ``fragment``."""
    raised = [result["raised"][case] for result in ranks]
    assert all(r is not None for r in raised), f"some rank did not raise: {raised}"
    assert all(r == raised[0] for r in raised), f"ranks raised different errors: {raised}"
    kind, message = raised[0]
    assert kind == "ValueError"
    assert fragment in message


@pytest.mark.parametrize("case", sorted(SAME_ERROR_EVERYWHERE))
def test_disagreeing_ranks_raise_the_same_error_on_every_rank(ranks, case):
    assert_same_error_everywhere(ranks, case, SAME_ERROR_EVERYWHERE[case])


def test_one_rank_rejecting_its_arguments_stops_every_rank(ranks):
    raised = [result["raised"]["bad_positives_on_one_rank"] for result in ranks]
    assert raised[1] == ("ValueError", raised[1][1]) and "positives" in raised[1][1]
    for rank, error in enumerate(raised):
        if rank != 1:
            assert error == ("ValueError", error[1]) and "rank(s) [1]" in error[1], error


def test_group_still_usable_after_the_errors(ranks):
    # Every rank's ``sum`` loss after the errors, summed over ranks: the global sum, the same on
    # every rank, and equal to the reference loss of the concatenated batch.
    world_size = len(ranks)
    queries = torch.cat([ring_workers._features(2 + r, seed=r) for r in range(world_size)])
    keys = torch.cat([ring_workers._features(3 + r, seed=10 + r) for r in range(world_size)])
    key_offsets = [sum(3 + s for s in range(r)) for r in range(world_size)]
    positives = torch.cat([torch.arange(2 + r) + key_offsets[r] for r in range(world_size)])
    expected = contrastive_loss(queries, keys, 3.0, positives=positives, reduction="sum", backend="reference")
    for result in ranks:
        torch.testing.assert_close(result["after_errors"], expected, **TOLERANCE)


def test_reductions_none_and_sum_without_autograd(ranks):
    parts = ring_workers.reduction_inputs(len(ranks))
    queries = torch.cat([q for q, _ in parts])
    keys = torch.cat([k for _, k in parts])
    key_offsets = torch.tensor([0] + [k.shape[0] for _, k in parts]).cumsum(0)
    positives = torch.cat([torch.arange(q.shape[0]) + key_offsets[r] for r, (q, _) in enumerate(parts)])
    expected = contrastive_loss(queries, keys, 3.0, positives=positives, reduction="none",
                                backend="reference")
    row_offsets = [0] + torch.tensor([q.shape[0] for q, _ in parts]).cumsum(0).tolist()
    for rank, result in enumerate(ranks):
        mine = expected[row_offsets[rank]: row_offsets[rank + 1]]
        torch.testing.assert_close(result["reductions"]["none"], mine, **TOLERANCE)
        torch.testing.assert_close(result["reductions"]["sum"], mine.sum(), **TOLERANCE)


@pytest.mark.parametrize("weighting", ["even", "uneven"])
def test_sigmoid_gradients_when_each_rank_scales_its_own_loss(ranks, weighting):
    """The sigmoid loss takes its gradients in the forward, each key's summed over every rank's
    rows with weight 1; the backward scales them by the rows' common weight, which the ranks
    agree on first. Rank r scaling its loss by r + 1 gives each rank's rows another weight: the
    gradients must still be those of the sum of the scaled losses (one process, float64)."""
    n = len(ranks)
    parts = ring_workers.reduction_inputs(n)
    queries = torch.cat([q for q, _ in parts]).requires_grad_(True)
    keys = torch.cat([k for _, k in parts]).requires_grad_(True)
    bias = torch.tensor(-1.0, dtype=queries.dtype, requires_grad=True)
    key_offsets = [0] + torch.tensor([k.shape[0] for _, k in parts]).cumsum(0).tolist()
    row_offsets = [0] + torch.tensor([q.shape[0] for q, _ in parts]).cumsum(0).tolist()
    positives = torch.cat([torch.arange(q.shape[0]) + key_offsets[r] for r, (q, _) in enumerate(parts)])
    per_row = contrastive_loss(queries, keys, 3.0, bias, loss="sigmoid", positives=positives,
                               reduction="none", backend="reference")
    factors = [float(r + 1) if weighting == "uneven" else 1.0 for r in range(n)]
    row_factor = torch.cat([torch.full((q.shape[0],), factor, dtype=queries.dtype)
                            for (q, _), factor in zip(parts, factors)])
    # each rank's mean is (n / M) times its rows' sum (docs/contract.md, "Reductions")
    (per_row * row_factor).sum().mul(n / queries.shape[0]).backward()
    bias_total = sum(result["weighted_sigmoid"][weighting]["bias"] for result in ranks)
    torch.testing.assert_close(bias_total, bias.grad, **TOLERANCE)  # each rank has its share
    for rank, result in enumerate(ranks):
        mine = result["weighted_sigmoid"][weighting]
        torch.testing.assert_close(mine["queries"], queries.grad[row_offsets[rank]:row_offsets[rank + 1]],
                                   **TOLERANCE)
        torch.testing.assert_close(mine["keys"], keys.grad[key_offsets[rank]:key_offsets[rank + 1]],
                                   **TOLERANCE)
    assert keys.grad.abs().max() > 1e-3


def test_ring_schedule_switches_leave_out_the_transfers_or_the_compute(ranks):
    """ring.schedule(transfer=False) runs every block computation and no transfer;
    compute=False every transfer and no block computation (through the backward too); outside
    the context the ring is exact again."""
    for result in ranks:
        runs = result["schedules"]
        full, no_transfer, no_compute = runs["full"], runs["no-transfer"], runs["no-compute"]
        assert full["blocks"] > 0 and full["batches"] > 0
        assert (no_transfer["blocks"], no_transfer["batches"]) == (full["blocks"], 0)
        assert (no_compute["blocks"], no_compute["batches"]) == (0, full["batches"])
        torch.testing.assert_close(runs["after"]["value"], full["value"], rtol=0, atol=0)
        torch.testing.assert_close(runs["after"]["queries"], full["queries"], rtol=0, atol=0)


def test_each_key_block_counts_its_pairs_before_its_kernels_and_lists_them_after(ranks):
    """With several positives, listing a block's pairs waits on the host for their number: counted
    before the block's kernels are queued and listed after them, that wait is on the count, not on
    the kernels, at every block of the forward and every slice of the backward."""
    for result in ranks:
        events = result["pair_order"]
        assert events and len(events) % 3 == 0, events
        triples = [tuple(events[start:start + 3]) for start in range(0, len(events), 3)]
        assert all(first == "counted" and last == "listed" for first, _, last in triples), events
        kernels = [kernel for _, kernel, _ in triples]
        assert kernels[:len(ranks)] == ["forward_block"] * len(ranks), events
        assert set(kernels[len(ranks):]) == {"backward_block"}, events


@pytest.mark.parametrize("case", sorted(ring_workers.TRAFFIC_CASES))
def test_bytes_sent_per_rank_are_the_readme_formula(ranks, case):
    """The README's count ("What crosses the network"): per rank and step, the forward sends the
    key block (k_max x c, input dtype) n - 1 times and, for the symmetric softmax loss, its column
    log-sum-exp (k_max, accumulation dtype) n times; the backward sends the key block n - 1 times
    with, for the symmetric loss, the column statistic and its gradient (2 k_max), and the key
    gradients (k_max x c, accumulation dtype) n times. The sigmoid loss computes its gradients in
    the forward: the key block goes round once, with its key gradients, and the backward sends
    nothing."""
    loss, symmetric, dtype = ring_workers.TRAFFIC_CASES[case]
    n, c = len(ranks), ring_workers.TRAFFIC_WIDTH
    k_max = max(ring_workers.traffic_keys(rank) for rank in range(n))
    element = torch.finfo(dtype).bits // 8
    accumulator = 8 if dtype == torch.float64 else 4
    columns = loss == "softmax" and symmetric
    blocks, key_gradients = (n - 1) * k_max * c * element, n * k_max * c * accumulator
    if loss == "sigmoid":
        forward, backward = blocks + key_gradients, 0
    else:
        forward = blocks + columns * n * k_max * accumulator
        backward = blocks + (n - 1) * k_max * columns * 2 * accumulator + key_gradients
    for result in ranks:
        assert result["traffic"][case] == {"forward": forward, "backward": backward}


@pytest.mark.parametrize("loss_name", sorted(ring_workers.TRITON_LOSSES))
def test_ring_over_triton_block_ops_matches_float64(ranks, loss_name):
    if ranks[0]["triton"] is None:
        pytest.skip("Triton is not importable here")
    world_size = len(ranks)
    loss, bias_value, hardness, objectives = ring_workers.TRITON_LOSSES[loss_name]
    parts = ring_workers.triton_inputs(world_size, objectives)
    queries = torch.cat([p["queries"] for p in parts]).double().requires_grad_(True)
    keys = torch.cat([p["keys"] for p in parts]).double().requires_grad_(True)
    key_offsets = [0] + torch.tensor([p["keys"].shape[0] for p in parts]).cumsum(0).tolist()
    row_offsets = [0] + torch.tensor([p["queries"].shape[0] for p in parts]).cumsum(0).tolist()
    labels = [ring_workers.triton_labels(objectives, part) for part in parts]
    local_positives = [torch.arange(p["queries"].shape[0]) if label["positives"] is None else p["positives"]
                       for p, label in zip(parts, labels)]
    positives = torch.cat([local + key_offsets[r] for r, local in enumerate(local_positives)])
    groups = {name: None if labels[0][name] is None else torch.cat([label[name] for label in labels])
              for name in ("query_groups", "key_groups")}
    scale = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
    bias = None
    if bias_value is not None:
        bias = torch.tensor(bias_value, dtype=torch.float64, requires_grad=True)
    # What the ring differentiates: the sum of the ranks' "mean" values, (n / M) * all rows.
    total = contrastive_loss(
        queries, keys, scale, bias, loss=loss, positives=positives, reduction="sum", backend="reference",
        **groups,
        **ring_workers.hardness_arguments(hardness, {name: torch.cat([p[name] for p in parts])
                                                     for name in ("query_ids", "key_owners")}),
        **ring_workers.objective_arguments(objectives, {name: torch.cat([p[name] for p in parts]).double()
                                                        for name in ("guide_queries", "guide_keys")}),
    ) * (world_size / queries.shape[0])
    total.backward()
    fp32 = {"rtol": 1e-5, "atol": 1e-6}
    if objectives.get("listed_row_share"):
        # The listed left-out entries' terms are added by the tiles and taken back from logits
        # formed again in another order: their rounding, of the logits' size (up to 40 with these
        # unnormalised features) times 2^-24, stays in gradient elements that are near 0.
        fp32["atol"] = 1e-5
    for rank, result in enumerate(ranks):
        mine = result["triton"][loss_name]
        rows = slice(row_offsets[rank], row_offsets[rank + 1])
        cols = slice(key_offsets[rank], key_offsets[rank + 1])
        torch.testing.assert_close(mine["queries"].double(), queries.grad[rows], **fp32)
        torch.testing.assert_close(mine["keys"].double(), keys.grad[cols], **fp32)
    listed = [result["triton"][loss_name]["listed"] for result in ranks]
    if objectives.get("listed_row_share"):  # the backward of every rank with rows listed its entries
        assert all(blocks for blocks, part in zip(listed, parts) if len(part["queries"])), listed
        assert sum(map(sum, listed)) > 0, listed
    else:  # nothing listed (a rank without left-out entries may list none)
        assert not any(map(sum, listed)), listed
    summed = {name: sum(float(r["triton"][loss_name][name]) for r in ranks) for name in ("value", "scale")}
    torch.testing.assert_close(summed["value"], float(total.detach()), **fp32)
    torch.testing.assert_close(summed["scale"], float(scale.grad), **fp32)
    if bias is not None:
        bias_total = sum(float(r["triton"][loss_name]["bias"]) for r in ranks)
        torch.testing.assert_close(bias_total, float(bias.grad), **fp32)


def test_group_of_one_gives_exactly_the_local_result(ranks):
    in_group, local = ranks[0]["group_of_one"]
    assert torch.equal(in_group, local)


# --------------------------------------------------------------------------------------------
# NCCL (GPU): the parity script under torchrun, when two GPUs are visible.


def test_nccl_ring_parity_script_dry_run_on_cpu():
    """The script itself over gloo (``--cpu``, the torch tiles), on its sigmoid, Matryoshka and
    distillation cases: the one-pass ring with a rank without rows and sliced key gradients, the
    widths, the teacher."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "scripts" / "ring_nccl_check.py"), "--cpu",
               "--only", "sigmoid,matryoshka,distillation"]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "ALL PASSED" in completed.stdout and "checked 12 cases" in completed.stdout


@pytest.mark.gpu
def test_nccl_ring_parity_script():
    """The 38 NCCL checks (19 cases in fp32 and bf16) with autotuning on. On a machine whose
    Triton and tuning caches are cold, every tuning key (width, size class, the dtypes of the
    kernel's arguments, which the options change) tunes once (rank 0 tunes, rank 1 waits and
    loads), hence the long limit."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "scripts" / "ring_nccl_check.py")]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "ALL PASSED" in completed.stdout
