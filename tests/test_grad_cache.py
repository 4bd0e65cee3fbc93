"""GradCache (hf_infcl.grad_cache): a cached chunked step gives the full-batch step's gradients.

Dropout stays on where the comparison allows it: the uncached reference then embeds the same
chunks with grad in one graph under the same seed, so both draw the same dropout masks only if
the replay restores each chunk's RNG state.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings

import pytest
import torch

from hf_infcl import contrastive_loss
from hf_infcl.chunk_graphs import ChunkGraphs
from hf_infcl.grad_cache import cached_step, split_batch
from tests.helpers.offline import run_two_processes
from tests.helpers.trainer_fixtures import (
    clip_batch,
    is_activation_checkpointing,
    naflex_batch,
    one_thread,  # noqa: F401  (a fixture)
    pair_text_batch,
    parameter_grads,
    tiny_clip,
    tiny_dual_encoder,
    tiny_siglip2,
)

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clip_encoder(model):
    def encode(chunk):
        out = model(**chunk)
        return out.image_embeds, out.text_embeds

    return encode


def clip_loss(image_embeds, text_embeds, log_scale):
    return contrastive_loss(image_embeds, text_embeds, log_scale.exp())


def assert_same_grads(cached, reference, rtol=1e-5, atol=1e-6):
    assert cached.keys() == reference.keys()
    assert len(cached) > 10
    for name in reference:
        torch.testing.assert_close(cached[name], reference[name], rtol=rtol, atol=atol, msg=name)


def uncached_chunked_grads(model, batch, chunk_size, seed):
    """The full-batch step in one autograd graph, the encoders run over the same chunks."""
    model.zero_grad()
    encode = clip_encoder(model)
    torch.manual_seed(seed)
    outputs = [encode(chunk) for chunk in split_batch(batch, chunk_size)]
    image_embeds, text_embeds = (torch.cat(parts) for parts in zip(*outputs))
    loss = clip_loss(image_embeds, text_embeds, model.logit_scale)
    loss.backward()
    return loss.detach(), parameter_grads(model)


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload"])
def test_cached_step_matches_full_batch_with_dropout(offload):
    model = tiny_clip(dropout=0.2)
    batch = clip_batch(16)
    reference_loss, reference = uncached_chunked_grads(model, batch, 4, seed=7)

    model.zero_grad()
    torch.manual_seed(7)
    result = cached_step(clip_encoder(model), batch, clip_loss, 4, loss_params=[model.logit_scale],
                         offload=offload, device="cpu" if offload else None)
    torch.testing.assert_close(result.loss, reference_loss, rtol=1e-6, atol=1e-6)
    assert_same_grads(parameter_grads(model), reference)
    assert model.logit_scale.grad is not None and model.logit_scale.grad.abs() > 0
    assert [e.shape for e in result.embeddings] == [(16, 8), (16, 8)]
    assert not any(e.requires_grad for e in result.embeddings)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-towers", "separate-towers"])
def test_cached_step_matches_full_batch_dual_encoder(shared):
    model = tiny_dual_encoder(shared=shared, dropout=0.2)
    batch = pair_text_batch(16)

    def encode(chunk):
        out = model(**chunk)
        return out.query_embeds, out.doc_embeds

    def loss_fn(queries, docs, log_scale):
        return contrastive_loss(queries, docs, log_scale.exp())

    torch.manual_seed(3)
    outputs = [encode(chunk) for chunk in split_batch(batch, 4)]
    queries, docs = (torch.cat(parts) for parts in zip(*outputs))
    reference_loss = loss_fn(queries, docs, model.log_logit_scale)
    reference_loss.backward()
    reference = parameter_grads(model)

    model.zero_grad()
    torch.manual_seed(3)
    result = cached_step(encode, batch, loss_fn, 4, loss_params=[model.log_logit_scale])
    torch.testing.assert_close(result.loss, reference_loss.detach(), rtol=1e-6, atol=1e-6)
    assert_same_grads(parameter_grads(model), reference)
    assert "log_logit_scale" in reference


def test_cached_step_matches_clip_own_loss_without_dropout():
    """Against CLIPModel(return_loss=True) on the whole batch in one call: an independent oracle."""
    model = tiny_clip(dropout=0.0)
    batch = clip_batch(16, seed=3)
    out = model(**batch, return_loss=True)
    out.loss.backward()
    reference = parameter_grads(model)

    model.zero_grad()
    result = cached_step(clip_encoder(model), batch, clip_loss, 4, loss_params=[model.logit_scale])
    torch.testing.assert_close(result.loss, out.loss.detach(), rtol=1e-6, atol=1e-6)
    assert_same_grads(parameter_grads(model), reference)


def test_cached_step_matches_siglip2_own_loss_on_naflex_batches():
    """SigLIP 2's chunks carry the matching rows of every image input (rows of different numbers
    of valid patches, uneven chunks): Siglip2Model(return_loss=True) on the whole batch is the oracle."""
    from hf_infcl.models import model_family, scale_and_bias

    model = tiny_siglip2()
    batch = naflex_batch(10, seed=3)
    out = model(**batch, return_loss=True)
    out.loss.backward()
    reference = parameter_grads(model)

    model.zero_grad()
    family = model_family(model)

    def sigmoid_loss(image_embeds, text_embeds, log_scale, bias):
        return contrastive_loss(image_embeds, text_embeds, *scale_and_bias(log_scale, bias), loss="sigmoid")

    result = cached_step(functools.partial(family.encode_pairs, model), batch, sigmoid_loss, 3,
                         loss_params=family.loss_parameters(model, "sigmoid"))
    torch.testing.assert_close(result.loss, out.loss.detach(), rtol=1e-6, atol=1e-6)
    assert_same_grads(parameter_grads(model), reference)
    assert model.logit_bias.grad.abs() > 0


@pytest.mark.parametrize("no_grad_chunk_size", [16, 6], ids=["whole-batch", "uneven"])
def test_larger_no_grad_chunks_keep_the_gradients_without_dropout(no_grad_chunk_size):
    """The first pass in other chunks than the replays: exact for encoders that draw no random
    numbers (CLIP's own loss on the whole batch as the oracle)."""
    model = tiny_clip(dropout=0.0)
    batch = clip_batch(16, seed=3)
    model(**batch, return_loss=True).loss.backward()
    reference = parameter_grads(model)

    model.zero_grad()
    cached_step(clip_encoder(model), batch, clip_loss, 4, loss_params=[model.logit_scale],
                no_grad_chunk_size=no_grad_chunk_size)
    assert_same_grads(parameter_grads(model), reference)


def test_replay_without_rng_restore_would_differ():
    """The dropout check has teeth: chunks that draw fresh masks in the replay change the grads."""
    model = tiny_clip(dropout=0.2)
    batch = clip_batch(16)
    _, reference = uncached_chunked_grads(model, batch, 4, seed=7)
    model.zero_grad()
    torch.manual_seed(8)  # a different stream: the replay's masks no longer match phase 1's draws
    cached_step(clip_encoder(model), batch, clip_loss, 4, loss_params=[model.logit_scale])
    grads = parameter_grads(model)
    assert max((grads[k] - reference[k]).abs().max().item() for k in reference) > 1e-4


def test_two_towers_as_separate_encoders_and_scaled_loss():
    """One callable per tower (different sizes per tower allowed) and a GradScaler-like factor."""
    model = tiny_clip(dropout=0.1)
    batch = clip_batch(12, seed=4)
    images = {"pixel_values": batch["pixel_values"]}
    texts = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def image_tower(chunk):
        return model.get_image_features(**chunk).pooler_output

    def text_tower(chunk):
        return model.get_text_features(**chunk).pooler_output

    def loss_fn(image_embeds, text_embeds, log_scale):
        image_embeds = torch.nn.functional.normalize(image_embeds, dim=-1)
        text_embeds = torch.nn.functional.normalize(text_embeds, dim=-1)
        return contrastive_loss(image_embeds, text_embeds, log_scale.exp(), backend="reference")

    torch.manual_seed(11)
    reference_loss = loss_fn(image_tower(images), text_tower(texts), model.logit_scale)
    (reference_loss * 8.0).backward()  # uncached chunk = whole tower, so draws match chunk_size=None below
    reference = parameter_grads(model)

    model.zero_grad()
    torch.manual_seed(11)
    result = cached_step([image_tower, text_tower], [images, texts], loss_fn, None,
                         loss_params=[model.logit_scale], scale_loss=lambda loss: loss * 8.0)
    torch.testing.assert_close(result.loss, reference_loss.detach())
    assert_same_grads(parameter_grads(model), reference)

    # Chunked towers: same loss value with dropout off in the same way both times.
    model.eval()
    model.zero_grad()
    towers, tower_inputs = [image_tower, text_tower], [images, texts]
    full = cached_step(towers, tower_inputs, loss_fn, None, loss_params=[model.logit_scale])
    full_grads = parameter_grads(model)
    model.zero_grad()
    chunked = cached_step(towers, tower_inputs, loss_fn, 5, loss_params=[model.logit_scale])
    torch.testing.assert_close(chunked.loss, full.loss)
    assert_same_grads(parameter_grads(model), full_grads)


@pytest.mark.parametrize("keep_last_chunk", [True, False], ids=["last-chunk-kept", "every-chunk-replayed"])
@pytest.mark.parametrize("per_tower", [False, True], ids=["one-factory", "factory-per-tower"])
def test_no_sync_holds_every_backward_but_the_last_unsynchronised(per_tower, keep_last_chunk):
    """DDP's rule, kept or not: each chunk's forward with grad and its backward run in the same
    state, inside ``no_sync`` but for the step's last backward (with a factory per tower, each
    tower's last); each chunk is backpropagated once, and a kept chunk is not replayed."""
    model = tiny_clip(dropout=0.0)
    batch = clip_batch(10, seed=5)
    inside = {"image": False, "text": False, "any": False}
    forwards, backwards = [], []

    def factory(tag):
        @contextlib.contextmanager
        def no_sync():
            inside[tag] = True
            yield
            inside[tag] = False
        return no_sync

    def tower(name, features, tag):
        def encode(chunk):
            embeds = features(**chunk).pooler_output
            if torch.is_grad_enabled():
                forwards.append((name, not inside[tag]))
                embeds.register_hook(lambda grad: backwards.append((name, not inside[tag])))
            else:
                forwards.append((name, None))
            return embeds
        return encode

    images = {"pixel_values": batch["pixel_values"]}
    texts = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    tags = ("image", "text") if per_tower else ("any", "any")
    no_sync = [factory("image"), factory("text")] if per_tower else factory("any")
    towers = [tower("image", model.get_image_features, tags[0]),
              tower("text", model.get_text_features, tags[1])]
    cached_step(towers, [images, texts], lambda i, t: contrastive_loss(i, t, 10.0), 4, no_sync=no_sync,
                keep_last_chunk=keep_last_chunk)
    # 3 chunks per tower (4 + 4 + 2 rows): each backpropagated once; the text tower's last one kept
    without_grad = [name for name, synced in forwards if synced is None]
    assert without_grad == ["image"] * 3 + ["text"] * (2 if keep_last_chunk else 3)
    with_grad = [(name, synced) for name, synced in forwards if synced is not None]
    assert sorted(with_grad) == sorted(backwards) and len(backwards) == 6
    if per_tower:
        last_of_each = [max(i for i, (n, _) in enumerate(backwards) if n == t) for t in ("image", "text")]
        assert [synced for _, synced in backwards] == [i in last_of_each for i in range(6)]
    else:
        assert [synced for _, synced in backwards] == [False] * 5 + [True]
    if keep_last_chunk:  # the kept chunk: embedded with grad before the loss, backpropagated first
        assert forwards[5] == ("text", False) and backwards[0] == ("text", False)


def test_the_kept_last_chunk_gives_the_gradients_of_replaying_it():
    """Dropout on, float64: the last chunk embedded once, with grad, draws the masks its replay
    would have, so the step's loss and gradients are those of replaying every chunk; separate
    towers and a shorter last chunk."""
    model = tiny_clip(dropout=0.2).double()
    batch = {name: (value.double() if value.is_floating_point() else value)
             for name, value in clip_batch(10, seed=9).items()}
    images = {"pixel_values": batch["pixel_values"]}
    texts = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    towers = [lambda c: model.get_image_features(**c).pooler_output,
              lambda c: model.get_text_features(**c).pooler_output]
    results = {}
    for keep in (False, True):
        model.zero_grad()
        torch.manual_seed(17)
        loss = cached_step(towers, [images, texts], lambda i, t, s: contrastive_loss(i, t, s.exp()), 4,
                           loss_params=[model.logit_scale], keep_last_chunk=keep).loss
        results[keep] = loss, parameter_grads(model)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-12, atol=1e-12)
    assert_same_grads(results[True][1], results[False][1], rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError, match="keep_last_chunk must be a bool, got int"):
        cached_step(towers, [images, texts], lambda i, t: contrastive_loss(i, t, 10.0), 4, keep_last_chunk=1)


