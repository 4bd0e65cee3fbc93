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
"""

from __future__ import annotations

import torch

__all__ = [
    "full_value", "is_dtensor", "prepare_for_sharding", "scalar_state_dict", "vectorise_scalar_parameters",
]


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter or gradient sharded by FSDP2)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole value: a DTensor is gathered from every rank (every process must call
    this), any other tensor is returned as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


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
