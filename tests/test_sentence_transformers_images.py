"""``hf_infcl.losses`` on image-text SentenceTransformer models, cached and not, against
sentence-transformers' own losses in float64, offline, on CPU.

The cached path cuts every column's inputs into mini-batches with sentence-transformers' own
``_create_minibatch`` (the CachedLossMixin's), so an image column is cut as CachedMNRL cuts it:
``pixel_values`` per image for CLIP-like models, and, for VLMs that flatten the patches of every
image into one tensor (Qwen2-VL), ``pixel_values`` and ``image_grid_thw`` by the rows' images
(``num_images_per_sample``). Two models:

- a tiny CLIP saved with ``save_pretrained`` and loaded by sentence-transformers' ``Transformer``
  module (text and image modalities, embeddings from ``get_text_features`` /
  ``get_image_features``), dropout on, fed by the model's own ``preprocess`` of PIL images;
- a tiny Qwen2-VL behind a small input module, with last-token pooling, fed the inputs its
  processor gives (image pad tokens, flattened patches, ``image_grid_thw``, ``mm_token_type_ids``),
  built by hand: the Qwen2-VL processor needs torchvision, which CPU CI does not install.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers")

from hf_infcl import losses  # noqa: E402
from tests.helpers.sentence_transformers_fixtures import replay_tolerance  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # tiny_clip

# float64: the losses differ only in summation order.
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
CAPTIONS = [f"a {colour} square number {i}" for i, colour in
            enumerate(["red", "green", "blue", "white", "black", "grey", "pink", "brown", "gold", "cyan"])]


def float64_features(features: dict) -> dict:
    return {key: value.double() if torch.is_tensor(value) and value.is_floating_point() else value
            for key, value in features.items()}


def loss_and_gradients(model, loss_module, columns, seed: int):
    """Loss value and every parameter gradient of one forward/backward, with dropout seeded; each
    column's features are copied, since the modules write their outputs into them."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_module([dict(column) for column in columns], None)
    loss.backward()
    gradients = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), gradients


def assert_same_step(expected, actual):
    """Equal losses and gradients; a gradient is compared at the scale of the largest one, since
    some (attention key biases) are zero in exact arithmetic and only rounding in either loss."""
    expected_loss, expected_grads = expected
    actual_loss, actual_grads = actual
    tolerance = replay_tolerance(TOLERANCE)
    torch.testing.assert_close(actual_loss, expected_loss, **tolerance)
    assert actual_grads.keys() == expected_grads.keys() and len(expected_grads) > 10
    scale = max(grad.abs().max() for grad in expected_grads.values())
    for name, expected_grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name] / scale, expected_grad / scale, **tolerance,
                                   msg=lambda message, n=name: f"{n}: {message}")


# ---- a CLIP through sentence-transformers' Transformer module ------------------------------------


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A tiny CLIP (dropout 0.1 in both towers) and its processor, saved with ``save_pretrained``."""
    from tiny_clip import build_word_tokenizer, model_for, processor_for, tiny_config

    folder = tmp_path_factory.mktemp("tiny_clip")
    tokenizer = build_word_tokenizer(CAPTIONS)
    config = tiny_config("clip", tokenizer, image_size=16, patch_size=4, width=32)
    for tower in (config.text_config, config.vision_config):
        tower.dropout = tower.attention_dropout = 0.1
    model_for(config, seed=0).save_pretrained(folder)
    processor_for(config, tokenizer).save_pretrained(folder)
    return folder


def load_clip(folder):
    """The saved CLIP as a SentenceTransformer: sentence-transformers' Transformer module, which
    embeds texts with ``get_text_features`` and images with ``get_image_features``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Transformer

    model = SentenceTransformer(modules=[Transformer(str(folder))], device="cpu")
    assert set(model[0].modality_config) == {"text", "image"}
    return model


@pytest.fixture(scope="module")
def clip_model(clip_folder):
    return load_clip(clip_folder).double().train()


def random_images(count: int, seed: int):
    """PIL images of random pixels and sizes (the processor resizes and crops them)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (int(rng.integers(12, 40)), int(rng.integers(12, 40)), 3),
                                        dtype=np.uint8)) for _ in range(count)]


def clip_columns(model, kinds: str, rows: int, seed: int) -> list[dict]:
    """One column per letter of ``kinds`` ("i": images, "t": captions), ``rows`` each, as the
    model's ``preprocess`` gives them."""
    import random

    shuffle = random.Random(seed)
    columns = []
    for index, kind in enumerate(kinds):
        if kind == "i":
            inputs = random_images(rows, seed=seed + index)
        else:
            inputs = shuffle.sample(CAPTIONS, rows)
        columns.append(float64_features(model.preprocess(inputs)))
    return columns