def test_split_batch_repeats_scalars_and_checks_sizes():
    chunks = split_batch({"x": torch.arange(10), "flag": True, "t": torch.tensor(3.0)}, 4)
    assert [c["x"].tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(c["flag"] is True and float(c["t"]) == 3.0 for c in chunks)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        split_batch({"a": torch.zeros(3), "b": torch.zeros(4)}, 2)


def test_bad_arguments_are_rejected():
    model = tiny_clip(dropout=0.0)
    batch = clip_batch(4)
    with pytest.raises(ValueError, match="chunk_size"):
        cached_step(clip_encoder(model), batch, clip_loss, 0, loss_params=[model.logit_scale])
    with pytest.raises(TypeError, match="sequence of dicts"):
        cached_step([clip_encoder(model)], batch, clip_loss, 2)
    with pytest.raises(ValueError, match="2 encoders but 1 input"):
        cached_step([clip_encoder(model), clip_encoder(model)], [batch], clip_loss, 2)
    with pytest.raises(TypeError, match="tensor or a tuple"):
        cached_step(lambda chunk: {"x": 1}, batch, clip_loss, 2)
    with pytest.raises(ValueError, match="no_grad_chunk_size must be a positive int or None, got 0"):
        cached_step(clip_encoder(model), batch, clip_loss, 2, no_grad_chunk_size=0)


def test_autocast_bf16_with_grad_scaler():
    """bf16 autocast around every encoder call, a GradScaler scaling the loss: after unscaling, the
    gradients are those of the uncached step under the same autocast (bf16 tolerance)."""
    model = tiny_clip(dropout=0.1)
    batch = clip_batch(16, seed=12)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    model.zero_grad()
    torch.manual_seed(4)
    encode = clip_encoder(model)
    outputs = []
    for chunk in split_batch(batch, 4):
        with autocast():
            outputs.append(encode(chunk))
    image_embeds, text_embeds = (torch.cat(parts) for parts in zip(*outputs))
    clip_loss(image_embeds.float(), text_embeds.float(), model.logit_scale).backward()
    reference = parameter_grads(model)

    model.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    torch.manual_seed(4)
    cached_step(clip_encoder(model), batch, lambda i, t, s: clip_loss(i.float(), t.float(), s), 4,
                loss_params=[model.logit_scale], forward_context=autocast, scale_loss=scaler.scale)
    scaled = parameter_grads(model)
    scaler.unscale_(optimizer)
    unscaled = parameter_grads(model)
    assert_same_grads(unscaled, reference, rtol=2e-2, atol=2e-3)
    name = "text_projection.weight"
    torch.testing.assert_close(scaled[name], unscaled[name] * 1024.0)


def test_gradient_checkpointing_inside_the_replay():
    model = tiny_clip(dropout=0.2)
    # transformers >= 5.20 renamed it; the GPU image has an older 5.x
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert is_activation_checkpointing(model)
    batch = clip_batch(16, seed=13)
    reference_loss, reference = uncached_chunked_grads(model, batch, 4, seed=21)
    model.zero_grad()
    torch.manual_seed(21)
    result = cached_step(clip_encoder(model), batch, clip_loss, 4, loss_params=[model.logit_scale])
    torch.testing.assert_close(result.loss, reference_loss, rtol=1e-6, atol=1e-6)
    assert_same_grads(parameter_grads(model), reference)


@pytest.mark.gpu
@torch.backends.cudnn.flags(enabled=True, allow_tf32=False)  # exact fp32 patch convolutions
def test_offload_on_gpu_keeps_one_chunk_on_the_device():
    """The batch stays in pinned host memory: the device never holds much more than one chunk,
    and the gradients equal the uncached step's on the GPU."""
    device = torch.device("cuda")
    model = tiny_clip(dropout=0.0).to(device)
    batch = clip_batch(1024, seed=14)
    padding = torch.randn(1024, 64, 1024)  # a 256 MiB host-only column: offload must not copy it whole
    inputs = {**batch, "padding": padding}

    def encode(chunk):
        assert chunk["pixel_values"].device.type == "cuda" and chunk["padding"].shape[0] <= 64
        out = model(**{k: v for k, v in chunk.items() if k != "padding"})
        return out.image_embeds, out.text_embeds

    def loss_fn(image_embeds, text_embeds, log_scale):
        return contrastive_loss(image_embeds, text_embeds, log_scale.exp(), backend="torch")

    full = model(**{k: v.to(device) for k, v in batch.items()})
    loss_fn(full.image_embeds, full.text_embeds, model.logit_scale).backward()
    reference = parameter_grads(model)
    del full

    model.zero_grad()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cached_step(encode, inputs, loss_fn, 64, loss_params=[model.logit_scale], offload=True, device=device)
    peak_above_baseline = torch.cuda.max_memory_allocated() - baseline
    # The prefetch holds the chunk being computed and the next one (and briefly the one being
    # freed): about 3 chunks of 1/16 of the batch each, far from the whole batch.
    assert peak_above_baseline < padding.numel() * 4 / 4, peak_above_baseline
    assert_same_grads(parameter_grads(model), reference, rtol=1e-4, atol=1e-5)


# ---- layers with batch statistics --------------------------------------------------------------


class BatchNormEncoder(torch.nn.Module):
    """Linear, ``norms`` BatchNorm1d layers, Linear: in training mode each row's embedding depends
    on the other rows it is encoded with."""

    def __init__(self, norms: int = 1, **batch_norm_options):
        super().__init__()
        torch.manual_seed(0)
        self.project = torch.nn.Linear(6, 8)
        self.norms = torch.nn.ModuleList(torch.nn.BatchNorm1d(8, **batch_norm_options) for _ in range(norms))
        self.head = torch.nn.Linear(8, 5)

    def forward(self, chunk):
        hidden = self.project(chunk["x"])
        for norm in self.norms:
            hidden = norm(hidden)
        return self.head(hidden)


def two_towers(rows: int = 8, seed: int = 9):
    generator = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, 6, generator=generator)} for _ in range(2)]


