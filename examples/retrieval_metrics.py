"""Retrieval metrics the examples report: recall@k, MRR and zero-shot top-1 accuracy.

Relevance is given by integer ids rather than by position, so that duplicate texts count: a
query is answered correctly by *any* candidate whose id equals the query's (two held-out digits
of the same class may share the caption "a scan of a handwritten seven").
"""

from __future__ import annotations

import torch


def first_relevant_rank(similarity: torch.Tensor, query_ids: torch.Tensor, candidate_ids: torch.Tensor):
    """0-based rank of the best-ranked relevant candidate of every query ([queries] int64).

    Ties with the relevant candidate are counted against it (a constant model scores zero).
    """
    relevant = query_ids[:, None] == candidate_ids[None, :]
    if not bool(relevant.any(dim=1).all()):
        raise ValueError("every query needs at least one relevant candidate")
    best_relevant = similarity.masked_fill(~relevant, float("-inf")).max(dim=1).values
    # Irrelevant candidates scoring at least as high as the best relevant one rank above it.
    return ((similarity >= best_relevant[:, None]) & ~relevant).sum(dim=1)


def retrieval_metrics(similarity, query_ids, candidate_ids, ks=(1, 5, 10), prefix=""):
    """recall@k for each k and the mean reciprocal rank, as plain floats."""
    rank = first_relevant_rank(similarity.float(), query_ids, candidate_ids)
    metrics = {f"{prefix}recall@{k}": float((rank < k).float().mean()) for k in ks}
    metrics[f"{prefix}mrr"] = float((1.0 / (rank.float() + 1)).mean())
    return metrics


def zero_shot_accuracy(image_embeds, class_text_embeds, labels) -> float:
    """Top-1 accuracy of classifying each image as its most similar class embedding."""
    predictions = (image_embeds.float() @ class_text_embeds.float().T).argmax(dim=1)
    return float((predictions == labels).float().mean())


@torch.no_grad()
def embed_texts(tokenizer, texts, encode, batch_size, max_length, device) -> torch.Tensor:
    """fp32 embeddings [len(texts), d] of ``encode(input_ids=..., attention_mask=...)``, in batches."""
    out = []
    for start in range(0, len(texts), batch_size):
        tok = tokenizer(
            texts[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        ).to(device)
        out.append(encode(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]).float())
    return torch.cat(out)
