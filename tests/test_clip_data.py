"""``examples/train_clip.py`` on real-data layouts: parquet and webdataset shards of the bundled
digits, streamed (``--streaming``) and in memory, in one process and in two (gloo); which rows
each process trained on is recorded by ``tests/helpers/clip_rows_worker.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.clip_rows_worker import read_rows
from tests.helpers.offline import run_two_processes
from tests.test_examples import _digit_shards

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import clip_model  # noqa: E402  (the model side of train_clip, from examples/)
import image_text_batches  # noqa: E402  (the data pipeline, from examples/)

WORKER = ROOT / "tests" / "helpers" / "clip_rows_worker.py"
BAD_ROWS = {"image does not decode": 1, "empty caption": 1}  # what _digit_shards puts in shard 0

pytest.importorskip("datasets")


# ---- in memory: every row once per epoch -------------------------------------------------------


@pytest.mark.parametrize("rows", [64, 51, 49, 37, 33])  # 37 = 2 x 18 + 1: a last batch of one row
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("equal_shares", [False, True])
def test_rank_batches_give_every_row_once_per_epoch(rows, world, equal_shares):
    from image_text_batches import RankBatches

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
    """Parquet shards in memory, 2 DataLoader workers per process making pieces of 5 rows (a
    process's batch of 16 or 8 rows is 4 or 2 pieces), 1 process or 2 (gloo), 2 epochs: every row
    is decoded in a worker, never in a training process, and both workers decode parts of each
    batch of several pieces; within each epoch the processes' rows are disjoint and together the
    whole train split (the last step's shares are uneven with 2 processes: 51 rows, batches of 16,
    3 + 3 rows split 2 + 1); the bad image, met by a worker of one process or the other in each
    epoch, is counted once."""
    parquet, _ = _digit_shards(tmp_path)
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    arguments = ["--dataset", str(parquet), "--image_column", "image", "--output_dir", str(out),
                 "--max_train_samples", "51", "--global_batch_size", "16", "--max_steps", "8",
                 "--eval_steps", "0", "--dataloader_num_workers", "2"]
    env = {"CLIP_ROWS_DIR": str(rows_dir), "CLIP_PIECE_ROWS": "5"}
    if world == 1:
        import train_clip

        from tests.helpers.clip_rows_worker import install

        for name, value in env.items():
            monkeypatch.setenv(name, value)
        install(monkeypatch.setattr)  # DataLoader workers fork from this process: they record too
        train_clip.main(arguments)
        training_pids = {os.getpid()}
    else:
        run_two_processes(WORKER, *arguments, env=env, timeout=300)
        training_pids = {r["pid"] for r in read_rows(rows_dir) if r.get("training_process")}
        assert len(training_pids) == 2
    recorded = [r for r in read_rows(rows_dir) if "index" in r]
    decoding_pids = {r["pid"] for r in recorded}
    assert len(decoding_pids) == 2 * world and not decoding_pids & training_pids
    for epoch in (0, 1):  # (the join thread's prefetching may have begun epoch 2)
        by_rank = [[r["index"] for r in recorded if (r["epoch"], r["rank"]) == (epoch, rank)]
                   for rank in range(world)]
        assert world == 1 or not set(by_rank[0]) & set(by_rank[1])
        together = [index for rank_rows in by_rank for index in rank_rows]
        assert sorted(together) == list(range(51)), epoch
        for rank in range(world):
            for number in range(3):  # the full batches: 16 // world rows, more than one piece
                batch = [r for r in recorded if (r["epoch"], r["rank"], r["batch"]) == (epoch, rank, number)]
                assert len(batch) == 16 // world and len({r["pid"] for r in batch}) == 2, batch
    results = json.loads((out / "eval_results.json").read_text())
    assert results["skipped_rows"] == BAD_ROWS


def _digits_pieces_setup(rows=48):
    """The example's default processor and a :class:`PairDataset` of ``rows`` digits, as main
    builds them, and its join (a :class:`PairCollate`)."""
    import train_clip

    from bundled_data import load_image_caption_data

    model_args, data_args, _ = train_clip.parse_arguments([])
    data = load_image_caption_data("digits", seed=42)
    clip, processor, _ = clip_model.load_model_and_processor(model_args, data_args, data, seed=42)
    examples = data.train[:rows]
    dataset = image_text_batches.PairDataset(examples, image_text_batches.group_ids(data, examples),
                                     processor.image_processor, seed=42)
    collate = image_text_batches.make_collate(processor.tokenizer, clip_model.caption_length(clip, None))
    return dataset, collate


class _WorkerTaggedPairs:
    """A :class:`PairDataset` whose pieces say which DataLoader worker made them."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, piece):
        import torch

        return {**self.dataset.__getitems__(piece), "worker": torch.utils.data.get_worker_info().id}


def test_pieces_from_several_workers_make_one_batch_in_order():
    """Batches of 16 rows cut into pieces of 5 (5 + 5 + 5 + 1), made by 2 DataLoader workers in
    turn: the pieces arrive in the sampler's order, and each batch joined from them equals the
    batch made in one piece (the same rows, pixel values, captions and their padding, groups)."""
    import torch

    dataset, collate = _digits_pieces_setup()
    sampler = image_text_batches.RankBatches(len(dataset), 16, 0, 1, seed=7)
    loader = torch.utils.data.DataLoader(_WorkerTaggedPairs(dataset), num_workers=2,
                                         batch_sampler=image_text_batches.EpochBatches(sampler, 5),
                                         collate_fn=image_text_batches.batch_as_is)
    assert len(loader) == 3 * 4
    pieces = list(loader)
    assert [piece["batch"] for piece in pieces] == [(0, n, i == 3) for n in range(3) for i in range(4)]
    assert [piece["worker"] for piece in pieces] == [0, 1] * 6  # the workers take turns
    assert [len(piece["captions"]) for piece in pieces] == [5, 5, 5, 1] * 3
    assert all(piece["pixel_values"].dtype == torch.float32 for piece in pieces)

    batches = image_text_batches.epoch_batches(loader, sampler, {}, collate)
    for number, indices in enumerate(list(sampler)):
        joined = next(batches)
        whole = collate([dataset.__getitems__((0, number, True, indices))])
        assert joined.keys() == whole.keys()
        for name in whole:
            torch.testing.assert_close(joined[name], whole[name], rtol=0, atol=0, msg=name)
    resumed = image_text_batches.epoch_batches(loader, sampler, {}, collate, step=2)  # skips 2 batches
    torch.testing.assert_close(next(resumed)["pixel_values"], whole["pixel_values"], rtol=0, atol=0)
    # their DataLoader iterators and workers end now, not whenever they are garbage collected
    batches.close()
    resumed.close()


def test_training_batches_resumed_at_a_step_give_the_batches_of_the_whole_run():
    """``image_text_batches.training_batches``, the pipeline's entry point, in memory: the batches
    of a run resumed at step 4 (in the second epoch of 3 steps) are the uninterrupted run's from
    its fifth on, made by DataLoader workers and joined ahead in a thread."""
    import torch

    dataset, collate = _digits_pieces_setup()
    from bundled_data import load_image_caption_data

    data = load_image_caption_data("digits", seed=42)
    data.train = data.train[:48]
    image_processor = dataset.image_processor

    def batches(step):
        sampler = image_text_batches.RankBatches(48, 16, 0, 1, seed=7)
        return image_text_batches.training_batches(
            data, sampler, collate, image_processor, batch_size=16, rank=0, world=1, seed=7, num_workers=2,
            shuffle_buffer_size=1, step=step)

    whole, resumed = batches(0), batches(4)
    try:
        expected = [next(whole) for _ in range(6)][4:]
        for batch in expected:
            got = next(resumed)
            assert got.keys() == batch.keys() and len(got["input_ids"]) == 16
            for name in batch:
                torch.testing.assert_close(got[name], batch[name], rtol=0, atol=0, msg=name)
    finally:
        whole.close()
        resumed.close()


def test_pieces_carry_pixel_values_in_the_mixed_precision_dtype():
    """--mixed_precision bf16: the workers' pixel values are bf16, the fp32 ones rounded; the
    vision tower's patch embedding, under autocast, computes the same from either."""
    import torch

    dataset, collate = _digits_pieces_setup(rows=8)
    piece = (0, 0, True, list(range(8)))
    fp32 = dataset.__getitems__(piece)["pixel_values"]
    dataset.pixel_dtype = torch.bfloat16
    bf16 = collate([dataset.__getitems__(piece)])["pixel_values"]
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, fp32.to(torch.bfloat16), rtol=0, atol=0)
    convolution = torch.nn.Conv2d(3, 4, 4, stride=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # what CLIP's and SigLIP's embeddings do: the pixels cast to the weights' dtype first
        torch.testing.assert_close(convolution(bf16.to(torch.float32)), convolution(fp32), rtol=0, atol=0)


def test_an_error_in_the_join_thread_reaches_the_training_loop_with_its_message(tmp_path, monkeypatch):
    """Joining a batch fails (in Prefetched's thread): the run ends with that exception and its
    message, and the thread has ended."""
    import threading

    import train_clip

    def failing_join(self, pieces):
        raise RuntimeError(f"cannot join {len(pieces)} pieces")

    monkeypatch.setattr(image_text_batches, "PIECE_ROWS", 5)
    monkeypatch.setattr(image_text_batches.PairCollate, "__call__", failing_join)
    with pytest.raises(RuntimeError, match=r"^cannot join 4 pieces$"):
        # no DataLoader workers: the traceback pytest keeps would keep them alive after the test
        train_clip.main(["--max_steps", "2", "--global_batch_size", "16", "--eval_steps", "0",
                         "--dataloader_num_workers", "0", "--output_dir", str(tmp_path / "out")])
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("join-batches")]


