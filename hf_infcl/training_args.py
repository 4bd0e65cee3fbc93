"""``InfCLTrainingArguments``: ``TrainingArguments`` plus the contrastive-loss options of
:class:`~hf_infcl.InfCLTrainer`.

A module of its own, as TRL keeps each ``XConfig`` in a file beside its ``XTrainer``: scripts
parse these arguments (``HfArgumentParser``) without building a Trainer, and the options are
checked here once, at parse time. ``hf_infcl.trainer`` re-exports the class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from .loss import BACKENDS, LOSSES, PRECISIONS

__all__ = ["CHUNK_GRADIENT_SYNCS", "InfCLTrainingArguments"]

CHUNK_GRADIENT_SYNCS = ("step", "chunk")


@dataclass
class InfCLTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the contrastive-loss options of :class:`InfCLTrainer`."""

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
    loss_backend: str = field(
        default="auto",
        metadata={"help": "Backend of the loss: 'auto' (Triton on CUDA when available), 'torch', 'triton' "
                          "or 'reference' (materialised, small batches only)."},
    )
    precision: str = field(
        default="auto",
        metadata={"help": "Matmul precision of the loss for fp32 embeddings: 'auto' (TF32 on CUDA in every "
                          "backend, exact fp32 elsewhere), 'tf32' or 'ieee' (exact fp32). bf16/fp16 "
                          "embeddings are unaffected."},
    )
    contrastive_loss: str | None = field(
        default=None,
        metadata={"help": "'softmax' (InfoNCE/CLIP) or 'sigmoid' (SigLIP). None: 'sigmoid' for models with a "
                          "logit_bias (SigLIP), else 'softmax'."},
    )
    symmetric: bool = field(
        default=True,
        metadata={"help": "Softmax loss: average the row->key and key->row directions, as CLIP does."},
    )
    logit_scale_max: float | None = field(
        default=100.0,
        metadata={"help": "Clamp the learned logit scale exp(logit_scale) to at most this after each "
                          "optimizer step (CLIP uses 100). None disables the clamp."},
    )
    group_column: str | None = field(
        default=None,
        metadata={"help": "Batch column of integer group ids: rows and keys of the same group are not "
                          "negatives of each other (duplicate captions, the same document twice)."},
    )
    chunk_gradient_sync: str = field(
        default="step",
        metadata={"help": "With chunk_size under DDP or FSDP2: 'step' reduces the encoders' gradients once "
                          "per step (sync off during the replays; under FSDP2 the replays accumulate "
                          "unsharded gradients), 'chunk' after every chunk's replay (FSDP2: sharded "
                          "gradient memory, one reduce-scatter per chunk)."},
    )
    eval_block_rows: int = field(
        default=1024,
        metadata={"help": "Rows per block when evaluation ranks every key for each row (memory "
                          "eval_block_rows x eval set size)."},
    )

    def __post_init__(self):
        super().__post_init__()
        chunk = self.chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
            raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if self.offload and self.chunk_size is None:
            raise ValueError("offload=True needs chunk_size: without chunks the whole batch is on the device")
        if self.loss_backend not in BACKENDS:
            raise ValueError(f"loss_backend must be one of {', '.join(map(repr, BACKENDS))}; "
                             f"got {self.loss_backend!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}; "
                             f"got {self.precision!r}")
        if self.contrastive_loss is not None and self.contrastive_loss not in LOSSES:
            raise ValueError(f"contrastive_loss must be one of {', '.join(map(repr, LOSSES))} or None; "
                             f"got {self.contrastive_loss!r}")
        if self.logit_scale_max is not None and not self.logit_scale_max > 0:
            raise ValueError(f"logit_scale_max must be > 0 or None, got {self.logit_scale_max!r}")
        if self.chunk_gradient_sync not in CHUNK_GRADIENT_SYNCS:
            choices = ", ".join(map(repr, CHUNK_GRADIENT_SYNCS))
            raise ValueError(f"chunk_gradient_sync must be one of {choices}; "
                             f"got {self.chunk_gradient_sync!r}")
        if self.eval_block_rows <= 0:
            raise ValueError(f"eval_block_rows must be positive, got {self.eval_block_rows!r}")
