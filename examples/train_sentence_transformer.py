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

A decoder embedder (``--preset``), built as Qwen3-Embedding is: a Qwen3 model, last-token pooling
(``Pooling(pooling_mode="lasttoken")``; the tokenizer ends every text with EOS), ``Normalize``, and a
query prompt saved with the model (sentence-transformers' ``prompts``: ``encode(...,
prompt_name="query")``), trained in bf16 (on a GPU that has it) with gradient checkpointing and
``InfCLLoss(mini_batch_size=...)``:

    python examples/train_sentence_transformer.py --preset qwen3-0.6b \
        --model_name_or_path Qwen/Qwen3-Embedding-0.6B --per_device_train_batch_size 1024   # one GPU
    python examples/train_sentence_transformer.py --preset qwen3-tiny     # the same path in seconds, CPU

``qwen3-0.6b`` is Qwen3-Embedding-0.6B's layout (hidden 1024, 28 layers, 16 query / 8 key-value
heads of 128, intermediate 3072, vocabulary 151669, rope theta 1e6); ``--model_name_or_path``
(Qwen/Qwen3-Embedding-0.6B, Qwen/Qwen3-0.6B or a local folder of a Qwen3/Qwen2/Llama-style model)
loads that checkpoint's weights and tokenizer. Without it nothing is downloaded: the layout is built
from its config with random weights and a byte-level BPE tokenizer is trained on the run's texts,
which checks the pipeline and the memory of a step, not the quality of an embedder. ``qwen3-tiny``
is the same architecture at hidden 64 and 2 layers, for CI. A preset's defaults (learning rate
2e-5 for qwen3-0.6b and 1e-3 for qwen3-tiny, 128 / 64 tokens, mini-batches of 64 / 16 texts, bf16
where supported, gradient checkpointing, the query prompt ``--query_prompt``) give way to any flag
given.

Today's embedder recipes: ``--margin 0.1`` (``--margin_strategy``) leaves out of each query's
negatives the passages the model itself scores within the margin of its positive (GISTEmbedLoss's
filter, the model its own guide); ``--matryoshka_dims 384 128 32`` wraps the loss in
sentence-transformers' ``MatryoshkaLoss`` and scores the held-out split at each width too.

With no arguments: 1024 training pairs, 16 steps of 64, 1000 held out (under a minute on a
2-core CPU). Every ``SentenceTransformerTrainingArguments`` flag works (``--learning_rate``,
``--max_steps``, ``--bf16``, ``--push_to_hub``, ...), plus ``--precision`` of the loss. Numeric
flags are checked before any work, and so is ``--push_to_hub`` (token, Hub reachable, repo id).
``--no_grad_mini_batch_size`` runs the gradient-free pass of ``--mini_batch_size``'s GradCache in larger
chunks (faster; exact gradients only for a model without dropout, see ``InfCLLoss``).
``--resume_from_checkpoint`` (a ``checkpoint-<step>`` folder that ``--save_strategy steps`` saved, or
``latest``: the last in ``--output_dir``) goes on from that checkpoint to the uninterrupted run's end.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch

from hf_infcl.ops.options import (
    FALSE_NEGATIVE_STRATEGIES,
    PRECISIONS,
    FalseNegativeStrategy,
    Precision,
    check_chunking,
    check_matryoshka,
)
from hf_infcl.training_args import CHECKPOINTING_ARGUMENT

from decoder_text import RETRIEVAL_INSTRUCTION, end_texts_with_eos, train_bpe_tokenizer
from example_cli import (
    FINITE,
    POSITIVE,
    HubPush,
    argument_parser,
    close_process_group,
    fail,
    parse_with_defaults,
    preset_defaults,
)
from retrieval_metrics import retrieval_metrics_at_widths
from text_outputs import finish_run, resume_checkpoint, save_results_and_card, train_and_evaluate
from text_pairs import TEXT_EXAMPLE_RULES, TEXT_TRAINING_DEFAULTS, TextPairArguments

