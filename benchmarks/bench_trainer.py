"""Largest trainable batch and samples/s: plain ``Trainer`` (CLIP's own loss) vs ``InfCLTrainer``.

The model is a CLIP ViT-B/32-sized ``CLIPModel`` built from its config (random weights: memory and
speed do not depend on them), 224 px images, 77-token texts, bf16 mixed precision (``bf16=True``),
AdamW. Batches are synthetic; for runs without offload they are drawn straight on the GPU so that
the input pipeline times nothing, and with offload they sit in pinned host memory (bf16 pixels),
as a real offloaded batch would.

Steps:
1. B_v: the largest batch the plain ``Trainer`` with ``return_loss=True`` trains for two steps
   without running out of memory (doubling from --start-batch, then bisection to --resolution).
2. The largest batch ``InfCLTrainer`` trains for one step with chunk 256 and offload, trying
   ``--ours-factors`` x B_v (32 first; the bar is >= 32 x B_v). Host memory bounds this: 32 x B_v
   pairs of bf16 224 px images take 32 x B_v x 0.3 MB of pinned memory.
3. samples/s at B_v: vanilla, ours without chunking, ours with chunk 256, ours with chunk 256 and
   offload (--warmup untimed steps, then --steps timed ones); on a GPU also the chunked two with
   ``chunk_cuda_graphs=False``, and those with every chunk replayed
   (``cached_step(keep_last_chunk=False)``: the eager chunks' last one not kept).

The table is printed last; CSV rows (with device and versions) go to $OUT/bench_trainer.csv when
$OUT is set, or to --csv.

    python benchmarks/bench_trainer.py                 # one H100, about 5-8 minutes
    python benchmarks/bench_trainer.py --tiny          # a CPU smoke run of the whole script

``--profile`` trains one more, untimed step per config of step 3 under torch.profiler and prints how
long the GPU was busy in it and its kernels by name.

Under ``torchrun`` both trainers run DDP, each rank on its own GPU with ``--vanilla-batch`` pairs
(rank 0's step time is reported):

    torchrun --nproc_per_node 2 benchmarks/bench_trainer.py --vanilla-batch 1536 --ours-factors ""

``--fsdp MODEL`` measures the same two figures under FSDP2 on every GPU of the machine, for
``decoder-1.5b`` (a Qwen2-1.5B-shaped decoder DualEncoder, last-token pooling, 128-token queries
and documents) or ``vit-l14`` (CLIP ViT-L/14 at 224 px): the largest global batch of the plain
Trainer (the model's own loss on each rank's batch) and of InfCLTrainer with ``--chunk-size``, and
pairs/s of both at the plain Trainer's largest batch. Every trial is a fresh ``torchrun`` (an
out-of-memory rank takes its peers down with it instead of leaving them waiting):

    python benchmarks/bench_trainer.py --fsdp decoder-1.5b --ours-batches 65536
    python benchmarks/bench_trainer.py --fsdp decoder-1.5b --tiny     # CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import sys
import time
from unittest import mock

import torch
from bench_common import (
    Column,
    csv_path,
    device_name,
    free_memory,
    is_out_of_memory,
    print_table,
    versions,
    write_csv,
)
from bench_common import synchronize as synchronize_device
from torch.utils.data import Dataset
from transformers import CLIPConfig, CLIPModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

from hf_infcl import InfCLTrainer, InfCLTrainingArguments
from hf_infcl.grad_cache import cached_step
from hf_infcl.sharding import prepare_for_sharding

IMAGE_SIZE = 224
TEXT_LENGTH = 77
# pinned host bytes per pair with offload: bf16 pixels, int64 ids and mask
HOST_BYTES_PER_PAIR = 3 * IMAGE_SIZE * IMAGE_SIZE * 2 + 2 * TEXT_LENGTH * 8


def available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def clip_b32_config(tiny: bool) -> CLIPConfig:
    if tiny:
        text = dict(vocab_size=1000, bos_token_id=998, eos_token_id=999, hidden_size=32,
                    intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    max_position_embeddings=TEXT_LENGTH)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=IMAGE_SIZE, patch_size=32)
        return CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)
    # openai/clip-vit-base-patch32
    text = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                num_attention_heads=8, max_position_embeddings=TEXT_LENGTH)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=IMAGE_SIZE, patch_size=32)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=512)


class Indices(Dataset):
    """n placeholder examples; the collator makes the synthetic batch."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return {"index": index}


