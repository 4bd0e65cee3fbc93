"""What ``train_clip.py`` leaves behind and resumes from: checkpoints with the run's history, the
saved model and processor, ``eval_results.json``, the training curves and the model card.

- :class:`RunHistory`: the logging and evaluation points, training time and data wait of a run so
  far, saved in each checkpoint (``run_history.json``) beside Accelerate's state, so that a
  resumed run's results, curves and card cover the whole run; :func:`resume_point` reads it back
  (and ends a resume whose schedule has already ended); :func:`delete_old_checkpoints` keeps the
  last ``--save_total_limit`` checkpoints.
- :func:`save_model`, :func:`card_facts` and :func:`save_results_and_card`: the end of a run.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace

import torch

from example_cli import checkpoint_folder, fail
from training_curves import save_training_curves


@dataclass
class RunHistory:
    """What a run has done up to a checkpoint, saved in it (``run_history.json``)."""

    total_steps: int  # the schedule's length
    train_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    train: list = field(default_factory=list)  # the logging steps' points
    evaluations: list = field(default_factory=list)  # the held-out metrics of the evaluation steps

    FILE = "run_history.json"

    def save(self, checkpoint: str) -> None:
        with open(os.path.join(checkpoint, self.FILE), "w") as handle:
            json.dump(asdict(self), handle, indent=2)

    @classmethod
    def load(cls, checkpoint: str) -> RunHistory | None:
        path = os.path.join(checkpoint, cls.FILE)
        if not os.path.isfile(path):  # a checkpoint saved without one
            return None
        with open(path) as handle:
            return cls(**json.load(handle))


def resume_point(resume_from: str | None, output_dir: str, total_steps: int, log):
    """(checkpoint folder or None, its step, the history to go on with) of --resume_from_checkpoint
    (a folder, or 'latest': the last checkpoint-<step> of ``output_dir``). A schedule of
    ``total_steps`` that has already ended ends the run (exit 2) saying so: training 0 steps and
    writing a new card over the finished run's is never what a resume means."""
    checkpoint = checkpoint_folder(resume_from, output_dir)
    if checkpoint is None:
        return None, 0, RunHistory(total_steps)
    step = int(checkpoint.rstrip("/").rsplit("-", 1)[-1])
    saved = RunHistory.load(checkpoint)
    planned = f"; the run saved there planned {saved.total_steps}" if saved else ""
    if step >= total_steps:
        fail(f"--resume_from_checkpoint {checkpoint}: the checkpoint is at step {step}, where this run's "
             f"schedule of {total_steps} steps (--max_steps, else --num_train_epochs) has already ended"
             f"{planned}: nothing to train; pass a larger --max_steps to train on")
    if saved is None:
        return checkpoint, step, RunHistory(total_steps)
    if saved.total_steps != total_steps:
        log(f"note: the run saved in {checkpoint} planned {saved.total_steps} steps, this one {total_steps}: "
            "the learning-rate schedule follows this run's")
    return checkpoint, step, replace(saved, total_steps=total_steps)


def delete_old_checkpoints(output_dir: str, keep: int | None) -> None:
    """--save_total_limit: delete all but the last ``keep`` checkpoint-<step> folders (None: none)."""
    if keep is None:
        return
    import shutil

    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    steps = sorted(int(name.rsplit("-", 1)[1]) for name in os.listdir(output_dir)
                   if name.startswith(f"{PREFIX_CHECKPOINT_DIR}-") and name.rsplit("-", 1)[1].isdigit())
    for step in steps[:-keep]:
        shutil.rmtree(os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}"))


def save_model(accelerator, embedder, processor, output_dir: str, vectorised: list[str]) -> None:
    """The trained model and its processor in ``output_dir``, as a plain checkpoint of its family.
    Every process calls it: under FSDP2 the full weights are gathered (a collective) and saved with
    the 0-d shapes of the parameters ``vectorise_scalar_parameters`` made 1-element."""
    from clip_model import pretrained_state_dict

    state = accelerator.get_state_dict(embedder) if accelerator.is_fsdp2 else None
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        model = accelerator.unwrap_model(embedder).clip
        if state is not None:
            model.save_pretrained(output_dir, state_dict=pretrained_state_dict(state, vectorised))
        else:
            model.save_pretrained(output_dir)
        processor.save_pretrained(output_dir)


