"""What the GPU tests of the Gluon kernels share: the skip marker for machines that cannot run them,
and their random operands."""

from __future__ import annotations

import pytest
import torch


def _hopper_with_gluon() -> bool:
    from hf_infcl.ops.triton import gluon_sigmoid

    if not (torch.cuda.is_available() and gluon_sigmoid.available()):
        return False
    return torch.cuda.get_device_capability()[0] == 9


hopper_only = pytest.mark.skipif(not _hopper_with_gluon(),
                                 reason="needs a Hopper GPU and a Triton with Gluon")


def unit_rows(m: int, k: int, c: int, dtype: torch.dtype):
    """(seed, generator, queries [m, c], keys [k, c]): L2-normalised random rows in ``dtype`` on the
    GPU, from a fresh seed (returned, for the failure message)."""
    seed = int(torch.randint(0, 2**31, ()).item())
    generator = torch.Generator(device="cuda").manual_seed(seed)
    queries, keys = (torch.nn.functional.normalize(torch.randn(n, c, device="cuda", generator=generator),
                                                   dim=1).to(dtype) for n in (m, k))
    return seed, generator, queries, keys


def spiked_rows(m: int, k: int, c: int, dtype: torch.dtype, spike: float = 4.0):
    """(seed, generator, queries [m, c], keys [k, c]) as :func:`unit_rows` gives them, with every
    16th query (one per 16 rows, so in every warp's rows of a tile) ``spike`` times its key: at
    CLIP's scales that row's logit with its key lies hundreds above every logit of the other keys
    in its warp's rows, where a shift shared across rows would underflow their terms."""
    seed, generator, queries, keys = unit_rows(m, k, c, dtype)
    spiked = torch.arange(0, min(m, k), 16, device="cuda")
    queries[spiked] = (spike * keys[spiked].float()).to(dtype)
    return seed, generator, queries, keys


def paired_rows(m: int, k: int, c: int):
    """(seed, queries [m, c], keys [k, c]) in fp32 on the GPU, L2-normalised, each of the first m
    keys pulled towards its query (the positives stand out, as a loss sees them)."""
    seed, _, queries, keys = unit_rows(m, k, c, torch.float32)
    keys[:m] += 0.5 * queries
    return seed, queries, keys


def loss_and_grads(queries, keys, backend, precision, scale: float, bias: float | None = None, **options):
    """[loss, d queries, d keys, d scale(, d bias)] in float64 of ``contrastive_loss`` with a learnable
    scale (and bias), accumulated in float64 for float64 inputs and in fp32 otherwise."""
    from hf_infcl import contrastive_loss

    queries, keys = queries.clone().requires_grad_(True), keys.clone().requires_grad_(True)
    dtype = torch.float64 if queries.dtype == torch.float64 else torch.float32
    scalars = [torch.tensor(value, dtype=dtype, device="cuda", requires_grad=True)
               for value in (scale, bias) if value is not None]
    loss = contrastive_loss(queries, keys, *scalars, backend=backend, precision=precision, **options)
    grads = torch.autograd.grad(loss, (queries, keys, *scalars))
    return [loss.detach().double()] + [grad.double() for grad in grads]
