"""``hf_infcl.metrics``: one retrieval metric, one tie rule, for the Trainer and the examples alike."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hf_infcl.metrics import relevant_ranks, retrieval_metrics

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))


def brute_force_ranks(queries, keys, query_ids, key_ids):
    """The documented rule, one pair at a time: irrelevant keys scoring >= the best relevant key."""
    scores = queries.double() @ keys.double().T
    ranks = []
    for i in range(len(queries)):
        relevant = [j for j in range(len(keys)) if key_ids[j] == query_ids[i]]
        best = max(float(scores[i, j]) for j in relevant)
        ranks.append(sum(float(scores[i, j]) >= best for j in range(len(keys)) if key_ids[j] != query_ids[i]))
    return torch.tensor(ranks)


def tied_embeddings():
    """Small-integer embeddings (exact dot products in fp32) with many ties, ids with duplicates."""
    generator = torch.Generator().manual_seed(3)
    queries = torch.randint(-1, 2, (23, 3), generator=generator).float()
    keys = torch.randint(-1, 2, (17, 3), generator=generator).float()
    key_ids = torch.randint(0, 12, (17,), generator=generator)
    query_ids = key_ids[torch.randint(0, 17, (23,), generator=generator)]  # every query has an answer
    return queries, keys, query_ids, key_ids


@pytest.mark.parametrize("block_rows", [1, 4, 1024])
def test_ranks_follow_the_documented_tie_rule(block_rows):
    queries, keys, query_ids, key_ids = tied_embeddings()
    expected = brute_force_ranks(queries, keys, query_ids, key_ids)
    scores = queries @ keys.T
    assert any(len(set(row.tolist())) < len(row) for row in scores), "the case must contain ties"
    got = relevant_ranks(queries, keys, query_ids, key_ids, block_rows=block_rows)
    assert torch.equal(got, expected)


def test_a_constant_model_scores_zero():
    metrics = retrieval_metrics(torch.ones(50, 4), torch.ones(50, 4), ks=(1, 10))
    assert metrics["recall@1"] == 0.0 and metrics["recall@10"] == 0.0
    assert metrics["mrr"] == pytest.approx(1 / 50)  # every positive ranks last of 50


def test_without_ids_key_i_answers_query_i_and_extra_keys_are_negatives():
    queries = torch.eye(3)
    keys = torch.cat([torch.eye(3), torch.tensor([[2.0, 0.0, 0.0]])])  # key 3 beats query 0's positive
    assert relevant_ranks(queries, keys).tolist() == [1, 0, 0]
    metrics = retrieval_metrics(queries, keys, ks=(1, 2))
    assert metrics == {"recall@1": pytest.approx(2 / 3), "recall@2": 1.0, "mrr": pytest.approx((0.5 + 2) / 3)}


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="together"):
        relevant_ranks(torch.ones(2, 2), torch.ones(2, 2), torch.arange(2), None)
    with pytest.raises(ValueError, match="every query needs at least one relevant key"):
        relevant_ranks(torch.ones(2, 2), torch.ones(2, 2), torch.tensor([0, 5]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="query_ids"):
        relevant_ranks(torch.ones(2, 2), torch.ones(2, 2), torch.arange(3), torch.arange(2))
    with pytest.raises(TypeError, match="key_ids"):
        relevant_ranks(torch.ones(2, 2), torch.ones(2, 2), torch.arange(2), torch.zeros(2))
    with pytest.raises(ValueError, match="at least 3 keys"):
        relevant_ranks(torch.ones(3, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="block_rows"):
        relevant_ranks(torch.ones(2, 2), torch.ones(2, 2), block_rows=0)


def test_trainer_and_examples_report_the_same_recall_on_the_same_embeddings(tmp_path, monkeypatch):
    """The Trainer's evaluation (rows paired with keys, a group column) and the examples' metric
    (ids) on one set of embeddings full of ties: the same recall@k and MRR."""
    import hf_infcl.trainer
    from hf_infcl import InfCLTrainer
    from hf_infcl.trainer import retrieval_recalls
    from tests.trainer_fixtures import PairDataset, clip_batch, tiny_clip, trainer_arguments

    import retrieval_metrics as example_metrics

    n = 17
    generator = torch.Generator().manual_seed(5)
    queries = torch.randint(-1, 2, (n, 3), generator=generator).float()
    keys = queries.clone()
    keys[::3] = torch.randint(-1, 2, (6, 3), generator=generator).float()  # a third lose their match
    groups = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 9, 10, 11, 12, 13])
    ours = relevant_ranks(queries, keys, groups, groups)
    scores = queries @ keys.T
    relevant = groups[:, None] == groups[None, :]
    best = scores.masked_fill(~relevant, float("-inf")).amax(1)
    strict = ((scores > best[:, None]) & ~relevant).sum(1)
    assert (strict == 0).sum() > (ours == 0).sum(), "the case must have ties that decide recall@1"

    # the examples' function is the library's
    from_examples = example_metrics.retrieval_metrics(queries, keys, groups, groups, ks=(1, 5, 10))
    assert from_examples == retrieval_metrics(queries, keys, groups, groups, ks=(1, 5, 10))
    recalls = retrieval_recalls(queries, keys, groups, ks=(1, 5, 10), block_rows=3)
    assert recalls == {k: from_examples[f"recall@{k}"] for k in (1, 5, 10)}

    # ... and so is what InfCLTrainer.evaluate() logs: the towers are replaced by lookups of the
    # embeddings above (row i of the eval set carries index i in its first pixel).
    batch = clip_batch(n, seed=1)
    batch["pixel_values"][:, 0, 0, 0] = torch.arange(n, dtype=batch["pixel_values"].dtype)
    batch["group"] = groups

    def index(inputs):
        return inputs["pixel_values"][:, 0, 0, 0].round().long().cpu()

    monkeypatch.setattr(hf_infcl.trainer, "encode_queries", lambda model, inputs: queries[index(inputs)])
    monkeypatch.setattr(hf_infcl.trainer, "encode_keys", lambda model, inputs: keys[index(inputs)])
    trainer = InfCLTrainer(model=tiny_clip(dropout=0.0),
                           args=trainer_arguments(tmp_path, per_device_eval_batch_size=5, eval_block_rows=4,
                                                  group_column="group", remove_unused_columns=False),
                           eval_dataset=PairDataset(batch))
    logged = trainer.evaluate()
    for k in (1, 5, 10):
        assert logged[f"eval_image_to_text_recall@{k}"] == pytest.approx(from_examples[f"recall@{k}"])
    assert logged["eval_image_to_text_mrr"] == pytest.approx(from_examples["mrr"])
    reverse = retrieval_metrics(keys, queries, groups, groups)
    assert logged["eval_text_to_image_recall@1"] == pytest.approx(reverse["recall@1"])
    assert 0 < from_examples["recall@1"] < 1
