"""``InfCLTrainingArguments``: ``TrainingArguments`` plus the contrastive-loss options of
:class:`~hf_infcl.InfCLTrainer`.

A module of its own, as TRL keeps each ``XConfig`` in a file beside its ``XTrainer``: scripts
parse these arguments (``HfArgumentParser``) without building a Trainer, and the options are
checked here once, at parse time. The package exports the class as ``hf_infcl.InfCLTrainingArguments``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from transformers import TrainingArguments

from .ops.options import (
    BACKENDS,
    FALSE_NEGATIVE_STRATEGIES,
    GROUP_POSITIVES,
    LOSSES,
    PRECISIONS,
    BackendName,
    FalseNegativeStrategy,
    GroupPositives,
    LossKind,
    Precision,
    check_bool,
    check_choice,
    check_chunk_size,
    check_chunking,
    check_distillation_weight,
    check_false_negative_margin,
    check_graphs_chunking,
    check_label_smoothing,
    check_matryoshka,
    check_matryoshka_dims,
    check_matryoshka_weights,
)

__all__ = ["CHECKPOINTING_ARGUMENT", "CHUNK_GRADIENT_SYNCS", "CHUNK_PARAMETER_GATHERS", "FIELD_CHECKS",
           "TEACHER_COLUMNS", "InfCLTrainingArguments"]

ChunkGradientSync = Literal["step", "chunk"]
CHUNK_GRADIENT_SYNCS: tuple[str, ...] = get_args(ChunkGradientSync)
ChunkParameterGather = Literal["step", "chunk"]
CHUNK_PARAMETER_GATHERS: tuple[str, ...] = get_args(ChunkParameterGather)
# The batch columns of a teacher's precomputed embeddings of the rows and of the keys (distillation_weight).
TEACHER_COLUMNS: tuple[str, str] = ("teacher_query_embeds", "teacher_key_embeds")

# The training argument that turns activation checkpointing on, by the installed transformers'
# name: activation_checkpointing from 5.20 (which keeps gradient_checkpointing as an alias that
# warns when set), gradient_checkpointing before. Reading args.gradient_checkpointing works in both.
CHECKPOINTING_ARGUMENT: str = ("activation_checkpointing" if "activation_checkpointing"
                               in TrainingArguments.__dataclass_fields__ else "gradient_checkpointing")

FieldCheck = Callable[[str, Any], None]  # (field name, value) -> None, or a ValueError/TypeError naming it


def _choice(vocabulary: tuple[str, ...], *, optional: bool = False) -> FieldCheck:
    """One of the strings of ``vocabulary`` (or None, when ``optional``): ``check_choice``'s message."""
    return lambda name, value: check_choice(name, value, vocabulary, optional=optional)


def _number(kind: type, *, above: float | None = None, at_least: float | None = None,
            below: float | None = None, optional: bool = False) -> FieldCheck:
    """A number of ``kind`` (``int``; or ``float``, which takes ints too; never a bool) within the
    given bounds, or None when ``optional``: TypeError for another type, ValueError out of bounds."""
    accepted = (int,) if kind is int else (int, float)
    bounds = [text for text in (f"> {above}" if above is not None else None,
                                f">= {at_least}" if at_least is not None else None,
                                f"< {below}" if below is not None else None) if text]
    rule = f"{'an int' if kind is int else 'a float'}{' ' if bounds else ''}{' and '.join(bounds)}"
    rule += " or None" if optional else ""

    def check(name: str, value) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise TypeError(f"{name} must be {rule}, got {type(value).__name__}")
        # written so that NaN fails every bound
        if not ((above is None or value > above) and (at_least is None or value >= at_least)
                and (below is None or value < below)):
            raise ValueError(f"{name} must be {rule}, got {value!r}")

    return check


def _optional_str(name: str, value) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")


# The one check of each field InfCLTrainingArguments adds to TrainingArguments, run by its
# __post_init__ in this order (tests/test_options.py fails for an added field missing here).
def _optional_label_smoothing(name: str, value) -> None:
    """None (the model's own loss's), or the loss's label smoothing (its one check; the loss kind
    and the groups are checked with the model, by the Trainer)."""
    if value is not None:
        check_label_smoothing(value, "softmax", name=name)


def _optional_distillation_weight(name: str, value) -> None:
    """None (no distillation), or distillation's mix (its one check)."""
    if value is not None:
        check_distillation_weight(value, name)


def _optional(check) -> FieldCheck:
    """None (not set), or ``check(value, name=name)``: the option's one check."""
    def optional_check(name: str, value) -> None:
        if value is not None:
            check(value, name=name)

    return optional_check


