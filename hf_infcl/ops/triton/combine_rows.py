"""The O(m c) epilogues (:func:`hf_infcl.ops.key_blocks.combine_rows`: the positive logits, and the
accumulators turned into the returned gradients) in one kernel launch, one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import INTERPRET, unused_pointer
from .launch import launch_jit

# Columns per step of a row: up to 1024 (c = 768 takes one masked step).
_MAX_BLOCK = 64 if INTERPRET else 1024


@triton.jit
def _combine_rows_kernel(
    out_ptr, accumulator_ptr, weight_ptr, sources_ptr, source_index_ptr, source_weight_ptr, offsets_ptr,
    scale_ptr, dot_with_ptr, dot_index_ptr, dots_ptr, width, n_sources, stride_out, stride_accumulator,
    stride_sources, stride_dot_with, stride_weight, stride_source_weight,
    HAS_OUT: tl.constexpr, HAS_ACCUMULATOR: tl.constexpr, WEIGHT: tl.constexpr,
    HAS_SOURCE_WEIGHT: tl.constexpr, ONE_ENTRY_PER_ROW: tl.constexpr, INDEXED: tl.constexpr,
    HAS_DOTS: tl.constexpr, DOT_INDEXED: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program per row r: v = w * accumulator[r] + sum_t source_weight[t] * sources[source_index[t]]
    over the row's entries t in [offsets[r], offsets[r + 1]) (t = r with ONE_ENTRY_PER_ROW), in
    fp32; stores scale * v into out[r] and <v, dot_with[r]> (DOT_INDEXED: dot_with[dot_index[r]])
    into dots[r]. WEIGHT: 0 none, 1 one
    per row, 2 one for all rows. Without INDEXED, entry t takes sources[t], and (one entry per
    row) rows from n_sources on have none."""
    row = tl.program_id(0).to(tl.int64)
    if ONE_ENTRY_PER_ROW:
        first = row
        if INDEXED:
            last = row + 1
        else:
            last = tl.where(row < n_sources, row + 1, row)
    else:
        first = tl.load(offsets_ptr + row)
        last = tl.load(offsets_ptr + row + 1)
    if WEIGHT == 1:
        weight = tl.load(weight_ptr + row * stride_weight).to(tl.float32)
    elif WEIGHT == 2:
        weight = tl.load(weight_ptr).to(tl.float32)
    else:
        weight = 1.0
    scale = tl.load(scale_ptr).to(tl.float32) if HAS_OUT else 1.0
    partner = row
    if DOT_INDEXED:
        partner = tl.load(dot_index_ptr + row).to(tl.int64)
    dot = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for column_start in range(0, width, BLOCK_C):
        columns = column_start + tl.arange(0, BLOCK_C)
        valid = columns < width
        value = tl.zeros((BLOCK_C,), dtype=tl.float32)
        if HAS_ACCUMULATOR:
            value = tl.load(accumulator_ptr + row * stride_accumulator + columns, mask=valid,
                            other=0.0).to(tl.float32) * weight
        for entry in range(first, last):
            if INDEXED:
                source = tl.load(source_index_ptr + entry).to(tl.int64)
            else:
                source = entry
            added = tl.load(sources_ptr + source * stride_sources + columns, mask=valid,
                            other=0.0).to(tl.float32)
            if HAS_SOURCE_WEIGHT:
                added = added * tl.load(source_weight_ptr + entry * stride_source_weight).to(tl.float32)
            value += added
        if HAS_DOTS:
            dot += value * tl.load(dot_with_ptr + partner * stride_dot_with + columns, mask=valid,
                                   other=0.0).to(tl.float32)
        if HAS_OUT:
            tl.store(out_ptr + row * stride_out + columns, (value * scale).to(out_ptr.dtype.element_ty),
                     mask=valid)
    if HAS_DOTS:
        tl.store(dots_ptr + row, tl.sum(dot, axis=0))


def combine_rows(*, rows: int, sources, source_index, source_weight=None, entry_rows=None, accumulator=None,
                 weight=None, out=None, scale=None, dot_with=None, dot_index=None):
    """:func:`hf_infcl.ops.key_blocks.combine_rows` in one launch (fp32 arithmetic; sources of
    fp32, fp16 or bf16, an fp32 accumulator). No host synchronisation: the rows' entry ranges
    are found on the device, and ``source_index`` None (the identity) needs none."""
    device = sources.device
    dummy = unused_pointer(device)
    dots = torch.empty(rows, dtype=torch.float32, device=device) if dot_with is not None else None
    if rows == 0:
        return dots
    offsets = None
    if entry_rows is not None:
        row_starts = torch.arange(rows + 1, device=device, dtype=entry_rows.dtype)
        offsets = torch.searchsorted(entry_rows, row_starts)
    width = sources.shape[1]
    weight_kind = 0 if weight is None else (2 if weight.dim() == 0 else 1)
    # The weights are read through their strides: a loss's backward hands in expanded ones
    # (stride 0), which need no copy.
    source_index = None if source_index is None else source_index.contiguous()
    dot_index = None if dot_index is None else dot_index.contiguous()

    def pointer(tensor):  # an empty slice's address may lie past its allocation: never passed
        return dummy if tensor is None or tensor.numel() == 0 else tensor

    def stride(tensor):
        return 0 if tensor is None else tensor.stride(0)

    for tensor in (sources, accumulator, out, dot_with):
        if tensor is not None and tensor.stride(-1) != 1:
            raise ValueError("combine_rows needs rows with unit column stride")
    launch_jit(
        _combine_rows_kernel, (rows,),
        pointer(out), pointer(accumulator), pointer(weight), pointer(sources), pointer(source_index),
        pointer(source_weight), pointer(offsets), pointer(scale), pointer(dot_with), pointer(dot_index),
        pointer(dots), width, sources.shape[0], stride(out), stride(accumulator), sources.stride(0),
        stride(dot_with), stride(weight) if weight_kind == 1 else 0, stride(source_weight),
        HAS_OUT=out is not None, HAS_ACCUMULATOR=accumulator is not None, WEIGHT=weight_kind,
        HAS_SOURCE_WEIGHT=source_weight is not None, ONE_ENTRY_PER_ROW=entry_rows is None,
        INDEXED=source_index is not None, HAS_DOTS=dot_with is not None, DOT_INDEXED=dot_index is not None,
        BLOCK_C=min(_MAX_BLOCK, triton.next_power_of_2(width)), num_warps=4,
    )
    return dots
