"""LayerNorm with its weight and bias gradients reduced by every SM, for small row counts.

At the row counts of a gradient-cached step's chunks (a few thousand to 64 × 1024 rows), PyTorch's
LayerNorm backward reduces the weight and bias gradients on one thread block per 32 columns (see
:mod:`.triton.layer_norm_grads`), which leaves most SMs idle, once per LayerNorm and chunk.
:func:`split_affine_grads` is a context in
which ``torch.nn.functional.layer_norm`` (what ``nn.LayerNorm`` calls) keeps PyTorch's forward
and input gradient but reduces the weight and bias gradients over the rows with the Triton
kernel. Outputs are the same; the two gradients differ from PyTorch's by the order of an fp32
sum.

The context intercepts every torch call in Python (a ``TorchFunctionMode``), which costs host
time per operation: it is meant for code that runs once and is replayed, as a CUDA graph's
capture is.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .logit_stats import triton_importable

__all__ = ["split_affine_grads"]

# Above this many rows PyTorch's own backward splits the rows over blocks: it stays in charge.
PYTORCH_SPLITS_ROWS = 64 * 1024

# The dtypes routed to the kernel, which sums in fp32: float64 LayerNorms stay PyTorch's.
ROUTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# HF_INFCL_LAYER_NORM_GRADS=0 leaves every LayerNorm to PyTorch.
ENVIRONMENT_VARIABLE = "HF_INFCL_LAYER_NORM_GRADS"


def split_affine_grads() -> contextlib.AbstractContextManager:
    """A context in which CUDA LayerNorms of at most :data:`PYTORCH_SPLITS_ROWS` rows, with a
    weight and under autograd, take their weight and bias gradients from the Triton kernel. A
    no-op context where Triton is not available or ``HF_INFCL_LAYER_NORM_GRADS=0``."""
    wanted = os.environ.get(ENVIRONMENT_VARIABLE, "1") != "0"
    if not (wanted and torch.cuda.is_available() and triton_importable()):
        return contextlib.nullcontext()
    return _SplitAffineGrads()


class _SplitAffineGrads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.layer_norm:
            try:
                call = _layer_norm_arguments(*args, **kwargs)
            except TypeError:  # arguments F.layer_norm does not take: its own error, below
                call = None
            if call is not None and _routed(*call):
                return _LayerNormSplitGrads.apply(*call)
        return func(*args, **kwargs)


def _layer_norm_arguments(input, normalized_shape, weight=None, bias=None, eps=1e-5) -> tuple:
    """``F.layer_norm``'s arguments in its order, defaults filled in, the shape as a tuple."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return input, shape, weight, bias, eps


def _routed(x, normalized_shape, weight, bias, eps) -> bool:
    """Whether this call's weight and bias gradients go to the Triton kernel: a CUDA input of
    :data:`ROUTED_DTYPES` whose trailing dimensions are ``normalized_shape``, at most
    :data:`PYTORCH_SPLITS_ROWS` rows, a weight, and a gradient wanted for the weight or the bias.
    Any other call is PyTorch's (its own errors included)."""
    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.is_cuda):
        return False
    if weight is None or x.dtype not in ROUTED_DTYPES or weight.dtype not in ROUTED_DTYPES:
        return False
    if not (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    n_shape = len(normalized_shape)
    if n_shape == 0 or x.dim() < n_shape or tuple(x.shape[x.dim() - n_shape:]) != normalized_shape:
        return False
    if any(tuple(param.shape) != normalized_shape for param in (weight, bias) if param is not None):
        return False
    rows = x.numel() // max(1, math.prod(normalized_shape))
    return 0 < rows <= PYTORCH_SPLITS_ROWS


class _LayerNormSplitGrads(torch.autograd.Function):
    """``F.layer_norm`` through ``torch.native_layer_norm``; backward: PyTorch's input gradient,
    the weight's and bias's from :func:`~.triton.layer_norm_grads.layer_norm_affine_grads`."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)  # autocast's rule for layer_norm
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        from .triton.layer_norm_grads import layer_norm_affine_grads

        x, weight, bias, mean, rstd = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad_out, x, ctx.normalized_shape, mean, rstd, weight, bias, [True, False, False])[0]
        width = weight.numel()
        grad_weight, grad_bias = layer_norm_affine_grads(x.reshape(-1, width).contiguous(),
                                                         grad_out.reshape(-1, width), mean.reshape(-1),
                                                         rstd.reshape(-1))
        grad_weight = grad_weight.view_as(weight).to(weight.dtype) if ctx.needs_input_grad[2] else None
        if bias is None or not ctx.needs_input_grad[3]:
            grad_bias = None
        else:
            grad_bias = grad_bias.view_as(bias).to(bias.dtype)
        return grad_x, None, grad_weight, grad_bias, None
