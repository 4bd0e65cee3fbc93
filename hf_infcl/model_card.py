"""Model cards for models trained with hf_infcl, and pushing a checkpoint with its card.

The cards are the ``model_cards/*.md`` Jinja templates (``clip`` for CLIP-style image-text
models, ``clap`` for CLAP's audio-text models, ``dual_encoder`` for text retrievers), filled from
the facts of a run: base model and data, global batch, chunk size, loss settings, processes and
devices, peak GPU memory, evaluation results, the training-curves image where the run drew one
(``curves_image``, a path relative to the card), and how to load the model. Their YAML header is a
``huggingface_hub.ModelCardData`` (library_name, tags including ``inf-cl``, datasets, metrics,
a model-index of the evaluation results), so the Hub reads them like any other card.

    from hf_infcl.model_card import save_model_card, push_checkpoint
    save_model_card("outputs/run", "clip", dataset="digits", global_batch_size=128,
                    eval_results={"zero_shot_top1": 0.94})
    push_checkpoint("outputs/run", "me/tiny-clip")      # README.md included

``huggingface_hub`` (and ``jinja2``, which it uses for templates) are imported lazily.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import sys
from pathlib import Path

KINDS = ("clip", "clap", "dual_encoder")

# Shipped inside the package (so wheel installs have them); ``model_cards/`` at the top of the
# repository is a link to this folder.
TEMPLATE_DIR = Path(__file__).resolve().parent / "model_cards"

# Every fact a card may be given. Names double as the rows of the "Training" table, in order.
SETTING_LABELS = {
    "global_batch_size": "global contrastive batch",
    "per_device_batch_size": "batch per process",
    "chunk_size": "encoder chunk (GradCache)",
    "offload": "batch offloaded to host memory",
    "loss": "loss",
    "symmetric": "symmetric (both directions)",
    "mask_false_negatives": "same-class / duplicate pairs masked as negatives",
    "logit_scale": "final logit scale",
    "logit_bias": "final logit bias",
    "num_processes": "processes",
    "device": "devices",
    "mixed_precision": "mixed precision",
    "peak_gpu_memory_gib": "peak GPU memory (GiB, per process)",
    "learning_rate": "learning rate",
    "steps": "optimizer steps",
    "epochs": "epochs",
    "train_seconds": "training time (s)",
    "pairs_per_second": "throughput (pairs/s)",
}
OTHER_FACTS = (
    "model_name",
    "repo_id",
    "base_model",
    "model_description",
    "dataset",
    "datasets",
    "dataset_description",
    "dataset_license",
    "attribution",
    "license",
    "train_pairs",
    "held_out_pairs",
    "eval_results",
    "eval_results_before",
    "class_names",
    "example_prompts",
    "hub_model_id",
    "library_name",
    "usage",
    "command",
    "tags",
    "language",
    "curves_image",
    "skipped_rows",
)
KNOWN_FACTS = frozenset(SETTING_LABELS) | frozenset(OTHER_FACTS)


def installed_version() -> str:
    """hf_infcl's version from the package metadata (``hf_infcl.__version__`` is the same);
    ``"0+unknown"`` for a checkout on ``sys.path`` that was never installed."""
    try:
        return importlib.metadata.version("hf_infcl")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def latest_eval_results(log_history: list[dict]) -> dict:
    """The ``eval_results`` of a card from a Trainer's ``state.log_history``: the metrics of its
    latest evaluation, without the ``eval_`` prefix and without the timing entries."""
    last_eval = next((entry for entry in reversed(log_history)
                      if any(key.startswith("eval_") for key in entry)), {})
    return {key.removeprefix("eval_"): value for key, value in last_eval.items()
            if key.startswith("eval_") and not key.endswith(("runtime", "_per_second"))}


_PIPELINE_TAG = {"clip": "zero-shot-image-classification", "clap": "zero-shot-audio-classification",
                 "dual_encoder": "sentence-similarity"}
_TASK_NAME = {
    "clip": "Zero-shot image classification and image-text retrieval",
    "clap": "Zero-shot audio classification and audio-text retrieval",
    "dual_encoder": "Text retrieval",
}
_TAGS = {"clip": ["clip", "image-text"], "clap": ["clap", "audio-text"],
         "dual_encoder": ["dual-encoder", "retrieval"]}
_EXAMPLE_PROMPTS = {"clip": ["a photo of a cat", "a photo of a dog"],
                    "clap": ["the sound of a dog barking", "the sound of rain"]}


def _require_hub():
    try:
        import huggingface_hub
    except ImportError as error:
        raise ImportError("model cards need huggingface_hub: pip install huggingface_hub") from error
    return huggingface_hub


def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}; got {kind!r}")


def _format(value):
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _metric_type(name: str) -> str:
    """The Hub's metric id for one of our result names (``image_to_text_recall@5`` -> recall)."""
    lowered = name.lower()
    for metric in ("accuracy", "recall", "mrr", "ndcg", "map", "precision", "loss"):
        if metric in lowered:
            return metric
    if "top1" in lowered:
        return "accuracy"
    return lowered


