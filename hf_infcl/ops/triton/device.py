"""What the launchers ask of the device: the interpreter switch, SM count, TMA, and the buffer
they pass for pointers a kernel does not read."""

from __future__ import annotations

import functools
import os

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

# Under TRITON_INTERPRET=1 (read once, at import) the kernels run on the CPU interpreter: one small
# fixed config each, loads upcast to fp32 before tl.dot (the interpreter's half-precision dot is
# not exact), no inline assembly.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@functools.cache
def is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Whether the GPU has the tensor memory accelerator (Hopper, compute capability 9, and later)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_aligned(tensor: torch.Tensor) -> bool:
    """Whether the copy engine can read ``tensor`` as [rows, c] blocks: 2-D, not empty, unit column
    stride, base address and row stride in bytes multiples of 16."""
    return (
        tensor.dim() == 2 and tensor.shape[0] > 0 and tensor.stride(1) == 1 and tensor.data_ptr() % 16 == 0
        and (tensor.stride(0) * tensor.element_size()) % 16 == 0
    )


def tensor_descriptor(tensor: torch.Tensor) -> TensorDescriptor | None:
    """A tensor descriptor of a [rows, c] operand where the copy engine can read it (a Hopper GPU
    or the interpreter; see :func:`tma_aligned`), else None. Its block shape is set per config
    (the gradient-tile kernel's pre-hook). The gradient-tile kernel reads its tiles faster this
    way than through pointers."""
    usable = INTERPRET or (tensor.is_cuda and _has_tma(tensor.device))
    if not (usable and tma_aligned(tensor)):
        return None
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), [16, 16])


@functools.cache
def unused_pointer(device: torch.device) -> torch.Tensor:
    """A one-element buffer of this module's own (one per device) for pointer arguments that a
    kernel specialisation never reads.

    It must not be one of the caller's tensors: the autotuner restores ``col_partial_ptr`` (and
    zeroes ``row_sums_ptr``) around every trial, i.e. it copies into whatever tensor sits in that
    slot. Passing the logit scale there made the first, tuning call bump the version counter of
    the caller's ``logit_scale`` tensor and broke its autograd graph. Its contents never matter.
    """
    return torch.empty(1, dtype=torch.float32, device=device)


def pair_pointers(has_mask: bool, hardness: int, positive_keys, key_offset: int, query_ids, key_owners,
                  hardness_strength, dummy) -> tuple:
    """(positive_ptr, key_offset, query_id_ptr, key_owner_ptr, hardness_ptr) of a launch: the
    positives serve the group mask and the hardness offset alike; ``dummy`` where nothing reads."""
    if not hardness:
        return positive_keys if has_mask else dummy, key_offset, dummy, dummy, dummy
    return positive_keys, key_offset, query_ids, key_owners, hardness_strength