def test_prefetched_makes_the_next_batch_ahead_and_ends_cleanly():
    import threading
    import time


    made = []

    def batches():
        for number in range(3):
            made.append(number)
            yield number
        raise ValueError("the data ran out after 3 batches")

    ahead = image_text_batches.Prefetched(batches())
    assert next(ahead) == 0
    for _ in range(100):  # the thread makes batch 1 while batch 0 is in use
        if made == [0, 1]:
            break
        time.sleep(0.05)
    assert made == [0, 1]
    assert [next(ahead), next(ahead)] == [1, 2]
    with pytest.raises(ValueError, match="the data ran out after 3 batches"):
        next(ahead)
    ahead.close()
    ended = image_text_batches.Prefetched(n for n in range(5))  # closed with a batch made ahead
    assert next(ended) == 0
    ended.close()
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("join-batches")]


# ---- streaming -------------------------------------------------------------------------------


def stream_args(source, out, steps):
    parquet, tars = source
    data = (["--dataset", str(parquet), "--image_column", "image"] if steps[0] == "parquet"
            else ["--dataset", str(tars), "--image_column", "png", "--caption_column", "txt"])
    # 2 rows held out, so that the bad rows 3 and 5 of shard 0 reach the DataLoader workers
    return [*data, "--streaming", "--held_out_samples", "2", "--max_steps", str(steps[1]),
            "--per_device_train_batch_size", "4", "--shuffle_buffer_size", "8", "--eval_steps", "0",
            "--dataloader_num_workers", "2", "--output_dir", str(out)]


