"""torch.compile's marks on our functions, without importing ``torch._dynamo`` at ``import hf_infcl``.

``torch.compiler.disable`` and ``torch.compiler.assume_constant_result`` import ``torch._dynamo``
when they decorate a function, which takes about as long as importing torch itself: as
decorators in the loss's modules they doubled the time of ``import hf_infcl`` for every process,
most of which never compile anything. These two do what they do, and ask ``torch._dynamo`` for
nothing until torch.compile is tracing (and so has imported it).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["constant_when_compiled", "run_eagerly"]


def run_eagerly(fn):
    """``fn`` kept out of torch.compile's graphs, as ``@torch.compiler.disable`` keeps it: traced code
    breaks the graph at the call and runs ``fn`` eagerly (and what it calls). Eager callers call
    ``fn`` itself."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _disabled(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


# torch.compiler.disable(fn) of each function run_eagerly has been traced with (a dict, not
# functools.cache: torch.compile warns about tracing through a cache wrapper)
_DISABLED: dict = {}


def _disabled(fn):
    disabled = _DISABLED.get(fn)
    if disabled is None:
        disabled = _DISABLED[fn] = torch.compiler.disable(fn)
    return disabled


def constant_when_compiled(fn):
    """``torch.compiler.assume_constant_result(fn)``: torch.compile calls ``fn`` once while tracing
    and keeps its result as a constant. That decorator only sets this attribute on ``fn``
    (``tests/test_compile.py`` holds the two to each other)."""
    fn._dynamo_marked_constant = True
    return fn
