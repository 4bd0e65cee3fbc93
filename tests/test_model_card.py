"""Model cards: the rendered Markdown parses as a Hub card with the right metadata, and the
push uploads exactly the model files (checked with a fake HfApi: nothing leaves the machine)."""

from __future__ import annotations

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
        'CLIPModel.from_pretrained("someone/tiny-clip-digits")',
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
