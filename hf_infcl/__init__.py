"""hf_infcl: exact, memory-linear contrastive loss (Inf-CL) for the Hugging Face stack.

Plain PyTorch: ``hf_infcl.contrastive_loss`` / ``hf_infcl.InfCLLoss`` and
``hf_infcl.contrastive_distillation_loss`` (in-batch distillation from a teacher's embeddings),
with the block backends ``TorchTiles`` and ``TritonBlocks``. The Trainer integration (``InfCLTrainer``,
``InfCLTrainingArguments``), ``DualEncoder``, ``TritonBlocks`` (it needs Triton) and
``hf_infcl.losses`` (sentence-transformers) are imported lazily, so ``import hf_infcl`` stays light.
"""

from importlib import import_module
from importlib import metadata as _metadata

from .distillation import contrastive_distillation_loss
from .loss import InfCLLoss, contrastive_loss
from .ops import warm_start as _warm_start
from .ops.tiled import TorchTiles

try:
    __version__ = _metadata.version("hf_infcl")
except _metadata.PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"

# name -> module that defines it, imported on first access
_LAZY = {
    "InfCLTrainer": ".trainer",
    "InfCLTrainingArguments": ".training_args",
    "DualEncoder": ".dual_encoder",
    "DualEncoderConfig": ".dual_encoder",
    "TritonBlocks": ".ops.triton",
    "reset_autotuning": ".ops",
    "losses": ".losses",
}

__all__ = ["contrastive_loss", "contrastive_distillation_loss", "InfCLLoss", "TorchTiles", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        module = import_module(_LAZY[name], __name__)
        return module if name == "losses" else getattr(module, name)
    raise AttributeError(f"module 'hf_infcl' has no attribute {name!r}")


# Triton's once-per-process setup, in a background thread (nothing on CPU-only builds)
_warm_start.start()
