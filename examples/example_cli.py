"""Command-line handling shared by the examples.

- :func:`argument_parser`: HfArgumentParser whose choice flags (fields typed with a ``Literal``,
  such as the loss options' vocabularies in ``hf_infcl.ops.options``) fail in hf_infcl's one
  format: ``--precision must be one of 'auto', 'tf32', 'ieee'; got 'fp8'``.
- :func:`parse_with_defaults`: HfArgumentParser with example-friendly defaults, set through the
  parser's own defaults, so that any flag given on the command line wins, in any spelling
  (``--learning_rate 3e-4`` or ``--learning_rate=3e-4``).
- :func:`check_numeric_flags`: every numeric flag checked before any work, with a one-line error
  that names the flag (``--global_batch_size must be > 0, got 0``).
- :func:`given_value`, :func:`preset_defaults`: a flag's value read before parsing, and the
  defaults a text example's ``--preset`` sets (its own, bf16 where supported, the output folder).
- :func:`check_output_dir`: ``--output_dir`` is a folder that can be written, checked before any
  work (a run must not train for an hour and then fail to save).
- :func:`checkpoint_folder`: ``--resume_from_checkpoint``'s folder (a path, or ``latest``: the last
  ``checkpoint-<step>`` of ``--output_dir``), checked to be a checkpoint before any work.
- :func:`check_data_file`: a data file with no rows (empty, blank, a CSV header alone) named in one
  line, before ``datasets`` fails on it with a long traceback.
- :func:`accelerate_on_cpu`, :func:`trackers`, :func:`tracker_config`: what ``train_clip.py`` tells
  Accelerate (the CPU for several processes without CUDA, ``--report_to``'s trackers, each one
  installed, and the flags for their hyperparameter tables).
- :class:`HubPush`: ``--push_to_hub`` checked before training (:func:`check_hub_push`: repo id,
  token, the Hub answering, the repo writable), so a run does not train for nothing and fail at the
  end; its ``push`` uploads after the results are printed (:func:`push_output_dir`), failing in
  one line.

Errors are argparse-style: one ``<script>: error: ...`` line on standard error (printed by the
main process only) and exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch


class ExampleError(SystemExit):
    """A command-line mistake: exit status 2 after one ``<script>: error: <message>`` line."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


def is_main_process() -> bool:
    """Rank 0 of a launch (torchrun / accelerate launch set RANK), or a lone process."""
    return int(os.environ.get("RANK", "0")) == 0


