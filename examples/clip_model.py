"""The model side of ``train_clip.py``: loading, the two towers as one module, the loss and one
training step, and the held-out evaluation.

- :func:`load_model_and_processor`: a checkpoint (CLIP, SigLIP, SigLIP 2, any CLIP-like model with
  its processor), a config's architecture, or the tiny default model (``tiny_clip``).
- :func:`embedder_for`: the model as a :class:`ClipEmbedder` (normalised embeddings of both towers:
  what DDP / FSDP2 wrap; the model's ``forward`` would build the b x b logits), with the loss's
  learned scale and bias.
- :func:`clip_loss` and :func:`training_step`: one forward/backward of a batch with the exact
  Inf-CL loss over the global batch (a ring across processes), in chunks with ``--chunk_size``
  (GradCache), on GPUs as CUDA graphs (:func:`chunk_graphs_for`; under DDP on a stream of their
  own, :func:`ddp_training_stream`).
- :func:`evaluate`: zero-shot top-1 and image<->text recall of the held-out split.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from hf_infcl.sharding import scalar_state_dict

from example_cli import fail
from image_text_batches import group_ids
from retrieval_metrics import embed_texts, retrieval_metrics, zero_shot_accuracy

# Caption length of the tiny default model (the digits' and most captions' words fit).
TINY_TEXT_LENGTH = 32


def _features(output):
    """``get_*_features`` return a tensor (transformers 4) or an output with the projection in
    ``pooler_output`` (transformers 5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipEmbedder(torch.nn.Module):
    """The two towers as one module returning normalised embeddings (what DDP / FSDP2 wrap).

    Calling the model's ``forward`` would build CLIP's b x b logits matrix, which is what the
    Inf-CL loss exists to avoid. The sigmoid loss's learned bias is SigLIP's own ``logit_bias``
    (``model_bias``); a CLIPModel trained with the sigmoid loss has none, and ``logit_bias`` makes
    it a parameter of this module rather than of the loop: DDP and FSDP2 then average its gradient
    over the processes like the logit scale's, Accelerate's FSDP2 ``prepare`` finds it in the model
    (it remaps every optimizer parameter to the model's sharded one), and ``save_state``
    checkpoints it.
    """

    def __init__(self, clip, logit_bias: float | None = None, model_bias: bool = False):
        super().__init__()
        self.clip = clip
        self.model_bias = model_bias
        self.logit_bias = None if logit_bias is None else torch.nn.Parameter(torch.tensor(float(logit_bias)))

    def forward(self, input_ids=None, attention_mask=None, **images):
        """(image, text) embeddings of the towers whose inputs are given (None for the other); the
        image inputs are ``pixel_values`` and, for SigLIP 2, ``pixel_attention_mask`` and
        ``spatial_shapes``.

        Evaluation calls this too: FSDP2 gathers this root module's own parameters (embeddings,
        projections, the scale) only around its ``forward``.
        """
        image = text = None
        if images.get("pixel_values") is not None:
            image = F.normalize(_features(self.clip.get_image_features(**images)), dim=-1)
        if input_ids is not None:
            text = _features(self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask))
            text = F.normalize(text, dim=-1)
        return image, text

    def loss_parameters(self) -> list[torch.Tensor]:
        """The parameters the loss uses directly, read now: under FSDP2 the module holds sharded
        DTensors between steps and the gathered tensors after a forward."""
        bias = self.clip.logit_bias if self.model_bias else self.logit_bias
        return [self.clip.logit_scale] + ([bias] if bias is not None else [])


def embedder_for(model, loss: str, fresh: bool, global_batch: int) -> ClipEmbedder:
    """``model`` as a :class:`ClipEmbedder` for ``loss``, with its loss parameters: the learned
    temperature and, for the sigmoid loss, a learned bias, the model's own for SigLIP (a pretrained
    one kept as it is), else a new one the embedder holds. A ``fresh`` (not pretrained) model, or
    one without a bias, starts the sigmoid loss as SigLIP does."""
    model_bias = loss == "sigmoid" and getattr(model, "logit_bias", None) is not None
    logit_bias = None
    if loss == "sigmoid" and (fresh or not model_bias):
        # SigLIP's initialisation, t = 10 and b = -10, puts the prior probability of a pair being
        # positive at about 1 / (its batch of 32k); b = -log(batch) does the same for ours.
        logit_bias = -math.log(global_batch)
        with torch.no_grad():
            model.logit_scale.fill_(math.log(10.0))
            if model_bias:
                model.logit_bias.fill_(logit_bias)
                logit_bias = None
    return ClipEmbedder(model, logit_bias, model_bias=model_bias)


