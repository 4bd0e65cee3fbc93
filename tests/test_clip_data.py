"""``examples/train_clip.py`` on real-data layouts: parquet and webdataset shards of the bundled
digits, streamed (``--streaming``) and in memory, in one process and in two (gloo); which rows
each process trained on is recorded by ``tests/clip_rows_worker.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.clip_rows_worker import read_rows
from tests.offline import run_two_processes
from tests.test_examples import _digit_shards

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
WORKER = ROOT / "tests" / "clip_rows_worker.py"
BAD_ROWS = {"image does not decode": 1, "empty caption": 1}  # what _digit_shards puts in shard 0

pytest.importorskip("datasets")


# ---- in memory: every row once per epoch -------------------------------------------------------


@pytest.mark.parametrize("rows", [64, 51, 49, 37, 33])  # 37 = 2 x 18 + 1: a last batch of one row
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("equal_shares", [False, True])
def test_rank_batches_give_every_row_once_per_epoch(rows, world, equal_shares):
    from train_clip import RankBatches

    per_device = 16 // world + 1
    samplers = [RankBatches(rows, per_device, rank, world, seed=3, equal_shares=equal_shares)
                for rank in range(world)]
    orders = []
    for epoch in range(2):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        steps = [list(sampler) for sampler in samplers]
        assert len({len(s) for s in steps}) == 1 and len(steps[0]) == len(samplers[0])  # ranks in step
        shares = [[len(batch) for batch in rank_steps] for rank_steps in steps]
        for step_shares in zip(*shares):
            assert min(step_shares) >= 1 and max(step_shares) - min(step_shares) <= (0 if equal_shares else 1)
        seen = [row for rank_steps in steps for batch in rank_steps for row in batch]
        assert len(seen) == len(set(seen))  # nothing repeated
        left_out = rows - len(seen)
        assert left_out == (rows % world if equal_shares else 0), left_out  # nothing dropped
        orders.append(sorted(seen, key=seen.index))
    assert orders[0] != orders[1]  # each epoch is reshuffled
    resumed = RankBatches(rows, per_device, 0, world, seed=3, equal_shares=equal_shares)
    resumed.set_epoch(1, skip_batches=1)
    samplers[0].set_epoch(1)
    assert list(resumed) == list(samplers[0])[1:]


@pytest.mark.parametrize("world", [1, 2])
def test_in_memory_rows_are_decoded_in_workers_once_per_epoch(tmp_path, world, monkeypatch):
    """Parquet shards in memory, 2 DataLoader workers per process, 1 process or 2 (gloo), 2 epochs:
    every row is decoded in a worker, never in a training process; within each epoch the
    processes' rows are disjoint and together the whole train split (the last step's shares are
    uneven with 2 processes: 51 rows, batches of 16, 3 + 3 rows split 2 + 1); the bad image, met by
    a worker of one process or the other in each epoch, is counted once."""
    parquet, _ = _digit_shards(tmp_path)
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    arguments = ["--dataset", str(parquet), "--image_column", "image", "--output_dir", str(out),
                 "--max_train_samples", "51", "--global_batch_size", "16", "--max_steps", "8",
                 "--eval_steps", "0", "--dataloader_num_workers", "2"]
    if world == 1:
        import train_clip

        from tests.clip_rows_worker import install

        monkeypatch.setenv("CLIP_ROWS_DIR", str(rows_dir))
        install(monkeypatch.setattr)  # DataLoader workers fork from this process: they record too
        train_clip.main(arguments)
        training_pids = {os.getpid()}
    else:
        run_two_processes(WORKER, *arguments, env={"CLIP_ROWS_DIR": str(rows_dir)}, timeout=300)
        training_pids = {r["pid"] for r in read_rows(rows_dir) if r.get("training_process")}
        assert len(training_pids) == 2
    recorded = [r for r in read_rows(rows_dir) if "index" in r]
    decoding_pids = {r["pid"] for r in recorded}
    assert len(decoding_pids) == 2 * world and not decoding_pids & training_pids
    for epoch in (0, 1):
        by_rank = [[r["index"] for r in recorded if (r["epoch"], r["rank"]) == (epoch, rank)]
                   for rank in range(world)]
        assert world == 1 or not set(by_rank[0]) & set(by_rank[1])
        together = [index for rank_rows in by_rank for index in rank_rows]
        assert sorted(together) == list(range(51)), epoch
    results = json.loads((out / "eval_results.json").read_text())
    assert results["skipped_rows"] == BAD_ROWS


# ---- streaming -------------------------------------------------------------------------------


def stream_args(source, out, steps):
    parquet, tars = source
    data = (["--dataset", str(parquet), "--image_column", "image"] if steps[0] == "parquet"
            else ["--dataset", str(tars), "--image_column", "png", "--caption_column", "txt"])
    # 2 rows held out, so that the bad rows 3 and 5 of shard 0 reach the DataLoader workers
    return [*data, "--streaming", "--held_out_samples", "2", "--max_steps", str(steps[1]),
            "--per_device_train_batch_size", "4", "--shuffle_buffer_size", "8", "--eval_steps", "0",
            "--dataloader_num_workers", "2", "--output_dir", str(out)]


@pytest.mark.parametrize("layout", ["parquet", "webdataset"])
def test_streaming_one_process_reads_each_row_once_per_pass_and_counts_bad_rows(tmp_path, layout,
                                                                               monkeypatch):
    import train_clip

    from tests.clip_rows_worker import install

    source = _digit_shards(tmp_path)
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    monkeypatch.setenv("CLIP_ROWS_DIR", str(rows_dir))
    install(monkeypatch.setattr)  # DataLoader workers fork from this process: they record too
    # 2 shards of 30 rows, 2 held out, 2 bad: 56 good rows, one shard per worker (26 and 30): 6 and
    # 7 full batches of 4, and each worker's last 2 rows joined into a 14th batch: 14 steps are
    # exactly one pass, over every good row.
    train_clip.main(stream_args(source, out, (layout, 14)))
    recorded = read_rows(rows_dir)
    first_pass = [r["caption"] for r in recorded if r["epoch"] == 0]
    assert len(first_pass) == 56 and len(set(first_pass)) == len(first_pass)
    assert not any(r["epoch"] > 0 for r in recorded)
    assert os.getpid() not in {r["pid"] for r in recorded}  # decoded in the workers
    assert not any(caption.endswith((", row 0", ", row 1")) for caption in first_pass)  # held out
    results = json.loads((out / "eval_results.json").read_text())
    assert results["skipped_rows"] == BAD_ROWS
    assert len(results["train"]) >= 1 and results["final"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parquet", "webdataset"])
def test_streaming_two_processes_read_different_rows_and_count_bad_rows_once(tmp_path, layout):
    source = _digit_shards(tmp_path)
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    # one shard per process: 28 (26 good) and 30 rows, batches of 4 (6 and 7 full ones, and each
    # process's 2 rest rows wait for its next pass), 8 steps cover a pass each
    run_two_processes(WORKER, *stream_args(source, out, (layout, 8)), env={"CLIP_ROWS_DIR": str(rows_dir)},
                      timeout=300)
    recorded = [r for r in read_rows(rows_dir) if "caption" in r]
    by_rank = [{r["caption"] for r in recorded if r["rank"] == rank} for rank in (0, 1)]
    assert by_rank[0] and by_rank[1] and not by_rank[0] & by_rank[1]
    first_pass = Counter(r["caption"] for r in recorded if r["epoch"] == 0)
    assert max(first_pass.values()) == 1 and len(first_pass) == 56
    results = json.loads((out / "eval_results.json").read_text())
    assert results["skipped_rows"] == BAD_ROWS  # counted by one worker of one process, summed once


# ---- a pretrained start, LiT, zero-shot on --eval_dataset, curves --------------------------------

DIGITS = "zero,one,two,three,four,five,six,seven,eight,nine"
TEMPLATE = "a photo of a {name}."


def save_tiny_checkpoint(kind, folder, texts, text_length=32):
    """A tiny CLIPModel or SiglipModel with its processor, saved as a Hub checkpoint would be;
    ``text_length``: its text tower's max_position_embeddings."""
    import torch
    from transformers import CLIPProcessor, SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor

    from tiny_clip import build_image_processor, build_tiny_clip, build_word_tokenizer

    tokenizer = build_word_tokenizer(texts, max_length=text_length)
    if kind == "clip":
        model = build_tiny_clip(tokenizer, image_size=8, patch_size=4, width=32, layers=1,
                                max_text_length=text_length)
        processor = CLIPProcessor(image_processor=build_image_processor(8), tokenizer=tokenizer)
    else:
        tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        torch.manual_seed(0)
        model = SiglipModel(SiglipConfig(
            text_config=dict(tower, vocab_size=len(tokenizer), max_position_embeddings=text_length,
                             pad_token_id=0),
            vision_config=dict(tower, image_size=8, patch_size=4)))
        image_processor = SiglipImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5] * 3,
                                               image_std=[0.5] * 3)
        processor = SiglipProcessor(image_processor=image_processor, tokenizer=tokenizer)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def zero_shot_top1_of(folder, rows):
    """Zero-shot top-1 of the checkpoint in ``folder`` on (PIL image, label) ``rows``, computed
    here with the model's own feature methods."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoProcessor

    model, processor = AutoModel.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)
    padding = "max_length" if model.config.model_type == "siglip" else True

    def features(output):
        return F.normalize(output if torch.is_tensor(output) else output.pooler_output, dim=-1)

    with torch.no_grad():
        prompts = [TEMPLATE.format(name=name) for name in DIGITS.split(",")]
        text = processor.tokenizer(prompts, padding=padding, truncation=True, max_length=32,
                                   return_tensors="pt")
        classes = features(model.get_text_features(**text))
        pixels = processor.image_processor(images=[image for image, _ in rows], return_tensors="pt")
        images = features(model.get_image_features(pixel_values=pixels["pixel_values"]))
    labels = torch.tensor([label for _, label in rows])
    return float(((images @ classes.T).argmax(1) == labels).float().mean())


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_pretrained_start_lit_zero_shot_and_curves(tmp_path, kind):
    """--model_name_or_path a local CLIP / SigLIP checkpoint with --freeze_vision_model: the
    vision tower (projection included) is saved unchanged, the text tower trained; SigLIP gets
    the sigmoid loss and trains its own logit bias; zero-shot top-1 on --eval_dataset equals the
    saved model's, computed here; the curves PNG is drawn and the card shows it."""
    import torch
    import train_clip
    from safetensors.torch import load_file

    from bundled_data import load_classification_set

    parquet, _ = _digit_shards(tmp_path)
    start, out = tmp_path / "start", tmp_path / "out"
    before = save_tiny_checkpoint(kind, start, digit_texts())
    tensorboard = importlib.util.find_spec("tensorboard") is not None  # else that one check is left out
    final = train_clip.main([
        "--model_name_or_path", str(start), "--freeze_vision_model", "--dataset", str(parquet),
        "--image_column", "image", "--eval_dataset", str(parquet), "--class_names", DIGITS,
        "--prompt_template", TEMPLATE, "--max_steps", "4", "--global_batch_size", "16", "--eval_steps", "2",
        "--logging_steps", "1", "--output_dir", str(out),
        "--report_to", "tensorboard" if tensorboard else "none",
    ])
    after = load_file(str(out / "model.safetensors"))
    vision = [name for name in before if name.startswith(("vision_model.", "visual_projection."))]
    text = [name for name in before if name.startswith(("text_model.", "text_projection."))]
    assert vision and text
    for name in vision:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(after[name], before[name]) for name in text)
    arguments = json.loads((out / "training_args.json").read_text())
    assert arguments["loss"] == ("sigmoid" if kind == "siglip" else "softmax")
    if kind == "siglip":  # the model's own bias trained (and saved), not a fresh one beside it
        assert not torch.equal(after["logit_bias"], before["logit_bias"])

    rows = [(ex.image, ex.label) for ex in
            load_classification_set(str(parquet), class_names=DIGITS, template=TEMPLATE, log=print).held_out]
    assert len(rows) == 59  # the row whose image does not decode is skipped
    assert 0 <= final["zero_shot_top1"] <= 1
    assert final["zero_shot_top1"] == pytest.approx(zero_shot_top1_of(out, rows), abs=1e-6)

    png = out / "training_curves.png"
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    from PIL import Image

    assert Image.open(png).size[0] > 500
    card = (out / "README.md").read_text()
    assert "![Training loss, logit scale and held-out metrics over optimizer steps](training_curves.png)" \
        in card
    assert "| zero_shot_top1 |" in card and "| throughput (pairs/s) |" in card
    results = json.loads((out / "eval_results.json").read_text())
    assert [point["step"] for point in results["train"]] == [1, 2, 3, 4]
    assert [point["step"] for point in results["history"]] == [2, 4]
    if tensorboard:
        assert list((out / "runs").rglob("events.out.tfevents.*"))


