"""What sharded training (FSDP2's ``fully_shard``, DeepSpeed) needs of a contrastive model.

Used by ``InfCLTrainer``, ``hf_infcl.grad_cache`` and the Accelerate example, and usable in your
own loop:

- :func:`fsdp_no_sync`, :func:`deepspeed_no_sync`: the ``no_sync`` of a cached step
  (:func:`hf_infcl.grad_cache.cached_step`) under FSDP2 and DeepSpeed, so the replays accumulate
  and the last one reduces; :func:`deepspeed_hold_reduction`: the same for backwards that run
  inside one engine backward (replays from a hook on the loss); :func:`fsdp_gather_once`: FSDP2
  gathers each unit once per cached step;
- :func:`vectorise_scalar_parameters`: ``fully_shard`` refuses 0-d parameters and DeepSpeed cannot
  broadcast them, so CLIP's ``logit_scale`` trains as a 1-element vector (the models broadcast it
  the same way);
- :func:`scalar_state_dict`: gives those parameters back their 0-d shape for ``save_pretrained``
  (``CLIPModel.from_pretrained`` would re-initialise a ``[1]`` scale instead of loading it);
- :func:`full_value` / :func:`is_dtensor`: a parameter sharded by FSDP2 is a DTensor between
  steps, one partitioned by ZeRO-3 an empty placeholder; its value needs a gather (a collective:
  every process calls it). :func:`accumulate_sharded_grad` adds a gradient of that whole value
  to the sharded ``.grad``, as FSDP2's own reduction would;
- :func:`keep_gathered_under_zero3`: DeepSpeed ZeRO-3 frees a parameter's value when the forward
  of the module that owns it ends; the loss reads the logit scale (and bias) after the model's
  forward, so they are registered as used outside their module's forward.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = [
    "accumulate_sharded_grad", "deepspeed_hold_reduction", "deepspeed_no_sync", "fsdp_gather_once",
    "fsdp_no_sync", "full_value", "is_dtensor", "is_zero3_parameter", "keep_gathered_under_zero3",
    "prepare_for_sharding", "scalar_state_dict", "vectorise_scalar_parameters",
]


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter or gradient sharded by FSDP2)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def is_zero3_parameter(tensor) -> bool:
    """Whether ``tensor`` is a parameter partitioned by DeepSpeed ZeRO-3 (between the forwards
    that gather it, its ``.data`` is an empty placeholder)."""
    return getattr(tensor, "ds_status", None) is not None


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole value. A DTensor (sharded by FSDP2) is gathered from every rank; a
    ZeRO-3 parameter is gathered into a detached copy; both are collectives, which every process
    must call. Any other tensor is returned as it is."""
    if is_dtensor(tensor):
        return tensor.full_tensor()
    if is_zero3_parameter(tensor):
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor]):
            return tensor.detach().clone()
    return tensor


def accumulate_sharded_grad(param, grad: torch.Tensor) -> None:
    """Add the average over ranks of ``grad`` (this rank's gradient of the full value of ``param``,
    a DTensor) to the sharded ``param.grad``, as FSDP2's own reduction does for the parameters it
    sees: each rank's loss is its share of the global loss, so the average is the gradient of the
    global loss. A collective: every process calls it."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    mesh = param.device_mesh
    reduced = grad.detach().to(param.dtype).clone()
    dist.all_reduce(reduced, group=mesh.get_group())
    reduced /= mesh.size()
    # Every rank holds the same full value now: each keeps its own shard, with no communication.
    shard = distribute_tensor(reduced, mesh, param.placements, src_data_rank=None)
    if param.grad is None:
        param.grad = shard
    else:
        param.grad += shard


@contextlib.contextmanager
def fsdp_no_sync(module):
    """The ``no_sync`` of an FSDP2 module (``torch.distributed.fsdp.fully_shard``): gradient
    reduction off inside, so the replays accumulate unsharded gradients and the last replay
    reduce-scatters them once (one reduction per step, at the memory cost of unsharded
    gradients). Pass ``no_sync=lambda: fsdp_no_sync(model)`` to
    :func:`hf_infcl.grad_cache.cached_step`; leave ``no_sync`` out to reduce-scatter after every
    replay instead (sharded gradient memory, one reduce-scatter per chunk)."""
    if not hasattr(module, "set_requires_gradient_sync"):
        raise TypeError(f"fsdp_no_sync needs a module wrapped by fully_shard, got {type(module).__name__}")
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


@contextlib.contextmanager
def fsdp_gather_once(module, reshard_after_forward: bool = True):
    """FSDP2: inside, each ``fully_shard`` unit of ``module`` keeps its parameters unsharded from
    their first all-gather to the end, so a cached step gathers them once instead of once per
    chunk in the no-grad pass and twice per chunk in the replays (forward, then backward). It costs
    the memory of the unsharded parameters (an unsharded model, in the parameters' dtype) for the
    step. At the end every unit is resharded and gets back ``reshard_after_forward`` (as given to
    ``fully_shard``) and resharding after backward.

    Wrap the cached step in it: ``with fsdp_gather_once(model): cached_step(...)``."""
    units = [unit for unit in module.modules() if hasattr(unit, "set_reshard_after_backward")]
    if not units:
        raise TypeError(f"fsdp_gather_once needs a module wrapped by fully_shard, got "
                        f"{type(module).__name__}")
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            unit.reshard()


@contextlib.contextmanager
def deepspeed_no_sync(engine):
    """The ``no_sync`` of a DeepSpeed engine (ZeRO stages 1-3): inside, the engine is not at a
    gradient-accumulation boundary, so a replay's backward only accumulates; the last replay,
    outside, runs at the boundary state the engine had before (at a boundary, unless you are
    accumulating several cached steps), which reduces. Pass
    ``no_sync=lambda: deepspeed_no_sync(engine)`` and
    ``backward=lambda t: engine.backward(t, scale_wrt_gas=False)`` to
    :func:`hf_infcl.grad_cache.cached_step`, then call ``engine.step()``. Under ZeRO-2 every replay
    must be inside: a boundary per replay would reduce (and average) the partial gradients of each
    one."""
    if not hasattr(engine, "set_gradient_accumulation_boundary"):
        raise TypeError(f"deepspeed_no_sync needs a DeepSpeed engine, got {type(engine).__name__}")
    boundary = engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        engine.set_gradient_accumulation_boundary(boundary)


@contextlib.contextmanager
def deepspeed_hold_reduction(engine):
    """Inside, ZeRO (stages 1-3) leaves the gradients of ``engine``'s parameters accumulating in
    their ``.grad`` instead of taking them for reduction; the first backward after the exit
    reduces everything accumulated, once. For backwards that run inside one ``engine.backward``
    (a cached loss's replays, from a hook on the loss tensor): ZeRO takes each parameter's gradient
    once per engine backward (a second one stops it with "Gradient computed twice"), so
    :func:`deepspeed_no_sync`, which works per engine backward, cannot serve there. It sets
    ``ds_grad_is_ready``, DeepSpeed's own flag for a parameter used in a loop within one backward."""
    if not hasattr(engine, "set_gradient_accumulation_boundary"):
        raise TypeError(f"deepspeed_hold_reduction needs a DeepSpeed engine, got {type(engine).__name__}")
    params = [param for param in engine.module.parameters() if param.requires_grad]
    for param in params:
        param.ds_grad_is_ready = False
    try:
        yield
    finally:
        for param in params:
            param.ds_grad_is_ready = True


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