def caption_padding(model) -> str:
    """SigLIP's text towers pool the last position: their captions are padded to the length they
    were trained on (transformers' SigLIP docs: ``padding="max_length"``); CLIP's to the longest."""
    return "max_length" if getattr(model.config, "model_type", "") in ("siglip", "siglip2") else "longest"


def adamw(embedder, learning_rate: float, weight_decay: float, beta2: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, without weight decay for biases, norms and the scale."""
    decay, no_decay = [], []
    for name, param in embedder.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "logit_scale" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, beta2))


def pretrained_state_dict(embedder_state: dict, vectorised: list[str], prefix: str = "clip.") -> dict:
    """The model's state dict for ``save_pretrained`` out of the embedder's: its ``prefix`` keys
    only (not the loop's bias), with the parameters ``vectorise_scalar_parameters`` made 1-element
    0-d again, so that ``from_pretrained`` loads them instead of re-initialising a mismatch."""
    model_state = {key.removeprefix(prefix): value for key, value in embedder_state.items()
                   if key.startswith(prefix)}
    return scalar_state_dict(model_state, [name.removeprefix(prefix) for name in vectorised])


def clamp_logit_scale(model: ClipEmbedder, loss: str = "softmax") -> None:
    """CLIP caps the scale at 100 (SigLIP does not: its pretrained scale is above 100); this loop
    also keeps it at or above 1 (log-scale >= 0). Done after the optimizer step, on the parameter
    the optimizer updates (under FSDP2 the sharded one), by the library's clamp (the one
    ``InfCLTrainer`` uses, here with a lower bound too)."""
    from hf_infcl.callbacks import clamp_logit_scale as clamp

    clamp(model.clip.logit_scale, maximum=100.0 if loss == "softmax" else math.inf, minimum=1.0)


def clip_loss(args, groups, process_group="auto"):
    """``loss_fn(image_embeds, text_embeds, log_scale[, bias])`` of one batch."""
    from hf_infcl import contrastive_loss

    def loss_fn(image_embeds, text_embeds, log_scale, *bias):
        groups_kwargs = {}
        if args.mask_false_negatives:
            groups_kwargs = {"query_groups": groups, "key_groups": groups}
        return contrastive_loss(
            image_embeds,
            text_embeds,
            log_scale.exp(),
            bias[0] if bias else None,
            loss=args.loss,
            symmetric=args.symmetric,
            process_group=process_group,
            backend=args.backend,
            precision=args.precision,
            **groups_kwargs,
        )

    return loss_fn


def graphs_cannot_run(device: torch.device, processes: int, fsdp2: bool,
                      reduce_every_chunk: bool) -> str | None:
    """What keeps the cached step's CUDA graphs (--chunk_cuda_graphs) from running, or None. Under
    DDP the graphs run the towers outside DDP's forward and the gradients are averaged after the
    step (:func:`training_step`)."""
    if device.type != "cuda":
        return f"this run trains on {device.type}, not on a CUDA GPU"
    if fsdp2:
        return "FSDP2 reduces and shards the gradients in hooks that a CUDA graph would skip"
    if reduce_every_chunk and processes > 1:
        return ("--reduce_every_chunk reduces the gradients in each replay's hooks, which a CUDA graph "
                "would skip")
    return None


def ddp_training_stream(asked: bool | None, *, chunk_size, device, processes: int, fsdp2: bool,
                        reduce_every_chunk: bool):
    """A CUDA stream to wrap the model in DDP and train on where the cached step's graphs may run
    under DDP, else None. DDP binds each parameter's gradient accumulator to the stream current
    when it wraps the model, a backward waits on that stream, and a captured backward cannot wait
    on the default one (:mod:`hf_infcl.chunk_graphs`)."""
    if not chunk_size or asked is False or processes == 1:
        return None
    if graphs_cannot_run(device, processes, fsdp2, reduce_every_chunk) is not None:
        return None
    return torch.cuda.Stream(device)


def chunk_graphs_for(model, asked: bool | None, *, device, processes: int, fsdp2: bool,
                     reduce_every_chunk: bool):
    """(the cached step's :class:`~hf_infcl.chunk_graphs.ChunkGraphs`, or None; why not, or None).

    ``asked`` is --chunk_cuda_graphs: None (the default) turns them on where they can run and give the
    eager step's gradients, at most ``DEFAULT_MAX_GRAPHS`` of them, a failed capture running eagerly
    from then on; True where they can run (the caller refuses the rest); False never."""
    from hf_infcl.chunk_graphs import DEFAULT_MAX_GRAPHS, ChunkGraphs, reason_against_default_graphs

    if asked is False:
        return None, "--chunk_cuda_graphs false"
    reason = graphs_cannot_run(device, processes, fsdp2, reduce_every_chunk)
    if reason is None and asked is None:
        reason = reason_against_default_graphs(model, device)
    if reason is not None:
        return None, reason
    by_default = asked is None
    return ChunkGraphs(model.parameters(), max_graphs=DEFAULT_MAX_GRAPHS if by_default else None,
                       eager_on_failure=by_default), None


def training_step(embedder, model, batch, loss_fn, chunk_size=None, *, offload=False, device=None,
                  no_sync=None, forward_context=contextlib.nullcontext, scale_loss=None, backward=None,
                  chunk_graphs=None):
    """One forward/backward of the batch; the detached loss. ``embedder`` is what ``prepare``
    returned (DDP, FSDP2 or the module), ``model`` the :class:`ClipEmbedder` inside it. With
    ``chunk_graphs`` the chunks run as CUDA graphs through ``model`` (under DDP outside its forward:
    DDP's hooks, which a graph would skip, do not run) and the gradients are averaged after the step,
    as DDP's synchronised backward would; ``no_sync`` is not used then."""
    from hf_infcl.chunk_graphs import average_gradients
    from hf_infcl.grad_cache import cached_step

    if chunk_size:
        graphed = chunk_graphs is not None
        encoder = model if graphed else embedder
        # The loss parameters as read before the step: under FSDP2 sharded DTensors, which
        # cached_step gives the loss as their full value and whose gradient it averages over ranks.
        loss = cached_step(
            lambda chunk: encoder(**chunk),
            batch,
            loss_fn,
            chunk_size,
            loss_params=model.loss_parameters(),
            offload=offload,
            device=device,
            no_sync=None if graphed else no_sync,
            forward_context=forward_context,
            scale_loss=scale_loss,
            chunk_graphs=chunk_graphs,
        ).loss
        if graphed and isinstance(embedder, torch.nn.parallel.DistributedDataParallel):
            average_gradients(model.parameters(), embedder.process_group)
        return loss
    with forward_context():
        image_embeds, text_embeds = embedder(**batch)
    # Read after the forward: under FSDP2 the root's parameters are then the gathered tensors,
    # whose gradient FSDP2 reduce-scatters with the rest.
    loss = loss_fn(image_embeds, text_embeds, *model.loss_parameters())
    (backward or torch.Tensor.backward)(loss)
    return loss.detach()


def freeze_towers(model, vision=False, text=False) -> None:
    """--freeze_vision_model (LiT: a locked image tower, its projection included) and
    --freeze_text_model."""
    for frozen, tower, projection in ((vision, "vision_model", "visual_projection"),
                                      (text, "text_model", "text_projection")):
        if frozen:
            for part in (tower, projection):
                if getattr(model, part, None) is not None:
                    getattr(model, part).requires_grad_(False)


def caption_length(model, given: int | None) -> int:
    """--max_seq_length, by default the text length the model was built or pretrained with: its
    text config's ``max_position_embeddings`` (77 for CLIP, 64 for SigLIP, which must see its
    captions padded to that length)."""
    return given or model.config.text_config.max_position_embeddings


def load_model_and_processor(model_args, data_args, data, seed):
    """(model, processor, description): --model_name_or_path (any CLIP-like checkpoint with its
    processor), else a fresh model of --config_name's architecture, else the tiny --model_type model;
    the last two with the word-level tokenizer over ``data``'s captions."""
    from transformers import CONFIG_MAPPING, AutoModel, AutoProcessor, PretrainedConfig

    from tiny_clip import (
        FAMILIES,
        build_tiny_clip_and_processor,
        build_word_tokenizer,
        model_for,
        processor_for,
        with_word_tokenizer,
    )

    if model_args.model_name_or_path is not None:
        model = AutoModel.from_pretrained(model_args.model_name_or_path)
        processor = AutoProcessor.from_pretrained(model_args.model_name_or_path)
        return model, processor, model_args.model_name_or_path
    texts = data.vocabulary_text()
    if model_args.config_name is not None:
        # a config without its model_type is a CLIPConfig, as this flag always took
        family = PretrainedConfig.get_config_dict(model_args.config_name)[0].get("model_type", "clip")
        if family not in FAMILIES:
            fail(f"--config_name must be a config of {', '.join(FAMILIES)}; got a {family} config")
        config = CONFIG_MAPPING[family].from_pretrained(model_args.config_name)
        tokenizer = build_word_tokenizer(texts, max_length=config.text_config.max_position_embeddings)
        config = with_word_tokenizer(config, tokenizer)
        return (model_for(config, seed), processor_for(config, tokenizer),
                f"{model_args.config_name} (config, random init)")
    model, processor = build_tiny_clip_and_processor(
        texts,
        family=model_args.model_type,
        image_size=model_args.image_size,
        patch_size=model_args.patch_size,
        seed=seed,
        width=model_args.tiny_width,
        layers=model_args.tiny_layers,
        max_text_length=data_args.max_seq_length or TINY_TEXT_LENGTH,
    )
    return model, processor, f"tiny {type(model).__name__} built from a config (random init)"


@torch.no_grad()
def evaluate(embedder, processor, data, held_out_images, device, batch_size, max_length, classification=None,
             padding="longest"):
    """Zero-shot top-1 over the class prompts and image<->text recall over the held-out pairs.

    Zero-shot runs on ``classification`` (``(ImageCaptionData, pixel values)`` of --eval_dataset)
    when given, else on the held-out pairs where the data has classes. ``embedder`` is the
    :class:`ClipEmbedder` (under FSDP2 the sharded root, through its forward); every process
    calls this with the same data, as FSDP2's gathers need."""
    was_training = embedder.training
    embedder.eval()
    tokenizer = processor.tokenizer

    def embed_text(texts):
        def encode(**tokens):
            return embedder(**tokens)[1]

        embeds = embed_texts(tokenizer, texts, encode, batch_size, max_length, device, padding=padding)
        return F.normalize(embeds, dim=-1)

    def embed_images(inputs):
        starts = range(0, len(inputs["pixel_values"]), batch_size)
        return F.normalize(torch.cat([
            embedder(**{name: value[s : s + batch_size].to(device) for name, value in inputs.items()})[0]
            .float() for s in starts]), dim=-1)

    image_embeds = embed_images(held_out_images)
    metrics = {}
    if classification is None and data.class_names is not None:
        classification = (data, image_embeds)
    elif classification is not None:
        classification = (classification[0], embed_images(classification[1]))
    if classification is not None:
        classes, class_images = classification
        prompts = classes.class_prompts()
        flat = embed_text([p for class_prompts in prompts for p in class_prompts])
        # Prompt ensemble: a class is the normalised mean of its templates' embeddings.
        class_embeds = F.normalize(flat.view(len(prompts), len(prompts[0]), -1).mean(dim=1), dim=-1)
        labels = torch.tensor([ex.label for ex in classes.held_out], device=device)
        metrics["zero_shot_top1"] = zero_shot_accuracy(class_images, class_embeds, labels)
    # Retrieval over the distinct held-out captions (templated data repeats them). A caption
    # answers an image when it describes it: same class where there are classes, else the
    # same text.
    caption_group = {}
    for ex, groups in zip(data.held_out, group_ids(data, data.held_out)):
        caption_group.update(zip(ex.captions, groups))
    image_ids = torch.tensor([groups[0] for groups in group_ids(data, data.held_out)], device=device)
    text_ids = torch.tensor(list(caption_group.values()), device=device)
    text_embeds = embed_text(list(caption_group))
    metrics.update(retrieval_metrics(image_embeds, text_embeds, image_ids, text_ids, prefix="image_to_text_"))
    metrics.update(retrieval_metrics(text_embeds, image_embeds, text_ids, image_ids, prefix="text_to_image_"))
    embedder.train(was_training)
    return metrics