def test_the_clip_columns_are_images_and_texts(clip_model):
    """The columns the parity tests cut: batch-first ``pixel_values`` beside no token ids, and
    dropout that a replay must repeat (else the cached comparisons would prove less)."""
    images, texts = clip_columns(clip_model, "it", rows=4, seed=0)
    assert images["pixel_values"].shape == (4, 3, 16, 16) and "input_ids" not in images
    assert texts["input_ids"].shape[0] == 4
    torch.manual_seed(0)
    first = clip_model(dict(images))["sentence_embedding"]
    torch.manual_seed(1)
    assert not torch.allclose(first, clip_model(dict(images))["sentence_embedding"])


@pytest.mark.parametrize("kinds", ["it", "ti", "tii", "iti"],
                         ids=["images-captions", "captions-images", "captions-images-negatives",
                              "images-captions-negatives"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["", "symmetric"])
def test_clip_cached_matches_cached_mnrl(clip_model, kinds, symmetric):
    """10 rows in mini-batches of 4, 4 and 2, dropout on: the loss and every gradient of both
    towers equal CachedMultipleNegativesRankingLoss's (or its symmetric form's)."""
    from tests.helpers.sentence_transformers_fixtures import st_reference_loss

    columns = clip_columns(clip_model, kinds, rows=10, seed=len(kinds) + 10 * symmetric)
    reference = st_reference_loss(clip_model, symmetric, mini_batch_size=4)
    expected = loss_and_gradients(clip_model, reference, columns, seed=5)
    ours = losses.InfCLLoss(clip_model, symmetric=symmetric, mini_batch_size=4)
    actual = loss_and_gradients(clip_model, ours, columns, seed=5)
    assert_same_step(expected, actual)
    for tower in (".vision_model.", ".text_model."):
        assert any(tower in name for name in actual[1])


@pytest.mark.parametrize("kinds", ["it", "tii"], ids=["images-captions", "captions-images-negatives"])
def test_clip_mini_batches_equal_the_whole_batch(clip_model, kinds):
    """Without dropout the mini-batches change nothing: the cached loss and gradients equal
    MultipleNegativesRankingLoss's on the whole batch (each image embedded in its own chunk)."""
    from sentence_transformers.sentence_transformer import losses as st_losses

    columns = clip_columns(clip_model, kinds, rows=7, seed=40 + len(kinds))
    clip_model.eval()
    try:
        reference = st_losses.MultipleNegativesRankingLoss(clip_model)
        expected = loss_and_gradients(clip_model, reference, columns, 0)
        for mini_batch_size in (1, 3):
            cached = losses.InfCLLoss(clip_model, mini_batch_size=mini_batch_size)
            assert_same_step(expected, loss_and_gradients(clip_model, cached, columns, 0))
    finally:
        clip_model.train()


def test_clip_gist_cached_matches_cached_gist(clip_model):
    """InfCLGISTLoss with mini-batches on image anchors and caption positives, the guide a second
    CLIP of the same processor (no re-tokenising), equals CachedGISTEmbedLoss."""
    import copy

    from sentence_transformers.sentence_transformer import losses as st_losses

    guide = copy.deepcopy(clip_model).eval()
    with torch.no_grad():
        for parameter in guide.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    columns = clip_columns(clip_model, "iti", rows=9, seed=77)
    reference = st_losses.CachedGISTEmbedLoss(clip_model, guide, mini_batch_size=4)
    expected = loss_and_gradients(clip_model, reference, columns, seed=3)
    actual = loss_and_gradients(clip_model, losses.InfCLGISTLoss(clip_model, guide, mini_batch_size=4),
                                columns, seed=3)
    assert_same_step(expected, actual)


# ---- a VLM whose images are flattened patches with a grid per image (Qwen2-VL) ----------------------

VLM_WIDTH = 32
VOCAB, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 40, 35, 36, 37, 38
TEXT_TOKENS = 30  # ids below this are words
PATCH_VALUES = 3 * 2 * 2  # channels x patch x patch (temporal patch 1)


class TinyVLM(torch.nn.Module):
    """A sentence-transformers input module around a Qwen2VLModel: the inputs a Qwen2-VL processor
    gives in, token embeddings out (as ST's Transformer module hands them to Pooling)."""

    INPUTS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")

    def __init__(self, seed: int = 0):
        from transformers import Qwen2VLConfig, Qwen2VLModel

        super().__init__()
        config = Qwen2VLConfig(
            text_config=dict(hidden_size=VLM_WIDTH, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                             max_position_embeddings=256, attention_dropout=0.1,
                             rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                             bos_token_id=0, eos_token_id=0, pad_token_id=0),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=VLM_WIDTH, num_heads=2, patch_size=2,
                               spatial_merge_size=2, temporal_patch_size=1, in_chans=3, mlp_ratio=2),
            image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END,
        )
        torch.manual_seed(seed)
        self.model = Qwen2VLModel(config)

    def forward(self, features, **kwargs):
        inputs = {key: features[key] for key in self.INPUTS if key in features}
        features["token_embeddings"] = self.model(**inputs).last_hidden_state
        return features


