"""``InfCLTrainer``: the transformers ``Trainer`` with the Inf-CL loss and gradient caching.

The Trainer keeps its loop, checkpoints, logging and callbacks. This subclass changes only:

- ``compute_loss``: embeddings from the model (``hf_infcl.models``) and ``contrastive_loss`` over
  the whole contrastive batch (every process's rows, through the ring when several processes run);
  with ``distillation_weight``, ``contrastive_distillation_loss`` against the teacher's embeddings
  the batches carry (``TEACHER_COLUMNS``) or a ``teacher`` model computes;
- ``training_step`` when ``chunk_size`` is set: the cached three-phase step of
  ``hf_infcl.grad_cache`` (one gradient reduction per step under DDP or FSDP2, optional data
  offload); under FSDP2, 0-d parameters become 1-element vectors for ``fully_shard`` and are
  saved 0-d again;
- ``evaluation_loop``: ``eval_loss`` as the Trainer means it (the mean over eval batches),
  ``eval_whole_set_loss`` (the whole eval set as one contrastive batch, comparable across batch
  sizes), recall@1/5/10 and MRR in both directions, block by block, without an n x n similarity
  matrix (``hf_infcl.metrics``: a key is a hit when it is the positive or in its group, the
  ``group_column``'s or else the keys with identical inputs; other ties count against the
  positive); its predictions, which
  ``predict()`` returns, are the embeddings of both towers ``(rows, keys)``, with the labels,
  and ``compute_metrics`` gets them as an ``EvalPrediction``;
- ``log``: adds the logit scale (CLAP: ``logit_scale_audio`` and ``logit_scale_text``) and the
  in-batch top-1 accuracy to every training log;
- a callback clamps the learned logit scale after each optimizer step (CLIP's log(100)).

What it reads of the model goes through the model's family adapter (``hf_infcl.models``): the
scale as the model's own forward takes it, and the loss its own ``return_loss=True`` computes
(ALIGN's label smoothing, CLAP's two scales) unless the arguments ask for another. Its
arguments are ``hf_infcl.training_args`` (a plain ``TrainingArguments`` is converted), the
clamp ``hf_infcl.callbacks``, the ranking ``hf_infcl.metrics`` and the card
``hf_infcl.model_card``; all four are usable without a Trainer.

The contrastive batch is ``per_device_train_batch_size`` x number of processes. Gradient
accumulation does not add negatives (each micro-batch is its own contrastive batch); to grow the
batch beyond memory, raise the batch size and set ``chunk_size``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import warnings

import numpy as np
import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import EvalLoopContainer, find_batch_size, nested_detach
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

from .batch_statistics import check_no_batch_statistics
from .callbacks import ClampLogitScale
from .chunk_graphs import DEFAULT_MAX_GRAPHS, ChunkGraphs, average_gradients, reason_against_default_graphs
from .distillation import contrastive_distillation_loss
from .grad_cache import cached_step, split_batch, to_device
from .loss import Objectives, _contrastive_loss
from .metrics import (
    embeddings_by_width,
    input_fingerprints,
    relevant_ranks,
    retrieval_metrics,
    same_input_ids,
)
from .models import (
    _select,
    contrastive_loss_kind,
    encode_keys,
    encode_queries,
    model_family,
    unwrap_model,
)
from .ops.options import check_label_smoothing
from .rng import unreplayed_draws_warning
from .sharding import (
    deepspeed_no_sync,
    fsdp_gather_once,
    full_value,
    keep_gathered_under_zero3,
    prepare_for_sharding,
    scalar_state_dict,
)
from .training_args import TEACHER_COLUMNS, InfCLTrainingArguments

__all__ = ["InfCLTrainer"]

logger = logging.getLogger(__name__)

# rows per process whose in-batch top-1 accuracy is logged (an estimate at large batches)
ACCURACY_ROWS = 1024


class InfCLTrainer(Trainer):
    """Trains a CLIP-like model (ALIGN and Aimv2 too), a ``ClapModel`` or a
    :class:`~hf_infcl.dual_encoder.DualEncoder` with the Inf-CL loss.

    Batches are dicts with the model's tower inputs (``pixel_values`` + ``input_ids``/
    ``attention_mask``; ``input_features`` (+ ``is_longer``) + ``input_ids``/``attention_mask`` for
    CLAP; or ``query_*`` + ``doc_*``); row i of one tower is the positive of row i of the other.
    Everything else is the ``Trainer`` API.

    With ``args.distillation_weight``, the loss distils a teacher over every key of the batch
    (``contrastive_distillation_loss``): the batches carry its embeddings of their rows and keys
    (``teacher_query_embeds``, ``teacher_key_embeds``), or ``teacher``, a model of the student's
    family (the same batch entries), embeds each batch without gradient, in the cached step's
    chunks when ``chunk_size`` is set. The Trainer puts it in eval mode, freezes it and moves it to
    the device: one full copy per process, outside DDP, FSDP and DeepSpeed.

    ``args`` may be a plain ``TrainingArguments``: it is converted to ``InfCLTrainingArguments``
    with every field as the user set it and the contrastive fields at their defaults (a subclass
    with fields of its own is refused, naming them).
    """

    def __init__(self, model=None, args: InfCLTrainingArguments | None = None, *more, teacher=None,
                 **kwargs):
        if model is None:
            raise ValueError("InfCLTrainer needs a model (model_init is not supported)")
        if args is None:
            args = InfCLTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, InfCLTrainingArguments):
            args = _as_infcl_arguments(args)
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("InfCLTrainer computes the contrastive loss itself; drop compute_loss_func")
        self.family = model_family(model)  # TypeError for models we cannot take embeddings from
        self.teacher = teacher
        super().__init__(model, args, *more, **kwargs)
        self._check_combinations()
        sharded = self._is_fsdp2() or self.is_deepspeed_enabled
        self._flattened_scalars = prepare_for_sharding(self.model, self.optimizer) if sharded else []
        # Our loss is a per-batch mean: let the Trainer divide it for gradient accumulation.
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False
        self.loss_kind = args.contrastive_loss or contrastive_loss_kind(self.model)
        if self.loss_kind == "softmax" and contrastive_loss_kind(self.model) == "sigmoid":
            warnings.warn("the model has a logit_bias (SigLIP) but contrastive_loss='softmax' ignores it; it "
                          "gets no gradient (with DDP, set ddp_find_unused_parameters=True)", stacklevel=2)
        self.family.check_loss_options(self.loss_kind, args.symmetric)
        self.label_smoothing = self._label_smoothing()
        self._check_distillation()
        if teacher is not None:
            # a constant target: no gradient, no dropout; one copy per process, outside DDP/FSDP
            teacher.eval().requires_grad_(False).to(args.device)
        if args.logit_scale_max is not None:
            self.add_callback(ClampLogitScale(args.logit_scale_max))
        # [sum of top-1 accuracy, sum of each logged scale (_scale_names), steps] since the last log
        self._step_stats = None
        self._scale_names = []
        self._chunk_graphs = None  # ChunkGraphs of the cached step, made at its first call
        self._graphs_decided = False  # whether the first cached step has decided on them

    def train(self, *args, **kwargs):
        """``Trainer.train``; under DDP, where the cached step may run CUDA graphs, on a CUDA stream
        of its own (:meth:`_ddp_graphs_stream`)."""
        stream = self._ddp_graphs_stream()
        if stream is None:
            return super().train(*args, **kwargs)
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)  # what the caller queued before (the model's moves)
        try:
            with torch.cuda.stream(stream):
                return super().train(*args, **kwargs)
        finally:
            caller.wait_stream(stream)  # the caller reads the trained model on its own stream

    def _ddp_graphs_stream(self):
        """A new CUDA stream where DDP may meet the cached step's CUDA graphs, else None. DDP keeps
        each parameter's gradient accumulator (an autograd node) from its construction, bound to
        the stream current then; a backward waits on that stream at its end, and a capture cannot
        wait on the legacy default stream. Wrapped and trained on a stream of its own, the model's
        replays can be captured."""
        args = self.args
        graphs_possible = (args.chunk_size is not None and args.chunk_cuda_graphs is not False
                           and self.accelerator.num_processes > 1 and self._why_graphs_cannot_run() is None)
        return torch.cuda.Stream() if graphs_possible else None

    def _check_combinations(self):
        args = self.args
        if args.n_gpu > 1:
            raise ValueError("InfCLTrainer does not support torch.nn.DataParallel (several GPUs in one "
                             "process); launch one process per GPU with torchrun or accelerate launch")
        if args.label_smoothing_factor:
            raise ValueError("label_smoothing_factor smooths a classifier's labels and does not apply here; "
                             "the contrastive loss's is label_smoothing (leave label_smoothing_factor at 0)")
        if args.group_positives is not None and args.group_column is None:
            raise ValueError(f"group_positives={args.group_positives!r} needs group_column (the batch column "
                             "whose ids say which keys are a row's positives)")
        if args.chunk_size is not None and args.deepspeed and args.chunk_gradient_sync == "chunk":
            raise ValueError(
                "chunk_gradient_sync='chunk' does not apply to DeepSpeed, which reduces gradients at its "
                "accumulation boundary (once per step); leave it at 'step'"
            )
        if args.chunk_size is not None and self.is_fsdp_enabled and not self._is_fsdp2():
            raise ValueError(
                "InfCLTrainer supports chunk_size (gradient caching) under FSDP2 only; set "
                "fsdp_config={'version': 2} (FSDP1 is deprecated in PyTorch), or leave chunk_size unset"
            )
        if args.chunk_cuda_graphs:
            reason = self._why_graphs_cannot_run()
            if reason is not None:
                raise ValueError(f"chunk_cuda_graphs=True cannot run here: {reason}")
        if args.gradient_accumulation_steps > 1:
            warnings.warn(
                "gradient accumulation does not add negatives: each micro-batch of "
                "per_device_train_batch_size x processes rows is its own contrastive batch. To grow the "
                "contrastive batch, raise per_device_train_batch_size and set chunk_size instead.",
                stacklevel=3,
            )

    def _warn_once_of_random_draws(self, model) -> None:
        """no_grad_chunk_size's replays cannot redraw the gradient-free pass's random numbers: say so
        once where the model draws some (its dropout)."""
        if getattr(self, "_warned_of_random_draws", False):
            return
        self._warned_of_random_draws = True
        settings = f"no_grad_chunk_size={self.args.no_grad_chunk_size} with chunk_size={self.args.chunk_size}"
        message = unreplayed_draws_warning(model, settings, "leave no_grad_chunk_size unset")
        if message is not None:
            warnings.warn(message, stacklevel=3)

    def _label_smoothing(self) -> float:
        """``label_smoothing`` as set, else the model's own loss's (its softmax loss only)."""
        given = self.args.label_smoothing
        if given is not None:
            check_label_smoothing(given, self.loss_kind, grouped=self.args.group_column is not None,
                                  groups="group_column", filtered=self.args.false_negative_margin is not None)
            return given
        own = self.family.label_smoothing if self.loss_kind == "softmax" else 0.0
        conflicts = {"false_negative_margin": "", "group_column": " (a row's candidates would be its allowed "
                     "keys only)"}
        for option, why in conflicts.items():
            if own and getattr(self.args, option) is not None:
                raise ValueError(
                    f"{type(unwrap_model(self.model)).__name__}'s own loss smooths its labels by {own} (what "
                    f"label_smoothing=None takes), which is not defined with {option}{why}: set "
                    f"label_smoothing=0.0, or leave {option} unset"
                )
        return own

    def _check_distillation(self) -> None:
        """What ``distillation_weight`` cannot be combined with: the distillation loss
        (``contrastive_distillation_loss``) is the softmax loss's KL over every key, without
        groups, score filter, label smoothing or Triton kernels."""
        args = self.args
        if args.distillation_weight is None:
            if args.teacher_logit_scale is not None:
                raise ValueError(f"teacher_logit_scale={args.teacher_logit_scale!r} needs "
                                 "distillation_weight (the weight of the KL against the teacher)")
            if self.teacher is not None:
                raise ValueError("teacher needs distillation_weight (the weight of the KL against the "
                                 "teacher's softmax)")
            return
        if self.teacher is not None:
            teacher_family = model_family(self.teacher)  # TypeError for models we cannot embed with
            if not teacher_family.distillable or teacher_family.inputs != self.family.inputs:
                raise ValueError(f"teacher must embed the student's batch as one of its kind does: a "
                                 f"{type(unwrap_model(self.teacher)).__name__} cannot teach a "
                                 f"{type(unwrap_model(self.model)).__name__} (for another tokenizer or "
                                 f"family, precompute its embeddings into {' and '.join(TEACHER_COLUMNS)})")
        prefix = f"distillation_weight={args.distillation_weight!r}"
        if not self.family.distillable:
            raise ValueError(f"{prefix} is not defined for {type(unwrap_model(self.model)).__name__}, whose "
                             "loss is not one softmax loss with one scale; leave distillation_weight unset")
        if self.loss_kind != "softmax":
            raise ValueError(f"{prefix} distils the teacher's softmax over the keys, but the loss is "
                             f"{self.loss_kind!r} (contrastive_loss, or the model's logit_bias): set "
                             "contrastive_loss='softmax'")
        for option in ("group_column", "false_negative_margin", "matryoshka_dims"):
            if getattr(args, option) is not None:
                raise ValueError(f"{prefix} is not defined with {option} (the KL runs over every key of "
                                 f"the batch, on the whole embeddings); leave one of them unset")
        if self.label_smoothing:
            source = ("label_smoothing" if args.label_smoothing is not None else
                      f"{type(unwrap_model(self.model)).__name__}'s own loss (label_smoothing=None)")
            raise ValueError(f"{prefix} is not defined with label smoothing ({source} smooths by "
                             f"{self.label_smoothing}): set label_smoothing=0.0")

    def _is_fsdp2(self) -> bool:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return self.is_fsdp_enabled and getattr(plugin, "fsdp_version", 1) == 2

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self._flattened_scalars and self.args.should_save:
            # Checkpoints keep the model's own shapes: CLIPModel.from_pretrained expects a 0-d
            # logit_scale and would re-initialise a [1] one.
            if state_dict is None:
                state_dict = self.accelerator.unwrap_model(self.model).state_dict()
            state_dict = scalar_state_dict(state_dict, self._flattened_scalars)
        super()._save(output_dir, state_dict=state_dict)

    # ---- data ----------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        column = self.args.group_column
        # the teacher's embeddings travel with the batch to the loss, past remove_unused_columns
        precomputed = self.args.distillation_weight is not None and self.teacher is None
        teacher = TEACHER_COLUMNS if precomputed else ()
        for column in (self.args.group_column, *teacher):
            if column is not None and column not in self._signature_columns:
                self._signature_columns = [*self._signature_columns, column]

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        if self.args.offload and getattr(dataloader, "device", None) is not None:
            # Accelerate's DataLoaderShard would move every whole batch to the GPU; with offload
            # the cached step moves one chunk at a time.
            dataloader.device = None
        return dataloader

    # ---- loss ----------------------------------------------------------------------------

    def _loss_params(self, model) -> list[torch.Tensor]:
        """The model's log logit scale (and SigLIP's bias): the parameters the loss uses directly,
        as the model holds them now (the cached step and FSDP2 need the parameter objects)."""
        return self.family.loss_parameters(model, self.loss_kind)

    def _keep_loss_params_gathered(self, model) -> None:
        """Under DeepSpeed ZeRO-3, before the first forward of the engine: the loss reads the
        scale and bias after the model's forward, where ZeRO-3 would have freed them."""
        if self.is_deepspeed_enabled:
            keep_gathered_under_zero3(unwrap_model(model), self._loss_params(model))

    def _groups(self, inputs, device):
        column = self.args.group_column
        if column is None:
            return None
        if column not in inputs and column in ("label", "label_ids") and "labels" in inputs:
            column = "labels"  # transformers' default collator renames these columns
        if column not in inputs:
            raise KeyError(f"group_column={column!r} is not in the batch (keys: {sorted(inputs)})")
        return torch.as_tensor(inputs[column]).to(device)

    def _teacher(self, inputs, device, chunk_size: int | None = None) -> tuple | None:
        """``(teacher's row embeddings, its key embeddings, its scale)`` of this process's batch on
        ``device``, or None without distillation: the ``teacher`` model's, embedded without
        gradient in chunks of ``chunk_size`` rows, or the batch's ``TEACHER_COLUMNS``. The scale is
        ``teacher_logit_scale``, else the teacher model's own, else None (the student's)."""
        if self.args.distillation_weight is None:
            return None
        given = [column for column in TEACHER_COLUMNS if column in inputs]
        scale = self.args.teacher_logit_scale
        if self.teacher is not None:
            if given:
                raise ValueError(f"the batch carries {', '.join(given)} and InfCLTrainer has a teacher "
                                 "model; give the teacher's embeddings one way")
            rows, keys = self._embed_with_teacher(inputs, device, chunk_size)
            if scale is None:
                family = model_family(self.teacher)
                scale = family.scale_and_bias(self.teacher, *family.scale_parameters(self.teacher))[0]
            return rows, keys, scale
        missing = [column for column in TEACHER_COLUMNS if column not in given]
        if missing:
            raise KeyError(f"distillation_weight needs the teacher's embeddings in the batch: "
                           f"{', '.join(missing)} missing (keys: {sorted(inputs)})")
        rows, keys = (torch.as_tensor(inputs[column]).detach().to(device) for column in TEACHER_COLUMNS)
        return rows, keys, scale

    @torch.no_grad()
    def _embed_with_teacher(self, inputs, device, chunk_size):
        """The teacher model's embeddings of the batch's rows and keys on ``device``, one chunk of
        ``chunk_size`` rows at a time (the whole batch for None), under the student's autocast."""
        family = model_family(self.teacher)
        towers = _select(inputs, (*family.inputs.query, *family.inputs.key))
        rows, keys = [], []
        with self.compute_loss_context_manager():
            for chunk in split_batch(towers, chunk_size):
                chunk_rows, chunk_keys = family.encode_pairs(self.teacher, to_device(chunk, device))
                rows.append(chunk_rows)
                keys.append(chunk_keys)
        return torch.cat(rows), torch.cat(keys)

    def _contrastive(self, model, queries, keys, groups, *values, process_group="auto", teacher=None):
        """The family's loss (``ModelFamily.loss``: the model's own, from the values of its loss
        parameters) over ``contrastive_loss`` with this run's options; with ``teacher`` (what
        ``_teacher`` returns), over ``contrastive_distillation_loss``."""
        dtype = torch.promote_types(queries.dtype, keys.dtype)

        def configured_loss(rows, cols, scale, bias, symmetric=self.args.symmetric):
            # The options were checked once, by InfCLTrainingArguments, _label_smoothing and
            # _check_distillation.
            if teacher is not None:
                teacher_rows, teacher_keys, teacher_scale = teacher
                return contrastive_distillation_loss(
                    rows.to(dtype), cols.to(dtype), teacher_rows.to(dtype), teacher_keys.to(dtype), scale,
                    scale.detach() if teacher_scale is None else teacher_scale, symmetric=symmetric,
                    distillation_weight=self.args.distillation_weight, reduction="mean",
                    process_group=process_group, backend=self.args.loss_backend,
                    precision=self.args.precision,
                )
            return _contrastive_loss(
                rows.to(dtype), cols.to(dtype), scale, bias, positives=None, query_groups=groups,
                key_groups=groups, process_group=process_group, loss=self.loss_kind, symmetric=symmetric,
                reduction="mean", backend=self.args.loss_backend, precision=self.args.precision,
                options_checked=True, label_smoothing=self.label_smoothing,
                objectives=Objectives(self.args.group_positives, self.args.false_negative_margin,
                                      self.args.false_negative_strategy),
                matryoshka_dims=self.args.matryoshka_dims, matryoshka_weights=self.args.matryoshka_weights,
            )

        return self.family.loss(model, configured_loss, queries, keys, *values)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._keep_loss_params_gathered(model)
        teacher = self._teacher(inputs, self.args.device)  # a batch without it fails before the forward
        queries, keys = self.family.encode_pairs(model, inputs)
        groups = self._groups(inputs, queries.device)
        loss = self._contrastive(model, queries, keys, groups, *self._loss_params(model), teacher=teacher)
        if model.training:
            self._track(queries.detach(), keys.detach(), model, groups)
        if return_outputs:
            return loss, {"query_embeds": queries, "key_embeds": keys}
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.args.chunk_size is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        # after model.train(): the modes the layers have in this step
        check_no_batch_statistics(unwrap_model(model), "chunk_size=None")
        if self.args.no_grad_chunk_size not in (None, self.args.chunk_size):
            self._warn_once_of_random_draws(unwrap_model(model))
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        if not self.args.offload:
            inputs = self._prepare_inputs(inputs)
        names = self.family.inputs
        encoder_inputs = {name: inputs[name] for name in (*names.query, *names.key)
                          if inputs.get(name) is not None}
        groups = self._groups(inputs, self.args.device)
        teacher = self._teacher(inputs, self.args.device, self.args.chunk_size)
        ga_steps = self.current_gradient_accumulation_steps
        if self._is_fsdp2():
            # The loss parameters are read sharded (cached_step gathers their full value and
            # reduces their gradient); an evaluation forward may have left the root gathered.
            model.reshard()
        deepspeed = self.is_deepspeed_enabled
        if deepspeed:
            self._keep_loss_params_gathered(model)
            # As Accelerate's DeepSpeed backward: the engine's accumulation boundary follows the
            # Trainer's, the replays stay off it, and the engine steps at the boundary.
            model.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
            no_sync = functools.partial(deepspeed_no_sync, model)
            backward = functools.partial(model.backward, scale_wrt_gas=False)
        else:
            reduce_once = self.args.chunk_gradient_sync == "step"
            no_sync = functools.partial(self.accelerator.no_sync, model) if reduce_once else None
            backward = None
        chunk_graphs = self._graphs_for(model)
        encode, forward_context = self._chunk_encoder(model, chunk_graphs)
        if chunk_graphs is not None:
            no_sync = None  # no DDP hooks run: the gradients are averaged after the step

        def loss_fn(queries, keys, *params):
            return self._contrastive(model, queries, keys, groups, *params, teacher=teacher)

        def scale_for_backward(loss):
            # what Trainer.training_step + Accelerator.backward do to the loss before backward
            if deepspeed:  # the engine's backward applies its own fp16 loss scale
                return loss / ga_steps
            loss = loss / ga_steps / self.accelerator.gradient_accumulation_steps
            scaler = getattr(self.accelerator, "scaler", None)
            return scaler.scale(loss) if scaler is not None else loss

        with self._gather_context(model):
            result = cached_step(
                encode,
                encoder_inputs,
                loss_fn,
                self.args.chunk_size,
                no_grad_chunk_size=self.args.no_grad_chunk_size,
                loss_params=self._loss_params(model),
                offload=self.args.offload,
                device=self.args.device if self.args.offload else None,
                no_sync=no_sync,
                backward=backward,
                scale_loss=scale_for_backward,
                forward_context=forward_context,
                chunk_graphs=chunk_graphs,
            )
        several = self.accelerator.num_processes > 1
        if chunk_graphs is not None and several and self.accelerator.sync_gradients:
            # DDP's reduction, which its hooks would have made in a synchronised backward
            average_gradients(model.parameters(), getattr(model, "process_group", None))
        # logged before the step, as the scale the loss used (ZeRO-3 frees it at the step)
        self._track(*result.embeddings, model, groups)
        if deepspeed and self.accelerator.sync_gradients:
            model.step()  # the optimizer and scheduler the Trainer steps are DeepSpeed's no-op wrappers
        return result.loss.to(self.args.device) / ga_steps

    def _chunk_encoder(self, model, chunk_graphs):
        """(encode, forward_context) of the cached step's chunks: the model's forward (so that DDP's
        hooks run) in the Trainer's loss context; or, with ``chunk_graphs``, the two towers through
        their feature methods (outside DDP's forward), concurrently on two streams, inside the
        graphs too, under the mixed-precision autocast Accelerate would wrap around forward."""
        if chunk_graphs is None:
            return functools.partial(self.family.encode_pairs, model), self.compute_loss_context_manager
        encode = functools.partial(self.family.encode_pairs_on_two_streams, model,
                                   key_stream=self._key_stream)
        return encode, self.accelerator.autocast

    def _gather_context(self, model):
        """Under FSDP2 with chunk_parameter_gather='step': the sharded units' parameters are
        gathered once for the whole cached step (fsdp_gather_once)."""
        if not (self._is_fsdp2() and self.args.chunk_parameter_gather == "step"):
            return contextlib.nullcontext()
        plugin = self.accelerator.state.fsdp_plugin
        return fsdp_gather_once(model, reshard_after_forward=bool(plugin.reshard_after_forward))

    def _graphs_for(self, model) -> ChunkGraphs | None:
        """The cached step's ChunkGraphs, made at its first call: with chunk_cuda_graphs=True, or
        by default (None) where :meth:`_why_no_graphs` finds nothing against them."""
        if not self._graphs_decided:
            self._graphs_decided = True
            setting = self.args.chunk_cuda_graphs
            reason = self._why_no_graphs(model) if setting is None else None
            if reason is not None:
                logger.info("InfCLTrainer: the cached step runs its chunks without CUDA graphs: %s "
                            "(chunk_cuda_graphs=None decided so; True asks for them).", reason)
            elif setting is not False:
                # the default's graphs are bounded in number, and never stop a run that eager mode trains
                by_default = setting is None
                self._chunk_graphs = ChunkGraphs(model.parameters(),
                                                 max_graphs=DEFAULT_MAX_GRAPHS if by_default else None,
                                                 eager_on_failure=by_default)
                self._key_stream = torch.cuda.Stream()
        return self._chunk_graphs

    def _why_graphs_cannot_run(self) -> str | None:
        """What keeps the cached step's CUDA graphs from running at all (an explicit True is refused
        for it), or None."""
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return "FSDP and DeepSpeed reduce (and shard) gradients in hooks that a CUDA graph would skip"
        if self.accelerator.num_processes > 1 and self.args.chunk_gradient_sync == "chunk":
            return ("chunk_gradient_sync='chunk' reduces the gradients in each replay's DDP hooks, which a "
                    "CUDA graph would skip (the default 'step' averages them once after the graphs)")
        if self.args.torch_compile:
            return "torch_compile compiles the model itself"
        if self.args.device.type != "cuda":
            return f"this run trains on {self.args.device.type}, not on a CUDA GPU"
        return None

    def _why_no_graphs(self, model) -> str | None:
        """Why the default (chunk_cuda_graphs=None) leaves the cached step's CUDA graphs off, or None:
        what an explicit True refuses, and what graphs would get wrong or pay for in memory."""
        args = self.args
        reason = self._why_graphs_cannot_run()
        if reason is not None:
            return reason
        if args.no_grad_chunk_size not in (None, args.chunk_size):
            return "no_grad_chunk_size chunks the gradient-free pass otherwise than the replays"
        return reason_against_default_graphs(unwrap_model(model), args.device,
                                             gradient_checkpointing=args.gradient_checkpointing)

    # ---- logging -------------------------------------------------------------------------

    def _logged_this_step(self) -> bool:
        """Whether the optimizer step being computed will be logged (so its metrics are wanted)."""
        args, step = self.args, self.state.global_step + 1
        if args.logging_strategy == "no":
            return False
        if args.logging_strategy == "steps":
            every = max(int(self.state.logging_steps or args.logging_steps), 1)
            return step % every == 0 or (args.logging_first_step and step == 1)
        return True  # epoch logging: the logged step is not known ahead

    @torch.no_grad()
    def _track(self, queries, keys, model, groups=None):
        """Accumulate the in-batch top-1 accuracy of steps that will be logged.

        The first ``ACCURACY_ROWS`` rows of each process are ranked against every key of the global
        batch (keys of other processes gathered), so the cost stays small at any batch size. A row
        is right when no other key scores at least as high as its positive, or (with a group column)
        as its best key of its own group, which the loss does not treat as negatives either: the
        tie rule of ``hf_infcl.metrics``.
        """
        if not self._logged_this_step():
            return
        queries = queries[:ACCURACY_ROWS]
        if groups is not None:
            groups_of_rows = groups[:ACCURACY_ROWS]
        offset = 0
        key_groups = groups
        if self.accelerator.num_processes > 1:
            # pad to the largest rank with NaN rows (they rank below every real key) and gather every key
            padded = self.accelerator.pad_across_processes(keys.float(), dim=0, pad_index=float("nan"))
            offset = self.accelerator.process_index * padded.shape[0]
            keys = self.accelerator.gather(padded)
            if groups is not None:
                key_groups = self.accelerator.gather(self.accelerator.pad_across_processes(groups, dim=0))
        if groups is not None:
            row_ids, key_ids = groups_of_rows, key_groups
        else:
            row_ids = torch.arange(offset, offset + queries.shape[0], device=queries.device)
            key_ids = torch.arange(keys.shape[0], device=queries.device)
        ranks = relevant_ranks(queries, keys, row_ids, key_ids, block_rows=self.args.eval_block_rows)
        hits = (ranks == 0).sum()
        accuracy = torch.as_tensor(hits, dtype=torch.float32, device=queries.device) / queries.shape[0]
        # sharded by FSDP2 between steps: every rank takes part in the gather
        values = [full_value(param.detach()).float() for param in self.family.scale_parameters(model)]
        scales = self.family.logged_scales(model, *values)
        self._scale_names = list(scales)
        scales = [scale.reshape(()).to(queries.device) for scale in scales.values()]
        stats = torch.stack([accuracy, *scales, torch.ones_like(accuracy)])
        previous = self._step_stats
        self._step_stats = stats if previous is None else previous + stats.to(previous)

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self._step_stats is not None:
            stats = self._step_stats.to(self.args.device)
            if self.accelerator.num_processes > 1:
                stats = self.accelerator.reduce(stats, reduction="sum")
            accuracy, *scales, count = stats.tolist()
            logs["accuracy"] = accuracy / count
            for name, scale in zip(self._scale_names, scales):
                logs[name] = scale / count
            self._step_stats = None
        return super().log(logs, *args, **kwargs)

    def create_model_card(self, language=None, license=None, tags=None, model_name=None,
                          finetuned_from=None, tasks=None, dataset_tags=None, dataset=None,
                          dataset_args=None, **kwargs):
        """Write the output directory's README.md with hf_infcl's card (``push_to_hub`` calls
        this): the run's contrastive settings and its latest evaluation, valid Hub metadata."""
        if not self.is_world_process_zero():
            return
        from .model_card import latest_eval_results, save_model_card

        kind = self.family.name
        processes = self.accelerator.num_processes
        save_model_card(
            self.args.output_dir,
            kind,
            model_name=model_name or self.args.hub_model_id or os.path.basename(
                os.path.abspath(self.args.output_dir)),
            base_model=finetuned_from,
            dataset=dataset if isinstance(dataset, str) else None,
            tags=[tags] if isinstance(tags, str) else tags,
            language=language,
            license=license,
            hub_model_id=self.args.hub_model_id,
            global_batch_size=self.args.per_device_train_batch_size * processes,
            per_device_batch_size=self.args.per_device_train_batch_size,
            chunk_size=self.args.chunk_size,
            offload=self.args.offload,
            loss=self.loss_kind,
            symmetric=self.args.symmetric,
            num_processes=processes,
            device=str(self.args.device),
            peak_gpu_memory_gib=(torch.cuda.max_memory_allocated() / 2**30
                                 if torch.cuda.is_available() else None),
            learning_rate=self.args.learning_rate,
            steps=self.state.global_step,
            eval_results=latest_eval_results(self.state.log_history),
        )

    # ---- evaluation ----------------------------------------------------------------------

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """The Trainer's loop over the eval batches, with the contrastive metrics.

        - ``{prefix}_loss``: the Trainer's ``eval_loss``, the mean of the per-batch losses, each batch
          (``per_device_eval_batch_size`` rows of one process, its own rows as negatives) weighted
          as ``Trainer.evaluation_loop`` weights it (``eval_batch_size`` copies, the remainder of the
          last batch dropped by ``gather_for_metrics``). It depends on the eval batch size.
        - ``{prefix}_whole_set_loss``: the loss over the whole eval set taken as one batch (every
          process's rows), comparable across batch sizes and process counts. The name ends in
          ``loss``, so ``metric_for_best_model="whole_set_loss"`` minimises it, as for ``eval_loss``.
        - recall@1/5/10 and MRR in both directions over the whole set, block by block
          (``hf_infcl.metrics``). A retrieved key is a hit when it is the row's positive or shares
          its group: the ``group_column``'s ids when given, else the keys whose inputs are identical
          to the positive's (a repeated caption); keys of other groups that tie with the positive
          count against it.

        Predictions (unless ``prediction_loss_only``) are the embeddings of both towers, a tuple
        ``(rows, keys)`` of numpy arrays in dataset order (``predict()`` returns them); label ids are
        the batches' ``label_names`` (default ``labels``) when every batch has them.
        ``compute_metrics`` is called once with an ``EvalPrediction`` of these (labels None if
        there are none; ``losses``, the per-batch losses, with ``include_for_metrics=["loss"]``);
        its results join the metrics with the prefix, as with the Trainer.
        """
        args = self.args
        if args.batch_eval_metrics and self.compute_metrics is not None:
            raise ValueError("InfCLTrainer calls compute_metrics once, on the whole eval set (the retrieval "
                             "metrics need every row); set batch_eval_metrics=False")
        if prediction_loss_only is None:
            prediction_loss_only = args.prediction_loss_only
        model = self.model
        model.eval()
        params = [p.detach().float() for p in self._loss_params(model)]
        eval_set = self._embed_eval_set(dataloader, model, params, prediction_loss_only)
        losses = torch.cat(eval_set.batch_losses).cpu().numpy()
        finite = np.isfinite(losses)
        if args.logging_nan_inf_filter and finite.any():
            losses = losses[finite]
        with torch.no_grad():
            whole_set_loss = self._contrastive(model, eval_set.queries, eval_set.keys, eval_set.groups,
                                               *params, process_group=None)
        predictions, label_ids = eval_set.predictions.get_arrays(), eval_set.labels.get_arrays()
        metrics = {}
        if self.compute_metrics is not None and predictions is not None:
            extra = {"losses": losses} if "loss" in args.include_for_metrics else {}
            metrics = denumpify_detensorize(self.compute_metrics(
                EvalPrediction(predictions=predictions, label_ids=label_ids, **extra)))
            prefix = f"{metric_key_prefix}_"
            metrics = {name if name.startswith(prefix) else prefix + name: value
                       for name, value in metrics.items()}
        metrics[f"{metric_key_prefix}_loss"] = losses.mean().item()
        metrics[f"{metric_key_prefix}_whole_set_loss"] = float(whole_set_loss)
        metrics.update(self._retrieval_metrics(eval_set, metric_key_prefix))
        return EvalLoopOutput(predictions=predictions, label_ids=label_ids, metrics=metrics,
                              num_samples=eval_set.queries.shape[0])

    def _embed_eval_set(self, dataloader, model, params, prediction_loss_only) -> _EvalSet:
        """Both towers' embeddings of every eval batch, gathered from every process in dataset
        order, with each batch's loss (this process's batch alone, as the Trainer's
        prediction_step), the group ids or the inputs' fingerprints, and the predictions."""
        args = self.args
        eval_set = _EvalSet(EvalLoopContainer(args.eval_do_concat_batches, padding_index=-100),
                            EvalLoopContainer(args.eval_do_concat_batches, padding_index=-100))
        names = self.family.inputs
        batch_size = args.eval_batch_size
        for batch in dataloader:
            if batch_size is None:  # a batch sampler: the Trainer takes the first batch's size
                batch_size = find_batch_size(batch)
            batch = self._prepare_inputs(batch)
            with torch.no_grad(), self.accelerator.autocast():
                batch_queries = encode_queries(model, batch).float()
                batch_keys = encode_keys(model, batch).float()
            batch_groups = self._groups(batch, batch_queries.device)
            with torch.no_grad():  # this process's batch alone, as the Trainer's prediction_step
                batch_loss = self._contrastive(model, batch_queries, batch_keys, batch_groups, *params,
                                               process_group=None)
            eval_set.batch_losses.append(self.accelerator.gather_for_metrics(
                batch_loss.detach().reshape(1).repeat(batch_size)))
            gathered = [batch_queries, batch_keys]
            if batch_groups is not None:
                gathered.append(batch_groups)
            else:
                gathered += [input_fingerprints(_select(batch, names.query)),
                             input_fingerprints(_select(batch, names.key))]
            eval_set.add(*self.accelerator.gather_for_metrics(tuple(gathered)))
            if not prediction_loss_only:
                eval_set.predictions.add((eval_set.query_blocks[-1], eval_set.key_blocks[-1]))
                labels = self._label_ids(batch)
                if labels is not None:  # padded and gathered as the Trainer does
                    labels = self.accelerator.pad_across_processes(labels, dim=1, pad_index=-100)
                    eval_set.labels.add(self.accelerator.gather_for_metrics(labels))
        if not eval_set.query_blocks:
            raise ValueError("the evaluation dataset is empty")
        return eval_set

    def _retrieval_metrics(self, eval_set: _EvalSet, metric_key_prefix: str) -> dict[str, float]:
        """Recall@1/5/10 and MRR in both directions over the whole eval set (``hf_infcl.metrics``);
        with ``matryoshka_dims``, also of each width's L2-normalised prefixes (``..._dim64_mrr``),
        the embeddings that width serves."""
        # A retrieved key is a hit when it is the row's positive or in the positive's group: the
        # group column's, else the keys with the positive's inputs (hf_infcl.metrics).
        if eval_set.groups is None:
            query_ids = same_input_ids(torch.cat(eval_set.query_prints))
            key_ids = same_input_ids(torch.cat(eval_set.key_prints))
        else:
            query_ids = key_ids = eval_set.groups
        row, key = self.family.rows, self.family.keys
        metrics = {}
        for width, queries, keys in embeddings_by_width(eval_set.queries, eval_set.keys,
                                                        self.args.matryoshka_dims or ()):
            directions = {f"{row}_to_{key}": (queries, keys, key_ids),
                          f"{key}_to_{row}": (keys, queries, query_ids)}
            for direction, (rows, cols, ids) in directions.items():
                metrics.update(retrieval_metrics(rows, cols, ids, ids, block_rows=self.args.eval_block_rows,
                                                 prefix=f"{metric_key_prefix}_{direction}_{width}"))
        return metrics

    def _label_ids(self, batch):
        """The batch's labels as the Trainer's prediction_step takes them (``label_names``; for
        contrastive models, which have none, a ``labels`` column), or None."""
        names = self.label_names or ["labels"]
        if not all(isinstance(batch.get(name), torch.Tensor) for name in names):
            return None
        labels = nested_detach(tuple(batch[name] for name in names))
        return labels[0] if len(labels) == 1 else labels

