"""The on-disk store of autotuned configurations (hf_infcl.ops.triton.tuning_store): what one process
tunes, the next loads instead of tuning; the processes of one machine tune a key once; devices
and Triton versions keep separate files. Autotuner stand-ins replace Triton's, whose tuning
needs a GPU; the GPU check is ``tests/helpers/gpu_smoke.py``'s second-process case."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time

from hf_infcl.ops.triton.tuning_store import SHIPPED_DIRECTORY, TuningStore, file_name, tuning_key


class _Config:
    """Stands in for triton.Config: what the store saves and rebuilds."""

    def __init__(self, kwargs, num_warps=4, num_stages=3, num_ctas=1, maxnreg=None):
        self.kwargs, self.num_warps, self.num_stages = dict(kwargs), num_warps, num_stages
        self.num_ctas, self.maxnreg = num_ctas, maxnreg

    def __eq__(self, other):
        return vars(self) == vars(other)


class _Tuner:
    """Stands in for triton's Autotuner: a cache of chosen configs, and a launch that "tunes"
    (counts, takes a while, picks a config) when its key is not cached."""

    arg_names = ["x_ptr", "c", "size_class", "FLAG"]
    keys = ["c", "size_class"]

    def __init__(self, choice=None):
        self.cache = {}
        self.tunings = 0
        self.choice = choice or _Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=4)

    def launch(self, key, seconds=0.0):
        if key not in self.cache:
            self.tunings += 1
            time.sleep(seconds)
            self.cache[key] = self.choice


class _Tensor:
    def __init__(self, dtype):
        self.dtype = dtype


def _run(store, tuner, key, device="NVIDIA H100 80GB HBM3", version="3.6.0", seconds=0.0):
    with store.tuned(tuner, "grad_tile", key, device, version, _Config):
        tuner.launch(key, seconds)


def test_tuning_key_is_the_autotuners(tmp_path):
    """The key arguments' values, then every tensor argument's dtype, in argument order."""
    tuner = _Tuner()
    key = tuning_key(tuner, (_Tensor("torch.bfloat16"), 768), {"size_class": 2, "FLAG": True})
    assert key == (768, 2, "torch.bfloat16")


def test_a_second_process_loads_what_the_first_tuned(tmp_path, caplog):
    key = (768, 2, "torch.bfloat16")
    first = _Tuner()
    with caplog.at_level(logging.WARNING, logger="hf_infcl"):
        _run(TuningStore(tmp_path), first, key)
    assert first.tunings == 1
    assert any("autotuning grad_tile" in r.message and "took" not in r.message for r in caplog.records)
    assert any("took" in r.message for r in caplog.records)
    saved = json.loads((tmp_path / "NVIDIA-H100-80GB-HBM3--triton-3.6.0.json").read_text())
    assert saved["grad_tile"][repr(key)]["kwargs"] == {"BLOCK_M": 64, "BLOCK_N": 128}

    caplog.clear()
    second = _Tuner(choice=_Config({"BLOCK_M": 1}))  # would pick something else if it tuned
    with caplog.at_level(logging.WARNING, logger="hf_infcl"):
        _run(TuningStore(tmp_path), second, key)
    assert second.tunings == 0
    assert second.cache[key] == first.choice
    assert not caplog.records  # nothing tuned, nothing said


def test_devices_versions_and_keys_tune_apart(tmp_path):
    store, key = TuningStore(tmp_path), (768, 2, "torch.bfloat16")
    _run(store, _Tuner(), key)
    for device, version, other_key in [("NVIDIA H200", "3.6.0", key), ("NVIDIA H100 80GB HBM3", "3.7.0", key),
                                       ("NVIDIA H100 80GB HBM3", "3.6.0", (512, 2, "torch.bfloat16"))]:
        tuner = _Tuner()
        _run(store, tuner, other_key, device=device, version=version)
        assert tuner.tunings == 1, (device, version, other_key)
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_retune_tunes_again_and_saves_the_new_choice(tmp_path):
    key = (768, 2, "torch.bfloat16")
    _run(TuningStore(tmp_path), _Tuner(), key)
    store = TuningStore(tmp_path)
    store.retune()
    tuner = _Tuner(choice=_Config({"BLOCK_M": 256}))
    _run(store, tuner, key)
    assert tuner.tunings == 1
    later = _Tuner()
    _run(TuningStore(tmp_path), later, key)
    assert later.tunings == 0 and later.cache[key] == _Config({"BLOCK_M": 256})


def test_an_unwritable_folder_warns_once_and_tunes_in_memory(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    store = TuningStore(blocked / "sub")
    with caplog.at_level(logging.WARNING, logger="hf_infcl"):
        for size_class in (1, 2):
            tuner = _Tuner()
            _run(store, tuner, (768, size_class, "torch.float32"))
            assert tuner.tunings == 1
    assert sum("cannot write" in r.message for r in caplog.records) == 1


def test_the_default_folder_follows_hf_infcl_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_INFCL_CACHE", str(tmp_path))
    expected = tmp_path / "autotune" / "NVIDIA-H100--triton-3.6.0.json"
    assert TuningStore().path("NVIDIA H100", "3.6.0") == expected
    monkeypatch.delenv("HF_INFCL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert TuningStore().directory == tmp_path / "xdg" / "hf_infcl" / "autotune"


def _rank(directory, key, results):
    tuner = _Tuner()
    _run(TuningStore(directory), tuner, key, seconds=1.0)
    results.put((tuner.tunings, vars(tuner.cache[key])))


def test_the_processes_of_one_machine_tune_a_key_once(tmp_path):
    """Four processes start together (the ranks of one job): one tunes, under the lock; the
    others wait for it and load its choice."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    key = (768, 2, "torch.bfloat16")
    processes = [context.Process(target=_rank, args=(tmp_path, key, results)) for _ in range(4)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert sorted(tunings for tunings, _ in outcomes) == [0, 0, 0, 1]
    assert all(config == outcomes[0][1] for _, config in outcomes)


def _tune_until_released(directory, key, started, release, results):
    tuner = _Tuner()
    with TuningStore(directory).tuned(tuner, "grad_tile", key, "NVIDIA H100 80GB HBM3", "3.6.0", _Config):
        started.set()
        released = release.wait(timeout=30)  # still tuning, holding this key's lock
        tuner.launch(key)
    results.put(("first", released, tuner.tunings))


def _tune_another_key(directory, key, started, release, results):
    started.wait(timeout=30)
    tuner = _Tuner()
    _run(TuningStore(directory), tuner, key)
    release.set()
    results.put(("second", True, tuner.tunings))


def test_processes_tune_different_keys_side_by_side_and_both_are_saved(tmp_path):
    """Independent jobs on one machine (or test workers) need different keys: one process's
    tuning must not hold up another's, and saving both must keep both. The first process tunes
    until the second has tuned and saved its own key: with one lock for the whole store the
    second would wait for the first, and the first would wait in vain."""
    context = multiprocessing.get_context("spawn")
    results, started, release = context.Queue(), context.Event(), context.Event()
    keys = [(768, 2, "torch.bfloat16"), (512, 1, "torch.float32")]
    processes = [context.Process(target=target, args=(tmp_path, key, started, release, results))
                 for target, key in zip((_tune_until_released, _tune_another_key), keys)]
    for process in processes:
        process.start()
    outcomes = sorted(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert outcomes == [("first", True, 1), ("second", True, 1)]
    saved = json.loads(TuningStore(tmp_path).path("NVIDIA H100 80GB HBM3", "3.6.0").read_text())
    assert sorted(saved["grad_tile"]) == sorted(repr(key) for key in keys)


def _ship(folder, key, choice, kernel="grad_tile", device="NVIDIA H100 80GB HBM3", version="3.6.0"):
    """``choice`` for ``key`` added to a shipped file, as the package ships them."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(device, version)
    shipped = json.loads(path.read_text()) if path.exists() else {}
    entry = {"kwargs": dict(choice.kwargs), "num_warps": choice.num_warps, "num_stages": choice.num_stages}
    shipped.setdefault(kernel, {})[repr(key)] = entry
    path.write_text(json.dumps(shipped))


def test_a_shipped_configuration_loads_without_tuning(tmp_path, caplog):
    key, shipped = (768, 2, "torch.bfloat16"), _Config({"BLOCK_M": 256, "BLOCK_N": 64}, num_warps=8)
    _ship(tmp_path / "shipped", key, shipped)
    tuner = _Tuner()
    with caplog.at_level(logging.WARNING, logger="hf_infcl"):
        _run(TuningStore(tmp_path / "store", shipped=tmp_path / "shipped"), tuner, key)
    assert tuner.tunings == 0 and tuner.cache[key] == shipped
    assert not caplog.records
    # another key, device or Triton version is not in it: those tune
    for other in [dict(key=(512, 2, "torch.bfloat16")), dict(device="NVIDIA H200"), dict(version="3.7.0")]:
        tuner, store = _Tuner(), TuningStore(tmp_path / "store", shipped=tmp_path / "shipped")
        _run(store, tuner, other.pop("key", key), **other)
        assert tuner.tunings == 1, other


def test_the_machines_own_choice_comes_before_the_shipped_one_and_retune_ignores_both(tmp_path):
    key = (768, 2, "torch.bfloat16")
    _ship(tmp_path / "shipped", key, _Config({"BLOCK_M": 256}))
    own = _Config({"BLOCK_M": 32})
    _run(TuningStore(tmp_path / "store", shipped=None), _Tuner(choice=own), key)
    tuner = _Tuner()
    _run(TuningStore(tmp_path / "store", shipped=tmp_path / "shipped"), tuner, key)
    assert tuner.tunings == 0 and tuner.cache[key] == own
    store = TuningStore(tmp_path / "store", shipped=tmp_path / "shipped")
    store.retune()
    tuner = _Tuner()
    _run(store, tuner, key)
    assert tuner.tunings == 1


def test_a_look_up_without_tuning_finds_the_same_choice_as_a_launch_would(tmp_path):
    """``saved``, for launches kept out of the autotuner (tiny problems): the machine's choice,
    else the shipped one, else None; None too once the process retunes. It never tunes or saves."""
    key, device, version = (768, 0, "torch.bfloat16"), "NVIDIA H100 80GB HBM3", "3.6.0"
    store = TuningStore(tmp_path / "store", shipped=tmp_path / "shipped")
    assert store.saved("grad_tile", key, device, version, _Config) is None
    assert not (tmp_path / "store").exists()
    shipped = _Config({"BLOCK_M": 256}, num_warps=8)
    _ship(tmp_path / "shipped", key, shipped)
    assert store.saved("grad_tile", key, device, version, _Config) == shipped
    own = _Config({"BLOCK_M": 32})
    _run(TuningStore(tmp_path / "store", shipped=None), _Tuner(choice=own), key)
    assert store.saved("grad_tile", key, device, version, _Config) == own
    assert store.saved("stats", key, device, version, _Config) is None  # another kernel's
    store.retune()
    assert store.saved("grad_tile", key, device, version, _Config) is None


def test_an_fp16_key_without_a_choice_of_its_own_takes_the_bf16_one(tmp_path):
    """fp16 tensors (fp16 inputs, or fp32 ones multiplied as fp16 copies) load the shipped bf16
    choice of the same width and size class instead of tuning; a choice of their own (shipped or
    the machine's) comes first; keys that mix dtypes or hold no fp16 have no such fallback."""
    bf16_key = (768, 2, "torch.bfloat16", "torch.float32")
    fp16_key = (768, 2, "torch.float16", "torch.float32")
    bf16_choice = _Config({"BLOCK_M": 256, "BLOCK_N": 64}, num_warps=8)
    _ship(tmp_path / "shipped", bf16_key, bf16_choice)
    store = TuningStore(tmp_path / "store", shipped=tmp_path / "shipped")
    tuner = _Tuner()
    _run(store, tuner, fp16_key)
    assert tuner.tunings == 0 and tuner.cache[fp16_key] == bf16_choice
    for unmatched in [(768, 2, "torch.float32", "torch.float32"), (768, 2, "torch.float16", "torch.bfloat16"),
                      (512, 2, "torch.float16", "torch.float32")]:
        tuner = _Tuner()
        _run(store, tuner, unmatched)
        assert tuner.tunings == 1, unmatched
    shipped_fp16 = _Config({"BLOCK_M": 64})
    _ship(tmp_path / "shipped", fp16_key, shipped_fp16)
    tuner = _Tuner()
    _run(TuningStore(tmp_path / "other_store", shipped=tmp_path / "shipped"), tuner, fp16_key)
    assert tuner.tunings == 0 and tuner.cache[fp16_key] == shipped_fp16
    own = _Config({"BLOCK_M": 32})
    _run(TuningStore(tmp_path / "store", shipped=None), _Tuner(choice=own), fp16_key)
    tuner = _Tuner()
    _run(TuningStore(tmp_path / "store", shipped=tmp_path / "shipped"), tuner, fp16_key)
    assert tuner.tunings == 0 and tuner.cache[fp16_key] == own


def test_an_unreadable_shipped_file_is_no_file(tmp_path):
    key = (768, 2, "torch.bfloat16")
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / file_name("NVIDIA H100 80GB HBM3", "3.6.0")).write_text("{not json")
    tuner = _Tuner()
    _run(TuningStore(tmp_path / "store", shipped=tmp_path / "shipped"), tuner, key)
    assert tuner.tunings == 1


def test_the_package_ships_configurations_of_the_current_kernels():
    """Every shipped file is named as the store names its files, holds kernels of the current
    revision (an older revision's entries would never be read) and whole configurations."""
    from hf_infcl.ops.triton.launch import KERNEL_REVISION

    files = sorted(SHIPPED_DIRECTORY.glob("*.json"))
    assert files, f"nothing shipped in {SHIPPED_DIRECTORY}"
    for path in files:
        device, version = path.stem.split("--triton-")
        assert path.name == file_name(device, version)
        table = json.loads(path.read_text())
        assert table
        for kernel, entries in table.items():
            assert kernel.endswith(f"-r{KERNEL_REVISION}"), (path.name, kernel)
            for entry, saved in entries.items():
                assert entry.startswith("(") and isinstance(saved["num_warps"], int), (path.name, entry)
                assert {"BLOCK_M", "BLOCK_N", "BLOCK_K"} <= saved["kwargs"].keys(), (path.name, entry)


COMMON_WIDTHS = (256, 384, 512, 768, 1024, 1152, 1536, 2048, 4096)


def test_the_shipped_files_spare_bf16_fp16_and_fp32_the_tuning_at_the_common_widths(tmp_path):
    """Both shipped GPUs hold bf16 choices for both kernels at every common width and tuned size
    class, and each of them is what an fp16 launch of the same key loads: fp16 inputs, and fp32
    ones (multiplied as fp16 copies), start without tuning there too."""
    import ast

    store = TuningStore(tmp_path / "store", shipped=SHIPPED_DIRECTORY)
    for path in sorted(SHIPPED_DIRECTORY.glob("*.json")):
        device, version = path.stem.split("--triton-")
        for kernel, entries in json.loads(path.read_text()).items():
            parsed = {ast.literal_eval(entry): saved for entry, saved in entries.items()}
            bf16 = {key: saved for key, saved in parsed.items() if key[2:4] == ("torch.bfloat16",) * 2}
            covered = {(key[0], key[1]) for key in bf16}
            missing = {(c, size) for c in COMMON_WIDTHS for size in (1, 2)} - covered
            assert not missing, (path.name, kernel, sorted(missing))
            for key, saved in bf16.items():
                fp16_key = tuple("torch.float16" if part == "torch.bfloat16" else part for part in key)
                if repr(fp16_key) in entries:
                    continue  # a choice of its own, tuned on fp16
                loaded = store.saved(kernel, fp16_key, device, version, _Config)
                assert loaded is not None and loaded.kwargs == saved["kwargs"], (path.name, kernel, key)