def build_card_data(kind: str, **facts):
    """The card's YAML metadata as a ``huggingface_hub.ModelCardData``."""
    _check_kind(kind)
    unknown = set(facts) - KNOWN_FACTS
    if unknown:
        raise TypeError(f"unknown model card facts {sorted(unknown)}; known: {sorted(KNOWN_FACTS)}")
    hub = _require_hub()
    results = facts.get("eval_results") or {}
    model_name = (
        facts.get("model_name") or facts.get("hub_model_id") or facts.get("repo_id") or "hf_infcl model"
    )
    dataset_name = facts.get("dataset") or "custom"
    eval_results = [
        hub.EvalResult(
            task_type=_PIPELINE_TAG[kind],
            task_name=_TASK_NAME[kind],
            dataset_type=dataset_name,
            dataset_name=dataset_name,
            dataset_split="held-out",
            metric_type=_metric_type(name),
            metric_name=name,
            metric_value=round(float(value), 4),
        )
        for name, value in results.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in ("step", "loss")
    ]
    tags = ["inf-cl", "hf_infcl", "contrastive-learning"]
    tags += _TAGS[kind]
    tags += [tag for tag in facts.get("tags") or () if tag not in tags]
    library = facts.get("library_name") or "transformers"
    metrics = sorted({result.metric_type for result in eval_results})
    return hub.ModelCardData(
        library_name=library,
        pipeline_tag=_PIPELINE_TAG[kind],
        tags=tags,
        base_model=facts.get("base_model") or None,
        datasets=facts.get("datasets") or None,
        license=facts.get("license") or None,
        language=facts.get("language") or None,
        metrics=metrics or None,
        model_name=model_name,
        eval_results=eval_results or None,
    )


def render_model_card(kind: str, *, template_path: str | os.PathLike | None = None, **facts) -> str:
    """The model card (Markdown with a YAML header) of a run.

    Args:
        kind: ``"clip"``, ``"clap"`` or ``"dual_encoder"``: which template of ``model_cards/``.
        template_path: another Jinja template (it receives the same variables).
        **facts: what the run knows; see ``KNOWN_FACTS``. The main ones: ``base_model`` (a Hub
            id, or None when trained from scratch; ``model_description`` then says what it is),
            ``dataset`` / ``dataset_description`` / ``datasets`` (Hub dataset ids),
            ``global_batch_size``, ``chunk_size``, ``loss``, ``num_processes``, ``device``,
            ``peak_gpu_memory_gib``, ``eval_results`` (name -> value; ``eval_results_before`` the
            same before training), ``repo_id`` (what the usage snippet loads).
    """
    _check_kind(kind)
    card_data = build_card_data(kind, **facts)
    hub = _require_hub()
    path = Path(template_path) if template_path is not None else TEMPLATE_DIR / f"{kind}.md"
    if not path.is_file():
        raise FileNotFoundError(
            f"model card template {path} not found (it ships in the repository's "
            "model_cards/ folder; pass template_path= to use another)"
        )
    results = facts.get("eval_results") or {}
    before = facts.get("eval_results_before") or {}
    rows = []
    for name, value in results.items():
        if name in ("step",) or not isinstance(value, (int, float)):
            continue
        shown = _format(value)
        if name in before:
            shown = f"{_format(before[name])} → {shown}"
        rows.append((name + (" (before → after)" if name in before else ""), shown))
    settings = [
        (label, _format(facts[key])) for key, label in SETTING_LABELS.items() if facts.get(key) is not None
    ]
    repo_id = facts.get("repo_id") or facts.get("hub_model_id") or "path/to/this/model"
    prompts = facts.get("example_prompts") or _EXAMPLE_PROMPTS.get(kind, _EXAMPLE_PROMPTS["clip"])
    variables = dict(
        model_name=card_data.model_name,
        base_model=facts.get("base_model"),
        model_description=facts.get("model_description") or "trained from scratch",
        dataset=facts.get("dataset") or "custom data",
        dataset_description=facts.get("dataset_description"),
        dataset_license=facts.get("dataset_license"),
        attribution=facts.get("attribution"),
        train_pairs=facts.get("train_pairs", "?"),
        held_out_pairs=facts.get("held_out_pairs", "?"),
        global_batch_size=facts.get("global_batch_size", "?"),
        num_processes=int(facts.get("num_processes") or 1),
        settings=settings,
        results=rows,
        repo_id=repo_id,
        loss=facts.get("loss") or "softmax",  # the usage's probabilities: sigmoid or softmax
        example_prompts=list(prompts),
        usage=facts.get("usage") or _default_usage(kind, card_data.library_name, repo_id),
        hf_infcl_version=installed_version(),
        command=facts.get("command"),
        curves_image=facts.get("curves_image"),
        skipped_rows=", ".join(f"{count} {reason}"
                               for reason, count in sorted((facts.get("skipped_rows") or {}).items())),
    )
    card = hub.ModelCard.from_template(card_data, template_str=path.read_text(encoding="utf-8"), **variables)
    return str(card)