class SyntheticPairs:
    """Collator: random pixels and token ids (eos last) for as many pairs as it is given."""

    def __init__(self, config: CLIPConfig, device: torch.device, on_host: bool, return_loss: bool):
        self.vocab = config.text_config.vocab_size
        self.eos = config.text_config.eos_token_id
        self.device = device
        self.on_host = on_host
        self.return_loss = return_loss
        self.pinned = {}  # batch size -> its pinned pixel batch

    def __call__(self, features):
        n = len(features)
        if self.on_host:
            pixels = self.pinned_pixels(n)
            ids = torch.randint(0, self.vocab - 2, (n, TEXT_LENGTH))
        else:
            pixels = torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, device=self.device)
            ids = torch.randint(0, self.vocab - 2, (n, TEXT_LENGTH), device=self.device)
        ids[:, -1] = self.eos
        batch = {"pixel_values": pixels, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.return_loss:
            batch["return_loss"] = True
        return batch

    def pinned_pixels(self, n: int) -> torch.Tensor:
        """A pinned bf16 host batch of ``n`` images, filled once from a small random pool and
        returned again at every step (nothing writes to it after): pinning 0.3 MB per pair anew each
        step is the input pipeline's work (a DataLoader pins in its own thread, beside the step),
        not the step's, and with several ranks pinning at once it would weigh on the timed steps."""
        if n not in self.pinned:
            pool = torch.randn(256, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bfloat16)
            pixels = torch.empty(n, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bfloat16,
                                 pin_memory=torch.cuda.is_available())
            for start in range(0, n, len(pool)):
                stop = min(start + len(pool), n)
                pixels[start:stop] = pool[: stop - start]
            self.pinned[n] = pixels
        return self.pinned[n]


class StepTimer(TrainerCallback):
    """Wall time at the end of every step (after a device synchronisation)."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        synchronize_device()
        self.ends.append(time.perf_counter())

    def seconds_per_step(self, warmup: int) -> float:
        """Mean seconds of the steps after the first ``warmup`` (NaN with fewer than two ends)."""
        timed = self.ends[warmup - 1:] if warmup >= 1 else self.ends
        return (timed[-1] - timed[0]) / (len(timed) - 1) if len(timed) > 1 else float("nan")


class StepProfiler(TrainerCallback):
    """torch.profiler over one step (the ``step``-th, 1-based): how much of its wall time the GPU
    was busy (the union of kernel intervals; two streams overlap, so the kernels' sum can exceed
    it), and its kernels grouped by name."""

    def __init__(self, step: int):
        self.step, self.profiler, self.report = step, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            from torch.profiler import ProfilerActivity, profile

            synchronize_device()
            # CPU: no kernels to report, but the --tiny smoke run still goes through the code
            cuda = torch.cuda.is_available()
            self.profiler = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None or state.global_step != self.step:
            return
        synchronize_device()
        wall_ms = (time.perf_counter() - self.started) * 1e3
        self.profiler.__exit__(None, None, None)
        kernels = [event for event in self.profiler.events()
                   if event.device_type == torch.autograd.DeviceType.CUDA]
        self.profiler = None
        busy_us, end_us = 0.0, float("-inf")
        for start, stop in sorted((k.time_range.start, k.time_range.end) for k in kernels):
            busy_us += max(0.0, stop - max(start, end_us))
            end_us = max(end_us, stop)
        by_name, calls = {}, {}
        for kernel in kernels:
            name = kernel.name[:100]
            by_name[name] = by_name.get(name, 0.0) + kernel.device_time / 1e3
            calls[name] = calls.get(name, 0) + 1
        busy_ms = busy_us / 1e3
        lines = [f"step {wall_ms:.1f} ms, GPU busy {busy_ms:.1f} ms ({busy_ms / wall_ms:.0%}), kernels "
                 f"{sum(by_name.values()):.1f} ms in {len(kernels)} launches; by name (ms, launches):"]
        for name, ms in sorted(by_name.items(), key=lambda item: -item[1])[:25]:
            lines.append(f"      {ms:8.2f} {calls[name]:6d}  {name}")
        self.report = "\n".join(lines)


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def print_rows(rows, widths, peak: str = "peak GiB") -> None:
    """The results table; ``widths``: of the measure, config, unit and "vs" columns."""
    measure, config, unit, versus = widths
    columns = [Column("measure", measure, align="<"), Column("config", config, align="<"), Column("batch", 8),
               Column("value", 10), Column("", unit, align="<", gap="  "), Column("vs", versus, align="<"),
               Column(peak, align="<")]
    print_table(columns, [(row["measure"], row["config"], row["batch"], row["value"], row["unit"],
                           row.get("ratio", ""), row.get("peak_gib", "")) for row in rows])


def run(kind: str, batch: int, steps: int, options, chunk_size=None, offload=False, cuda_graphs=None,
        warmup=1, profile=False, replay_every_chunk=False):
    """Train ``steps`` steps; return (seconds per step after ``warmup`` steps, peak GiB), or None
    when the device (or, with offload, pinned host memory) runs out of memory. ``profile``: one
    more step under the profiler, outside the timed ones; its report is printed.
    ``replay_every_chunk``: the cached step with ``keep_last_chunk=False`` (the A/B of keeping
    the last chunk's activations instead of replaying it)."""
    config = clip_b32_config(options.tiny)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    common = dict(output_dir=os.path.join(options.work_dir, kind), per_device_train_batch_size=batch,
                  max_steps=steps + (1 if profile else 0), bf16=not options.tiny, report_to="none",
                  save_strategy="no", logging_strategy="no", disable_tqdm=True, remove_unused_columns=False,
                  dataloader_pin_memory=False, use_cpu=not torch.cuda.is_available(), seed=0)
    timer = StepTimer()
    profiler = StepProfiler(steps + 1) if profile else None
    callbacks = [timer] + ([profiler] if profiler else [])
    trainer = model = None
    free_memory(reset_peak_stats=True)
    try:
        torch.manual_seed(0)
        with device:  # initialise on the GPU: much faster than on the host for 150M parameters
            model = CLIPModel(config)
        if kind == "vanilla":
            args = TrainingArguments(**common)
            collator = SyntheticPairs(config, device, on_host=False, return_loss=True)
            trainer = Trainer(model=model, args=args, train_dataset=Indices(batch * common["max_steps"]),
                              data_collator=collator, callbacks=callbacks)
        else:
            args = InfCLTrainingArguments(**common, chunk_size=chunk_size, offload=offload,
                                          chunk_cuda_graphs=cuda_graphs)
            collator = SyntheticPairs(config, device, on_host=offload, return_loss=False)
            trainer = InfCLTrainer(model=model, args=args, train_dataset=Indices(batch * common["max_steps"]),
                                   data_collator=collator, callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)
        every_chunk = functools.partial(cached_step, keep_last_chunk=False)
        with (mock.patch("hf_infcl.trainer.cached_step", every_chunk) if replay_every_chunk
              else contextlib.nullcontext()):
            trainer.train()
        peak = peak_gib()
        if profiler is not None and profiler.report and int(os.environ.get("RANK", "0")) == 0:
            print(f"    profile of {kind}: {profiler.report}", flush=True)
        graphs = getattr(trainer, "_chunk_graphs", None)
        if graphs is not None:  # what the cached step's chunks ran as
            failed = f"; eager after a failed capture: {graphs.failure}" if graphs.failure else ""
            print(f"    CUDA graphs: {graphs.captured} captured{failed}", flush=True)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        print(f"    out of memory: {str(error).splitlines()[0][:120]}", flush=True)
        return None
    finally:
        if trainer is not None:
            trainer.accelerator.free_memory()
        del trainer, model
        free_memory(reset_peak_stats=True)
    if profile:
        timer.ends = timer.ends[:steps]  # the profiled step is not timed
    return timer.seconds_per_step(warmup), peak


def fits(kind, batch, options, **kwargs):
    result = run(kind, batch, 2 if kind == "vanilla" else 1, options, **kwargs)
    status = "ok" if result is not None else "OOM"
    print(f"  {kind:<24} batch {batch:>8}: {status}"
          + (f" (peak {result[1]:.1f} GiB)" if result else ""), flush=True)
    return result is not None


def largest_vanilla_batch(options) -> int:
    low, high = 0, None
    batch = options.start_batch
    while high is None:
        if batch > options.max_batch:
            return low
        if fits("vanilla", batch, options):
            low, batch = batch, batch * 2
        else:
            high = batch
    while high - low > max(options.resolution, 1):
        middle = (low + high) // 2 // options.resolution * options.resolution
        if middle <= low:
            break
        if fits("vanilla", middle, options):
            low = middle
        else:
            high = middle
    return low


# ---- FSDP2 ---------------------------------------------------------------------------------


def fsdp_model(name: str, tiny: bool, device):
    """(model, wrapped layer class name, collator(n, return_loss)) of an --fsdp setting."""
    if name == "vit-l14":
        from transformers.models.clip.modeling_clip import CLIPEncoderLayer

        if tiny:
            config = clip_b32_config(True)
        else:  # openai/clip-vit-large-patch14
            text = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=TEXT_LENGTH)
            vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                          num_attention_heads=16, image_size=IMAGE_SIZE, patch_size=14)
            config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=768)
        with device:
            model = CLIPModel(config)
        pairs = SyntheticPairs(config, device, on_host=False, return_loss=False)

        def collate(n, return_loss):
            pairs.return_loss = return_loss
            return pairs([None] * n)
        return model, CLIPEncoderLayer.__name__, collate

    from transformers import Qwen2Config

    from hf_infcl.dual_encoder import DualEncoder

    if tiny:
        config = Qwen2Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    else:  # Qwen/Qwen2-1.5B
        config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                             num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                             max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True)
    with device:
        model = DualEncoder.from_encoders(config, pooling="last", learn_scale=True, logit_scale_init=20.0)
    # fully_shard refuses 0-d parameters: InfCLTrainer reshapes them itself, the plain Trainer does not
    model.log_logit_scale = torch.nn.Parameter(model.log_logit_scale.detach().reshape(1))
    length = 128

    def collate(n, return_loss):
        batch = {}
        for side in ("query", "doc"):
            batch[f"{side}_input_ids"] = torch.randint(0, config.vocab_size, (n, length), device=device)
            batch[f"{side}_attention_mask"] = torch.ones(n, length, dtype=torch.long, device=device)
        if return_loss:
            batch["return_loss"] = True
        return batch
    return model, "Qwen2DecoderLayer", collate


