"""The text examples' evaluation before and after training, and what they leave in their output
folder: ``eval_results.json``, hf_infcl's model card (with the fields both text examples share),
and, when asked, the upload of the whole folder to the Hub (``example_cli.push_output_dir``); and
:func:`resume_checkpoint`, the Trainer checkpoint ``--resume_from_checkpoint`` names, checked before
any work (the Trainer reads that field only when it is handed to ``train``)."""

from __future__ import annotations

import json
import os
import time

import torch


def save_results_and_card(args, script_args, data, trainer, *, before, after, train_seconds,
                          **card_fields) -> None:
    """Write eval_results.json and the model card into ``args.output_dir``.

    ``args``: the run's TrainingArguments (``hub_model_id``, when set, is what the card's usage
    snippet loads; else the local folder); ``script_args``: a ``TextPairArguments``; ``data``: the
    ``TextPairs`` trained on; ``card_fields``: what differs between the examples (loss settings,
    library name, tags). Call it on the main process, after the model is saved.
    """
    from hf_infcl.model_card import save_model_card

    with open(os.path.join(args.output_dir, "eval_results.json"), "w") as handle:
        json.dump({"before": before, "after": after, "train_seconds": train_seconds}, handle, indent=2)
    world = trainer.accelerator.num_processes
    minilm = script_args.model_name_or_path is None
    save_model_card(
        args.output_dir,
        "dual_encoder",
        model_name=args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir)),
        base_model="sentence-transformers/all-MiniLM-L6-v2" if minilm else script_args.model_name_or_path,
        dataset=data.name,
        dataset_description=data.description,
        dataset_license=data.license,
        train_pairs=len(data.train),
        held_out_pairs=len(data.held_out),
        global_batch_size=args.per_device_train_batch_size * world,
        per_device_batch_size=args.per_device_train_batch_size,
        num_processes=world,
        device=str(args.device),
        mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else "no",
        peak_gpu_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        learning_rate=args.learning_rate,
        steps=trainer.state.global_step,
        train_seconds=train_seconds,
        eval_results=after,
        eval_results_before=before,
        repo_id=args.hub_model_id or os.path.abspath(args.output_dir),
        **card_fields,
    )



def resume_checkpoint(args) -> str | None:
    """The Trainer checkpoint folder to resume from: ``args.resume_from_checkpoint`` (a folder, or
    ``latest``: the last checkpoint-<step> of ``--output_dir``), else None. A folder without the
    Trainer's state, or one whose step already ends ``--max_steps``, ends the run in one line."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint

    from example_cli import checkpoint_folder, fail, is_main_process

    checkpoint = checkpoint_folder(args.resume_from_checkpoint, args.output_dir, TRAINER_STATE_NAME)
    if checkpoint is None:
        last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
        if last is not None and is_main_process():
            print(f"note: {args.output_dir} holds checkpoints up to {last}; this run starts from step 0 "
                  "(--resume_from_checkpoint latest goes on from it)", flush=True)
        return None
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as handle:
        step = json.load(handle)["global_step"]
    if 0 < args.max_steps <= step:  # the Trainer would train 0 steps and save over the finished run
        fail(f"--resume_from_checkpoint {checkpoint}: the checkpoint is at step {step}, where this run's "
             f"--max_steps {args.max_steps} has already ended: nothing to train; pass a larger --max_steps "
             "to train on")
    return checkpoint


def train_and_evaluate(trainer, evaluate, say, resume_from: str | None = None) -> tuple[dict, dict, float]:
    """``evaluate()`` before and after ``trainer.train(resume_from_checkpoint=resume_from)``, each said
    in a line: (before, after, training seconds), what ``save_results_and_card`` records. GPU peak
    memory counts from here."""
    before = evaluate()
    say("before: " + ", ".join(f"{k} {v:.3f}" for k, v in before.items()))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train_started = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_from)
    if resume_from is not None:
        say(f"resumed from {resume_from}: trained to step {trainer.state.global_step}")
    train_seconds = time.perf_counter() - train_started
    after = evaluate()
    say("after:  " + ", ".join(f"{k} {v:.3f}" for k, v in after.items()))
    return before, after, train_seconds


def finish_run(say, started: float, train_seconds: float, output_dir: str, hub) -> None:
    """The last line of a text example's run (its time and where it saved), then the Hub upload
    when ``--push_to_hub`` asked for one (``hub``: an ``example_cli.HubPush``, or None)."""
    say(f"done in {time.perf_counter() - started:.1f} s ({train_seconds:.1f} s training); "
        f"saved to {os.path.abspath(output_dir)}")
    if hub is not None:
        hub.push()
