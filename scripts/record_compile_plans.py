"""Record the compile plans of the common first calls on this GPU into the package's shipped plans
(``hf_infcl/ops/triton/shipped_compile_plans/``), so that a first call on a fresh machine with this
GPU and Triton release compiles its kernels in parallel (``hf_infcl/ops/triton/compile_plans.py``).

One case is a loss, a width c, a dtype and a size class, the cases of ``scripts/tune_shipped.py``
plus the tiny class 0: the first call (forward and backward of ``hf_infcl.contrastive_loss`` on
L2-normalised random features, learnable scale, and bias for the sigmoid loss) of a fresh process
with an empty tuning store (so the shipped tuned configurations load, as on a fresh machine),
recording each kernel it compiles. Each case also records a call on the route a first call takes
while its plan builds a Gluon kernel in the background: the cuBLAS route of the sigmoid loss
(``sigmoid_logits="gemm"``), the statistics kernel of the softmax loss
(``softmax_statistics="triton"``). The plan of every case is written into the shipped file of this
GPU name and Triton version (older plans of the same keys replaced). Record again after a change
to a kernel: plans whose kernels' sources changed are skipped at run time.

    python scripts/record_compile_plans.py --dry-run
    python scripts/record_compile_plans.py --jobs 12
    python scripts/record_compile_plans.py --widths 512 --dtypes bf16 --losses softmax --size-classes 2
    python scripts/record_compile_plans.py --as-device "NVIDIA H100 80GB HBM3"   # on an H200

``--as-device NAME`` records the plans of another GPU of the same architecture and SM count (an H100
SXM's on an H200: both sm_90 with 132 SMs, so Triton compiles the same kernels for both): the cases
run under that GPU's name, so they load its shipped tuned configurations, and the plans go into its
file. A plan only says what to compile ahead; where it is wrong for the real GPU, that GPU's first
call compiles what it needs itself, as without a plan.

``--refresh-digests`` needs no GPU: after an edit inside a kernel's body that left its parameters as
they were, each recorded specialisation (the parameters' types, constants and options) still
describes what a first call compiles, so only the entries' source digests are brought up to date,
in every shipped file. An entry whose kernel's parameters changed is left stale and named: record
its plans again on the GPU.

    python scripts/record_compile_plans.py --refresh-digests
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("tune_shipped", Path(__file__).with_name("tune_shipped.py"))
tune_shipped = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tune_shipped)

# Rows (= keys) of a case of each size class: the tuned classes' sizes of tune_shipped, but the
# largest class at the 32k rows of the benchmarks, and the tiny class, which is not tuned.
SIZES = {0: 1024, 1: tune_shipped.SIZES[1], 2: 32768}

# The case's first call as tune_shipped runs it, recorded.
CHILD = """
import json, os, sys
import torch
if os.environ.get("RECORD_AS_DEVICE"):  # another GPU of this architecture: its name, so its tuned choices
    torch.cuda.get_device_name = lambda *args, **kwargs: os.environ["RECORD_AS_DEVICE"]
from hf_infcl.ops.triton import compile_plans
sys.path.insert(0, sys.argv[1])
import tune_shipped
loss, dtype = sys.argv[2], sys.argv[4]
width, size_class, rows = (int(sys.argv[index]) for index in (3, 5, 6))
with compile_plans.recording() as recorded:
    recorded["seconds"] = tune_shipped.run_case(loss, width, dtype, size_class, rows=rows)
    # the routes a first call takes while its plan builds a Gluon kernel in the background
    from hf_infcl.ops.triton import TritonBlocks
    meanwhile = dict(sigmoid_logits="gemm") if loss == "sigmoid" else dict(softmax_statistics="triton")
    tune_shipped.run_case(loss, width, dtype, size_class, rows=rows, backend=TritonBlocks(**meanwhile))
