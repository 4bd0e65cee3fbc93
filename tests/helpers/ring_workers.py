"""Processes of the gloo ring tests (``tests/test_ring.py``), spawned 2 or 3 at a time on CPU.

Each rank trains a tiny dual encoder wrapped in DDP for one step on its own uneven slice of a
global batch, with the ring loss over the process group; rank 0 repeats the step in one process
on the concatenated batch with the materialised float64 reference loss. Both sets of gradients,
the updated parameters and the logged loss go to a file that the test process compares. The same
processes then provoke every kind of disagreement between ranks and record what each rank
raised. Nothing is asserted here: a failure must reach pytest, not die in a child.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hf_infcl import TorchTiles, contrastive_loss
from hf_infcl.ops import ring
from tests.helpers.recording_tiles import RecordingTiles, recorded

INPUT_WIDTH = 5
FEATURE_WIDTH = 4
# Small tiles, so that every block crosses tile boundaries in both directions.
TILES = TorchTiles(tile_rows=2, tile_keys=3)


@dataclass(frozen=True)
class Scenario:
    """One DDP training step: loss options and the rows/keys each rank holds, per world size (4:
    the two-node launch of ``tests/test_multinode.py``, for the scenarios that have it)."""

    loss: str = "softmax"
    symmetric: bool = True
    bias: bool = False
    groups: bool = False
    custom_positives: bool = False
    rows: dict = field(default_factory=dict)  # world size -> rows per rank
    # world size -> keys per rank (>= rows: the extras are hard negatives)
    keys: dict = field(default_factory=dict)
    backend: object = TILES
    process_group: str = "auto"  # "auto", or "world" for dist.group.WORLD passed explicitly
    slice_bytes: int | None = None  # force the backward's key gradients to travel in many slices
    hardness: str | None = None  # a hardness_mode, with strength HARDNESS_STRENGTH
    label_smoothing: float = 0.0
    group_positives: str | None = None
    margin: float | None = None  # false_negative_margin
    strategy: str = "absolute"  # false_negative_strategy
    guide: bool = False  # guide embeddings (of width GUIDE_WIDTH, no gradient) for the score filter


SCENARIOS = {
    "softmax_symmetric": Scenario(
        rows={2: (5, 2), 3: (3, 0, 2), 4: (3, 1, 0, 4)}, keys={2: (5, 2), 3: (3, 0, 2), 4: (3, 1, 0, 4)},
        process_group="world",
    ),
    "hard_negatives": Scenario(
        # n=2: rank 1 has one row and two hard negatives; n=3: rank 1 has hard negatives only.
        rows={2: (4, 1), 3: (4, 0, 2), 4: (2, 4, 1, 0)}, keys={2: (6, 3), 3: (5, 3, 2), 4: (3, 6, 2, 3)},
        slice_bytes=3 * FEATURE_WIDTH * 8,
    ),
    "hard_negatives_one_direction": Scenario(
        symmetric=False, rows={2: (3, 2), 3: (2, 3, 1)}, keys={2: (5, 2), 3: (2, 5, 3)}, backend="torch",
    ),
    "groups_spanning_ranks": Scenario(
        groups=True, custom_positives=True, rows={2: (4, 3), 3: (3, 1, 3)}, keys={2: (5, 4), 3: (4, 3, 3)},
        slice_bytes=2 * FEATURE_WIDTH * 8,
    ),
    "one_key_per_rank": Scenario(  # key blocks of one row: the backward's single-slice path
        rows={2: (1, 1), 3: (1, 1, 1)}, keys={2: (1, 1), 3: (1, 1, 1)},
    ),
    "sigmoid_with_bias": Scenario(
        loss="sigmoid", bias=True, rows={2: (4, 2), 3: (2, 0, 3), 4: (2, 3, 1, 2)},
        keys={2: (5, 2), 3: (3, 2, 3), 4: (3, 3, 2, 4)},
    ),
    "sigmoid_groups": Scenario(
        loss="sigmoid", bias=True, groups=True,
        rows={2: (3, 3), 3: (2, 2, 2)}, keys={2: (4, 3), 3: (2, 3, 2)},
    ),
    # Key owners spanning ranks travel with their key blocks (in slices in the backward).
    "hardness_in_batch_groups": Scenario(
        groups=True, custom_positives=True, hardness="in_batch_negatives",
        rows={2: (4, 2), 3: (3, 0, 2), 4: (2, 3, 0, 2)}, keys={2: (6, 4), 3: (4, 3, 3), 4: (3, 4, 2, 3)},
        slice_bytes=2 * FEATURE_WIDTH * 8,
    ),
    "hardness_hard_negatives_one_direction": Scenario(
        symmetric=False, hardness="hard_negatives", backend="torch",
        rows={2: (3, 2), 3: (2, 1, 3)}, keys={2: (6, 5), 3: (4, 3, 6)},
    ),
    "hardness_all_negatives": Scenario(
        hardness="all_negatives", rows={2: (2, 4), 3: (2, 2, 1)}, keys={2: (5, 6), 3: (3, 4, 2)},
    ),
    # The mean key and query over the group (all-reduced, their gradient too): uneven ranks, hard
    # negatives, a rank without rows (n=3).
    "label_smoothing": Scenario(
        label_smoothing=0.1, rows={2: (5, 2), 3: (3, 0, 2)}, keys={2: (7, 3), 3: (4, 2, 3)},
    ),
    "label_smoothing_one_direction": Scenario(
        symmetric=False, label_smoothing=0.3, custom_positives=True, backend="torch",
        rows={2: (2, 4), 3: (1, 3, 2)}, keys={2: (5, 6), 3: (3, 4, 4)},
    ),
    # Several positives per row: the groups' pairs span ranks; the keys' positive parts travel with
    # the column statistic, their gradients with the key gradients' slices.
    "group_positives_any": Scenario(
        groups=True, custom_positives=True, group_positives="any",
        rows={2: (4, 3), 3: (3, 0, 3), 4: (3, 1, 2, 3)}, keys={2: (6, 4), 3: (4, 3, 3), 4: (4, 3, 3, 3)},
        slice_bytes=2 * FEATURE_WIDTH * 8,
    ),
    "group_positives_each_one_direction": Scenario(
        symmetric=False, groups=True, group_positives="each", backend="torch",
        rows={2: (3, 4), 3: (2, 3, 2)}, keys={2: (5, 4), 3: (2, 5, 3)},
    ),
    "group_positives_each_symmetric": Scenario(
        groups=True, group_positives="each", rows={2: (5, 2), 3: (2, 2, 3)}, keys={2: (5, 3), 3: (2, 4, 3)},
    ),
    "group_positives_sigmoid": Scenario(
        loss="sigmoid", bias=True, groups=True, group_positives="any",
        rows={2: (3, 3), 3: (2, 0, 2)}, keys={2: (4, 3), 3: (2, 3, 2)},
    ),
    # The score filter: the guide's key blocks and the keys' column thresholds travel with the keys.
    "filter_absolute": Scenario(
        margin=0.2, rows={2: (5, 2), 3: (3, 0, 2)}, keys={2: (6, 3), 3: (4, 2, 3)},
        slice_bytes=2 * FEATURE_WIDTH * 8,
    ),
    "filter_guide_relative_groups": Scenario(
        groups=True, custom_positives=True, margin=-0.1, strategy="relative", guide=True,
        rows={2: (4, 3), 3: (3, 1, 3), 4: (3, 1, 2, 2)}, keys={2: (5, 4), 3: (4, 3, 3), 4: (4, 3, 3, 3)},
        slice_bytes=2 * FEATURE_WIDTH * 8,
    ),
    "filter_guide_group_positives": Scenario(
        groups=True, custom_positives=True, group_positives="each", margin=0.1, guide=True,
        rows={2: (4, 2), 3: (2, 2, 2)}, keys={2: (6, 4), 3: (3, 4, 3)},
    ),
    "filter_sigmoid_one_direction": Scenario(
        loss="sigmoid", bias=True, margin=-0.3, backend="torch",
        rows={2: (3, 3), 3: (2, 1, 3)}, keys={2: (4, 5), 3: (3, 3, 4)},
    ),
}
HARDNESS_STRENGTH = 3.0
GUIDE_WIDTH = 3


class TinyDualEncoder(nn.Module):
    """Two linear towers plus a learnable temperature (and a SigLIP bias)."""

    def __init__(self, with_bias: bool):
        super().__init__()
        self.query_tower = nn.Linear(INPUT_WIDTH, FEATURE_WIDTH, dtype=torch.float64)
        self.key_tower = nn.Linear(INPUT_WIDTH, FEATURE_WIDTH, dtype=torch.float64)
        self.log_scale = nn.Parameter(torch.tensor(math.log(4.0), dtype=torch.float64))
        self.bias = nn.Parameter(torch.tensor(-1.5, dtype=torch.float64)) if with_bias else None

    def forward(self, query_inputs, key_inputs):
        queries = torch.tanh(self.query_tower(query_inputs))
        keys = torch.tanh(self.key_tower(key_inputs))
        return queries, keys, self.log_scale.exp(), self.bias


def global_batch(scenario: Scenario, world_size: int, seed: int):
    """The whole group's inputs, split by rank, with global positives and groups."""
    gen = torch.Generator().manual_seed(seed)
    rows, keys = scenario.rows[world_size], scenario.keys[world_size]
    parts = []
    for m, k in zip(rows, keys):
        part = {
            "query_inputs": torch.randn(m, INPUT_WIDTH, generator=gen, dtype=torch.float64),
            "key_inputs": torch.randn(k, INPUT_WIDTH, generator=gen, dtype=torch.float64),
            "positives": torch.randperm(k, generator=gen)[:m] if scenario.custom_positives else None,
            "query_groups": torch.randint(0, 3, (m,), generator=gen) if scenario.groups else None,
            "key_groups": torch.randint(0, 3, (k,), generator=gen) if scenario.groups else None,
        }
        # Make each positive's input resemble its row's, as a trained pairing would.
        positives = part["positives"] if part["positives"] is not None else torch.arange(m)
        part["key_inputs"][positives] += part["query_inputs"]
        if scenario.guide:
            part["guide_queries"] = torch.randn(m, GUIDE_WIDTH, generator=gen, dtype=torch.float64)
            part["guide_keys"] = torch.randn(k, GUIDE_WIDTH, generator=gen, dtype=torch.float64)
        parts.append(part)
    if scenario.hardness is not None:
        add_hardness_ids(parts, rows, keys, gen)
    return parts