# {dataset}: wordnet, stdlib (where WordNet is not installed) or the --dataset file's name
DEFAULT_OUTPUT_DIR = "outputs/sentence-transformer-{dataset}"

# Qwen3-Embedding-0.6B's layout (its backbone is Qwen3-0.6B's, without the language-model head).
QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151669, max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
)
PRESETS = {
    "qwen3-0.6b": dict(
        config=QWEN3_0_6B, tokenizer_vocab=16384,
        defaults={"learning_rate": 2e-5, "max_seq_length": 128, "mini_batch_size": 64,
                  CHECKPOINTING_ARGUMENT: True},
    ),
    "qwen3-tiny": dict(
        config=dict(QWEN3_0_6B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024,
                    max_position_embeddings=512),
        tokenizer_vocab=1024,
        defaults={"learning_rate": 1e-3, "max_seq_length": 64, "mini_batch_size": 16,
                  CHECKPOINTING_ARGUMENT: True},
    ),
}


@dataclass
class ScriptArguments(TextPairArguments):
    preset: str | None = field(
        default=None,
        metadata={"help": "A decoder embedder: qwen3-0.6b (Qwen3-Embedding-0.6B's layout; random weights "
                  "unless --model_name_or_path names a checkpoint) or qwen3-tiny (the same at hidden 64, "
                  "for tests). Last-token pooling, EOS appended, Normalize, a query prompt, bf16 where "
                  "supported, gradient checkpointing, --mini_batch_size."},
    )
    query_prompt: str | None = field(
        default=None,
        metadata={"help": "Text put before every query (the anchor column) in training and evaluation, "
                  "saved as the model's 'query' prompt (default: the model's own; with --preset, a "
                  "retrieval instruction 'Instruct: ...\\nQuery: ')."},
    )
    scale: float = field(default=20.0, metadata={"help": "1 / temperature, as MultipleNegativesRankingLoss."})
    symmetric: bool = field(default=False, metadata={"help": "Also the passage -> query direction."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "GradCache chunk of texts."})
    no_grad_mini_batch_size: int | None = field(
        default=None,
        metadata={"help": "Texts per chunk of GradCache's gradient-free pass (needs --mini_batch_size, the "
                  "replays' chunk; default: the same). Larger is faster; the gradients are exact only for a "
                  "model without dropout (MiniLM's 0.1: approximate, and the loss warns)."},
    )
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
    margin: float | None = field(
        default=None,
        metadata={"help": "Leave out of each query's negatives the passages the model itself scores above "
                  "its positive's cosine minus this margin (GISTEmbedLoss's filter with the model as its own "
                  "guide, as Qwen3-Embedding trains). None: off."},
    )
    margin_strategy: FalseNegativeStrategy = field(
        default="absolute",
        metadata={"help": f"How --margin applies, one of {', '.join(FALSE_NEGATIVE_STRATEGIES)}: the "
                  "positive's score minus the margin, or minus |score| times the margin."},
    )
    matryoshka_dims: list[int] | None = field(
        default=None,
        metadata={"help": "Matryoshka representation learning: strictly descending widths, e.g. 384 256 128 "
                  "64; the loss is wrapped in sentence-transformers' MatryoshkaLoss (the loss of each "
                  "truncated embedding, summed), and the held-out split is scored at each width too."},
    )

    def __post_init__(self):
        check_matryoshka(self.matryoshka_dims, None, names=("--matryoshka_dims", "--matryoshka_weights"))


# What every numeric flag must be (checked before any work; a test holds this complete).
NUMERIC_RULES = {
    **TEXT_EXAMPLE_RULES,
    "scale": POSITIVE,
    "mini_batch_size": POSITIVE,
    "no_grad_mini_batch_size": POSITIVE,
    "eval_batch_size": POSITIVE,
    "margin": FINITE,
}

# Example-friendly defaults (the parser's own: any flag given on the command line wins).
DEFAULTS = TEXT_TRAINING_DEFAULTS