print("RECORDED " + json.dumps(recorded))
"""


def record_case(case: tuple, env: dict) -> dict | None:
    """One case's recording (``keys``, ``kernels``, ``seconds``) from a fresh process; None (its
    error printed) where the first call failed."""
    loss, width, dtype, size_class = case
    command = [sys.executable, "-c", CHILD, str(Path(__file__).parent), loss, str(width), dtype,
               str(size_class), str(SIZES[size_class])]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RECORDED ")]
    if done.returncode or not lines:
        print(f"{' '.join(map(str, case))}: the first call failed, no plan:\n{done.stderr[-3000:]}",
              file=sys.stderr)
        return None
    recorded = json.loads(lines[-1][len("RECORDED "):])
    # a key without a shipped configuration tunes: its compiles are every candidate's, no plan
    recorded["tuned"] = "hf_infcl: autotuning" in done.stderr
    return recorded


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default=",".join(map(str, tune_shipped.WIDTHS)), help="feature widths c")
    parser.add_argument("--dtypes", default=",".join(tune_shipped.DTYPES), help="bf16, fp16, fp32")
    parser.add_argument("--losses", default=",".join(tune_shipped.LOSSES),
                        help=", ".join(tune_shipped.LOSSES))
    parser.add_argument("--size-classes", default="0,1,2", help="size classes: 0, 1, 2")
    parser.add_argument("--jobs", type=int, default=8, help="cases recorded at once (one process each)")
    parser.add_argument("--shipped", default=None,
                        help="the folder of the plan files (default: the package's shipped_compile_plans/)")
    parser.add_argument("--as-device", default=None,
                        help="record for another GPU of this architecture and SM count, by its name")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and stop")
    parser.add_argument("--refresh-digests", action="store_true",
                        help="no GPU: bring the shipped entries' digests up to date where their kernels' "
                             "parameters did not change")
    opts = parser.parse_args(argv)
    tune_shipped.split_case_options(parser, opts, SIZES)
    if opts.jobs < 1:
        parser.error("--jobs must be positive")
    return opts


def main(argv=None) -> int:
    opts = parse_options(argv)
    if opts.refresh_digests:
        return refresh_digests(Path(opts.shipped) if opts.shipped else None)
    todo = tune_shipped.cases(opts.widths, opts.dtypes, opts.losses, opts.size_classes)
    if opts.dry_run:
        for case in todo:
            print(*case)
        print(f"{len(todo)} cases")
        return 0
    import torch
    import triton

    from hf_infcl.ops.triton.compile_plans import SHIPPED_DIRECTORY, add_plan, plan_path
    from hf_infcl.ops.triton.device import device_name

    if not torch.cuda.is_available():
        print("record_compile_plans: needs a CUDA GPU (use --dry-run to list the cases)", file=sys.stderr)
        return 1
    path = plan_path(Path(opts.shipped or SHIPPED_DIRECTORY),
                     opts.as_device or device_name(torch.device("cuda")), triton.__version__)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as store:
        # an empty tuning store: the shipped configurations load, as on a fresh machine
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_INFCL_CACHE": store}
        env.pop("HF_INFCL_TRITON_AUTOTUNE", None)
        env.pop("RECORD_AS_DEVICE", None)
        if opts.as_device:
            env["RECORD_AS_DEVICE"] = opts.as_device
        with ThreadPoolExecutor(opts.jobs) as pool:
            recordings = list(pool.map(lambda case: record_case(case, env), todo))
    written = 0
    for case, recorded in zip(todo, recordings):
        if recorded is None:
            continue
        print(f"{' '.join(map(str, case))}: {len(recorded['kernels'])} kernels, first call "
              f"{recorded['seconds']:.2f} s, {len(set(recorded['keys']))} plan key(s)"
              + (" - tuned, so no plan (ship its configuration first: scripts/tune_shipped.py)"
                 if recorded["tuned"] else ""))
        if recorded["keys"] and recorded["kernels"] and not recorded["tuned"]:
            add_plan(path, recorded["keys"][0], recorded["kernels"])
            written += 1
    failed = recordings.count(None)
    print(f"{written} plans written to {path} in {time.perf_counter() - started:.0f} s"
          + (f"; {failed} cases failed (above)" if failed else ""))
    return 1 if failed else 0


def refresh_digests(directory: Path | None = None) -> int:
    """Every plan file in ``directory`` (default: the shipped plans) with its entries' digests made
    current where the kernel's parameters are the recorded ones (see the module docstring); 1 if an
    entry is left stale."""
    from hf_infcl.ops.triton import compile_plans

    left_stale = set()
    for path in sorted(Path(directory or compile_plans.SHIPPED_DIRECTORY).glob("*.json.gz")):
        table = compile_plans._read(path)
        renamed, refreshed = {}, 0
        for entry_id, entry in table.get("kernels", {}).items():
            kernel = getattr(importlib.import_module(entry["module"]), entry["name"])
            digest = compile_plans.source_digest(kernel)
            if entry["digest"] != digest:
                if list(json.loads(entry["specialization"])["signature"]) != list(kernel.arg_names):
                    left_stale.add(f"{entry['module']}.{entry['name']}")
                else:
                    entry = {**entry, "digest": digest}
                    refreshed += 1
            renamed[entry_id] = compile_plans.entry_id(entry), entry
        table["kernels"] = {new_id: entry for new_id, entry in renamed.values()}
        table["plans"] = {key: [renamed[entry_id][0] for entry_id in plan]
                          for key, plan in table["plans"].items()}
        compile_plans.write_table(path, table)
        print(f"{path.name}: {refreshed} entries' digests refreshed")
    if left_stale:
        print(f"parameters changed, record these kernels' plans again on the GPU: {sorted(left_stale)}",
              file=sys.stderr)
    return 1 if left_stale else 0


if __name__ == "__main__":
    sys.exit(main())
