"""The loss across processes: key blocks travel round a ring of ranks, queries stay put.

Rank r of n holds its rows Q_r [m_r, c] and keys K_r [k_r, c]. The statistics every row and every
key needs (:mod:`hf_infcl.ops.spec`) run over the keys and rows of the whole group, which no rank
ever gathers. Instead, in n steps, every key block visits every rank:

    step t: rank r holds the key block of rank (r - t) mod n, sends it on to rank r + 1 and
            receives the next one from rank r - 1 *before* it computes on the current block, so
            the transfer overlaps the compute.

Forward: a rank merges each block's partial row statistic into its rows' statistic. The column
statistic (softmax, symmetric loss) of a key block is a running log-sum-exp that follows its
block one step behind: rank r sends it on after adding its own partial, and rank r + 1 needs it
only once it has computed its own partial, so that transfer overlaps compute too. After n steps
the complete column statistic arrives home.

With ``group_positives`` each block also gives the partial positive parts of the pairs it holds
(:mod:`hf_infcl.ops.positive_pairs`): the rows' merge into the rows' own, the keys' travel with the
column statistic. With the score filter the guide's key block and the keys' column thresholds
travel with the keys; the rows' thresholds stay where the rows are.

Backward: the key blocks travel again, carrying their owner's complete column statistic and its
gradient (and the keys' complete positive parts and their gradients). The gradient of the keys
is accumulated in fp32 (fp64 for fp64 inputs) the same way as the forward's column statistic: it
travels one step behind its key block, and arrives home when every rank has added G^T Q_r. It
travels in slices of the key block (at least two), each rank adding into a slice in place and
sending it on while it computes the next one, so that a rank holds about one key block of
accumulators (plus one slice in flight), and the previous rank's slice always arrives while an
earlier one is computed.

The sigmoid loss needs no statistic before its gradients, so when a gradient is wanted (and the
rows share one weight: a mean or sum; ``StatsSpec.gradients_in_forward``) it takes one pass: each
visiting key block gives the rows' softplus sums and G K and G^T Q with every row weight 1, the key
gradients travelling home in the forward as they do in the backward above. The key blocks go round
once, and the backward only scales what the forward kept, after one all_reduce of two numbers that
checks every rank's rows have the same weight (where they do not, because a rank scaled its own
loss, the backward runs the ring above).

Ranks may hold different numbers of rows and keys (one may hold no rows at all): the sizes are
exchanged first with one small all_gather, which also carries every option that must agree, so
that a mismatch raises the same ``ValueError`` on every rank instead of a hang. Key blocks travel
padded to the largest k; each rank computes only on the owner's real keys.

For measurement, :func:`schedule` switches the transfers or the block computations off (the
loss is then wrong by design): ``benchmarks/bench_ring.py`` times the ring's compute and its
communication apart with it.

Gradients: each rank's backward returns the gradient of the *sum of every rank's* loss with
respect to its own queries and keys, and its share of the gradient of the scale and bias (from the
logits it computed). With the ``mean`` reduction of docs/contract.md ("Reductions"), DDP's average of the
ranks' gradients is then exactly the gradient of the global mean; no collective touches the scale
or the bias.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .key_blocks import BlockPairFinder, add_block_pair_gradients, block_parts, left_out_counts
from .options import (
    FALSE_NEGATIVE_STRATEGIES,
    GROUP_POSITIVES,
    HARDNESS_MODES,
    LOSSES,
    PRECISIONS,
    REDUCTIONS,
    wire_codes,
)
from .positive_pairs import (
    PositiveParts,
    empty_positive_parts,
    merge_parts,
    merge_positive_parts,
)
from .spec import (
    BlockOps,
    KeyLabels,
    PairLabels,
    StatsSpec,
    accumulation_dtype,
    empty_row_stats,
    merge_row_stats,
)

# The all_gather at the start carries these fields per rank (as float64: every value is a small
# integer, exact in a double).
_LAYOUT_FIELDS = (
    "ok", "rows", "keys", "width", "dtype", "loss", "columns", "precision", "device_type",
    "has_bias", "has_groups", "reduction", "hardness", "hardness_strength", "label_smoothing",
    "group_positives", "filters", "false_negative_margin", "false_negative_strategy", "guide_width",
    "teacher_width", "distillation_weight", "matryoshka_dims", "matryoshka_dim", "matryoshka_weight",
    "gradients_in_forward",
)
# the others are small integers
_FLOAT_FIELDS = ("hardness_strength", "label_smoothing", "false_negative_margin", "distillation_weight",
                 "matryoshka_weight")
# The options' codes come from their vocabularies (hf_infcl.ops.options); the dtype and device codes
# are the ring's own.
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_LOSS_CODES = wire_codes(LOSSES)
_PRECISION_CODES = wire_codes(PRECISIONS)
_DEVICE_CODES = {"cpu": 1, "cuda": 2, "xpu": 3, "mps": 4}
_REDUCTION_CODES = wire_codes(REDUCTIONS)
_HARDNESS_CODES = {None: 0, **wire_codes(HARDNESS_MODES)}
_GROUP_POSITIVES_CODES = {None: 0, **wire_codes(GROUP_POSITIVES)}
_STRATEGY_CODES = wire_codes(FALSE_NEGATIVE_STRATEGIES)

# The backward's key-gradient accumulators travel in slices of at most this many bytes (fp32):
# small enough that the one slice in flight besides the block's accumulators costs little, large
# enough to keep each slice's GEMMs efficient.
_MAX_SLICE_BYTES = 64 * 2**20
_MAX_SLICES = 8


@dataclass(frozen=True)
class RingSchedule:
    """What the ring runs: its block computations (``compute``) and its transfers (``transfer``).
    Both on is the loss; see :func:`schedule`."""

    compute: bool = True
    transfer: bool = True


_FULL_SCHEDULE = RingSchedule()
_SCHEDULE: contextvars.ContextVar[RingSchedule] = contextvars.ContextVar("hf_infcl_ring_schedule")


@contextlib.contextmanager
def schedule(compute: bool = True, transfer: bool = True):
    """Inside, the ring (forward and backward) runs only part of its schedule, to time the parts:

    - ``transfer=False``: no point-to-point transfer; each "received" block is a local copy of the
      one sent, so every step computes on blocks of the real shapes (the compute alone);
    - ``compute=False``: no block computation; every transfer of the real schedule, with its
      real sizes and order, still runs (the communication alone).

    With either off the loss and its gradients are wrong: this is for benchmarks only. The size
    exchange at the start always runs. The switches hold for the backward of a loss computed
    inside (they travel with the call's layout), wherever autograd runs it."""
    token = _SCHEDULE.set(RingSchedule(compute=compute, transfer=transfer))
    try:
        yield
    finally:
        _SCHEDULE.reset(token)


class MatryoshkaTerm(NamedTuple):
    """Which term of a Matryoshka loss a ring call computes (docs/contract.md, "Matryoshka in one
    call"): the loss makes one call per dim, and the layout exchange of each compares these, so
    that ranks holding other dims or weights raise at the first term where they differ, every rank
    the same error, instead of making different calls and waiting on each other. (Ranks that agree
    on the terms before a call are at the same term: no index needs to travel.)"""

    count: int  # D, the number of dims
    dim: int  # d_t
    weight: float  # w_t


@dataclass(frozen=True)
class RingLayout:
    """Who holds what: the outcome of the size exchange, identical on every rank."""

    group: object
    rank: int  # this process's rank within the group
    world_size: int
    next_peer: int  # global rank of (rank + 1) mod n: where key blocks go
    prev_peer: int  # global rank of (rank - 1) mod n: where they come from
    rows: tuple[int, ...]  # m of every rank
    keys: tuple[int, ...]  # k of every rank
    schedule: RingSchedule = _FULL_SCHEDULE  # as schedule() set it when the sizes were exchanged

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def max_keys(self) -> int:
        return max(self.keys)

    def key_offset(self, rank: int) -> int:
        """Global index of rank ``rank``'s first key (keys are numbered in rank order)."""
        return sum(self.keys[:rank])

    def owner(self, step: int) -> int:
        """The rank whose key block this rank holds at ``step``."""
        return (self.rank - step) % self.world_size

    # The layout is the ring's schedule of key blocks (hf_infcl.ops.key_blocks.KeyBlockSchedule).

    def forward_stats(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias, labels: PairLabels):
        # Every key block adds to one count per row of the score filter's left-out entries; each block's
        # backward lists its own entries of the counted rows.
        counts = left_out_counts(spec, ops, queries, keys, labels)
        labels = labels._replace(left_out=counts)
        return (*_ring_forward(self, spec, ops, queries, keys, scale, bias, labels), counts)

    def backward_accumulators(self, spec: StatsSpec, ops: BlockOps, queries, keys, scale, bias,
                              labels: PairLabels, row_stat, col_stat, grad_row_stat, grad_col_stat,
                              positives=None):
        return _ring_backward(self, spec, ops, queries, keys, scale, bias, labels, row_stat, col_stat,
                              grad_row_stat, grad_col_stat, positives)

    def forward_with_gradients(self, spec: StatsSpec, ops, queries, keys, scale, bias, labels: PairLabels):
        return _ring_forward_with_gradients(self, spec, ops, queries, keys, scale, bias, labels)

    def common_row_weight(self, row_weight: torch.Tensor) -> torch.Tensor | None:
        """The one gradient every row statistic of every rank has, which the one-pass route's key
        gradients (summed over every rank's rows with weight 1) are scaled by; None where the
        ranks' weights differ (a rank's loss scaled on its own), for the exact backward."""
        device = _metadata_device(self.group, row_weight.device)
        if row_weight.numel():
            bounds = torch.stack([-row_weight.min(), row_weight.max()]).to(device, torch.float64)
        else:  # no rows here: no say
            bounds = torch.full((2,), float("-inf"), dtype=torch.float64, device=device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.group)
        negated_low, high = bounds.tolist()  # one host synchronisation
        if -negated_low != high:
            return None
        return torch.tensor(high, dtype=row_weight.dtype, device=row_weight.device)


def _metadata_device(group, fallback: torch.device) -> torch.device:
    """Where the size exchange's tensor must live for this group's backend."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback.type != "meta" else torch.device("cpu")


def _all_gather_layout(group, values: list[float], device: torch.device) -> torch.Tensor:
    world_size = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).cpu()


def announce_rejected_arguments(group, device: torch.device | None = None) -> None:
    """Take part in the size exchange as a rank whose arguments failed their checks.

    Called by a rank that is about to raise its own argument error, so that the other ranks, who
    are waiting in the exchange, raise too instead of hanging.
    """
    values = [0.0] * len(_LAYOUT_FIELDS)
    _all_gather_layout(group, values, _metadata_device(group, device or torch.device("cpu")))


def exchange_layout(group, queries, keys, spec: StatsSpec, has_bias: bool, has_groups: bool,
                    reduction: str = "mean", label_smoothing: float = 0.0,
                    guide_width: int | None = None, teacher_width: int | None = None,
                    distillation_weight: float | None = None,
                    matryoshka_term: MatryoshkaTerm | None = None) -> RingLayout:
    """Exchange sizes and options with every rank of ``group``; raise the same error everywhere
    when they disagree. ``guide_width``: the score filter's guide's width, None without a guide;
    ``teacher_width`` and ``distillation_weight``: in-batch distillation's
    (:mod:`hf_infcl.ops.distillation_ring`), None for the contrastive loss; ``matryoshka_term``:
    the term of a Matryoshka loss this call computes, None outside one."""
    values = {
        "ok": 1,
        "rows": queries.shape[0],
        "keys": keys.shape[0],
        "width": queries.shape[1],
        "dtype": _DTYPE_CODES.get(queries.dtype, 99),
        "loss": _LOSS_CODES[spec.loss],
        "columns": int(spec.columns),
        "precision": _PRECISION_CODES[spec.precision],
        "device_type": _DEVICE_CODES.get(queries.device.type, 99),
        "has_bias": int(has_bias),
        "has_groups": int(has_groups),
        "reduction": _REDUCTION_CODES.get(reduction, 99),
        "hardness": _HARDNESS_CODES[spec.hardness if spec.offsets else None],
        "hardness_strength": spec.hardness_strength if spec.offsets else 0.0,
        "label_smoothing": label_smoothing,
        "group_positives": _GROUP_POSITIVES_CODES[spec.group_positives],
        "filters": int(spec.filters),
        "false_negative_margin": spec.false_negative_margin if spec.filters else 0.0,
        "false_negative_strategy": _STRATEGY_CODES[spec.false_negative_strategy] if spec.filters else 0,
        "guide_width": -1 if guide_width is None else guide_width,
        "teacher_width": -1 if teacher_width is None else teacher_width,
        "distillation_weight": -1.0 if distillation_weight is None else distillation_weight,
        "matryoshka_dims": 0 if matryoshka_term is None else matryoshka_term.count,
        "matryoshka_dim": -1 if matryoshka_term is None else matryoshka_term.dim,
        "matryoshka_weight": -1.0 if matryoshka_term is None else matryoshka_term.weight,
        "gradients_in_forward": int(spec.gradients_in_forward),
    }
    table = _all_gather_layout(
        group, [float(values[name]) for name in _LAYOUT_FIELDS], _metadata_device(group, queries.device)
    )
    columns = {name: [v if name in _FLOAT_FIELDS else int(v) for v in table[:, i].tolist()]
               for i, name in enumerate(_LAYOUT_FIELDS)}
    _check_agreement(columns)

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    return RingLayout(
        group=group,
        rank=rank,
        world_size=world_size,
        next_peer=dist.get_global_rank(group, (rank + 1) % world_size),
        prev_peer=dist.get_global_rank(group, (rank - 1) % world_size),
        rows=tuple(columns["rows"]),
        keys=tuple(columns["keys"]),
        schedule=_SCHEDULE.get(_FULL_SCHEDULE),
    )


def _check_agreement(columns: dict[str, list[int]]) -> None:
    """Raise on disagreement. Every rank runs this on the same table, so every rank raises the
    same error."""
    rejected = [rank for rank, ok in enumerate(columns["ok"]) if not ok]
    if rejected:
        raise ValueError(
            f"rank(s) {rejected} of the process group rejected their arguments to the loss "
            "(see the error raised there); every rank stops"
        )

    def per_rank(name, decode=str):
        return ", ".join(f"rank {r}: {decode(v)}" for r, v in enumerate(columns[name]))

    # The Matryoshka fields first: a term's width is its dim, which they name.
    names = {
        "matryoshka_dims": ("the number of matryoshka_dims", lambda v: str(v) if v else "none"),
        "matryoshka_dim": ("matryoshka_dims (the prefix width of one term)",
                           lambda v: "none" if v < 0 else str(v)),
        "matryoshka_weight": ("matryoshka_weights (the weight of one term)",
                              lambda v: "none" if v < 0 else str(v)),
        "width": ("the feature width c", str),
        "dtype": ("the dtype of the features", _decoder(_DTYPE_CODES)),
        "device_type": ("the device type", _decoder(_DEVICE_CODES)),
        "loss": ("loss", _decoder(_LOSS_CODES)),
        "columns": ("symmetric (column statistics)", lambda v: str(bool(v))),
        "precision": ("precision", _decoder(_PRECISION_CODES)),
        "has_bias": ("whether logit_bias is given", lambda v: str(bool(v))),
        "has_groups": ("whether query_groups/key_groups are given", lambda v: str(bool(v))),
        "reduction": ("reduction", _decoder(_REDUCTION_CODES)),
        "hardness": ("hardness_mode", _decoder(_HARDNESS_CODES)),
        "hardness_strength": ("hardness_strength", str),
        "label_smoothing": ("label_smoothing", str),
        "group_positives": ("group_positives", _decoder(_GROUP_POSITIVES_CODES)),
        "filters": ("whether false_negative_margin is given", lambda v: str(bool(v))),
        "false_negative_margin": ("false_negative_margin", str),
        "false_negative_strategy": ("false_negative_strategy", _decoder({None: 0, **_STRATEGY_CODES})),
        "guide_width": ("the width of guide_queries/guide_keys", lambda v: "no guide" if v < 0 else str(v)),
        "teacher_width": ("the width of teacher_queries/teacher_keys (distillation)",
                          lambda v: "no teacher (contrastive_loss)" if v < 0 else str(v)),
        "distillation_weight": ("distillation_weight",
                                lambda v: "none (contrastive_loss)" if v < 0 else str(v)),
        # the sigmoid loss's one-pass route sends its key gradients in the forward
        "gradients_in_forward": ("whether a gradient is wanted (every rank must backpropagate the loss)",
                                 lambda v: str(bool(v))),
    }
    for field, (what, decode) in names.items():
        if len(set(columns[field])) > 1:
            raise ValueError(f"ranks of the process group disagree on {what}: {per_rank(field, decode)}")
    if sum(columns["rows"]) == 0:
        raise ValueError("no rank of the process group has any rows (queries is empty everywhere)")


def _decoder(codes: dict) -> Callable[[int], str]:
    names = {code: str(name).replace("torch.", "") for name, code in codes.items()}
    return lambda code: names.get(code, "other")


# --------------------------------------------------------------------------------------------
# Point-to-point plumbing.


def post_exchange(layout: RingLayout, outgoing: list[torch.Tensor], incoming: list[torch.Tensor]):
    """Post one batch: send ``outgoing`` to the next rank, receive ``incoming`` from the previous.

    Returns the works to wait on. Every rank posts its batches in the same order, so they match.
    With the transfers switched off (:func:`schedule`) ``incoming`` gets a copy of ``outgoing``.
    """
    if not layout.schedule.transfer:
        for sent, received in zip(outgoing, incoming):
            received.copy_(sent)
        return []
    ops = [dist.P2POp(dist.isend, t, layout.next_peer, layout.group) for t in outgoing]
    ops += [dist.P2POp(dist.irecv, t, layout.prev_peer, layout.group) for t in incoming]
    return dist.batch_isend_irecv(ops)


def wait_all(works) -> None:
    for work in works or ():
        work.wait()


def padded_block(tensor: torch.Tensor, length: int, fill: float) -> torch.Tensor:
    """``tensor`` as a contiguous block of ``length`` rows (the ring's fixed message size)."""
    if tensor.shape[0] == length and tensor.is_contiguous():
        return tensor
    out = torch.full((length, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0]] = tensor
    return out


class TravellingBlocks:
    """The key blocks (and whatever travels with them) going round the ring, double-buffered.

    ``current`` holds the block of this step; ``post_next`` sends it on and receives the next
    one into a spare buffer before the current block is computed on; ``advance`` waits for that
    transfer and makes the received block current.
    """

    def __init__(self, layout: RingLayout, own: list[torch.Tensor]):
        self.layout = layout
        self.current = own
        self._own = own  # the caller's tensors, never received into
        self._spare = None
        self._incoming = None
        self._works = None

    def post_next(self) -> None:
        if self._spare is None:
            self._spare = [torch.empty_like(t) for t in self.current]
        self._incoming, self._spare = self._spare, None
        self._works = post_exchange(self.layout, self.current, self._incoming)

    def advance(self, keep_spare: bool = True) -> None:
        """Make the received block current; ``keep_spare=False`` when no block is to come."""
        wait_all(self._works)
        finished = self.current
        self.current, self._incoming, self._works = self._incoming, None, None
        if finished is not self._own and keep_spare:
            self._spare = finished


def _travelling_key_labels(labels: PairLabels, k_max: int) -> list[torch.Tensor]:
    """The per-key labels (:class:`~hf_infcl.ops.spec.KeyLabels`) that travel with this rank's key
    block, padded, whichever are given: its groups, its hardness owners (-1 pads: nobody's keys),
    its guide keys and its column thresholds (+inf pads: nothing left out)."""
    given = zip(labels.own_keys(), (0, -1, 0.0, float("inf")))
    return [padded_block(tensor, k_max, fill) for tensor, fill in given if tensor is not None]


def _block_key_labels(labels: PairLabels, travelled: list[torch.Tensor], lo: int, hi: int) -> KeyLabels:
    """Keys ``lo:hi`` of a visiting key block's labels, as :func:`_travelling_key_labels` packed them
    (every rank gives the same labels: the size exchange checks it)."""
    travelled = iter(travelled)
    return KeyLabels(*(None if own is None else next(travelled)[lo:hi] for own in labels.own_keys()))


def _ring_forward(layout, spec, ops, queries, keys, scale, bias, labels: PairLabels):
    acc = accumulation_dtype(queries.dtype)
    device = queries.device
    m, k_max, n = queries.shape[0], layout.max_keys, layout.world_size
    row_stat = empty_row_stats(spec, m, acc, device)
    grouped = spec.group_positives is not None
    positives = empty_positive_parts(spec, m, 0, acc, device) if grouped else None

    compute = layout.schedule.compute
    blocks = TravellingBlocks(layout, [padded_block(keys, k_max, 0.0),
                                       *_travelling_key_labels(labels, k_max)])

    # The running column statistics of the block computed last step, one step behind its keys: the
    # column log-sum-exp, and with group_positives the keys' positive parts (and counts).
    col_works, col_arrived = None, None
    for step in range(n):
        owner = layout.owner(step)
        k_owner = layout.keys[owner]
        if step < n - 1:
            blocks.post_next()  # before the compute, so that the transfer overlaps it
        block_keys = blocks.current[0][:k_owner]

        # nothing to compute (backends need not handle empty blocks), or the compute switched off
        if m == 0 or k_owner == 0 or not compute:
            partial_row = empty_row_stats(spec, m, acc, device)
            partial_col = torch.full((k_owner,), float("-inf"), dtype=acc, device=device)
            partial_positives = empty_positive_parts(spec, m, k_owner, acc, device) if grouped else None
        else:
            key_offset = layout.key_offset(owner)
            key_labels = _block_key_labels(labels, blocks.current[1:], 0, k_owner)
            finder = None  # made before the block's kernel (BlockPairFinder says why)
            if grouped:
                finder = BlockPairFinder(ops, queries, labels.query_groups, labels.positive_keys,
                                         key_labels.key_groups, key_offset)
            block = labels.block(spec, key_labels, key_offset)
            partial_row, partial_col = ops.forward_block(
                spec, queries, block_keys, scale, bias, block.mask, hardness=block.hardness,
                score_filter=block.score_filter)
            # the ring's statistics and transfers are in the accumulation dtype, whatever the ops keep
            partial_row = partial_row.to(acc)
            partial_col = None if partial_col is None else partial_col.to(acc)
            partial_positives = None
            if grouped:
                partial_positives = block_parts(spec, ops, queries, block_keys, scale, bias, finder.pairs(),
                                                partial_row.dtype)
        row_stat = merge_row_stats(spec, row_stat, partial_row)
        if grouped:
            positives = merge_positive_parts(spec, positives, partial_positives)

        if spec.columns:
            wait_all(col_works)  # the running statistics sent by the previous rank last step
            partial = _column_rows(partial_col, partial_positives)
            if col_arrived is not None:
                partial = _merge_column_rows(spec, col_arrived[:, :k_owner], partial)
            outgoing = padded_block(partial.T, k_max, float("-inf")).T.contiguous()
            col_arrived = torch.empty_like(outgoing)
            # At the last step this sends the block's complete statistics home to its owner and
            # receives this rank's own.
            col_works = post_exchange(layout, [outgoing], [col_arrived])
        if step < n - 1:
            blocks.advance(keep_spare=step < n - 2)

    if spec.columns:
        wait_all(col_works)
        own_columns = col_arrived[:, : keys.shape[0]].clone()
        col_stat = own_columns[0]
        if grouped:
            positives = PositiveParts(positives.rows, own_columns[1], positives.row_counts,
                                      own_columns[2] if positives.row_counts is not None else None)
    else:
        col_stat = row_stat.new_empty(0)
    return row_stat, col_stat, positives


def _column_rows(col_stat: torch.Tensor, positives: PositiveParts | None) -> torch.Tensor:
    """What travels with a key block's column statistic, one row each: the statistic, and with
    ``group_positives`` the keys' positive parts (and for "each" their counts)."""
    rows = [col_stat]
    if positives is not None:
        rows += [t for t in (positives.columns, positives.column_counts) if t is not None]
    return torch.stack(rows)


def _merge_column_rows(spec: StatsSpec, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two blocks of :func:`_column_rows` of the same keys, merged row by row."""
    merged = [torch.logaddexp(a[0], b[0])]
    if a.shape[0] > 1:
        merged.append(merge_parts(spec, a[1], b[1]))
    if a.shape[0] > 2:
        merged.append(a[2] + b[2])  # counts
    return torch.stack(merged)


def key_slices(k_max: int, width: int, element_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of a key block in which its gradient accumulator travels: at least two (so that
    a slice's accumulator always arrives while an earlier slice is computed), at most
    ``_MAX_SLICES``, each at most ``_MAX_SLICE_BYTES`` where possible."""
    count = math.ceil(k_max * width * element_bytes / _MAX_SLICE_BYTES)
    count = max(min(2, k_max), min(count, _MAX_SLICES, k_max))
    bounds = [round(i * k_max / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class TravellingKeyGradients:
    """This rank's share of the key gradients going round the ring in the backward, slice by slice.

    Per slice of the key block, the running key gradient of the block this rank computes on next:
    received from the previous rank, computed into in place, sent on. About one key block per
    rank; at most one spare buffer whose transfer is done, and the last batch's transfer, waited
    one slice later.
    """

    def __init__(self, layout: RingLayout, slices: list[tuple[int, int]], width: int, dtype, device):
        self.layout = layout
        self.slices = slices
        self.running: list[torch.Tensor | None] = [None] * len(slices)
        self._shape = (width, dtype, device)
        self._spare: list[torch.Tensor] = []
        self._pending = None  # (works, buffer sent) of the last batch

    def _buffer(self, length: int) -> torch.Tensor:
        if self._spare and self._spare[-1].shape[0] == length:
            return self._spare.pop()
        width, dtype, device = self._shape
        return torch.empty(length, width, dtype=dtype, device=device)

    def _wait_pending(self) -> None:
        if self._pending is not None:
            works, sent = self._pending
            wait_all(works)
            self._spare[:] = [sent]
            self._pending = None

    def accumulator(self, step: int, index: int) -> torch.Tensor:
        """The key gradient of slice ``index`` to compute into at ``step``: zeros at the first."""
        lo, hi = self.slices[index]
        if step == 0:
            return self._buffer(hi - lo).zero_()
        # Sent by the previous rank a whole slice's compute ago or more, and its batch already
        # waited, unless the block is a single slice (k = 1).
        if len(self.slices) == 1:
            self._wait_pending()
        return self.running[index]

    def send_on(self, index: int, accumulator: torch.Tensor) -> None:
        """Send the running gradient of slice ``index`` on (at the last step: home to its owner)
        and receive the next one (at the last step: this rank's own, complete)."""
        # The previous batch had this slice's compute to finish in.
        self._wait_pending()
        lo, hi = self.slices[index]
        self.running[index] = self._buffer(hi - lo)
        self._pending = (post_exchange(self.layout, [accumulator], [self.running[index]]), accumulator)

    def arrived(self) -> list[tuple[tuple[int, int], torch.Tensor]]:
        """This rank's own key gradient, complete, as (row range, accumulator) slices."""
        self._wait_pending()
        self._spare.clear()
        return list(zip(self.slices, self.running))


def _slices_to_compute(layout: RingLayout, blocks: TravellingBlocks, key_grads: TravellingKeyGradients,
                       rows: int):
    """The ring's steps as the key gradients travel: yields (owner, lo, hi, accumulator) for each
    slice of the visiting key block to compute on (its real keys ``lo:hi`` of rank ``owner``'s
    block, while this rank has rows and the compute is on); every slice's accumulator is sent on
    once the caller has computed into it, and the next block is posted before the step's compute."""
    n = layout.world_size
    for step in range(n):
        k_owner = layout.keys[layout.owner(step)]
        if step < n - 1:
            blocks.post_next()  # before the compute, so that the transfer overlaps it
        for index, (lo, hi) in enumerate(key_grads.slices):
            accumulator = key_grads.accumulator(step, index)
            hi = min(hi, k_owner)  # rows past the owner's k are padding: never computed
            if lo < hi and rows > 0 and layout.schedule.compute:
                yield layout.owner(step), lo, hi, accumulator
            key_grads.send_on(index, accumulator)
        if step < n - 1:
            blocks.advance(keep_spare=step < n - 2)


def _ring_forward_with_gradients(layout, spec, ops, queries, keys, scale, bias, labels: PairLabels):
    """The sigmoid loss's one pass over the ring (``StatsSpec.gradients_in_forward``): each visiting
    key block gives the rows' softplus sums and, with every row weight 1, G K for this rank's rows
    and G^T Q for the block, which travels on and home as the backward's key gradient does. The
    key block goes round once instead of twice. Returns (row_stat, UnitGradients, None)."""
    from .key_blocks import UnitGradients

    acc = accumulation_dtype(queries.dtype)
    device = queries.device
    (m, width), k_max = queries.shape, layout.max_keys
    row_stat = empty_row_stats(spec, m, acc, device)
    grad_queries = torch.zeros(m, width, dtype=acc, device=device)
    row_sums = torch.zeros(m, dtype=acc, device=device)
    own = [padded_block(keys, k_max, 0.0), *_travelling_key_labels(labels, k_max)]
    blocks = TravellingBlocks(layout, own)
    slices = key_slices(k_max, width, torch.finfo(acc).bits // 8)
    key_grads = TravellingKeyGradients(layout, slices, width, acc, device)

    for owner, lo, hi, accumulator in _slices_to_compute(layout, blocks, key_grads, m):
        key_labels = _block_key_labels(labels, blocks.current[1:], lo, hi)
        block = labels.block(spec, key_labels, layout.key_offset(owner) + lo)
        partial_row, partial_sums = ops.forward_backward_block(
            spec, queries, blocks.current[0][lo:hi], scale, bias, block.mask, grad_queries,
            accumulator[: hi - lo], score_filter=block.score_filter)
        row_stat = merge_row_stats(spec, row_stat, partial_row.to(acc))
        row_sums += partial_sums

    return row_stat, UnitGradients(grad_queries, key_grads.arrived(), row_sums), None


def _ring_backward(layout, spec, ops, queries, keys, scale, bias, labels: PairLabels, row_stat, col_stat,
                   grad_row_stat, grad_col_stat, positives=None):
    """Returns (unscaled G K for this rank's rows, this rank's unscaled G^T Q as a list of
    (row range, accumulator) slices, row sums of G). ``positives``: the
    :class:`~hf_infcl.ops.key_blocks.PositiveGradients` of ``group_positives``, or None."""
    acc = accumulation_dtype(queries.dtype)
    device = queries.device
    (m, width), k_max = queries.shape, layout.max_keys
    row_weight = grad_row_stat.to(acc)
    grad_queries = torch.zeros(m, width, dtype=acc, device=device)
    row_sums = torch.zeros(m, dtype=acc, device=device)

    own = [padded_block(keys, k_max, 0.0), *_travelling_key_labels(labels, k_max)]
    if spec.columns:
        # The owner's complete column statistic and its gradient travel with the keys (and the keys'
        # complete positive parts and their gradients).
        travelling = [col_stat, grad_col_stat]
        if positives is not None:
            travelling += [positives.column_part, positives.column_weight]
        col_info = torch.zeros(len(travelling), k_max, dtype=acc, device=device)
        for row, values in enumerate(travelling):
            col_info[row, : keys.shape[0]] = values.to(acc)
        own.append(col_info)
    blocks = TravellingBlocks(layout, own)

    slices = key_slices(k_max, width, torch.finfo(acc).bits // 8)
    key_grads = TravellingKeyGradients(layout, slices, width, acc, device)

    for owner, lo, hi, accumulator in _slices_to_compute(layout, blocks, key_grads, m):
        block_cols = blocks.current[-1] if spec.columns else None
        key_offset = layout.key_offset(owner) + lo
        key_labels = _block_key_labels(labels, blocks.current[1:], lo, hi)
        finder = None  # made before the slice's kernels (BlockPairFinder says why)
        if positives is not None:
            finder = BlockPairFinder(ops, queries, labels.query_groups, labels.positive_keys,
                                     key_labels.key_groups, key_offset)
        block = labels.block(spec, key_labels, key_offset)
        slice_keys = blocks.current[0][lo:hi]
        row_sums += ops.backward_block(
            spec, queries, slice_keys, scale, bias, block.mask, row_stat,
            block_cols[0, lo:hi] if spec.columns else None,
            row_weight,
            block_cols[1, lo:hi] if spec.columns else None,
            grad_queries, accumulator[: hi - lo], hardness=block.hardness,
            score_filter=block.score_filter,
        )
        if positives is not None:
            columns = (None, None)
            if spec.columns:
                columns = (block_cols[2, lo:hi], block_cols[3, lo:hi])
            add_block_pair_gradients(spec, ops, queries, slice_keys, scale, bias, finder.pairs(),
                                     positives.row_part, positives.row_weight, *columns, grad_queries,
                                     accumulator[: hi - lo], row_sums)

    return grad_queries, key_grads.arrived(), row_sums