def add_hardness_ids(parts, rows, keys, gen):
    """Each part's ``query_ids`` (unique across ranks) and ``key_owners``: a row's positive is its
    own, the other keys belong to random rows of any rank, or to nobody (-1)."""
    starts = [sum(rows[:rank]) for rank in range(len(rows))]
    for part, m, k, start in zip(parts, rows, keys, starts):
        part["query_ids"] = torch.arange(start, start + m)
        part["key_owners"] = torch.randint(-1, max(1, sum(rows)), (k,), generator=gen)
        positives = part["positives"] if part["positives"] is not None else torch.arange(m)
        part["key_owners"][positives] = part["query_ids"]


def hardness_arguments(hardness, batch):
    """The hardness keyword arguments of ``contrastive_loss`` for a batch (none without a mode)."""
    if hardness is None:
        return {}
    return dict(hardness_mode=hardness, hardness_strength=HARDNESS_STRENGTH, query_ids=batch["query_ids"],
                key_owners=batch["key_owners"])


def concatenated(parts):
    """One process's view of the whole batch: keys in rank order, positives as global indices."""
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + part["key_inputs"].shape[0])
    positives = []
    for part, offset in zip(parts, offsets):
        local = part["positives"]
        if local is None:
            local = torch.arange(part["query_inputs"].shape[0])
        positives.append(local + offset)
    groups = parts[0]["query_groups"] is not None
    batch = {
        "query_inputs": torch.cat([p["query_inputs"] for p in parts]),
        "key_inputs": torch.cat([p["key_inputs"] for p in parts]),
        "positives": torch.cat(positives),
        "query_groups": torch.cat([p["query_groups"] for p in parts]) if groups else None,
        "key_groups": torch.cat([p["key_groups"] for p in parts]) if groups else None,
    }
    for name in ("query_ids", "key_owners", "guide_queries", "guide_keys"):
        if name in parts[0]:
            batch[name] = torch.cat([p[name] for p in parts])
    return batch


