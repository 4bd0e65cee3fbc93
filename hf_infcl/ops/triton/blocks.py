"""Block ops (the protocol of :mod:`hf_infcl.ops.spec`) on the fused Triton kernels.

``forward_block`` runs the statistics kernel once over the tiles: it gives the row statistic
and, for the symmetric softmax loss, the column log-sum-exp from the same tiles (or, with
``fused_columns=False``, from a second column-major pass).

``backward_block`` walks the problem in super-tiles (:mod:`.super_tiles`): the gradient-tile
kernel writes each one's G into a bounded buffer, and two cuBLAS GEMMs add G K and G^T Q.

``distillation_forward_block`` / ``distillation_backward_block`` are in-batch distillation's
(:mod:`.distillation`): the statistics of both models' logits in one pass per direction, and the
same super-tile walk with G from both.

``prefix_forward_block`` / ``prefix_backward_block`` are Matryoshka's one pass over every prefix
(:mod:`.matryoshka`), taken only with ``matryoshka_one_pass=True``.

``forward_backward_block`` is the sigmoid loss's one pass (``StatsSpec.gradients_in_forward``):
the same super-tiles with every row weight 1, each row's softplus terms (the row statistic) summed
from the same logits, by the Gluon kernel on Hopper (half-precision inputs, no group mask), else
by an elementwise kernel over cuBLAS dot products, or (``sigmoid_logits="fused"``) by the
gradient-tile kernel.

fp32 inputs run as :mod:`.operands` says (TF32's precision through scaled fp16 copies by default,
TF32 tensor cores with ``tf32_via_fp16=False``, or exact fp32 for ``"ieee"``). The
object keeps no state between calls, so the ring can call it once per visiting key block.
Float64 inputs have no tensor-core path: they are handed to :class:`TorchTiles`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..distillation import (
    DistillationSpec,
    SoftTargetGradients,
    SoftTargetStats,
    TeacherLogits,
)
from ..key_blocks import combine_rows as torch_combine_rows
from ..matryoshka import PrefixSpec, PrefixSums
from ..options import check_positive_int
from ..positive_pairs import GroupRanges, PositiveParts, counts_positives, takes_log_sum_exp
from ..spec import GroupMask, HardnessOffset, LeftOutCounts, ScoreFilter, StatsSpec
from ..tiled import TorchTiles
from ..value_check import run_deferred_check
from . import (
    compile_plans,
    distillation,
    gluon_distillation,
    gluon_sigmoid,
    gluon_stats,
    group_pairs,
    matryoshka,
    stats,
)
from .combine_rows import combine_rows
from .device import INTERPRET
from .jit_math import dot_precision
from .left_out import (
    ENTRIES_PER_VECTOR,
    LISTED_ROW_SHARE,
    LeftOutList,
    empty_list,
    find_left_out,
    rows_to_list,
    take_back_left_out,
    zero_counts,
)
from .operands import (
    HALF_TYPES,
    ROW_LABELS,
    ROW_STATISTIC_ONLY,
    Operands,
    dot_operands,
    gemm_operands,
    kernel_operands,
    label_arguments,
    mask_arguments,
    resolved,
    scalar,
    sliced,
)
from .own_score_bounds import own_score_filter
from .super_tiles import CublasDotsRoute, GluonRoute, GradTileRoute, RouteArguments, g_scale, walk

SIGMOID_LOGITS = ("auto", "gluon", "gemm", "fused")
SOFTMAX_STATISTICS = ("auto", "gluon", "triton")
# The statistics kernel's tallest row block: a launch over a multiple of it needs no row masks.
_WHOLE_ROWS = max(config.kwargs["BLOCK_M"] for config in stats.STATS_KERNEL.tuner.configs)


@dataclass(frozen=True)
class TritonBlocks:
    """Fused Triton block ops for CUDA tensors (or any tensors under ``TRITON_INTERPRET=1``).

    Attributes:
        tile_rows, tile_keys: the backward's super-tile; its G buffer holds
            ``tile_rows * tile_keys`` entries of the GEMM operand dtype. None picks 8192 x 8192
            for half-precision G (every mode but ``precision="ieee"``) and 4096 x 8192 for fp32
            G (128 MiB either way); the sigmoid one pass's cuBLAS route, whose G lies beside a
            buffer of dot products of another element size, takes 4096 keys (fp32 inputs).
        stat_splits: programs sharing one outer block's inner range in the forward (None: enough
            to fill the GPU). Tests set it to exercise the merge of partial statistics.
        poison: fill every buffer the kernels must write completely with NaN first (tests use it
            to prove that no entry is left unwritten).
        fused_columns: the symmetric loss's column statistic comes out of the row pass (one
            forward pass); False runs a second, column-major pass instead.
        column_buffer_entries: fp32 entries (default 16M: 64 MiB) of the fused pass's column
            partials, one per (row block, key); more rows per launch when larger. (The one-pass
            Matryoshka forward keeps one per term: D times as many.)
        tf32_via_fp16: multiply fp32 inputs with TF32 precision as fp16 copies, each divided by
            the power of two at or above its largest magnitude (exact), in the kernels and the
            backward's GEMMs: TF32's 10-bit mantissa at twice the TF32 rate and half the bytes
            (values under 2^-14 of their tensor's largest go through fp16's subnormals, an
            absolute error of at most 2^-25 of it). True by default; False runs the kernels on
            TF32 tensor cores (operands rounded to TF32 to nearest) and only the GEMMs on the
            copies. In-batch distillation and the one-pass Matryoshka kernels always take TF32.
        sigmoid_logits: where the sigmoid loss's one pass gets each super-tile's dot products:
            ``"gluon"`` from the Gluon kernel of :mod:`.gluon_sigmoid`, which also forms G and the
            sums (Hopper GPUs, fp16 / bf16 operands, fp32 inputs' fp16 copies included, no group
            mask; a ValueError elsewhere);
            ``"gemm"`` from a cuBLAS GEMM into a buffer (fp16 for half-precision inputs, fp32
            for fp32 inputs), read by an elementwise kernel that writes G; ``"fused"`` from the
            gradient-tile kernel itself, which computes them and G in one kernel (no dot-product
            buffer, but its tensor-core work and its elementwise work run one after the other);
            ``"auto"`` (the default): ``"gluon"`` where it can run, else ``"gemm"``; also
            ``"gemm"`` while a first call's compile plan is still building the Gluon kernel in
            the background (:mod:`.compile_plans`), so that call does not wait for it.
        softmax_statistics: which kernel gives the symmetric softmax loss's row and column
            statistics in the forward's one pass: ``"gluon"`` the Gluon kernel of
            :mod:`.gluon_stats` (Hopper GPUs, fp16 / bf16 operands, fp32 inputs' fp16 copies
            included, no bias, group mask or hardness offset; the score filter only without a
            guide or groups, with a margin from -0.5 ("absolute") or from 0 to below 1
            ("relative"), and not on fp16 copies; a ValueError elsewhere); ``"triton"`` the
            statistics kernel of :mod:`.stats`;
            ``"auto"`` (the default): ``"gluon"`` where it can run, the row and key counts are
            multiples of 128, c is at least 384 and below 2048 and rows x keys x c at least
            3 * 2^37 (e.g. 32k x 32k at c = 384), else ``"triton"``, which is also taken while a
            first call's compile plan is still building the Gluon kernel in the background.
        distillation_kernels: which kernels run in-batch distillation: ``"gluon"`` those of
            :mod:`.gluon_distillation` (the symmetric forward's statistics of both directions in one
            pass, and the backward's G of each super-tile; Hopper GPUs, fp16 / bf16 student and
            teacher embeddings of one dtype; a ValueError elsewhere); ``"triton"`` those of
            :mod:`.distillation` (two passes for the symmetric statistics); ``"auto"`` (the
            default): ``"gluon"`` where it can run and the row and key counts are multiples of its
            tiles, else ``"triton"``.
        listed_row_share: with a guide, the softmax loss finds the entries the score filter
            leaves out first (:mod:`.left_out`); where at most this share of the rows has any,
            the other rows' statistics run without the filter, and the backward lists the entries
            and runs the tiles without its masks. Elsewhere both filter every tile, as 0 always
            does.
        listed_entries_per_vector: nor does it list more than this many entries per row and key
            (the list's memory, 12 bytes an entry, stays linear in the batch).
        matryoshka_one_pass: ``matryoshka_dims`` computes every prefix in one pass of the
            kernels of :mod:`.matryoshka` (one product of the widest prefix per tile in each
            direction); False (the default) takes one loss call per prefix, which measures
            faster at the widths measured so far (benchmarks/README.md).
    """

    tile_rows: int | None = None
    tile_keys: int | None = None
    stat_splits: int | None = None
    poison: bool = False
    fused_columns: bool = True
    column_buffer_entries: int = 16 * 2**20
    tf32_via_fp16: bool = True
    sigmoid_logits: str = "auto"
    softmax_statistics: str = "auto"
    # Out of the repr, which names a call's compile plan (.compile_plans.plan_key): distillation
    # calls have no plans, and the shipped plans' names stay those of the other settings.
    distillation_kernels: str = dataclasses.field(default="auto", repr=False)
    listed_row_share: float = LISTED_ROW_SHARE
    listed_entries_per_vector: int = ENTRIES_PER_VECTOR
    matryoshka_one_pass: bool = False

    # The one-process value check runs just before this object's first kernel, after its host
    # work: the check's synchronisation idles the GPU (hf_infcl.ops.value_check).
    runs_deferred_value_check: ClassVar[bool] = True

    def __post_init__(self):
        if self.sigmoid_logits not in SIGMOID_LOGITS:
            raise ValueError(f"sigmoid_logits must be one of {SIGMOID_LOGITS}, got {self.sigmoid_logits!r}")
        for name in ("softmax_statistics", "distillation_kernels"):
            if getattr(self, name) not in SOFTMAX_STATISTICS:
                raise ValueError(f"{name} must be one of {SOFTMAX_STATISTICS}, got {getattr(self, name)!r}")
        entries = self.listed_entries_per_vector
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0:
            raise ValueError(f"listed_entries_per_vector must be a non-negative integer, got {entries!r}")
        for name in ("tile_rows", "tile_keys", "stat_splits", "column_buffer_entries"):
            check_positive_int(name, getattr(self, name), optional=True)
        share = self.listed_row_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"listed_row_share must be a number from 0 to 1, got {share!r}")
        for name in ("poison", "fused_columns", "tf32_via_fp16", "matryoshka_one_pass"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def forward_block(self, spec: StatsSpec, queries, keys, scale, bias, mask: GroupMask | None,
                      hardness: HardnessOffset | None = None, score_filter: ScoreFilter | None = None):
        if queries.dtype == torch.float64:
            run_deferred_check()
            return TorchTiles().forward_block(spec, queries, keys, scale, bias, mask, hardness=hardness,
                                              score_filter=score_filter)
        problem = self._prepare(spec, queries, keys, scale, bias, mask, hardness, score_filter)
        if score_filter is not None and score_filter.left_out is not None:
            rows = self._count_left_out(problem, score_filter.left_out)
            if rows is not None:
                return self._statistics_by_row_sets(problem, mask, rows)
        return self._statistics(problem)

    def _statistics(self, problem: _Problem):
        """(row statistic, column statistic or None) of one block's forward."""
        spec, operands = problem.spec, problem.kernel
        queries, keys, scale, bias = operands.queries, operands.keys, operands.scale, problem.bias
        if spec.columns and self.fused_columns:
            return self._rows_and_columns_in_one_pass(problem)
        row_stat = stats.logit_stats(
            queries, keys, scale, bias, sigmoid=spec.loss == "sigmoid", columns=False,
            precision=spec.precision, splits=self.stat_splits, out=self._stat_buffer(queries, keys),
            **problem.labels,
        )
        col_stat = None
        if spec.columns:
            col_stat = stats.logit_stats(
                keys, queries, scale, bias, sigmoid=False, columns=True, precision=spec.precision,
                splits=self.stat_splits, out=self._stat_buffer(keys, queries),
                **{name: value for name, value in problem.labels.items() if name not in ROW_STATISTIC_ONLY},
            )
        return row_stat, col_stat

    def backward_block(self, spec: StatsSpec, queries, keys, scale, bias, mask: GroupMask | None,
                       row_stat, col_stat, row_weight, col_weight, grad_queries, grad_keys,
                       hardness: HardnessOffset | None = None, score_filter: ScoreFilter | None = None):
        if queries.dtype == torch.float64:
            return TorchTiles().backward_block(spec, queries, keys, scale, bias, mask, row_stat, col_stat,
                                               row_weight, col_weight, grad_queries, grad_keys,
                                               hardness=hardness, score_filter=score_filter)
        problem = self._prepare(spec, queries, keys, scale, bias, mask, hardness, score_filter)
        listed = None
        if score_filter is not None and score_filter.left_out is not None:
            listed = self._list_left_out(problem, score_filter.left_out)
        if listed is not None:  # the tiles without the filter's masks, the listed entries taken back after
            problem = dataclasses.replace(problem, labels=label_arguments(mask, hardness, problem.kernel))
        row_sums = torch.zeros(queries.shape[0], dtype=torch.float32, device=queries.device)
        g_factor = g_scale(problem.gemm.queries.dtype, row_weight, col_weight)
        route = GradTileRoute(problem.route_arguments(row_sums, g_factor), row_stat, row_weight, col_stat,
                              col_weight, sigmoid=problem.spec.loss == "sigmoid",
                              precision=problem.spec.precision, clamp_exponents=listed is not None)
        self._walk(problem, route, grad_queries, grad_keys, g_factor)
        if listed is not None:
            operands = problem.kernel
            take_back_left_out(listed, operands.queries, operands.keys, operands.scale, problem.bias,
                               route.row_stat, route.col_stat, route.row_weight, route.col_weight,
                               grad_queries, grad_keys, row_sums, queries.detach().contiguous(),
                               keys.detach().contiguous())
        return row_sums

    def left_out_counts(self, spec: StatsSpec, queries, keys, *, guided: bool) -> LeftOutCounts | None:
        """Zero counts of the score filter's left-out entries per row
        (:class:`~hf_infcl.ops.spec.LeftOutListOps`) for the softmax loss with a guide and without a
        hardness offset; None elsewhere, where the kernels keep the filter's masks. Without a
        guide, finding the entries would take a GEMM of the model's own products, more than the
        masks cost; with one, the masks cost a second product per tile."""
        if not guided or spec.loss != "softmax" or spec.offsets or queries.dtype == torch.float64:
            return None
        if not self.listed_row_share:
            return None
        return zero_counts(queries.shape[0], queries.device)

    def _list_left_out(self, problem: _Problem, counts: LeftOutCounts) -> LeftOutList | None:
        """The left-out entries of the rows the forward counted any for, listed over those rows
        alone, where they are few enough (:mod:`.left_out`); None where they are not."""
        found = rows_to_list(counts, self.listed_row_share, self.listed_entries_per_vector,
                             problem.kernel.keys.shape[0])
        if found is None:
            return None
        rows, entries = found
        listed = empty_list(entries, rows.device)
        if entries:
            self._find_left_out(_rows_of(problem, rows, problem.labels), listed=listed, row_ids=rows)
        return listed

    def _count_left_out(self, problem: _Problem, counts: LeftOutCounts) -> torch.Tensor | None:
        """Count this block's left-out entries per row into ``counts``; the rows that have any
        where they are at most ``listed_row_share`` of the rows, else None (one host
        synchronisation)."""
        block_counts = torch.zeros_like(counts.per_row)
        self._find_left_out(problem, counts=block_counts)
        counts.per_row.add_(block_counts)
        rows = torch.nonzero(block_counts).squeeze(1)
        return rows if rows.numel() <= self.listed_row_share * block_counts.shape[0] else None

    def _find_left_out(self, problem: _Problem, **outputs) -> None:
        """:func:`.left_out.find_left_out` with the problem's filter labels."""
        labels = problem.labels
        find_left_out(labels["guide_queries"], labels["guide_keys"],
                      precision=dot_precision(problem.kernel.queries.dtype, problem.spec.precision),
                      row_thresholds=labels["row_thresholds"], key_thresholds=labels.get("key_thresholds"),
                      positive_keys=labels["positive_keys"], key_offset=labels.get("key_offset", 0),
                      row_groups=labels.get("row_groups"), key_groups=labels.get("key_groups"),
                      group_positives=labels.get("group_positives", False), splits=self.stat_splits,
                      **outputs)

    def _statistics_by_row_sets(self, problem: _Problem, mask: GroupMask | None, rows: torch.Tensor):
        """The forward's statistics with the filtering kernel over ``rows`` (those with left-out
        entries) and the rows of too few for a whole row block, the plain kernel over the others
        (their own entries are all kept, in both statistics); the column statistics of the two
        sets merged."""
        m = problem.kernel.queries.shape[0]
        left_out = torch.zeros(m, dtype=torch.bool, device=rows.device)
        left_out[rows] = True
        order = torch.argsort(left_out.to(torch.int8), stable=True)  # the rows without any first
        whole = (m - rows.numel()) // _WHOLE_ROWS * _WHOLE_ROWS  # in whole row blocks: no tile masks
        plain_labels = label_arguments(mask, None, problem.kernel)
        row_stat = torch.empty(m, dtype=torch.float32, device=rows.device)
        col_stat = None
        for part, labels in ((order[:whole], plain_labels), (order[whole:], problem.labels)):
            if part.numel() == 0:
                continue
            part_rows, part_columns = self._statistics(_rows_of(problem, part, labels))
            row_stat[part] = part_rows
            if part_columns is not None:
                col_stat = part_columns if col_stat is None else torch.logaddexp(col_stat, part_columns)
        return row_stat, col_stat

    def forward_backward_block(self, spec: StatsSpec, queries, keys, scale, bias, mask: GroupMask | None,
                               grad_queries, grad_keys, score_filter: ScoreFilter | None = None):
        """The sigmoid loss's one pass (``OnePassSigmoidOps``): the backward's super-tiles with
        every row weight 1, each tile's softplus row sums taken from the same logits (whose dot
        products ``sigmoid_logits`` says who computes)."""
        if queries.dtype == torch.float64:
            run_deferred_check()
            return TorchTiles().forward_backward_block(spec, queries, keys, scale, bias, mask, grad_queries,
                                                       grad_keys, score_filter=score_filter)
        if spec.loss != "sigmoid":
            raise ValueError("the one-pass route is for the sigmoid loss")
        problem = self._prepare(spec, queries, keys, scale, bias, mask, None, score_filter)
        f32 = dict(dtype=torch.float32, device=queries.device)
        ones = torch.ones(queries.shape[0], **f32)
        row_stat, row_sums = torch.zeros(queries.shape[0], **f32), torch.zeros(queries.shape[0], **f32)
        g_factor = g_scale(problem.gemm.queries.dtype, ones, None)
        arguments = problem.route_arguments(row_sums, g_factor, softplus_sums=row_stat)
        if self._gluon_dots(problem):
            route = GluonRoute(arguments)
        elif self.sigmoid_logits != "fused" and score_filter is None:  # (the fused kernel filters)
            dots = dot_operands(problem.gemm, problem.kernel, problem.kernel.scale)
            route = CublasDotsRoute(arguments, dots, problem.gemm.queries.dtype, self.poison)
        else:
            route = GradTileRoute(arguments, ones, ones, None, None, sigmoid=True,
                                  precision=problem.spec.precision)
        self._walk(problem, route, grad_queries, grad_keys, g_factor)
        return row_stat, row_sums

    def distillation_forward_block(self, spec: DistillationSpec, queries, keys, scale,
                                   teacher: TeacherLogits):
        """In-batch distillation's statistics (:class:`~hf_infcl.ops.distillation.DistillationBlockOps`):
        the rows' over the keys, and with ``spec.columns`` the keys' over the rows: both in one pass
        of the Gluon kernel where it runs (:meth:`_gluon_distillation`), else each in one pass of
        :func:`.distillation.soft_target_stats`."""
        if queries.dtype == torch.float64:
            run_deferred_check()
            return TorchTiles().distillation_forward_block(spec, queries, keys, scale, teacher)
        student, teacher = self._distillation_operands(spec, queries, keys, scale, teacher)
        if spec.columns and self._gluon_distillation(student, teacher):
            return self._distillation_by_gluon(student, teacher)
        options = dict(precision=spec.precision, splits=self.stat_splits)
        rows = distillation.soft_target_stats(student.queries, student.keys, teacher.queries, teacher.keys,
                                              student.scale, teacher.scale, **options)
        columns = None
        if spec.columns:
            columns = distillation.soft_target_stats(student.keys, student.queries, teacher.keys,
                                                     teacher.queries, student.scale, teacher.scale, **options)
        return rows, columns

    def distillation_backward_block(self, spec: DistillationSpec, queries, keys, scale,
                                    teacher: TeacherLogits, rows: SoftTargetGradients,
                                    columns: SoftTargetGradients | None, grad_queries, grad_keys):
        """Add G K and G^T Q into the accumulators and return the row sums of G
        (:class:`~hf_infcl.ops.distillation.DistillationBlockOps`), G from
        :class:`.distillation.SoftTargetRoute` over the backward's super-tiles."""
        if queries.dtype == torch.float64:
            return TorchTiles().distillation_backward_block(spec, queries, keys, scale, teacher, rows,
                                                            columns, grad_queries, grad_keys)
        student, teacher = self._distillation_operands(spec, queries, keys, scale, teacher)
        row_sums = torch.zeros(queries.shape[0], dtype=torch.float32, device=queries.device)
        # G's largest entry is at most the sum of its four weights' largest (each probability <= 1)
        def bound(direction):
            if direction is None:
                return None
            return direction.student_weight.abs() + direction.target_weight.abs()

        g_factor = g_scale(student.queries.dtype, bound(rows), bound(columns))
        inv_g_scale = None if g_factor is None else 1.0 / g_factor
        if self._gluon_distillation(student, teacher):
            route = gluon_distillation.GluonSoftTargetRoute(student.queries, student.keys, student.scale,
                                                            teacher, rows, columns, row_sums, inv_g_scale)
        else:
            route = distillation.SoftTargetRoute(student.queries, student.keys, student.scale, teacher, rows,
                                                 columns, row_sums, inv_g_scale, spec.precision)
        tile = self._super_tile(student.queries.dtype, queries.shape[0], keys.shape[0], route.g_alone)
        walk(route, student, grad_queries, grad_keys, g_factor, tile, spec.precision, self.poison)
        return row_sums

    def _gluon_distillation(self, student, teacher: TeacherLogits) -> bool:
        """Whether distillation takes the Gluon kernels (``distillation_kernels``)."""
        if self.distillation_kernels == "triton":
            return False
        operands = (student.queries, student.keys, teacher.queries, teacher.keys)
        usable = gluon_distillation.usable(*operands)
        if self.distillation_kernels == "gluon":
            if not usable:
                raise ValueError(
                    "distillation_kernels='gluon' needs a Hopper GPU (compute capability 9), a Triton "
                    "with Gluon, and fp16 or bf16 student and teacher embeddings of one dtype whose rows "
                    "are 16-byte aligned; use 'auto' to fall back to 'triton' elsewhere")
            return True
        # "auto": whole tiles only (partial ones take the kernel's masked path, which spills)
        whole = (student.queries.shape[0] % gluon_distillation.BLOCK_M == 0
                 and student.keys.shape[0] % gluon_distillation.BLOCK_N == 0)
        return usable and whole

    def _distillation_by_gluon(self, student, teacher: TeacherLogits):
        """Both directions' distillation statistics from the Gluon kernel
        (:mod:`.gluon_distillation`), rows in chunks whose column partials (three statistics,
        four per row block and key) fit ``column_buffer_entries``."""
        queries, keys = student.queries, student.keys
        (m, k), device = (queries.shape[0], keys.shape[0]), queries.device
        per_block = 3 * gluon_distillation.PARTIALS_PER_BLOCK
        block_m = gluon_distillation.BLOCK_M
        # as few chunks as the buffer allows, of equal row blocks (no short last launch)
        row_blocks = -(-m // block_m)
        chunks = -(-row_blocks // max(1, self.column_buffer_entries // (per_block * k)))
        chunk_rows = min(m, -(-row_blocks // chunks) * block_m)
        partials = torch.empty(per_block * -(-chunk_rows // block_m) * k, dtype=torch.float32, device=device)
        rows = torch.empty((3, m), dtype=torch.float32, device=device)
        columns = torch.empty((3, k), dtype=torch.float32, device=device)
        if self.poison:
            rows.fill_(float("nan"))
            columns.fill_(float("nan"))
        run_deferred_check()  # the one-process value check, just before the first kernel
        for r0 in range(0, m, chunk_rows):
            r1 = min(r0 + chunk_rows, m)
            if self.poison:
                partials.fill_(float("nan"))
            gluon_distillation.soft_target_stats_both(
                queries[r0:r1], keys, teacher.queries[r0:r1], teacher.keys, student.scale, teacher.scale,
                partials, rows[:, r0:r1], columns, accumulate_columns=r0 > 0, splits=self.stat_splits)
        return SoftTargetStats(*rows), SoftTargetStats(*columns)

    def _distillation_operands(self, spec: DistillationSpec, queries, keys, scale, teacher: TeacherLogits):
        """(the student's operands and logit scale, the teacher's) as the distillation kernels take
        them: fp32 with TF32 precision rounded to TF32 (the teacher as it is loaded), the scales
        0-d fp32."""
        self._check(queries, keys)
        self._check(teacher.queries, teacher.keys)
        student = kernel_operands(StatsSpec(loss="softmax", columns=spec.columns, precision=spec.precision),
                                  queries, keys, scale, via_fp16=False)
        return student, distillation.teacher_scalars(teacher)

    def prefix_forward_block(self, spec: PrefixSpec, queries, keys, scale, bias, query_scales, key_scales,
                             mask: GroupMask | None):
        """Every Matryoshka term's statistics (:class:`~hf_infcl.ops.matryoshka.PrefixBlockOps`) from
        :func:`.matryoshka.prefix_stats`: one pass over the tiles (the column statistic of the
        symmetric loss from the row pass's column partials, rows in the chunks of
        :meth:`_column_partial_chunks`: the plain loss's, with a partial per term), or with
        ``fused_columns=False`` a second, column-major pass."""
        if queries.dtype == torch.float64:
            run_deferred_check()
            return TorchTiles().prefix_forward_block(spec, queries, keys, scale, bias, query_scales,
                                                     key_scales, mask)
        operands, bias, mask_arguments = self._prefix_operands(spec, queries, keys, scale, bias, mask)
        query_norms, key_norms = (matryoshka.per_term(x) for x in (query_scales, key_scales))
        options = dict(sigmoid=spec.loss == "sigmoid", precision=spec.precision, splits=self.stat_splits,
                       mask=mask_arguments)
        queries, keys = operands.queries, operands.keys
        if not (spec.columns and self.fused_columns):
            row_stat = matryoshka.prefix_stats(queries, keys, query_norms, key_norms, operands.scale, bias,
                                               spec.dims, columns=False, **options)
            col_stat = None
            if spec.columns:
                col_stat = matryoshka.prefix_stats(keys, queries, key_norms, query_norms, operands.scale,
                                                   bias, spec.dims, columns=True, **options)
            return row_stat, col_stat
        terms, m, k = len(spec.dims), queries.shape[0], keys.shape[0]
        row_stat = torch.empty((terms, m), dtype=torch.float32, device=queries.device)
        col_stat = None
        chunks = self._column_partial_chunks(m, k, matryoshka.MIN_BLOCK_M, terms, queries.device)
        for r0, r1, partials in chunks:
            chunk_mask = dict(mask_arguments, **sliced(mask_arguments, ROW_LABELS, r0, r1))
            row_stat[:, r0:r1] = matryoshka.prefix_stats(
                queries[r0:r1], keys, query_norms[:, r0:r1].contiguous(), key_norms, operands.scale, bias,
                spec.dims, columns=False, column_partials=partials.view(-1, terms, k),
                **dict(options, mask=chunk_mask))
            col_stat = stats.merge_partials(partials, log_sum_exp=True, previous=col_stat, out=col_stat)
        return row_stat, col_stat.view(terms, k)

    def prefix_backward_block(self, spec: PrefixSpec, queries, keys, scale, bias, query_scales, key_scales,
                              mask: GroupMask | None, row_stat, col_stat, row_weight, col_weight,
                              grad_queries, grad_keys) -> PrefixSums:
        """Each term's products over its own prefix, Ĝ^t K[:, :d_t] and Ĝ^tᵀ Q[:, :d_t], and the
        per-term sums (:class:`~hf_infcl.ops.matryoshka.PrefixBlockOps`), Ĝ from
        :class:`.matryoshka.PrefixRoute` over the backward's super-tiles."""
        if queries.dtype == torch.float64:
            return TorchTiles().prefix_backward_block(spec, queries, keys, scale, bias, query_scales,
                                                      key_scales, mask, row_stat, col_stat, row_weight,
                                                      col_weight, grad_queries, grad_keys)
        operands, bias, mask_arguments = self._prefix_operands(spec, queries, keys, scale, bias, mask)
        query_norms, key_norms = matryoshka.per_term(query_scales), matryoshka.per_term(key_scales)
        terms, m, k = len(spec.dims), queries.shape[0], keys.shape[0]
        sums = PrefixSums(*(torch.zeros((terms, n), dtype=torch.float32, device=queries.device)
                            for n in (m, m, k)))
        factor = matryoshka.g_factor(operands.queries.dtype, query_norms, key_norms, row_weight, col_weight)
        route = matryoshka.PrefixRoute(spec, operands.queries, operands.keys, operands.scale, bias,
                                       query_norms, key_norms, mask_arguments, row_stat, row_weight, col_stat,
                                       col_weight, sums, None if factor is None else 1.0 / factor)
        tile = matryoshka.super_tile(operands.queries.dtype, m, k, terms, self.tile_rows, self.tile_keys)
        walk(route, operands, grad_queries, grad_keys, factor, tile, spec.precision, self.poison)
        return PrefixSums(*(x.to(grad_queries.dtype) for x in sums))

    def _prefix_operands(self, spec: PrefixSpec, queries, keys, scale, bias, mask: GroupMask | None):
        """(operands and logit scale, 0-d fp32 bias or None, the group mask's launcher arguments) of
        the one-pass Matryoshka kernels: fp32 with TF32 precision rounded to TF32; the backward's
        GEMMs multiply the same operands."""
        self._check(queries, keys)
        operands = kernel_operands(StatsSpec(loss=spec.loss, columns=spec.columns, precision=spec.precision),
                                   queries, keys, scale, via_fp16=False)
        return operands, None if bias is None else scalar(bias), mask_arguments(mask)

    def combine_rows(self, **arguments):
        """The epilogues' row primitive (:func:`hf_infcl.ops.key_blocks.combine_rows`) in one
        kernel launch instead of a dozen torch ops per row chunk, and with no host
        synchronisation. Float64 goes to the torch version."""
        if arguments["sources"].dtype == torch.float64:
            return torch_combine_rows(**arguments)
        return combine_rows(**arguments)

    def takes_group_ranges(self, queries: torch.Tensor) -> bool:
        """Whether the pairs of ``group_positives`` go through :meth:`group_positive_parts` and
        :meth:`add_group_pair_gradients` (no list of pairs, so no host synchronisation for their
        number): half-precision or fp32 vectors of at most ``group_pairs.MAX_WIDTH``."""
        return queries.dtype != torch.float64 and queries.shape[1] <= group_pairs.MAX_WIDTH

    def group_positive_parts(self, spec: StatsSpec, queries, keys, scale, bias,
                             ranges: GroupRanges) -> PositiveParts:
        """The positive parts of one process's pairs (:mod:`hf_infcl.ops.positive_pairs`), from
        their ranges, one launch per direction; the ranges are kept for the backward."""
        queries, keys, scale, bias = _pair_operands(queries, keys, scale, bias)
        log_sum_exp = takes_log_sum_exp(spec)
        rows, row_counts = group_pairs.group_pair_parts(queries, keys, scale, bias, ranges.rows,
                                                        log_sum_exp=log_sum_exp)
        columns = column_counts = None
        if spec.columns:
            columns, column_counts = group_pairs.group_pair_parts(keys, queries, scale, bias, ranges.keys,
                                                                  log_sum_exp=log_sum_exp)
        if not counts_positives(spec):
            row_counts = column_counts = None
        return PositiveParts(rows, columns, row_counts, column_counts, ranges)

    def add_group_pair_gradients(self, spec: StatsSpec, queries, keys, scale, bias, ranges: GroupRanges,
                                 row_part, row_weight, column_part, column_weight, grad_queries, grad_keys,
                                 row_sums) -> None:
        """:func:`hf_infcl.ops.positive_pairs.add_pair_gradients` from the pairs' ranges: each row
        adds its pairs' entries of G times their keys, each key its pairs' times their rows."""
        queries, keys, scale, bias = _pair_operands(queries, keys, scale, bias)
        log_sum_exp = takes_log_sum_exp(spec)
        row_part = row_part.contiguous()
        column_part = None if column_part is None else column_part.contiguous()
        group_pairs.add_group_pair_gradients(
            queries, keys, scale, bias, ranges.rows, grad_queries, log_sum_exp=log_sum_exp,
            outer_part=row_part, outer_weight=row_weight, inner_part=column_part, inner_weight=column_weight,
            row_sums=row_sums)
        group_pairs.add_group_pair_gradients(
            keys, queries, scale, bias, ranges.keys, grad_keys, log_sum_exp=log_sum_exp,
            outer_part=column_part, outer_weight=column_weight, inner_part=row_part, inner_weight=row_weight)

    # ----------------------------------------------------------------------------------------

    def _prepare(self, spec: StatsSpec, queries, keys, scale, bias, mask, hardness, score_filter) -> _Problem:
        """The checked inputs as the kernels and GEMMs take them (:mod:`.operands`)."""
        self._check(queries, keys)
        spec = resolved(spec, queries)
        kernel = kernel_operands(spec, queries, keys, scale, self.tf32_via_fp16)
        gemm = gemm_operands(spec, queries, keys, kernel, self.tf32_via_fp16)
        labels = label_arguments(mask, hardness, kernel, score_filter)
        if not INTERPRET:  # a first call of its kind compiles its kernels in parallel first
            compile_plans.prepare(compile_plans.plan_key(
                self, spec, queries, kernel.queries, queries.shape[0], keys.shape[0], queries.shape[1],
                bias is not None, labels), queries.device)
        return _Problem(spec, kernel, gemm, None if bias is None else scalar(bias), labels)

    def _walk(self, problem: _Problem, route, grad_queries, grad_keys, g_factor) -> None:
        m, k = problem.kernel.queries.shape[0], problem.kernel.keys.shape[0]
        tile = self._super_tile(problem.gemm.queries.dtype, m, k, route.g_alone)
        walk(route, problem.gemm, grad_queries, grad_keys, g_factor, tile, problem.spec.precision,
             self.poison)

    def _gluon_dots(self, problem: _Problem) -> bool:
        """Whether the one pass takes its logits from the Gluon kernel (``sigmoid_logits``)."""
        if self.sigmoid_logits not in ("auto", "gluon"):
            return False
        operands = problem.kernel
        usable = problem.gemm is operands and gluon_sigmoid.usable(operands.queries, operands.keys,
                                                                    has_mask=bool(problem.labels))
        if self.sigmoid_logits == "gluon" and not usable:
            raise ValueError(
                "sigmoid_logits='gluon' needs a Hopper GPU (compute capability 9), a Triton with Gluon, "
                "fp16 or bf16 inputs (or fp32 ones as fp16 copies, tf32_via_fp16) whose rows are 16-byte "
                "aligned, and no group mask; use 'auto' to fall back to 'gemm' elsewhere")
        # while a compile plan builds the kernel in the background, "auto" takes the cuBLAS route
        return usable and gluon_sigmoid.ready(wait=self.sigmoid_logits == "gluon")

    def _gluon_statistics(self, problem: _Problem) -> bool:
        """Whether the one-pass forward takes the Gluon kernel (``softmax_statistics``)."""
        if self.softmax_statistics == "triton":
            return False
        queries, keys = problem.kernel.queries, problem.kernel.keys
        usable = (problem.bias is None and (not problem.labels or _own_score_filter(problem))
                  and gluon_stats.usable(queries, keys))
        if self.softmax_statistics == "gluon":
            if not usable:
                raise ValueError(
                    "softmax_statistics='gluon' needs a Hopper GPU (compute capability 9), a Triton with "
                    "Gluon, fp16 or bf16 inputs (or fp32 ones as fp16 copies, tf32_via_fp16) whose rows are "
                    "16-byte aligned, and no bias, group mask or hardness offset; a score filter only "
                    "without a guide or groups, of margin >= -0.5 with 'absolute' (0 to below 1 with "
                    "'relative') and without fp16 copies; use 'auto' to fall back to 'triton' elsewhere")
            return gluon_stats.ready(wait=True)
        # "auto": whole tiles only (partial ones take the kernel's masked path, which spills), and
        # widths and sizes where it measured faster in the loss
        (m, c), k = queries.shape, keys.shape[0]
        whole = m % gluon_stats.BLOCK_M == 0 and k % gluon_stats.BLOCK_N == 0
        large = (gluon_stats.AUTO_MIN_WIDTH <= c < gluon_stats.AUTO_MAX_WIDTH
                 and m * k * c >= gluon_stats.AUTO_MIN_WORK)
        # while a compile plan builds the kernel in the background, take .stats
        return usable and whole and large and gluon_stats.ready(wait=False)

    def _rows_and_columns_by_gluon(self, problem: _Problem):
        """Row and column log-sum-exp from the Gluon kernel (:mod:`.gluon_stats`), rows in chunks
        whose column partials (four per row block and key) fit ``column_buffer_entries``."""
        queries, keys, scale = problem.kernel.queries, problem.kernel.keys, problem.kernel.scale
        (m, k), device = (queries.shape[0], keys.shape[0]), queries.device
        per_block = gluon_stats.PARTIALS_PER_BLOCK
        chunk_rows = min(m, max(1, self.column_buffer_entries // (per_block * k)) * gluon_stats.BLOCK_M)
        partials = torch.empty((per_block * -(-chunk_rows // gluon_stats.BLOCK_M), k), dtype=torch.float32,
                               device=device)
        splits = gluon_stats.splits_for(chunk_rows, k, device, self.stat_splits)
        row_buffer = torch.empty(splits * chunk_rows, dtype=torch.float32, device=device)
        score_filter = _gluon_filter(problem) if problem.labels else None

        def chunk_launch(r0, r1):
            """(row_out, written, the launch) of rows r0:r1."""
            # each split's rows one after the other, and the partials' leading rows: contiguous
            row_out = row_buffer[: splits * (r1 - r0)].view(splits, r1 - r0)
            written = partials[: per_block * -(-(r1 - r0) // gluon_stats.BLOCK_M)]
            chunk_filter = None
            if score_filter is not None:  # (chunks start at whole row blocks)
                blocks = slice(r0 // gluon_stats.BLOCK_M, -(-r1 // gluon_stats.BLOCK_M))
                chunk_filter = score_filter._replace(
                    row_bounds=score_filter.row_bounds[r0:r1], positives=score_filter.positives[r0:r1],
                    ranges=tuple(bound[blocks] for bound in score_filter.ranges))
            return row_out, written, gluon_stats.stats_launch(queries[r0:r1], keys, scale, row_out, written,
                                                              splits, chunk_filter)

        # The first chunk's launch made before the value check's synchronisation, so that after it
        # the GPU waits on the launch alone; each later one while the GPU runs the one before.
        first = chunk_launch(0, min(chunk_rows, m))
        run_deferred_check()  # the one-process value check, just before the first kernel
        row_stat = col_stat = None
        for r0 in range(0, m, chunk_rows):
            r1 = min(r0 + chunk_rows, m)
            row_out, written, launch_chunk = first if r0 == 0 else chunk_launch(r0, r1)
            if self.poison:
                row_out.fill_(float("nan"))
                written.fill_(float("nan"))
            used = launch_chunk()
            rows = row_out[0] if used == 1 else stats.merge_partials(row_out[:used], log_sum_exp=True)
            if r1 - r0 == m:  # one chunk: its rows are all the rows
                row_stat = rows
            else:
                if row_stat is None:
                    row_stat = torch.empty(m, dtype=torch.float32, device=device)
                row_stat[r0:r1] = rows
            col_stat = stats.merge_partials(written, log_sum_exp=True, previous=col_stat, out=col_stat)
        if score_filter is not None:  # keys that are nobody's positive: no column term (the backward's p = 0)
            col_stat.masked_fill_(problem.labels["key_thresholds"] == float("inf"), float("inf"))
        return row_stat, col_stat

    def _rows_and_columns_in_one_pass(self, problem: _Problem):
        """Row and column log-sum-exp from one pass over the tiles, rows in the chunks of
        :meth:`_column_partial_chunks`."""
        if self._gluon_statistics(problem):
            return self._rows_and_columns_by_gluon(problem)
        queries, keys, scale = problem.kernel.queries, problem.kernel.keys, problem.kernel.scale
        m = queries.shape[0]
        row_stat = col_stat = None
        for r0, r1, partials in self._column_partial_chunks(m, keys.shape[0], stats.MIN_BLOCK_M, 1,
                                                            queries.device):
            rows = stats.logit_stats(
                queries[r0:r1], keys, scale, problem.bias, sigmoid=False, columns=False,
                precision=problem.spec.precision, splits=self.stat_splits,
                out=self._stat_buffer(queries[r0:r1], keys), column_partials=partials,
                **dict(problem.labels, **sliced(problem.labels, ROW_LABELS, r0, r1)),
            )
            if r1 - r0 == m:  # one chunk: its rows are all the rows
                row_stat = rows
            else:
                if row_stat is None:
                    row_stat = torch.empty(m, dtype=torch.float32, device=queries.device)
                row_stat[r0:r1] = rows
            col_stat = stats.merge_partials(partials, log_sum_exp=True, previous=col_stat, out=col_stat)
        return row_stat, col_stat

    def _column_partial_chunks(self, m: int, k: int, min_block_m: int, terms: int, device):
        """The row chunks of a forward whose row pass also gives the column statistic: (start,
        end, partials), ``partials`` fp32 [row blocks, terms * k] (one per row block of the
        kernel's smallest, ``min_block_m``, term and key) filled with -inf before each chunk (row
        blocks a config with larger blocks leaves unwritten must not count). A chunk holds as many
        rows as ``column_buffer_entries`` allows per term; the caller merges each chunk's partials
        into the column statistic before the next chunk reuses the buffer."""
        chunk_rows = min(m, max(1, self.column_buffer_entries // k) * min_block_m)
        partials = torch.empty((-(-chunk_rows // min_block_m), terms * k), dtype=torch.float32, device=device)
        for start in range(0, m, chunk_rows):
            partials.fill_(float("-inf"))
            yield start, min(start + chunk_rows, m), partials

    def _super_tile(self, dtype: torch.dtype, m: int, k: int, wide: bool = False) -> tuple[int, int]:
        # 128 MiB of G: each super-tile then carries enough GPU work to hide the host time of its
        # three launches (at c = 512 the GPU's work per 64 MiB super-tile was no more than its
        # launches' host time). ``wide``: G alone, or written over the dot products; else G beside
        # a dot-product buffer, with half the keys.
        default_keys = 8192 if wide else 4096
        rows = self.tile_rows if self.tile_rows is not None else (8192 if dtype in HALF_TYPES else 4096)
        keys = self.tile_keys if self.tile_keys is not None else default_keys
        return min(rows, m), min(keys, k)

    def _stat_buffer(self, outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor | None:
        if not self.poison:
            return None
        splits, _ = stats.inner_splits(outer.shape[0], inner.shape[0], outer.device, self.stat_splits)
        return torch.full((splits, outer.shape[0]), float("nan"), dtype=torch.float32, device=outer.device)

    @staticmethod
    def _check(queries: torch.Tensor, keys: torch.Tensor) -> None:
        if queries.dtype not in (torch.float32, *HALF_TYPES):
            raise TypeError(f"queries must be float32, float16 or bfloat16 for Triton, got {queries.dtype}")
        if keys.dtype != queries.dtype:
            raise TypeError(f"keys have dtype {keys.dtype} but queries have {queries.dtype}")
        if not INTERPRET and queries.device.type != "cuda":
            raise ValueError(f"the Triton kernels need CUDA tensors, got queries on {queries.device}")


@dataclass(frozen=True)
class _Problem:
    """One call's inputs as the kernels and GEMMs take them."""

    spec: StatsSpec  # precision resolved
    kernel: Operands  # what the kernels multiply, and the logit scale for them
    gemm: Operands  # what the backward's GEMMs multiply
    bias: torch.Tensor | None  # 0-d fp32
    labels: dict  # the launchers' group-mask and hardness arguments

    def route_arguments(self, row_sums, g_factor, softplus_sums=None) -> RouteArguments:
        inv_g_scale = None if g_factor is None else 1.0 / g_factor
        return RouteArguments(self.kernel, self.bias, self.labels, inv_g_scale, row_sums, softplus_sums)


# The labels of the score filter without a guide, groups or hardness offset.
_OWN_SCORE_FILTER_LABELS = {"positive_keys", "key_offset", "row_thresholds", "key_thresholds"}


# The most negative "absolute" margin the Gluon statistics kernel takes (Qwen3-Embedding's rule is
# -0.1). Its bounds then sit halfway between each positive and its threshold, so that no kept term
# exceeds exp(scale * |margin| / 2) and the positive's is at least the inverse: within fp32's range
# for scales up to about 300 at this margin.
GLUON_MIN_MARGIN = -0.5


def _own_score_filter(problem: _Problem) -> bool:
    """Whether the problem's only labels are a score filter the Gluon statistics kernel takes
    (:class:`.gluon_stats.OwnScoreFilter`): the model's own scores, with a column statistic, an
    "absolute" margin from :data:`GLUON_MIN_MARGIN` on or a "relative" one from 0 to below 1 (each
    threshold's sign is then its positive's), and the kernels' operands not fp16 copies (whose
    thresholds are in other units)."""
    spec, labels = problem.spec, problem.labels
    if set(labels) != _OWN_SCORE_FILTER_LABELS or problem.kernel.queries_factor is not None:
        return False
    margin = spec.false_negative_margin
    if spec.false_negative_strategy == "absolute":
        return margin >= GLUON_MIN_MARGIN
    return 0 <= margin < 1


def _gluon_filter(problem: _Problem) -> gluon_stats.OwnScoreFilter:
    """The own-score filter's arguments of the Gluon statistics kernel (:mod:`.own_score_bounds`):
    the bounds from the thresholds, the positives as indices into this block's keys. A bound is a
    row's (or key's) positive's score, from which the kernel makes the threshold again; with a
    negative margin the kernel takes half the margin, so its bound lies halfway between positive
    and threshold and its thresholds are the same. Made before the value check's
    synchronisation, so that the GPU does not idle through this host work."""
    spec, labels = problem.spec, problem.labels
    margin = spec.false_negative_margin
    return own_score_filter(labels["row_thresholds"], labels["key_thresholds"], labels["positive_keys"],
                            labels["key_offset"], problem.kernel.keys.shape[0],
                            margin if margin >= 0 else margin / 2, spec.false_negative_strategy)


def _rows_of(problem: _Problem, rows: torch.Tensor, labels: dict) -> _Problem:
    """The problem of the kernels' operands and ``labels`` of just these ``rows`` (the forward's
    and the left-out entries' launches only: the GEMMs' operands stay whole)."""
    queries = problem.kernel.queries.index_select(0, rows)
    labels = dict(labels, **{name: labels[name].index_select(0, rows) for name in ROW_LABELS
                             if name in labels})
    kernel = dataclasses.replace(problem.kernel, queries=queries)
    return dataclasses.replace(problem, kernel=kernel, labels=labels)


def _pair_operands(queries, keys, scale, bias):
    """The pair kernels' operands: rows of unit column stride, 0-d fp32 scale and bias."""
    queries, keys = (tensor if tensor.stride(-1) == 1 else tensor.contiguous() for tensor in (queries, keys))
    return queries, keys, scalar(scale), None if bias is None else scalar(bias)
