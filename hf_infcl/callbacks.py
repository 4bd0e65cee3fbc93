"""The learned logit scale's clamp: a function for any training loop, and the Trainer callback.

CLIP clamps its temperature after each optimizer step so that the logits cannot grow without
bound: the learned parameter is the log of the scale, and it is clamped to ``log(100)``.

- :func:`clamp_logit_scale` clamps one log-scale parameter in place (a plain tensor, one
  sharded by FSDP2, or one trained by DeepSpeed ZeRO, whose optimizer keeps an fp32 master copy
  that is clamped too); a custom loop such as ``examples/train_clip.py`` calls it after
  ``optimizer.step()``.
- :class:`ClampLogitScale` is the ``TrainerCallback`` :class:`~hf_infcl.InfCLTrainer` adds (from
  ``logit_scale_max``); it clamps the model's learned log-scales (CLIP's ``logit_scale``;
  ``DualEncoder``'s ``log_logit_scale``; CLAP's ``logit_scale_a`` and ``logit_scale_t``; ALIGN's
  temperature is not a log-scale and is left alone), as :func:`hf_infcl.models.learned_log_scales`
  lists them.
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from .models import learned_log_scales

__all__ = ["ClampLogitScale", "clamp_logit_scale"]


def _positive(value, name):
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


@torch.no_grad()
def clamp_logit_scale(log_scale: torch.Tensor, maximum: float = 100.0, *,
                      minimum: float | None = None) -> None:
    """Clamp a learned log logit scale in place, so that ``exp(log_scale) <= maximum``.

    Args:
        log_scale: the parameter holding the log of the scale (CLIP's ``logit_scale``), the one the
            optimizer updates (under FSDP2 the sharded one). Under DeepSpeed ZeRO the optimizer
            steps an fp32 master copy and writes it over the parameter, so that copy is clamped
            too (under ZeRO-1/2 a collective: every process calls this).
        maximum: the largest scale (CLIP: 100).
        minimum: the smallest scale, or None (the default, as CLIP and the Trainer callback) for
            no lower bound. ``minimum=1`` keeps the log-scale at or above 0, so that the scale
            never falls below 1 (temperature at most 1).
    """
    log_maximum = math.log(_positive(maximum, "maximum"))
    log_minimum = None if minimum is None else math.log(_positive(minimum, "minimum"))
    log_scale.clamp_(min=log_minimum, max=log_maximum)
    if hasattr(log_scale, "ds_id") or hasattr(log_scale, "_hp_mapping"):  # DeepSpeed ZeRO-3 / ZeRO-1, 2
        _clamp_deepspeed_copies(log_scale, log_minimum, log_maximum)


def _clamp_deepspeed_copies(param, log_minimum, log_maximum) -> None:
    """The clamp is elementwise, so under ZeRO-3 each rank clamps its own partitions (the fp32
    master's and the parameter's), with no communication."""
    from deepspeed import utils

    if hasattr(param, "ds_id"):  # ZeRO-3
        master = utils.safe_get_local_fp32_param(param)
        if master is not None:
            utils.safe_set_local_fp32_param(param, master.clamp(min=log_minimum, max=log_maximum))
        param.ds_tensor.clamp_(min=log_minimum, max=log_maximum)
    else:  # ZeRO-1/2: the parameter is whole; its master is gathered and written back
        master = utils.safe_get_full_fp32_param(param)
        if master is not None:
            utils.safe_set_full_fp32_param(param, master.clamp(min=log_minimum, max=log_maximum))


class ClampLogitScale(TrainerCallback):
    """After each optimizer step, clamp each learned log-scale (CLIP's ``logit_scale``,
    ``DualEncoder``'s ``log_logit_scale``, or CLAP's two) to log(maximum).

    CLIP clamps its temperature this way so the logits cannot grow without bound. A fixed scale
    (``requires_grad=False``) and models without a log-scale are left alone.
    """

    def __init__(self, maximum: float = 100.0):
        self.log_maximum = math.log(_positive(maximum, "maximum"))
        self.maximum = maximum

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        for param in learned_log_scales(model) if model is not None else ():
            clamp_logit_scale(param, self.maximum)
