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
    from hf_infcl.metrics import retrieval_recalls
    from tests.helpers.trainer_fixtures import PairDataset, clip_batch, tiny_clip, trainer_arguments

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


# ---- hits: the positive's group (group_column, else identical inputs) ------------------------


def test_fingerprints_are_equal_exactly_for_identical_inputs_however_padded():
    from hf_infcl.metrics import input_fingerprints, same_input_ids

    generator = torch.Generator().manual_seed(21)
    texts = [torch.randint(3, 40, (int(n),), generator=generator).tolist() for n in (4, 2, 6, 4)]
    texts.append(texts[0][:3] + [texts[0][3] + 1])  # one token changed
    texts.append(texts[1] + [0])  # a real token 0, not padding: another text

    def padded(rows, length, side):
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, row in enumerate(rows):
            span = slice(0, len(row)) if side == "right" else slice(length - len(row), length)
            ids[i, span], mask[i, span] = torch.tensor(row), 1
        return input_fingerprints({"input_ids": ids, "attention_mask": mask})

    prints = torch.cat([padded(texts, 7, "right"), padded(texts, 9, "left"), padded(texts[:1], 4, "right")])
    ids = same_input_ids(prints).tolist()
    assert ids[:6] == ids[6:12] and ids[12] == ids[0]  # the same texts, padded differently
    assert len(set(ids[:6])) == 6

    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        images = torch.randn(5, 3, 4, 4, generator=generator).to(dtype)
        images[3] = images[0]
        images[4] = images[1]
        images.view(bits)[4, 2, 3, 3] ^= 1  # one ulp away from image 1
        alone = input_fingerprints({"pixel_values": images[3:4].clone()})  # in a batch of its own
        ids = same_input_ids(torch.cat([input_fingerprints({"pixel_values": images}), alone]))
        assert ids[0] == ids[3] == ids[5] and len(set(ids[:3].tolist() + ids[4:5].tolist())) == 4, ids


def test_fingerprints_name_bad_input():
    from hf_infcl.metrics import input_fingerprints

    with pytest.raises(ValueError, match="at least one tensor"):
        input_fingerprints({"input_ids": None})
    with pytest.raises(ValueError, match="'input_ids' has shape \\(3, 4\\); every input needs 2 rows"):
        input_fingerprints({"input_ids": torch.ones(3, 4), "attention_mask": torch.ones(2, 4)})


CAPTION_TOKENS = {"A": [5, 9, 2], "B": [6, 2], "C": [7, 8, 8, 2]}
CAPTION_EMBEDDINGS = {5: [1.0, 0.0], 6: [0.0, 1.0], 7: [-1.0, 0.0]}  # by a caption's first token


class CaptionPairs(torch.utils.data.Dataset):
    """Image-caption rows whose captions the collator pads to each batch's longest."""

    def __init__(self, pixel_values, captions, groups=None):
        self.pixel_values, self.captions, self.groups = pixel_values, captions, groups

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, index):
        row = {"pixel_values": self.pixel_values[index], "caption": self.captions[index]}
        return row if self.groups is None else {**row, "group": self.groups[index]}


def pad_captions(rows):
    length = max(len(row["caption"]) for row in rows)
    batch = {"pixel_values": torch.stack([row["pixel_values"] for row in rows]),
             "input_ids": torch.zeros(len(rows), length, dtype=torch.long),
             "attention_mask": torch.zeros(len(rows), length, dtype=torch.long)}
    for i, row in enumerate(rows):
        batch["input_ids"][i, : len(row["caption"])] = torch.tensor(row["caption"])
        batch["attention_mask"][i, : len(row["caption"])] = 1
    if "group" in rows[0]:
        batch["group"] = torch.tensor([row["group"] for row in rows])
    return batch


def hand_checked_evaluation(tmp_path, monkeypatch, groups=None):
    """Four pairs: captions A, B, A, C (A padded to 3 and to 4 in the two eval batches of 2); image 3
    is image 0 again. The towers are replaced by lookups: an image's embedding is its first two
    pixels ([1, 0], [0, 1], [1, 1], [1, 0]), a caption's is its first token's."""
    import hf_infcl.trainer
    from hf_infcl import InfCLTrainer
    from tests.helpers.trainer_fixtures import tiny_clip, trainer_arguments

    pixel_values = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    pixel_values[:, 0, 0, :2] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    pixel_values[3] = pixel_values[0]
    captions = [CAPTION_TOKENS[c] for c in "ABAC"]
    monkeypatch.setattr(hf_infcl.trainer, "encode_queries",
                        lambda model, inputs: inputs["pixel_values"][:, 0, 0, :2].clone())
    monkeypatch.setattr(hf_infcl.trainer, "encode_keys", lambda model, inputs: torch.tensor(
        [CAPTION_EMBEDDINGS[int(first)] for first in inputs["input_ids"][:, 0]]))
    settings = dict(per_device_eval_batch_size=2, remove_unused_columns=False)
    if groups is not None:
        settings["group_column"] = "group"
    trainer = InfCLTrainer(model=tiny_clip(dropout=0.0), args=trainer_arguments(tmp_path, **settings),
                           eval_dataset=CaptionPairs(pixel_values, captions, groups),
                           data_collator=pad_captions)
    return trainer.evaluate()