def close_process_group() -> None:
    """Destroy the default process group at the end of a launched run.

    On CPU (gloo), a gloo worker thread still releasing a last collective's tensors while Python
    shuts down can abort the process after all its output is written ("terminate called without
    an active exception"; a torch issue). Destroying the group first makes that rarer; it cannot
    rule it out while the Trainer still holds the group.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def has_accelerator() -> bool:
    """Whether torch sees an accelerator (CUDA, ROCm, MPS, XPU, ...) to copy batches to."""
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def fail(message: str):
    """Print ``<script>: error: <message>`` once (main process) and exit with status 2."""
    if is_main_process():
        print(f"{os.path.basename(sys.argv[0]) or 'example'}: error: {message}", file=sys.stderr, flush=True)
    raise ExampleError(message)


def argument_parser(dataclass_types, **kwargs):
    """``HfArgumentParser(dataclass_types, **kwargs)`` whose choice flags end the run with
    ``--<flag> must be one of 'a', 'b'; got 'x'`` (one line, :func:`fail`), the message every
    hf_infcl entry point gives for the options it checks, instead of argparse's usage and
    ``invalid choice`` lines."""
    from transformers import HfArgumentParser

    from hf_infcl.ops.options import choice_error

    class ArgumentParser(HfArgumentParser):
        def _check_value(self, action, value):  # argparse's hook for choices
            if action.choices is not None and value not in action.choices and action.option_strings:
                fail(str(choice_error(action.option_strings[0], value, action.choices)))
            super()._check_value(action, value)

    return ArgumentParser(dataclass_types, **kwargs)


def parse_with_defaults(parser, argv, default_output_dir: str, defaults: dict[str, object],
                        rules: dict[str, Rule]):
    """``parser.parse_args_into_dataclasses(argv)`` (default: ``sys.argv[1:]``) with ``output_dir`` =
    ``default_output_dir`` and ``defaults`` ({field name: typed value}) as the parser's defaults,
    every numeric flag checked against ``rules`` (:func:`check_numeric_flags`).

    The defaults are the parser's own (argparse ``set_defaults``), so a flag given on the command
    line in any form overrides them. A dataclass ``__post_init__`` check that fails (ValueError)
    becomes a one-line error.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    defaults = {"output_dir": default_output_dir, **defaults}
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Several processes without CUDA (`accelerate launch --multi_gpu` / torchrun on a CPU
        # machine) only form one gloo group when the Trainer is told to use the CPU.
        defaults["use_cpu"] = True
    if not has_accelerator():  # pinned memory serves copies to an accelerator; else a warning
        defaults["dataloader_pin_memory"] = False
    dests = {action.dest for action in parser._actions}
    unknown = set(defaults) - dests
    if unknown:
        raise KeyError(f"defaults for flags the parser does not have: {sorted(unknown)}")
    for action in parser._actions:
        if action.dest in defaults:
            action.required = False  # a default makes a required flag optional
    parser.set_defaults(**defaults)
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:  # the dataclasses' own checks (e.g. InfCLTrainingArguments)
        fail(str(error))
    check_numeric_flags(parsed, rules)
    return parsed


def given_value(argv, flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``), read before parsing: for a
    flag such as ``--preset`` that changes the parser's defaults."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def preset_defaults(argv, presets: dict[str, dict], defaults: dict[str, object], output_dir: str):
    """(preset name or None, defaults, output folder) for ``argv``'s ``--preset`` (one of ``presets``,
    each with its own ``"defaults"``): the preset's defaults over ``defaults``, bf16 on a GPU that has
    it, and ``output_dir``'s ``{dataset}`` named after the preset. An unknown preset ends the run."""
    preset = given_value(argv, "--preset")
    if preset is None:
        return None, dict(defaults), output_dir
    if preset not in presets:
        fail(f"--preset must be one of {', '.join(presets)}; got {preset!r}")
    defaults = {**defaults, **presets[preset]["defaults"]}
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        defaults["bf16"] = True
    return preset, defaults, output_dir.format(dataset=preset)


def check_output_dir(path: str) -> None:
    """End the run (one line naming ``--output_dir``) unless ``path`` is a folder, or can be made
    one, and can be written: the first existing folder on the way to it must be writable."""
    folder = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        fail(f"--output_dir {path} is a file, not a folder: choose another --output_dir")
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        fail(f"--output_dir {path} cannot be made: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        fail(f"--output_dir {path} cannot be written: {existing} is not writable")


def checkpoint_folder(resume_from: str | None, output_dir: str, marker: str | None = None) -> str | None:
    """The checkpoint folder ``--resume_from_checkpoint`` names (None when not given): the folder
    itself, or for ``latest`` the last ``checkpoint-<step>`` of ``output_dir``. A folder that is
    missing, or lacks the file ``marker`` every checkpoint of the run's kind holds, ends the run
    in one line naming the flag."""
    if not resume_from:
        return None
    if resume_from == "latest":
        from transformers.trainer_utils import get_last_checkpoint

        checkpoint = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if checkpoint is None:
            fail(f"--resume_from_checkpoint latest: no checkpoint-* folder in {output_dir}")
        return checkpoint
    if not os.path.isdir(resume_from):
        fail(f"--resume_from_checkpoint {resume_from}: no such folder (a checkpoint-<step> folder of a "
             "previous run, or 'latest')")
    if marker is not None and not os.path.isfile(os.path.join(resume_from, marker)):
        fail(f"--resume_from_checkpoint {resume_from} is not a checkpoint: it has no {marker} (pass a "
             "checkpoint-<step> folder of a previous run, or 'latest')")
    return resume_from


def check_data_file(path: str, flag: str = "--dataset") -> None:
    """Raise a ValueError naming ``flag`` when the local file ``path`` has no rows to read: empty,
    blank lines only, or (CSV / TSV) a header line alone. Read without parsing: a few lines."""
    extension = os.path.splitext(path)[1].lower()
    if not os.path.isfile(path) or extension not in (".csv", ".tsv", ".json", ".jsonl"):
        return
    lines = 0
    with open(path, "rb") as handle:
        for line in handle:
            lines += bool(line.strip())
            if lines == 2:
                return
    if lines == 0:
        raise ValueError(f"{flag} {path} is empty: it has no rows")
    if extension in (".csv", ".tsv"):
        raise ValueError(f"{flag} {path} has a header line and no rows")


# ---- numeric flags ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """What a numeric flag must be: ``test(value)`` true; ``text`` says it in the error."""

    test: Callable[[float], bool]
    text: str


POSITIVE = Rule(lambda v: v > 0, "> 0")
FINITE = Rule(math.isfinite, "a finite number")
NON_NEGATIVE = Rule(lambda v: v >= 0, ">= 0")
RATIO = Rule(lambda v: 0 <= v <= 1, "between 0 and 1")
BELOW_ONE = Rule(lambda v: 0 <= v < 1, ">= 0 and < 1")
STEPS = Rule(lambda v: v > 0 or v == -1, "> 0, or -1 (train for num_train_epochs)")
SEED = Rule(lambda v: 0 <= v < 2**32, "between 0 and 2**32 - 1")
RANK = Rule(lambda v: v >= -1, ">= -1")

# Every numeric field of transformers' TrainingArguments (and of sentence-transformers' subclass;
# hf_infcl.InfCLTrainingArguments checks its own when it is built, see numeric_fields). None, where a
# field allows it, always passes: it means "not set".
TRAINING_ARGUMENT_RULES = {
    "per_device_train_batch_size": POSITIVE,
    "per_device_eval_batch_size": POSITIVE,
    "gradient_accumulation_steps": POSITIVE,
    "eval_accumulation_steps": POSITIVE,
    "num_train_epochs": POSITIVE,
    "max_steps": STEPS,
    "learning_rate": POSITIVE,
    "warmup_steps": NON_NEGATIVE,
    "warmup_ratio": RATIO,
    "weight_decay": NON_NEGATIVE,
    "adam_beta1": BELOW_ONE,
    "adam_beta2": BELOW_ONE,
    "adam_epsilon": POSITIVE,
    "max_grad_norm": NON_NEGATIVE,
    "label_smoothing_factor": BELOW_ONE,
    "neftune_noise_alpha": POSITIVE,
    "torch_empty_cache_steps": POSITIVE,
    "logging_steps": POSITIVE,
    "eval_steps": POSITIVE,
    "eval_delay": NON_NEGATIVE,
    "save_steps": POSITIVE,
    "save_total_limit": NON_NEGATIVE,
    "seed": SEED,
    "data_seed": SEED,
    "dataloader_num_workers": NON_NEGATIVE,
    "dataloader_prefetch_factor": POSITIVE,
    "ddp_bucket_cap_mb": POSITIVE,
    "ddp_timeout": POSITIVE,
    "local_rank": RANK,
}

def _is_number_type(annotation) -> bool:
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(a in (int, float) for a in args)
    return False


def numeric_fields(dataclass_type) -> list[str]:
    """Names of the fields of ``dataclass_type`` typed int or float (or ``int | None`` ...), less
    those the dataclass checks itself when it is built (its ``checked_numeric_fields``, as
    ``InfCLTrainingArguments`` has): a parse that got that far has them checked."""
    hints = typing.get_type_hints(dataclass_type)
    checked = set(getattr(dataclass_type, "checked_numeric_fields", ()))
    return [f.name for f in dataclasses.fields(dataclass_type)
            if f.init and f.name not in checked and _is_number_type(hints[f.name])]


def check_numeric_flags(objects, rules: dict[str, Rule]) -> None:
    """Check every numeric field of the parsed dataclasses ``objects`` that ``rules`` names;
    the first bad one ends the run with ``--<name> must be <rule>, got <value>``."""
    for obj in objects:
        for name in numeric_fields(type(obj)):
            value = getattr(obj, name)
            rule = rules.get(name)
            if rule is None or value is None or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not rule.test(value):
                fail(f"--{name} must be {rule.text}, got {value!r}")


# ---- Accelerate ------------------------------------------------------------------------------------


def accelerate_on_cpu(use_cpu: bool) -> bool:
    """Whether to ask Accelerate for the CPU.

    Several processes on a machine without CUDA (``accelerate launch --multi_gpu --num_processes 2``
    or ``torchrun``) only form a gloo group when Accelerate is told ``cpu=True``; otherwise each
    process would train alone.
    """
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if (
        os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"
        and "MASTER_PORT" in os.environ
        and not several
    ):
        # `accelerate launch --cpu --num_processes N` starts N processes only through MPI.
        print(
            "note: `accelerate launch --cpu --num_processes N` starts a single process unless MPI is "
            "configured; for N processes on CPU run `accelerate launch --multi_gpu --num_processes N "
            "examples/train_clip.py` (add --use_cpu on a GPU machine)",
            file=sys.stderr,
        )
    return use_cpu or (several and not torch.cuda.is_available())


def trackers(report_to: str) -> list[str]:
    """--report_to as Accelerate's ``log_with``: [] for 'none', else the named trackers, each one
    installed (Accelerate would silently drop one that is not)."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    names = [name.strip() for name in report_to.split(",") if name.strip()]
    if names in ([], ["none"]):
        return []
    known = [str(kind) for kind in LoggerType]
    available = [str(kind) for kind in get_available_trackers()]
    for name in names:
        if name not in known:
            fail(f"--report_to must name trackers among {', '.join(known)} or 'none'; got {name!r}")
        if name != "all" and name not in available:
            fail(f"--report_to {name}: {name} is not installed (pip install {name})")
    return names


def tracker_config(*argument_groups) -> dict:
    """The run's flags for the trackers' hyperparameter tables (numbers, text and booleans only)."""
    return {name: value for group in argument_groups for name, value in dataclasses.asdict(group).items()
            if isinstance(value, (int, float, str, bool))}


# ---- --push_to_hub ---------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _status_code(error: BaseException):
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def check_hub_push(repo_id: str | None, output_dir: str, token: str | None = None,
                   private: bool = False) -> str:
    """Before training, make sure ``--push_to_hub`` can succeed; return the repo id to push to.

    Checks, in order, with a one-line error for each: a token exists (``--hub_token``, ``HF_TOKEN``
    or ``hf auth login``); the Hub answers and accepts the token (``whoami``); the repo id is
    valid (without ``--hub_model_id``: ``<your user name>/<output_dir's name>``, as the Trainer
    does); the repo exists or can be created (``create_repo(exist_ok=True)``, as the Trainer does
    at its start).
    """
    try:
        import huggingface_hub
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        fail("--push_to_hub needs huggingface_hub: pip install huggingface_hub")
    if repo_id is not None:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as error:
            fail(f"--hub_model_id {repo_id!r} is not a valid repo id ('user/name'): {first_line(error)}")
    token = token or huggingface_hub.get_token()
    if not token:
        fail("--push_to_hub needs a Hugging Face token with write access: run `hf auth login`, set "
             "HF_TOKEN, or pass --hub_token")
    api = huggingface_hub.HfApi(token=token)
    endpoint = getattr(huggingface_hub.constants, "ENDPOINT", "the Hugging Face Hub")
    try:
        user = api.whoami()
    except Exception as error:  # network, offline mode, refused token: all end the run here
        if _status_code(error) == 401:
            fail(f"--push_to_hub: the Hub refused the token ({first_line(error)})")
        fail(f"--push_to_hub: cannot reach {endpoint} ({first_line(error)}); train without "
             "--push_to_hub and upload later with hf_infcl.model_card.push_checkpoint")
    if repo_id is None:
        name = os.path.basename(os.path.abspath(output_dir))
        repo_id = f"{user['name']}/{name}" if isinstance(user, dict) and user.get("name") else name
        try:
            validate_repo_id(repo_id)
        except HFValidationError as error:
            fail(f"--push_to_hub without --hub_model_id pushes to {repo_id!r}, which is not a valid repo "
                 f"id ({first_line(error)}); pass --hub_model_id user/name")
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    except Exception as error:
        fail(f"--push_to_hub: cannot create or write the repo {repo_id} ({first_line(error)})")
    return repo_id


@dataclass
class HubPush:
    """An example's ``--push_to_hub``: :meth:`checked` before training, :meth:`push` after the
    results are out, both on the main process only."""

    output_dir: str
    repo_id: str | None
    token: str | None
    private: bool

    @classmethod
    def checked(cls, args) -> HubPush | None:
        """None without ``args.push_to_hub``; else the push, checked now (:func:`check_hub_push`)."""
        if not args.push_to_hub:
            return None
        if is_main_process():
            args.hub_model_id = check_hub_push(args.hub_model_id, args.output_dir, args.hub_token,
                                               bool(args.hub_private_repo))
        return cls(args.output_dir, args.hub_model_id, args.hub_token, bool(args.hub_private_repo))

    def push(self) -> None:
        """Upload --output_dir (:func:`push_output_dir`)."""
        if is_main_process():
            push_output_dir(self.output_dir, self.repo_id, self.token, self.private)


def push_output_dir(output_dir: str, repo_id: str, token: str | None = None, private: bool = False) -> str:
    """Upload the run's folder (model, processor/tokenizer, card, results) to ``repo_id``.

    Call it after the results are printed and saved: should the upload still fail (the network
    went away during training), the run ends with one line saying where the model is, exit 1.
    """
    from hf_infcl.model_card import push_checkpoint

    try:
        url = push_checkpoint(output_dir, repo_id, token=token, private=private)
    except Exception as error:
        raise SystemExit(
            f"{os.path.basename(sys.argv[0]) or 'example'}: error: push to {repo_id} failed "
            f"({first_line(error)}); the model is saved in {os.path.abspath(output_dir)}: upload it "
            f"later with hf_infcl.model_card.push_checkpoint({str(output_dir)!r}, {repo_id!r})"
        ) from None
    print(f"pushed to {url}", flush=True)
    return url