def fsdp_trial(options) -> None:
    """One trial under torchrun: ``--trial-kind`` (vanilla or infcl) at ``--trial-batch`` pairs per
    rank for ``--steps`` steps; rank 0 writes seconds per step and peak memory to ``--trial-out``."""
    import json

    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model, layer_class, collate = fsdp_model(options.fsdp, options.tiny, device)
    vanilla = options.trial_kind == "vanilla"
    batch = options.trial_batch
    common = dict(output_dir=os.path.join(options.work_dir, "fsdp"), per_device_train_batch_size=batch,
                  max_steps=options.steps, bf16=cuda, report_to="none", save_strategy="no",
                  logging_strategy="no", disable_tqdm=True, remove_unused_columns=False,
                  dataloader_pin_memory=False, use_cpu=not cuda, seed=0)
    if options.engine == "zero3":
        common["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}}
    else:
        common.update(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [layer_class],
                                              "reshard_after_forward": True})
    timer = StepTimer()

    def collator(features):
        return collate(len(features), vanilla)
    if vanilla:
        # the plain Trainer cannot shard a CLIPModel as it comes (a 0-d logit_scale, and no single
        # input embedding for Accelerate to wrap): it gets the preparation InfCLTrainer applies
        prepare_for_sharding(model)
        trainer = Trainer(model=model, args=TrainingArguments(**common), data_collator=collator,
                          train_dataset=Indices(batch * options.steps * 8), callbacks=[timer])
    else:
        args = InfCLTrainingArguments(**common, chunk_size=options.chunk_size,
                                      chunk_gradient_sync=options.chunk_sync,
                                      chunk_parameter_gather=options.gather)
        trainer = InfCLTrainer(model=model, args=args, data_collator=collator,
                               train_dataset=Indices(batch * options.steps * 8), callbacks=[timer])
    trainer.remove_callback(PrinterCallback)
    if not cuda:  # Accelerate enables FSDP on GPUs only: the CPU smoke run checks the rest
        print("no GPU: the smoke run trains without FSDP", flush=True)
    trainer.train()
    peak = peak_gib()
    per_step = timer.seconds_per_step(options.warmup)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(options.trial_out, "w") as handle:
            json.dump({"seconds_per_step": per_step, "peak_gib": peak}, handle)
    dist.barrier()
    dist.destroy_process_group()