def train_step(model, batch, scenario, backend, process_group):
    """Forward, loss, backward and one SGD step; returns the loss (detached)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    queries, keys, scale, bias = model(batch["query_inputs"], batch["key_inputs"])
    loss = contrastive_loss(
        queries, keys, scale, bias, loss=scenario.loss, symmetric=scenario.symmetric,
        positives=batch["positives"], query_groups=batch["query_groups"], key_groups=batch["key_groups"],
        reduction="mean", process_group=process_group, backend=backend,
        **hardness_arguments(scenario.hardness, batch), label_smoothing=scenario.label_smoothing,
        group_positives=scenario.group_positives, false_negative_margin=scenario.margin,
        false_negative_strategy=scenario.strategy, guide_queries=batch.get("guide_queries"),
        guide_keys=batch.get("guide_keys"),
    )
    loss.backward()
    module = getattr(model, "module", model)  # DDP wraps the encoder
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    optimizer.step()
    return loss.detach(), grads


def run_scenario(name: str, scenario: Scenario, rank: int, world_size: int):
    seed = 1000 + 17 * world_size + sorted(SCENARIOS).index(name)
    torch.manual_seed(seed)
    model = TinyDualEncoder(with_bias=scenario.bias)
    initial_state = {k: v.clone() for k, v in model.state_dict().items()}
    ddp_model = nn.parallel.DistributedDataParallel(model)
    parts = global_batch(scenario, world_size, seed)
    group = dist.group.WORLD if scenario.process_group == "world" else "auto"

    default_slice_bytes = ring._MAX_SLICE_BYTES
    if scenario.slice_bytes is not None:
        ring._MAX_SLICE_BYTES = scenario.slice_bytes
    try:
        loss, grads = train_step(ddp_model, parts[rank], scenario, scenario.backend, group)
    finally:
        ring._MAX_SLICE_BYTES = default_slice_bytes
    logged = loss.clone()
    dist.all_reduce(logged)
    logged /= world_size  # what a Trainer logs: the mean of the ranks' returned losses
    per_rank_losses = [torch.zeros_like(loss) for _ in range(world_size)]
    dist.all_gather(per_rank_losses, loss)
    result = {
        "ring_grads": grads,
        "ring_params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "logged_loss": logged,
        "per_rank_losses": torch.stack(per_rank_losses),
    }
    if rank == 0:
        reference_model = TinyDualEncoder(with_bias=scenario.bias)
        reference_model.load_state_dict(initial_state)
        reference_loss, reference_grads = train_step(
            reference_model, concatenated(parts), scenario, "reference", None
        )
        result.update(
            reference_loss=reference_loss,
            reference_grads=reference_grads,
            reference_params={k: v.detach().clone() for k, v in reference_model.state_dict().items()},
        )
    return result


# --------------------------------------------------------------------------------------------
# Ranks that disagree: each case gives every rank its own arguments; every rank records what it
# raised.


def _features(m, width=FEATURE_WIDTH, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, width, generator=gen, dtype=dtype)


def disagreement_cases(rank: int, world_size: int):
    last = world_size - 1
    ids = dict(query_ids=torch.arange(3) + 3 * rank, key_owners=torch.arange(3) + 3 * rank)  # hardness
    return {
        "width": lambda: contrastive_loss(_features(3, 4 + (rank == 0)), _features(3, 4 + (rank == 0)),
                                          process_group="auto"),
        "dtype": lambda: contrastive_loss(
            _features(3, dtype=torch.float32 if rank == last else torch.float64),
            _features(3, dtype=torch.float32 if rank == last else torch.float64), process_group="auto"),
        "symmetric": lambda: contrastive_loss(_features(3), _features(3), symmetric=rank != 0,
                                              process_group="auto"),
        "loss": lambda: contrastive_loss(
            _features(3), _features(3), loss="sigmoid" if rank == 0 else "softmax", process_group="auto"),
        "bias_given": lambda: contrastive_loss(
            _features(3), _features(3), logit_bias=-1.0 if rank == 0 else None, loss="sigmoid",
            process_group="auto"),
        "groups_given": lambda: contrastive_loss(
            _features(3), _features(3), query_groups=torch.zeros(3, dtype=torch.long) if rank == 0 else None,
            key_groups=torch.zeros(3, dtype=torch.long) if rank == 0 else None, process_group="auto"),
        "reduction": lambda: contrastive_loss(
            _features(3), _features(3), reduction="sum" if rank == last else "mean", process_group="auto"),
        "hardness_mode": lambda: contrastive_loss(
            _features(3), _features(3), hardness_mode="all_negatives" if rank == 0 else "hard_negatives",
            hardness_strength=2.0, **ids, process_group="auto"),
        "hardness_strength": lambda: contrastive_loss(
            _features(3), _features(3), hardness_mode="all_negatives", hardness_strength=2.0 + (rank == last),
            **ids, process_group="auto"),
        "label_smoothing": lambda: contrastive_loss(
            _features(3), _features(3), label_smoothing=0.1 if rank == 0 else 0.0, process_group="auto"),
        "group_positives": lambda: contrastive_loss(
            _features(3), _features(3), query_groups=torch.arange(3), key_groups=torch.arange(3),
            group_positives="any" if rank == last else "each", process_group="auto"),
        "false_negative_margin": lambda: contrastive_loss(
            _features(3), _features(3), false_negative_margin=0.1 if rank == 0 else 0.2,
            process_group="auto"),
        "margin_given": lambda: contrastive_loss(
            _features(3), _features(3), false_negative_margin=0.1 if rank == last else None,
            process_group="auto"),
        "false_negative_strategy": lambda: contrastive_loss(
            _features(3), _features(3), false_negative_margin=0.1,
            false_negative_strategy="relative" if rank == 0 else "absolute", process_group="auto"),
        "guide_width": lambda: contrastive_loss(
            _features(3), _features(3), false_negative_margin=0.1,
            guide_queries=_features(3, 2 + (rank == 0)), guide_keys=_features(3, 2 + (rank == 0)),
            process_group="auto"),
        # the sigmoid loss sends its key gradients in the forward when a gradient is wanted
        "gradient_wanted": lambda: contrastive_loss(
            _features(3).requires_grad_(rank == 0), _features(3), loss="sigmoid", process_group="auto"),
        # One rank's own argument check fails: it raises its own error, the others are told.
        "bad_positives_on_one_rank": lambda: contrastive_loss(
            _features(3), _features(3), positives=torch.tensor([0, 1, 7 if rank == 1 else 2]),
            process_group="auto"),
        "no_rows_anywhere": lambda: contrastive_loss(_features(0), _features(0), process_group="auto"),
    }


def record_raised(calls: dict) -> dict:
    """Run each call; name -> (type name, message) of what it raised, or None."""
    raised = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = None
        except Exception as error:  # recorded for the test process to judge
            raised[name] = (type(error).__name__, str(error))
    return raised


def run_disagreements(rank: int, world_size: int):
    raised = record_raised(disagreement_cases(rank, world_size))
    # The group must still be in step afterwards: a correct loss right after all those errors.
    queries, keys = _features(2 + rank, seed=rank), _features(3 + rank, seed=10 + rank)
    after = contrastive_loss(queries, keys, 3.0, process_group="auto", reduction="sum")
    dist.all_reduce(after)
    return raised, after


def reduction_inputs(world_size: int):
    """Per-rank features for the reduction checks: uneven, rank 1 without rows, hard negatives."""
    rows = [4, 0, 3][:world_size]
    keys = [5, 2, 3][:world_size]
    return [(_features(m, seed=20 + r), _features(k, seed=40 + r))
            for r, (m, k) in enumerate(zip(rows, keys))]


def run_reductions(rank: int, world_size: int):
    """This rank's ``none`` and ``sum`` values (no autograd: the forward alone must be right)."""
    queries, keys = reduction_inputs(world_size)[rank]
    with torch.no_grad():
        return {
            reduction: contrastive_loss(queries, keys, 3.0, reduction=reduction, process_group="auto",
                                        backend=TILES)
            for reduction in ("none", "sum")
        }


