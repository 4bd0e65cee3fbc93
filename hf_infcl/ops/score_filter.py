"""The score filter's thresholds (docs/contract.md, "False negatives by score"), computed outside the
kernels from each row's positive: O(m c_g) work, [m] + [k] numbers.

    "absolute":  tau_i = g_{i,p(i)} - margin
    "relative":  tau_i = g_{i,p(i)} - |g_{i,p(i)}| * margin

with g the guide's similarity <GQ_i, GK_j>, or without a guide the model's own dot product x_ij
(detached). Key p(i) carries tau_i as its column threshold; keys that are nobody's positive carry
+inf (they have no column term). The tiles' masks (:class:`~hf_infcl.ops.spec.ScoreFilter`) are
recomputed from these in every pass, never stored.
"""

from __future__ import annotations

import torch

from .spec import StatsSpec


def thresholds(spec: StatsSpec, queries, keys, positives, guide_queries, guide_keys, combine):
    """(row thresholds [m], key thresholds [k] or None without a column statistic), in the
    accumulation dtype; ``positives`` None: p(i) = i. ``combine``: the block ops' row primitive
    (:func:`hf_infcl.ops.key_blocks.combine_rows`), which takes the positives' dot products."""
    if guide_queries is None:
        rows, columns = queries.detach(), keys.detach()
    else:
        rows, columns = guide_queries.detach(), guide_keys.detach()
    scores = combine(rows=rows.shape[0], sources=columns, source_index=positives, dot_with=rows)
    margin = spec.false_negative_margin
    if spec.false_negative_strategy == "absolute":
        row_thresholds = scores - margin
    else:
        row_thresholds = scores - scores.abs() * margin
    if not spec.columns:
        return row_thresholds, None
    key_thresholds = torch.full((keys.shape[0],), float("inf"), dtype=scores.dtype, device=scores.device)
    if positives is None:
        key_thresholds[: row_thresholds.shape[0]] = row_thresholds
    else:
        key_thresholds[positives] = row_thresholds  # positives are distinct here (loss.py checks)
    return row_thresholds, key_thresholds
