"""What an install brings: Triton only where it is needed, and the library whole without it.

CUDA builds of torch bring Triton; a CPU-only install must not download it for kernels it cannot
run. Without Triton, hf_infcl imports and its PyTorch backends compute the loss.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.helpers.offline import offline_env

ROOT = Path(__file__).resolve().parent.parent


def requirement_names(requirements: list[str]) -> set[str]:
    return {Requirement(requirement).name.lower() for requirement in requirements}


def test_triton_is_an_extra_not_a_dependency():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert "triton" not in requirement_names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "triton" in requirement_names(extras["triton"])
    assert "triton" in requirement_names(extras["dev"])  # the tests run the kernels under the interpreter
    assert "-e \".[dev]\"" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


# As if Triton were not installed: every import of it, direct or probed, fails.
HIDE_TRITON = '''
import sys

class HideTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideTriton())
'''

# The package of the fused kernels: the only one that imports Triton when it is imported.
TRITON_PACKAGE = "hf_infcl.ops.triton"

WITHOUT_TRITON = HIDE_TRITON + '''
import importlib
import pkgutil

import torch

import hf_infcl
from hf_infcl.ops.logit_stats import backend_name

triton_package = sys.argv[1]
for module in pkgutil.walk_packages(hf_infcl.__path__, "hf_infcl."):
    if not module.name.startswith(triton_package):
        importlib.import_module(module.name)
        continue
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as error:
        assert error.name.split(".")[0] == "triton", error
    else:
        raise AssertionError(f"{module.name} imports without Triton")

assert backend_name("auto", torch.device("cpu")) == "torch"
generator = torch.Generator().manual_seed(11)
for loss in ("softmax", "sigmoid"):
    bias = -2.0 if loss == "sigmoid" else None
    inputs = [torch.randn(9, 5, generator=generator, dtype=torch.float64).requires_grad_() for _ in "qk"]
    expected = hf_infcl.contrastive_loss(*inputs, 3.0, bias, loss=loss, backend="reference")
    expected_grads = torch.autograd.grad(expected, inputs)
    for backend in ("auto", "torch"):
        got = hf_infcl.contrastive_loss(*inputs, 3.0, bias, loss=loss, backend=backend)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
        for grad, expected_grad in zip(torch.autograd.grad(got, inputs), expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "triton")
assert not loaded, loaded
print("computed without triton")
'''


def test_the_library_imports_and_computes_without_triton(tmp_path):
    """Every module outside the Triton package imports, the Triton package says it needs Triton,
    and the PyTorch backends equal the reference."""
    script = tmp_path / "without_triton.py"
    script.write_text(WITHOUT_TRITON, encoding="utf-8")
    env = offline_env(tmp_path)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, str(script), TRITON_PACKAGE], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "computed without triton" in result.stdout, output[-6000:]


def test_the_blocker_hides_triton(tmp_path):
    """The test above would pass vacuously if the blocker let Triton through."""
    script = tmp_path / "import_triton.py"
    script.write_text(HIDE_TRITON + "import triton\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=offline_env(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "No module named 'triton'" in result.stderr, result.stderr[-2000:]


TRITON_ROUTE = HIDE_TRITON + '''
import pytest
import torch

import hf_infcl
from hf_infcl.ops.logit_stats import backend_name

with pytest.raises(ImportError, match="pip install"):
    backend_name("triton", torch.device("cuda"))
assert backend_name("auto", torch.device("cuda")) == "torch"
with pytest.raises(ImportError):
    hf_infcl.TritonBlocks
hf_infcl.reset_autotuning()
print("triton route refused")
'''


def test_the_triton_route_says_it_needs_triton(tmp_path):
    """``backend="triton"`` and ``hf_infcl.TritonBlocks`` raise ImportError naming the install;
    ``"auto"`` falls back to the torch backend, on CUDA too; ``reset_autotuning`` is a no-op."""
    script = tmp_path / "triton_route.py"
    script.write_text(TRITON_ROUTE, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=offline_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "triton route refused" in result.stdout, result.stderr[-3000:]
