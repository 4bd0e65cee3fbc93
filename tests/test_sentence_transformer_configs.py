"""The sharding configs shipped for ``examples/train_sentence_transformer.py`` train its qwen3-tiny
preset on two CPU processes over gloo (``tests/helpers/sentence_transformer_config_workers.py``):
``--deepspeed examples/st_zero3.json`` and ``accelerate launch --config_file examples/st_fsdp2.yaml``'s
FSDP2. Each run evaluates before and after training and saves the whole model, which loads again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.offline import run_two_processes

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "helpers" / "sentence_transformer_config_workers.py"
EXAMPLE_ARGS = ["--preset", "qwen3-tiny", "--max_train_pairs", "32", "--held_out_pairs", "8",
                "--per_device_train_batch_size", "8", "--max_steps", "2"]


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_the_shipped_config_trains_the_tiny_preset_on_two_processes(tmp_path, engine):
    pytest.importorskip("sentence_transformers")
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    run_two_processes(WORKER, engine, *EXAMPLE_ARGS, "--output_dir", out,
                      env={"DS_ACCELERATOR": "cpu"} if engine == "zero3" else None)
    from sentence_transformers import SentenceTransformer

    results = json.loads((out / "eval_results.json").read_text())
    assert results, results
    saved = SentenceTransformer(str(out), device="cpu")
    layers = saved[0].model.layers
    assert len(layers) == 2 and saved[1].pooling_mode == "lasttoken"
    # whole weights, not one process's shard or ZeRO-3's empty placeholders
    assert saved[0].model.embed_tokens.weight.shape == (1024, 64)
    assert all(float(param.abs().sum()) > 0 for param in saved.parameters())
    embeddings = saved.encode(["a small dog"], convert_to_tensor=True)
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(1))


def test_st_fsdp2_yaml_wraps_each_qwen3_decoder_layer(monkeypatch):
    """What ``accelerate launch --config_file examples/st_fsdp2.yaml`` hands the example: FSDP2 on two
    processes in bf16, a wrap policy that finds every Qwen3 decoder layer."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_sentence_transformer
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from transformers import Qwen3Config, Qwen3Model

    from tests.helpers.sentence_transformer_config_workers import launch_environment

    for key, value in launch_environment(ROOT / "examples" / "st_fsdp2.yaml").items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == ["Qwen3DecoderLayer"]
    model = Qwen3Model(Qwen3Config(**train_sentence_transformer.PRESETS["qwen3-tiny"]["config"]))
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert [module for module in model.modules() if policy(module)] == list(model.layers)


def test_normalize_is_left_to_the_fsdp2_root():
    """Accelerate takes Normalize (no parameters) for a final norm to shard alone, which fully_shard
    cannot wrap; the example's patch leaves it to the root and keeps a norm with parameters."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_sentence_transformer
    from accelerate.utils import fsdp_utils
    from sentence_transformers.sentence_transformer.modules import Normalize

    class WithNormalize(torch.nn.Sequential):
        pass

    model = WithNormalize(torch.nn.Linear(2, 2), Normalize())
    with_parameters = WithNormalize(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    original = fsdp_utils._find_final_norm
    assert isinstance(original(model), Normalize)  # what Accelerate would shard alone
    try:
        train_sentence_transformer.leave_parameterless_norms_to_the_fsdp2_root()
        train_sentence_transformer.leave_parameterless_norms_to_the_fsdp2_root()  # idempotent
        assert fsdp_utils._find_final_norm(model) is None
        assert fsdp_utils._find_final_norm(with_parameters) is with_parameters[1]
    finally:
        fsdp_utils._find_final_norm = original