def digit_texts():
    from bundled_data import DIGIT_NAMES, load_digits

    texts = load_digits().vocabulary_text() + [TEMPLATE.format(name=n) for n in DIGIT_NAMES] + ["row"]
    return texts + [str(i) for i in range(60)]


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_caption_length_defaults_to_the_pretrained_models_text_length(tmp_path, kind, monkeypatch):
    """Without --max_seq_length, a pretrained model's captions are cut at its text length (its text
    config's max_position_embeddings, 24 here: a real SigLIP's 64 needs no flag); SigLIP's are
    padded to that length, as SigLIP was trained (transformers' SigLIP docs: padding="max_length"),
    CLIP's to the batch's longest caption."""
    import train_clip

    parquet, _ = _digit_shards(tmp_path)
    start = tmp_path / "start"
    save_tiny_checkpoint(kind, start, digit_texts(), text_length=24)
    widths = []
    training_step = train_clip.training_step

    def recording_step(embedder, model, batch, *args, **kwargs):
        widths.append(batch["input_ids"].shape[1])
        return training_step(embedder, model, batch, *args, **kwargs)

    monkeypatch.setattr(train_clip, "training_step", recording_step)
    train_clip.main(["--model_name_or_path", str(start), "--dataset", str(parquet), "--image_column", "image",
                     "--max_steps", "2", "--global_batch_size", "8", "--eval_steps", "0",
                     "--output_dir", str(tmp_path / "out")])
    if kind == "siglip":
        assert widths == [24, 24]
    else:
        assert len(widths) == 2 and max(widths) < 24  # digit captions are about 12 tokens


