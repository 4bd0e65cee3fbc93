"""Autotuned kernel configurations kept on disk, so that tuning is paid once per machine.

Triton's autotuner compiles and times every candidate configuration on a kernel's first call
for each tuning key, in every process: a long wait, paid again by every run and by every rank of
a job. This store keeps the chosen configurations in one JSON file per device name and
Triton version (``<cache>/autotune/<device>--triton-<version>.json``), keyed by kernel and tuning
key. Before a launch whose key the autotuner has not seen, :meth:`TuningStore.tuned` looks the key
up on disk; if it is missing, it takes that key's file lock, looks again (another process of the
job may have tuned it meanwhile) and only then lets the launch tune, then saves the choice. The
processes of a job on one machine therefore tune a key once, the others wait for that and load
the result; a later run loads it at once. Processes that need different keys (independent jobs
on the GPUs of one machine, test workers) tune them side by side: the lock is per key, and only
the file's read-modify-write is serialised.

The cache folder is ``$HF_INFCL_CACHE`` or ``~/.cache/hf_infcl`` (``$XDG_CACHE_HOME/hf_infcl``
where that is set). If it cannot be written, tuning stays in memory, with one warning.

The package also ships configurations tuned on the GPUs the project is measured on
(``shipped_tuning/`` beside this file, the same files), read when the machine's own store lacks a
key: there, a first call loads instead of tuning. The machine's own choices come first, and
``retune`` ignores both. A key of fp16 tensors without a choice of its own takes the same key's
bf16 choice (:func:`_bf16_entry`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

logger = logging.getLogger("hf_infcl")


# The configurations the package ships, one file per device name and Triton version.
SHIPPED_DIRECTORY = Path(__file__).with_name("shipped_tuning")


def default_directory() -> Path:
    """Where tuned configurations are kept (see the module docstring)."""
    explicit = os.environ.get("HF_INFCL_CACHE")
    if explicit:
        return Path(explicit).expanduser() / "autotune"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "hf_infcl" / "autotune"


def tuning_key(tuner, args: tuple, kwargs: dict) -> tuple:
    """The key under which Triton's autotuner caches a launch's configuration: the values of its
    ``key`` arguments, then the dtype of every tensor argument, in argument order (as
    ``triton.runtime.Autotuner.run`` forms it)."""
    named = {**dict(zip(tuner.arg_names, args)), **kwargs}
    named = {name: value for name, value in named.items() if name in tuner.arg_names}
    key = [named[name] for name in tuner.keys if name in named]
    key += [str(value.dtype) for value in named.values() if hasattr(value, "dtype")]
    return tuple(key)


class TuningStore:
    """Tuned configurations of one device, on disk (see the module docstring).

    Args:
        directory: the folder of the JSON files (default: :func:`default_directory`, read when
            first needed).
        shipped: the folder of the package's read-only files of the same names
            (:data:`SHIPPED_DIRECTORY`; None: none).
    """

    def __init__(self, directory: str | os.PathLike | None = None,
                 shipped: str | os.PathLike | None = SHIPPED_DIRECTORY):
        self._directory = None if directory is None else Path(directory)
        self._shipped = None if shipped is None else Path(shipped)
        self._retune = False
        self._warned = False

    @property
    def directory(self) -> Path:
        return self._directory if self._directory is not None else default_directory()

    def path(self, device_name: str, triton_version: str) -> Path:
        """The file of one device name and Triton version."""
        return self.directory / file_name(device_name, triton_version)

    def _saved_files(self, device_name: str, triton_version: str) -> list[Path]:
        """Where a saved choice is looked for: the machine's own file first, then the package's."""
        name = file_name(device_name, triton_version)
        return [self.directory / name] + ([] if self._shipped is None else [self._shipped / name])

    def retune(self) -> None:
        """From now on in this process, tune every key again on its first launch (and save the new
        choice) instead of loading the saved one: what a benchmark that sweeps sizes wants."""
        self._retune = True

    @contextlib.contextmanager
    def tuned(self, tuner, kernel: str, key: tuple, device_name: str, triton_version: str, config_type):
        """Around one launch of ``tuner`` whose tuning key is ``key``: load a saved configuration
        into the tuner first, or, if there is none, let the launch tune (under a lock shared by
        the processes of this machine) and save its choice. Yields whether the launch tunes."""
        if key in tuner.cache:
            yield False
            return
        path = self.path(device_name, triton_version)
        entry = repr(key)
        saved = self.saved(kernel, key, device_name, triton_version, config_type)
        if saved is not None:
            tuner.cache[key] = saved
            yield False
            return
        try:
            lock = _locked(_key_lock_path(path, kernel, entry))  # held across the yield
        except OSError as error:
            self._warn_once(f"cannot write tuned configurations to {path.parent} ({error}); "
                            "each process tunes for itself")
            yield True
            return
        with lock:
            if not self._retune and self._load(tuner, kernel, entry, key, path, config_type):
                yield False
                return
            logger.warning("hf_infcl: autotuning %s for %s on %s (once per machine: the choice is saved "
                           "to %s)", kernel, key, device_name, path)
            start = time.perf_counter()
            yield True
            elapsed = time.perf_counter() - start
            if key in tuner.cache:
                self._save(kernel, entry, tuner.cache[key], path)
                logger.warning("hf_infcl: autotuning %s took %.1f s", kernel, elapsed)

    # ----------------------------------------------------------------------------------------

    def saved(self, kernel: str, key: tuple, device_name: str, triton_version: str, config_type):
        """The configuration saved for ``kernel`` and ``key`` (the machine's own, else the
        package's), or None where there is none or this process retunes: a look-up that never
        tunes, for launches kept out of the autotuner."""
        if self._retune:
            return None
        for entry in filter(None, (repr(key), _bf16_entry(key))):
            for path in self._saved_files(device_name, triton_version):
                config = _saved_config(path, kernel, entry, config_type)
                if config is not None:
                    return config
        return None

    def _load(self, tuner, kernel: str, entry: str, key: tuple, path: Path, config_type) -> bool:
        config = _saved_config(path, kernel, entry, config_type)
        if config is None:
            return False
        tuner.cache[key] = config
        return True

    def _save(self, kernel: str, entry: str, config, path: Path) -> None:
        saved = {
            "kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None),
        }
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            # Other keys may be saved at the same time: the read-modify-write holds the file's lock.
            with _locked(path.with_suffix(".lock")):
                table = _read(path)
                table.setdefault(kernel, {})[entry] = saved
                partial.write_text(json.dumps(table, indent=1, sort_keys=True))
                os.replace(partial, path)  # readers never see a half-written file
        except OSError as error:
            self._warn_once(f"cannot save tuned configurations to {path} ({error})")

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("hf_infcl: %s", message)


def _saved_config(path: Path, kernel: str, entry: str, config_type):
    """The configuration saved in ``path`` for ``kernel`` and the key written ``entry``, or None."""
    saved = _read(path).get(kernel, {}).get(entry)
    if saved is None:
        return None
    return config_type(saved["kwargs"], num_warps=saved["num_warps"], num_stages=saved["num_stages"],
                       num_ctas=saved.get("num_ctas", 1), maxnreg=saved.get("maxnreg"))


def _bf16_entry(key: tuple) -> str | None:
    """The entry of ``key`` with its fp16 tensors read as bf16, for a key with fp16 tensors and no
    bf16 one (else None). fp16 and bf16 operands take the same tensor-core rate and bytes, and the
    choices tuned for both mostly agree (benchmarks/README.md), while the shipped files hold bf16
    at more widths: fp16 inputs, and fp32 ones multiplied as fp16 copies, load bf16's choice there
    instead of tuning."""
    if "torch.float16" not in key or "torch.bfloat16" in key:
        return None
    return repr(tuple("torch.bfloat16" if part == "torch.float16" else part for part in key))


def file_name(device_name: str, triton_version: str) -> str:
    """The name of the file of one device name and Triton version (in the store and shipped)."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", device_name).strip("-") or "device"
    return f"{slug}--triton-{triton_version}.json"


def _key_lock_path(path: Path, kernel: str, entry: str) -> Path:
    """The lock file of one kernel and tuning key, beside the store's file."""
    digest = hashlib.sha1(f"{kernel} {entry}".encode()).hexdigest()[:16]
    return path.parent / f"{path.stem}.locks" / f"{digest}.lock"


def _locked(lock_path: Path):
    """``lock_path`` opened and exclusively locked (creating its folder): use it as a context
    manager; the lock goes when the file closes. flock, not POSIX record locks: those would be
    dropped when any other descriptor of the process closes the same file."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(lock_path, "a")  # noqa: SIM115 - returned open, closed by the caller's with
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError:
        handle.close()
        raise
    return handle


def _read(path: Path) -> dict:
    """The saved table, or an empty one where there is none or it cannot be read."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}