def side_prompts(model) -> dict[str, str]:
    """{column: prompt}: the model's non-empty 'query' prompt before the anchors and 'document'
    prompt before the passages, the same in training as in :func:`evaluate_retrieval`."""
    prompts = model.prompts or {}
    columns = {"anchor": prompts.get("query"), "positive": prompts.get("document")}
    return {column: prompt for column, prompt in columns.items() if prompt}


@torch.no_grad()
def evaluate_retrieval(model, pairs, batch_size=256, dims=()):
    """recall@1/10 and MRR of each held-out query's passage among all distinct held-out passages,
    each side with its prompt (:func:`side_prompts`); for each width of ``dims`` also of the
    embeddings truncated to it and re-normalised (``dim64_mrr``, ...)."""
    passages = list(dict.fromkeys(p for _, p in pairs))
    passage_id = {p: i for i, p in enumerate(passages)}
    prompts = side_prompts(model)

    def embed(texts, column):
        return model.encode(texts, prompt=prompts.get(column), batch_size=batch_size, convert_to_tensor=True,
                            normalize_embeddings=True, show_progress_bar=False).float()

    queries, docs = embed([q for q, _ in pairs], "anchor"), embed(passages, "positive")
    query_ids = torch.tensor([passage_id[p] for _, p in pairs], device=docs.device)
    passage_ids = torch.arange(len(passages), device=docs.device)
    return retrieval_metrics_at_widths(queries, docs, query_ids, passage_ids, dims)


def build_parser():
    from sentence_transformers import SentenceTransformerTrainingArguments

    # --precision (a Literal field) is checked by the parser, in hf_infcl's one format.
    return argument_parser((ScriptArguments, SentenceTransformerTrainingArguments))


def parse_arguments(argv=None):
    """(ScriptArguments, SentenceTransformerTrainingArguments) of ``argv``, every flag checked; a
    ``--preset`` sets its own defaults first."""
    argv = sys.argv[1:] if argv is None else list(argv)
    preset, defaults, output_dir = preset_defaults(argv, PRESETS, DEFAULTS, DEFAULT_OUTPUT_DIR)
    script_args, args = parse_with_defaults(build_parser(), argv, output_dir, defaults, NUMERIC_RULES)
    try:  # the library's one chunk rule, spelled as this script's flags
        chunked = {"--no_grad_mini_batch_size": script_args.no_grad_mini_batch_size}
        check_chunking(script_args.mini_batch_size, chunked, name="--mini_batch_size")
    except ValueError as error:
        fail(str(error))
    if preset is not None and script_args.query_prompt is None:
        script_args.query_prompt = RETRIEVAL_INSTRUCTION
    return script_args, args


def save_random_decoder(preset, texts, folder) -> None:
    """The preset's layout with random weights and a tokenizer trained on ``texts``, saved into
    ``folder`` with ``save_pretrained``: what a checkpoint would hold, so that both load alike."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = train_bpe_tokenizer(texts, preset["tokenizer_vocab"])
    eos = tokenizer.eos_token_id
    config = Qwen3Config(**preset["config"], bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    weights = {name: tensor.contiguous() for name, tensor in Qwen3Model(config).state_dict().items()}
    # Each process writes its own folder: save_pretrained writes on rank 0 alone once a process
    # group exists (torchrun, accelerate launch), and the others would find their folder empty.
    config.save_pretrained(folder)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)


def build_decoder_embedder(script_args, data, device):
    """A SentenceTransformer of the preset: Transformer (the checkpoint ``--model_name_or_path``, else
    the preset's layout with random weights) -> last-token Pooling -> Normalize, with the query prompt."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    with tempfile.TemporaryDirectory() as folder:
        path = script_args.model_name_or_path
        if not path:
            texts = [text for pair in data.train for text in pair] + [script_args.query_prompt or ""]
            save_random_decoder(PRESETS[script_args.preset], texts, folder)
            path = folder
        transformer = Transformer(path, max_seq_length=script_args.max_seq_length)
    end_texts_with_eos(transformer.tokenizer)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling, Normalize()], device=device,
                               prompts={"query": script_args.query_prompt or "", "document": ""})


