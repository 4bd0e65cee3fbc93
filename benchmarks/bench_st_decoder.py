"""The Qwen3-0.6B decoder embedder in training: InfCLLoss against CachedMNRL, and under FSDP2 / ZeRO-3.

The model is ``examples/train_sentence_transformer.py --preset qwen3-0.6b``, built by the example's
own code (Qwen3-Embedding-0.6B's layout with random weights, a byte-level BPE tokenizer trained on
this run's texts, last-token pooling, Normalize, the query prompt) with the preset's settings: bf16
on a GPU that has it (Accelerate's autocast, fp32 weights and embeddings, as the Trainer runs it),
gradient checkpointing, 128 tokens per text, mini-batches of 64 texts. The weights do not change
the time or memory of a step.

Part ``step`` (one process): a training step (embed, loss, backward, AdamW step) with
``hf_infcl.losses.InfCLLoss(model, mini_batch_size=64)`` and with sentence-transformers'
``CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)`` at each of ``--sizes`` (pairs;
every text exactly 128 random token ids ending in EOS). Each loss first trains one step at
``--warmup-pairs`` (kernels compiled, AdamW state made), and its loss alone runs once at each size
on random embeddings (kernels tuned for that size) before the timed steps; then ``--repeats`` timed
steps per loss at each size, the losses taking turns. Per loss and size: the median step time and
the peak CUDA memory above what was allocated before the step (model, AdamW state, the token ids);
InfCLLoss's row carries its step time and peak over CachedMNRL's.

Part ``sharded`` (under torchrun, one run per invocation): the same model trained by
``SentenceTransformerTrainer`` with ``InfCLLoss(mini_batch_size=64, gather_across_devices=True)``
for one warm-up and ``--steps`` timed steps of ``--batch`` pairs per process (random texts, cut to
128 tokens by the tokenizer, as the example's data is), under ``--engine`` none (one process, or
DDP), fsdp2 (the Trainer's ``--fsdp full_shard`` with FSDP2 over each ``Qwen3DecoderLayer``) or
zero3 (``--deepspeed examples/st_zero3.json``, the config the README gives). Per run: the slowest
process's median step time, and the largest peak CUDA memory of any process (what is allocated at
the step's start, weights and optimizer state, and the step's peak). Its targets: on one process,
zero3's and fsdp2's peak no higher than none's; on two, the 32k-pairs-per-process run of fsdp2
(a 64k contrastive batch) trains.

GPU commands (H100; times include building the model, about 1 min; a 16k-pair step is about
2.5e16 flops per loss, near a minute of GPU time, and an H200 had not finished the warm-ups in
5.3 min, so give ``step`` at its default size 10 min):

    python benchmarks/bench_st_decoder.py step                          # 16k pairs: over 5 min
    python benchmarks/bench_st_decoder.py step --sizes 4k --repeats 2   # a quick look: about 2 min
    for engine in none fsdp2 zero3; do                                  # one GPU: about 2 min each
        torchrun --nproc_per_node 1 benchmarks/bench_st_decoder.py sharded --engine $engine
    done
    torchrun --nproc_per_node 2 benchmarks/bench_st_decoder.py sharded --engine fsdp2 \\
        --batch 32k --steps 1                                           # 2 GPUs, 64k pairs: over 10 min

CPU dry run (qwen3-tiny, a few pairs, gloo; what ``tests/test_bench_st_decoder.py`` runs):

    python benchmarks/bench_st_decoder.py step --cpu
    torchrun --nproc_per_node 1 benchmarks/bench_st_decoder.py sharded --cpu --engine fsdp2

Every row is appended to ``$OUT/bench_st_decoder.csv`` when OUT is set (or to ``--csv``), with the
device, the versions and the preset.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_common import (  # this folder is on sys.path
    Column,
    allocated,
    append_csv_row,
    csv_path,
    device_name,
    format_count,
    free_memory,
    is_out_of_memory,
    max_allocated,
    parse_count,
    peak_above,
    print_table,
    reset_peak,
    synchronize,
    time_steps,
    versions,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]  # the example's builder, and this checkout's hf_infcl

import train_sentence_transformer as example  # noqa: E402

ZERO3_CONFIG = ROOT / "examples" / "st_zero3.json"
ENGINES = ("none", "fsdp2", "zero3")
# FSDP2 units: every decoder layer, the rest (embeddings, final norm) with the root
FSDP2_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
                "reshard_after_forward": True}
# text part of the dry run on CPU (the tiny preset), and of the GPU run
SIZES = {"gpu": dict(sizes="16k", warmup_pairs="256", batch="1024"),
         "cpu": dict(sizes="48", warmup_pairs="16", batch="24")}
WORDS = [f"w{index:04d}" for index in range(2000)]  # the random texts' words
TOKENIZER_PAIRS = 1000  # texts the example's builder trains its tokenizer on
FIELDS = ["part", "preset", "engine", "processes", "loss", "pairs", "mini_batch_size", "tokens", "status",
          "step_s", "steps", "step_times", "peak_gib", "start_gib", "step_vs_cached", "peak_vs_cached",
          "loss_value", "nonfinite_grads", "nonfinite_parameters", "device", "torch", "transformers",
          "sentence_transformers", "deepspeed", "hf_infcl"]


def gib(n_bytes: float) -> float:
    return round(n_bytes / 2**30, 3)


# ---- the model, as the example builds it ---------------------------------------------------------


def preset_arguments(preset: str, cpu: bool, flags=()):
    """(ScriptArguments, SentenceTransformerTrainingArguments) of the example for ``--preset preset``
    and ``flags``: the preset's bf16, gradient checkpointing, sequence length and mini-batch."""
    argv = ["--preset", preset, "--output_dir", tempfile.mkdtemp(prefix="bench_st_decoder_"),
            "--report_to", "none", *(["--use_cpu"] if cpu else []), *flags]
    return example.parse_arguments(argv)


