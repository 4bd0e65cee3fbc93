"""``hf_infcl.ops.layer_norm``: LayerNorm's weight and bias gradients from the Triton kernel
inside a gradient-cached step's CUDA graphs. The kernel itself is checked against float64 on the
CPU interpreter (``tests/helpers/triton_interpreted.py``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from hf_infcl.ops import layer_norm
from hf_infcl.ops.layer_norm import split_affine_grads

OURS = "_LayerNormSplitGradsBackward"


def test_the_context_is_a_no_op_without_cuda_triton_or_with_the_switch_off(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(split_affine_grads(), contextlib.nullcontext)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(layer_norm, "triton_importable", lambda: False)
    assert isinstance(split_affine_grads(), contextlib.nullcontext)
    monkeypatch.setattr(layer_norm, "triton_importable", lambda: True)
    assert not isinstance(split_affine_grads(), contextlib.nullcontext)
    monkeypatch.setenv("HF_INFCL_LAYER_NORM_GRADS", "0")
    assert isinstance(split_affine_grads(), contextlib.nullcontext)


def test_cpu_calls_pass_through_the_mode_unchanged():
    """The mode only takes CUDA LayerNorms: on the CPU every call, LayerNorm included, is PyTorch's."""
    gen = torch.Generator().manual_seed(3)
    norm = torch.nn.LayerNorm(6)
    x = torch.randn(4, 6, generator=gen, requires_grad=True)
    with layer_norm._SplitAffineGrads():
        out = norm(x)
        other = torch.tanh(x) * 2
    assert type(out.grad_fn).__name__ == "NativeLayerNormBackward0"
    assert torch.equal(out, norm(x)) and torch.equal(other, torch.tanh(x) * 2)


def test_layer_norm_arguments_take_an_int_shape_and_keywords():
    x = torch.zeros(2, 3)
    assert layer_norm._layer_norm_arguments(x, 3) == (x, (3,), None, None, 1e-5)
    assert layer_norm._layer_norm_arguments(x, [3], eps=0.1)[1:] == ((3,), None, None, 0.1)


def float64_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.double() - exact).norm() / exact.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["fp32", "bf16-autocast", "bf16-model"])
def test_routed_layer_norm_keeps_outputs_and_input_grads_and_matches_float64(setting):
    """CUDA LayerNorms inside the mode, at a chunk's row count (256 texts of 77 tokens): the output
    (dtype included) and the input gradient are PyTorch's, bit for bit; the weight and bias
    gradients are within PyTorch's own rounding of float64 autograd's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(11)
    dtype = torch.bfloat16 if setting == "bf16-model" else torch.float32
    norm = torch.nn.LayerNorm(512, device="cuda", dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2, generator=gen)
        norm.bias.normal_(0.0, 0.2, generator=gen)
    x = (torch.randn(256, 77, 512, device="cuda", generator=gen) * 2 + 0.5).to(dtype)
    grad = torch.randn(256, 77, 512, device="cuda", generator=gen)
    def autocast():
        return torch.autocast("cuda", torch.bfloat16, enabled=setting == "bf16-autocast")

    def run(mode):
        x_in = x.clone().requires_grad_()
        with mode, autocast():
            out = norm(x_in)
        grads = torch.autograd.grad(out, (x_in, norm.weight, norm.bias), grad.to(out.dtype))
        return out, grads

    ours, our_grads = run(split_affine_grads())
    theirs, their_grads = run(contextlib.nullcontext())
    assert type(ours.grad_fn).__name__ == OURS and type(theirs.grad_fn).__name__ != OURS
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert torch.equal(our_grads[0], their_grads[0])

    exact_params = [param.detach().double().requires_grad_() for param in (norm.weight, norm.bias)]
    exact_out = F.layer_norm(x.double(), (512,), *exact_params, norm.eps)
    exact = torch.autograd.grad(exact_out, exact_params, grad.to(theirs.dtype).double())
    for ours_grad, their_grad, exact_grad in zip(our_grads[1:], their_grads[1:], exact):
        assert ours_grad.dtype == their_grad.dtype == dtype
        # both round to the parameter's dtype at the end; fp32 sums differ only in their order
        assert float64_error(ours_grad, exact_grad) <= 2 * float64_error(their_grad, exact_grad) + 1e-6


@pytest.mark.gpu
def test_layer_norms_the_kernel_does_not_take_stay_pytorchs():
    """float64, more rows than PyTorch's own split threshold, no weight, no gradient wanted."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    weight = torch.ones(8, device="cuda", requires_grad=True)
    cases = {
        "float64": (torch.randn(4, 8, device="cuda", dtype=torch.float64), weight.double()),
        "many rows": (torch.randn(layer_norm.PYTORCH_SPLITS_ROWS + 1, 8, device="cuda"), weight),
        "no weight": (torch.randn(4, 8, device="cuda"), None),
    }
    with split_affine_grads():
        assert type(F.layer_norm(torch.randn(4, 8, device="cuda"), (8,), weight).grad_fn).__name__ == OURS
        for name, (x, w) in cases.items():
            out = F.layer_norm(x.requires_grad_(), (8,), w)
            assert type(out.grad_fn).__name__ != OURS, name
        with torch.no_grad():
            assert F.layer_norm(torch.randn(4, 8, device="cuda"), (8,), weight).grad_fn is None
