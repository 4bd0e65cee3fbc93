"""benchmarks/bench_batch_scaling.py and its data: the dictd reader on a dictionary the test writes,
the merge and the split by word, the batches without a passage twice, the evaluation against a
float64 reference, and the CPU smoke run end to end (CSV rows appended across calls, the table, the
plot)."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import os
import random
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")
sys.path.insert(0, BENCHMARKS)

import bench_batch_scaling as study  # noqa: E402  (benchmarks/ is put on the path above)
import dictionary_pairs as dictionary  # noqa: E402

BASE64 = dictionary.BASE64_DIGITS


def encode_number(value: int) -> str:
    digits = ""
    while True:
        digits = BASE64[value % 64] + digits
        value //= 64
        if value == 0:
            return digits


def write_dictd(folder, entries, name="gcide", compress=False, extra_index=()):
    """A dictd dictionary of ``entries`` (entry texts, each indexed by its first word) in ``folder``;
    ``extra_index``: more (word, entry number) lines pointing at entries already written."""
    data, index = b"", []
    for text in entries:
        raw = text.encode("utf-8")
        index.append((text.split(" ", 1)[0].lower(), len(data), len(raw)))
        data += raw
    index += [(word, index[number][1], index[number][2]) for word, number in extra_index]
    index = [("00-database-info", 0, 5)] + index
    with open(os.path.join(folder, f"{name}.index"), "w", encoding="utf-8") as handle:
        for word, offset, length in index:
            handle.write(f"{word}\t{encode_number(offset)}\t{encode_number(length)}\n")
    if compress:
        with gzip.open(os.path.join(folder, f"{name}.dict.dz"), "wb") as handle:
            handle.write(data)
    else:
        with open(os.path.join(folder, f"{name}.dict"), "wb") as handle:
            handle.write(data)


ALLOCATE = (
    'Allocate \\Al"lo*cate\\, v. t. [LL. allocatus, p. p. of allocare,\n'
    "   fr. L. ad + locare to place. See {Allow}.]\n"
    "   1. To distribute or assign; to allot. --Burke.\n"
    "      [1913 Webster]\n\n"
    "   2. To localize. [R.]\n"
    "      [1913 Webster]\n\n"
    "   Syn: allot, assign.\n"
    "        [WordNet 1.5]\n\n"
)
ALLNIGHT = (
    'Allnight \\All"night`\\, n.\n   Light, fuel, or food for the whole night. [Obs.] --Bacon.\n'
    "   [1913 Webster]\n\n"
)
HUANACO = 'Huanaco \\Hua*na"co\\, n.\n   See Guanaco.\n\n'


@pytest.mark.parametrize("compress", [False, True])
def test_dictd_reader_gives_each_sense_once_without_sources_or_citations(tmp_path, compress):
    write_dictd(
        tmp_path,
        [ALLOCATE, ALLNIGHT, HUANACO],
        compress=compress,
        extra_index=[("allot", 0), ("allnight", 1)],
    )
    assert list(dictionary.gcide_pairs(str(tmp_path))) == [
        ("To distribute or assign; to allot.", "allocate"),
        ("To localize.", "allocate"),
        ("Light, fuel, or food for the whole night.", "allnight"),
    ]
    assert dictionary.find_gcide_dir(str(tmp_path)) == str(tmp_path)


def test_dictd_numbers_and_bad_input():
    assert dictionary.decode_dictd_number("Bfk") == 6116
    assert all(dictionary.decode_dictd_number(encode_number(n)) == n for n in (0, 1, 63, 64, 4095, 10**7))
    with pytest.raises(ValueError, match="dictd base64"):
        dictionary.decode_dictd_number("B-k")
    with pytest.raises(FileNotFoundError, match="--gcide-dir"):
        dictionary.find_gcide_dir("/nonexistent")


def test_merge_keeps_the_first_of_each_normalised_definition():
    first = [("A small dog.", "puppy"), ("to run fast", "sprint")]
    second = [("a  small DOG", "whelp"), ("To run, fast!", "dash"), ("a large cat", "lion")]
    assert dictionary.merge_pairs(first, second) == [
        ("A small dog.", "puppy"),
        ("to run fast", "sprint"),
        ("a large cat", "lion"),
    ]


def synthetic_pairs(n_words=70, seed=0):
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(60)]
    pairs = []
    for index in range(n_words):
        word = f"head{index}"
        synonyms = [word] + ([f"head{rng.randrange(n_words)}"] if rng.random() < 0.2 else [])
        for _ in range(rng.randint(1, 3)):
            pairs.append((" ".join(rng.choices(vocabulary, k=8)), ", ".join(dict.fromkeys(synonyms))))
    return pairs


def test_split_by_word_keeps_every_held_out_word_out_of_training():
    pairs = synthetic_pairs()
    split = dictionary.split_by_word(pairs, 30, seed=1)
    held_words = {w for _, p in split.held_out for w in dictionary.passage_words(p)}
    train_words = {w for _, p in split.train for w in dictionary.passage_words(p)}
    assert len(split.held_out) >= 30 and split.train
    assert held_words.isdisjoint(train_words)
    assert len(split.train) + len(split.held_out) + split.dropped == len(pairs)
    assert set(split.candidates()) == {p for _, p in split.train + split.held_out}
    with pytest.raises(ValueError, match="--held-out-pairs"):
        dictionary.split_by_word(pairs, 0)


def test_batches_never_hold_a_passage_twice_and_are_all_about_full():
    passages = [p for _, p in synthetic_pairs()]  # up to three senses a word
    batches = study.no_duplicate_batches(passages, 16, random.Random(0))
    assert len(batches) == -(-len(passages) // 16)
    for batch in batches:
        assert len({passages[i] for i in batch}) == len(batch) <= 16
    assert max(map(len, batches)) - min(map(len, batches)) <= 1
    assert sorted(i for batch in batches for i in batch) == list(range(len(passages)))


def test_a_word_with_more_senses_than_batches_trains_on_as_many():
    passages = ["run"] * 5 + [f"w{i}" for i in range(7)]
    batches = study.no_duplicate_batches(passages, 6, random.Random(0))
    assert len(batches) == 2 and [sum(passages[i] == "run" for i in b) for b in batches] == [1, 1]
    assert sum(map(len, batches)) == 9


def test_cap_senses_keeps_at_most_that_many_per_word():
    pairs = [(f"sense {i}", "run") for i in range(10)] + [("a pace", "walk")]
    capped = dictionary.cap_senses(pairs, 4, seed=3)
    assert sum(p == "run" for _, p in capped) == 4 and ("a pace", "walk") in capped
    assert capped == [pair for pair in pairs if pair in capped]  # the order kept
    with pytest.raises(ValueError, match="--max-senses"):
        dictionary.cap_senses(pairs, 0)


def smoke_arguments(folder, csv_path, *extra):
    return [
        "--smoke",
        "--sources",
        "gcide",
        "--gcide-dir",
        str(folder),
        "--held-out-pairs",
        "20",
        "--mini-batch-size",
        "8",
        "--base-lr",
        "1e-3",
        "--csv",
        str(csv_path),
        *extra,
    ]


def dictionary_entries(pairs):
    by_word = {}
    for definition, passage in pairs:
        by_word.setdefault(passage.split(",")[0], []).append(definition)
    return [
        f"{word} \\{word}\\, n.\n" + "".join(f"   {n}. {d}.\n\n" for n, d in enumerate(senses, 1))
        for word, senses in by_word.items()
    ]


def test_min_steps_trains_whole_epochs_until_the_steps_are_reached(tmp_path, capsys):
    """--min-steps: a batch whose epoch has fewer steps trains more whole epochs; one whose epoch has
    enough trains --epochs; the row says what it did, and the table labels the runs by their epochs."""
    write_dictd(tmp_path, dictionary_entries(synthetic_pairs()))
    rows_path = tmp_path / "rows.csv"
    study.main(smoke_arguments(tmp_path, rows_path, "--batches", "8,64", "--min-steps", "6"))
    with open(rows_path, newline="") as handle:
        small, large = list(csv.DictReader(handle))
    train_pairs = int(small["train_pairs"])
    per_epoch = -(-train_pairs // 64)  # steps of one epoch at 64
    assert (small["epochs"], small["min_steps"]) == ("1", "6") and int(small["steps"]) == -(-train_pairs // 8)
    assert int(large["epochs"]) == -(-6 // per_epoch) > 1
    assert int(large["steps"]) == int(large["epochs"]) * per_epoch
    capsys.readouterr()
    study.main(["--table", "--csv", str(rows_path)])
    table = capsys.readouterr().out
    assert f"| infcl, {large['epochs']} epochs | 64 |" in table and "| infcl | 8 |" in table


def test_a_pairs_file_gives_the_split_the_dictionaries_give(tmp_path, capsys):
    """--save-pairs writes the merged pairs (for a machine without the dictionaries); --pairs-file
    reads them back, and the split is the one the dictionaries give."""
    write_dictd(tmp_path, dictionary_entries(synthetic_pairs()))
    pairs_path = tmp_path / "pairs.jsonl.gz"
    study.main(smoke_arguments(tmp_path, tmp_path / "rows.csv", "--save-pairs", str(pairs_path)))
    assert "merged pairs to" in capsys.readouterr().out
    assert not (tmp_path / "rows.csv").exists()  # nothing trained
    from_dictionaries = study.load_split(study.parse_arguments(smoke_arguments(tmp_path, tmp_path / "a.csv")),
                                         log=lambda _: None)
    from_file = study.load_split(
        study.parse_arguments(smoke_arguments(tmp_path, tmp_path / "b.csv", "--pairs-file", str(pairs_path))),
        log=lambda _: None)
    assert from_file == from_dictionaries and len(from_file.train) > 80
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as handle:
        handle.write('["a definition", "word"]\n["only one"]\n')
    with pytest.raises(ValueError, match="line 2"):
        dictionary.read_pairs(str(tmp_path / "bad.jsonl.gz"))


def test_evaluation_matches_a_float64_reference(tmp_path):
    write_dictd(tmp_path, dictionary_entries(synthetic_pairs()))
    args = study.parse_arguments(smoke_arguments(tmp_path, tmp_path / "rows.csv"))
    split = study.load_split(args, log=lambda _: None)
    texts = [t for pair in split.train + split.held_out for t in pair]
    model, _ = study.load_model(args, texts, torch.device("cpu"))
    metrics = study.evaluate(model, split, batch_size=7)
    candidates = split.candidates()
    queries = model.encode([d for d, _ in split.held_out], batch_size=7, convert_to_tensor=True).double()
    keys = model.encode(candidates, batch_size=7, convert_to_tensor=True).double()
    queries, keys = (torch.nn.functional.normalize(x, dim=1) for x in (queries, keys))
    scores = queries @ keys.T
    answer = torch.tensor([candidates.index(p) for _, p in split.held_out])
    positive = scores[torch.arange(len(answer)), answer]
    scores[torch.arange(len(answer)), answer] = -torch.inf
    rank = (scores >= positive[:, None]).sum(dim=1)  # ties count against the answer
    assert metrics["recall@1"] == pytest.approx(float((rank < 1).double().mean()), abs=1e-12)
    assert metrics["recall@10"] == pytest.approx(float((rank < 10).double().mean()), abs=1e-12)
    assert metrics["mrr"] == pytest.approx(float((1 / (rank.double() + 1)).mean()), abs=1e-5)


def test_smoke_run_appends_rows_and_writes_the_table_and_plot(tmp_path, capsys):
    write_dictd(tmp_path, dictionary_entries(synthetic_pairs()), compress=True)
    rows_path = tmp_path / "rows.csv"
    study.main(smoke_arguments(tmp_path, rows_path, "--batches", "0,8,16"))
    study.main(smoke_arguments(tmp_path, rows_path, "--batches", "16", "--loss", "cached-mnrl"))
    with open(rows_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    # a second call's file (another GPU call's) combines with the first in the table
    other_path = tmp_path / "other.csv"
    study.append_row(str(other_path), {**rows[2], "batch": "32", "steps": "4"})
    assert [(row["loss"], row["batch"]) for row in rows] == [
        ("untrained", "0"),
        ("infcl", "8"),
        ("infcl", "16"),
        ("cached-mnrl", "16"),
    ]
    for row in rows:
        assert all(0 <= float(row[m]) <= 1 for m in ("recall@1", "recall@10", "mrr"))
        assert int(row["held_out_pairs"]) >= 20 and int(row["train_pairs"]) > 80
    assert float(rows[1]["learning_rate"]) == pytest.approx(1e-3 * (8 / 256) ** 0.5)
    train_pairs = int(rows[1]["train_pairs"])
    assert [int(row["steps"]) for row in rows[:3]] == [0, -(-train_pairs // 8), -(-train_pairs // 16)]
    assert rows[0]["seconds_per_epoch"] == "" and float(rows[1]["seconds_per_epoch"]) > 0
    # both losses are the same objective on the same batches: the same model comes out (fp32, no dropout)
    for metric in ("recall@1", "recall@10", "mrr"):
        assert float(rows[3][metric]) == pytest.approx(float(rows[2][metric]), abs=1e-4)
    assert float(rows[2]["mrr"]) != float(rows[0]["mrr"])  # training changed the model

    capsys.readouterr()
    study.main(["--table", "--csv", str(rows_path), str(other_path)])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| loss | batch |") and len(table) == 2 + 5
    assert any(line.startswith("| infcl | 32 | 1 | 4 |") for line in table)
    assert any(line.startswith("| cached-mnrl | 16 |") for line in table)
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the plot is not checked")
    plot = tmp_path / "plot.png"
    study.main(["--plot", str(plot), "--csv", str(rows_path), str(other_path)])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "variant, label",
    [
        (["--margin", "0.1"], "infcl, margin 0.1"),
        (["--guide", "initial", "--margin", "0.05"], "infcl, margin 0.05, guide initial"),
    ],
)
def test_the_filter_variants_run_and_are_told_apart_in_the_table(tmp_path, variant, label, capsys):
    write_dictd(tmp_path, dictionary_entries(synthetic_pairs()))
    rows_path = tmp_path / "rows.csv"
    study.main(smoke_arguments(tmp_path, rows_path, "--batches", "16", *variant))
    (row,) = study.read_rows(str(rows_path))
    assert study.variant(row) == label and 0 < float(row["mrr"]) <= 1
    capsys.readouterr()
    study.main(["--table", "--csv", str(rows_path)])
    assert f"| {label} | 16 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--batches", "1"], "--batches"),
        (["--batches", "4x"], "--batches"),
        (["--epochs", "0"], "--epochs"),
        (["--min-steps", "0"], "--min-steps"),
        (["--sources", "web"], "--sources"),
        (["--loss", "cached-mnrl", "--margin", "0.1"], "--margin"),
        (["--table", "--csv", "/nonexistent.csv"], "--table"),
        (["--csv", "a.csv", "b.csv"], "--csv"),
        (["--pairs-file", "/nonexistent.jsonl.gz"], "--pairs-file"),
        (["--save-pairs", "a.gz", "--pairs-file", __file__], "--save-pairs"),
    ],
)
def test_bad_arguments_name_their_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        study.parse_arguments(argv)
    assert flag in capsys.readouterr().err


def test_a_csv_of_other_columns_is_refused_before_any_work(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="--csv"):
        study.check_csv_columns(str(other))