def normalised_loss(rows, keys):
    return contrastive_loss(torch.nn.functional.normalize(rows, dim=-1),
                            torch.nn.functional.normalize(keys, dim=-1), 10.0)


def whole_batch_grads(encoder, towers):
    encoder.zero_grad(set_to_none=True)
    normalised_loss(encoder(towers[0]), encoder(towers[1])).backward()
    return parameter_grads(encoder)


def test_cached_step_refuses_a_module_with_batch_norm():
    encoder, towers = BatchNormEncoder(), two_towers()
    for chunk_size in (4, None):
        with pytest.raises(ValueError) as refused:
            cached_step([encoder, encoder], towers, normalised_loss, chunk_size)
        message = str(refused.value)
        assert "1 BatchNorm layer(s) of the model (BatchNorm1d)" in message and ": norms.0." in message
        assert "chunk_size=None" in message and "freeze_batch_norm(model)" in message
        # refused before any work
        assert int(encoder.norms[0].num_batches_tracked) == 0 and parameter_grads(encoder) == {}
    # why (a plain callable is not looked into): chunks normalised alone give other gradients, and
    # a batch in one chunk updates the running statistics in both passes
    reference = whole_batch_grads(encoder, towers)
    assert int(encoder.norms[0].num_batches_tracked) == 2  # one call per tower
    encoder.zero_grad(set_to_none=True)
    cached_step([lambda chunk: encoder(chunk)] * 2, towers, normalised_loss, 4)
    grads = parameter_grads(encoder)
    assert max(float((grads[name] - reference[name]).abs().max()) for name in reference) > 1e-2
    tracked = int(encoder.norms[0].num_batches_tracked)
    encoder.zero_grad(set_to_none=True)
    cached_step([lambda chunk: encoder(chunk)] * 2, towers, normalised_loss, None)
    torch.testing.assert_close(parameter_grads(encoder), reference, rtol=1e-5, atol=1e-6)
    assert int(encoder.norms[0].num_batches_tracked) == tracked + 4


