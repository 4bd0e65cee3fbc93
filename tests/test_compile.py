"""torch.compile: the loss is one custom op in the graph (``fullgraph=True``), and the compiled
values and gradients equal eager ones. The GPU counterpart (Triton kernels, autotuning on) is in
``tests/helpers/gpu_smoke.py``."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from torch import nn

import hf_infcl
from hf_infcl import TorchTiles, contrastive_loss
from hf_infcl.ops import custom_ops  # noqa: F401  (registers torch.ops.hf_infcl)

OPTIONS = {
    "softmax-sym": dict(loss="softmax", symmetric=True),
    "softmax-asym": dict(loss="softmax", symmetric=False),
    "sigmoid": dict(loss="sigmoid", symmetric=False),
}


def _inputs(m=12, k=20, c=7, *, dtype=torch.float64, groups=True, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2**31))
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, dtype=dtype), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(k, c, generator=gen, dtype=dtype), dim=1)
    extra = dict(positives=torch.randperm(k, generator=gen)[:m])
    if groups:
        extra["query_groups"] = torch.randint(0, 4, (m,), generator=gen)
        extra["key_groups"] = torch.randint(0, 4, (k,), generator=gen)
    log_scale = torch.tensor(math.log(float(torch.empty(()).uniform_(3.0, 15.0, generator=gen))), dtype=dtype)
    bias = torch.tensor(float(torch.empty(()).uniform_(-6.0, 0.0, generator=gen)), dtype=dtype)
    return q, keys, log_scale, bias, extra


def _loss_fn(options, extra, backend="auto"):
    def fn(q, k, log_scale, bias):
        return contrastive_loss(q, k, logit_scale=log_scale.exp(),
                                logit_bias=bias if options["loss"] == "sigmoid" else None,
                                backend=backend, **options, **extra)
    return fn


def _value_and_grads(fn, q, k, log_scale, bias):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, log_scale, bias)]
    value = fn(*leaves)
    grads = torch.autograd.grad(value, leaves, allow_unused=True)
    return value.detach(), [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def _assert_same(got, expected, rtol):
    (value, grads), (ref_value, ref_grads) = got, expected
    torch.testing.assert_close(value, ref_value, rtol=rtol, atol=0)
    for name, g, ref in zip(["queries", "keys", "log_scale", "bias"], grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=rtol, atol=rtol * float(ref.abs().max()), msg=name)


@pytest.mark.parametrize("option", [*OPTIONS, "sigmoid-one-pass"])
def test_custom_op_passes_opcheck(option):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of the op
    (for the sigmoid loss also with its gradients computed in the forward)."""
    q, k, log_scale, bias, extra = _inputs(6, 9, 5)
    one_pass = option == "sigmoid-one-pass"
    options = OPTIONS["sigmoid" if one_pass else option]
    sigmoid = options["loss"] == "sigmoid"
    scale = log_scale.exp().detach().requires_grad_(True)
    bias = bias.requires_grad_(True) if sigmoid else None
    args = (q.requires_grad_(True), k.requires_grad_(True), scale, bias, extra["positives"],
            extra["query_groups"], extra["key_groups"], options["loss"], options["symmetric"] and not sigmoid,
            "ieee", one_pass, "torch", False)
    torch.library.opcheck(torch.ops.hf_infcl.logit_stats.default, args)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_custom_op_with_hardness_passes_opcheck(symmetric):
    """The hardness offset's ids, mode and strength as the op's trailing arguments."""
    q, k, log_scale, _, extra = _inputs(6, 9, 5)
    owners = torch.randint(-1, 8, (9,), generator=torch.Generator().manual_seed(1))
    owners[extra["positives"]] = torch.arange(6)
    scale = log_scale.exp().detach().requires_grad_(True)
    args = (q.requires_grad_(True), k.requires_grad_(True), scale, None, extra["positives"],
            extra["query_groups"], extra["key_groups"], "softmax", symmetric, "ieee", False, "torch", False,
            torch.arange(6), owners, "in_batch_negatives", 2.5)
    torch.library.opcheck(torch.ops.hf_infcl.logit_stats.default, args)