@contextlib.contextmanager
def whole_parameters(model, dtensors: bool = True):
    """A context in which a sharded model holds its whole parameters on every process (a collective:
    every process enters it), so that ``encode`` and ``save_pretrained`` run outside the training
    step: parameters partitioned by DeepSpeed ZeRO-3 are gathered in place; with ``dtensors``, FSDP2's
    DTensors are replaced by their gathered values until the context ends (FSDP2's own forward
    hooks gather for ``encode``, so evaluation leaves them alone). Nothing to do for a whole model."""
    from hf_infcl.sharding import full_value, is_dtensor, is_zero3_parameter

    partitioned = [param for param in model.parameters() if is_zero3_parameter(param)]
    if partitioned:
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned):
            yield
        return
    sharded = [(module, name, param) for module in model.modules()
               for name, param in module._parameters.items() if dtensors and is_dtensor(param)]
    for module, name, param in sharded:
        module._parameters[name] = torch.nn.Parameter(full_value(param).detach(), requires_grad=False)
    # sentence-transformers before 6.2 moves the model at every encode (model.to(device)), which
    # FSDP2's DTensor parameters refuse ("Couldn't swap"); they are on their device already.
    stays = not dtensors and any(is_dtensor(param) for param in model.parameters())
    if stays:
        model.to = lambda *args, **kwargs: model
    try:
        yield
    finally:
        if stays:
            del model.to
        for module, name, param in sharded:
            module._parameters[name] = param


def leave_parameterless_norms_to_the_fsdp2_root() -> None:
    """Accelerate's FSDP2 preparation gives the model's last child whose class name holds "Norm" a unit
    of its own: for a SentenceTransformer that is ``Normalize``, which has no parameters to shard and
    which ``fully_shard`` cannot wrap (sentence-transformers' modules derive from ``ABC`` first: "object
    layout differs"). Such a module is left to the root's unit instead; idempotent."""
    from accelerate.utils import fsdp_utils

    find_final_norm = fsdp_utils._find_final_norm
    if getattr(find_final_norm, "skips_parameterless", False):
        return

    def final_norm_with_parameters(model):
        norm = find_final_norm(model)
        return norm if norm is not None and any(True for _ in norm.parameters()) else None

    final_norm_with_parameters.skips_parameterless = True
    fsdp_utils._find_final_norm = final_norm_with_parameters


def load_model(script_args, data, device):
    """The SentenceTransformer to train: a preset's decoder embedder, or the checkpoint (default:
    all-MiniLM-L6-v2) as saved; ``--query_prompt`` becomes its 'query' prompt."""
    from sentence_transformers import SentenceTransformer

    if script_args.preset:
        return build_decoder_embedder(script_args, data, device)
    model = SentenceTransformer(script_args.model_path(), device=device)
    model.max_seq_length = script_args.max_seq_length
    if script_args.query_prompt is not None:
        model.prompts = {**(model.prompts or {}), "query": script_args.query_prompt}
    return model


def checkpoint_the_model_itself(model, args) -> None:
    """Turn on the activation checkpointing the arguments ask for on the model itself, and clear
    the flag, where the Trainer's own call would fail: sentence-transformers before 6.2 takes
    nothing but ``gradient_checkpointing_kwargs`` in ``gradient_checkpointing_enable``, and the
    Trainer of newer transformers passes ``every_n_layers`` and ``offload`` too (a TypeError at
    the start of ``train``). Elsewhere the Trainer does it, as usual."""
    if not args.gradient_checkpointing:  # mirrors activation_checkpointing where transformers has both
        return
    parameters = inspect.signature(model.gradient_checkpointing_enable).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "every_n_layers" for p in parameters):
        return
    model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)
    for name in {"gradient_checkpointing", CHECKPOINTING_ARGUMENT}:  # both, where the new name exists
        setattr(args, name, False)


