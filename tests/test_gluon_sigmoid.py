"""The Gluon kernel of the sigmoid loss's one pass (``hf_infcl.ops.triton.gluon_sigmoid``).

GPU (Hopper): the kernel's G and row sums against float64 on the same rounded operands, with
the G buffer poisoned with NaN (every entry of the tile written, none past a row's 16-byte
padding, which only zeros may reach); the loss's
default route on such a GPU goes through the kernel and matches float64; asking for the kernel
where it cannot run is a clear error. Gluon kernels do not run under ``TRITON_INTERPRET``: on CPU
(CI) these skip, and ``tests/helpers/triton_interpreted.py`` checks the refusal and the fallback.
"""

from __future__ import annotations

import pytest
import torch

from hf_infcl import contrastive_loss
from hf_infcl.ops.triton import TritonBlocks, gluon_sigmoid
from tests.helpers.gluon import hopper_only, loss_and_grads, paired_rows, unit_rows

# (rows, keys, c, dtype, scaled G): whole and partial 128 x 128 tiles, widths that are and are not
# multiples of the kernel's 64-wide chunks, fp16 with G stored divided by a scale.
TILE_CASES = [
    (1024, 2048, 768, torch.bfloat16, False),
    (1000, 3000, 200, torch.bfloat16, False),
    (777, 2331, 72, torch.float16, True),
    (4096, 8192, 512, torch.float16, True),
    (130, 129, 1024, torch.bfloat16, False),
    (1, 5, 8, torch.bfloat16, False),
]


def _tile_id(case):
    m, k, c, dtype, scaled = case
    return f"m{m}-k{k}-c{c}-{str(dtype)[6:]}" + ("-scaled" if scaled else "")


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("case", TILE_CASES, ids=[_tile_id(c) for c in TILE_CASES])
def test_gpu_sigmoid_tile_matches_float64(case):
    m, k, c, dtype, scaled = case
    seed, gen, queries, keys = unit_rows(m, k, c, dtype)
    # Logits over both signs and far into the tails (scale 10-30, bias -10..0).
    scale = 10.0 + 20.0 * torch.rand((), device="cuda", generator=gen)
    bias = -10.0 * torch.rand((), device="cuda", generator=gen)
    g_scale = 0.25 + torch.rand((), device="cuda", generator=gen) if scaled else None
    # A row stride past the tile's keys: what lies beyond them must stay untouched.
    ld = -(-(k + 8) // 8) * 8
    buffer = torch.full((m, ld), float("nan"), dtype=dtype, device="cuda")
    g = buffer[:, :k]
    row_sums = torch.rand(m, device="cuda", generator=gen)
    softplus_sums = torch.rand(m, device="cuda", generator=gen)
    start_rows, start_softplus = row_sums.double(), softplus_sums.double()
    gluon_sigmoid.sigmoid_tile(queries, keys, g, row_sums, softplus_sums, scale, bias,
                               None if g_scale is None else 1.0 / g_scale)

    z = scale.double() * (queries.double() @ keys.double().T) + bias.double()
    sigmoid, softplus = torch.sigmoid(z), torch.nn.functional.softplus(z)
    expected_g = sigmoid / (1.0 if g_scale is None else g_scale.double())
    assert torch.isfinite(g).all(), (seed, "an entry of the tile was not written")
    # TMA stores whole 16-byte units: a row's padding up to that boundary may hold zeros, nothing else.
    aligned_k = -(-k // 8) * 8
    padding = buffer[:, k:aligned_k]
    assert (torch.isnan(padding) | (padding == 0)).all(), (seed, "the padding past a row's last key got G")
    assert torch.isnan(buffer[:, aligned_k:]).all(), (seed, "written past the padding")
    # G is rounded to the operands' dtype once: half an ulp, norm-wise.
    g_error = float((g.double() - expected_g).norm() / expected_g.norm())
    assert g_error < (4e-3 if dtype == torch.bfloat16 else 5e-4), (seed, g_error)
    # The sums are fp32 from exact fp32 dot products: far tighter than the inputs' rounding.
    for got, start, expected in ((row_sums, start_rows, sigmoid), (softplus_sums, start_softplus, softplus)):
        error = float(((got.double() - start - expected.sum(1)).abs() / expected.sum(1)).max())
        assert error < 2e-5, (seed, error)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpu_default_sigmoid_route_is_the_gluon_kernel(monkeypatch, dtype, reduction):
    """What a user's sigmoid loss runs on a Hopper GPU: the default backend's one pass through the
    Gluon kernel (counted), with several super-tiles, matching float64 in the loss and in every
    gradient, a learnable scale and bias included. fp32 inputs (TF32 precision) take it too, as
    their scaled fp16 copies."""
    calls = []
    kernel = gluon_sigmoid.sigmoid_tile
    monkeypatch.setattr(gluon_sigmoid, "sigmoid_tile", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    m, k, c = 3000, 5000, 256
    seed, queries, keys = paired_rows(m, k, c)

    def loss_and_grads_of(q, kk, backend, precision):
        return loss_and_grads(q, kk, backend, precision, 11.0, -9.0, loss="sigmoid", reduction=reduction)

    blocks = TritonBlocks(tile_rows=1024, tile_keys=2048, poison=True)
    got = loss_and_grads_of(queries.to(dtype), keys.to(dtype), blocks, "auto")
    assert len(calls) == 3 * 3, "the one pass did not run through the Gluon kernel"
    rounded = (queries.to(dtype).double(), keys.to(dtype).double())
    from hf_infcl.ops.tiled import TorchTiles

    expected = loss_and_grads_of(*rounded, TorchTiles(4096, 4096), "ieee")
    for name, a, b in zip(("loss", "dq", "dk", "dscale", "dbias"), got, expected):
        error = float((a - b).norm() / b.norm())
        assert error < (3e-3 if dtype == torch.float32 else 1e-2), (seed, name, error)


@pytest.mark.gpu
@hopper_only
def test_gpu_gluon_route_refuses_a_group_mask():
    """sigmoid_logits='gluon' names what it needs where it cannot run (a group mask here; the
    interpreted tests check a machine without a GPU); "auto" takes the cuBLAS route there."""
    # A gradient is wanted: the one pass (where the route matters) runs only then.
    q = torch.nn.functional.normalize(torch.randn(8, 16, device="cuda"), dim=1).bfloat16().requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(8, 16, device="cuda"), dim=1).bfloat16()
    groups = torch.arange(8, device="cuda") // 2
    scale, bias = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
    with pytest.raises(ValueError, match="sigmoid_logits='gluon' needs"):
        contrastive_loss(q, k, scale, bias, loss="sigmoid", backend=TritonBlocks(sigmoid_logits="gluon"),
                         query_groups=groups, key_groups=groups)
    loss = contrastive_loss(q, k, scale, bias, loss="sigmoid", backend=TritonBlocks(), query_groups=groups,
                            key_groups=groups)
    assert torch.isfinite(loss)
