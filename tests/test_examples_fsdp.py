"""``examples/train_clip.py`` under FSDP2 (``accelerate launch --config_file examples/fsdp2.yaml``).

Accelerate ignores FSDP on the CPU, so the CPU tests check the pieces: the config resolves to
FSDP2 over CLIP's encoder layers; the scalar logit scale survives the 1-element reshaping through
``save_pretrained`` / ``from_pretrained``; and the example's own step, clamp, scale logging,
evaluation and save run under ``fully_shard`` applied by hand (as Accelerate applies it) over gloo
with two processes (this file is also that worker: ``torchrun --nproc_per_node 2
tests/test_examples_fsdp.py OUT``), equal to one process without FSDP on both ranks' pairs.

The GPU test (``-m gpu``, two CUDA devices) runs the real ``accelerate launch`` with the config:
cached, uncached and resumed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(ROOT))

import train_clip  # noqa: E402

from hf_infcl.sharding import full_value, vectorise_scalar_parameters  # noqa: E402
from tests.helpers.offline import run_two_processes  # noqa: E402

import clip_model  # noqa: E402
import image_text_batches  # noqa: E402
from clip_model import (  # noqa: E402
    ClipEmbedder,
    clamp_logit_scale,
    clip_loss,
    pretrained_state_dict,
    training_step,
)

LOSSES = ["softmax", "sigmoid"]
VARIANTS = ["uncached", "cached-per-step", "cached-per-chunk"]
ROWS_PER_RANK, CHUNK = 8, 3  # chunks of 3, 3, 2
START_SCALE = 6.0  # above log(100): the clamp after the step must bring it down
LR = 1e-3  # plain SGD, small enough for the scale to stay above log(100) before the clamp


def loss_args(loss):
    return SimpleNamespace(loss=loss, symmetric=True, mask_false_negatives=True, backend="torch",
                           precision="ieee")


# ---- the config ------------------------------------------------------------------------------


def test_fsdp2_yaml_launches_fsdp2_over_clip_encoder_layers(monkeypatch):
    """What ``accelerate launch --config_file examples/fsdp2.yaml`` hands the script: FSDP2, two
    processes, bf16, sharded checkpoints, and a wrap policy that finds CLIP's encoder layers."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.launch import prepare_multi_gpu_env
    from transformers.models.clip import modeling_clip
    from transformers.models.siglip import modeling_siglip

    from tests.helpers.trainer_fixtures import tiny_clip

    args = launch_command_parser().parse_args(
        ["--config_file", str(EXAMPLES / "fsdp2.yaml"), str(EXAMPLES / "train_clip.py")]
    )
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and args.num_processes == 2 and args.mixed_precision == "bf16"
    environment = prepare_multi_gpu_env(args)
    for key, value in environment.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.transformer_cls_names_to_wrap == ["CLIPEncoderLayer"]
    embedder = ClipEmbedder(tiny_clip())  # two layers per tower
    plugin.set_auto_wrap_policy(embedder)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, embedder)
    wrapped = [module for module in embedder.modules() if policy(module)]
    assert len(wrapped) == 4 and all(isinstance(m, modeling_clip.CLIPEncoderLayer) for m in wrapped)
    # The class the config's comment names for SigLIP exists.
    assert hasattr(modeling_siglip, "SiglipEncoderLayer")


# ---- the helpers -----------------------------------------------------------------------------


def test_a_vectorised_logit_scale_is_saved_as_clips_scalar_and_reloads(tmp_path):
    from transformers import CLIPModel

    from tests.helpers.trainer_fixtures import tiny_clip

    clip = tiny_clip()
    with torch.no_grad():
        clip.logit_scale.fill_(3.21)
    embedder = ClipEmbedder(clip, logit_bias=-2.5)
    names = vectorise_scalar_parameters(embedder)
    assert sorted(names) == ["clip.logit_scale", "logit_bias"]
    assert clip.logit_scale.shape == (1,) and embedder.logit_bias.shape == (1,)
    assert all(p.ndim > 0 for p in embedder.parameters()) and clip.logit_scale.requires_grad
    state = pretrained_state_dict(embedder.state_dict(), names)
    assert state.keys() == CLIPModel(clip.config).state_dict().keys()  # the bias is the loop's
    assert state["logit_scale"].shape == ()
    clip.save_pretrained(tmp_path / "restored", state_dict=state)
    loaded = CLIPModel.from_pretrained(tmp_path / "restored")
    assert loaded.logit_scale.shape == () and float(loaded.logit_scale) == pytest.approx(3.21)
    torch.testing.assert_close(loaded.text_projection.weight, clip.text_projection.weight)


def test_the_vectorised_scale_is_not_loaded_unless_restored(tmp_path):
    """Why pretrained_state_dict restores the shape: a [1] logit_scale in the checkpoint is not
    loaded into CLIPModel's 0-d one (re-initialised, or an error)."""
    from transformers import CLIPModel

    from tests.helpers.trainer_fixtures import tiny_clip

    clip = tiny_clip()
    with torch.no_grad():
        clip.logit_scale.fill_(3.21)
    vectorise_scalar_parameters(clip)
    clip.save_pretrained(tmp_path / "vector")
    try:
        loaded = CLIPModel.from_pretrained(tmp_path / "vector")
    except (RuntimeError, ValueError):
        return
    assert float(loaded.logit_scale) != pytest.approx(3.21)