def main(argv=None):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer

    try:  # sentence-transformers >= 6.1 moved it
        from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    except ImportError:
        from sentence_transformers.training_args import BatchSamplers

    from hf_infcl import losses

    script_args, args = parse_arguments(argv)
    script_args.set_output_dir(args, DEFAULT_OUTPUT_DIR)
    resume_from = resume_checkpoint(args)  # the Trainer reads the flag only when train() is handed it
    # In-batch negatives: a batch must not hold the same passage twice (it would be a false negative).
    args.batch_sampler = BatchSamplers.NO_DUPLICATES
    hub = HubPush.checked(args)  # now, not after training; pushed with our card at the end
    args.push_to_hub = False  # the Trainer's own push would upload a second time, with its own card
    started = time.perf_counter()

    data = script_args.load_pairs(seed=args.seed)
    model = load_model(script_args, data, str(args.device))
    checkpoint_the_model_itself(model, args)
    if not args.prompts:  # --prompts, when given, is the Trainer's own and wins in training
        args.prompts = side_prompts(model) or None  # the prompts evaluate_retrieval puts before each side
    train = Dataset.from_dict({"anchor": [q for q, _ in data.train], "positive": [p for _, p in data.train]})
    loss = losses.InfCLLoss(
        model,
        scale=script_args.scale,
        symmetric=script_args.symmetric,
        mini_batch_size=script_args.mini_batch_size,
        no_grad_mini_batch_size=script_args.no_grad_mini_batch_size,
        precision=script_args.precision,
        gather_across_devices=True,  # negatives from every process: the contrastive batch is global
        margin=script_args.margin,
        margin_strategy=script_args.margin_strategy,
    )
    dims = script_args.matryoshka_dims or ()
    if dims:
        from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

        try:  # the widths against the model's, now that it is loaded
            check_matryoshka(dims, None, model.get_embedding_dimension(),
                             names=("--matryoshka_dims", "--matryoshka_weights"))
        except ValueError as error:
            fail(str(error))
        loss = MatryoshkaLoss(model, loss, matryoshka_dims=list(dims))
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss)
    if trainer.is_fsdp_enabled:  # Normalize ends every model here
        leave_parameterless_norms_to_the_fsdp2_root()
    say = print if trainer.is_world_process_zero() else (lambda *a, **k: None)
    world = trainer.accelerator.num_processes
    if script_args.preset:
        backbone = model[0].config
        weights = f"weights of {script_args.model_name_or_path}" if script_args.model_name_or_path else (
            "random weights, a tokenizer trained here")
        parameters = sum(p.numel() for p in model.parameters())
        say(f"preset {script_args.preset}: {backbone.model_type}, {backbone.num_hidden_layers} layers, "
            f"hidden {backbone.hidden_size}, {parameters / 1e6:.1f} M parameters "
            f"({weights}); pooling {model[1].pooling_mode}, mini-batch {script_args.mini_batch_size}")
    say(
        f"{data.description}: {len(data.train)} training pairs, {len(data.held_out)} held out; "
        f"contrastive batch {args.per_device_train_batch_size * world}"
    )

    def evaluate():
        with whole_parameters(model, dtensors=False):  # every process evaluates, so every process gathers
            return evaluate_retrieval(model, data.held_out, script_args.eval_batch_size, dims)

    before, after, train_seconds = train_and_evaluate(trainer, evaluate, say, resume_from)

    with whole_parameters(model):  # gathered by every process, saved by the first
        if trainer.is_world_process_zero():
            # sentence-transformers' card runs the model (FSDP2's hooks would gather on this process
            # alone); the hf_infcl card below replaces it anyway
            model.save_pretrained(args.output_dir, create_model_card=not trainer.is_fsdp_enabled)
    if trainer.is_world_process_zero():
        card_args, card_fields = script_args, {}
        if script_args.preset and not script_args.model_name_or_path:  # no base model: say what was trained
            card_args = replace(script_args, model_name_or_path="")
            card_fields = dict(model_description=f"the {script_args.preset} preset's Qwen3 layout, "
                               "trained from random weights")
        # Replaces sentence-transformers' own README with the hf_infcl card (same metadata style).
        save_results_and_card(
            args, card_args, data, trainer, before=before, after=after, train_seconds=train_seconds,
            **card_fields,
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
