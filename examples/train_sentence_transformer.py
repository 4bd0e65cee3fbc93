"""Fine-tune a SentenceTransformer with ``hf_infcl.losses.InfCLLoss`` and SentenceTransformerTrainer.

    python examples/train_sentence_transformer.py                 # MiniLM on WordNet, CPU or GPU
    python examples/train_sentence_transformer.py --per_device_train_batch_size 8192 \\
        --mini_batch_size 256 --bf16                               # a large batch through GradCache

The same data as ``train_retriever.py`` (WordNet definition -> word pairs, the standard library's
docstring -> code pairs when WordNet is absent, or your own query/passage file) as (anchor,
positive) columns; the loss is MultipleNegativesRankingLoss's, computed by hf_infcl without a
batch x batch matrix (``--symmetric`` for the symmetric variant). sentence-transformers'
InformationRetrievalEvaluator scores the held-out split before and after training.

Every ``SentenceTransformerTrainingArguments`` flag works (``--learning_rate``, ``--max_steps``,
``--bf16``, ...).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' shared helpers

from example_cli import parse_with_defaults  # noqa: E402
from text_outputs import save_results_and_card  # noqa: E402
from text_pairs import TextPairArguments  # noqa: E402

DEFAULT_OUTPUT_DIR = "outputs/sentence-transformer-wordnet"


@dataclass
class ScriptArguments(TextPairArguments):
    scale: float = field(default=20.0, metadata={"help": "1 / temperature, as MultipleNegativesRankingLoss."})
    symmetric: bool = field(default=False, metadata={"help": "Also the passage -> query direction."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "GradCache chunk of texts."})


def information_retrieval_evaluator(pairs, name):
    """sentence-transformers' evaluator: each query's passage among all distinct held-out passages."""
    try:  # sentence-transformers >= 6.1 moved it
        from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    except ImportError:
        from sentence_transformers.evaluation import InformationRetrievalEvaluator

    passages = list(dict.fromkeys(p for _, p in pairs))
    passage_id = {p: f"d{i}" for i, p in enumerate(passages)}
    queries = {f"q{i}": q for i, (q, _) in enumerate(pairs)}
    relevant = {f"q{i}": {passage_id[p]} for i, (_, p) in enumerate(pairs)}
    return InformationRetrievalEvaluator(
        queries=queries,
        corpus={v: k for k, v in passage_id.items()},
        relevant_docs=relevant,
        name=name,
        accuracy_at_k=[1, 10],
        precision_recall_at_k=[1, 10],
        mrr_at_k=[10],
        ndcg_at_k=[10],
        map_at_k=[10],
        show_progress_bar=False,
    )


def summary(scores, name):
    """recall@1, recall@10 and MRR@10 from the evaluator's metric names."""
    wanted = {
        "recall@1": "cosine_recall@1",
        "recall@10": "cosine_recall@10",
        "mrr@10": "cosine_mrr@10",
        "ndcg@10": "cosine_ndcg@10",
    }
    return {
        short: float(scores[f"{name}_{long}"]) for short, long in wanted.items() if f"{name}_{long}" in scores
    }


def main(argv=None):
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    try:  # sentence-transformers >= 6.1 moved it
        from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    except ImportError:
        from sentence_transformers.training_args import BatchSamplers
    from transformers import HfArgumentParser

    from hf_infcl import losses

    parser = HfArgumentParser((ScriptArguments, SentenceTransformerTrainingArguments))
    defaults = {
        "--per_device_train_batch_size": "128",
        "--learning_rate": "1e-4",
        "--num_train_epochs": "1",
        "--logging_steps": "10",
        "--save_strategy": "no",
        "--report_to": "none",
    }
    script_args, args = parse_with_defaults(parser, argv, DEFAULT_OUTPUT_DIR, defaults)
    # In-batch negatives: a batch must not hold the same passage twice (it would be a false negative).
    args.batch_sampler = BatchSamplers.NO_DUPLICATES
    push_to_hub, args.push_to_hub = args.push_to_hub, False  # pushed with our card at the end
    started = time.perf_counter()

    data = script_args.load_pairs(seed=args.seed)
    model_path = script_args.model_path()
    model = SentenceTransformer(model_path, device=str(args.device))
    model.max_seq_length = script_args.max_seq_length
    train = Dataset.from_dict({"anchor": [q for q, _ in data.train], "positive": [p for _, p in data.train]})
    loss = losses.InfCLLoss(
        model,
        scale=script_args.scale,
        symmetric=script_args.symmetric,
        mini_batch_size=script_args.mini_batch_size,
    )
    evaluator = information_retrieval_evaluator(data.held_out, name="held-out")
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss)
    say = print if trainer.is_world_process_zero() else (lambda *a, **k: None)
    world = trainer.accelerator.num_processes
    say(
        f"{data.description}: {len(data.train)} training pairs, {len(data.held_out)} held out; "
        f"contrastive batch {args.per_device_train_batch_size * world}"
    )

    before = summary(evaluator(model), evaluator.name)
    say("before: " + ", ".join(f"{k} {v:.3f}" for k, v in before.items()))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train_started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_started
    after = summary(evaluator(model), evaluator.name)
    say("after:  " + ", ".join(f"{k} {v:.3f}" for k, v in after.items()))

    if trainer.is_world_process_zero():
        model.save_pretrained(args.output_dir)
        # Replaces sentence-transformers' own README with the hf_infcl card (same metadata style).
        save_results_and_card(
            args, script_args, data, trainer, before=before, after=after, train_seconds=train_seconds,
            push_to_hub=push_to_hub,
            library_name="sentence-transformers",
            chunk_size=script_args.mini_batch_size,
            loss="softmax",
            symmetric=script_args.symmetric,
            logit_scale=script_args.scale,
            tags=["sentence-transformers", "sentence-similarity"],
        )
    say(
        f"done in {time.perf_counter() - started:.1f} s ({train_seconds:.1f} s training); "
        f"saved to {os.path.abspath(args.output_dir)}"
    )
    return before, after


if __name__ == "__main__":
    main()