@dataclasses.dataclass
class _EvalSet:
    """What the evaluation loop gathers over the eval set, every process's rows in dataset order,
    batch by batch: both towers' embeddings; the group column's ids, or else each tower's input
    fingerprints; each batch's loss, repeated ``eval_batch_size`` times; the predictions
    (embeddings, unless ``prediction_loss_only``) and labels."""

    predictions: EvalLoopContainer
    labels: EvalLoopContainer
    query_blocks: list[torch.Tensor] = dataclasses.field(default_factory=list)
    key_blocks: list[torch.Tensor] = dataclasses.field(default_factory=list)
    group_blocks: list[torch.Tensor] = dataclasses.field(default_factory=list)
    query_prints: list[torch.Tensor] = dataclasses.field(default_factory=list)
    key_prints: list[torch.Tensor] = dataclasses.field(default_factory=list)
    batch_losses: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def add(self, queries, keys, *ids) -> None:
        """One gathered batch: its embeddings, then its group ids or its two towers' fingerprints."""
        self.query_blocks.append(queries)
        self.key_blocks.append(keys)
        if len(ids) == 1:
            self.group_blocks.append(ids[0])
        else:
            self.query_prints.append(ids[0])
            self.key_prints.append(ids[1])

    @functools.cached_property
    def queries(self) -> torch.Tensor:
        return torch.cat(self.query_blocks)

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        return torch.cat(self.key_blocks)

    @functools.cached_property
    def groups(self) -> torch.Tensor | None:
        return torch.cat(self.group_blocks) if self.group_blocks else None


def _as_infcl_arguments(args) -> InfCLTrainingArguments:
    """``TrainingArguments`` -> ``InfCLTrainingArguments``: the same field values, our defaults for
    the added fields."""
    if not isinstance(args, TrainingArguments):
        raise TypeError("args must be TrainingArguments or InfCLTrainingArguments, got "
                        f"{type(args).__name__}")
    ours = {field.name for field in dataclasses.fields(InfCLTrainingArguments) if field.init}
    given = {field.name: getattr(args, field.name) for field in dataclasses.fields(args) if field.init}
    unknown = sorted(set(given) - ours)
    if unknown:
        raise TypeError(f"args of type {type(args).__name__} has fields InfCLTrainingArguments lacks "
                        f"({', '.join(unknown)}); pass TrainingArguments or InfCLTrainingArguments")
    return InfCLTrainingArguments(**given)