@pytest.fixture(scope="module")
def vlm_model():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    model = SentenceTransformer(modules=[TinyVLM(), Pooling(VLM_WIDTH, "lasttoken")], device="cpu")
    return model.double().train()


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    input_ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return input_ids, attention_mask


def vlm_image_column(images_per_row: list[int], seed: int) -> dict:
    """Rows of 0, 1 or more images of random grids (each a vision block of pad tokens) and a few
    words, with every image's patches in one ``pixel_values`` tensor, as Qwen2-VL's processor gives."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=generator))

    rows, grids, patches = [], [], []
    for images in images_per_row:
        row = []
        for _ in range(images):
            height, width = 2 * draw(1, 3), 2 * draw(1, 4)  # patches, a multiple of the merge size
            grids.append([1, height, width])
            patches.append(torch.randn(height * width, PATCH_VALUES, generator=generator,
                                       dtype=torch.float64))
            row += [VISION_START] + [IMAGE_PAD] * (height * width // 4) + [VISION_END]
        row += torch.randint(1, TEXT_TOKENS, (draw(1, 4),), generator=generator).tolist()
        rows.append(row)
    input_ids, attention_mask = left_padded(rows)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "mm_token_type_ids": (input_ids == IMAGE_PAD).long(), "pixel_values": torch.cat(patches),
            "image_grid_thw": torch.tensor(grids), "num_images_per_sample": torch.tensor(images_per_row)}


def vlm_text_column(rows: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 8, (rows,), generator=generator).tolist()
    input_ids, attention_mask = left_padded(
        [torch.randint(1, TEXT_TOKENS, (length,), generator=generator).tolist() for length in lengths])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


IMAGES_PER_ROW = [1, 2, 1, 0, 1, 2, 1, 1]


@pytest.mark.parametrize("symmetric", [False, True], ids=["", "symmetric"])
def test_vlm_cached_matches_cached_mnrl(vlm_model, symmetric):
    """Image rows (some with two images, one with none) against captions, mini-batches of 3 that cut
    the flattened patches at image boundaries, attention dropout on: CachedMNRL's loss and gradients."""
    from tests.helpers.sentence_transformers_fixtures import st_reference_loss

    columns = [vlm_image_column(IMAGES_PER_ROW, seed=1), vlm_text_column(len(IMAGES_PER_ROW), seed=2)]
    reference = st_reference_loss(vlm_model, symmetric, mini_batch_size=3)
    expected = loss_and_gradients(vlm_model, reference, columns, seed=9)
    ours = losses.InfCLLoss(vlm_model, symmetric=symmetric, mini_batch_size=3)
    actual = loss_and_gradients(vlm_model, ours, columns, seed=9)
    assert_same_step(expected, actual)
    assert any(".visual." in name for name in actual[1])


@pytest.mark.parametrize("chunking", [dict(mini_batch_size=3), dict(mini_batch_size=2),
                                      dict(mini_batch_size=4, mini_batch_num_tokens=12)],
                         ids=["mini-batch3", "mini-batch2", "token-budget12"])
def test_vlm_mini_batches_equal_the_whole_batch(vlm_model, chunking):
    """Without dropout the cached loss on captions -> image rows (and image hard negatives) equals
    MultipleNegativesRankingLoss on the whole batch, however the rows and their images are cut.
    (Not in mini-batches of 1: Qwen2-VL embeds a row without images alone ~1e-10 away from the
    same row in a batch with images, in CachedMNRL as here.)"""
    from sentence_transformers.sentence_transformer import losses as st_losses

    rows = len(IMAGES_PER_ROW)
    columns = [vlm_text_column(rows, seed=3), vlm_image_column(IMAGES_PER_ROW, seed=4),
               vlm_image_column(IMAGES_PER_ROW[::-1], seed=5)]
    vlm_model.eval()
    try:
        reference = st_losses.MultipleNegativesRankingLoss(vlm_model)
        expected = loss_and_gradients(vlm_model, reference, columns, 0)
        actual = loss_and_gradients(vlm_model, losses.InfCLLoss(vlm_model, **chunking), columns, 0)
    finally:
        vlm_model.train()
    assert_same_step(expected, actual)


def test_sentence_transformer_trainer_trains_clip_on_image_caption_pairs(clip_folder, tmp_path):
    """SentenceTransformerTrainer on a dataset of PIL images and captions: the collator preprocesses
    the image column, InfCLLoss caches it in mini-batches, and both towers move."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = load_clip(clip_folder)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train = Dataset.from_dict({"image": random_images(16, seed=8), "caption": (CAPTIONS * 2)[:16]})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3,
        save_strategy="no", report_to="none", use_cpu=True, dataloader_pin_memory=False)
    loss = losses.InfCLLoss(model, mini_batch_size=3)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss)
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    moved = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    for tower in (".vision_model.", ".text_model."):
        assert any(tower in name for name in moved), tower
