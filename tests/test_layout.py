"""The package's shape, as its readers meet it: one import path per public name, and no function
outside the Triton kernels longer than a screen."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import hf_infcl

PACKAGE = Path(hf_infcl.__file__).resolve().parent
KERNELS = PACKAGE / "ops" / "triton"  # kernels and their launchers: long by nature
MAX_FUNCTION_LINES = 80  # signature and body; a public function's argument docs are not logic


def modules_outside_the_kernels() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(hf_infcl.__path__, "hf_infcl.")
            if not info.name.startswith("hf_infcl.ops.triton")]


@pytest.mark.parametrize("module_name", modules_outside_the_kernels())
def test_each_module_exports_only_what_it_defines(module_name):
    """A class or function in a module's ``__all__`` is defined there: no module re-exports
    another's names, so each has one import path (the package's lazy top-level names aside)."""
    if module_name == "hf_infcl.losses":
        pytest.importorskip("sentence_transformers")
    module = importlib.import_module(module_name)
    borrowed = [name for name in getattr(module, "__all__", ())
                if (inspect.isclass(obj := getattr(module, name)) or inspect.isfunction(obj))
                and obj.__module__ != module_name]
    assert not borrowed, f"{module_name} re-exports {borrowed}"


def test_no_function_outside_the_kernels_is_longer_than_a_screen():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if KERNELS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines: " + ", ".join(long)


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0
