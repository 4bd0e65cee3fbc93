"""One RNG snapshot for replaying a forward pass with the same random draws (dropout).

Gradient caching runs each chunk twice, once without grad and once with; both passes must draw
the same dropout masks. :class:`RngState` records the CPU generator and the generators of the
accelerator devices a chunk's tensors live on, and restores them for the replay. The device part
is a thin use of ``torch.utils.checkpoint.get_device_states`` / ``set_device_states`` (what
activation checkpointing itself does), and the restore runs inside ``torch.random.fork_rng``, so
the replay leaves every generator where it was, as a single uncached forward would.

:func:`active_dropout_layers` names the layers of a model that draw random numbers now, and
:func:`random_draws_in_training` adds the dropout rates of Hugging Face configurations: where a
replay cannot restore the first pass's state (the two passes cut the batch differently), these
are what make its gradients differ from the loss's.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.utils.checkpoint import get_device_states, set_device_states

from .batch_statistics import listed_names

__all__ = ["RngState", "active_dropout_layers", "host_random_draws_in_training", "random_draws_in_training",
           "unreplayed_draws_warning"]


class RngState:
    """The CPU RNG state and the RNG states of the accelerator devices some tensors live on.

    ``RngState.capture(*tensors)`` takes the snapshot (non-tensors are ignored);
    ``with state.restored():`` runs a block from it and puts every generator back afterwards.
    """

    def __init__(self, cpu_state: torch.Tensor, device_type: str | None, devices: list[int],
                 device_states: list[torch.Tensor]):
        self.cpu_state = cpu_state
        self.device_type = device_type
        self.devices = devices
        self.device_states = device_states

    @classmethod
    def capture(cls, *tensors) -> RngState:
        """Snapshot the CPU generator and those of the devices ``tensors`` live on.

        With no accelerator tensor among them but CUDA initialised, the current CUDA device's
        state is taken: the inputs may be on the host while the model runs on the GPU.
        """
        on_device = [t for t in tensors
                     if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")]
        if not on_device and torch.cuda.is_available() and torch.cuda.is_initialized():
            on_device = [torch.empty(0, device=torch.device("cuda", torch.cuda.current_device()))]
        # One device type, preferring CUDA, as torch.utils.checkpoint infers it; one tensor per device.
        types = {t.device.type for t in on_device}
        device_type = ("cuda" if "cuda" in types else on_device[0].device.type) if on_device else None
        one_per_device = {t.device: t for t in on_device if t.device.type == device_type}
        ordered = [one_per_device[d] for d in sorted(one_per_device, key=str)]
        devices, device_states = get_device_states(*ordered)
        return cls(torch.get_rng_state(), device_type, devices, device_states)

    @contextlib.contextmanager
    def restored(self):
        """Run the block from the captured state; every generator is put back afterwards."""
        with torch.random.fork_rng(devices=self.devices, enabled=True, device_type=self.device_type):
            torch.set_rng_state(self.cpu_state)
            if self.devices:
                set_device_states(self.devices, self.device_states, device_type=self.device_type)
            yield


def active_dropout_layers(module: nn.Module) -> list[str]:
    """Names of ``module``'s dropout layers that draw random numbers in a forward now: torch's
    dropout layers (``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout``, ...) in training mode with
    ``p > 0``. ``""`` names ``module`` itself. Randomness drawn without such a layer (a functional
    ``dropout`` whose rate is a plain attribute, stochastic depth written by hand) is not seen."""
    return [name for name, layer in module.named_modules()
            if isinstance(layer, _DropoutNd) and layer.training and layer.p > 0]


def random_draws_in_training(model: nn.Module) -> list[str]:
    """What in ``model`` draws random numbers in a forward now: its active dropout layers
    (:func:`active_dropout_layers`), and for each Hugging Face model inside it in training mode its
    configuration's dropout rates above 0 (``text_config.attention_dropout=0.1``), which models
    such as CLIP apply through functional calls that no layer shows."""
    return _configuration_rates(model, "dropout") + active_dropout_layers(model)


def host_random_draws_in_training(model: nn.Module) -> list[str]:
    """The configuration rates above 0 of the Hugging Face models inside ``model`` in training mode
    whose draws happen on the host: ``layerdrop`` (``encoder_layerdrop=0.1``), where transformers
    skips a layer by a CPU random number and a Python ``if``. A CUDA graph records one outcome of
    that ``if`` and repeats it."""
    return _configuration_rates(model, "layerdrop")


def _configuration_rates(model: nn.Module, word: str) -> list[str]:
    """``name=rate`` of the rates above 0 whose names hold ``word``, in the configurations of the
    Hugging Face models inside ``model`` that are in training mode."""
    found, seen = [], set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if module.training and hasattr(config, "to_dict"):
            found += _rates(config, word, f"{name}.config." if name else "config.", seen)
    return found


def _rates(config, word: str, prefix: str, seen: set) -> list[str]:
    """``name=rate`` of a configuration's rates above 0 whose names hold ``word``, its
    sub-configurations' too; each configuration once (``seen``: their ids; a tower's
    configuration is also its parent's part)."""
    if id(config) in seen:
        return []
    seen.add(id(config))
    rates = []
    for name, value in vars(config).items():
        if word in name and isinstance(value, float) and value > 0:
            rates.append(f"{prefix}{name}={value}")
        elif hasattr(value, "to_dict") and not isinstance(value, type):  # a sub-configuration
            rates += _rates(value, word, f"{prefix}{name}.", seen)
    return rates


def unreplayed_draws_warning(model: nn.Module, settings: str, exact_instead: str) -> str | None:
    """The warning of a cached step whose gradient-free pass is chunked otherwise than its replays
    (``settings``, e.g. ``"no_grad_chunk_size=1024 with chunk_size=256"``) where ``model`` draws
    random numbers (:func:`random_draws_in_training`); None where it draws none. ``exact_instead``:
    the setting that keeps the replays exact."""
    draws = [name or type(model).__name__ for name in random_draws_in_training(model)]
    if not draws:
        return None
    return (f"{settings}, and the model draws dropout masks in training mode ({len(draws)} source(s): "
            f"{listed_names(draws)}): the replays cannot draw the masks of the gradient-free pass, so the "
            "gradients are approximate, not the loss's. For exact gradients set the model's dropout to 0, "
            f"or {exact_instead}.")