def random_texts(count: int, words: int, seed: int) -> list[str]:
    """``count`` texts of ``words`` words drawn from :data:`WORDS` (each one token of the tokenizer
    trained on them), so that a text is longer than the model's sequence length."""
    draw = random.Random(seed)
    return [" ".join(draw.choices(WORDS, k=words)) for _ in range(count)]


def build_model(script_args, device):
    """The preset's SentenceTransformer by the example's own ``load_model`` (random weights from seed
    0, its tokenizer trained on random texts), in train mode."""
    texts = random_texts(2 * TOKENIZER_PAIRS, script_args.max_seq_length + 16, seed=1)
    data = SimpleNamespace(train=list(zip(texts[::2], texts[1::2])))
    torch.manual_seed(0)
    return example.load_model(script_args, data, str(device)).train()


def autocast_like_accelerate(model, device) -> None:
    """The model's forward under bf16 autocast with fp32 outputs: what Accelerate's ``prepare_model``
    does to the Trainer's model under ``bf16=True`` (its own two wrappers)."""
    from accelerate.utils import convert_outputs_to_fp32

    model.forward = convert_outputs_to_fp32(torch.autocast(device.type, dtype=torch.bfloat16)(model.forward))


def token_columns(model, pairs: int, tokens: int, generator, device) -> list[dict]:
    """Two columns (anchors, positives) of ``pairs`` texts, each ``tokens`` random token ids ending in
    EOS (what last-token pooling reads), in the shape of the model's own ``preprocess``."""
    template = dict(model.preprocess(["a"]))
    vocabulary, eos = model[0].config.vocab_size, model.tokenizer.eos_token_id
    columns = []
    for _ in range(2):
        input_ids = torch.randint(0, vocabulary, (pairs, tokens), generator=generator)
        input_ids[:, -1] = eos
        features = {key: value for key, value in template.items() if not isinstance(value, torch.Tensor)}
        features.update(input_ids=input_ids.to(device), attention_mask=torch.ones_like(input_ids).to(device))
        columns.append(features)
    return columns


# ---- part "step" -----------------------------------------------------------------------------------


