"""Block ops (the protocol of :mod:`hf_infcl.ops.spec`) on the fused Triton kernels.

``forward_block`` runs the statistics kernel once over the tiles: it gives the row statistic
and, for the symmetric softmax loss, the column log-sum-exp from the same tiles (or, with
``fused_columns=False``, from a second column-major pass).

``backward_block`` walks the problem in super-tiles of ``tile_rows x tile_keys`` logits. For each
one, the gradient-tile kernel recomputes the logits once and writes G (both directions'
probabilities, masked) into a bounded scratch buffer; two cuBLAS GEMMs then add G K to the
query accumulator and G^T Q to the key accumulator. ``hf_infcl.ops.triton_kernels`` explains why
G goes through that buffer rather than register accumulators for widths of 512-1024.

``forward_backward_block`` is the sigmoid loss's one pass (``StatsSpec.gradients_in_forward``):
the same super-tiles with every row weight 1, each row's softplus terms (the row statistic) summed
from the same logits. No statistics pass at all. On a Hopper GPU, for half-precision inputs
without a group mask, one Gluon kernel computes each super-tile's logits, G and the sums
(:mod:`hf_infcl.ops.gluon_sigmoid`); elsewhere (``sigmoid_logits="gemm"``) a cuBLAS GEMM computes
the dot products (fp16 for half-precision inputs, see ``_dot_operands``) and an elementwise
kernel forms G and the sums; ``"fused"`` has the gradient-tile kernel compute the dot products
itself.

fp32 inputs with TF32 precision ("auto" on CUDA, or "tf32") run the kernels on TF32 tensor
cores, as docs/contract.md ("Precision") says, after rounding the operands to TF32 to nearest
(``round_to_tf32``: the dot itself truncates). The backward's two GEMMs then multiply fp16
copies scaled by 1 / max|x| (per tensor) and G in fp16: a TF32 GEMM would round its operands to
the same 10-bit mantissa, while fp16 halves G's bytes and runs at twice the TF32 rate; the
scaling keeps every value in fp16's range, and the factors go into the accumulation. What
differs from TF32 is fp16's smaller exponent range *below* the largest entry (entries under 6e-5
x max|x| keep an absolute error of 3e-8 x max|x|). ``TritonBlocks(tf32_via_fp16=True)`` also
runs the kernels on those fp16 copies (the factors folded into the logit scale): faster still,
but opt-in because its ring gradients measured further from float64 than one GPU's, beyond the
TF32 tolerance (``benchmarks/triton_notes.md``), and the cause is not yet known. ``precision="ieee"`` keeps
exact fp32 everywhere.

The object keeps no state between calls, so the ring can call it once per visiting key block.
Float64 inputs have no tensor-core path: they are handed to :class:`TorchTiles`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import gluon_sigmoid
from . import triton_kernels as kernels
from .key_blocks import combine_rows
from .spec import GroupMask, HardnessOffset, StatsSpec, resolve_precision
from .tiled import TorchTiles

_HALF_TYPES = (torch.float16, torch.bfloat16)
SIGMOID_LOGITS = ("auto", "gluon", "gemm", "fused")
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class TritonBlocks:
    """Fused Triton block ops for CUDA tensors (or any tensors under ``TRITON_INTERPRET=1``).

    Attributes:
        tile_rows, tile_keys: the backward's super-tile; its G buffer holds
            ``tile_rows * tile_keys`` entries of the GEMM operand dtype. None picks 8192 x 4096
            for half-precision G (every mode but ``precision="ieee"``) and 4096 x 4096 for fp32
            G (64 MiB either way); the sigmoid one pass over fp16 dot products (half-precision
            inputs) writes G over them and takes 8192 x 8192 (128 MiB for both).
        stat_splits: programs sharing one outer block's inner range in the forward (None: enough
            to fill the GPU). Tests set it to exercise the merge of partial statistics.
        poison: fill every buffer the kernels must write completely with NaN first (tests use it
            to prove that no entry is left unwritten).
        fused_columns: the symmetric loss's column statistic comes out of the row pass (one
            forward pass); False runs a second, column-major pass instead.
        column_buffer_entries: fp32 entries (default 16M: 64 MiB) of the fused pass's column
            partials, one per (row block, key); more rows per launch when larger.
        tf32_via_fp16: multiply fp32 inputs with TF32 precision as scaled fp16 copies in the
            kernels too (faster; see the module docstring for its accuracy); False (the
            default) runs the kernels on TF32 tensor cores and only the GEMMs in fp16.
        sigmoid_logits: where the sigmoid loss's one pass gets each super-tile's dot products:
            ``"gluon"`` from the Gluon kernel of :mod:`hf_infcl.ops.gluon_sigmoid`, which also
            forms G and the sums (Hopper GPUs, fp16 / bf16 inputs, no group mask; a ValueError
            elsewhere); ``"gemm"`` from a cuBLAS GEMM into a buffer (fp16 for half-precision
            inputs, fp32 for fp32 inputs), read by an elementwise kernel that writes G;
            ``"fused"`` from the gradient-tile kernel itself, which computes them and G in one
            kernel (no dot-product buffer, but its tensor-core work and its elementwise work
            run one after the other); ``"auto"`` (the default): ``"gluon"`` where it can run,
            else ``"gemm"``.
    """

    tile_rows: int | None = None
    tile_keys: int | None = None
    stat_splits: int | None = None
    poison: bool = False
    fused_columns: bool = True
    column_buffer_entries: int = 16 * 2**20
    tf32_via_fp16: bool = False
    sigmoid_logits: str = "auto"

    # forward_block and forward_backward_block take ``before_first_kernel`` (see
    # hf_infcl.ops.spec.calls_before_first_kernel): the one-process value check, whose host
    # synchronisation leaves the GPU idle until the next launch, runs after the operands and
    # buffers are prepared (~0.3-0.8 ms of host work at b = 32k on an H100 machine's host); the
    # forward hands it to the statistics launcher, which calls it just before the launch.
    calls_before_first_kernel: ClassVar[bool] = True

    def __post_init__(self):
        if self.sigmoid_logits not in SIGMOID_LOGITS:
            raise ValueError(f"sigmoid_logits must be one of {SIGMOID_LOGITS}, got {self.sigmoid_logits!r}")
        for name in ("tile_rows", "tile_keys", "stat_splits", "column_buffer_entries"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    # ----------------------------------------------------------------------------------------

    def forward_block(self, spec: StatsSpec, queries, keys, scale, bias, mask: GroupMask | None,
                      hardness: HardnessOffset | None = None, before_first_kernel=None):
        if queries.dtype == torch.float64:
            kernels.call_if_given(before_first_kernel)
            return TorchTiles().forward_block(spec, queries, keys, scale, bias, mask, hardness=hardness)
        self._check(queries, keys)
        spec = _resolved(spec, queries)
        operands = self._operands(spec, queries, keys, scale)
        queries, keys, scale = operands.queries, operands.keys, operands.scale
        bias = None if bias is None else _scalar(bias)
        groups = _mask_arguments(mask)
        labels = _label_arguments(groups, hardness, operands)  # the row statistic's: groups and offset
        if spec.columns and self.fused_columns:
            return self._rows_and_columns_in_one_pass(spec, queries, keys, scale, bias, labels,
                                                      before_first_kernel)
        row_stat = kernels.logit_stats(
            queries, keys, scale, bias, sigmoid=spec.loss == "sigmoid", columns=False,
            precision=spec.precision, splits=self.stat_splits, out=self._stat_buffer(queries, keys),
            before_launch=before_first_kernel, **labels,
        )
        col_stat = None
        if spec.columns:
            col_stat = kernels.logit_stats(
                keys, queries, scale, bias, sigmoid=False, columns=True, precision=spec.precision,
                splits=self.stat_splits, out=self._stat_buffer(keys, queries), **groups,
            )
        return row_stat, col_stat

    def backward_block(self, spec: StatsSpec, queries, keys, scale, bias, mask: GroupMask | None,
                       row_stat, col_stat, row_weight, col_weight, grad_queries, grad_keys,
                       hardness: HardnessOffset | None = None):
        if queries.dtype == torch.float64:
            return TorchTiles().backward_block(spec, queries, keys, scale, bias, mask, row_stat, col_stat,
                                               row_weight, col_weight, grad_queries, grad_keys,
                                               hardness=hardness)
        return self._super_tiles(spec, queries, keys, scale, bias, mask, row_stat, col_stat, row_weight,
                                 col_weight, grad_queries, grad_keys, hardness=hardness)

    def forward_backward_block(self, spec: StatsSpec, queries, keys, scale, bias, mask: GroupMask | None,
                               grad_queries, grad_keys, before_first_kernel=None):
        """The sigmoid loss's one pass (``OnePassSigmoidOps``): the backward's super-tiles with
        every row weight 1, each tile's softplus row sums taken from the same logits (whose dot
        products ``sigmoid_logits`` says who computes)."""
        if queries.dtype == torch.float64:
            kernels.call_if_given(before_first_kernel)
            return TorchTiles().forward_backward_block(spec, queries, keys, scale, bias, mask, grad_queries,
                                                       grad_keys)
        if spec.loss != "sigmoid":
            raise ValueError("the one-pass route is for the sigmoid loss")
        ones = torch.ones(queries.shape[0], dtype=torch.float32, device=queries.device)
        row_stat = torch.zeros(queries.shape[0], dtype=torch.float32, device=queries.device)
        row_sums = self._super_tiles(spec, queries, keys, scale, bias, mask, ones, None, ones, None,
                                     grad_queries, grad_keys, softplus_sums=row_stat,
                                     before_first_kernel=before_first_kernel)
        return row_stat, row_sums

    def _super_tiles(self, spec: StatsSpec, queries, keys, scale, bias, mask: GroupMask | None, row_stat,
                     col_stat, row_weight, col_weight, grad_queries, grad_keys, softplus_sums=None,
                     hardness: HardnessOffset | None = None, before_first_kernel=None):
        """The backward's walk over super-tiles (see the module docstring); returns the row sums
        of G. With ``softplus_sums`` [m] (fp32, zeroed) the one-pass route: the sigmoid row
        statistic is added into it, by the Gluon kernel (Hopper), by the elementwise kernel over
        cuBLAS dot products (``sigmoid_logits="gemm"``) or by the gradient-tile kernel."""
        self._check(queries, keys)
        spec = _resolved(spec, queries)
        operands = self._operands(spec, queries, keys, scale)
        gemm = self._gemm_operands(spec, queries, keys, operands)
        queries, keys, scale = operands.queries, operands.keys, operands.scale
        bias = None if bias is None else _scalar(bias)
        m, k = queries.shape[0], keys.shape[0]
        device = queries.device
        labels = _label_arguments(_mask_arguments(mask), hardness, operands)
        # The one pass: its super-tiles' logits from the Gluon kernel, or their dot products from
        # cuBLAS (see _dot_operands), or from the gradient-tile kernel ("fused").
        gluon_dots = softplus_sums is not None and self._gluon_dots(gemm, operands, labels)
        gemm_dots = softplus_sums is not None and not gluon_dots and self.sigmoid_logits != "fused"
        if gemm_dots:
            dot_q, dot_k, dots_scale, dots_dtype = _dot_operands(gemm, operands, scale)
        f32 = dict(dtype=torch.float32, device=device)
        row_stat, row_weight = row_stat.to(**f32).contiguous(), row_weight.to(**f32).contiguous()
        if col_stat is not None:
            col_stat, col_weight = col_stat.to(**f32).contiguous(), col_weight.to(**f32).contiguous()

        # G is stored in the GEMM operands' dtype. In fp16 it is stored as G / g_scale,
        # g_scale = max |weight|, so that it keeps its relative precision when the weights are
        # tiny (1/m for a mean over 1M rows underflows fp16). bf16 and fp32 have fp32's
        # exponent range and store G itself.
        g_scale = None
        if gemm.queries.dtype == torch.float16:
            g_scale = row_weight.abs().amax()
            if col_weight is not None:
                g_scale = g_scale + col_weight.abs().amax()
            g_scale = g_scale.clamp_min(_TINY)
        inv_g_scale = None if g_scale is None else 1.0 / g_scale

        # The GEMMs add (G / g_scale) @ (K / k_max) into grad_queries, whose true increment is
        # that times g_scale * k_max. Dividing the accumulator by the factor first and
        # multiplying it back after keeps every product exactly one fp32 addmm (no rounded
        # half-precision intermediate that could overflow) at the cost of two cheap passes.
        factor_q = _product(g_scale, gemm.keys_max)
        factor_k = _product(g_scale, gemm.queries_max)
        if factor_q is not None:
            grad_queries.div_(factor_q)
        if factor_k is not None:
            grad_keys.div_(factor_k)

        # G over dot products of its own element size (fp16 dots, half-precision G) overwrites
        # them in place: each entry is read and written by the same thread.
        g_over_dots = gemm_dots and dots_dtype.itemsize == gemm.queries.dtype.itemsize
        tile_rows, tile_keys = self._super_tile(gemm.queries.dtype, m, k, g_over_dots or gluon_dots)
        # Row stride padded to 8 elements so that cuBLAS sees aligned leading dimensions.
        ld = -(-tile_keys // 8) * 8
        dots = torch.empty((tile_rows, ld), dtype=dots_dtype, device=device) if gemm_dots else None
        if g_over_dots:
            scratch = dots.view(gemm.queries.dtype)
        else:
            scratch = torch.empty((tile_rows, ld), dtype=gemm.queries.dtype, device=device)
        row_sums = torch.zeros(m, **f32)
        base_offset = labels.pop("key_offset", 0)
        offset = {name: labels.pop(name) for name in ("hardness", "hardness_strength") if name in labels}
        sigmoid = spec.loss == "sigmoid"
        # One autotuning key for every super-tile of this call, so that tuning (which zeroes the
        # row-sum buffer it benchmarks on) can only happen on the first super-tile.
        size_class = kernels.problem_size_class(m, k)

        # Every view the loop needs, made once: at b = 32k the loop body runs 32-64 times per
        # call and at 128k ~1000 times, and the host time of slicing a dozen tensors per
        # super-tile (on top of three launches) was longer than the GPU work it launched.
        row_bounds = [(r0, min(r0 + tile_rows, m)) for r0 in range(0, m, tile_rows)]
        key_bounds = [(k0, min(k0 + tile_keys, k)) for k0 in range(0, k, tile_keys)]
        rows = [
            dict(queries=queries[r0:r1], gemm_queries=gemm.queries[r0:r1], grad=grad_queries[r0:r1],
                 row_sums=row_sums[r0:r1], row_stat=row_stat[r0:r1], row_weight=row_weight[r0:r1],
                 softplus_sums=None if softplus_sums is None else softplus_sums[r0:r1],
                 labels=_sliced(labels, _ROW_LABELS, r0, r1), dot_queries=dot_q[r0:r1] if gemm_dots else None,
                 descriptor=_descriptor(queries[r0:r1], gemm_dots, gluon_dots, gluon_sigmoid.BLOCK_M))
            for r0, r1 in row_bounds
        ]
        key_tiles = [
            dict(keys=keys[k0:k1], gemm_keys=gemm.keys[k0:k1], grad=grad_keys[k0:k1],
                 col_stat=None if col_stat is None else col_stat[k0:k1],
                 col_weight=None if col_weight is None else col_weight[k0:k1],
                 labels=dict(_sliced(labels, _KEY_LABELS, k0, k1), key_offset=base_offset + k0)
                 if labels else {}, dot_keys=dot_k[k0:k1] if gemm_dots else None,
                 descriptor=_descriptor(keys[k0:k1], gemm_dots, gluon_dots, gluon_sigmoid.BLOCK_N))
            for k0, k1 in key_bounds
        ]
        g_views, dot_views = {}, {}  # at most four shapes each: full, last row panel, last key tile, both
        # The gradient-tile kernel's configuration, from its first launch: every later super-tile
        # has the same tuning key (size_class), so it skips the autotuner's look-ups (host time).
        config = None

        # The one pass is the forward: the value check goes before its first kernel.
        kernels.call_if_given(before_first_kernel)
        with _cublas_precision(gemm.queries.dtype, spec.precision, device):
            for row in rows:
                for tile in key_tiles:
                    shape = (row["queries"].shape[0], tile["keys"].shape[0])
                    g = g_views.get(shape)
                    if g is None:
                        g = g_views[shape] = scratch[: shape[0], : shape[1]]
                    if self.poison:
                        scratch.fill_(float("nan"))
                    if gluon_dots:
                        gluon_sigmoid.sigmoid_tile(row["queries"], tile["keys"], g, row["row_sums"],
                                                   row["softplus_sums"], scale, bias, inv_g_scale,
                                                   descriptors=(row["descriptor"], tile["descriptor"]))
                    elif gemm_dots:
                        d = dot_views.get(shape)
                        if d is None:
                            d = dot_views[shape] = dots[: shape[0], : shape[1]]
                        if self.poison:
                            dots.fill_(float("nan"))
                        _add_product(d, row["dot_queries"], tile["dot_keys"].T, beta=0)
                        kernels.sigmoid_from_dots(d, g, row["row_sums"], row["softplus_sums"], dots_scale,
                                                  bias, inv_g_scale,
                                                  **row["labels"], **tile["labels"])
                    else:
                        config = kernels.grad_tile(
                            row["queries"], tile["keys"], g, row["row_sums"], scale, bias, inv_g_scale,
                            row["row_stat"], tile["col_stat"], row["row_weight"], tile["col_weight"],
                            sigmoid=sigmoid, precision=spec.precision, size_class=size_class,
                            softplus_sums=row["softplus_sums"], config=config,
                            descriptors=(row["descriptor"], tile["descriptor"]), **row["labels"],
                            **tile["labels"], **offset,
                        )
                    _add_product(row["grad"], g, tile["gemm_keys"])
                    _add_product(tile["grad"], g.T, row["gemm_queries"])

        if factor_q is not None:
            grad_queries.mul_(factor_q)
        if factor_k is not None:
            grad_keys.mul_(factor_k)
        return row_sums

    def combine_rows(self, **arguments):
        """The epilogues' row primitive (:func:`hf_infcl.ops.key_blocks.combine_rows`) in one
        kernel launch instead of a dozen torch ops per row chunk, and with no host
        synchronisation. Float64 goes to the torch version."""
        if arguments["sources"].dtype == torch.float64:
            return combine_rows(**arguments)
        return kernels.combine_rows(**arguments)

    # ----------------------------------------------------------------------------------------

    def _gluon_dots(self, gemm: _Operands, operands: _Operands, labels: dict) -> bool:
        """Whether the one pass takes its logits from the Gluon kernel (``sigmoid_logits``)."""
        if self.sigmoid_logits not in ("auto", "gluon"):
            return False
        usable = gemm is operands and gluon_sigmoid.usable(operands.queries, operands.keys,
                                                            has_mask=bool(labels))
        if self.sigmoid_logits == "gluon" and not usable:
            raise ValueError(
                "sigmoid_logits='gluon' needs a Hopper GPU (compute capability 9), a Triton with Gluon, "
                "fp16 or bf16 inputs whose rows are 16-byte aligned, and no group mask; use 'auto' to fall "
                "back to 'gemm' elsewhere")
        return usable

    def _operands(self, spec: StatsSpec, queries, keys, scale) -> _Operands:
        """The tensors the kernels multiply, and the logit scale that makes their logits right."""
        scale = _scalar(scale)
        queries, keys = queries.contiguous(), keys.contiguous()
        if not _tf32(spec, queries):
            return _Operands(queries, keys, scale, None, None)
        if self.tf32_via_fp16:
            fp16 = _scaled_fp16(queries, keys)
            return _Operands(fp16.queries, fp16.keys, scale * fp16.queries_max * fp16.keys_max,
                             fp16.queries_max, fp16.keys_max)
        # Triton's TF32 dot truncates each operand's mantissa to 10 bits, which shrinks every
        # logit by about 1e-3 of its size while the positive logit is exact fp32: the fp32
        # loss value came out 3-11 % off on 2 x H200. Rounded to nearest first, the
        # truncation is exact and the rounding errors no longer share a sign.
        return _Operands(round_to_tf32(queries), round_to_tf32(keys), scale, None, None)

    def _gemm_operands(self, spec: StatsSpec, queries, keys, kernel_operands: _Operands) -> _Operands:
        """The operands of the backward's G K and G^T Q GEMMs (``scale`` unused).

        fp32 inputs with TF32 precision multiply as fp16 copies scaled by 1 / max|x|: a TF32
        GEMM rounds its operands to the same 10-bit mantissa, while fp16 halves the bytes of G
        and of the operands and runs at twice the TF32 rate. Otherwise: the kernels' operands.
        """
        if not _tf32(spec, queries) or self.tf32_via_fp16:
            return kernel_operands
        fp16 = _scaled_fp16(queries, keys)
        return _Operands(fp16.queries, fp16.keys, kernel_operands.scale, fp16.queries_max, fp16.keys_max)

    def _rows_and_columns_in_one_pass(self, spec, queries, keys, scale, bias, labels,
                                      before_first_kernel=None):
        """Row and column log-sum-exp from one pass over the tiles (``labels``: the launcher's
        group and hardness arguments).

        Rows go in chunks small enough that the column partials (one fp32 per row block and
        key) fit in ``column_buffer_entries``; each chunk's partials are merged into the column
        statistic before the next chunk reuses the buffer.
        """
        m, k = queries.shape[0], keys.shape[0]
        device = queries.device
        blocks_per_chunk = max(1, self.column_buffer_entries // k)
        chunk_rows = min(m, blocks_per_chunk * kernels.MIN_BLOCK_M)
        partials = torch.empty((_cdiv(chunk_rows, kernels.MIN_BLOCK_M), k), dtype=torch.float32,
                               device=device)
        row_stat = torch.empty(m, dtype=torch.float32, device=device) if chunk_rows < m else None
        col_stat = None
        for r0 in range(0, m, chunk_rows):
            r1 = min(r0 + chunk_rows, m)
            # Row blocks a config with larger blocks leaves unwritten must not count: -inf.
            partials.fill_(float("-inf"))
            chunk_labels = dict(labels, **_sliced(labels, _ROW_LABELS, r0, r1))
            rows = kernels.logit_stats(
                queries[r0:r1], keys, scale, bias, sigmoid=False, columns=False,
                precision=spec.precision, splits=self.stat_splits,
                out=self._stat_buffer(queries[r0:r1], keys), column_partials=partials,
                before_launch=before_first_kernel if r0 == 0 else None, **chunk_labels,
            )
            if row_stat is None:  # one chunk: its rows are all the rows
                row_stat = rows
            else:
                row_stat[r0:r1] = rows
            col_stat = kernels.merge_partials(partials, log_sum_exp=True, previous=col_stat, out=col_stat)
        return row_stat, col_stat

    def _super_tile(self, dtype: torch.dtype, m: int, k: int, wide: bool = False) -> tuple[int, int]:
        # 64 MiB of G: each super-tile then carries enough GPU work to hide the host time of its
        # three launches; smaller tiles left the GPU waiting on the host (benchmarks/triton_notes.md).
        # ``wide``: G written over the dot products, or G alone (the Gluon kernel needs no
        # dot-product buffer): twice the keys in the memory of G and dot products side by side.
        default_keys = 8192 if wide else 4096
        rows = self.tile_rows if self.tile_rows is not None else (8192 if dtype in _HALF_TYPES else 4096)
        keys = self.tile_keys if self.tile_keys is not None else default_keys
        return min(rows, m), min(keys, k)

    def _stat_buffer(self, outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor | None:
        if not self.poison:
            return None
        splits, _ = kernels.inner_splits(outer.shape[0], inner.shape[0], outer.device, self.stat_splits)
        return torch.full((splits, outer.shape[0]), float("nan"), dtype=torch.float32, device=outer.device)

    @staticmethod
    def _check(queries: torch.Tensor, keys: torch.Tensor) -> None:
        if queries.dtype not in (torch.float32, *_HALF_TYPES):
            raise TypeError(f"queries must be float32, float16 or bfloat16 for Triton, got {queries.dtype}")
        if keys.dtype != queries.dtype:
            raise TypeError(f"keys have dtype {keys.dtype} but queries have {queries.dtype}")
        if not kernels.INTERPRET and queries.device.type != "cuda":
            raise ValueError(f"the Triton kernels need CUDA tensors, got queries on {queries.device}")


@dataclass(frozen=True)
class _Operands:
    queries: torch.Tensor
    keys: torch.Tensor
    scale: torch.Tensor | None  # 0-d fp32: the logit scale for these operands
    queries_max: torch.Tensor | None  # the factors the fp16 copies were divided by, if any
    keys_max: torch.Tensor | None


def _dot_operands(gemm: _Operands, operands: _Operands, scale: torch.Tensor):
    """(queries, keys, scale, dtype of the product) whose cuBLAS product gives the sigmoid one
    pass's dot products.

    Half-precision inputs: fp16 copies divided by a power of two at least their largest entry
    (exact, no rounding), so that every dot product lies within +-c and its fp16 result cannot
    overflow; the elementwise kernel then reads 2 bytes per logit instead of 4 (what bounds
    it). Rounding a dot product to fp16 (2^-11 relative) is 4x finer than the rounding the
    half-precision inputs themselves carry. fp32 inputs: the backward GEMMs' operands (the
    scaled fp16 copies of TF32 precision, or the fp32 inputs of "ieee"), with fp32 dot
    products. The scale takes every factor the operands were divided by."""
    if gemm is not operands:  # fp32 inputs with TF32 precision: fp16 copies divided by their maxima
        return gemm.queries, gemm.keys, scale * _product(gemm.queries_max, gemm.keys_max), torch.float32
    if gemm.queries.dtype not in _HALF_TYPES:
        return gemm.queries, gemm.keys, scale, torch.float32
    # Both factors from one small tensor, and each copy in one op that divides and converts
    # (a dozen host launches instead of twenty: they run before the first GEMM, the GPU idle).
    maxima = _largest_magnitudes(gemm.queries, gemm.keys)
    inverse = torch.exp2(-torch.ceil(torch.log2(maxima)))  # 1 / (powers of two >= maxima)
    copies = [torch.mul(t.detach(), factor, out=torch.empty(t.shape, dtype=torch.float16, device=t.device))
              for t, factor in zip((gemm.queries, gemm.keys), inverse)]
    return copies[0], copies[1], scale / inverse.prod(), torch.float16


def _descriptor(operand: torch.Tensor, gemm_dots: bool, gluon_dots: bool, block_rows: int):
    """The TMA descriptor a super-tile's kernel reads ``operand`` [rows, c] through: the Gluon
    kernel's, the gradient-tile kernel's (None where there is no TMA), or none for the cuBLAS
    route, which reads the fp16 copies."""
    if gluon_dots:
        return gluon_sigmoid.make_descriptor(operand, block_rows)
    return None if gemm_dots else kernels.tensor_descriptor(operand)


def _resolved(spec: StatsSpec, queries: torch.Tensor) -> StatsSpec:
    """``spec`` with ``"auto"`` precision replaced by what it means here (:func:`resolve_precision`),
    so that the kernels, the GEMMs and the operand preparation below all see "tf32" or "ieee"."""
    return dataclasses.replace(spec, precision=resolve_precision(spec.precision, queries.dtype,
                                                                 queries.device))


def _tf32(spec: StatsSpec, queries: torch.Tensor) -> bool:
    """fp32 inputs multiplied with TF32 precision."""
    return queries.dtype == torch.float32 and spec.precision == "tf32"


def _scaled_fp16(queries: torch.Tensor, keys: torch.Tensor) -> _Operands:
    """fp16 copies of fp32 operands divided by their largest magnitude (per tensor), so that
    every value is in fp16's range; ``scale`` is left unset (None)."""
    maxima = _largest_magnitudes(queries, keys)
    copies = [torch.div(t.detach(), factor, out=torch.empty(t.shape, dtype=torch.float16, device=t.device))
              for t, factor in zip((queries, keys), maxima)]  # divided and converted in one op each
    return _Operands(copies[0], copies[1], None, maxima[0], maxima[1])


