"""The cached sentence-transformers losses (``losses.InfCLLoss`` / ``InfCLGISTLoss`` /
``InfCLDistillLoss`` with ``mini_batch_size``) on a model sharded by FSDP2 or DeepSpeed ZeRO.

sentence-transformers' ``CachedLossMixin`` embeds every mini-batch without gradient, computes the
loss, and replays each mini-batch with gradient from a hook on the loss tensor, one backward per
mini-batch. Under DDP its hook keeps all replays but the last in ``no_sync``; under FSDP2
(``fully_shard``, in place, so the loss's ``model`` is the sharded module) nothing would: every
replay's backward would reduce-scatter, and every unit would be gathered again for each
mini-batch's forward and backward. :class:`ShardedReplaysMixin` makes a cached step under FSDP2
gather each unit once (:func:`hf_infcl.sharding.fsdp_gather_once`) and reduce-scatter once, at
the last replay (:func:`hf_infcl.sharding.fsdp_no_sync` around the others).

With gradient accumulation the Trainer's own ``no_sync`` holds the replays of every micro-batch
but the last unreduced, and is left alone.

Under DDP, sentence-transformers releases before the fix of their issue #4027 replay without
``no_sync``, so DDP all-reduces after every mini-batch; there the mixin holds all replays but the
last in ``no_sync`` itself, as those of FSDP2 (:func:`_ddp_reducing_each_replay`).

Under DeepSpeed (the loss's ``model`` is the engine) the replays run inside the engine's backward,
which the Trainer calls on the loss, and ZeRO takes each parameter's gradient once per engine
backward (ZeRO-2 stops at the second replay with "Gradient computed twice").
:func:`hf_infcl.sharding.deepspeed_hold_reduction` keeps every replay but the last accumulating
in ``.grad``, so the last one hands ZeRO the whole gradient, once; the engine's boundary and
step stay the Trainer's. Every trainable parameter must take part in the last mini-batch's forward
(as in any dense encoder): one used only by earlier mini-batches would keep its gradient
unreduced, and is refused (ValueError) when the replays end.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .sharding import deepspeed_hold_reduction, fsdp_gather_once, fsdp_no_sync

__all__ = ["ShardedReplaysMixin", "is_deepspeed_engine", "is_fsdp2_module"]


def is_fsdp2_module(module) -> bool:
    """Whether ``module`` is wrapped by FSDP2's ``fully_shard`` (the sharded root the loss calls)."""
    return hasattr(module, "set_requires_gradient_sync") and hasattr(module, "set_reshard_after_forward")


def is_deepspeed_engine(module) -> bool:
    """Whether ``module`` is a DeepSpeed engine (what sentence-transformers' Trainer puts in the
    loss under ``deepspeed=...``)."""
    return hasattr(module, "set_gradient_accumulation_boundary")


def _ddp_reducing_each_replay(model):
    """The DDP module behind ``model`` (under torch.compile too) where sentence-transformers'
    replays would all-reduce it after every mini-batch, else None: their releases without
    ``_ddp_replay_context`` (before the fix of their issue #4027) replay without ``no_sync``; later
    ones hold all replays but the last in it themselves. A static graph is left as it is: its
    reducer must see a synchronised first backward."""
    from sentence_transformers.base.losses import gradcache
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)
    if (isinstance(model, DistributedDataParallel) and not model.static_graph
            and not hasattr(gradcache, "_ddp_replay_context")):
        return model
    return None


def _reduces_gradients(module) -> bool:
    """Whether FSDP2 reduces ``module``'s gradients at its next backward: False inside an outer
    ``no_sync`` (the Trainer's, on the micro-batches of a gradient-accumulation step but the last)."""
    groups = [group for unit in module.modules() if hasattr(unit, "_get_fsdp_state")
              for group in fsdp_param_groups(unit._get_fsdp_state())]
    return all(group.reduce_grads for group in groups)