def train_step(loss_module, columns, optimizer) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_module([dict(column) for column in columns], None)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def timed_step(loss_module, columns, optimizer) -> tuple[float, int, float]:
    """(seconds, peak bytes above the allocation before it, loss) of one training step."""
    loss_value = []
    peak, seconds = peak_above(
        lambda: time_steps(lambda: loss_value.append(train_step(loss_module, columns, optimizer)), 1)[0])
    return seconds, peak, loss_value[0]


def nonfinite_tensors(optimizer) -> tuple[int, int]:
    """(parameters whose gradient holds a NaN or inf, parameters that do), read after a step: a step
    that trains on a non-finite loss, or leaves the model non-finite, says which."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    grads = sum(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in parameters)
    return grads, sum(not bool(torch.isfinite(p).all()) for p in parameters)


def warm_loss_alone(loss_module, pairs: int, width: int, device) -> None:
    """The loss and its backward on random embeddings of ``pairs`` rows (the mini-batches' cache),
    so that kernel tuning for this size falls outside the timed steps."""
    generator = torch.Generator(device=device).manual_seed(pairs)
    reps = [[torch.randn(pairs, width, generator=generator, device=device, requires_grad=True)]
            for _ in range(2)]
    loss_module.calculate_loss(reps, None, with_backward=True)


def failure_status(error: BaseException) -> str:
    if is_out_of_memory(error):
        return "OOM"
    traceback.print_exc()
    return f"error: {type(error).__name__}: {error}"[:300]


def progress(message: str, started: float = time.perf_counter()) -> None:
    """One line on stderr with the seconds since the script started, so that a run stopped by a
    time limit still says how far it got."""
    print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)


def run_step_part(opts, meta, record) -> None:
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from hf_infcl import losses

    script_args, args = preset_arguments(opts.preset, opts.cpu)
    device = args.device
    model = build_model(script_args, device)
    progress("model built")
    if args.bf16:
        autocast_like_accelerate(model, device)
    if args.gradient_checkpointing:  # mirrors activation_checkpointing where transformers has it
        model.gradient_checkpointing_enable()
    mini_batch = opts.mini_batch_size or script_args.mini_batch_size
    tokens = script_args.max_seq_length
    loss_modules = {"InfCLLoss": losses.InfCLLoss(model, mini_batch_size=mini_batch),
                    "CachedMNRL": CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    generator = torch.Generator().manual_seed(0)
    width = model[1].get_embedding_dimension()  # the pooling's output, what Normalize passes on
    base = dict(part="step", engine="none", processes=1, mini_batch_size=mini_batch, tokens=tokens)
    failed = {}
    warmup = token_columns(model, opts.warmup_pairs, tokens, generator, device)
    for name, loss_module in loss_modules.items():  # kernels compiled, AdamW state made
        try:
            train_step(loss_module, warmup, optimizer)
        except Exception as error:  # noqa: BLE001 - recorded, the other loss goes on
            failed[name] = failure_status(error)
            record({**base, "loss": name, "pairs": opts.warmup_pairs, "status": f"warm-up {failed[name]}"})
        optimizer.zero_grad(set_to_none=True)
        free_memory()
        progress(f"{name}: warm-up step done")
    del warmup
    for pairs in opts.sizes:
        columns = token_columns(model, pairs, tokens, generator, device)
        results = {name: {"seconds": [], "peaks": [], "starts": [], "losses": [], "nonfinite": (0, 0)}
                   for name in loss_modules}
        for name, loss_module in loss_modules.items():
            if name not in failed:
                try:
                    warm_loss_alone(loss_module, pairs, width, device)
                except Exception as error:  # noqa: BLE001
                    results[name]["status"] = failure_status(error)
                free_memory()
                progress(f"{name}: loss alone at {pairs} pairs done")
        for round_index in range(opts.repeats):
            names = list(loss_modules) if round_index % 2 == 0 else list(loss_modules)[::-1]
            for name in names:
                result = results[name]
                if name in failed or "status" in result:
                    continue
                optimizer.zero_grad(set_to_none=True)
                free_memory()
                result["starts"].append(allocated())
                try:
                    seconds, peak, loss_value = timed_step(loss_modules[name], columns, optimizer)
                except Exception as error:  # noqa: BLE001 - an OOM is a result, anything else is reported
                    result["status"] = failure_status(error)
                else:
                    result["seconds"].append(seconds)
                    result["peaks"].append(peak)
                    result["losses"].append(loss_value)
                    result["nonfinite"] = nonfinite_tensors(optimizer)  # outside the timed step
                    progress(f"{name}: a step of {pairs} pairs took {seconds:.2f} s, loss {loss_value:.4f}, "
                             "parameters with a non-finite gradient / value after it: "
                             "{} / {}".format(*result["nonfinite"]))
                optimizer.zero_grad(set_to_none=True)
                free_memory()
        rows = {}
        for name, result in results.items():
            row = {**base, "loss": name, "pairs": pairs}
            status = failed.get(name) or result.get("status")
            if status is not None:
                row["status"] = status if name not in failed else f"skipped after {status}"
            else:
                row.update(status="ok", step_s=round(statistics.median(result["seconds"]), 3),
                           steps=len(result["seconds"]),
                           step_times=" ".join(f"{s:.3f}" for s in result["seconds"]),
                           peak_gib=gib(max(result["peaks"])), start_gib=gib(max(result["starts"])),
                           loss_value=round(result["losses"][-1], 4), nonfinite_grads=result["nonfinite"][0],
                           nonfinite_parameters=result["nonfinite"][1])
            rows[name] = row
        ours, theirs = rows["InfCLLoss"], rows["CachedMNRL"]
        if ours["status"] == theirs["status"] == "ok":
            ours["step_vs_cached"] = round(ours["step_s"] / theirs["step_s"], 3)
            if theirs["peak_gib"]:  # zero on the CPU
                ours["peak_vs_cached"] = round(ours["peak_gib"] / theirs["peak_gib"], 3)
        for row in rows.values():
            record(row)
        del columns
        free_memory()


# ---- part "sharded" --------------------------------------------------------------------------------


def engine_flags(engine: str) -> list[str]:
    """The example's command-line flags (TrainingArguments') for ``engine``."""
    if engine == "fsdp2":
        return ["--fsdp", "full_shard", "--fsdp_config", json.dumps(FSDP2_CONFIG)]
    if engine == "zero3":
        return ["--deepspeed", str(ZERO3_CONFIG)]
    return []


def trainer_class(engine: str, cpu: bool):
    """SentenceTransformerTrainer; on CPU under fsdp2 with the tests' switch to FSDP2 (Accelerate
    applies FSDP on GPUs only), so that the dry run goes through the Trainer's FSDP2 path."""
    from sentence_transformers import SentenceTransformerTrainer

    if not (cpu and engine == "fsdp2"):
        return SentenceTransformerTrainer
    from tests.helpers.trainer_fsdp_workers import CpuFsdpMixin

    class CpuFsdpSentenceTransformerTrainer(CpuFsdpMixin, SentenceTransformerTrainer):
        """SentenceTransformerTrainer under FSDP2 on CPU."""

    return CpuFsdpSentenceTransformerTrainer


