"""What sharded training (FSDP2's ``fully_shard``, DeepSpeed) needs of a contrastive model.

Used by ``InfCLTrainer``, ``hf_infcl.grad_cache`` and the Accelerate example, and usable in your
own loop:

- :func:`vectorise_scalar_parameters`: ``fully_shard`` refuses 0-d parameters and DeepSpeed cannot
  broadcast them, so CLIP's ``logit_scale`` trains as a 1-element vector (the models broadcast it
  the same way);
- :func:`scalar_state_dict`: gives those parameters back their 0-d shape for ``save_pretrained``
  (``CLIPModel.from_pretrained`` would re-initialise a ``[1]`` scale instead of loading it);
- :func:`full_value` / :func:`is_dtensor`: a parameter sharded by FSDP2 is a DTensor between
  steps; its value needs a gather (a collective: every process calls it).
- :func:`keep_gathered_under_zero3`: DeepSpeed ZeRO-3 frees a parameter's value when the forward
  of the module that owns it ends; the loss reads the logit scale (and bias) after the model's
  forward, so they are registered as used outside their module's forward.
"""

from __future__ import annotations

import torch

__all__ = [
    "full_value", "is_dtensor", "is_zero3_parameter", "keep_gathered_under_zero3", "prepare_for_sharding",
    "scalar_state_dict", "vectorise_scalar_parameters",
]


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter or gradient sharded by FSDP2)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole value: a DTensor is gathered from every rank (every process must call
    this), any other tensor is returned as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def is_zero3_parameter(tensor) -> bool:
    """Whether ``tensor`` is a parameter partitioned by DeepSpeed ZeRO-3 (between the forwards
    that gather it, its ``.data`` is an empty placeholder)."""
    return getattr(tensor, "ds_status", None) is not None


def keep_gathered_under_zero3(module: torch.nn.Module, params) -> None:
    """Keep ZeRO-3 parameters that a loss reads *after* ``module``'s forward whole from that
    forward to the optimizer step. Call it after ``deepspeed.initialize`` (which resets what this
    sets); parameters not under ZeRO-3 are left alone.

    ZeRO-3 frees a parameter when the forward of the module that uses it ends, and even those
    below ``stage3_param_persistence_threshold`` whenever its record of the forward is incomplete,
    which a cached step (a no-grad pass, then replays) always makes it. Each parameter is registered
    with ``deepspeed.zero.register_external_parameter(module, param)``, so ``module``'s forward
    gathers it, and marked as DeepSpeed marks a parameter that a module returns from its forward
    (``is_external_param``), so that no module's end frees it: the optimizer step does.
    """
    zero3 = [param for param in params if is_zero3_parameter(param)]
    if not zero3:
        return
    import deepspeed

    for param in zero3:
        if not getattr(param, "is_external_param", False):
            deepspeed.zero.register_external_parameter(module, param)
            param.is_external_param = True


def vectorise_scalar_parameters(module: torch.nn.Module, optimizer=None) -> list[str]:
    """Replace every 0-d parameter of ``module`` by a 1-element one (in ``optimizer``'s parameter
    groups too, if given); return the names replaced, for :func:`scalar_state_dict`."""
    names = []
    for name, param in list(module.named_parameters()):
        if param.ndim != 0:
            continue
        owner_name, _, attribute = name.rpartition(".")
        vector = torch.nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad)
        setattr(module.get_submodule(owner_name), attribute, vector)
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["params"] = [vector if p is param else p for p in group["params"]]
        names.append(name)
    return names


def scalar_state_dict(state_dict: dict, names) -> dict:
    """A copy of ``state_dict`` with the whole 1-element tensors of ``names`` made 0-d again
    (entries still sharded are left as they are)."""
    restored = dict(state_dict)
    for name in names:
        value = restored.get(name)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not is_dtensor(value):
            restored[name] = value.reshape(())
    return restored


def prepare_for_sharding(model: torch.nn.Module, optimizer=None) -> list[str]:
    """Make a contrastive model acceptable to Accelerate's FSDP2 and DeepSpeed preparation (the
    plain ``Trainer``'s too); return the names of the parameters that a saved state dict must give
    back their 0-d shape (:func:`scalar_state_dict`).

    - ``fully_shard`` refuses 0-d parameters (CLIP's ``logit_scale``), and DeepSpeed cannot
      broadcast them: they become 1-element vectors, which the models broadcast the same way (in
      ``optimizer`` too, if one was given).
    - Accelerate shards ``get_input_embeddings()`` as a unit of its own, and transformers raises
      NotImplementedError for two-tower models that have no single input embedding (CLIPModel):
      for those this model answers None, so each tower's embeddings stay with its root.
    """
    for accessor in ("get_input_embeddings", "get_output_embeddings"):
        method = getattr(model, accessor, None)
        if method is None:
            continue
        try:
            method()
        except NotImplementedError:
            setattr(model, accessor, lambda: None)
    return vectorise_scalar_parameters(model, optimizer)