def fsdp_run(options, kind: str, batch: int, steps: int, warmup: int):
    """Launch one trial (``batch`` pairs per rank); (seconds per step, peak GiB) or None on OOM."""
    import json
    import socket
    import subprocess
    import tempfile

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    handle, out = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(options.gpus),
               "--master_port", str(port), os.path.abspath(__file__), "--fsdp", options.fsdp,
               "--trial-kind", kind, "--trial-batch", str(batch), "--trial-out", out,
               "--steps", str(steps), "--warmup", str(warmup), "--chunk-size", str(options.chunk_size),
               "--work-dir", options.work_dir, "--engine", options.engine, "--chunk-sync", options.chunk_sync,
               "--gather", options.gather] + (["--tiny"] if options.tiny else [])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python_path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    finished = subprocess.run(command, env=environment, capture_output=True, text=True,
                              timeout=options.trial_timeout)
    seconds = time.perf_counter() - started
    if finished.returncode != 0:
        log = finished.stdout + finished.stderr
        # cuBLAS reports a full device as a failed handle allocation
        if any(sign in log for sign in ("out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")):
            return None
        raise RuntimeError(f"trial {kind} at {batch}/rank failed:\n{log[-4000:]}")
    with open(out) as handle:
        result = json.load(handle)
    print(f"    ({seconds:.0f} s)", flush=True)
    return result["seconds_per_step"], result["peak_gib"]


