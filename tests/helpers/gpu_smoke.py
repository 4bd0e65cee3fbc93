"""GPU smoke cases, run the way users run: autotuning on, and each case in a fresh process, so
that its first call is the one that tunes.

``python -m tests.helpers.gpu_smoke CASE`` runs one case and prints ``SMOKE OK CASE {details}`` last;
``tests/test_gpu_smoke.py`` (``pytest -m gpu``) launches every case in its own process with
``HF_INFCL_TRITON_AUTOTUNE`` removed from the environment. ``python -m tests.helpers.gpu_smoke --list``
prints the case names.

Cases:
* ``loss-<loss>-<dtype>``: the functional loss with a learnable log-scale (and bias for the
  sigmoid loss) as a model produces them (``log_scale.exp()``), hard negatives and group masks,
  against float64 on the same rounded inputs; no input's version counter may change.
* ``first-sigmoid-step-<m>x<c>``: the first sigmoid call of a process at the sizes where it once
  raised an autograd error (the autotuner wrote into the caller's scale).
* ``compile-<loss>``: ``torch.compile(fullgraph=True)`` around the loss, values and gradients
  equal to eager and to float64.
* ``trainer-<model>-<chunking>``: three bf16 steps of ``InfCLTrainer`` for CLIPModel, SiglipModel,
  Siglip2Model (NaFlex batches, rows of different numbers of patches), DualEncoder, AlignModel (a
  learned temperature, label smoothing) and ClapModel (audio-text, two learned scales), each with
  a learned scale, with and without ``chunk_size`` (the chunks as CUDA graphs, by default, and
  eagerly, ``chunk_cuda_graphs=False``). ALIGN's and
  CLAP's BatchNorm layers are frozen (``freeze_batch_norm``) when chunked: gradient caching refuses
  batch statistics.
* ``accelerate-example``: 20 steps of ``accelerate launch examples/train_clip.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Norm-wise relative tolerances against float64 on the same rounded inputs (fp32 runs on TF32).
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "fp32": 3e-3}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOSSES = {"softmax-sym": ("softmax", True), "softmax-asym": ("softmax", False), "sigmoid": ("sigmoid", False)}


def _features(m, k, c, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(m, c, generator=gen, device="cuda"), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(k, c, generator=gen, device="cuda"), dim=1)
    keys[:m] = torch.nn.functional.normalize(keys[:m] + 0.7 * q, dim=1)  # positives closer, as trained
    groups = (torch.randint(0, m // 4, (m,), generator=gen, device="cuda"),
              torch.randint(0, m // 4, (k,), generator=gen, device="cuda"))
    return q, keys, groups


def _loss_and_grads(q, k, groups, log_scale, bias, loss, symmetric, backend="auto", fn=None):
    """Loss and gradients of (q, k, log_scale[, bias]) with the scale and bias as outputs of
    autograd ops; asserts that no input's version counter changed."""
    from hf_infcl import contrastive_loss

    q = q.detach().requires_grad_(True)
    k = k.detach().requires_grad_(True)
    log_scale = log_scale.detach().requires_grad_(True)
    raw_bias = None if bias is None else bias.detach().requires_grad_(True)
    scale = log_scale.exp()
    bias_input = None if raw_bias is None else raw_bias * 1.0
    owned = [q, k, scale, groups[0], groups[1]] + ([bias_input] if bias_input is not None else [])
    versions = [t._version for t in owned]
    if fn is None:
        value = contrastive_loss(q, k, scale, bias_input, loss=loss, symmetric=symmetric,
                                 query_groups=groups[0], key_groups=groups[1], backend=backend)
    else:
        value = fn(q, k, scale, bias_input, groups[0], groups[1])
    leaves = [q, k, log_scale] + ([raw_bias] if raw_bias is not None else [])
    grads = torch.autograd.grad(value, leaves)
    assert [t._version for t in owned] == versions, "an input tensor was modified in place"
    return [value.detach().double()] + [g.double() for g in grads]


def _relative_errors(got, expected):
    names = ["loss", "queries", "keys", "log_scale", "bias"]
    errors = {}
    for name, g, e in zip(names, got, expected):
        assert torch.isfinite(g).all(), f"{name} is not finite"
        errors[name] = float((g - e).norm() / e.norm().clamp_min(1e-30))
    return errors


def _float64_reference(q, k, groups, log_scale, bias, loss, symmetric, dtype):
    from hf_infcl import TorchTiles

    rounded_q, rounded_k = q.to(dtype).double(), k.to(dtype).double()
    bias = None if bias is None else bias.double()
    return _loss_and_grads(rounded_q, rounded_k, groups, log_scale.double(), bias, loss, symmetric,
                           backend=TorchTiles(4096, 4096))


