"""``scripts/tune_shipped.py`` on CPU: its cases, its options' checks, and the merge of a tuning
store's file into the shipped one (the tuning itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tune_shipped.py"
spec = importlib.util.spec_from_file_location("tune_shipped", SCRIPT)
tune_shipped = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tune_shipped)


def test_the_cases_are_every_combination_smaller_sizes_first(capsys):
    assert tune_shipped.main(["--dry-run", "--widths", "512,768", "--dtypes", "bf16", "--losses", "sigmoid",
                              "--size-classes", "2,1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["sigmoid 512 bf16 2", "sigmoid 768 bf16 2", "sigmoid 512 bf16 1", "sigmoid 768 bf16 1",
                     "4 cases"]
    assert len(tune_shipped.cases(tune_shipped.WIDTHS, list(tune_shipped.DTYPES), tune_shipped.LOSSES,
                                  tune_shipped.SIZES)) == 9 * 3 * 3 * 2


def test_the_size_classes_hold_the_kernels_classes():
    from hf_infcl.ops.triton.launch import problem_size_class

    for size_class, rows in tune_shipped.SIZES.items():
        assert problem_size_class(rows, rows) == size_class


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtypes", "fp8"], "--dtypes: unknown \\['fp8'\\]"),
    (["--losses", "hinge"], "--losses: unknown \\['hinge'\\]"),
    (["--size-classes", "3"], "--size-classes: unknown \\[3\\]"),
    (["--size-classes", "0"], "--size-classes: unknown \\[0\\]"),  # tiny problems are not tuned
    (["--widths", "0"], "--widths must be positive"),
    (["--merge-only"], "--merge-only needs --store"),
])
def test_bad_options_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        tune_shipped.parse_options(argv)
    assert re.search(message, capsys.readouterr().err)


def test_merge_only_merges_every_file_of_the_store_without_a_gpu(tmp_path, capsys):
    """A store tuned during other runs (each file one GPU name and Triton version) merges into the
    shipped files of the same names; an empty store is an error."""
    entry = {"kwargs": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, "num_warps": 4, "num_stages": 4}
    folders = ["--store", str(tmp_path / "store"), "--shipped", str(tmp_path / "shipped")]
    assert tune_shipped.main(folders + ["--merge-only"]) == 1
    assert "nothing tuned" in capsys.readouterr().err
    (tmp_path / "store" / "autotune").mkdir(parents=True)
    for name in ("NVIDIA-H200--triton-3.6.0.json", "NVIDIA-H100-80GB-HBM3--triton-3.6.0.json"):
        (tmp_path / "store" / "autotune" / name).write_text(json.dumps({"stats-r5": {"(384, 2)": entry}}))
    assert tune_shipped.main(folders + ["--merge-only"]) == 0
    shipped = sorted(path.name for path in (tmp_path / "shipped").glob("*.json"))
    assert shipped == ["NVIDIA-H100-80GB-HBM3--triton-3.6.0.json", "NVIDIA-H200--triton-3.6.0.json"]
    assert json.loads((tmp_path / "shipped" / shipped[1]).read_text()) == {"stats-r5": {"(384, 2)": entry}}


def test_merge_adds_and_replaces_entries_and_keeps_the_others(tmp_path):
    entry = {"kwargs": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, "num_warps": 4, "num_stages": 4}
    other = {**entry, "num_warps": 8}
    store, shipped = tmp_path / "store.json", tmp_path / "shipped" / "gpu.json"
    store.write_text(json.dumps({"stats-r5": {"(512, 2)": entry, "(768, 2)": other}}))
    assert tune_shipped.merge(store, shipped) == 2
    assert tune_shipped.merge(store, shipped) == 0  # nothing new
    store.write_text(json.dumps({"stats-r5": {"(768, 2)": entry}, "grad_tile-r5": {"(768, 2)": entry}}))
    assert tune_shipped.merge(store, shipped) == 2
    assert json.loads(shipped.read_text()) == {"stats-r5": {"(512, 2)": entry, "(768, 2)": entry},
                                               "grad_tile-r5": {"(768, 2)": entry}}


@pytest.mark.gpu
def test_one_case_tunes_and_ships_both_kernels(tmp_path):
    case = ["--widths", "256", "--dtypes", "bf16", "--losses", "softmax", "--size-classes", "1"]
    folders = ["--store", str(tmp_path / "store"), "--shipped", str(tmp_path / "shipped")]
    assert tune_shipped.main(case + folders) == 0
    (shipped,) = (tmp_path / "shipped").glob("*.json")
    assert {kernel.split("-r")[0] for kernel in json.loads(shipped.read_text())} >= {"stats", "grad_tile"}