def peak_host_memory_gib() -> float | None:
    """The training process's peak resident memory (its DataLoader workers not included); None
    where Python has no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


def device_description(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({os.cpu_count()} cores)"


def card_facts(args, data, classes, *, base_model: str, pretrained: bool, train_pairs, **measured) -> dict:
    """The model card's facts (``hf_infcl.model_card``) of a run: ``args`` (the training flags),
    ``data`` (the training data), ``classes`` (the zero-shot classes' data, or None), and what the
    run ``measured`` (steps, time, scale, results, ...: the card's own names)."""
    name = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
    return dict(
        base_model=base_model if pretrained else None, model_description=base_model,
        dataset=data.name, dataset_description=data.description, dataset_license=data.license,
        attribution=data.attribution, train_pairs=train_pairs, held_out_pairs=len(data.held_out),
        per_device_batch_size=args.per_device_train_batch_size, chunk_size=args.chunk_size,
        offload=args.offload, loss=args.loss, symmetric=args.symmetric,
        mask_false_negatives=args.mask_false_negatives, learning_rate=args.learning_rate,
        class_names=list(classes.class_names) if classes else None,
        example_prompts=[prompts[0] for prompts in classes.class_prompts()[:2]] if classes else None,
        hub_model_id=args.hub_model_id, model_name=name,
        repo_id=args.hub_model_id or os.path.abspath(args.output_dir),
        # The OpenMoji artwork is share-alike: so is a model trained on it.
        license="cc-by-sa-4.0" if data.name == "openmoji" else None,
        **measured,
    )


def save_results_and_card(args, facts: dict, run: RunHistory, log) -> None:
    """The training curves, ``eval_results.json`` (final metrics, the whole run's evaluation and
    logging points, the skipped rows), ``training_args.json`` and the card, into --output_dir.
    Call it on the main process, after :func:`save_model`."""
    from hf_infcl.model_card import save_model_card

    facts["curves_image"] = save_training_curves(run.train, run.evaluations, args.output_dir, log)
    with open(os.path.join(args.output_dir, "eval_results.json"), "w") as handle:
        json.dump({"final": facts["eval_results"], "history": run.evaluations, "train": run.train,
                   "skipped_rows": facts["skipped_rows"] or {}}, handle, indent=2)
    with open(os.path.join(args.output_dir, "training_args.json"), "w") as handle:
        json.dump(asdict(args), handle, indent=2)
    save_model_card(args.output_dir, "clip", **facts)


def log_summary(log, facts: dict, run: RunHistory, *, resumed_at: int, this_run_seconds: float,
                wall_seconds: float, output_dir: str, eval_skipped: dict | None) -> None:
    """The run's last lines: steps, time, throughput, data wait and memory, the held-out results,
    where the model is, and the rows skipped."""
    seconds, waited, final = facts["train_seconds"], run.data_wait_seconds, facts["eval_results"]
    throughput = (f"{facts['pairs_per_second']:.0f} pairs/s, "
                  f"waited {waited:.1f} s for data, {waited / seconds:.0%} of training")
    if facts["peak_gpu_memory_gib"] is not None:
        throughput += f", peak GPU memory {facts['peak_gpu_memory_gib']:.1f} GiB"
    peak_host_gib = peak_host_memory_gib()
    if peak_host_gib is not None:
        throughput += f", peak host memory {peak_host_gib:.1f} GiB"
    resumed = f"({this_run_seconds:.1f} s of them after resuming at step {resumed_at}) " if resumed_at else ""
    log(f"done: {facts['steps']} steps in {seconds:.1f} s of training {resumed}({wall_seconds:.1f} s in all; "
        f"{throughput}); held-out {', '.join(f'{k} {v:.3f}' for k, v in final.items())}")
    if "zero_shot_top1" in final:
        log(f"held-out zero-shot accuracy: {final['zero_shot_top1']:.1%}")
    log(f"saved to {os.path.abspath(output_dir)}")
    skipped = facts["skipped_rows"]
    if skipped:
        log(f"skipped {sum(skipped.values())} rows of the data: "
            + ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items())))
    if eval_skipped:
        log(f"skipped rows of --eval_dataset: {eval_skipped}")