def run_loss_case(loss_name: str, dtype_name: str, m=3000, k=6000, c=256, seed=None):
    loss, symmetric = LOSSES[loss_name]
    dtype = DTYPES[dtype_name]
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little") % 2**31
    q, keys, groups = _features(m, k, c, seed)
    log_scale = torch.tensor(math.log(14.0), device="cuda")
    bias = torch.tensor(-10.0, device="cuda") if loss == "sigmoid" else None
    got = _loss_and_grads(q.to(dtype), keys.to(dtype), groups, log_scale, bias, loss, symmetric)
    expected = _float64_reference(q, keys, groups, log_scale, bias, loss, symmetric, dtype)
    errors = _relative_errors(got, expected)
    assert max(errors.values()) < TOLERANCE[dtype_name], (seed, errors)
    return {"seed": seed, "errors": errors}


def run_first_sigmoid_step(m: int, c: int):
    """The issue's report, as written: bf16 features, learnable log-temperature and bias."""
    import hf_infcl

    gen = torch.Generator(device="cuda").manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(m, c, device="cuda", generator=gen), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(m, c, device="cuda", generator=gen), dim=-1)
    img = img.bfloat16().requires_grad_(True)
    txt = txt.bfloat16().requires_grad_(True)
    log_t = torch.tensor(math.log(10.0), device="cuda", requires_grad=True)
    bias = torch.tensor(-10.0, device="cuda", requires_grad=True)
    loss = hf_infcl.contrastive_loss(img, txt, logit_scale=log_t.exp(), logit_bias=bias, loss="sigmoid",
                                     symmetric=False)
    grads = torch.autograd.grad(loss, [img, txt, log_t, bias])
    assert all(torch.isfinite(g).all() for g in grads)
    return {"loss": float(loss), "d_log_t": float(grads[2]), "d_bias": float(grads[3])}


def run_compile_case(loss_name: str, m=4096, c=256):
    """fullgraph torch.compile (Inductor) around the loss, bf16, first call compiled."""
    from hf_infcl import contrastive_loss

    loss, symmetric = LOSSES[loss_name]
    seed = int.from_bytes(os.urandom(4), "little") % 2**31
    q, keys, groups = _features(m, m, c, seed)
    log_scale = torch.tensor(math.log(14.0), device="cuda")
    bias = torch.tensor(-10.0, device="cuda") if loss == "sigmoid" else None

    def fn(q, k, scale, bias, query_groups, key_groups):
        return contrastive_loss(q, k, scale, bias, loss=loss, symmetric=symmetric, query_groups=query_groups,
                                key_groups=key_groups)

    compiled = torch.compile(fn, fullgraph=True)
    inputs = (q.bfloat16(), keys.bfloat16(), groups, log_scale, bias, loss, symmetric)
    got = _loss_and_grads(*inputs, fn=compiled)
    eager = _loss_and_grads(*inputs, fn=fn)
    expected = _float64_reference(q, keys, groups, log_scale, bias, loss, symmetric, torch.bfloat16)
    to_eager = _relative_errors(got, eager)
    to_float64 = _relative_errors(got, expected)
    # The same kernels run in both; only the order of the atomic row sums (d bias) may differ.
    assert max(to_eager.values()) < 1e-3, (seed, to_eager)
    assert max(to_float64.values()) < TOLERANCE["bf16"], (seed, to_float64)
    return {"seed": seed, "to_eager": to_eager, "to_float64": to_float64}


# The families whose chunks the Trainer's default CUDA graphs capture with every transformers version
# tested. SigLIP 2's position resizing, and the eager attention masks of ALIGN's and CLAP's text
# towers, copy host tensors to the GPU in some versions (5.17): their default falls back to eager.
GRAPHED_BY_DEFAULT = {"clip", "siglip", "dual-encoder"}


