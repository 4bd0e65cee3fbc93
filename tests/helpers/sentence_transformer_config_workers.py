"""Worker for ``tests/test_sentence_transformer_configs.py``: the example
``examples/train_sentence_transformer.py`` under one of its shipped sharding configs, on CPU.

    torchrun --nproc_per_node 2 tests/helpers/sentence_transformer_config_workers.py ENGINE ARGS...

ENGINE: fsdp2 or zero3; ARGS: the example's.

``zero3``: the example's own ``--deepspeed examples/st_zero3.json`` (DeepSpeed's CPU accelerator,
``DS_ACCELERATOR=cpu``; its communication over gloo, which TrainingArguments leaves alone on CPU).
``fsdp2``: the environment ``accelerate launch --config_file examples/st_fsdp2.yaml`` gives the
script, with the Trainer's Accelerator switched to that FSDP2 plugin on CPU (Accelerate applies
FSDP on GPUs only), as ``tests/helpers/trainer_fsdp_workers.CpuFsdpMixin`` does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]


def launch_environment(config: Path) -> dict[str, str]:
    """The FSDP variables ``accelerate launch --config_file config`` sets for the script."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "script.py"])
    args, _, _ = _validate_launch_command(args)
    return {key: value for key, value in prepare_multi_gpu_env(args).items()
            if key.startswith("FSDP_") or key == "ACCELERATE_USE_FSDP"}


def use_fsdp2_plugin_of_the_environment() -> None:
    import sentence_transformers
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class CpuFsdpSentenceTransformerTrainer(sentence_transformers.SentenceTransformerTrainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            state.fsdp_plugin = FullyShardedDataParallelPlugin()  # read from the launch variables
            for shared in (state.__dict__, PartialState._shared_state):
                shared["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

    sentence_transformers.SentenceTransformerTrainer = CpuFsdpSentenceTransformerTrainer


def main(engine: str, *example_args: str) -> None:
    import torch

    torch.set_num_threads(1)
    if engine == "fsdp2":
        os.environ.update(launch_environment(ROOT / "examples" / "st_fsdp2.yaml"))
        use_fsdp2_plugin_of_the_environment()
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        example_args = ("--deepspeed", str(ROOT / "examples" / "st_zero3.json"), *example_args)
    import train_sentence_transformer

    train_sentence_transformer.main(list(example_args))


if __name__ == "__main__":
    main(*sys.argv[1:])
    from tests.helpers.trainer_fixtures import end_worker_process

    end_worker_process()