def test_frozen_batch_norm_is_chunked_exactly():
    """freeze_batch_norm: eval mode with the running statistics, through model.train(); the chunked
    step then equals the whole batch's, and the running statistics stay as they were."""
    from hf_infcl.batch_statistics import freeze_batch_norm

    encoder, towers = BatchNormEncoder(norms=2), two_towers()
    encoder(towers[0])  # running statistics away from their initial zeros and ones
    assert freeze_batch_norm(encoder) == ["norms.0", "norms.1"]
    encoder.train()
    assert encoder.training and not any(norm.training for norm in encoder.norms)
    running = [norm.running_mean.clone() for norm in encoder.norms]
    reference = whole_batch_grads(encoder, towers)
    encoder.zero_grad(set_to_none=True)
    cached_step([encoder, encoder], towers, normalised_loss, 3)
    torch.testing.assert_close(parameter_grads(encoder), reference, rtol=1e-5, atol=1e-6)
    assert "norms.1.weight" in reference  # the affine part still trains
    for norm, before in zip(encoder.norms, running):
        assert torch.equal(norm.running_mean, before)
    encoder.eval()
    encoder.train(True)
    assert not encoder.norms[0].training


def test_batch_statistics_are_found_in_every_form():
    from hf_infcl.batch_statistics import check_no_batch_statistics, freeze_batch_norm

    with pytest.raises(ValueError, match=r"7 BatchNorm layer\(s\).*norms\.0, norms\.1, norms\.2, norms\.3, "
                                         r"norms\.4 and 2 more\."):
        check_no_batch_statistics(BatchNormEncoder(norms=7), "chunk_size=None")
    check_no_batch_statistics(BatchNormEncoder(norms=7).eval(), "chunk_size=None")  # running statistics
    # without running statistics a layer uses the batch's in eval mode too, and cannot be frozen
    stateless = BatchNormEncoder(track_running_stats=False).eval()
    with pytest.raises(ValueError, match=r"norms\.0 keep no running statistics"):
        check_no_batch_statistics(stateless, "chunk_size=None")
    with pytest.raises(ValueError, match="track_running_stats=False"):
        freeze_batch_norm(stateless)
    with pytest.raises(ValueError, match=r"\(SyncBatchNorm\).*: 1\."):
        check_no_batch_statistics(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.SyncBatchNorm(2)),
                                  "chunk_size=None")
    layer_norm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    check_no_batch_statistics(layer_norm, "chunk_size=None")  # normalises each row alone