def run_weighted_sigmoid(rank: int, world_size: int):
    """The sigmoid loss's gradients (its one pass) when each rank scales its own loss: by 1 on
    every rank, then by rank + 1 (the key gradients, summed over every rank's rows in the forward,
    no longer share one weight, and the backward computes the tiles again). The inputs of
    :func:`reduction_inputs` (rank 1 without rows)."""
    results = {}
    for name, factor in (("even", 1.0), ("uneven", float(rank + 1))):
        queries, keys = (t.clone().requires_grad_(True) for t in reduction_inputs(world_size)[rank])
        bias = torch.tensor(-1.0, dtype=queries.dtype, requires_grad=True)
        loss = contrastive_loss(queries, keys, 3.0, bias, loss="sigmoid", process_group="auto", backend=TILES)
        (loss * factor).backward()
        results[name] = {"queries": queries.grad, "keys": keys.grad, "bias": bias.grad}
    return results


# name: (loss, bias or None, hardness_mode or None, several positives and the score filter: their
# contrastive_loss arguments, "guide" for the parts' guide embeddings)
TRITON_LOSSES = {
    "softmax_symmetric": ("softmax", None, None, {}),
    "sigmoid_with_bias": ("sigmoid", -1.5, None, {}),
    "softmax_hard_negatives": ("softmax", None, "hard_negatives", {}),
    "softmax_group_positives_filter": ("softmax", None, None,
                                       dict(group_positives="any", false_negative_margin=0.3)),
    "softmax_group_positives_each": ("softmax", None, None, dict(group_positives="each")),
    "sigmoid_filter_guide": ("sigmoid", -1.5, None, dict(false_negative_margin=-0.1, guide=True)),
    # the default positives (keys[:m] of each rank), over more tiles than one block
    "softmax_filter_default_positives": ("softmax", None, None,
                                          dict(false_negative_margin=0.1, default_positives=True)),
    # a guide: the backward filters each block's tiles (most rows have left-out entries here), or
    # lists each block's left-out entries whatever their rows' share and number and takes them back
    "softmax_filter_guide": ("softmax", None, None, dict(false_negative_margin=0.2, guide=True)),
    "softmax_filter_guide_listed": ("softmax", None, None, dict(false_negative_margin=0.2, guide=True,
                                                                listed_row_share=1.0)),
}


