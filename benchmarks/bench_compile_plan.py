"""What a fresh machine's first call would take if its kernels were compiled in parallel up front.

An experiment for the first-call aim (≤ 3 s on a fresh H100 or H200), not a feature: a first
process, with an empty Triton cache, records the specialisation of every kernel its first call
(softmax, forward + backward, bf16) compiles, through Triton's ``jit_post_compile_hook``. A second
process, with another empty Triton cache, compiles all of them first, one thread each
(``JITFunction.preload``, then the launcher), and then makes the same call. A shipped "compile
plan" per GPU and width could do the same inside the package.

    python benchmarks/bench_compile_plan.py --b 32768 --c 512
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROCESS = r"""
import importlib, json, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
from triton import knobs
from hf_infcl import contrastive_loss

mode, plan_path = sys.argv[1], sys.argv[2]
b, c, setup = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=1).bfloat16().requires_grad_(True)
k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=1).bfloat16().requires_grad_(True)
log_scale = torch.tensor(2.3, device="cuda", requires_grad=True)
torch.cuda.synchronize()
time.sleep(setup)  # what a script builds between import and its first step
recorded = []


def record(**kwargs):
    function = kwargs["fn"].jit_function.fn
    recorded.append({"module": function.__module__, "name": function.__name__,
                     "specialization": kwargs["compile"]["specialization_data"]})


def build(entry):
    torch.cuda.set_device(q.device)
    started = time.perf_counter()
    kernel = getattr(importlib.import_module(entry["module"]), entry["name"]).preload(entry["specialization"])
    kernel = kernel.result() if hasattr(kernel, "result") else kernel
    kernel._init_handles()  # the launcher (gcc on Triton 3.6) and the module load
    return entry["name"], time.perf_counter() - started


if mode == "record":
    knobs.runtime.jit_post_compile_hook = record
start = time.perf_counter()
if mode == "replay":
    plan = json.load(open(plan_path))
    with ThreadPoolExecutor(len(plan)) as pool:
        built = list(pool.map(build, plan))
    print(f"compiled {len(plan)} kernels in parallel in {time.perf_counter() - start:.2f} s: "
          + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in built))
call = time.perf_counter()
contrastive_loss(q, k, log_scale.exp()).backward()
torch.cuda.synchronize()
end = time.perf_counter()
print(f"{mode}: first call {end - call:.2f} s, with the compiles before it {end - start:.2f} s")
if mode == "record":
    json.dump(recorded, open(plan_path, "w"))
    print("recorded:", ", ".join(entry["name"] for entry in recorded))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=int, default=32768)
    parser.add_argument("--c", type=int, default=512)
    parser.add_argument("--setup-seconds", type=float, default=2.0,
                        help="seconds between making the inputs and the first call (see bench_first_call.py)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        plan = os.path.join(work, "plan.json")
        for mode in ("record", "replay"):
            env = {**os.environ, "PYTHONPATH": str(ROOT),
                   "TRITON_CACHE_DIR": os.path.join(work, f"triton_{mode}"),  # empty: a fresh machine's
                   "HF_INFCL_CACHE": os.path.join(work, f"store_{mode}")}
            env.pop("HF_INFCL_TRITON_AUTOTUNE", None)
            done = subprocess.run([sys.executable, "-c", PROCESS, mode, plan, str(args.b), str(args.c),
                                   str(args.setup_seconds)], env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr[-4000:])
            print(done.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