def _default_usage(kind, library_name, repo_id):
    if kind in ("clip", "clap"):  # the template shows how
        return ""
    if library_name == "sentence-transformers":
        return (
            "```python\nfrom sentence_transformers import SentenceTransformer\n\n"
            f'model = SentenceTransformer("{repo_id}")\n'
            'queries = model.encode(["a query"])\npassages = model.encode(["a passage", "another passage"])\n'
            "print(model.similarity(queries, passages))\n```"
        )
    return (
        "```python\nfrom transformers import AutoTokenizer\nfrom hf_infcl import DualEncoder\n\n"
        f'model = DualEncoder.from_pretrained("{repo_id}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
        'queries = model.encode_queries(**tokenizer(["a query"], return_tensors="pt"))\n'
        'docs = model.encode_docs(\n'
        '    **tokenizer(["a passage", "another one"], padding=True, return_tensors="pt"))\n'
        "print(queries @ docs.T)\n```"
    )


def save_model_card(output_dir: str | os.PathLike, kind: str, **facts) -> Path:
    """Render the card and write it to ``output_dir/README.md`` (what the Hub shows)."""
    facts.setdefault(
        "command",
        " ".join(shlex.quote(a) for a in [os.path.basename(sys.argv[0]), *sys.argv[1:]])
        if sys.argv and sys.argv[0]
        else None,
    )
    text = render_model_card(kind, **facts)
    path = Path(output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# Files of a run that are not part of the published model.
_NOT_PUSHED_DIRS = ("checkpoint-", "runs", ".git", "__pycache__")
_NOT_PUSHED_SUFFIXES = (".lock", ".tmp")


def files_to_push(output_dir: str | os.PathLike) -> list[str]:
    """Relative paths of the files ``push_checkpoint`` uploads: the model, its processor or
    tokenizer, the card and the results; not the ``checkpoint-*`` training states."""
    root = Path(output_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"output_dir {root} is not a folder")
    files = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if not path.is_file() or any(part.startswith(_NOT_PUSHED_DIRS) for part in relative.parts):
            continue
        if path.name.endswith(_NOT_PUSHED_SUFFIXES):
            continue
        files.append(relative.as_posix())
    return files


def push_checkpoint(
    output_dir: str | os.PathLike,
    repo_id: str,
    *,
    api=None,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload model trained with hf_infcl",
) -> str:
    """Create (if needed) the model repo ``repo_id`` and upload ``files_to_push(output_dir)`` in one commit.

    ``api`` is a ``huggingface_hub.HfApi`` (or anything with ``create_repo`` and
    ``create_commit``); by default one is made with ``token``. Returns the commit URL.
    """
    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"repo_id must be a non-empty string such as 'user/model', got {repo_id!r}")
    files = files_to_push(output_dir)
    if "README.md" not in files:
        raise FileNotFoundError(f"{output_dir} has no README.md: call save_model_card first")
    hub = _require_hub()
    api = api if api is not None else hub.HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    operations = [
        hub.CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(Path(output_dir) / name))
        for name in files
    ]
    info = api.create_commit(
        repo_id=repo_id, repo_type="model", operations=operations, commit_message=commit_message
    )
    return getattr(info, "commit_url", None) or str(info)