def objective_arguments(objectives: dict, batch) -> dict:
    """``TRITON_LOSSES``' objectives as contrastive_loss's arguments for a batch (its guide)."""
    arguments = {name: value for name, value in objectives.items()
                 if name not in ("guide", "default_positives", "listed_row_share")}
    if objectives.get("guide"):
        arguments.update(guide_queries=batch["guide_queries"], guide_keys=batch["guide_keys"])
    return arguments


def triton_labels(objectives: dict, batch) -> dict:
    """A batch's positives and groups as contrastive_loss's arguments: none with ``default_positives``."""
    if objectives.get("default_positives"):
        return dict(positives=None, query_groups=None, key_groups=None)
    return {name: batch[name] for name in ("positives", "query_groups", "key_groups")}


def triton_inputs(world_size: int, objectives: dict | None = None):
    """Per-rank fp32 features for the Triton block ops (which hand float64 to the torch tiles):
    uneven, hard negatives, groups spanning ranks, custom positives, a rank without rows (n=3).
    With ``default_positives`` among the ``objectives`` (the default positives, no groups), more rows and
    keys than one of the interpreter's blocks holds, so that some tiles hold no positive."""
    if (objectives or {}).get("default_positives"):
        rows = {2: (20, 18), 3: (17, 0, 19)}[world_size]
        keys = {2: (40, 24), 3: (34, 20, 21)}[world_size]
    else:
        rows = {2: (5, 2), 3: (4, 0, 3)}[world_size]
        keys = {2: (7, 3), 3: (5, 2, 3)}[world_size]
    gen = torch.Generator().manual_seed(77 + world_size)
    parts = []
    for m, k in zip(rows, keys):
        parts.append({
            "queries": torch.randn(m, FEATURE_WIDTH, generator=gen),
            "keys": torch.randn(k, FEATURE_WIDTH, generator=gen),
            "positives": torch.randperm(k, generator=gen)[:m],
            "query_groups": torch.randint(0, 3, (m,), generator=gen),
            "key_groups": torch.randint(0, 3, (k,), generator=gen),
            "guide_queries": torch.randn(m, GUIDE_WIDTH, generator=gen),
            "guide_keys": torch.randn(k, GUIDE_WIDTH, generator=gen),
        })
    add_hardness_ids(parts, rows, keys, gen)
    return parts