def test_full_value_and_clamp_of_plain_parameters():
    from tests.helpers.trainer_fixtures import tiny_clip

    embedder = ClipEmbedder(tiny_clip())
    scale = embedder.clip.logit_scale
    assert full_value(scale) is scale
    with torch.no_grad():
        scale.fill_(5.0)
    clamp_logit_scale(embedder)
    assert embedder.clip.logit_scale is scale and float(scale) == pytest.approx(math.log(100))
    with torch.no_grad():
        scale.fill_(-1.0)
    clamp_logit_scale(embedder)
    assert float(scale) == 0.0


@pytest.mark.parametrize("loss", LOSSES)
def test_training_step_with_chunks_equals_the_step_without(loss):
    """One process: the cached step's gradients (bias and scale included) are the plain step's."""
    from tests.helpers.trainer_fixtures import clip_batch, tiny_clip

    grads = []
    for chunk in (None, CHUNK):
        embedder = ClipEmbedder(tiny_clip(dropout=0.0), logit_bias=-1.0 if loss == "sigmoid" else None)
        batch = clip_batch(ROWS_PER_RANK)
        groups = torch.arange(ROWS_PER_RANK)
        training_step(embedder, embedder, batch, clip_loss(loss_args(loss), groups), chunk)
        grads.append({n: p.grad.clone() for n, p in embedder.named_parameters() if p.grad is not None})
    plain, cached = grads
    assert plain.keys() == cached.keys() and "clip.logit_scale" in plain
    assert ("logit_bias" in plain) == (loss == "sigmoid")
    for name in plain:
        torch.testing.assert_close(cached[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


# ---- FSDP2 on CPU: two gloo processes, fully_shard applied as Accelerate applies it ------------


def _example_setup():
    """The example's default model (two layers per tower), data and a maker of its batches, as main
    builds them."""
    from bundled_data import load_image_caption_data

    model_args, data_args, _ = train_clip.parse_arguments(["--tiny_layers", "2"])
    data = load_image_caption_data("digits", seed=42)
    clip, processor, _ = clip_model.load_model_and_processor(model_args, data_args, data, seed=42)
    with torch.no_grad():
        clip.logit_scale.fill_(START_SCALE)
    rows = 2 * ROWS_PER_RANK
    length = clip_model.caption_length(clip, data_args.max_seq_length)
    collate = image_text_batches.make_collate(processor.tokenizer, length)
    groups = image_text_batches.group_ids(data, data.train[:rows])
    dataset = image_text_batches.PairDataset(data.train[:rows], groups, processor.image_processor, seed=42)
    held_out = image_text_batches.preprocess_images(processor.image_processor, data.held_out)

    def batch_of(indices):
        """The batch of these train rows (epoch 0) as one piece, made and joined as in training."""
        return image_text_batches.joined_batch([dataset.__getitems__((0, 0, True, list(indices)))], collate)

    return clip, processor, data, batch_of, held_out


def _one_step(embedder, model, batch, loss, chunk, no_sync, process_group):
    batch = dict(batch)
    groups = batch.pop("groups")
    loss_fn = clip_loss(loss_args(loss), groups, process_group)
    step_loss = training_step(embedder, model, batch, loss_fn, chunk, no_sync=no_sync)
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grads[name] = full_value(param.grad).detach().reshape(param.shape).clone()
    return step_loss, grads


def _fsdp_worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer

    from hf_infcl.sharding import fsdp_no_sync

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    init_device_mesh("cpu", (world,))
    out = Path(out_dir)
    results = {}
    for loss in LOSSES:
        bias = -math.log(2 * ROWS_PER_RANK) if loss == "sigmoid" else None
        if rank == 0:  # one process without FSDP on both ranks' pairs
            clip, processor, data, batch_of, held_out = _example_setup()
            model = ClipEmbedder(clip, bias)
            both_ranks = batch_of(range(2 * ROWS_PER_RANK))
            step_loss, grads = _one_step(model, model, both_ranks, loss, None, None, None)
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param -= LR * param.grad
            clamp_logit_scale(model)
            metrics = clip_model.evaluate(model, processor, data, held_out, "cpu", 256, 32)
            results[(loss, "reference")] = dict(
                loss=float(step_loss), grads=grads, metrics=metrics,
                scale=float(model.clip.logit_scale.exp()),
                weights={n: p.detach().clone() for n, p in model.clip.state_dict().items()},
            )
        for variant in VARIANTS:
            clip, processor, data, batch_of, held_out = _example_setup()
            model = ClipEmbedder(clip, bias)
            vectorised = vectorise_scalar_parameters(model)
            for layer in [m for m in model.modules() if isinstance(m, CLIPEncoderLayer)]:
                fully_shard(layer, reshard_after_forward=True)
            fully_shard(model)
            assert all(hasattr(p, "full_tensor") for p in model.loss_parameters())
            # An evaluation forward first, as in the middle of training: it leaves the root's
            # parameters gathered; run_evaluation's reshard puts the sharded ones back.
            with torch.no_grad():
                model(**{name: value[:4] for name, value in held_out.items()})
            model.reshard()
            assert all(hasattr(p, "full_tensor") for p in model.loss_parameters()), "not resharded"
            batch = batch_of(range(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK))
            chunk = None if variant == "uncached" else CHUNK
            no_sync = (lambda m=model: fsdp_no_sync(m)) if variant == "cached-per-step" else None
            step_loss, grads = _one_step(model, model, batch, loss, chunk, no_sync, "auto")
            global_loss = step_loss.reshape(1).clone()
            dist.all_reduce(global_loss)
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param -= LR * param.grad
            clamp_logit_scale(model)
            scale = full_value(model.clip.logit_scale).exp().item()  # what the progress bar shows
            metrics = clip_model.evaluate(model, processor, data, held_out, "cpu", 256, 32)
            model.reshard()
            # What accelerator.get_state_dict does under FSDP2 (a collective).
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(model, options=options)
            saved = out / f"{loss}-{variant}"
            if rank == 0:
                model.clip.save_pretrained(saved, state_dict=pretrained_state_dict(state, vectorised))
                results[(loss, variant)] = dict(loss=float(global_loss) / world, grads=grads, metrics=metrics,
                                                scale=scale, saved=str(saved))
            dist.barrier()
    if rank == 0:
        torch.save(results, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    out = tmp_path_factory.mktemp("fsdp-example")
    run_two_processes(__file__, out)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("loss", LOSSES)
def test_fsdp2_step_clamp_evaluation_and_save_equal_one_process(fsdp_results, loss, variant):
    """The example's step under fully_shard, each reduction, equals one process on both ranks'
    pairs: loss, every gradient (the scale's and SigLIP's bias included), the clamped scale it
    logs, the held-out metrics through the sharded root, and the saved checkpoint, whose
    logit_scale is CLIP's 0-d scalar again."""
    from transformers import CLIPModel

    reference, got = fsdp_results[(loss, "reference")], fsdp_results[(loss, variant)]
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert got["grads"].keys() == reference["grads"].keys() and len(reference["grads"]) > 20
    assert ("logit_bias" in reference["grads"]) == (loss == "sigmoid")
    for name, expected in reference["grads"].items():
        value = got["grads"][name].reshape(expected.shape)
        difference, size = float((value - expected).norm()), float(expected.norm())
        # Norm-wise, with an absolute floor: the attention key biases' gradients are zero in exact
        # arithmetic and hold only rounding noise (of a loss of about 35 at this scale).
        assert difference <= 1e-5 * size + 1e-5, f"{name}: difference {difference:.2e}, norm {size:.2e}"
    assert float(reference["grads"]["clip.logit_scale"].abs()) > 0
    assert got["scale"] == pytest.approx(reference["scale"], rel=1e-6)
    assert reference["scale"] == pytest.approx(100.0)  # the clamp brought 6.0 down to log(100)
    for name, value in reference["metrics"].items():
        assert got["metrics"][name] == pytest.approx(value, abs=1e-6), name
    loaded = CLIPModel.from_pretrained(got["saved"])
    assert loaded.logit_scale.shape == ()
    state = loaded.state_dict()
    assert state.keys() == reference["weights"].keys()
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(state[name], expected, rtol=1e-5, atol=1e-6, msg=name)


# ---- GPUs: the real launch -------------------------------------------------------------------


def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices")
@pytest.mark.parametrize("chunk_size", [32, None], ids=["cached", "uncached"])
def test_accelerate_launch_with_the_fsdp2_config_trains_saves_and_resumes(tmp_path, chunk_size):
    from transformers import CLIPModel

    def launch(output_dir, *extra):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(EXAMPLES / "fsdp2.yaml"), str(EXAMPLES / "train_clip.py"), "--max_steps", "20",
                   "--eval_steps", "10", "--save_steps", "10", "--output_dir", str(output_dir),
                   *(["--chunk_size", str(chunk_size)] if chunk_size else []), *extra]
        finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-6000:]
        return finished.stdout + finished.stderr

    output = launch(tmp_path / "run")
    assert "(2 processes on cuda" in output and "done: 20 steps" in output
    results = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    assert all(math.isfinite(entry["train_loss"]) for entry in results["history"])
    loaded = CLIPModel.from_pretrained(tmp_path / "run")
    assert loaded.logit_scale.shape == () and 0 < float(loaded.logit_scale) <= math.log(100) + 1e-6
    assert float(loaded.logit_scale) != pytest.approx(math.log(1 / 0.07))  # trained, not re-initialised
    # Resume the sharded checkpoint of step 10.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.rename(tmp_path / "run" / "checkpoint-10", resumed / "checkpoint-10")
    output = launch(resumed, "--resume_from_checkpoint", "latest")
    assert "at step 10" in output and "done: 20 steps" in output
    assert CLIPModel.from_pretrained(resumed).logit_scale.shape == ()


if __name__ == "__main__":
    _fsdp_worker(sys.argv[1])
