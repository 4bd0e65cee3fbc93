"""Fine-tune a SentenceTransformer with ``hf_infcl.losses.InfCLLoss`` and SentenceTransformerTrainer.

    python examples/train_sentence_transformer.py                 # MiniLM on WordNet, CPU or GPU
    python examples/train_sentence_transformer.py --max_train_pairs 65536 \\
        --per_device_train_batch_size 8192 --mini_batch_size 256 --bf16   # a large batch, GradCache

The same data as ``train_retriever.py`` (WordNet definition -> word pairs, the standard library's
docstring -> code pairs when WordNet is absent, or your own query/passage file) as (anchor,
positive) columns; the loss is MultipleNegativesRankingLoss's, computed by hf_infcl without a
batch x batch matrix (``--symmetric`` for the symmetric variant). The held-out split is scored
before and after training by ``hf_infcl.metrics`` (recall@1/10 and MRR of each query's passage
among all distinct held-out passages), the same metric and tie rule as ``train_retriever.py``
and ``InfCLTrainer``'s evaluation.

With no arguments: 1024 training pairs, 16 steps of 64, 1000 held out (under a minute on a
2-core CPU). Every ``SentenceTransformerTrainingArguments`` flag works (``--learning_rate``,
``--max_steps``, ``--bf16``, ``--push_to_hub``, ...), plus ``--precision`` of the loss. Numeric
flags are checked before any work, and so is ``--push_to_hub`` (token, Hub reachable, repo id).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hf_infcl.ops.options import PRECISIONS, Precision

from example_cli import POSITIVE, HubPush, argument_parser, close_process_group, parse_with_defaults
from retrieval_metrics import retrieval_metrics
from text_outputs import finish_run, save_results_and_card, train_and_evaluate
from text_pairs import TEXT_EXAMPLE_RULES, TEXT_TRAINING_DEFAULTS, TextPairArguments

# {dataset}: wordnet, stdlib (where WordNet is not installed) or the --dataset file's name
DEFAULT_OUTPUT_DIR = "outputs/sentence-transformer-{dataset}"


@dataclass
class ScriptArguments(TextPairArguments):
    scale: float = field(default=20.0, metadata={"help": "1 / temperature, as MultipleNegativesRankingLoss."})
    symmetric: bool = field(default=False, metadata={"help": "Also the passage -> query direction."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "GradCache chunk of texts."})
    precision: Precision = field(
        default="auto",
        metadata={
            "help": f"Matmul precision of the loss for fp32 embeddings, one of {', '.join(PRECISIONS)}: "
            "'auto' is TF32 on CUDA (every backend) and exact fp32 elsewhere, 'ieee' exact fp32."
        },
    )
    eval_batch_size: int = field(
        default=256, metadata={"help": "Texts per batch when scoring the held-out split."}
    )


# What every numeric flag must be (checked before any work; a test holds this complete).
NUMERIC_RULES = {
    **TEXT_EXAMPLE_RULES,
    "scale": POSITIVE,
    "mini_batch_size": POSITIVE,
    "eval_batch_size": POSITIVE,
}

# Example-friendly defaults (the parser's own: any flag given on the command line wins).
DEFAULTS = TEXT_TRAINING_DEFAULTS


@torch.no_grad()
def evaluate_retrieval(model, pairs, batch_size=256):
    """recall@1/10 and MRR of each held-out query's passage among all distinct held-out passages."""
    passages = list(dict.fromkeys(p for _, p in pairs))
    passage_id = {p: i for i, p in enumerate(passages)}

    def embed(texts):
        return model.encode(texts, batch_size=batch_size, convert_to_tensor=True, normalize_embeddings=True,
                            show_progress_bar=False).float()

    queries, docs = embed([q for q, _ in pairs]), embed(passages)
    query_ids = torch.tensor([passage_id[p] for _, p in pairs], device=docs.device)
    passage_ids = torch.arange(len(passages), device=docs.device)
    return retrieval_metrics(queries, docs, query_ids, passage_ids, ks=(1, 10))


def build_parser():
    from sentence_transformers import SentenceTransformerTrainingArguments

    # --precision (a Literal field) is checked by the parser, in hf_infcl's one format.
    return argument_parser((ScriptArguments, SentenceTransformerTrainingArguments))


def parse_arguments(argv=None):
    """(ScriptArguments, SentenceTransformerTrainingArguments) of ``argv``, every flag checked."""
    return parse_with_defaults(build_parser(), argv, DEFAULT_OUTPUT_DIR, DEFAULTS, NUMERIC_RULES)


def main(argv=None):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    try:  # sentence-transformers >= 6.1 moved it
        from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    except ImportError:
        from sentence_transformers.training_args import BatchSamplers

    from hf_infcl import losses

    script_args, args = parse_arguments(argv)
    script_args.set_output_dir(args, DEFAULT_OUTPUT_DIR)
    # In-batch negatives: a batch must not hold the same passage twice (it would be a false negative).
    args.batch_sampler = BatchSamplers.NO_DUPLICATES
    hub = HubPush.checked(args)  # now, not after training; pushed with our card at the end
    args.push_to_hub = False  # the Trainer's own push would upload a second time, with its own card
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
        precision=script_args.precision,
        gather_across_devices=True,  # negatives from every process: the contrastive batch is global
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss)
    say = print if trainer.is_world_process_zero() else (lambda *a, **k: None)
    world = trainer.accelerator.num_processes
    say(
        f"{data.description}: {len(data.train)} training pairs, {len(data.held_out)} held out; "
        f"contrastive batch {args.per_device_train_batch_size * world}"
    )

    evaluate = lambda: evaluate_retrieval(model, data.held_out, script_args.eval_batch_size)  # noqa: E731
    before, after, train_seconds = train_and_evaluate(trainer, evaluate, say)

    if trainer.is_world_process_zero():
        model.save_pretrained(args.output_dir)
        # Replaces sentence-transformers' own README with the hf_infcl card (same metadata style).
        save_results_and_card(
            args, script_args, data, trainer, before=before, after=after, train_seconds=train_seconds,
            library_name="sentence-transformers",
            chunk_size=script_args.mini_batch_size,
            loss="softmax",
            symmetric=script_args.symmetric,
            logit_scale=script_args.scale,
            tags=["sentence-transformers", "sentence-similarity"],
        )
    finish_run(say, started, train_seconds, args.output_dir, hub)
    return before, after


if __name__ == "__main__":
    main()
    close_process_group()