def run_triton(rank: int, world_size: int):
    """The ring over the Triton block ops (interpreted on CPU), fp32: this rank's value and
    gradients per loss, or None where Triton cannot be imported."""
    try:
        from hf_infcl.ops.triton import TritonBlocks
        from hf_infcl.ops.triton import blocks as triton_blocks
    except ImportError:
        return None
    listed, take_back = [], triton_blocks.take_back_left_out

    def counted(left_out, *args):  # each key block's listed left-out entries, in the backward
        listed.append(int(left_out.count))
        return take_back(left_out, *args)

    triton_blocks.take_back_left_out = counted
    try:
        return _run_triton_losses(rank, world_size, TritonBlocks, listed)
    finally:
        triton_blocks.take_back_left_out = take_back


def _run_triton_losses(rank: int, world_size: int, TritonBlocks, listed: list) -> dict:
    results = {}
    for name, (loss, bias_value, hardness, objectives) in TRITON_LOSSES.items():
        listed.clear()
        part = triton_inputs(world_size, objectives)[rank]
        queries = part["queries"].clone().requires_grad_(True)
        keys = part["keys"].clone().requires_grad_(True)
        scale = torch.tensor(4.0, requires_grad=True)
        bias = torch.tensor(bias_value, requires_grad=True) if bias_value is not None else None
        value = contrastive_loss(
            queries, keys, scale, bias, loss=loss, **triton_labels(objectives, part), process_group="auto",
            backend=TritonBlocks(tile_rows=2, tile_keys=4, poison=True,
                                 **({} if "listed_row_share" not in objectives else
                                    dict(listed_row_share=objectives["listed_row_share"],
                                         listed_entries_per_vector=10**6))),
            precision="ieee",  # exact fp32: this checks the ring's plumbing, not TF32 rounding
            **hardness_arguments(hardness, part), **objective_arguments(objectives, part),
        )
        value.backward()
        results[name] = {"value": value.detach(), "queries": queries.grad, "keys": keys.grad,
                         "scale": scale.grad, "bias": None if bias is None else bias.grad,
                         "listed": list(listed)}
    return results


