"""Model cards: the rendered Markdown parses as a Hub card with the right metadata, and the
push uploads exactly the model files (checked with a fake HfApi: nothing leaves the machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

hub = pytest.importorskip("huggingface_hub")

from hf_infcl.model_card import (  # noqa: E402
    files_to_push,
    push_checkpoint,
    render_model_card,
    save_model_card,
)

CLIP_FACTS = dict(
    model_name="tiny-clip-digits",
    dataset="digits",
    dataset_description="handwritten digits",
    attribution="All emojis designed by OpenMoji",
    train_pairs=1438,
    held_out_pairs=359,
    global_batch_size=4096,
    per_device_batch_size=2048,
    chunk_size=256,
    loss="softmax",
    symmetric=True,
    num_processes=2,
    device="NVIDIA H100",
    peak_gpu_memory_gib=3.25,
    eval_results={"zero_shot_top1": 0.9443, "image_to_text_recall@5": 0.98, "image_to_text_mrr": 0.95},
    example_prompts=["a photo of the handwritten digit zero"],
    repo_id="someone/tiny-clip-digits",
)


def test_clip_card_parses_with_hub_metadata():
    card = hub.ModelCard(render_model_card("clip", **CLIP_FACTS))
    data = card.data
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "zero-shot-image-classification"
    assert "inf-cl" in data.tags and "clip" in data.tags
    assert set(data.metrics) == {"accuracy", "recall", "mrr"}
    # The model-index round-trips into EvalResults with our names and values.
    results = {r.metric_name: (r.metric_type, r.metric_value) for r in data.eval_results}
    assert results == {
        "zero_shot_top1": ("accuracy", 0.9443),
        "image_to_text_recall@5": ("recall", 0.98),
        "image_to_text_mrr": ("mrr", 0.95),
    }
    assert data.eval_results[0].dataset_name == "digits"
    text = card.text
    for expected in (
        "| global contrastive batch | 4096 |",
        "| encoder chunk (GradCache) | 256 |",
        "| processes | 2 |",
        "| peak GPU memory (GiB, per process) | 3.25 |",
        'AutoModel.from_pretrained("someone/tiny-clip-digits")',
        "All emojis designed by OpenMoji",
        "a ring of 2 processes",
        "['a photo of the handwritten digit zero']",
    ):
        assert expected in text, expected


def test_dual_encoder_card_shows_before_and_after_and_library_usage():
    facts = dict(
        base_model="sentence-transformers/all-MiniLM-L6-v2",
        dataset="wordnet",
        datasets=["wordnet"],
        global_batch_size=256,
        num_processes=1,
        library_name="sentence-transformers",
        eval_results={"recall@1": 0.61, "mrr": 0.7},
        eval_results_before={"recall@1": 0.42, "mrr": 0.5},
        repo_id="someone/minilm-wordnet",
    )
    card = hub.ModelCard(render_model_card("dual_encoder", **facts))
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.data.library_name == "sentence-transformers"
    assert card.data.pipeline_tag == "sentence-similarity"
    assert "inf-cl" in card.data.tags and "dual-encoder" in card.data.tags
    assert "| recall@1 (before → after) | 0.42 → 0.61 |" in card.text
    assert 'SentenceTransformer("someone/minilm-wordnet")' in card.text
    # Without a library name the usage is hf_infcl's own DualEncoder.
    plain = render_model_card("dual_encoder", repo_id="x/y", eval_results={"mrr": 0.5})
    assert 'DualEncoder.from_pretrained("x/y")' in plain


def test_card_rejects_unknown_kinds_and_facts():
    with pytest.raises(ValueError, match="kind"):
        render_model_card("siglip")
    with pytest.raises(TypeError, match="global_bach_size"):
        render_model_card("clip", global_bach_size=3)


def _fake_run(tmp_path):
    out = tmp_path / "run"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
        "eval_results.json",
        "checkpoint-50/optimizer.bin",
        "checkpoint-50/model.safetensors",
        "runs/events.out",
        "1_Pooling/config.json",
    ):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    return out


class FakeHfApi:
    """Records what would be sent to the Hub."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, operations))
        return hub.CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/0",
            commit_message="m",
            commit_description="",
            oid="0",
        )


def test_push_uploads_model_processor_card_but_not_training_states(tmp_path):
    out = _fake_run(tmp_path)
    api = FakeHfApi()
    with pytest.raises(FileNotFoundError, match="README.md"):
        push_checkpoint(out, "someone/model", api=api)
    assert api.calls == []

    save_model_card(out, "clip", **CLIP_FACTS)
    url = push_checkpoint(out, "someone/model", api=api, private=True)
    assert url.endswith("someone/model/commit/0")
    (create, repo, options), (commit, commit_repo, operations) = api.calls
    assert (create, repo, options["private"], options["exist_ok"]) == (
        "create_repo",
        "someone/model",
        True,
        True,
    )
    assert commit == "create_commit" and commit_repo == "someone/model"
    expected = {
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
        "eval_results.json",
        "1_Pooling/config.json",
    }
    assert {op.path_in_repo for op in operations} == expected == set(files_to_push(out))
    for op in operations:  # each operation points at the real file of that name
        assert op.path_or_fileobj == str(out / op.path_in_repo)


@pytest.mark.parametrize("family, loss", [("clip", "softmax"), ("siglip", "sigmoid"), ("siglip2", "sigmoid")])
def test_clip_card_usage_runs_for_each_family(tmp_path, monkeypatch, family, loss):
    """The card's "How to use" code, run as a reader would, on a checkpoint of each family the
    CLIP template serves (saved offline): it loads through the Auto classes and prints one
    probability per label, softmax-normalised for the softmax loss, sigmoid for SigLIP's."""
    import contextlib
    import io
    import re

    import numpy as np
    from PIL import Image

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from tiny_clip import build_tiny_clip_and_processor

    labels = ["a photo of the digit zero", "a photo of the digit one"]
    # SigLIP 2's processor call applies its checkpoints' defaults (16 x 16 patches, up to 256 of
    # them; texts padded to 64 tokens) over the saved processor's: the tiny model takes them.
    options = dict(patch_size=16, image_size=32, max_text_length=64) if family == "siglip2" else {}
    model, processor = build_tiny_clip_and_processor(labels, family=family, **options)
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    processor.save_pretrained(checkpoint)
    text = render_model_card("clip", **dict(CLIP_FACTS, loss=loss, repo_id=str(checkpoint),
                                            example_prompts=labels))
    code = re.search(r"## How to use\n\n```python\n(.*?)```", text, re.S).group(1)
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "image.png")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "model_card_usage", "exec"), {})
    probabilities = eval(printed.getvalue())  # the dict the snippet prints
    assert list(probabilities) == labels
    values = np.array(list(probabilities.values()))
    assert np.all((values > 0) & (values < 1))
    if loss == "softmax":
        assert values.sum() == pytest.approx(1.0, abs=1e-6)
        assert "torch.sigmoid" not in code
    else:
        assert "torch.sigmoid" in code and 'padding="max_length"' in code