def test_fullgraph_compile_with_hardness_equals_eager():
    torch._dynamo.reset()
    q, k, log_scale, bias, extra = _inputs()
    owners = torch.randint(-1, 14, (20,), generator=torch.Generator().manual_seed(2))
    owners[extra["positives"]] = torch.arange(12)
    hardness = dict(hardness_mode="all_negatives", hardness_strength=3.0, query_ids=torch.arange(12),
                    key_owners=owners)
    fn = _loss_fn(OPTIONS["softmax-sym"], {**extra, **hardness})
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = (q, k, log_scale, bias)
    _assert_same(_value_and_grads(compiled, *inputs), _value_and_grads(fn, *inputs), rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_fullgraph_compile_with_label_smoothing_equals_eager_and_cross_entropy(dtype):
    """The smoothing terms (plain ops and RowDots around the custom op) trace into one graph;
    bf16 features take RowDots' sliced upcast."""
    torch._dynamo.reset()
    q, k, log_scale, bias, extra = _inputs(groups=False)
    q, k = q.to(dtype), k.to(dtype)
    fn = _loss_fn(OPTIONS["softmax-sym"], {**extra, "label_smoothing": 0.1})
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = (q, k, log_scale.float() if dtype != torch.float64 else log_scale, bias)
    value, grads = _value_and_grads(compiled, *inputs)
    exact = dtype == torch.float64
    _assert_same((value, grads), _value_and_grads(fn, *inputs), rtol=1e-12 if exact else 1e-6)
    logits = log_scale.exp().double() * q.double() @ k.double().T
    positives = extra["positives"]
    cross_entropy = functools.partial(nn.functional.cross_entropy, label_smoothing=0.1)
    columns = logits[:, positives].T
    expected = (cross_entropy(logits, positives) + cross_entropy(columns, torch.arange(12))) / 2
    torch.testing.assert_close(value.double(), expected, rtol=1e-10 if exact else 1e-5, atol=0)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_fullgraph_compile_equals_eager(option):
    """aot_eager: Dynamo and AOTAutograd see the op and its backward, nothing else runs differently."""
    torch._dynamo.reset()
    q, k, log_scale, bias, extra = _inputs()
    fn = _loss_fn(OPTIONS[option], extra)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = (q, k, log_scale, bias)
    _assert_same(_value_and_grads(compiled, *inputs), _value_and_grads(fn, *inputs), rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("option", ["softmax-sym", "sigmoid"])
def test_inductor_compile_equals_eager(option):
    """The default compiler (Inductor, C++ on CPU) around the op: float32 features."""
    torch._dynamo.reset()
    q, k, log_scale, bias, extra = _inputs(dtype=torch.float32)
    fn = _loss_fn(OPTIONS[option], extra)
    compiled = torch.compile(fn, fullgraph=True)
    inputs = (q, k, log_scale, bias)
    _assert_same(_value_and_grads(compiled, *inputs), _value_and_grads(fn, *inputs), rtol=1e-5)


class _TwoTowerWithLoss(nn.Module):
    """A model whose forward returns the loss, as a user would write it for a compiled step."""

    def __init__(self, width=16, dim=8):
        super().__init__()
        self.image = nn.Linear(width, dim)
        self.text = nn.Linear(width, dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.logit_bias = nn.Parameter(torch.tensor(-2.0))

    def forward(self, images, texts, loss):
        image = torch.nn.functional.normalize(self.image(images), dim=-1)
        text = torch.nn.functional.normalize(self.text(texts), dim=-1)
        bias = self.logit_bias if loss == "sigmoid" else None
        return hf_infcl.contrastive_loss(image, text, self.logit_scale.exp(), bias, loss=loss)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_compiled_model_with_the_loss_in_its_forward(loss):
    torch._dynamo.reset()
    torch.manual_seed(random.randrange(2**31))
    model = _TwoTowerWithLoss()
    images, texts = torch.randn(24, 16), torch.randn(24, 16)
    eager_loss = model(images, texts, loss)
    # (the bias is unused by the softmax loss: its gradient is None in both)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()), allow_unused=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled_loss = compiled(images, texts, loss)
    compiled_grads = torch.autograd.grad(compiled_loss, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
    for got, expected in zip(compiled_grads, eager_grads):
        assert (got is None) == (expected is None)
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_compiled_loss_still_rejects_bad_values():
    """Checks that read values (scale > 0, positives in range) run inside the op when compiled."""
    torch._dynamo.reset()
    q, k, _, _, _ = _inputs(groups=False)

    def fn(q, k, scale, positives):
        return contrastive_loss(q, k, logit_scale=scale, positives=positives)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    good = torch.arange(q.shape[0])
    assert torch.isfinite(compiled(q, k, torch.tensor(5.0, dtype=q.dtype), good))
    with pytest.raises(ValueError, match="logit_scale"):
        compiled(q, k, torch.tensor(-1.0, dtype=q.dtype), good)
    with pytest.raises(ValueError, match="positives"):
        compiled(q, k, torch.tensor(5.0, dtype=q.dtype), good + k.shape[0])


@pytest.mark.parametrize("backend", ["reference", "block-ops-object"])
def test_eager_only_backends_break_the_graph_cleanly(backend):
    """The reference and block-ops objects cannot be op arguments: they run eagerly inside a
    compiled function (a graph break), with the same result."""
    torch._dynamo.reset()
    q, k, log_scale, bias, extra = _inputs()
    block_ops = "reference" if backend == "reference" else TorchTiles(5, 7)
    fn = _loss_fn(OPTIONS["softmax-sym"], extra, backend=block_ops)
    compiled = torch.compile(fn, backend="aot_eager")
    inputs = (q, k, log_scale, bias)
    _assert_same(_value_and_grads(compiled, *inputs), _value_and_grads(fn, *inputs), rtol=1e-12)


def test_compiler_marks_stand_in_for_torchs_decorators():
    """hf_infcl.ops.compiler_marks replaces torch.compiler's decorators, which import torch._dynamo
    as they decorate: the constant mark is the attribute torch's sets, and a function run eagerly
    breaks a compiled function's graph where torch.compiler.disable does, every call running it."""
    from hf_infcl.ops.compiler_marks import constant_when_compiled, run_eagerly

    def ours():
        return True

    def theirs():
        return True

    constant_when_compiled(ours)
    torch._dynamo.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}

    calls = []

    def on_the_host(x):
        calls.append(1)
        return x * float(x.sum())  # a host synchronisation: a graph cannot hold it

    def around(marked, x):
        return marked(x + 1) * 2

    x = torch.arange(3.0)
    for mark in (run_eagerly, torch.compiler.disable):
        torch._dynamo.reset()
        calls.clear()
        fn = functools.partial(around, mark(on_the_host))
        compiled = torch.compile(fn, backend="eager")
        for _ in range(3):
            assert torch.equal(compiled(x), on_the_host(x + 1) * 2)
        assert len(calls) == 6, mark  # three compiled calls, three eager ones
        explained = torch._dynamo.explain(fn)(x)
        assert (explained.graph_count, explained.graph_break_count) == (2, 1), mark


def test_import_hf_infcl_leaves_torch_dynamo_unimported():
    """Importing torch._dynamo takes about as long as importing torch: nothing at import needs it."""
    import subprocess
    import sys

    code = "import sys, hf_infcl; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


OBJECTIVES = {
    "any-sym": dict(options="softmax-sym", group_positives="any"),
    "each-asym-filter": dict(options="softmax-asym", group_positives="each", margin=0.1),
    "sigmoid-any-guide": dict(options="sigmoid", group_positives="any", margin=-0.2, guide=True),
    "filter-guide-sym": dict(options="softmax-sym", margin=0.05, strategy="relative", guide=True),
}


def _objectives(case, m, k, seed=3):
    """contrastive_loss's keyword arguments of an OBJECTIVES case (guide tensors of width 3)."""
    gen = torch.Generator().manual_seed(seed)
    arguments = dict(group_positives=case.get("group_positives"), false_negative_margin=case.get("margin"),
                     false_negative_strategy=case.get("strategy", "absolute"))
    if case.get("guide"):
        arguments.update(guide_queries=torch.randn(m, 3, generator=gen, dtype=torch.float64),
                         guide_keys=torch.randn(k, 3, generator=gen, dtype=torch.float64))
    return arguments


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_custom_op_with_objectives_passes_opcheck(name):
    """The guide tensors, group_positives, margin and strategy as the op's trailing arguments, and
    its outputs for the positive parts and counts."""
    case = OBJECTIVES[name]
    options = OPTIONS[case["options"]]
    q, k, log_scale, bias, extra = _inputs(6, 9, 5)
    sigmoid = options["loss"] == "sigmoid"
    objectives = _objectives(case, 6, 9)
    scale = log_scale.exp().detach().requires_grad_(True)
    bias = bias.requires_grad_(True) if sigmoid else None
    args = (q.requires_grad_(True), k.requires_grad_(True), scale, bias, extra["positives"],
            extra["query_groups"], extra["key_groups"], options["loss"], options["symmetric"] and not sigmoid,
            "ieee", False, "torch", False, None, None, None, 0.0,
            objectives.get("guide_queries"), objectives.get("guide_keys"), objectives["group_positives"],
            objectives["false_negative_margin"], objectives["false_negative_strategy"])
    torch.library.opcheck(torch.ops.hf_infcl.logit_stats.default, args)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_fullgraph_compile_with_objectives_equals_eager(name):
    torch._dynamo.reset()
    case = OBJECTIVES[name]
    q, k, log_scale, bias, extra = _inputs()
    fn = _loss_fn(OPTIONS[case["options"]], {**extra, **_objectives(case, 12, 20)})
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = (q, k, log_scale, bias)
    _assert_same(_value_and_grads(compiled, *inputs), _value_and_grads(fn, *inputs), rtol=1e-12)