def run_group_of_one(rank: int):
    """A group holding only rank 0 (every rank must create it) gives exactly the local result."""
    solo = dist.new_group([0])
    if rank != 0:
        return None
    queries, keys = _features(4, seed=3), _features(6, seed=4)
    in_group = contrastive_loss(queries, keys, 2.5, process_group=solo, backend=TILES)
    local = contrastive_loss(queries, keys, 2.5, process_group=None, backend=TILES)
    return in_group, local


def run_schedules(rank: int, world_size: int):
    """Forward + backward under each of ring.schedule's settings, then once more with none: the
    block computations and point-to-point batches counted, the loss and query gradient kept."""
    queries, keys = _features(3 + rank, seed=60 + rank), _features(4 + rank, seed=80 + rank)
    batches = [0]
    original = dist.batch_isend_irecv

    def counted(ops):
        batches[0] += 1
        return original(ops)
    results = {}
    dist.batch_isend_irecv = counted
    try:
        for name, switches in (("full", {}), ("no-transfer", {"transfer": False}),
                               ("no-compute", {"compute": False}), ("after", None)):
            tiles, batches[0] = RecordingTiles(TILES.tile_rows, TILES.tile_keys), 0
            q = queries.clone().requires_grad_(True)
            context = ring.schedule(**switches) if switches is not None else contextlib.nullcontext()
            with context:
                value = contrastive_loss(q, keys, 3.0, process_group="auto", backend=tiles)
                value.backward()
            results[name] = {"blocks": len(tiles.events), "batches": batches[0], "value": value.detach(),
                             "queries": q.grad}
    finally:
        dist.batch_isend_irecv = original
    return results


