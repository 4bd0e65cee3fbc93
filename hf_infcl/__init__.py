"""hf_infcl: exact, memory-linear contrastive loss (Inf-CL) for the Hugging Face stack.

Plain PyTorch: ``hf_infcl.contrastive_loss`` / ``hf_infcl.InfCLLoss``. The Trainer integration
(``InfCLTrainer``, ``InfCLTrainingArguments``) and ``hf_infcl.losses`` (sentence-transformers)
are imported lazily, so ``import hf_infcl`` stays light.
"""

from importlib import import_module

from .loss import InfCLLoss, contrastive_loss
from .ops.tiled import TorchTiles

__version__ = "0.1.0"

# name -> module that defines it, imported on first access
_LAZY = {
    "InfCLTrainer": ".trainer",
    "InfCLTrainingArguments": ".trainer",
    "DualEncoder": ".models",
    "DualEncoderConfig": ".models",
    "losses": ".losses",
}

__all__ = ["contrastive_loss", "InfCLLoss", "TorchTiles", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        module = import_module(_LAZY[name], __name__)
        return module if name == "losses" else getattr(module, name)
    raise AttributeError(f"module 'hf_infcl' has no attribute {name!r}")