def test_streaming_batches_join_pieces_in_order_and_carry_a_pass_rest_into_the_next():
    """Two workers' pieces of 3 rows (and a last piece of 2 or 1) in the DataLoader's turn order:
    batches of 4 rows are the rows in arrival order, a piece cut where a batch ends; the 2 rows
    left after a pass open the next pass's first batch; a resumed run drops its first batches
    unjoined and goes on with the same ones; each piece's skipped rows are collected."""
    import torch

    from image_text_stream import endless_batches

    def piece(rows, skipped=None):
        return {"pixel_values": torch.tensor(rows, dtype=torch.float32).reshape(-1, 1),
                "captions": [str(row) for row in rows], "groups": torch.tensor(rows),
                "skipped": skipped or {}}

    class Pieces:
        batch_size, pairs, epoch = 4, type("Pairs", (), {"path": "shards"}), 0
        joined = []

        def set_epoch(self, epoch):
            self.epoch = epoch

        def collate(self, pieces):
            self.joined.append(len(pieces))
            return {"rows": [int(v) for p in pieces for v in p["pixel_values"].flatten()],
                    "captions": [c for p in pieces for c in p["captions"]]}

    def loader():  # a pass: worker 0 has rows 0-6, worker 1 rows 100-104 (+ the pass number)
        base, bad = 1000 * dataset.epoch, {"bad": "image does not decode"}
        return [piece([base + r for r in (0, 1, 2)]), piece([base + r for r in (100, 101, 102)]),
                piece([base + r for r in (3, 4, 5)], bad), piece([base + 103, base + 104]),
                piece([base + 6]), piece([], bad)]

    class Loader:
        def __iter__(self):
            return iter(loader())

    dataset, skipped = Pieces(), {}
    batches = endless_batches(Loader(), dataset, skipped)
    pass_rows = [0, 1, 2, 100, 101, 102, 3, 4, 5, 103, 104, 6]  # 12 rows: 3 batches, nothing left
    got = [next(batches)["rows"] for _ in range(3)]
    assert got == [pass_rows[:4], pass_rows[4:8], pass_rows[8:]]
    assert skipped == {"bad": "image does not decode"}
    dataset.batch_size = 5  # 12 rows a pass: 2 batches and 2 rows left, which open the next pass's
    dataset.joined.clear()
    whole = endless_batches(Loader(), dataset, {})
    made = [next(whole) for _ in range(5)]
    got = [batch["rows"] for batch in made]
    second = [1000 + row for row in pass_rows]
    assert got == [pass_rows[:5], pass_rows[5:10], pass_rows[10:] + second[:3], second[3:8],
                   second[8:] + [2000]]  # the third pass's first row ends the fifth batch
    assert all(batch["captions"] == [str(row) for row in batch["rows"]] for batch in made)  # cut alike
    resumed = endless_batches(Loader(), dataset, {}, skip_batches=3)
    dataset.joined.clear()
    assert [next(resumed)["rows"] for _ in range(2)] == got[3:]
    assert len(dataset.joined) == 2  # the 3 dropped batches were not joined


