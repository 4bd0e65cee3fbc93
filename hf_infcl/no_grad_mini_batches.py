"""The gradient-free pass of the cached sentence-transformers losses (``losses.InfCLLoss``,
``InfCLGISTLoss``, ``InfCLDistillLoss`` with ``mini_batch_size``) in mini-batches of its own size.

sentence-transformers' ``CachedLossMixin`` embeds every mini-batch without gradient, computes the
loss and its gradients w.r.t. the embeddings, then replays each mini-batch with gradient. The
first pass keeps no activations, so it fits larger mini-batches, which keep the device busier:
``no_grad_mini_batch_size`` sets their size (:class:`NoGradMiniBatchesMixin`) while the replays
keep ``mini_batch_size``. As with ``hf_infcl.grad_cache.cached_step``'s ``no_grad_chunk_size``, a
replay then covers part of a first-pass mini-batch and cannot draw that pass's random numbers
again: the gradients are exact (to the rounding of other matmul shapes) for a model that draws
none in training (dropout 0, or its dropout layers in eval mode), approximate otherwise, which a
warning says once (:func:`hf_infcl.rng.unreplayed_draws_warning`).
"""

from __future__ import annotations

import functools
import logging

import torch

from .ops.options import check_chunk_size, check_chunking
from .rng import unreplayed_draws_warning

__all__ = ["NoGradMiniBatchesMixin", "check_no_grad_mini_batch_size"]

logger = logging.getLogger(__name__)


def check_no_grad_mini_batch_size(no_grad_mini_batch_size, mini_batch_size, mini_batch_num_tokens) -> None:
    """The one rule of ``no_grad_mini_batch_size`` with the mini-batch settings it goes with: a
    positive int or None (gradient caching's chunk-size rule), and when set, ``mini_batch_size``
    set too (the replays' size) and ``mini_batch_num_tokens`` not."""
    check_chunk_size("no_grad_mini_batch_size", no_grad_mini_batch_size)
    if no_grad_mini_batch_size is None:
        return
    if mini_batch_num_tokens is not None:
        # A budget scaled for the first pass would pack other texts together than the replays'
        # budget, as a size does; refused rather than guess the scale.
        raise ValueError(
            f"no_grad_mini_batch_size={no_grad_mini_batch_size!r} cannot be combined with "
            f"mini_batch_num_tokens={mini_batch_num_tokens!r}: mini-batches packed by a token budget have no "
            "size in texts to enlarge. Give mini_batch_size instead of mini_batch_num_tokens, or leave "
            "no_grad_mini_batch_size None"
        )
    check_chunking(mini_batch_size, {"no_grad_mini_batch_size": no_grad_mini_batch_size},
                   name="mini_batch_size")


class NoGradMiniBatchesMixin:
    """Put between ``ShardedReplaysMixin`` and ``CachedLossMixin`` among a cached loss's bases.
    ``no_grad_mini_batch_size`` None, or equal to ``mini_batch_size``: ``CachedLossMixin``'s
    ``forward_cached`` unchanged (each replay under its mini-batch's RNG state). Another size: the
    gradient-free pass (the model's, and a second model's collected beside it) runs in mini-batches
    of that many texts, the loss's gradients are cut again into ``mini_batch_size`` rows, and
    sentence-transformers' backward hook replays those mini-batches without RNG replay.

    ``no_grad_mini_batch_size`` is assignable, as the loss's other hyperparameters, and checked
    when assigned and at each forward (``mini_batch_size`` may have changed since) by
    :func:`check_no_grad_mini_batch_size`; the loss's forward asks :meth:`_caches_this_forward`
    whether to cache.
    """

    _no_grad_mini_batch_size: int | None = None
    # Whether this loss has warned that its model's dropout makes the gradients approximate.
    _warned_of_dropout: bool = False

    @property
    def no_grad_mini_batch_size(self) -> int | None:
        return self._no_grad_mini_batch_size

    @no_grad_mini_batch_size.setter
    def no_grad_mini_batch_size(self, value: int | None) -> None:
        check_no_grad_mini_batch_size(value, self.mini_batch_size, self.mini_batch_num_tokens)
        self._no_grad_mini_batch_size = value

    def _caches_this_forward(self) -> bool:
        """Whether this forward caches gradients, its mini-batch settings checked as they are now."""
        check_no_grad_mini_batch_size(self.no_grad_mini_batch_size, self.mini_batch_size,
                                      self.mini_batch_num_tokens)
        return self.mini_batch_size is not None or self.mini_batch_num_tokens is not None

    def forward_cached(self, sentence_features, labels=None):
        if self.no_grad_mini_batch_size in (None, self.mini_batch_size):
            return super().forward_cached(sentence_features, labels)
        from sentence_transformers.base.losses.gradcache import _backward_hook, _minibatch_ranges

        sentence_features = list(sentence_features)
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._warn_once_of_dropout()
        # Both passes' boundaries before any forward, as CachedLossMixin takes them.
        replay_ranges = [_minibatch_ranges(features, self.mini_batch_size) for features in sentence_features]
        no_grad_ranges = [_minibatch_ranges(features, self.no_grad_mini_batch_size)
                          for features in sentence_features]
        reps = [[rep.detach().requires_grad_() for rep, _ in self.embed_minibatch_iter(
                    sentence_feature=features, with_grad=False, copy_random_state=False, ranges=ranges)]
                for features, ranges in zip(sentence_features, no_grad_ranges)]
        if not grad_enabled:
            return self.calculate_loss(reps, labels)
        loss = self.calculate_loss(reps, labels, with_backward=True).detach().requires_grad_()
        cache = self._replay_gradients(reps, replay_ranges)
        loss.register_hook(functools.partial(
            _backward_hook, sentence_features=sentence_features, loss_obj=self, cache=cache,
            # no state to restore: each replay draws afresh (a list per column, as the hook indexes it)
            random_states=[[None] * len(ranges) for ranges in replay_ranges], ranges=replay_ranges,
        ))
        return loss

    def _replay_gradients(self, reps, replay_ranges) -> list[list[torch.Tensor]]:
        """The loss's gradient w.r.t. each column's embeddings, cut into the replays' mini-batches."""
        unused = [str(index) for index, column in enumerate(reps) if any(rep.grad is None for rep in column)]
        if unused:  # CachedLossMixin's check, in its words
            raise ValueError(
                f"The loss computation of {type(self).__name__} did not use input column(s) "
                f"{', '.join(unused)}: their embeddings received no gradient. Every input column is embedded "
                "(twice, with gradient caching), so remove the unused column(s) from the dataset instead."
            )
        return [list(torch.cat([rep.grad for rep in column]).split([end - begin for begin, end in ranges]))
                for column, ranges in zip(reps, replay_ranges)]

    def _warn_once_of_dropout(self) -> None:
        if self._warned_of_dropout:
            return
        settings = (f"no_grad_mini_batch_size={self.no_grad_mini_batch_size} with "
                    f"mini_batch_size={self.mini_batch_size}")
        message = unreplayed_draws_warning(
            self.model, settings,
            "leave no_grad_mini_batch_size None (each replay then redraws its mini-batch's masks)")
        if message is None:
            return
        self._warned_of_dropout = True
        logger.warning(f"{type(self).__name__}: {message}")
