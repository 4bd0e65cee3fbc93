"""Metrics the examples report: retrieval recall@k and MRR, and zero-shot top-1 accuracy.

Retrieval is ``hf_infcl.metrics.retrieval_metrics``, the one implementation that
``InfCLTrainer``'s evaluation uses too (same tie rule: ties with the relevant candidate count
against it, so a constant model scores zero). Relevance is given by integer ids rather than by
position, so that duplicate texts count: a query is answered correctly by *any* candidate whose
id equals the query's (two held-out digits of the same class may share the caption "a scan of a
handwritten seven").
"""

from __future__ import annotations

import torch

from hf_infcl.metrics import embeddings_by_width, relevant_ranks, retrieval_metrics

__all__ = ["embed_texts", "relevant_ranks", "retrieval_metrics", "retrieval_metrics_at_widths",
           "zero_shot_accuracy"]


def retrieval_metrics_at_widths(queries, docs, query_ids, doc_ids, widths, ks=(1, 10)) -> dict[str, float]:
    """``retrieval_metrics`` of the whole embeddings, and for each of ``widths`` (Matryoshka
    training's) of their prefixes of that width, L2-normalised: ``dim64_mrr``, ..."""
    metrics = {}
    for width, width_queries, width_docs in embeddings_by_width(queries, docs, widths):
        metrics.update(retrieval_metrics(width_queries, width_docs, query_ids, doc_ids, ks=ks, prefix=width))
    return metrics


def zero_shot_accuracy(image_embeds, class_text_embeds, labels) -> float:
    """Top-1 accuracy of classifying each image as its most similar class embedding."""
    predictions = (image_embeds.float() @ class_text_embeds.float().T).argmax(dim=1)
    return float((predictions == labels).float().mean())


@torch.no_grad()
def embed_texts(tokenizer, texts, encode, batch_size, max_length, device, padding="longest") -> torch.Tensor:
    """fp32 embeddings [len(texts), d] of ``encode(input_ids=..., attention_mask=...)``, in batches
    (``padding="max_length"`` for SigLIP, as it was trained)."""
    out = []
    for start in range(0, len(texts), batch_size):
        tok = tokenizer(
            texts[start : start + batch_size],
            padding=padding,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        ).to(device)
        out.append(encode(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]).float())
    return torch.cat(out)