@pytest.mark.parametrize("layout", ["parquet", "webdataset"])
def test_streaming_one_process_reads_each_row_once_per_pass_and_counts_bad_rows(tmp_path, layout,
                                                                               monkeypatch):
    import train_clip

    from tests.helpers.clip_rows_worker import install

    source = _digit_shards(tmp_path)
    rows_dir, out = tmp_path / "rows", tmp_path / "out"
    rows_dir.mkdir()
    monkeypatch.setenv("CLIP_ROWS_DIR", str(rows_dir))
    monkeypatch.setenv("CLIP_PIECE_ROWS", "3")
    install(monkeypatch.setattr)  # DataLoader workers fork from this process: they record too
    # 2 shards of 30 rows, 2 held out, 2 bad: 56 good rows, one shard per worker (26 and 30), in
    # pieces of 3 (and a last one of 2) joined into batches of 4: 14 steps are exactly one pass,
    # over every good row (the join thread's prefetching may then begin the next pass).
    train_clip.main(stream_args(source, out, (layout, 14)))
    recorded = read_rows(rows_dir)
    first_pass = [r["caption"] for r in recorded if r["epoch"] == 0]
    assert len(first_pass) == 56 and len(set(first_pass)) == len(first_pass)
    assert os.getpid() not in {r["pid"] for r in recorded}  # decoded in the workers
    assert len({r["pid"] for r in recorded if r["epoch"] == 0}) == 2
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
    # one shard per process: 28 (26 good) and 30 rows, pieces of 3, batches of 4 (6 and 7 full
    # ones, and each process's 2 rows left wait for its next pass), 8 steps cover a pass each
    run_two_processes(WORKER, *stream_args(source, out, (layout, 8)),
                      env={"CLIP_ROWS_DIR": str(rows_dir), "CLIP_PIECE_ROWS": "3"}, timeout=300)
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
    """A tiny CLIPModel, SiglipModel or Siglip2Model with its processor, saved as a Hub checkpoint would be;
    ``text_length``: its text tower's max_position_embeddings."""
    import torch
    from transformers import CLIPProcessor, SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor

    from tiny_clip import build_image_processor, build_tiny_clip, build_word_tokenizer

    tokenizer = build_word_tokenizer(texts, max_length=text_length)
    if kind == "siglip2":  # NaFlex: at most 4 patches of 4 x 4 pixels per image
        from tiny_clip import model_for, processor_for, tiny_config

        config = tiny_config("siglip2", tokenizer, image_size=8, patch_size=4, width=32, layers=1,
                             max_text_length=text_length)
        model, processor = model_for(config), processor_for(config, tokenizer)
    elif kind == "clip":
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
    padding = "max_length" if model.config.model_type in ("siglip", "siglip2") else True

    def features(output):
        return F.normalize(output if torch.is_tensor(output) else output.pooler_output, dim=-1)

    with torch.no_grad():
        prompts = [TEMPLATE.format(name=name) for name in DIGITS.split(",")]
        text = processor.tokenizer(prompts, padding=padding, truncation=True, max_length=32,
                                   return_tensors="pt")
        classes = features(model.get_text_features(**text))
        pixels = processor.image_processor(images=[image for image, _ in rows], return_tensors="pt")
        images = features(model.get_image_features(**pixels))  # SigLIP 2: with its mask and shapes
    labels = torch.tensor([label for _, label in rows])
    return float(((images @ classes.T).argmax(1) == labels).float().mean())


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
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
    assert arguments["loss"] == ("softmax" if kind == "clip" else "sigmoid")
    if kind != "clip":  # the model's own bias trained (and saved), not a fresh one beside it
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