def fsdp_main(options, device_name: str) -> None:
    gpus = options.gpus
    label = {"decoder-1.5b": "Qwen2-1.5B-shaped decoder DualEncoder, 128 tokens",
             "vit-l14": "CLIP ViT-L/14, 224 px"}[options.fsdp]
    started = time.perf_counter()
    rows = []
    engine = "FSDP2" if options.engine == "fsdp2" else "ZeRO-3"
    ours_label = f"InfCLTrainer chunk {options.chunk_size}, {engine}, sync {options.chunk_sync}" + (
        f", gather {options.gather}" if options.engine == "fsdp2" else "")

    def fits_fsdp(kind, per_rank):
        result = fsdp_run(options, kind, per_rank, 2 if kind == "vanilla" else 1, warmup=1)
        print(f"  {kind:<8} global batch {per_rank * gpus:>8}: " + (f"ok (peak {result[1]:.1f} GiB)" if result
                                                                     else "OOM"), flush=True)
        return result is not None

    print(f"1. the plain Trainer's largest global batch under {engine} on {gpus} GPUs ({label}):", flush=True)
    low, high, per_rank = 0, None, options.start_batch
    if options.vanilla_batch:  # given: no search
        low, per_rank = options.vanilla_batch // gpus, options.max_batch + 1
    while high is None and per_rank <= options.max_batch:
        if fits_fsdp("vanilla", per_rank):
            low, per_rank = per_rank, per_rank * 2
        else:
            high = per_rank
    while high is not None and high - low > options.resolution:
        middle = (low + high) // 2 // options.resolution * options.resolution
        if middle <= low:
            break
        if fits_fsdp("vanilla", middle):
            low = middle
        else:
            high = middle
    b_v = low * gpus
    print(f"   B_v = {b_v}", flush=True)
    if low == 0:
        sys.exit("the plain Trainer did not fit even --start-batch; lower it")
    rows.append(dict(measure="largest batch", config=f"plain Trainer, {engine}", batch=b_v, value=b_v,
                     unit="pairs"))

    print(f"2. {ours_label}:", flush=True)
    ours = 0
    for global_batch in [int(b) for b in options.ours_batches.split(",") if b]:
        if not fits_fsdp("infcl", global_batch // gpus):
            break
        ours = global_batch
    if ours:
        config = ours_label
        rows.append(dict(measure="largest batch tried", config=config, batch=ours, value=ours, unit="pairs",
                         ratio=f"{ours / b_v:.0f} x B_v"))

    print(f"3. pairs/s at B_v = {b_v} ({options.warmup} warm-up + {options.steps} timed):", flush=True)
    vanilla_rate = None
    measured = [] if options.skip_rate else [(f"plain Trainer, {engine}", "vanilla"), (ours_label, "infcl")]
    for config, kind in measured[1:] if options.ours_rate_only else measured:
        result = fsdp_run(options, kind, low, options.warmup + options.steps, warmup=max(options.warmup, 1))
        rate = b_v / result[0] if result else float("nan")
        vanilla_rate = rate if kind == "vanilla" else vanilla_rate
        rows.append(dict(measure="pairs/s at B_v", config=config, batch=b_v, value=f"{rate:.1f}",
                         unit="pairs/s", peak_gib=f"{result[1]:.1f}" if result else "OOM",
                         ratio=f"{rate / vanilla_rate:.0%} of plain" if vanilla_rate else ""))
        print(f"  {config}: {rate:.1f} pairs/s", flush=True)
    print(f"\nbench_trainer --fsdp {options.fsdp} ({label}, bf16, {gpus} x {device_name}; "
          f"{time.perf_counter() - started:.0f} s)")
    print_rows(rows, (20, 36, 8, 16), peak="peak GiB/rank")

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and batches: a smoke run (CPU)")
    parser.add_argument("--start-batch", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=None, help="stop doubling above this (vanilla)")
    parser.add_argument("--resolution", type=int, default=None, help="bisection step for B_v")
    parser.add_argument("--ours-factors", default="32",
                        help="comma list of multiples of B_v to try for ours ('' skips step 2)")
    parser.add_argument("--vanilla-batch", type=int, default=None,
                        help="take B_v as given instead of searching for it (step 1)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps for samples/s")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="step 3: one more step per config under torch.profiler (not timed): GPU busy "
                             "time and kernels by name")
    parser.add_argument("--work-dir", default="/tmp/bench_trainer")
    parser.add_argument("--fsdp", choices=["decoder-1.5b", "vit-l14"], default=None,
                        help="measure this model under FSDP2 on every GPU (see the module docstring)")
    parser.add_argument("--ours-batches", default="65536",
                        help="--fsdp: comma list of global batches to try for ours")
    parser.add_argument("--trial-timeout", type=int, default=900, help="--fsdp: seconds per trial")
    parser.add_argument("--skip-rate", action="store_true", help="--fsdp: skip the pairs/s measurement")
    parser.add_argument("--ours-rate-only", action="store_true",
                        help="--fsdp: pairs/s of InfCLTrainer only (the plain Trainer measured before)")
    parser.add_argument("--engine", choices=["fsdp2", "zero3"], default="fsdp2",
                        help="--fsdp: shard with FSDP2 or DeepSpeed ZeRO-3 (both trainers)")
    parser.add_argument("--chunk-sync", choices=["step", "chunk"], default="step",
                        help="--fsdp: InfCLTrainer's chunk_gradient_sync")
    parser.add_argument("--gather", choices=["step", "chunk"], default="step",
                        help="--fsdp: InfCLTrainer's chunk_parameter_gather (FSDP2)")
    for name in ("--trial-kind", "--trial-batch", "--trial-out"):  # internal: one --fsdp trial
        parser.add_argument(name, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.trial_kind is not None:
        options.trial_batch = int(options.trial_batch)
        fsdp_trial(options)
        return
    if options.fsdp is not None:
        options.gpus = max(torch.cuda.device_count(), 1) if not options.tiny else 2
        options.start_batch = options.start_batch or (4 if options.tiny else 64)
        options.max_batch = options.max_batch or (8 if options.tiny else 1 << 16)
        options.resolution = options.resolution or (4 if options.tiny else 32)
        if options.tiny:
            options.ours_batches = "32"
        fsdp_main(options, device_name())
        return
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        # under torchrun (DDP, --vanilla-batch per GPU): each rank's model and batches on its own GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if options.start_batch is None:
        options.start_batch = 8 if options.tiny else 1024
    if options.max_batch is None:
        options.max_batch = 32 if options.tiny else 1 << 20
    if options.resolution is None:
        options.resolution = 8 if options.tiny else 256
    device = device_name(cpu=platform.processor() or "cpu")
    packages = versions("torch", "transformers")
    print(f"device: {device}; torch {packages['torch']}, transformers {packages['transformers']}", flush=True)
    started = time.perf_counter()
    rows = []

    print("1. B_v, the largest batch of the plain Trainer (return_loss=True):", flush=True)
    b_v = options.vanilla_batch or largest_vanilla_batch(options)
    print(f"   B_v = {b_v}", flush=True)
    if b_v == 0:
        sys.exit("the plain Trainer did not fit even --start-batch; lower it")

    print(f"2. the largest batch of InfCLTrainer, chunk {options.chunk_size} + offload:", flush=True)
    ours_max, host_limited = 0, False
    # the offloaded batch lives in pinned host memory, twice while the next one is collated
    host_cap = int(0.8 * available_host_bytes() / HOST_BYTES_PER_PAIR)
    for factor in [float(f) for f in options.ours_factors.split(",") if f]:
        batch = int(factor * b_v)
        if batch > host_cap:
            print(f"  {factor:g} x B_v = {batch} pairs needs {batch * HOST_BYTES_PER_PAIR / 2**30:.0f} GiB "
                  f"of pinned host memory; trying the host's limit {host_cap} instead", flush=True)
            batch, host_limited = host_cap, True
        if batch <= ours_max or not fits("infcl-chunk-offload", batch, options, chunk_size=options.chunk_size,
                                         offload=True):
            break
        ours_max = batch
        if host_limited:
            break
    rows.append(dict(measure="largest batch", config="vanilla Trainer", batch=b_v, value=b_v, unit="pairs"))
    if options.ours_factors:  # (none asked for: nothing was searched)
        bound = " (host-memory bound)" if host_limited else ""
        rows.append(dict(measure="largest batch", config=f"InfCLTrainer chunk {options.chunk_size} + offload",
                         batch=ours_max, value=ours_max, unit="pairs",
                         ratio=f"{ours_max / b_v:.1f} x B_v{bound}"))

    print(f"3. samples/s at B_v = {b_v} ({options.warmup} warm-up + {options.steps} timed):", flush=True)
    configs = [
        ("vanilla Trainer", "vanilla", {}),
        ("InfCLTrainer, no chunking", "infcl", {}),
        # the defaults: CUDA graphs wherever chunk_cuda_graphs=None finds them exact (one GPU here)
        (f"InfCLTrainer, chunk {options.chunk_size}", "infcl-chunk", {"chunk_size": options.chunk_size}),
        (f"InfCLTrainer, chunk {options.chunk_size} + offload", "infcl-chunk-offload",
         {"chunk_size": options.chunk_size, "offload": True}),
    ]
    if torch.cuda.is_available():
        configs += [
            (f"InfCLTrainer, chunk {options.chunk_size}, chunk_cuda_graphs=False", "infcl-chunk-eager",
             {"chunk_size": options.chunk_size, "cuda_graphs": False}),
            (f"InfCLTrainer, chunk {options.chunk_size} + offload, chunk_cuda_graphs=False",
             "infcl-chunk-offload-eager",
             {"chunk_size": options.chunk_size, "offload": True, "cuda_graphs": False}),
            # eager chunks keep the last one (graphs replay every chunk): the A/B of keeping it
            (f"InfCLTrainer, chunk {options.chunk_size}, chunk_cuda_graphs=False, every chunk replayed",
             "infcl-chunk-eager-replay-all",
             {"chunk_size": options.chunk_size, "cuda_graphs": False, "replay_every_chunk": True}),
            (f"InfCLTrainer, chunk {options.chunk_size} + offload, chunk_cuda_graphs=False, "
             "every chunk replayed",
             "infcl-chunk-offload-eager-replay-all",
             {"chunk_size": options.chunk_size, "offload": True, "cuda_graphs": False,
              "replay_every_chunk": True}),
        ]
    vanilla_rate = None
    for label, kind, kwargs in configs:
        result = run(kind, b_v, options.warmup + options.steps, options, warmup=max(options.warmup, 1),
                     profile=options.profile, **kwargs)
        if result is None:
            rate, peak = float("nan"), float("nan")
            print(f"  {label}: OOM at B_v", flush=True)
        else:
            rate, peak = b_v / result[0], result[1]
            print(f"  {label}: {rate:.1f} samples/s, peak {peak:.1f} GiB", flush=True)
        vanilla_rate = rate if kind == "vanilla" else vanilla_rate
        rows.append(dict(measure="samples/s at B_v", config=label, batch=b_v, value=f"{rate:.1f}",
                         unit="samples/s", peak_gib=f"{peak:.1f}",
                         ratio=f"{rate / vanilla_rate:.1%} of vanilla" if vanilla_rate else ""))

    elapsed = time.perf_counter() - started
    common = dict(device=device, **packages, model="tiny" if options.tiny else "CLIP ViT-B/32",
                  precision="fp32" if options.tiny else "bf16")
    fields = ["measure", "config", "batch", "value", "unit", "ratio", "peak_gib", *common]
    out_path = csv_path(options.csv, "bench_trainer.csv")
    if out_path:
        write_csv(out_path, [{**common, **row} for row in rows], fields)
        print(f"CSV: {out_path}")

    print(f"\nbench_trainer ({common['model']}, {common['precision']}, {device}; {elapsed:.0f} s)")
    print_rows(rows, (18, 40, 10, 18))

if __name__ == "__main__":
    main()
