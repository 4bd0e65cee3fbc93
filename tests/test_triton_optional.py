"""Triton is optional: without it ``import hf_infcl`` and the torch backends work, and only the
Triton route (``hf_infcl.ops.triton``) says that it needs Triton.

Each check runs in a fresh interpreter whose imports of ``triton`` fail (a meta-path finder
that refuses the package), as on a machine where it is not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WITHOUT_TRITON = """
import importlib.abc
import sys


class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
"""


def run_without_triton(code: str) -> subprocess.CompletedProcess:
    script = WITHOUT_TRITON + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_torch_backends_work_without_triton():
    """``import hf_infcl``, the loss on the ``"auto"`` and ``"torch"`` backends against the
    reference, ``reset_autotuning()``: none of them needs Triton."""
    result = run_without_triton("""
        import torch

        import hf_infcl
        from hf_infcl import InfCLLoss, TorchTiles, contrastive_loss, reset_autotuning

        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
        queries = torch.randn(7, 5, generator=gen, dtype=torch.float64)
        keys = torch.randn(9, 5, generator=gen, dtype=torch.float64)
        expected = contrastive_loss(queries, keys, 3.0, backend="reference")
        for backend in ("auto", "torch", TorchTiles(4, 4)):
            value = contrastive_loss(queries, keys, 3.0, backend=backend)
            torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(InfCLLoss()(queries, keys, 3.0), expected, rtol=1e-12, atol=1e-12)
        reset_autotuning()
        print("ok")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_the_triton_route_says_it_needs_triton():
    """``backend="triton"`` raises an ImportError that names the install command (``"auto"``
    falls back to the torch backend, on CUDA too); ``hf_infcl.TritonBlocks`` and importing the
    Triton folder raise ImportError, not another error."""
    result = run_without_triton("""
        import pytest
        import torch

        import hf_infcl
        from hf_infcl.loss import backend_name

        with pytest.raises(ImportError, match="pip install triton"):
            backend_name("triton", torch.device("cuda"))
        assert backend_name("auto", torch.device("cuda")) == "torch"
        with pytest.raises(ImportError):
            hf_infcl.TritonBlocks
        with pytest.raises(ImportError):
            import hf_infcl.ops.triton  # noqa: F401
        print("ok")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