# ---- SigLIP 2: NaFlex batches, rows with different numbers of patches -----------------------------

# (height, width) of the images: at most 4 patches of 4 x 4 pixels each, 4, 3 or 2 of them
NAFLEX_SHAPES = [(8, 8), (4, 12), (12, 4), (4, 8), (8, 4), (16, 16)]


def naflex_images(rows, seed=0):
    """``rows`` (image, caption) of noisy colour patches in every shape of NAFLEX_SHAPES, in turn."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    made = []
    for index in range(rows):
        height, width = NAFLEX_SHAPES[index % len(NAFLEX_SHAPES)]
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        pixels[..., index % 3] = 255
        pixels = np.clip(pixels.astype(int) + rng.integers(-40, 40, pixels.shape), 0, 255).astype(np.uint8)
        colour = ("red", "green", "blue")[index % 3]
        made.append((Image.fromarray(pixels), f"a {colour} patch {height} by {width} number {index}"))
    return made


def test_a_naflex_batch_gives_the_models_own_loss_and_gradients():
    """A tiny SigLIP 2 from the example's config (--model_type siglip2) on a batch made as in
    training (pieces of several image shapes, joined): the rows have different numbers of patches,
    and the example's step, without and with chunks, equals Siglip2Model's own loss
    (``return_loss=True``), with every parameter's gradient."""
    import torch
    import train_clip

    from bundled_data import ImageCaptionData, ImageCaptionExample

    examples = [ImageCaptionExample(image, (caption,)) for image, caption in naflex_images(12)]
    data = ImageCaptionData("naflex", train=examples, held_out=[])
    model_args, data_args, _ = train_clip.parse_arguments(["--model_type", "siglip2", "--tiny_width", "32"])
    siglip2, processor, _ = clip_model.load_model_and_processor(model_args, data_args, data, seed=0)
    assert type(siglip2).__name__ == "Siglip2Model"
    with torch.no_grad():  # away from the initial scale 1 and bias 0
        siglip2.logit_scale.fill_(1.7)
        siglip2.logit_bias.fill_(-2.3)
    groups = image_text_batches.group_ids(data, examples)
    dataset = image_text_batches.PairDataset(examples, groups, processor.image_processor, seed=0)
    collate = image_text_batches.make_collate(processor.tokenizer, 32, padding="max_length")
    batch = image_text_batches.joined_batch([dataset.__getitems__((0, 0, False, list(range(5)))),
                                     dataset.__getitems__((0, 0, True, list(range(5, 12))))], collate)
    assert {"pixel_values", "pixel_attention_mask", "spatial_shapes"} <= batch.keys()
    assert set(batch["pixel_attention_mask"].sum(1).tolist()) == {2, 3, 4}  # patches per row
    batch_groups = batch.pop("groups")

    siglip2.zero_grad()
    expected = siglip2(**batch, return_loss=True).loss
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in siglip2.named_parameters() if p.grad is not None}
    arguments = SimpleNamespace(loss="sigmoid", symmetric=True, mask_false_negatives=False, backend="torch",
                                precision="ieee")
    for chunk in (None, 5):
        siglip2.zero_grad()
        embedder = clip_model.ClipEmbedder(siglip2, model_bias=True)
        loss_fn = clip_model.clip_loss(arguments, batch_groups)
        loss = train_clip.training_step(embedder, embedder, batch, loss_fn, chunk)
        assert float(loss) == pytest.approx(float(expected), rel=1e-5), chunk
        grads = {name.removeprefix("clip."): p.grad for name, p in embedder.named_parameters()
                 if p.grad is not None}
        assert grads.keys() == expected_grads.keys()
        assert "vision_model.embeddings.patch_embedding.weight" in grads
        for name, value in expected_grads.items():
            torch.testing.assert_close(grads[name], value, rtol=1e-4, atol=1e-6, msg=f"{name}, chunk {chunk}")