def test_chunk_graphs_are_refused_where_cuda_graphs_cannot_run():
    model = tiny_clip(dropout=0.0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            ChunkGraphs(model.parameters())
    with pytest.raises(TypeError, match="chunk_graphs must be a hf_infcl.chunk_graphs.ChunkGraphs"):
        cached_step(clip_encoder(model), clip_batch(8), clip_loss, 4, loss_params=[model.logit_scale],
                    chunk_graphs=object())


def float64_clip_on_gpu(dropout: float):
    model = tiny_clip(dropout=dropout).to("cuda", torch.float64)
    batch = {name: (value.double() if value.is_floating_point() else value)
             for name, value in clip_batch(18, seed=15).items()}
    return model, batch


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload"])
def test_cuda_graph_replays_give_the_uncached_gradients_in_float64(offload):
    """Dropout on: graphed no-grad chunks and replays draw the masks of the eager, uncached
    reference (same seed, same chunks), step after step, the 2-row remainder chunk included."""
    model, batch = float64_clip_on_gpu(dropout=0.2)
    on_device = {name: value.cuda() for name, value in batch.items()}
    graphs = ChunkGraphs(model.parameters())
    for step in range(4):
        reference_loss, reference = uncached_chunked_grads(model, on_device, 4, seed=100 + step)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        result = cached_step(clip_encoder(model), batch if offload else on_device, clip_loss, 4,
                             loss_params=[model.logit_scale], offload=offload,
                             device="cuda" if offload else None, chunk_graphs=graphs)
        torch.testing.assert_close(result.loss, reference_loss, rtol=1e-12, atol=1e-12)
        assert_same_grads(parameter_grads(model), reference, rtol=1e-10, atol=1e-12)
    # the 4-row chunk's no-grad pass and replay, and (from the third step) the 2-row remainder's
    assert graphs.captured == 4

    # without zero_grad, a graphed step adds to the gradients already there
    before = parameter_grads(model)
    _, reference = uncached_chunked_grads(model, on_device, 4, seed=7)
    model.zero_grad(set_to_none=True)
    for name, param in model.named_parameters():
        param.grad = before[name].clone()
    torch.manual_seed(7)
    cached_step(clip_encoder(model), on_device, clip_loss, 4, loss_params=[model.logit_scale],
                chunk_graphs=graphs)
    assert_same_grads(parameter_grads(model), {name: before[name] + reference[name] for name in reference},
                      rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["failed-capture", "max-graphs"])
def test_chunks_the_graphs_leave_to_eager_mode_give_the_uncached_gradients_in_float64(how):
    """What the Trainer's default graphs fall back on, dropout on, step after step against the
    eager, uncached reference. ``failed-capture``: an encoder that reads a value on the host, which
    no capture can hold: with ``eager_on_failure`` the first capture fails, one warning says so, and
    that call and every later one run eagerly from the random state the call found. ``max-graphs``:
    one graph (the 4-row chunks' no-grad pass); the replays and the 2-row remainder stay eager."""
    model, batch = float64_clip_on_gpu(dropout=0.2)
    batch = {name: value.cuda() for name, value in batch.items()}
    encode = clip_encoder(model)
    if how == "failed-capture":
        graphs = ChunkGraphs(model.parameters(), eager_on_failure=True)

        def encoder(chunk):
            embeddings = encode(chunk)
            assert math.isfinite(embeddings[0].sum().item())  # a host synchronisation
            return embeddings
    else:
        graphs = ChunkGraphs(model.parameters(), max_graphs=1)
        encoder = encode
    stream = torch.cuda.current_stream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            reference_loss, reference = uncached_chunked_grads(model, batch, 4, seed=300 + step)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(300 + step)
            result = cached_step(encoder, batch, clip_loss, 4, loss_params=[model.logit_scale],
                                 chunk_graphs=graphs)
            torch.testing.assert_close(result.loss, reference_loss, rtol=1e-12, atol=1e-12)
            assert_same_grads(parameter_grads(model), reference, rtol=1e-10, atol=1e-12)
    assert torch.cuda.current_stream() == stream  # not the failed capture's stream
    failures = [str(warning.message) for warning in caught if "run eagerly" in str(warning.message)]
    if how == "failed-capture":
        assert graphs.captured == 0 and graphs.failure is not None
        assert len(failures) == 1, failures
        assert failures[0].startswith("capturing a CUDA graph of the chunk call ('embed', 0) failed")
    else:
        assert graphs.captured == 1 and graphs.failure is None and not failures


@pytest.mark.gpu
def test_chunk_graphs_refuse_distributed_hooks_and_other_chunkings():
    model, batch = float64_clip_on_gpu(dropout=0.0)
    graphs = ChunkGraphs(model.parameters())
    with pytest.raises(ValueError, match="one process only"):
        cached_step(clip_encoder(model), batch, clip_loss, 4, loss_params=[model.logit_scale],
                    device="cuda", no_sync=contextlib.nullcontext, chunk_graphs=graphs)
    with pytest.raises(ValueError, match="no_grad_chunk_size"):
        cached_step(clip_encoder(model), batch, clip_loss, 4, loss_params=[model.logit_scale],
                    device="cuda", no_grad_chunk_size=8, chunk_graphs=graphs)
    with pytest.raises(ValueError, match="warmup"):
        ChunkGraphs(model.parameters(), warmup=0)
    with pytest.raises(ValueError, match="^max_graphs must be a positive int or None, got 0$"):
        ChunkGraphs(model.parameters(), max_graphs=0)
    with pytest.raises(TypeError, match="^eager_on_failure must be a bool, got int$"):
        ChunkGraphs(model.parameters(), eager_on_failure=1)


@pytest.mark.gpu
@pytest.mark.parametrize("family_name", ["clip", "dual-encoder", "siglip2"])
def test_towers_on_two_streams_inside_cuda_graphs_give_the_uncached_gradients_in_float64(family_name):
    """The Trainer's chunk_cuda_graphs path: the key tower on a second stream, concurrently with
    the row tower inside the graphs. Against the same towers run one after the other (keys first,
    as they draw their random numbers first), in one autograd graph, dropout on (SigLIP 2: its
    NaFlex rows of different shapes in one graph, whose position check reads spatial_shapes on the
    host outside a capture; no dropout, the sigmoid loss with its bias)."""
    from hf_infcl.models import contrastive_loss_kind, model_family, scale_and_bias

    if family_name == "clip":
        model, batch = float64_clip_on_gpu(dropout=0.2)
    elif family_name == "siglip2":
        model = tiny_siglip2().to("cuda", torch.float64)
        batch = {name: (value.double() if value.is_floating_point() else value)
                 for name, value in naflex_batch(18, seed=15).items()}
    else:
        model = tiny_dual_encoder(dropout=0.2, learn_scale=True).to("cuda", torch.float64)
        batch = pair_text_batch(18, seed=15)
    batch = {name: value.cuda() for name, value in batch.items()}
    family = model_family(model)
    kind = contrastive_loss_kind(model)
    key_stream = torch.cuda.Stream()
    # SigLIP 2's position resizing copies a host tensor to the GPU in some transformers versions
    # (5.17), which no capture can hold: there the eager fallback of the Trainer's default runs.
    graphs = ChunkGraphs(model.parameters(), eager_on_failure=family_name == "siglip2")

    def loss_fn(rows, keys, *loss_params):
        return contrastive_loss(rows, keys, *scale_and_bias(*loss_params), loss=kind)

    def sequential_reference(seed):
        # returns nothing that holds the autograd graph: a graph kept alive keeps its
        # AccumulateGrad nodes, bound to the stream they were made on, which a capture cannot use
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        parts = []
        for chunk in split_batch(batch, 4):
            keys = family.encode_keys(model, chunk)
            parts.append((family.encode_rows(model, chunk), keys))
        rows, keys = (torch.cat(side) for side in zip(*parts))
        loss = loss_fn(rows, keys, *family.loss_parameters(model, kind))
        loss.backward()
        return loss.detach(), parameter_grads(model)

    for step in range(4):
        reference_loss, reference = sequential_reference(200 + step)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(200 + step)
        encode = functools.partial(family.encode_pairs_on_two_streams, model, key_stream=key_stream)
        result = cached_step(encode, batch, loss_fn, 4, loss_params=family.loss_parameters(model, kind),
                             chunk_graphs=graphs)
        torch.testing.assert_close(result.loss, reference_loss, rtol=1e-12, atol=1e-12)
        assert_same_grads(parameter_grads(model), reference, rtol=1e-10, atol=1e-12)
    assert graphs.captured == 4 or (family_name == "siglip2" and "Cannot copy between CPU and CUDA"
                                    in graphs.failure), (graphs.captured, graphs.failure)


def test_transformers_value_checks_are_off_only_while_a_graph_is_captured(monkeypatch):
    """SigLIP 2 checks its spatial_shapes with torch_compilable_check, which reads the tensor on the
    host, also while a CUDA graph is being captured: ChunkGraphs captures with those checks off."""
    from transformers.utils import torch_compilable_check

    from hf_infcl.chunk_graphs import _host_checks_off

    monkeypatch.delenv("TRANSFORMERS_DISABLE_TORCH_CHECK", raising=False)
    failing = torch.tensor([True, False])
    with _host_checks_off():
        torch_compilable_check(failing, "checked inside")
    with pytest.raises(ValueError, match="checked after"):
        torch_compilable_check(failing, "checked after")
    monkeypatch.setenv("TRANSFORMERS_DISABLE_TORCH_CHECK", "0")
    with _host_checks_off():
        pass
    assert os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] == "0"  # the user's setting is restored


