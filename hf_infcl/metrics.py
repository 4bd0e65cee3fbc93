"""Retrieval metrics: recall@k and the mean reciprocal rank, block by block.

This is the one implementation behind every retrieval figure hf_infcl reports: the evaluation of
:class:`~hf_infcl.InfCLTrainer` (``eval_<direction>_recall@k`` / ``_mrr``), its in-batch training
accuracy, :func:`retrieval_recalls` and the examples' before/after figures. Whoever reports
them, the same embeddings give the same numbers.

Relevance is given by integer ids: candidate j answers query i when ``key_ids[j] ==
query_ids[i]`` (duplicate captions, several words defined by one gloss, a document twice: any of
them is a right answer). Without ids, key i is the only right answer of query i, and keys past the
number of queries are negatives of every query.

**Tie rule.** The rank of a query is the number of *irrelevant* candidates that score **at least
as high** as its best-scoring relevant candidate: ties are counted against the query. This is
the conservative choice: a model that gives every candidate the same score ranks each relevant
candidate below all irrelevant ones, and scores recall@1 = 0 (not 1). NaN scores count as
``-inf``.

**Hits in the Trainer's evaluation.** Row i's positive is key i; a retrieved key is a hit when it
is the positive or shares the row's group: the ``group_column``'s ids when it is given (the five
captions of one COCO image), else the keys whose inputs are identical to the positive's (a caption
repeated across rows: its copies score exactly as the positive does, and no model could rank it
above them). The ids of identical inputs are :func:`same_input_ids` of :func:`input_fingerprints`.
Keys of other groups that tie with the positive still count against it.

Memory is ``block_rows x len(keys)`` similarities at a time, never ``len(queries) x len(keys)``.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .ops.options import check_positive_int

__all__ = ["RECALL_AT", "embeddings_by_width", "input_fingerprints", "relevant_ranks", "retrieval_metrics",
           "retrieval_recalls", "same_input_ids"]

RECALL_AT = (1, 5, 10)


def embeddings_by_width(queries: torch.Tensor, keys: torch.Tensor, widths=()):
    """``(name prefix, queries, keys)``: the whole embeddings (``""``), then for each Matryoshka
    width their prefixes of that width, L2-normalised (``"dim64_"``, ...): what each width serves,
    named as its metrics are. One width at a time, each normalised once."""
    yield "", queries, keys
    for width in widths:
        yield f"dim{width}_", F.normalize(queries[:, :width], dim=1), F.normalize(keys[:, :width], dim=1)


def _ids(ids, count, name, device):
    if ids is None:
        return torch.arange(count, device=device)
    ids = torch.as_tensor(ids, device=device)
    if ids.shape != (count,):
        raise ValueError(f"{name} must hold one id per embedding ({count}), got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be integer ids, got {ids.dtype}")
    return ids


@torch.no_grad()
def relevant_ranks(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_ids: torch.Tensor | None = None,
    key_ids: torch.Tensor | None = None,
    *,
    block_rows: int = 1024,
) -> torch.Tensor:
    """0-based rank of each query's best-scoring relevant key: ``[len(queries)]`` int64.

    Scores are dot products in fp32. The rank counts the irrelevant keys scoring at least as high
    as the best relevant key (ties count against the query; see the module docstring).

    Args:
        queries: ``[m, d]`` query embeddings.
        keys: ``[n, d]`` candidate embeddings.
        query_ids, key_ids: ``[m]`` and ``[n]`` integer ids, given together; key j is relevant to
            query i when their ids are equal. None: key i is the one relevant key of query i
            (needs ``n >= m``).
        block_rows: queries scored at a time (memory ``block_rows x n``).
    """
    if queries.ndim != 2 or keys.ndim != 2:
        raise ValueError(f"queries and keys must be 2-d, got shapes {tuple(queries.shape)} and "
                         f"{tuple(keys.shape)}")
    if queries.shape[1] != keys.shape[1]:
        raise ValueError(f"queries and keys must have the same width, got {queries.shape[1]} and "
                         f"{keys.shape[1]}")
    if (query_ids is None) != (key_ids is None):
        raise ValueError("give query_ids and key_ids together (or neither)")
    if query_ids is None and keys.shape[0] < queries.shape[0]:
        raise ValueError(f"without ids, key i answers query i: need at least {queries.shape[0]} keys, "
                         f"got {keys.shape[0]}")
    check_positive_int("block_rows", block_rows)
    device = keys.device
    query_ids = _ids(query_ids, queries.shape[0], "query_ids", device)
    key_ids = _ids(key_ids, keys.shape[0], "key_ids", device)
    keys = keys.float()
    ranks = []
    for start in range(0, queries.shape[0], block_rows):
        scores = queries[start : start + block_rows].to(device=device, dtype=torch.float32) @ keys.T
        scores = scores.masked_fill(scores.isnan(), float("-inf"))
        relevant = query_ids[start : start + block_rows, None] == key_ids[None, :]
        if not bool(relevant.any(dim=1).all()):
            raise ValueError("every query needs at least one relevant key (a key with its id)")
        best = scores.masked_fill(~relevant, float("-inf")).amax(dim=1)
        ranks.append(((scores >= best[:, None]) & ~relevant).sum(dim=1))
    if not ranks:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(ranks)


def retrieval_metrics(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_ids: torch.Tensor | None = None,
    key_ids: torch.Tensor | None = None,
    *,
    ks=RECALL_AT,
    block_rows: int = 1024,
    prefix: str = "",
) -> dict[str, float]:
    """``{prefix}recall@k`` for each k and ``{prefix}mrr``, as floats (see :func:`relevant_ranks`).

    recall@k: the share of queries whose best relevant key ranks in the top k; mrr: the mean of
    ``1 / (rank + 1)``.
    """
    if queries.shape[0] == 0:
        raise ValueError("retrieval metrics need at least one query")
    rank = relevant_ranks(queries, keys, query_ids, key_ids, block_rows=block_rows)
    metrics = {f"{prefix}recall@{k}": float((rank < k).double().mean()) for k in ks}
    metrics[f"{prefix}mrr"] = float((1.0 / (rank.double() + 1)).mean())
    return metrics


def retrieval_recalls(rows: torch.Tensor, keys: torch.Tensor, groups: torch.Tensor | None = None,
                      ks=RECALL_AT, block_rows: int = 1024) -> dict[int, float]:
    """Recall@k of retrieving key i for row i among all keys: ``{k: recall}``.

    A thin view of :func:`retrieval_metrics`, the one implementation the evaluation and the
    examples share: with ``groups``, every key of the row's group is a right answer; ties with the
    best right answer count against the row. Memory is ``block_rows x len(keys)``.
    """
    if rows.shape[0] != keys.shape[0]:
        raise ValueError(f"rows ({rows.shape[0]}) and keys ({keys.shape[0]}) must pair one to one")
    metrics = retrieval_metrics(rows, keys, groups, groups, ks=ks, block_rows=block_rows)
    return {k: metrics[f"recall@{k}"] for k in ks}


# Fingerprints: FINGERPRINT_WORDS sums mod a prime of each row's bytes times random weights. Integer
# sums are exact in any order, so a row's fingerprint does not depend on its batch; two different
# rows collide with probability FINGERPRINT_PRIME ** -FINGERPRINT_WORDS (about 2**-62).
FINGERPRINT_PRIME = 2**31 - 1
FINGERPRINT_WORDS = 2
_WEIGHT_BLOCK = 4096  # weights are drawn per block of byte positions, so a longer row extends a shorter's
_COLUMNS_AT_A_TIME = 2**13  # bytes x weights < 2**39: sums of 2**13 of them stay far below 2**63


@functools.lru_cache(maxsize=64)
def _position_weights(name: str, count: int, device: torch.device) -> torch.Tensor:
    """[count, FINGERPRINT_WORDS] weights in [0, prime) of the byte positions of input ``name``."""
    blocks = []
    for block in range(-(-count // _WEIGHT_BLOCK)):
        generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{block}".encode()))
        blocks.append(torch.randint(0, FINGERPRINT_PRIME, (_WEIGHT_BLOCK, FINGERPRINT_WORDS),
                                    generator=generator))
    return torch.cat(blocks)[:count].to(device)


def _without_padding(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The positions ``mask`` keeps moved to the front of each row (in order), the rest zeroed:
    the same for a row however it was padded (left or right, to any length)."""
    keep = mask != 0
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    trailing = (1,) * (value.ndim - 2)
    value = value.gather(1, order.view(*order.shape, *trailing).expand_as(value))
    kept = keep.gather(1, order).view(*keep.shape, *trailing)
    return torch.where(kept, value, torch.zeros((), dtype=value.dtype, device=value.device))


