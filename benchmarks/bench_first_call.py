"""How long a process's first loss call takes, with and without tuned configurations on disk.

Runs the first call (forward + backward, bf16 unless ``--dtype`` says otherwise, learnable
scale) of a fresh process several times against one tuning store (``HF_INFCL_CACHE``, a new empty
folder): the first process tunes and saves, the later ones load. ``--at-once N`` starts N
processes together instead, as the ranks of a job do on one machine: one tunes, the others wait
for it and load.

    python benchmarks/bench_first_call.py --b 32768 --c 512 --runs 3
    python benchmarks/bench_first_call.py --at-once 2
    python benchmarks/bench_first_call.py --new-triton-cache --warm-start off   # fresh machine, no warm start
    python benchmarks/bench_first_call.py --new-triton-cache --compile-plans off
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FIRST_CALL = """
import sys, time, torch
from hf_infcl import contrastive_loss
b, c, loss = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[sys.argv[5]]
q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=1).to(dtype).requires_grad_(True)
k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=1).to(dtype).requires_grad_(True)
log_scale = torch.tensor(2.3, device="cuda", requires_grad=True)
bias = torch.tensor(-10.0, device="cuda", requires_grad=True) if loss == "sigmoid" else None
torch.cuda.synchronize()
time.sleep(float(sys.argv[4]))  # what a script builds between import and its first step
start = time.perf_counter()
value = contrastive_loss(q, k, log_scale.exp(), bias, loss=loss)
value.backward()
torch.cuda.synchronize()
print(f"FIRST CALL {time.perf_counter() - start:.2f} s")
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=int, default=32768)
    parser.add_argument("--c", type=int, default=512)
    parser.add_argument("--loss", choices=["softmax", "sigmoid"], default="softmax")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                        help="the features' dtype (fp32: TF32 precision, the default)")
    parser.add_argument("--runs", type=int, default=3, help="processes one after the other")
    parser.add_argument("--at-once", type=int, default=1, help="processes started together, per run")
    parser.add_argument("--warm-start", choices=["on", "off"], default="on",
                        help="Triton's per-process setup in a background thread from `import hf_infcl` "
                             "(HF_INFCL_TRITON_WARM_START; on by default)")
    parser.add_argument("--compile-plans", choices=["on", "off"], default="on",
                        help="the shipped compile plans: a first call's kernels compiled in parallel "
                             "before it (HF_INFCL_COMPILE_PLANS; on by default)")
    parser.add_argument("--new-triton-cache", action="store_true",
                        help="a new empty Triton compile cache (TRITON_CACHE_DIR) for these runs, as on a "
                             "fresh machine: the first run compiles every kernel and its launcher")
    parser.add_argument("--setup-seconds", type=float, default=0.0,
                        help="seconds each process waits between creating its inputs and the first call, "
                             "standing in for the model and data a training script builds there")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as store, tempfile.TemporaryDirectory() as triton_cache:
        env = {**os.environ, "HF_INFCL_CACHE": store, "PYTHONPATH": str(ROOT),
               "HF_INFCL_TRITON_WARM_START": "1" if args.warm_start == "on" else "0",
               "HF_INFCL_COMPILE_PLANS": "1" if args.compile_plans == "on" else "0"}
        if args.new_triton_cache:
            env["TRITON_CACHE_DIR"] = triton_cache
        env.pop("HF_INFCL_TRITON_AUTOTUNE", None)
        command = [sys.executable, "-c", FIRST_CALL, str(args.b), str(args.c), args.loss,
                   str(args.setup_seconds), args.dtype]
        for run in range(args.runs):
            start = time.perf_counter()
            processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True) for _ in range(args.at_once)]
            for index, process in enumerate(processes):
                out, err = process.communicate()
                if process.returncode:
                    raise SystemExit(err[-4000:])
                tuned = "tuned" if "hf_infcl: autotuning" in err else "loaded"
                first = [line for line in out.splitlines() if line.startswith("FIRST CALL")][-1]
                # the setup time in every line: with none, the call also waits for Triton's setup
                print(f"run {run} process {index}: {first} ({tuned}; after {args.setup_seconds:g} s of "
                      f"setup); process wall {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