def test_repeated_captions_and_images_are_hits_of_each_other(tmp_path, monkeypatch):
    """Image -> text: image 0's positive A ties with the other A, a hit now (rank 0, was 1); image
    2 ([1, 1]) scores A, B, A alike: B counts against it (rank 1, was 2); image 1 ranks B first;
    image 3's positive C ranks last (3). Text -> image: images 0 and 3 are one group (identical
    pixels); text 0 ranks image 2 beside its group (1), text 1 ties with image 2 (1), text 2
    ties with images 0 and 3 (2), text 3 (C, [-1, 0]) ties with image 2 and is beaten by image 1 (2)."""
    metrics = hand_checked_evaluation(tmp_path, monkeypatch)
    assert metrics["eval_image_to_text_recall@1"] == pytest.approx(2 / 4)  # ranks 0, 0, 1, 3
    assert metrics["eval_image_to_text_recall@5"] == 1.0
    assert metrics["eval_image_to_text_mrr"] == pytest.approx((1 + 1 + 1 / 2 + 1 / 4) / 4)
    assert metrics["eval_text_to_image_recall@1"] == 0.0  # ranks 1, 1, 2, 2
    assert metrics["eval_text_to_image_mrr"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 3 + 1 / 3) / 4)


def test_a_group_column_decides_the_hits_instead_of_identical_inputs(tmp_path, monkeypatch):
    """The same pairs with every row its own group: identical inputs no longer help (the ranks of
    the rule without groups, 1, 0, 2, 3 and 2, 1, 2, 3); with rows 0, 2 and 3 one group (three
    captions of one image, as COCO's), ranks 0, 0, 1, 0 and 0, 1, 0, 1."""
    distinct = hand_checked_evaluation(tmp_path, monkeypatch, groups=[0, 1, 2, 3])
    assert distinct["eval_image_to_text_recall@1"] == pytest.approx(1 / 4)
    assert distinct["eval_image_to_text_mrr"] == pytest.approx((1 / 2 + 1 + 1 / 3 + 1 / 4) / 4)
    assert distinct["eval_text_to_image_mrr"] == pytest.approx((1 / 3 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    shared = hand_checked_evaluation(tmp_path, monkeypatch, groups=[0, 1, 0, 0])
    assert shared["eval_image_to_text_recall@1"] == pytest.approx(3 / 4)
    assert shared["eval_image_to_text_mrr"] == pytest.approx((1 + 1 + 1 / 2 + 1) / 4)
    assert shared["eval_text_to_image_recall@1"] == pytest.approx(2 / 4)
    assert shared["eval_text_to_image_mrr"] == pytest.approx((1 + 1 / 2 + 1 + 1 / 2) / 4)


def test_digits_with_repeated_captions_have_recall_above_zero(tmp_path):
    """Digits as image-caption pairs, one caption per digit ("a photo of the digit three", twelve
    times in 48 rows): the eleven identical copies of the positive tie with it. Counted against
    the positive, image -> text recall@1/5/10 would be 0.0; as hits, the evaluation equals the
    metric with the digit as the group, and is above 0."""
    pytest.importorskip("sklearn")
    from hf_infcl import InfCLTrainer
    from tests.helpers.trainer_fixtures import (
        DIGIT_WORDS,
        PairDataset,
        caption_tokenizer,
        digits_clip,
        digits_image_caption_split,
        trainer_arguments,
    )

    tokenizer = caption_tokenizer()
    _, images, labels = digits_image_caption_split(tokenizer)
    rows = torch.cat([torch.nonzero(labels == digit).flatten()[:12] for digit in range(4)])
    images, labels = images[rows], labels[rows]  # digits 0-3, twelve of each
    tokens = tokenizer([f"a photo of the digit {DIGIT_WORDS[int(label)]}" for label in labels],
                       padding="max_length", max_length=10, return_tensors="pt")
    dataset = PairDataset({"pixel_values": images, "input_ids": tokens["input_ids"],
                           "attention_mask": tokens["attention_mask"]})
    trainer = InfCLTrainer(model=digits_clip(len(tokenizer)).eval(),
                           args=trainer_arguments(tmp_path, per_device_eval_batch_size=16),
                           eval_dataset=dataset)
    metrics = trainer.evaluate()
    image_embeds, text_embeds = map(torch.from_numpy, trainer.predict(dataset).predictions)
    ties_against = retrieval_metrics(image_embeds, text_embeds)
    assert ties_against["recall@1"] == ties_against["recall@5"] == ties_against["recall@10"] == 0.0
    expected = retrieval_metrics(image_embeds, text_embeds, labels, labels)
    for name, value in expected.items():
        assert metrics[f"eval_image_to_text_{name}"] == pytest.approx(value), name
    assert metrics["eval_image_to_text_recall@1"] > 0