@torch.no_grad()
def input_fingerprints(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[b, FINGERPRINT_WORDS]`` int64 fingerprints of the rows of one tower's inputs (e.g.
    ``input_ids`` and ``attention_mask``, or ``pixel_values``), on their device.

    Rows with identical inputs get equal fingerprints, whatever batch they come from; different
    rows get different ones but with probability about 2**-62 per pair. An input named
    ``*attention_mask`` (``[b, L]``) drops the positions it masks from every input of the same
    leading shape, so padding to a batch's longest row (on either side) does not matter.
    Non-tensor entries are ignored.
    """
    tensors = {name: value for name, value in sorted(inputs.items()) if isinstance(value, torch.Tensor)}
    if not tensors:
        raise ValueError("input_fingerprints needs at least one tensor input")
    rows = next(iter(tensors.values())).shape[0]
    masks = [value for name, value in tensors.items() if name.endswith("attention_mask") and value.ndim == 2]
    fingerprint = None
    for name, value in tensors.items():
        if value.ndim == 0 or value.shape[0] != rows:
            raise ValueError(f"input {name!r} has shape {tuple(value.shape)}; every input needs {rows} rows")
        mask = next((m for m in masks if value.shape[:2] == m.shape), None)
        if mask is not None:
            value = _without_padding(value, mask)
        row_bytes = value.reshape(rows, -1).contiguous().view(torch.uint8)
        weights = _position_weights(name, row_bytes.shape[1], row_bytes.device)
        if fingerprint is None:
            fingerprint = torch.zeros(rows, FINGERPRINT_WORDS, dtype=torch.long, device=row_bytes.device)
        for start in range(0, row_bytes.shape[1], _COLUMNS_AT_A_TIME):
            columns = slice(start, start + _COLUMNS_AT_A_TIME)
            part = (row_bytes[:, columns].long().unsqueeze(-1) * weights[columns]).sum(dim=1)
            fingerprint = (fingerprint + part) % FINGERPRINT_PRIME
    return fingerprint


def same_input_ids(fingerprints: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64 ids from ``[n, w]`` fingerprints (:func:`input_fingerprints` of every row):
    rows with equal fingerprints share an id. Give them as the keys' ids of :func:`relevant_ranks`
    (and the rows' ids, row i's being its positive's) to count the copies of a positive as hits."""
    return torch.unique(fingerprints, dim=0, return_inverse=True)[1]
