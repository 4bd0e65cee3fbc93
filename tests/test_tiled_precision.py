"""The tiled PyTorch backend's softmax statistics at large logits, in fp32 (``hf_infcl.ops.tiled``).

At a logit scale of 100 the log-sum-exps are near 100, where an fp32 number is off by up to 4e-6,
and the backward's probabilities exp(z - lse) of a whole row (column) would all be off by that
factor. The inputs here are small integers, so every fp32 logit is exact and what is measured is
the statistics' own rounding: they must equal float64's well below fp32's resolution at their
size, each row's (column's) probabilities must sum to 1 as closely, and the gradients must follow.
"""

from __future__ import annotations

import pytest
import torch

from hf_infcl import TorchTiles, contrastive_loss
from hf_infcl.ops.spec import StatsSpec

SCALE = 0.5
SEEDS = [0, 1, 2]
TILES = TorchTiles(16, 16)  # several tiles per row and per column: their merges are measured too


def exact_logit_inputs(seed: int, m: int = 40, k: int = 48, c: int = 16):
    """fp32 rows and keys of small integers around one shared direction, the first m keys near
    their rows: the dot products (about 150) and the logits (about 75) are exact in fp32."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randint(2, 5, (c,), generator=generator)
    queries = (base + torch.randint(-1, 2, (m, c), generator=generator)).float()
    keys = (base + torch.randint(-1, 2, (k, c), generator=generator)).float()
    keys[:m] = queries + torch.randint(-1, 2, (m, c), generator=generator)
    return queries, keys


def float64_logits(queries, keys):
    logits = SCALE * queries.double() @ keys.double().T
    assert logits.min() > 32, "the logits must be large for the test to measure anything"
    return logits


@pytest.mark.parametrize("seed", SEEDS)
def test_softmax_statistics_of_large_logits_equal_float64s(seed):
    queries, keys = exact_logit_inputs(seed)
    spec = StatsSpec("softmax", columns=True, precision="ieee")
    row_stat, col_stat = TILES.forward_block(spec, queries, keys, torch.tensor(SCALE), None, None)
    logits = float64_logits(queries, keys)
    assert (row_stat.double() - logits.logsumexp(dim=1)).abs().max() < 1e-6
    assert (col_stat.double() - logits.logsumexp(dim=0)).abs().max() < 1e-6


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("direction", ["rows", "columns"])
def test_probabilities_of_large_logits_sum_to_one(seed, direction):
    """The backward's probabilities from the forward's statistics: a row's in the row sums of G
    (row weights 1), a column's in the key gradient's extra coordinate (column weights 1, and a
    coordinate that is 1 in every query, 0 in every key, so the logits are unchanged)."""
    queries, keys = exact_logit_inputs(seed)
    queries = torch.cat([queries, torch.ones(len(queries), 1)], dim=1)
    keys = torch.cat([keys, torch.zeros(len(keys), 1)], dim=1)
    (m, c), k = queries.shape, keys.shape[0]
    spec = StatsSpec("softmax", columns=True, precision="ieee")
    scale = torch.tensor(SCALE)
    row_stat, col_stat = TILES.forward_block(spec, queries, keys, scale, None, None)
    rows = direction == "rows"
    row_weight, col_weight = (torch.ones(m), torch.zeros(k)) if rows else (torch.zeros(m), torch.ones(k))
    grad_queries, grad_keys = torch.zeros(m, c), torch.zeros(k, c)
    row_sums = TILES.backward_block(spec, queries, keys, scale, None, None, row_stat, col_stat, row_weight,
                                    col_weight, grad_queries, grad_keys)
    sums = row_sums if rows else grad_keys[:, -1]
    assert (sums.double() - 1).abs().max() < 1e-6


@pytest.mark.parametrize("seed", SEEDS)
def test_fp32_gradients_at_large_logits_follow_float64(seed):
    """The asymmetric loss (GIST's): a row's probabilities all off by one factor leave a gradient
    along the keys' shared direction that the exact one does not have."""
    queries, keys = exact_logit_inputs(seed)
    results = []
    for dtype, backend in ((torch.float32, "torch"), (torch.float64, "reference")):
        q = queries.to(dtype, copy=True).requires_grad_(True)
        k = keys.to(dtype, copy=True).requires_grad_(True)
        loss = contrastive_loss(q, k, SCALE, symmetric=False, backend=backend)
        loss.backward()
        results.append((loss.detach().double(), q.grad.double(), k.grad.double()))
    (loss, grad_q, grad_k), (loss64, grad_q64, grad_k64) = results
    float64_logits(queries, keys)
    torch.testing.assert_close(loss, loss64, rtol=1e-6, atol=0)
    for grad, grad64 in ((grad_q, grad_q64), (grad_k, grad_k64)):
        assert (grad - grad64).norm() / grad64.norm() < 1.5e-6
