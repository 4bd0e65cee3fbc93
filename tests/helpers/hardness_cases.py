"""Inputs of the hardness offset (docs/contract.md, "Hardness offset") for the tests of the
functional on every backend (tests/test_loss.py, tests/helpers/triton_interpreted.py)."""

from __future__ import annotations

import torch


def with_hardness(case, mode, strength, seed):
    """``case`` (a dict with ``queries``, ``keys`` and ``positives``, None for the diagonal) with
    a hardness offset under ``case["hardness"]``, as ``contrastive_loss``'s keyword arguments:
    row ids 0..m-1, each positive owned by its row, the other keys by random rows, by rows that
    are not here (ids m, m + 1: another process's) or by nobody (-1)."""
    gen = torch.Generator().manual_seed(seed)
    m, k = case["queries"].shape[0], case["keys"].shape[0]
    owners = torch.randint(-1, m + 2, (k,), generator=gen)
    positives = case["positives"] if case["positives"] is not None else torch.arange(m)
    owners[positives] = torch.arange(m)
    return dict(case, hardness=dict(hardness_mode=mode, hardness_strength=strength, query_ids=torch.arange(m),
                                    key_owners=owners))