FIELD_CHECKS: dict[str, FieldCheck] = {
    "chunk_size": check_chunk_size,
    "no_grad_chunk_size": check_chunk_size,
    "offload": check_bool,
    "chunk_cuda_graphs": lambda name, value: check_bool(name, value, optional=True),
    "loss_backend": _choice(BACKENDS),
    "precision": _choice(PRECISIONS),
    "contrastive_loss": _choice(LOSSES, optional=True),
    "symmetric": check_bool,
    "label_smoothing": _optional_label_smoothing,
    "logit_scale_max": _number(float, above=0, optional=True),
    "group_column": _optional_str,
    "group_positives": _choice(GROUP_POSITIVES, optional=True),
    "false_negative_margin": lambda name, value: check_false_negative_margin(value, name),
    "false_negative_strategy": _choice(FALSE_NEGATIVE_STRATEGIES),
    "chunk_gradient_sync": _choice(CHUNK_GRADIENT_SYNCS),
    "chunk_parameter_gather": _choice(CHUNK_PARAMETER_GATHERS),
    "eval_block_rows": _number(int, above=0),
    "distillation_weight": _optional_distillation_weight,
    "teacher_logit_scale": _number(float, above=0, optional=True),
    "matryoshka_dims": _optional(check_matryoshka_dims),
    "matryoshka_weights": _optional(check_matryoshka_weights),
}


