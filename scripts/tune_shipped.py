"""Tune the loss's kernels for the common shapes on this GPU and add the choices to the package's
shipped configurations (``hf_infcl/ops/triton/shipped_tuning/``), so that users of this GPU and
Triton release load them instead of tuning on their first call.

One case is a loss, a width c, a dtype and a size class (the tuning key's coarse size: a batch of
``SIZES[class]`` rows and keys): one forward and backward of ``hf_infcl.contrastive_loss`` on
L2-normalised random features with a learnable scale, which tunes each kernel of that key once
(about 10 to 25 s per kernel on an H100) into a fresh tuning store. The losses are the ones users
run by default: ``softmax`` (symmetric, CLIP), ``softmax-one-direction`` (sentence-transformers'
MNRL) and ``sigmoid`` (with a bias, SigLIP). After the cases, the store's entries are merged into
the shipped file of this GPU name and Triton version (the existing entries kept, the new ones
added or replacing theirs). Options of the objectives (groups, the score filter, ...) change the
kernels' tuning keys and are not covered.

    python scripts/tune_shipped.py --dry-run                                 # list the cases
    python scripts/tune_shipped.py --widths 512,768 --dtypes bf16 --budget-s 500
    python scripts/tune_shipped.py --store /tmp/tuned --merge-only           # merge a store's files

A sweep of every case takes hours; split it over calls with ``--widths``/``--dtypes``/``--losses``
and ``--budget-s`` (no case starts after the budget is spent). Cases already in the store load
instead of tuning, so a sweep resumes where a stopped one ended when given the same ``--store``.

The shipped compile plans of this GPU assume the shipped choices: after changing them, record the
plans of the same cases again (``scripts/record_compile_plans.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

WIDTHS = (256, 384, 512, 768, 1024, 1152, 1536, 2048, 4096)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
LOSSES = ("softmax", "softmax-one-direction", "sigmoid")
# Rows (= keys) of a case of each tuned size class (hf_infcl.ops.triton.launch.problem_size_class:
# fewer than 2^28 entries, more). The tiny class 0 (fewer than 2^22) is not tuned: its launches
# run a saved choice where there is one, else the untuned configuration.
SIZES = {1: 8192, 2: 20480}


def cases(widths, dtypes, losses, size_classes) -> list[tuple[str, int, str, int]]:
    """(loss, width, dtype name, size class) of every case, the smaller sizes first."""
    return [(loss, width, dtype, size_class)
            for size_class, loss, width, dtype in itertools.product(size_classes, losses, widths, dtypes)]


def run_case(loss: str, width: int, dtype: str, size_class: int, rows: int | None = None,
             backend="triton") -> float:
    """One forward and backward of the case (tuning its kernels' keys) with ``rows`` rows and keys
    (default: ``SIZES[size_class]``) on ``backend`` (a block ops object for other settings); its
    seconds."""
    import torch
    import torch.nn.functional as F

    from hf_infcl import contrastive_loss

    rows = rows or SIZES[size_class]
    generator = torch.Generator(device="cuda").manual_seed(width + size_class)
    features = [F.normalize(torch.randn(rows, width, device="cuda", generator=generator), dim=1)
                .to(getattr(torch, DTYPES[dtype])).requires_grad_() for _ in range(2)]
    log_scale = torch.tensor(2.6593, device="cuda", requires_grad=True)
    bias = torch.tensor(-10.0, device="cuda", requires_grad=True) if loss == "sigmoid" else None
    start = time.perf_counter()
    kind = "sigmoid" if loss == "sigmoid" else "softmax"
    value = contrastive_loss(*features, log_scale.exp(), bias, loss=kind, symmetric=loss == "softmax",
                             backend=backend)
    value.backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def merge(store_file: Path, shipped_file: Path) -> int:
    """Add the store file's entries to the shipped file (creating it); the number of entries added
    or replaced."""
    new = json.loads(store_file.read_text())
    shipped = json.loads(shipped_file.read_text()) if shipped_file.exists() else {}
    changed = 0
    for kernel, entries in new.items():
        for key, entry in entries.items():
            if shipped.setdefault(kernel, {}).get(key) != entry:
                shipped[kernel][key] = entry
                changed += 1
    shipped_file.parent.mkdir(parents=True, exist_ok=True)
    shipped_file.write_text(json.dumps(shipped, indent=1, sort_keys=True) + "\n")
    return changed


def merge_store(store_folder: Path, shipped_folder: Path | None) -> int:
    """``--merge-only``: every file of a tuning store's folder (one per GPU name and Triton version,
    named as the shipped ones) merged into the shipped file of the same name; no GPU needed. Exit
    status 1 if the folder holds none."""
    from hf_infcl.ops.triton.tuning_store import SHIPPED_DIRECTORY

    store_files = sorted(store_folder.glob("*.json"))
    if not store_files:
        print(f"nothing tuned: no tuning file in {store_folder}", file=sys.stderr)
        return 1
    for store_file in store_files:
        shipped_file = (shipped_folder or SHIPPED_DIRECTORY) / store_file.name
        print(f"{merge(store_file, shipped_file)} entries added to {shipped_file}")
    return 0


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="feature widths c")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="bf16, fp16, fp32")
    parser.add_argument("--losses", default=",".join(LOSSES), help=", ".join(LOSSES))
    parser.add_argument("--size-classes", default="1,2", help="tuning size classes: 1, 2")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no case after this many seconds")
    parser.add_argument("--store", default=None,
                        help="the tuning store's folder (default: a fresh temporary one)")
    parser.add_argument("--shipped", default=None,
                        help="the folder of the shipped files (default: the package's shipped_tuning/)")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and stop")
    parser.add_argument("--merge-only", action="store_true",
                        help="run no case: merge --store's file for this GPU into the shipped one")
    opts = parser.parse_args(argv)
    split_case_options(parser, opts, SIZES)
    if opts.merge_only and opts.store is None:
        parser.error("--merge-only needs --store")
    return opts


def split_case_options(parser, opts, sizes: dict) -> None:
    """``opts``' comma-separated ``widths``, ``dtypes``, ``losses`` and ``size_classes`` as lists,
    each value checked (``sizes``: the size classes allowed); an error through ``parser``."""
    opts.widths = [int(width) for width in opts.widths.split(",")]
    opts.dtypes = opts.dtypes.split(",")
    opts.losses = opts.losses.split(",")
    opts.size_classes = [int(size_class) for size_class in opts.size_classes.split(",")]
    for name, values, allowed in [("--dtypes", opts.dtypes, DTYPES), ("--losses", opts.losses, LOSSES),
                                  ("--size-classes", opts.size_classes, sizes)]:
        unknown = [value for value in values if value not in allowed]
        if unknown:
            parser.error(f"{name}: unknown {unknown}; choose from {list(allowed)}")
    if min(opts.widths) < 1:
        parser.error("--widths must be positive")


def main(argv=None) -> int:
    opts = parse_options(argv)
    todo = cases(opts.widths, opts.dtypes, opts.losses, opts.size_classes)
    if opts.dry_run:
        for case in todo:
            print(*case)
        print(f"{len(todo)} cases")
        return 0
    store = Path(opts.store or tempfile.mkdtemp(prefix="hf_infcl_tune_"))
    if opts.merge_only:
        return merge_store(store / "autotune", Path(opts.shipped) if opts.shipped else None)
    import torch
    import triton

    from hf_infcl.ops.triton import launch
    from hf_infcl.ops.triton.device import device_name
    from hf_infcl.ops.triton.tuning_store import SHIPPED_DIRECTORY, TuningStore, file_name

    if not torch.cuda.is_available():
        print("tune_shipped: needs a CUDA GPU (use --dry-run to list the cases)", file=sys.stderr)
        return 1
    name = device_name(torch.device("cuda"))
    # Every case tuned into this store, none loaded from the configurations already shipped.
    tuning_store = launch.TUNING_STORE = TuningStore(store / "autotune", shipped=None)
    started = time.perf_counter()
    for index, case in enumerate(todo):
        if time.perf_counter() - started > opts.budget_s:
            print(f"budget spent: {len(todo) - index} cases not run", flush=True)
            break
        seconds = run_case(*case)
        print(f"[{time.perf_counter() - started:7.1f} s] {' '.join(map(str, case))}: {seconds:.1f} s",
              flush=True)
    store_file = tuning_store.path(name, triton.__version__)
    if not store_file.exists():
        print(f"nothing tuned: no {store_file}", file=sys.stderr)
        return 1
    shipped_file = Path(opts.shipped or SHIPPED_DIRECTORY) / file_name(name, triton.__version__)
    print(f"{merge(store_file, shipped_file)} entries added to {shipped_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
