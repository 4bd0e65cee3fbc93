"""Layers that normalise with the statistics of the batch (BatchNorm), which gradient caching cannot run.

A BatchNorm layer in training mode, or one built with ``track_running_stats=False`` in any mode,
normalises each row with the mean and variance of the rows it is called on. Gradient caching
calls the encoders on chunks of the batch, so each chunk would be normalised with its own
statistics and the step would silently differ from the whole batch's. Exact whole-batch
statistics are out of reach in general: the backward through the batch statistics couples every
row of the batch, so the replay of one chunk cannot be backpropagated on its own. Even a batch in
one chunk runs the encoders twice (the no-grad pass and the replay), which would update the
running statistics twice per step.

Every gradient-cached entry point (``InfCLTrainer`` with ``chunk_size``, ``grad_cache.cached_step``
with an ``nn.Module`` encoder, ``losses.InfCLLoss`` with ``mini_batch_size``) calls
:func:`check_no_batch_statistics` before its step. The ways out: no gradient caching, or the
layers in eval mode with their running statistics, which :func:`freeze_batch_norm` keeps through
the ``model.train()`` the Trainers call at every step.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["check_no_batch_statistics", "freeze_batch_norm"]

# layer names a message lists before it only counts the rest
LISTED_LAYERS = 5


def listed_names(names: list[str]) -> str:
    """The first :data:`LISTED_LAYERS` of ``names``, comma-separated, and how many more there are."""
    listed = ", ".join(names[:LISTED_LAYERS])
    if len(names) > LISTED_LAYERS:
        listed += f" and {len(names) - LISTED_LAYERS} more"
    return listed


def check_no_batch_statistics(module: nn.Module, unchunked: str) -> None:
    """Raise ValueError if ``module`` holds a layer that normalises with batch statistics now.

    Such a layer is a BatchNorm (``torch.nn.modules.batchnorm._BatchNorm``: ``BatchNorm1d/2d/3d``,
    ``SyncBatchNorm``, the lazy ones) in training mode, or one without running statistics
    (``track_running_stats=False``) in any mode.

    Args:
        module: the encoder (the model a chunked step runs).
        unchunked: the caller's setting that turns gradient caching off, as the user writes it
            (``"chunk_size=None"``), named in the message as the first way out.
    """
    layers = [(name, layer) for name, layer in module.named_modules()
              if isinstance(layer, _BatchNorm) and (layer.training or not layer.track_running_stats)]
    if not layers:
        return
    names = [name or type(module).__name__ for name, _ in layers]
    listed = listed_names(names)
    kinds = ", ".join(sorted({type(layer).__name__ for _, layer in layers}))
    without_running = [name for name, (_, layer) in zip(names, layers, strict=True)
                       if not layer.track_running_stats]
    message = (
        f"{len(layers)} BatchNorm layer(s) of the model ({kinds}) normalise with the statistics of the "
        f"batch they see: {listed}. Gradient caching encodes the batch in chunks, each twice (without "
        "and with gradients), so each chunk would be normalised with its own statistics, the step would "
        "differ from the whole batch's, and the running statistics would be updated twice. Either train "
        f"without gradient caching ({unchunked}), or keep those layers in eval mode with their running "
        "statistics: hf_infcl.batch_statistics.freeze_batch_norm(model) (a plain layer.eval() is undone "
        "by the model.train() a Trainer calls at every step)."
    )
    if without_running:
        message += (f" {', '.join(without_running[:LISTED_LAYERS])} keep no running statistics "
                    "(track_running_stats=False): only training without gradient caching works for them.")
    raise ValueError(message)


def freeze_batch_norm(module: nn.Module) -> list[str]:
    """Put every BatchNorm layer of ``module`` in eval mode for good, and return their names.

    Each layer then normalises with its running statistics (its affine weight and bias still
    train), and stays in eval mode when ``module.train()`` is called, as ``Trainer`` and
    ``SentenceTransformerTrainer`` do at every step. Its running statistics stop updating.
    ValueError, before any layer is changed, for a layer without running statistics
    (``track_running_stats=False``), which can only normalise with the batch's.
    """
    layers = [(name, layer) for name, layer in module.named_modules() if isinstance(layer, _BatchNorm)]
    without_running = [name for name, layer in layers if not layer.track_running_stats]
    if without_running:
        raise ValueError(
            f"freeze_batch_norm: {', '.join(without_running[:LISTED_LAYERS])} keep no running statistics "
            "(track_running_stats=False) and can only normalise with the batch's; train without gradient "
            "caching"
        )
    for _, layer in layers:
        layer.eval()
        # an instance attribute shadows nn.Module.train, so a parent's train() leaves it in eval
        layer.train = functools.partial(_stay_in_eval_mode, layer)
    return [name for name, _ in layers]


def _stay_in_eval_mode(layer: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(layer, False)