def fsdp_param_groups(state) -> list:
    """The parameter groups of an FSDP2 unit's state: ``_fsdp_param_groups`` where torch keeps a
    list (one group per mesh), else the single ``_fsdp_param_group`` of earlier releases (torch
    2.11), which is None for a unit without parameters."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _reshard_after_forward() -> bool:
    """``reshard_after_forward`` of Accelerate's FSDP plugin (what ``fully_shard`` was given), True
    when there is none."""
    from accelerate.state import AcceleratorState

    plugin = AcceleratorState._shared_state.get("fsdp_plugin")
    return bool(getattr(plugin, "reshard_after_forward", True))


class ShardedReplaysMixin:
    """Put before ``CachedLossMixin`` among a loss's bases. Under FSDP2 a cached forward with
    gradient gathers each unit of ``self.model`` once for the step (the no-grad pass and every
    replay), keeps gradient reduction off for every replay but the last, and reshards when the
    last replay is done; under DeepSpeed it holds ZeRO's reduction for every replay but the last;
    anything else runs ``CachedLossMixin`` unchanged."""

    # Texts still to replay in the current cached step under FSDP2 or DeepSpeed; None outside one.
    # Texts, not mini-batches: the replays may cut the batch otherwise than the gradient-free pass
    # (``no_grad_mini_batch_size``), but each text is embedded once in each.
    _texts_to_replay: int | None = None
    # The step's fsdp_gather_once, entered from the first pass to the end of the last replay.
    _gather_once: contextlib.AbstractContextManager | None = None
    # fsdp_no_sync or deepspeed_hold_reduction of self.model while entered: from the first pass to
    # the last replay's forward.
    _no_sync: contextlib.AbstractContextManager | None = None
    # Under DeepSpeed: names of the parameters whose gradient is held (a replay but the last gave
    # one, the last has not), and the hooks that keep that record; None outside a cached step.
    _held: set[str] | None = None
    _held_hooks: list | None = None

    def forward_cached(self, sentence_features, labels=None):
        # a step whose backward never ran must not leave its gradient sync off for this one
        self._end_step()
        if not torch.is_grad_enabled():
            return super().forward_cached(sentence_features, labels)
        if is_deepspeed_engine(self.model):
            self._no_sync = deepspeed_hold_reduction(self.model)
            self._no_sync.__enter__()
            self._watch_held(self.model)
        elif is_fsdp2_module(self.model):
            self._gather_once = fsdp_gather_once(self.model, reshard_after_forward=_reshard_after_forward())
            self._gather_once.__enter__()
            if _reduces_gradients(self.model):  # else an outer no_sync keeps every replay unreduced
                self._no_sync = fsdp_no_sync(self.model)
                self._no_sync.__enter__()
        elif (ddp := _ddp_reducing_each_replay(self.model)) is not None:
            if ddp.require_backward_grad_sync:  # else an outer no_sync keeps every replay unreduced
                self._no_sync = ddp.no_sync()
                self._no_sync.__enter__()
        else:
            return super().forward_cached(sentence_features, labels)
        self._texts_to_replay = 0
        try:
            loss = super().forward_cached(sentence_features, labels)
        except BaseException:
            self._end_step()
            raise
        # Tensor hooks run in the order they were registered: this one after the mixin's replays.
        loss.register_hook(lambda grad: self._after_replays())
        return loss

    def _watch_held(self, engine) -> None:
        """Keep ``_held`` for the trainable parameters of ``engine``'s module."""
        self._held = set()

        def record(param, name):
            if getattr(param, "ds_grad_is_ready", True):
                self._held.discard(name)
            else:
                self._held.add(name)
        self._held_hooks = [param.register_post_accumulate_grad_hook(functools.partial(record, name=name))
                            for name, param in engine.module.named_parameters() if param.requires_grad]

    def _after_replays(self) -> None:
        """End the step; refuse a gradient still held, which ZeRO would never reduce (its parameter
        took part in a mini-batch but not in the last one: a mixture of experts, say)."""
        held = sorted(self._held or ())
        self._end_step()
        if held:
            raise ValueError(
                f"{type(self).__name__} with mini_batch_size or mini_batch_num_tokens under DeepSpeed needs "
                "every trainable parameter that a mini-batch uses to be used by the step's last mini-batch "
                f"too (ZeRO reduces the gradients at the last replay); {', '.join(held[:5])} were not. "
                "Train it under FSDP2 or DDP, or leave mini_batch_size and mini_batch_num_tokens None"
            )

    def _sync_from_here(self) -> None:
        """Gradient reduction back on: the next backward reduces what the replays accumulated."""
        if self._no_sync is not None:
            no_sync, self._no_sync = self._no_sync, None
            no_sync.__exit__(None, None, None)

    def _end_step(self) -> None:
        """Sync back on and every unit resharded; nothing outside a cached step under FSDP2 or
        DeepSpeed."""
        self._texts_to_replay = None
        self._sync_from_here()
        for hook in self._held_hooks or ():
            hook.remove()
        self._held = self._held_hooks = None
        if self._gather_once is not None:
            gather_once, self._gather_once = self._gather_once, None
            gather_once.__exit__(None, None, None)

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        if self._texts_to_replay is not None:  # a cached step this mixin holds (see forward_cached)
            if not with_grad:
                self._texts_to_replay += end - begin  # every text of the first pass is replayed once
            else:
                self._texts_to_replay -= end - begin
                if self._texts_to_replay == 0:  # this replay's backward reduces everything
                    self._sync_from_here()
        return super().embed_minibatch(sentence_feature, begin, end, with_grad, copy_random_state,
                                       random_state)
