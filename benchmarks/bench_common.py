"""The harness the benchmark scripts share (they run as scripts, so this folder is on sys.path).

- sizes: :func:`parse_count` / :func:`format_count` ("32k" <-> 32768);
- timing: :func:`synchronize`, :func:`time_steps` (wall seconds per call, device-synchronised,
  optionally the slowest rank's), :func:`median_seconds`;
- memory: :func:`allocated`, :func:`max_allocated`, :func:`reset_peak`, :func:`peak_above`,
  :func:`free_memory` (all zero / no-ops when CUDA is not in use, so CPU smoke runs go through);
- failures: :func:`is_out_of_memory`;
- records: :func:`device_name`, :func:`versions`, :func:`csv_path`, :class:`CsvLog`,
  :func:`write_csv`, :func:`append_csv_row`;
- output: :class:`Column` and :func:`print_table`.
"""

from __future__ import annotations

import csv
import gc
import importlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# ---- sizes -----------------------------------------------------------------------------------


def parse_count(text: str) -> int:
    """"32k" -> 32768, "1m" -> 1048576, "100" -> 100 (powers of two, as batch sizes are)."""
    text = text.strip().lower()
    factor = {"k": 1024, "m": 1024 * 1024}.get(text[-1], 1)
    return int(text[:-1] if factor > 1 else text) * factor


def format_count(n: int) -> str:
    """The inverse of ``parse_count`` for table labels: 32768 -> "32k", 1048576 -> "1M"."""
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# ---- timing ----------------------------------------------------------------------------------


def cuda_in_use() -> bool:
    """CUDA is there and this process has used it (a CPU run on a GPU machine does not touch it)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a wall-clock time covers it."""
    if cuda_in_use():
        torch.cuda.synchronize()


def time_steps(fn: Callable[[], object], steps: int, warmup: int = 0, *, group=None,
               device: torch.device | str | None = None) -> list[float]:
    """Wall seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed ones, synchronised
    before and after. With a process ``group``, the ranks meet at a barrier before each call and
    every rank gets the slowest rank's time (reduced on ``device``, the group's device)."""
    import torch.distributed as dist

    times = []
    for index in range(warmup + steps):
        synchronize()
        if group is not None:
            dist.barrier(group=group)
        started = time.perf_counter()
        fn()
        synchronize()
        elapsed = time.perf_counter() - started
        if group is not None:
            slowest = torch.tensor([elapsed], device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            elapsed = float(slowest)
        if index >= warmup:
            times.append(elapsed)
    return times


def median_seconds(fn: Callable[[], object], steps: int, warmup: int = 0) -> float:
    """Median seconds of ``fn()`` over ``steps`` calls after ``warmup`` calls."""
    return statistics.median(time_steps(fn, steps, warmup))


def median_issue_seconds(fn: Callable[[], object], steps: int) -> float:
    """Median seconds to *issue* ``fn()`` from an idle GPU: until it returns, its kernels possibly
    still running. Where it exceeds the GPU's time for the same work, the host sets the pace."""
    times = []
    for _ in range(steps):
        synchronize()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    synchronize()
    return statistics.median(times)


def one_size_parser(description: str, rows: int):
    """A parser for the scripts that look at one problem size: ``--b`` rows (and keys, default
    ``rows``), ``--c`` features, ``--loss``."""
    import argparse

    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=int, default=rows, help="rows, and as many keys")
    parser.add_argument("--c", type=int, default=512, help="feature width")
    parser.add_argument("--loss", choices=["softmax", "sigmoid"], default="softmax")
    return parser


# ---- memory ----------------------------------------------------------------------------------


def allocated() -> int:
    return torch.cuda.memory_allocated() if cuda_in_use() else 0


def max_allocated() -> int:
    return torch.cuda.max_memory_allocated() if cuda_in_use() else 0


def reset_peak() -> None:
    if cuda_in_use():
        torch.cuda.reset_peak_memory_stats()


def peak_above(fn: Callable[[], object]) -> tuple[int, object]:
    """(peak bytes allocated during ``fn()`` above what was allocated before it, its result).
    Zero bytes when CUDA is not in use."""
    synchronize()
    before = allocated()
    reset_peak()
    result = fn()
    synchronize()
    return (max_allocated() - before if cuda_in_use() else 0), result


