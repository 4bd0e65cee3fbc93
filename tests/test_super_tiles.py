"""The super-tile walk of the Triton backward (``hf_infcl.ops.triton.super_tiles.walk``), on CPU with
a route whose G is a known matrix: G K and G^T Q over every super-tile against float64 products,
whatever the tile shape; each row panel's and key tile's views made once, and the first super-tile
written after only its own views were made (the rest were made before it kept the GPU idle), with
the one-process value check between those views and that first launch."""

from __future__ import annotations

import random

import pytest
import torch

from hf_infcl.ops import value_check
from hf_infcl.ops.triton import super_tiles
from hf_infcl.ops.triton.operands import Operands


class RecordingRoute:
    """G[r0:r1, k0:k1] of a fixed matrix ``g``; records when each view is made and each write."""

    g_alone = True
    segments = None

    def __init__(self, g: torch.Tensor, events: list):
        self.g, self.events = g, events

    def scratch(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def row_panel(self, start, end):
        self.events.append(("row_panel", start))
        return start, end

    def key_tile(self, start, end):
        self.events.append(("key_tile", start))
        return start, end

    def write(self, row_panel, key_tile, g):
        self.events.append(("write", row_panel[0], key_tile[0]))
        g.copy_(self.g[row_panel[0]:row_panel[1], key_tile[0]:key_tile[1]])


@pytest.mark.parametrize("m,k,tile",
                         [(50, 70, (16, 24)), (50, 70, (50, 70)), (33, 9, (8, 4)), (7, 40, (64, 13))],
                         ids=["m50-k70-t16x24", "m50-k70-one-tile", "m33-k9-t8x4", "m7-k40-t64x13"])
def test_the_walk_adds_every_super_tile_s_products_and_makes_each_view_once_when_first_needed(m, k, tile):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    queries, keys = torch.randn(m, 12, generator=gen), torch.randn(k, 12, generator=gen)
    g = torch.randn(m, k, generator=gen)
    grad_queries, grad_keys = torch.randn(m, 12, generator=gen), torch.randn(k, 12, generator=gen)
    expected_q = grad_queries.double() + g.double() @ keys.double()
    expected_k = grad_keys.double() + g.double().T @ queries.double()
    events = []
    checked = []
    token = value_check._PENDING.set(lambda: (checked.append(len(events)), events.append(("check",))))
    try:
        super_tiles.walk(RecordingRoute(g, events), Operands(queries, keys, None, None, None), grad_queries,
                         grad_keys, None, tile, "ieee", poison=True)
    finally:
        value_check._PENDING.reset(token)
    torch.testing.assert_close(grad_queries.double(), expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_keys.double(), expected_k, rtol=1e-5, atol=1e-5)
    row_starts, key_starts = list(range(0, m, tile[0])), list(range(0, k, tile[1]))
    made = [event for event in events if event[0] in ("row_panel", "key_tile")]
    assert sorted(made) == sorted([("row_panel", r) for r in row_starts]
                                  + [("key_tile", c) for c in key_starts])
    writes = [event for event in events if event[0] == "write"]
    assert writes == [("write", r, c) for r in row_starts for c in key_starts]
    # the first launch waits for its own views and the check only
    assert events[:4] == [("row_panel", 0), ("key_tile", 0), ("check",), ("write", 0, 0)]
    assert checked == [2]
    for index, event in enumerate(events):  # every view made before its first use, and no earlier
        if event[0] == "write":
            assert ("row_panel", event[1]) in events[:index] and ("key_tile", event[2]) in events[:index]
        elif event[0] in ("row_panel", "key_tile") and event[1]:
            first_use = ("write", event[1], 0) if event[0] == "row_panel" else ("write", 0, event[1])
            assert events[index + 1] == first_use
