"""Command-line parsing shared by the Trainer-based examples: HfArgumentParser with
example-friendly defaults that any flag given on the command line overrides."""

from __future__ import annotations

import os
import sys

import torch


def parse_with_defaults(parser, argv, default_output_dir: str, defaults: dict[str, str]):
    """``parser.parse_args_into_dataclasses`` over ``argv`` (default: ``sys.argv[1:]``) with
    ``--output_dir`` and ``defaults`` filled in where the command line leaves them out."""
    argv = sys.argv[1:] if argv is None else list(argv)
    defaults = {"--output_dir": default_output_dir, **defaults}
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Several processes without CUDA (`accelerate launch --multi_gpu` / torchrun on a CPU
        # machine) only form one gloo group when the Trainer is told to use the CPU.
        defaults["--use_cpu"] = "true"
    for flag, value in defaults.items():
        if flag not in argv:
            argv += [flag, value]
    return parser.parse_args_into_dataclasses(args=argv)