def free_memory(reset_peak_stats: bool = False) -> None:
    """Collect garbage and hand cached GPU blocks back (and reset the peak, if asked)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        if reset_peak_stats:
            torch.cuda.reset_peak_memory_stats()


def is_out_of_memory(error: BaseException) -> bool:
    """An out-of-memory error of the device: torch's own, or a library's (cuBLAS ALLOC_FAILED,
    NCCL, a kernel launcher) that only says so in its message."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return "out of memory" in text.lower() or "ALLOC_FAILED" in text


# ---- records ---------------------------------------------------------------------------------


def device_name(device: torch.device | str | None = None, cpu: str = "cpu") -> str:
    """The GPU's name, or ``cpu`` for a run on the host."""
    device = torch.device(device) if device is not None else None
    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    return torch.cuda.get_device_name(device) if on_cuda else cpu


def versions(*packages: str) -> dict[str, str]:
    """``{package: __version__}`` for each package, ``"-"`` where it is not installed."""
    found = {}
    for name in packages:
        try:
            found[name] = importlib.import_module(name).__version__
        except ImportError:
            found[name] = "-"
    return found


def csv_path(explicit: str | None, name: str) -> str | None:
    """``explicit``, or ``$OUT/name`` when ``OUT`` is set, or None (no CSV)."""
    if explicit:
        return explicit
    return os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None


class CsvLog:
    """CSV rows written as they are recorded (line-buffered: a sweep stopped midway keeps the rows
    it finished). Without a path it writes nothing."""

    def __init__(self, path: str | None, fields: Sequence[str], extrasaction: str = "raise"):
        self.path, self.fields, self.extrasaction = path, list(fields), extrasaction
        self._handle = self._writer = None

    def __enter__(self) -> CsvLog:
        if self.path:
            self._handle = open(self.path, "w", newline="", buffering=1)
            self._writer = csv.DictWriter(self._handle, fieldnames=self.fields,
                                          extrasaction=self.extrasaction)
            self._writer.writeheader()
        return self

    def write(self, row: dict) -> None:
        if self._writer is not None:
            self._writer.writerow(row)
            self._handle.flush()

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.close()


def write_csv(path: str | None, rows: Iterable[dict], fields: Sequence[str] | None = None) -> str | None:
    """Write ``rows`` at once (fields: those given, or every key of the rows, sorted); the path, or
    None when there is none."""
    rows = list(rows)
    if not path:
        return None
    with CsvLog(path, fields if fields is not None else sorted({key for row in rows for key in row})) as log:
        for row in rows:
            log.write(row)
    return path


def append_csv_row(path: str | None, row: dict, fields: Sequence[str]) -> None:
    """Add ``row`` to the CSV at ``path`` (its header first when the file is new), so that runs made
    one process at a time gather in one file; a file with other columns is refused (ValueError)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.isfile(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as handle:
            header = next(csv.reader(handle), [])
        if header != list(fields):
            raise ValueError(f"CSV {path} has other columns ({', '.join(header)}); give a new file")
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(fields), extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({key: "" if row.get(key) is None else row[key] for key in fields})


# ---- output ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One column of :func:`print_table`.

    ``spec`` formats numbers (``".1f"``, ``".0%"``); strings are printed as they are. ``missing``
    stands for None and NaN. ``gap`` is what comes before the column (the first one's is not printed).
    """

    title: str
    width: int = 0
    spec: str = ""
    align: str = ">"
    missing: str = ""
    gap: str = " "

    def cell(self, value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            text = self.missing
        elif self.spec and isinstance(value, (int, float)) and not isinstance(value, bool):
            text = format(value, self.spec)
        else:
            text = str(value)
        return f"{text:{self.align}{self.width}}"


def table_line(columns: Sequence[Column], cells: Sequence[str]) -> str:
    return "".join((column.gap if index else "") + cell
                   for index, (column, cell) in enumerate(zip(columns, cells)))


def print_table(columns: Sequence[Column], rows: Iterable[Sequence], title: str | None = None) -> None:
    """Print an optional title line, a header of the columns' titles, and one line per row (a
    sequence of values, one per column)."""
    if title is not None:
        print(title)
    print(table_line(columns, [f"{c.title:{c.align}{c.width}}" for c in columns]))
    for row in rows:
        print(table_line(columns, [column.cell(value) for column, value in zip(columns, row)]), flush=True)