@dataclass
class InfCLTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the contrastive-loss options of :class:`InfCLTrainer`.

    The loss options keep the Trainer's prefixed names: ``loss_backend`` is ``contrastive_loss``'s
    ``backend`` and the field ``contrastive_loss`` (a string, or None to follow the model) is its
    ``loss`` (docs/contract.md, "Options"). Their types are the ``Literal`` vocabularies of
    ``hf_infcl.ops.options``, so ``HfArgumentParser`` lists the choices; ``__post_init__`` checks
    every field this class adds once, each by its entry in ``FIELD_CHECKS`` (type, then range or
    choice), with a ValueError or TypeError naming the field.
    """

    # Checked by __post_init__ (FIELD_CHECKS, every added field): a command line's own numeric
    # checks need not repeat them.
    checked_numeric_fields: ClassVar[tuple[str, ...]] = tuple(FIELD_CHECKS)

    chunk_size: int | None = field(
        default=None,
        metadata={"help": "Rows per encoder chunk for gradient caching (GradCache). None: no caching, the "
                          "encoders see the whole per-device batch at once."},
    )
    no_grad_chunk_size: int | None = field(
        default=None,
        metadata={"help": "Rows per chunk of the cached step's first, gradient-free pass (None: chunk_size). "
                          "That pass keeps no activations, so larger chunks fit and run faster. The replays "
                          "then cannot redraw that pass's random numbers: the gradients are exact only for "
                          "models that draw none in training (dropout 0, as CLIP's default configuration). "
                          "Needs chunk_size; not with chunk_cuda_graphs."},
    )
    offload: bool = field(
        default=False,
        metadata={"help": "Keep the batch in pinned host memory and move one chunk at a time to the device. "
                          "Needs chunk_size."},
    )
    chunk_cuda_graphs: bool | None = field(
        default=None,
        metadata={"help": "Run the chunks of a cached step (chunk_size) as CUDA graphs, one per chunk shape, "
                          "with the two towers on two CUDA streams: removes the kernel-launch overhead that "
                          "makes small chunks of a small model slow. Keeps about one chunk's activations and "
                          "one gradient buffer per chunk shape allocated between steps. None (default): on "
                          "wherever the graphs give the eager step's gradients (CUDA, one process or DDP "
                          "with the gradients averaged after the step, no torch_compile, FSDP, DeepSpeed, "
                          "gradient checkpointing or layerdrop, the gradient buffers within 1/8 of the GPU's "
                          "memory), else off, the reason logged once; a chunk call that cannot be captured "
                          "runs eagerly from then on, with a warning. True: on, an error where they cannot "
                          "run. False: off."},
    )
    loss_backend: BackendName = field(
        default="auto",
        metadata={"help": "Backend of the loss: 'auto' (Triton on CUDA when available), 'torch', 'triton' "
                          "or 'reference' (materialised, small batches only)."},
    )
    precision: Precision = field(
        default="auto",
        metadata={"help": "Matmul precision of the loss for fp32 embeddings: 'auto' (TF32 on CUDA in every "
                          "backend, exact fp32 elsewhere), 'tf32' or 'ieee' (exact fp32). bf16/fp16 "
                          "embeddings are unaffected."},
    )
    contrastive_loss: LossKind | None = field(
        default=None,
        metadata={"help": "'softmax' (InfoNCE/CLIP) or 'sigmoid' (SigLIP). None: 'sigmoid' for models with a "
                          "logit_bias (SigLIP), else 'softmax'."},
    )
    symmetric: bool = field(
        default=True,
        metadata={"help": "Softmax loss: average the row->key and key->row directions, as CLIP does."},
    )
    label_smoothing: float | None = field(
        default=None,
        metadata={"help": "Softmax loss: label smoothing of every cross-entropy term, in [0, 1], as "
                          "torch.nn.functional.cross_entropy defines it (computed without the b x b matrix). "
                          "None: the model's own loss's (0.1 for AlignModel, 0 otherwise)."},
    )
    logit_scale_max: float | None = field(
        default=100.0,
        metadata={"help": "Clamp each learned log-scale so that the scale exp(logit_scale) is at most this "
                          "after each optimizer step (CLIP uses 100; CLAP's two scales too; ALIGN's "
                          "temperature is not clamped). None disables the clamp."},
    )
    group_column: str | None = field(
        default=None,
        metadata={"help": "Batch column of integer group ids: rows and keys of the same group are not "
                          "negatives of each other (duplicate captions, the same document twice)."},
    )
    group_positives: GroupPositives | None = field(
        default=None,
        metadata={"help": "With group_column: the keys of a row's group are its positives (several "
                          "captions of one image). 'any': -log of the softmax mass on them (MIL-NCE); "
                          "'each': the mean of -log p over them (SupCon). None: they are left out of the "
                          "negatives only."},
    )
    false_negative_margin: float | None = field(
        default=None,
        metadata={"help": "Leave out of each row's negatives the keys whose similarity (the model's own, "
                          "detached) is above the positive's minus this margin (negative: only keys more "
                          "than |margin| above it). None: off."},
    )
    false_negative_strategy: FalseNegativeStrategy = field(
        default="absolute",
        metadata={"help": "How false_negative_margin is applied: 'absolute' (positive's score minus the "
                          "margin) or 'relative' (minus |positive's score| times the margin)."},
    )
    chunk_gradient_sync: ChunkGradientSync = field(
        default="step",
        metadata={"help": "With chunk_size under DDP or FSDP2: 'step' reduces the encoders' gradients once "
                          "per step (sync off during the replays; under FSDP2 the replays accumulate "
                          "unsharded gradients), 'chunk' after every chunk's replay (FSDP2: sharded "
                          "gradient memory, one reduce-scatter per chunk)."},
    )
    chunk_parameter_gather: ChunkParameterGather = field(
        default="step",
        metadata={"help": "With chunk_size under FSDP2: 'step' gathers each sharded unit's parameters once "
                          "per step and keeps them unsharded through the chunks (the memory of the unsharded "
                          "parameters), 'chunk' lets FSDP2 gather them for every chunk's forward and again "
                          "for its backward."},
    )
    eval_block_rows: int = field(
        default=1024,
        metadata={"help": "Rows per block when evaluation ranks every key for each row (memory "
                          "eval_block_rows x eval set size)."},
    )
    distillation_weight: float | None = field(
        default=None,
        metadata={"help": "Distil a teacher over every key of the batch: the loss is (1 - w) * InfoNCE + w * "
                          "KL(teacher's softmax || student's) per row, w in [0, 1] "
                          "(hf_infcl.contrastive_distillation_loss). The batches carry the teacher's "
                          "embeddings of the rows and keys in the columns teacher_query_embeds and "
                          "teacher_key_embeds ([batch, teacher_dim] each), or InfCLTrainer(teacher=...) "
                          "embeds them. Softmax loss only; evaluation's "
                          "losses stay the contrastive loss. None: no distillation."},
    )
    teacher_logit_scale: float | None = field(
        default=None,
        metadata={"help": "With distillation_weight: the teacher's logit scale (its inverse temperature), "
                          "which multiplies the dot products of its embeddings. None: a teacher model's own "
                          "scale (InfCLTrainer(teacher=...)), else the student's of the step, without "
                          "gradient."},
    )

    matryoshka_dims: list[int] | None = field(
        default=None,
        metadata={"help": "Matryoshka representation learning: strictly descending prefix widths, e.g. "
                          "768 512 256 128 64; the loss is the weighted sum of the loss on each prefix of "
                          "the embeddings, L2-normalised (hf_infcl.contrastive_loss's matryoshka_dims; one "
                          "loss call per width). None: the loss on the whole embeddings."},
    )
    matryoshka_weights: list[float] | None = field(
        default=None,
        metadata={"help": "With matryoshka_dims: one non-negative weight per width (None: 1 each)."},
    )

    def __post_init__(self):
        for name, check in FIELD_CHECKS.items():  # before TrainingArguments' own work
            check(name, getattr(self, name))
        # the two Matryoshka fields together: one weight per width (the widths against the
        # embeddings' at the first loss)
        check_matryoshka(self.matryoshka_dims, self.matryoshka_weights)
        check_chunking(self.chunk_size, {"offload=True": self.offload,
                                         "chunk_cuda_graphs=True": self.chunk_cuda_graphs,
                                         "no_grad_chunk_size": self.no_grad_chunk_size})
        check_graphs_chunking(self.no_grad_chunk_size, self.chunk_size, self.chunk_cuda_graphs,
                              graphs_name="chunk_cuda_graphs=True")
        super().__post_init__()