def _largest_magnitudes(*tensors: torch.Tensor) -> torch.Tensor:
    """fp32 [len(tensors)]: each tensor's largest |entry| (at least the smallest normal float, so
    that it can divide), in one small tensor: a few launches for all of them."""
    return torch.stack([torch.linalg.vector_norm(t.detach(), ord=float("inf")) for t in tensors]
                       ).float().clamp_min(_TINY)


def _product(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a * b for optional 0-d factors (None means 1), kept away from 0 so it can divide."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        return a if b is None else b
    return (a * b).clamp_min(_TINY)


def _add_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1) -> None:
    """accumulator (fp32, or the operands' dtype) = beta * accumulator + a @ b, with no rounded
    intermediate (beta = 0: overwritten, whatever it held, NaN included).

    Operands of the accumulator's dtype: one in-place addmm. Half operands on CUDA: cuBLAS
    accumulates into the fp32 buffer directly (``out_dtype``). Elsewhere (CPU under the
    interpreter, or a torch without ``out_dtype``): the product of fp32 copies.
    """
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a, b, beta=beta)
        return
    if a.is_cuda and _HAS_OUT_DTYPE[0]:
        try:
            torch.addmm(accumulator, a, b, out_dtype=accumulator.dtype, beta=beta, out=accumulator)
            return
        except (RuntimeError, TypeError):
            _HAS_OUT_DTYPE[0] = False  # an older torch: use the general path from now on
    accumulator.addmm_(a.to(accumulator.dtype), b.to(accumulator.dtype), beta=beta)


# Whether torch.addmm(..., out_dtype=) works here; cleared at the first failure.
_HAS_OUT_DTYPE = [True]


@contextlib.contextmanager
def _cublas_precision(dtype: torch.dtype, precision: str, device: torch.device):
    """The G K and G^T Q GEMMs of fp32 operands follow ``precision`` like the kernels' tl.dot:
    TF32 unless "ieee" ("auto" included, whatever torch's global default says)."""
    if device.type != "cuda" or dtype != torch.float32:
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision != "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_to_tf32(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to the nearest TF32 value (10 mantissa bits; ties away from zero),
    still stored as fp32. Adding half a unit of the last kept bit to the bit pattern and
    clearing the dropped bits rounds the magnitude; a carry moves into the exponent as it should."""
    bits = tensor.detach().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def _scalar(value: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 tensor the kernels read through a pointer (no host synchronisation)."""
    return value.detach().reshape(()).to(torch.float32)


def _mask_arguments(mask: GroupMask | None) -> dict:
    if mask is None:
        return {}
    return dict(
        row_groups=mask.query_groups.to(torch.int64).contiguous(),
        key_groups=mask.key_groups.to(torch.int64).contiguous(),
        positive_keys=mask.positive_keys.to(torch.int64).contiguous(),
        key_offset=int(mask.key_offset),
    )


# The launchers' per-row and per-key label arguments (what a super-tile or row chunk slices).
_ROW_LABELS = ("row_groups", "positive_keys", "query_ids")
_KEY_LABELS = ("key_groups", "key_owners")


def _sliced(arguments: dict, names: tuple[str, ...], start: int, end: int) -> dict:
    """The ``names`` among ``arguments`` (those given), sliced to ``start:end``."""
    return {name: arguments[name][start:end] for name in names if name in arguments}


def _label_arguments(mask_arguments: dict, hardness: HardnessOffset | None, operands: _Operands) -> dict:
    """The launchers' arguments of the group mask (``mask_arguments``, :func:`_mask_arguments`)
    and of the hardness offset (the row statistic's, and the backward's). The offset's strength
    multiplies the kernels' dot products, which are those of the fp16 copies when fp32 runs as
    scaled fp16: it takes their factors."""
    if hardness is None:
        return mask_arguments
    device = hardness.query_ids.device
    strength = torch.tensor(hardness.strength, dtype=torch.float32, device=device)
    factor = _product(operands.queries_max, operands.keys_max)
    return dict(
        mask_arguments,
        query_ids=hardness.query_ids.to(torch.int64).contiguous(),
        key_owners=hardness.key_owners.to(torch.int64).contiguous(),
        positive_keys=hardness.positive_keys.to(torch.int64).contiguous(),
        key_offset=int(hardness.key_offset),
        hardness=hardness.mode_code,
        hardness_strength=strength if factor is None else strength * factor,
    )