def naflex_csv(folder, rows=60):
    lines = ["image_path,caption"]
    for index, (image, caption) in enumerate(naflex_images(rows)):
        image.save(folder / f"{index}.png")
        lines.append(f"{index}.png,{caption}")
    (folder / "pairs.csv").write_text("\n".join(lines))
    return folder / "pairs.csv"


@pytest.mark.parametrize("start", ["config", "checkpoint"])
def test_train_clip_trains_siglip2_on_naflex_batches(tmp_path, start, monkeypatch):
    """SigLIP 2 through the example: a tiny one from a config (--model_type siglip2) or a local
    checkpoint (--model_name_or_path, loaded as a Hub id is), on images of several shapes, with
    chunks: every batch reaches the model with its patch mask and shapes, the sigmoid loss trains
    the model's own scale and bias, and the saved model reloads with its processor."""
    import torch
    import train_clip
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoProcessor

    csv = naflex_csv(tmp_path)
    patches = []
    training_step = train_clip.training_step

    def recording_step(embedder, model, batch, *args, **kwargs):
        patches.append(set(batch["pixel_attention_mask"].sum(1).tolist()))
        return training_step(embedder, model, batch, *args, **kwargs)

    monkeypatch.setattr(train_clip, "training_step", recording_step)
    model = ["--model_type", "siglip2"]
    if start == "checkpoint":
        captions = [caption for _, caption in naflex_images(60)]
        before = save_tiny_checkpoint("siglip2", tmp_path / "start", captions)
        model = ["--model_name_or_path", str(tmp_path / "start")]
    out = tmp_path / "out"
    final = train_clip.main([*model, "--dataset", str(csv), "--max_steps", "3", "--global_batch_size", "16",
                             "--chunk_size", "6", "--eval_steps", "0", "--output_dir", str(out)])
    assert len(patches) == 3 and all(len(counts) > 1 for counts in patches), patches
    assert json.loads((out / "training_args.json").read_text())["loss"] == "sigmoid"
    assert 0 <= final["image_to_text_recall@1"] <= 1
    reloaded, processor = AutoModel.from_pretrained(out), AutoProcessor.from_pretrained(out)
    assert type(reloaded).__name__ == "Siglip2Model"
    assert processor.image_processor.max_num_patches == 4 and processor.image_processor.patch_size == 4
    after = load_file(str(out / "model.safetensors"))
    if start == "checkpoint":
        assert not torch.equal(after["logit_bias"], before["logit_bias"])
        assert not torch.equal(after["vision_model.embeddings.patch_embedding.weight"],
                               before["vision_model.embeddings.patch_embedding.weight"])


@pytest.mark.parametrize("family", ["clip-without-model-type", "siglip2"])
def test_config_name_builds_the_configs_family(tmp_path, family):
    """--config_name: a CLIP config json without its model_type (as the streaming benchmark writes
    it) builds a CLIPModel, a saved Siglip2Config a Siglip2Model with its NaFlex processor; both
    with the word-level tokenizer over the captions."""
    import train_clip
    from transformers import Siglip2Config

    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    if family == "siglip2":
        Siglip2Config(text_config=tower, vision_config={**tower, "patch_size": 4, "num_patches": 4}
                      ).save_pretrained(tmp_path)
        config = tmp_path / "config.json"
    else:
        config = tmp_path / "clip.json"
        config.write_text(json.dumps({"projection_dim": 16,
                                      "vision_config": {**tower, "image_size": 8, "patch_size": 4},
                                      "text_config": {**tower, "max_position_embeddings": 16}}))
    model_args, data_args, _ = train_clip.parse_arguments(["--config_name", str(config)])
    data = SimpleNamespace(vocabulary_text=lambda: ["a red patch", "a blue patch"])
    model, processor, _ = clip_model.load_model_and_processor(model_args, data_args, data, seed=0)
    expected = "Siglip2Model" if family == "siglip2" else "CLIPModel"
    assert type(model).__name__ == expected
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    images = processor.image_processor(images=[image for image, _ in naflex_images(3)], return_tensors="pt")
    assert ("spatial_shapes" in images) == (family == "siglip2")

