"""The tiled path never creates a tensor that grows with m * k, forward or backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_infcl import TorchTiles, contrastive_loss


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.numel() > self.largest:
                self.largest, self.op = value.numel(), func
        return out


def largest_tensor_of_step(backend, m, k, c, loss, symmetric):
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(m, c, generator=gen).requires_grad_(True)
    keys = torch.randn(k, c, generator=gen).requires_grad_(True)
    scale = torch.tensor(10.0, requires_grad=True)
    groups = torch.randint(0, 50, (m,), generator=gen), torch.randint(0, 50, (k,), generator=gen)
    with LargestTensor() as tracker:
        value = contrastive_loss(queries, keys, scale, loss=loss, symmetric=symmetric,
                                 query_groups=groups[0], key_groups=groups[1], backend=backend)
        value.backward()
    assert queries.grad is not None and keys.grad is not None and scale.grad is not None
    return tracker


@pytest.mark.parametrize("loss,symmetric", [("softmax", True), ("sigmoid", True)], ids=["softmax", "sigmoid"])
def test_tiled_path_never_allocates_m_by_k(loss, symmetric):
    m = k = 4096
    tiles = TorchTiles()  # the default tile sizes
    tracker = largest_tensor_of_step(tiles, m, k, 16, loss, symmetric)
    assert tracker.largest <= tiles.tile_rows * tiles.tile_keys, (tracker.largest, tracker.op)
    assert tracker.largest < m * k


def test_tracker_sees_the_materialised_matrix():
    """The probe itself can fail: the reference backend does build the m x k matrix."""
    tracker = largest_tensor_of_step("reference", 512, 512, 16, "softmax", True)
    assert tracker.largest >= 512 * 512