def run_trainer_case(model_name: str, chunk_size: int | None, cuda_graphs: bool | None = None):
    from hf_infcl import InfCLTrainer
    from hf_infcl.batch_statistics import freeze_batch_norm
    from tests.helpers.trainer_fixtures import (
        PairDataset,
        clap_batch,
        clip_batch,
        naflex_batch,
        pair_text_batch,
        tiny_align,
        tiny_clap,
        tiny_clip,
        tiny_dual_encoder,
        tiny_siglip,
        tiny_siglip2,
        trainer_arguments,
    )

    build = {"clip": (tiny_clip, clip_batch), "siglip": (tiny_siglip, clip_batch),
             "siglip2": (tiny_siglip2, naflex_batch),
             "dual-encoder": (lambda: tiny_dual_encoder(learn_scale=True), pair_text_batch),
             "align": (lambda: tiny_align(dropout=0.1), clip_batch),
             "clap": (lambda: tiny_clap(dropout=0.1), clap_batch)}[model_name]
    model = build[0]()
    if chunk_size is not None:
        freeze_batch_norm(model)
    learned = {name: p.detach().clone() for name, p in model.named_parameters()
               if name.split(".")[-1] in ("logit_scale", "log_logit_scale", "logit_bias", "temperature",
                                          "logit_scale_a", "logit_scale_t")}
    assert learned, "the model has no learned scale"
    # bf16=True: every Linear of the towers must run under autocast, in every training path
    linear_dtypes = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, output: linear_dtypes.add(output.dtype))
    with tempfile.TemporaryDirectory() as out:
        args = trainer_arguments(out, use_cpu=False, bf16=True, chunk_size=chunk_size,
                                 chunk_cuda_graphs=cuda_graphs, per_device_train_batch_size=64, max_steps=3,
                                 learning_rate=1e-2)
        trainer = InfCLTrainer(model=model, args=args, train_dataset=PairDataset(build[1](192)))
        trainer.train()
    graphs = trainer._chunk_graphs
    if chunk_size is None or cuda_graphs is False:
        assert graphs is None
    elif model_name in GRAPHED_BY_DEFAULT:  # 4 chunks of 16 per step: the no-grad chunk and the replay
        assert graphs is not None and graphs.failure is None and graphs.captured == 2, (
            graphs and (graphs.captured, graphs.failure))
    else:  # captured, or after a failed capture the eager fallback (its warning) trained the steps
        assert graphs is not None, model_name
        assert graphs.captured == 2 or graphs.failure.startswith("capturing a CUDA graph"), graphs.failure
    assert linear_dtypes == {torch.bfloat16}, f"bf16=True but Linear layers gave {linear_dtypes}"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(value) for value in losses), losses
    parameters = dict(model.named_parameters())
    moved = {name: not torch.equal(parameters[name].detach().cpu(), before.cpu())
             for name, before in learned.items()}
    assert all(moved.values()), f"learned scale/bias did not train: {moved}"
    assert next(model.parameters()).device.type == "cuda"
    return {"losses": losses, "graphs": graphs and (graphs.failure or f"{graphs.captured} captured")}


def run_accelerate_example():
    with tempfile.TemporaryDirectory() as out:
        command = ["accelerate", "launch", "--num_processes", "1", "examples/train_clip.py",
                   "--max_steps", "20", "--output_dir", out]
        # (an installed hf_infcl is found as is; a checkout is found through PYTHONPATH)
        path = [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        saved = sorted(path.name for path in Path(out).rglob("*") if path.is_file())
    assert any(name.endswith(".safetensors") for name in saved), saved
    return {"tail": result.stdout.strip().splitlines()[-3:]}


def _cases():
    cases = {}
    for loss_name in LOSSES:
        for dtype_name in DTYPES:
            cases[f"loss-{loss_name}-{dtype_name}"] = (run_loss_case, (loss_name, dtype_name))
    for m, c in ((8192, 768), (32768, 768)):
        cases[f"first-sigmoid-step-{m}x{c}"] = (run_first_sigmoid_step, (m, c))
    for loss_name in ("softmax-sym", "sigmoid"):
        cases[f"compile-{loss_name}"] = (run_compile_case, (loss_name,))
    model_names = ["clip", "siglip", "siglip2", "dual-encoder", "align", "clap"]
    for model_name in model_names:
        for chunk_size in (None, 16):
            name = f"trainer-{model_name}-" + ("whole-batch" if chunk_size is None else f"chunk{chunk_size}")
            cases[name] = (run_trainer_case, (model_name, chunk_size))
        cases[f"trainer-{model_name}-chunk16-eager"] = (run_trainer_case, (model_name, 16, False))
    cases["accelerate-example"] = (run_accelerate_example, ())
    return cases


CASES = _cases()


def main(argv):
    if argv == ["--list"]:
        print("\n".join(CASES))
        return
    (name,) = argv
    function, arguments = CASES[name]
    details = function(*arguments)
    print(f"SMOKE OK {name} {json.dumps(details)}")


if __name__ == "__main__":
    main(sys.argv[1:])