def test_streaming_resume_trains_on_the_batches_the_whole_run_would_have(tmp_path):
    """--streaming --save_steps 15: a run resumed from step 15 (one step into the stream's second
    pass, after the first pass's rest rows made its 14th batch) trains at steps 16 to 18 on the
    batches the uninterrupted run trained on: the same losses and the same final weights."""
    import torch
    import train_clip
    from safetensors.torch import load_file

    source = _digit_shards(tmp_path)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    logging = ["--logging_steps", "1"]
    train_clip.main([*stream_args(source, whole, ("parquet", 18)), "--save_steps", "15", *logging])
    resumed.mkdir()
    os.rename(whole / "checkpoint-15", resumed / "checkpoint-15")
    train_clip.main([*stream_args(source, resumed, ("parquet", 18)), "--resume_from_checkpoint", "latest",
                     *logging])

    def losses(out):
        train = json.loads((out / "eval_results.json").read_text())["train"]
        return {point["step"]: point["loss"] for point in train if point["step"] > 15}

    assert list(losses(resumed)) == [16, 17, 18]
    assert losses(resumed) == pytest.approx(losses(whole), rel=1e-5)
    expected, got = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    results = json.loads((resumed / "eval_results.json").read_text())
    assert results["skipped_rows"] == BAD_ROWS  # the replayed batches' bad rows are counted too