def step_meter():
    """A Trainer callback that keeps each optimizer step's seconds (synchronised), the peak memory
    allocated during it and what was allocated at its start."""
    from transformers import TrainerCallback

    class StepMeter(TrainerCallback):
        def __init__(self):
            self.seconds, self.peaks, self.starts = [], [], []
            self._started = 0.0

        def on_step_begin(self, *unused, **also_unused):
            synchronize()
            self.starts.append(allocated())
            reset_peak()
            self._started = time.perf_counter()

        def on_step_end(self, *unused, **also_unused):
            synchronize()
            self.seconds.append(time.perf_counter() - self._started)
            self.peaks.append(max_allocated())
            # Printed as it ends, so that a run cut by a time limit still shows the steps it made.
            print(f"step {len(self.seconds)} ({'warm-up' if len(self.seconds) == 1 else 'timed'}): "
                  f"{self.seconds[-1]:.1f} s, peak {gib(self.peaks[-1])} GiB", flush=True)

    return StepMeter()


def slowest_of_ranks(values: list[float], device) -> list[float]:
    """Each value's maximum over the processes (every process gets it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def run_sharded_part(opts, meta, record) -> None:
    from datasets import Dataset

    from hf_infcl import losses

    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available() and not opts.cpu
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    script_args, _ = preset_arguments(opts.preset, opts.cpu)
    # Built before the Trainer's arguments exist, as the sharded tests' workers do, so that no
    # DeepSpeed zero.Init is active while the example writes and loads the random weights.
    model = build_model(script_args, device)
    mini_batch = opts.mini_batch_size or script_args.mini_batch_size
    steps = opts.steps + 1  # the first is the warm-up
    flags = ["--per_device_train_batch_size", str(opts.batch), "--max_steps", str(steps),
             "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true", "--seed", "0",
             "--dataloader_num_workers", "0", *engine_flags(opts.engine)]
    _, args = preset_arguments(opts.preset, opts.cpu, flags)
    args.prompts = example.side_prompts(model) or None  # the query prompt before the anchors, as the example
    example.checkpoint_the_model_itself(model, args)  # as the example, where the Trainer's call would fail
    if opts.engine == "zero3" and not on_gpu:  # on CPU TrainingArguments leaves DeepSpeed's comms alone
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    texts = random_texts(2 * min(opts.batch * world * steps, 8192), script_args.max_seq_length + 16, seed=2)
    lengths = [len(ids) for ids in model.tokenizer(texts[:32])["input_ids"]]
    if min(lengths) < script_args.max_seq_length:
        raise RuntimeError(f"a random text of {min(lengths)} tokens, under {script_args.max_seq_length}")
    draw = random.Random(3)
    rows = opts.batch * world * steps
    train = Dataset.from_dict({"anchor": draw.choices(texts, k=rows),
                               "positive": draw.choices(texts, k=rows)})
    loss = losses.InfCLLoss(model, mini_batch_size=mini_batch, gather_across_devices=True)
    meter = step_meter()
    trainer = trainer_class(opts.engine, opts.cpu)(model=model, args=args, train_dataset=train, loss=loss,
                                                   callbacks=[meter])
    assert trainer.is_fsdp_enabled == (opts.engine == "fsdp2"), "FSDP2 is not on"
    if trainer.is_fsdp_enabled:  # as the example: Normalize stays in the root's unit
        example.leave_parameterless_norms_to_the_fsdp2_root()
    assert trainer.is_deepspeed_enabled == (opts.engine == "zero3"), "DeepSpeed is not on"
    row = dict(part="sharded", engine=opts.engine, processes=world, loss="InfCLLoss", pairs=opts.batch,
               mini_batch_size=mini_batch, tokens=script_args.max_seq_length)
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001 - an OOM is a result (written by the process that met it)
        record({**row, "status": failure_status(error)}, every_rank=True)
        raise
    timed = slice(1, None)  # after the warm-up
    seconds = slowest_of_ranks(meter.seconds[timed], device)
    peak, start = slowest_of_ranks([max(meter.peaks[timed]), max(meter.starts[timed])], device)
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    record({**row, "status": "ok", "step_s": round(statistics.median(seconds), 3), "steps": len(seconds),
            "step_times": " ".join(f"{s:.3f}" for s in seconds), "peak_gib": gib(peak),
            "start_gib": gib(start),
            "loss_value": round(logged[-1], 4) if logged else ""})


# ---- output ----------------------------------------------------------------------------------------


def print_rows(rows: list[dict], meta: dict) -> None:
    print(f"\n# {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}, "
          f"sentence-transformers {meta['sentence_transformers']}; preset {meta['preset']}")
    columns = [Column("part", 7, align="<"), Column("engine", 6, align="<"), Column("procs", 5),
               Column("loss", 10, align="<"), Column("pairs", 6), Column("step s", 8, ".3f"),
               Column("peak GiB", 8, ".2f"), Column("start GiB", 9, ".2f"),
               Column("x Cached step", 13, ".2f"), Column("x Cached peak", 13, ".2f"),
               Column("status", align="<")]
    print_table(columns, [[row.get("part"), row.get("engine"), row.get("processes"), row.get("loss"),
                           format_count(row["pairs"]), row.get("step_s"), row.get("peak_gib"),
                           row.get("start_gib"), row.get("step_vs_cached") or None,
                           row.get("peak_vs_cached") or None, row.get("status")] for row in rows])
    print("(step: peak above the step's start; sharded: the largest process's peak, start included; "
          "x Cached: InfCLLoss / CachedMNRL)")


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["step", "sharded"])
    parser.add_argument("--preset", choices=list(example.PRESETS), default=None,
                        help="default qwen3-0.6b (qwen3-tiny with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="a dry run on the CPU (tiny sizes; gloo)")
    parser.add_argument("--sizes", default=None, help="step: pairs per step, e.g. 4k,16k (default 16k)")
    parser.add_argument("--warmup-pairs", default=None, help="step: pairs of each loss's warm-up step (256)")
    parser.add_argument("--repeats", type=int, default=1, help="step: timed steps per loss and size")
    parser.add_argument("--engine", choices=ENGINES, default="none", help="sharded: none, fsdp2 or zero3")
    parser.add_argument("--batch", default=None, help="sharded: pairs per process and step (default 1024)")
    parser.add_argument("--steps", type=int, default=2, help="sharded: timed steps after one warm-up")
    parser.add_argument("--mini-batch-size", type=int, default=None,
                        help="texts per mini-batch (default: the preset's, 64)")
    parser.add_argument("--csv", default=None, help="append rows here (default $OUT/bench_st_decoder.csv)")
    opts = parser.parse_args(argv)
    defaults = SIZES["cpu" if opts.cpu else "gpu"]
    opts.preset = opts.preset or ("qwen3-tiny" if opts.cpu else "qwen3-0.6b")
    opts.sizes = [parse_count(size) for size in (opts.sizes or defaults["sizes"]).split(",")]
    opts.warmup_pairs = parse_count(opts.warmup_pairs or defaults["warmup_pairs"])
    opts.batch = parse_count(opts.batch or defaults["batch"])
    for name in ("repeats", "steps", "mini_batch_size"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if min(opts.sizes + [opts.warmup_pairs, opts.batch]) < 1:
        parser.error("--sizes, --warmup-pairs and --batch must be >= 1")
    if opts.part == "sharded" and "WORLD_SIZE" not in os.environ:
        parser.error("the sharded part runs under torchrun: torchrun --nproc_per_node N "
                     "benchmarks/bench_st_decoder.py sharded ...")
    if not opts.cpu and not torch.cuda.is_available():
        parser.error("no CUDA GPU: pass --cpu for a dry run")
    return opts


def main(argv=None) -> int:
    opts = parse_options(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if opts.cpu and opts.engine == "zero3":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported
    meta = {"device": device_name("cpu" if opts.cpu else "cuda"), "preset": opts.preset,
            **versions("torch", "transformers", "sentence_transformers", "deepspeed", "hf_infcl")}
    rank = int(os.environ.get("RANK", "0"))
    path = csv_path(opts.csv, "bench_st_decoder.csv")
    rows = []

    def record(row: dict, every_rank: bool = False) -> None:
        if rank != 0 and not every_rank:
            return
        row = {**{key: meta.get(key, "") for key in FIELDS}, **row}
        rows.append(row)
        print(json.dumps({key: value for key, value in row.items() if value not in ("", None)}), flush=True)
        append_csv_row(path, row, FIELDS)

    (run_step_part if opts.part == "step" else run_sharded_part)(opts, meta, record)
    if rank == 0:
        print_rows(rows, meta)
    errors = [row for row in rows if str(row.get("status", "")).startswith(("error", "warm-up error"))]
    return 1 if errors else 0


if __name__ == "__main__":
    code = main()
    if code == 0 and "WORLD_SIZE" in os.environ:  # under torchrun: no interpreter shutdown (gloo's threads)
        from tests.helpers.trainer_fixtures import end_worker_process

        end_worker_process()
    sys.exit(code)
