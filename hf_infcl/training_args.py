"""``InfCLTrainingArguments``: ``TrainingArguments`` plus the contrastive-loss options of
:class:`~hf_infcl.InfCLTrainer`.

A module of its own, as TRL keeps each ``XConfig`` in a file beside its ``XTrainer``: scripts
parse these arguments (``HfArgumentParser``) without building a Trainer, and the options are
checked here once, at parse time. ``hf_infcl.trainer`` re-exports the class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from transformers import TrainingArguments

from .grad_cache import check_chunk_size
from .loss import check_label_smoothing
from .ops.options import BackendName, LossKind, Precision, check_choice, check_option

__all__ = ["CHUNK_GRADIENT_SYNCS", "CHUNK_PARAMETER_GATHERS", "InfCLTrainingArguments"]

ChunkGradientSync = Literal["step", "chunk"]
CHUNK_GRADIENT_SYNCS: tuple[str, ...] = get_args(ChunkGradientSync)
ChunkParameterGather = Literal["step", "chunk"]
CHUNK_PARAMETER_GATHERS: tuple[str, ...] = get_args(ChunkParameterGather)


@dataclass
class InfCLTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the contrastive-loss options of :class:`InfCLTrainer`.

    The loss options keep the Trainer's prefixed names: ``loss_backend`` is ``contrastive_loss``'s
    ``backend`` and the field ``contrastive_loss`` (a string, or None to follow the model) is its
    ``loss`` (docs/contract.md, "Options"). Their types are the ``Literal`` vocabularies of
    ``hf_infcl.ops.options``, so ``HfArgumentParser`` lists the choices; ``__post_init__`` checks
    every option once, naming the field.
    """

    # Checked by __post_init__ (a command line's own numeric checks need not repeat them).
    checked_numeric_fields: ClassVar[tuple[str, ...]] = ("chunk_size", "logit_scale_max", "eval_block_rows",
                                                         "label_smoothing")

    chunk_size: int | None = field(
        default=None,
        metadata={"help": "Rows per encoder chunk for gradient caching (GradCache). None: no caching, the "
                          "encoders see the whole per-device batch at once."},
    )
    offload: bool = field(
        default=False,
        metadata={"help": "Keep the batch in pinned host memory and move one chunk at a time to the device. "
                          "Needs chunk_size."},
    )
    chunk_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "Run the chunks of a cached step (chunk_size) as CUDA graphs, one per chunk shape: "
                          "removes the kernel-launch overhead that makes small chunks of a small model slow. "
                          "One process, one CUDA GPU, no torch_compile; keeps about one chunk's activations "
                          "and one gradient buffer allocated between steps. Needs chunk_size."},
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

    def __post_init__(self):
        super().__post_init__()
        check_chunk_size("chunk_size", self.chunk_size)
        if self.offload and self.chunk_size is None:
            raise ValueError("offload=True needs chunk_size: without chunks the whole batch is on the device")
        if self.chunk_cuda_graphs and self.chunk_size is None:
            raise ValueError("chunk_cuda_graphs=True needs chunk_size: the graphs replay the chunks of a "
                             "cached step")
        check_option("backend", self.loss_backend, "loss_backend", block_ops=False)
        check_option("precision", self.precision)
        check_option("loss", self.contrastive_loss, "contrastive_loss", optional=True)
        if self.label_smoothing is not None:
            # its type and range here; with the loss kind and groups at the Trainer
            check_label_smoothing(self.label_smoothing, "softmax")
        if self.logit_scale_max is not None and not self.logit_scale_max > 0:
            raise ValueError(f"logit_scale_max must be > 0 or None, got {self.logit_scale_max!r}")
        check_choice("chunk_gradient_sync", self.chunk_gradient_sync, CHUNK_GRADIENT_SYNCS)
        check_choice("chunk_parameter_gather", self.chunk_parameter_gather, CHUNK_PARAMETER_GATHERS)
        if self.eval_block_rows <= 0:
            raise ValueError(f"eval_block_rows must be positive, got {self.eval_block_rows!r}")