def run_pair_order(rank: int, world_size: int) -> list[str]:
    """The calls of one forward and backward with several positives, in order: each key block's
    pairs counted (``counted``), its kernels queued (``forward_block``, ``backward_block``), its
    pairs listed (``listed``)."""
    from hf_infcl.ops import key_blocks  # the ring finds its pairs through key_blocks.BlockPairFinder

    events = []
    count_pairs, listed = key_blocks.count_pairs, key_blocks.listed
    key_blocks.count_pairs = recorded(events, "counted", count_pairs)
    key_blocks.listed = recorded(events, "listed", listed)
    try:
        m, k = 3 + rank, 4 + rank
        queries = _features(m, seed=70 + rank).requires_grad_(True)
        keys = _features(k, seed=75 + rank).requires_grad_(True)
        # two groups spread over every rank; each row's positive (its own index) is in its group
        value = contrastive_loss(queries, keys, 3.0, query_groups=torch.arange(m) % 2,
                                 key_groups=torch.arange(k) % 2, group_positives="any", process_group="auto",
                                 backend=RecordingTiles(TILES.tile_rows, TILES.tile_keys, events))
        value.backward()
    finally:
        key_blocks.count_pairs, key_blocks.listed = count_pairs, listed
    return events


# name -> (loss, symmetric, dtype): the calls whose point-to-point bytes are counted.
TRAFFIC_CASES = {
    "softmax_symmetric_bf16": ("softmax", True, torch.bfloat16),
    "softmax_one_direction_fp32": ("softmax", False, torch.float32),
    "sigmoid_fp64": ("sigmoid", True, torch.float64),
}
TRAFFIC_WIDTH = 6


def traffic_keys(rank: int) -> int:
    """Keys of each rank in the traffic count (uneven: the blocks travel padded to the largest)."""
    return 3 + 2 * rank


def run_traffic(rank: int, world_size: int):
    """Bytes this rank sends point to point in one forward and one backward of each of
    ``TRAFFIC_CASES``, counted at ``dist.batch_isend_irecv`` (the size exchange, an all_gather, is
    not counted)."""
    sent = [0]
    original = dist.batch_isend_irecv

    def counted(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops)
    results = {}
    dist.batch_isend_irecv = counted
    try:
        for name, (loss, symmetric, dtype) in TRAFFIC_CASES.items():
            queries = _features(2 + rank, TRAFFIC_WIDTH, dtype, seed=90 + rank).requires_grad_(True)
            keys = _features(traffic_keys(rank), TRAFFIC_WIDTH, dtype, seed=95 + rank).requires_grad_(True)
            sent[0] = 0
            value = contrastive_loss(queries, keys, 3.0, loss=loss, symmetric=symmetric, process_group="auto",
                                     backend=TILES)
            forward = sent[0]
            value.backward()
            results[name] = {"forward": forward, "backward": sent[0] - forward}
    finally:
        dist.batch_isend_irecv = original
    return results


def worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank; writes its results (or its traceback) under out_dir."""
    # (TRITON_INTERPRET=1, for the Triton block ops on CPU, is set by the parent before the
    # spawn: Triton is already imported by the time this runs.)
    run_rank(rank, world_size, init_file, out_dir, collect_results)


def collect_results(rank: int, world_size: int) -> dict:
    scenarios = {name: run_scenario(name, s, rank, world_size) for name, s in SCENARIOS.items()}
    results = {"scenarios": scenarios}
    results["raised"], results["after_errors"] = run_disagreements(rank, world_size)
    results["reductions"] = run_reductions(rank, world_size)
    results["triton"] = run_triton(rank, world_size)
    results["group_of_one"] = run_group_of_one(rank)
    results["schedules"] = run_schedules(rank, world_size)
    results["traffic"] = run_traffic(rank, world_size)
    results["pair_order"] = run_pair_order(rank, world_size)
    results["weighted_sigmoid"] = run_weighted_sigmoid(rank, world_size)
    return results


def run_rank(rank: int, world_size: int, init_file: str, out_dir: str, collect) -> None:
    """One spawned rank of a gloo group: writes ``collect(rank, world_size)`` to out_dir/rank{r}.pt,
    or its traceback to out_dir/rank{r}.error."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        results = collect(rank, world_size)
        dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise
