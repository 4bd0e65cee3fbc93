"""What the Triton block ops hand to the kernels and GEMMs: the operands (rounded or scaled copies
of fp32 inputs), the logit scale that keeps their logits right, and the launchers' label arguments.

fp32 inputs with TF32 precision run the kernels and the backward's GEMMs on fp16 copies divided by
a power of two per tensor (:func:`scaled_fp16`), with the factors folded into the logit scale and
the accumulation: TF32's 10-bit mantissa at the fp16 rate. ``TritonBlocks(tf32_via_fp16=False)``
runs the kernels on TF32 tensor cores instead, after rounding the operands to TF32 to nearest
(:func:`round_to_tf32`: the dot itself truncates), and only the GEMMs on the copies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..spec import GroupMask, HardnessOffset, ScoreFilter, StatsSpec, resolve_precision

HALF_TYPES = (torch.float16, torch.bfloat16)
TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Operands:
    queries: torch.Tensor
    keys: torch.Tensor
    scale: torch.Tensor | None  # 0-d fp32: the logit scale for these operands
    queries_factor: torch.Tensor | None  # the factors the fp16 copies were divided by, if any
    keys_factor: torch.Tensor | None


def kernel_operands(spec: StatsSpec, queries, keys, scale, via_fp16: bool) -> Operands:
    """The tensors the kernels multiply, and the logit scale that makes their logits right
    (``via_fp16``: fp32 inputs with TF32 precision as scaled fp16 copies)."""
    scale = scalar(scale)
    queries, keys = queries.contiguous(), keys.contiguous()
    if not is_tf32(spec, queries):
        return Operands(queries, keys, scale, None, None)
    if via_fp16:
        fp16 = scaled_fp16(queries, keys)
        return Operands(fp16.queries, fp16.keys, scale * fp16.queries_factor * fp16.keys_factor,
                        fp16.queries_factor, fp16.keys_factor)
    # Triton's TF32 dot truncates each operand's mantissa to 10 bits, which shrinks every logit
    # by about 1e-3 of its size while the positive logit is exact fp32, biasing the fp32 loss
    # value by several percent. Rounded to nearest first, the truncation is exact and the
    # rounding errors no longer share a sign.
    return Operands(round_to_tf32(queries), round_to_tf32(keys), scale, None, None)


def gemm_operands(spec: StatsSpec, queries, keys, kernel: Operands, via_fp16: bool) -> Operands:
    """The operands of the backward's G K and G^T Q GEMMs (``scale`` unused).

    fp32 inputs with TF32 precision multiply as fp16 copies divided by a power of two: a TF32 GEMM
    rounds its operands to the same 10-bit mantissa, while fp16 halves the bytes of G and of the
    operands and runs at twice the TF32 rate. Otherwise: the kernels' operands.
    """
    if not is_tf32(spec, queries) or via_fp16:
        return kernel
    fp16 = scaled_fp16(queries, keys)
    return Operands(fp16.queries, fp16.keys, kernel.scale, fp16.queries_factor, fp16.keys_factor)


def dot_operands(gemm: Operands, kernel: Operands, scale: torch.Tensor):
    """(queries, keys, scale, dtype of the product) whose cuBLAS product gives the sigmoid one
    pass's dot products.

    Half-precision inputs: fp16 copies divided by a power of two at least their largest entry
    (exact, no rounding), so that every dot product lies within +-c and its fp16 result cannot
    overflow; the elementwise kernel then reads 2 bytes per logit instead of 4 (what bounds
    it). Rounding a dot product to fp16 (2^-11 relative) is 4x finer than the rounding the
    half-precision inputs themselves carry. fp32 inputs: the backward GEMMs' operands (the
    scaled fp16 copies of TF32 precision, or the fp32 inputs of "ieee"), with fp32 dot
    products. The scale takes every factor the operands were divided by."""
    if gemm is not kernel:  # fp32 inputs, TF32 kernels: the GEMMs' fp16 copies divided by powers of two
        return gemm.queries, gemm.keys, scale * product(gemm.queries_factor, gemm.keys_factor), torch.float32
    if gemm.queries_factor is not None or gemm.queries.dtype not in HALF_TYPES:
        # fp32 inputs: as fp16 copies everywhere (the scale holds their factors), or exact ("ieee")
        return gemm.queries, gemm.keys, scale, torch.float32
    fp16 = scaled_fp16(gemm.queries, gemm.keys)
    return fp16.queries, fp16.keys, scale * fp16.queries_factor * fp16.keys_factor, torch.float16


def resolved(spec: StatsSpec, queries: torch.Tensor) -> StatsSpec:
    """``spec`` with ``"auto"`` precision replaced by what it means here (:func:`resolve_precision`),
    so that the kernels, the GEMMs and the operand preparation all see "tf32" or "ieee"."""
    return dataclasses.replace(spec, precision=resolve_precision(spec.precision, queries.dtype,
                                                                 queries.device))


def is_tf32(spec: StatsSpec, queries: torch.Tensor) -> bool:
    """fp32 inputs multiplied with TF32 precision."""
    return queries.dtype == torch.float32 and spec.precision == "tf32"


def scaled_fp16(queries: torch.Tensor, keys: torch.Tensor) -> Operands:
    """fp16 copies of the operands, each divided by the power of two at or above its largest
    magnitude, so that every value is in fp16's range; ``scale`` is left unset (None); the
    ``*_factor`` fields hold the two factors. Both factors come from one small tensor, and each copy
    from one op that divides and converts (few host launches, while the GPU waits for them).

    A power of two, not the largest magnitude itself: dividing by it is exact, so each value
    rounds to fp16 as it would to TF32 (above fp16's subnormals) whatever the tensor around it.
    Divided by its own maximum, a slice of a tensor rounded otherwise than the whole: the ring's
    backward, which takes each key block in slices, then recomputed logits rounded otherwise than
    those of its forward's statistics, and its gradients were further from float64 than one
    process's."""
    factors = torch.exp2(torch.ceil(torch.log2(_largest_magnitudes(queries, keys))))
    copies = [torch.div(t.detach(), factor, out=torch.empty(t.shape, dtype=torch.float16, device=t.device))
              for t, factor in zip((queries, keys), factors)]
    return Operands(copies[0], copies[1], None, factors[0], factors[1])


def _largest_magnitudes(*tensors: torch.Tensor) -> torch.Tensor:
    """fp32 [len(tensors)]: each tensor's largest |entry| (at least the smallest normal float, so
    that it can divide), in one small tensor: a few launches for all of them."""
    return torch.stack([torch.linalg.vector_norm(t.detach(), ord=float("inf")) for t in tensors]
                       ).float().clamp_min(TINY)


def product(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a * b for optional 0-d factors (None means 1), kept away from 0 so it can divide."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        return a if b is None else b
    return (a * b).clamp_min(TINY)


def round_to_tf32(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to the nearest TF32 value (10 mantissa bits; ties away from zero),
    still stored as fp32. Adding half a unit of the last kept bit to the bit pattern and
    clearing the dropped bits rounds the magnitude; a carry moves into the exponent as it should."""
    bits = tensor.detach().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def scalar(value: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 tensor the kernels read through a pointer (no host synchronisation)."""
    return value.detach().reshape(()).to(torch.float32)


# The launchers' per-row and per-key label arguments (what a super-tile or row chunk slices).
ROW_LABELS = ("row_groups", "positive_keys", "query_ids", "row_thresholds", "guide_queries")
KEY_LABELS = ("key_groups", "key_owners", "key_thresholds", "guide_keys")
# The row statistic's own arguments, which a column statistic's launch leaves out.
ROW_STATISTIC_ONLY = ("query_ids", "key_owners", "hardness", "hardness_strength", "row_thresholds")


def sliced(arguments: dict, names: tuple[str, ...], start: int, end: int) -> dict:
    """The ``names`` among ``arguments`` (those given), sliced to ``start:end``."""
    return {name: arguments[name][start:end] for name in names if name in arguments}


def mask_arguments(mask: GroupMask | None) -> dict:
    """The launchers' arguments of the group mask."""
    if mask is None:
        return {}
    return dict(
        row_groups=mask.query_groups.to(torch.int64).contiguous(),
        key_groups=mask.key_groups.to(torch.int64).contiguous(),
        positive_keys=mask.positive_keys.to(torch.int64).contiguous(),
        key_offset=int(mask.key_offset),
    )


def label_arguments(mask: GroupMask | None, hardness: HardnessOffset | None, kernel: Operands,
                    score_filter: ScoreFilter | None = None) -> dict:
    """The launchers' arguments of the group mask, of the hardness offset (the row statistic's,
    and the backward's) and of the score filter. The offset's strength multiplies the kernels' dot
    products, and the filter's thresholds (without a guide) are compared with them: they are those
    of the fp16 copies when fp32 runs as scaled fp16, so both take the copies' factors."""
    arguments = mask_arguments(mask)
    factor = product(kernel.queries_factor, kernel.keys_factor)
    if hardness is not None:
        device = hardness.query_ids.device
        strength = torch.full((), hardness.strength, dtype=torch.float32, device=device)  # a fill: no copy
        arguments.update(
            query_ids=hardness.query_ids.to(torch.int64).contiguous(),
            key_owners=hardness.key_owners.to(torch.int64).contiguous(),
            positive_keys=hardness.positive_keys.to(torch.int64).contiguous(),
            key_offset=int(hardness.key_offset),
            hardness=hardness.mode_code,
            hardness_strength=strength if factor is None else strength * factor,
        )
        if hardness.query_groups is not None:
            arguments.update(_positive_groups(hardness.query_groups, hardness.key_groups))
    if score_filter is not None:
        guided = score_filter.guide_queries is not None
        arguments.update(_filter_arguments(score_filter, None if guided else factor))
    return arguments


def _positive_groups(query_groups, key_groups) -> dict:
    """The launchers' arguments of ``group_positives``: the groups say which keys are positives (and
    mask nothing)."""
    return dict(row_groups=query_groups.to(torch.int64).contiguous(),
                key_groups=key_groups.to(torch.int64).contiguous(), group_positives=True)


def _filter_arguments(score_filter: ScoreFilter, factor: torch.Tensor | None) -> dict:
    """The launchers' arguments of the score filter: fp32 thresholds in the units of what they are
    compared with (divided by ``factor``, the scaled copies' factor, if any), the guide (contiguous
    rows), the positives."""

    def thresholds(values):
        if values is None:
            return None
        values = values.to(torch.float32)
        return (values if factor is None else values / factor).contiguous()

    arguments = dict(positive_keys=score_filter.positive_keys.to(torch.int64).contiguous(),
                     key_offset=int(score_filter.key_offset),
                     row_thresholds=thresholds(score_filter.row_thresholds))
    if score_filter.key_thresholds is not None:
        arguments["key_thresholds"] = thresholds(score_filter.key_thresholds)
    if score_filter.guide_queries is not None:
        # fp32 guides multiplied with TF32 are rounded as the kernels load them (no copies).
        arguments.update(guide_queries=score_filter.guide_queries.detach().contiguous(),
                         guide_keys=score_filter.guide_keys.detach().contiguous())
    if score_filter.query_groups is not None:
        arguments.update(_positive_groups(score_filter.query_groups, score_filter.key_groups))
    return arguments