def test_graph_signatures_fix_hashable_values_and_refuse_the_rest():
    from hf_infcl.chunk_graphs import _leaf_signature

    assert _leaf_signature(3) == ("value", 3) and _leaf_signature(None) == ("value", None)
    with pytest.raises(TypeError, match="unhashable list"):
        _leaf_signature([1, 2])
    with pytest.raises(ValueError, match="must be on the GPU"):
        _leaf_signature(torch.ones(2))


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [True, False], ids=["graphs", "eager"])
def test_a_shared_tower_on_two_streams_under_bf16_autocast_gives_the_one_stream_gradients(graphed):
    """The Trainer's two-stream path as it runs with bf16=True: the DualEncoder's one tower (shared
    by queries and documents) on both streams at once, inside autocast. autocast caches each weight's
    bf16 copy for its whole region; a copy cast on one stream and read by the other would be read
    without waiting for the cast (in a graph, from a replay's stale or reused memory). Against the
    towers one after the other in one autograd graph under the same autocast, step after step with
    new weights; bf16 sums the reference's gradient of each weight copy over the chunks, so the
    gradients are compared norm-wise."""
    from hf_infcl.models import model_family, scale_and_bias

    model = tiny_dual_encoder(dropout=0.0, learn_scale=True).cuda()
    batch = {name: value.cuda() for name, value in pair_text_batch(32, seed=16).items()}
    family = model_family(model)
    loss_params = family.loss_parameters(model, "softmax")
    key_stream = torch.cuda.Stream()
    graphs = ChunkGraphs(model.parameters()) if graphed else None

    def autocast():
        return torch.autocast("cuda", torch.bfloat16)

    def loss_fn(rows, keys, *params):
        return contrastive_loss(rows, keys, *scale_and_bias(*params))

    def one_stream_reference():
        # returns nothing that holds the autograd graph (see the float64 test above)
        model.zero_grad(set_to_none=True)
        with autocast():
            rows, keys = zip(*((family.encode_rows(model, chunk), family.encode_keys(model, chunk))
                               for chunk in split_batch(batch, 8)))
        loss = loss_fn(torch.cat(rows), torch.cat(keys), *loss_params)
        loss.backward()
        return loss.detach(), parameter_grads(model)

    for _ in range(4):
        reference_loss, reference = one_stream_reference()
        model.zero_grad(set_to_none=True)
        encode = functools.partial(family.encode_pairs_on_two_streams, model, key_stream=key_stream)
        result = cached_step(encode, batch, loss_fn, 8, loss_params=loss_params, forward_context=autocast,
                             chunk_graphs=graphs)
        torch.testing.assert_close(result.loss, reference_loss, rtol=1e-3, atol=1e-4)
        grads = parameter_grads(model)
        assert grads.keys() == reference.keys() and len(grads) > 10
        errors = {name: ((grads[name] - reference[name]).norm() / reference[name].norm()).item()
                  for name in reference if reference[name].norm() > 0}
        assert max(errors.values()) < 2e-2, sorted(errors.items(), key=lambda item: -item[1])[:3]
        with torch.no_grad():  # new weights each step, as an optimizer step makes them
            for param in model.parameters():
                param.add_(torch.randn_like(param), alpha=1e-2)
    if graphed:
        assert graphs.captured == 2


def test_average_gradients_averages_over_the_ranks_as_ddp_does():
    """Two gloo processes: hf_infcl.chunk_graphs.average_gradients (what the Trainer's graphed cached
    step runs under DDP) gives every rank the mean of the ranks' gradients, in several buckets of two
    dtypes, skips parameters without one, and ranks that disagree on which have one all raise."""
    run_two_processes(os.path.join(REPO, "tests", "helpers", "average_gradients_worker.py"), timeout=120)
