"""Compile plans (``hf_infcl.ops.triton.compile_plans``): the plan files, the plan keys, when a
plan is compiled, recording, and the shipped plans; on a GPU, a fresh machine's first call that
finds its kernels compiled by the plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hf_infcl.ops.spec import StatsSpec, resolve_precision  # noqa: E402
from hf_infcl.ops.triton import compile_plans, launch  # noqa: E402
from hf_infcl.ops.triton.blocks import TritonBlocks  # noqa: E402
from hf_infcl.ops.triton.operands import kernel_operands, label_arguments  # noqa: E402
from tests.helpers import plan_kernels  # noqa: E402
from tests.test_tuning_store import COMMON_WIDTHS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
H200 = "NVIDIA H200"
CUDA = torch.device("cuda")


def entry(name: str, specialization: str = "{}") -> dict:
    return {"module": "tests.helpers.plan_kernels", "name": name, "digest": "d-" + name,
            "specialization": specialization}


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """No plan key prepared yet and no plan file read yet, as in a new process."""
    monkeypatch.setattr(compile_plans, "_PREPARED", set())
    monkeypatch.setattr(compile_plans, "_SHIPPED", {})


def test_plans_share_their_kernels_in_the_file_and_read_back(tmp_path):
    path = compile_plans.plan_path(tmp_path, H200, "3.6.0")
    assert path.name == "NVIDIA-H200--triton-3.6.0.json.gz"
    compile_plans.add_plan(path, "first", [entry("a"), entry("b")])
    compile_plans.add_plan(path, "second", [entry("b"), entry("c")])
    written = path.read_bytes()
    assert compile_plans.shipped_plan(H200, "3.6.0", "first", tmp_path) == [entry("a"), entry("b")]
    assert compile_plans.shipped_plan(H200, "3.6.0", "second", tmp_path) == [entry("b"), entry("c")]
    assert compile_plans.shipped_plan(H200, "3.6.0", "third", tmp_path) == []
    assert len(compile_plans._read(path)["kernels"]) == 3  # b once
    compile_plans.add_plan(path, "first", [entry("c")])  # replaced: a is listed by no plan now
    assert sorted(kernel["name"] for kernel in compile_plans._read(path)["kernels"].values()) == ["b", "c"]
    compile_plans.add_plan(path, "first", [entry("a"), entry("b")])
    assert path.read_bytes() == written  # the same plans give the same bytes


def test_a_missing_or_unreadable_plan_file_gives_no_plan(tmp_path):
    assert compile_plans.shipped_plan(H200, "3.6.0", "first", tmp_path) == []
    compile_plans.plan_path(tmp_path, "other", "3.6.0").write_text("not gzip")
    assert compile_plans.shipped_plan("other", "3.6.0", "first", tmp_path) == []


def key_of(dtype=torch.bfloat16, width=512, rows=32768, keys=32768, blocks=None, loss="softmax", bias=False,
           labels=None):
    """The plan key of a plain call of these inputs (as ``TritonBlocks._prepare`` forms it)."""
    blocks = blocks or TritonBlocks()
    queries = torch.randn(2, width).to(dtype)
    # precision resolved as for CUDA tensors (fp32: TF32, through fp16 copies by default)
    spec = StatsSpec(loss, columns=loss == "softmax", precision=resolve_precision("auto", dtype, CUDA))
    kernel = kernel_operands(spec, queries, queries, torch.tensor(1.0), blocks.tf32_via_fp16)
    labels = label_arguments(None, None, kernel) if labels is None else labels
    return compile_plans.plan_key(blocks, spec, queries, kernel.queries, rows, keys, width, bias, labels)


def test_plan_keys_tell_apart_what_changes_a_calls_kernels():
    base = key_of()
    assert key_of() == base and hash(key_of()) == hash(base) and repr(key_of()) == repr(base)
    assert "0x" not in repr(base)  # no object addresses: the repr is the key in the shipped files
    variants = [key_of(dtype=torch.float16), key_of(dtype=torch.float32), key_of(width=768),
                key_of(rows=4096, keys=4096), key_of(rows=32760), key_of(keys=32776),
                key_of(blocks=TritonBlocks(tf32_via_fp16=False)), key_of(loss="sigmoid"), key_of(bias=True),
                key_of(labels={"query_groups": torch.zeros(2)})]
    assert len({base, *variants}) == len(variants) + 1
    assert key_of(labels={"query_groups": None}) == key_of(labels={})  # only the arguments given count
    # fp32 inputs: the kernels take fp16 copies, and the key says both
    assert "torch.float32, torch.float16" in repr(key_of(dtype=torch.float32))


def test_prepare_compiles_a_keys_plan_once(monkeypatch):
    compiled = []
    monkeypatch.setattr(compile_plans, "_wanted", lambda device: True)
    monkeypatch.setattr(compile_plans, "device_name", lambda device: H200)
    monkeypatch.setattr(compile_plans, "shipped_plan",
                        lambda name, version, key: [entry("a")] if "one" in key else [])
    monkeypatch.setattr(compile_plans, "_compile_in_parallel",
                        lambda entries, device: compiled.append(entries))
    for _ in range(3):
        compile_plans.prepare(("one",), torch.device("cpu"))
        compile_plans.prepare(("two",), torch.device("cpu"))
    assert compiled == [[entry("a")]]


def test_a_failing_plan_is_logged_and_the_call_goes_on(monkeypatch, caplog):
    def fail(entries, device):
        raise RuntimeError("a Triton of other internals")

    monkeypatch.setattr(compile_plans, "_wanted", lambda device: True)
    monkeypatch.setattr(compile_plans, "device_name", lambda device: H200)
    monkeypatch.setattr(compile_plans, "shipped_plan", lambda name, version, key: [entry("a")])
    monkeypatch.setattr(compile_plans, "_compile_in_parallel", fail)
    with caplog.at_level("DEBUG", logger="hf_infcl"):
        compile_plans.prepare(("one",), torch.device("cpu"))
    assert "compile plan" in caplog.text and "other internals" in caplog.text


def test_plans_are_used_only_on_a_machine_that_tuned_nothing_unless_turned_off(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_plans, "device_name", lambda device: H200)
    monkeypatch.setattr(launch, "_tunes", lambda: True)
    monkeypatch.setenv("HF_INFCL_CACHE", str(tmp_path))
    device = torch.device("cpu")
    assert compile_plans._wanted(device)
    monkeypatch.setenv("HF_INFCL_COMPILE_PLANS", "0")
    assert not compile_plans._wanted(device)
    monkeypatch.delenv("HF_INFCL_COMPILE_PLANS")
    monkeypatch.setattr(launch, "_tunes", lambda: False)  # HF_INFCL_TRITON_AUTOTUNE=0: other configurations
    assert not compile_plans._wanted(device)
    monkeypatch.setattr(launch, "_tunes", lambda: True)
    own = launch.TUNING_STORE.path(H200, compile_plans.triton.__version__)
    own.parent.mkdir(parents=True)
    own.write_text("{}")  # this machine tuned something: its choices may not be the plan's
    assert not compile_plans._wanted(device)


def test_entries_of_changed_or_missing_kernels_are_skipped():
    kernel = plan_kernels.copy_kernel
    current = {**entry("copy_kernel"), "digest": compile_plans.source_digest(kernel)}
    assert compile_plans._jit_function(current) is kernel
    assert compile_plans._jit_function({**current, "source": "Triton's hash, unused"}) is kernel
    assert compile_plans._jit_function({**current, "digest": "an older source"}) is None
    undigested = {name: value for name, value in current.items() if name != "digest"}
    assert compile_plans._jit_function(undigested) is None
    assert compile_plans._jit_function(entry("gone_kernel")) is None
    assert compile_plans._jit_function(entry("NOT_A_KERNEL")) is None


def test_compiling_a_plan_builds_every_kernel_and_logs_the_one_that_fails(monkeypatch, caplog):
    built = []

    class Compiled:
        def __init__(self, name):
            self.name = name

        def _init_handles(self):
            built.append(self.name)

    class Kernel:
        def __init__(self, name):
            self.name = name

        def preload(self, specialization):
            if self.name == "bad":
                raise RuntimeError("ptxas failed")
            return Compiled(self.name)

    monkeypatch.setattr(compile_plans, "_jit_function", lambda entry: Kernel(entry["name"]))
    monkeypatch.setattr(compile_plans, "_make_device_caches", lambda kernels, device: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with caplog.at_level("DEBUG", logger="hf_infcl"):
        compile_plans._compile_in_parallel([entry("a"), entry("bad"), entry("c")], torch.device("cpu"))
    assert sorted(built) == ["a", "c"] and "ptxas failed" in caplog.text


def test_a_background_kernel_compiles_in_its_own_thread_and_the_plan_does_not_wait_for_it(monkeypatch):
    """A plan builds its other kernels before it returns; the background kernel's compile goes on
    in a thread that ``compiling`` reports until it is done, and a fork waits for it."""
    import threading

    release, built = threading.Event(), []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def preload(self, specialization):
            if self.name == "slow":
                assert release.wait(30)
            return types.SimpleNamespace(_init_handles=lambda: built.append(self.name))

    kernels = {name: Kernel(name) for name in ("fast", "slow", "other")}
    monkeypatch.setattr(compile_plans, "_jit_function", lambda entry: kernels[entry["name"]])
    monkeypatch.setattr(compile_plans, "_make_device_caches", lambda kernels, device: None)
    monkeypatch.setattr(compile_plans, "_BACKGROUND_KERNELS", [])
    monkeypatch.setattr(compile_plans, "_BACKGROUND_THREADS", {})
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert compile_plans.compiles_in_background(kernels["slow"]) is kernels["slow"]
    assert not compile_plans.compiling(kernels["slow"])  # nothing started yet
    compile_plans._compile_in_parallel([entry("slow"), entry("fast"), entry("other")], torch.device("cpu"))
    assert sorted(built) == ["fast", "other"]
    assert compile_plans.compiling(kernels["slow"]) and not compile_plans.compiling(kernels["fast"])
    compile_plans._compile_in_parallel([entry("slow")], torch.device("cpu"))  # another plan's, meanwhile
    release.set()
    compile_plans.wait_for_background(kernels["slow"], timeout=30)  # waits for both
    assert not compile_plans.compiling(kernels["slow"]) and sorted(built) == ["fast", "other", "slow", "slow"]


BACKGROUND_THEN_FORK_AND_EXIT = """
import os, sys, time, types, torch
from hf_infcl.ops.triton import compile_plans
done_file = sys.argv[1]
class Kernel:  # a background kernel whose compile takes a while and leaves a file when it ends
    def preload(self, specialization):
        time.sleep(float(specialization))
        with open(done_file, "a") as f:
            f.write("built " + specialization + "\\n")
        return types.SimpleNamespace(_init_handles=lambda: None)
slow = compile_plans.compiles_in_background(Kernel())
compile_plans._jit_function = lambda entry: slow
compile_plans._make_device_caches = lambda kernels, device: None
torch.cuda.set_device = lambda device: None
compile_plans._compile_in_parallel([{"specialization": "1.0"}], torch.device("cpu"))
print("compiling", compile_plans.compiling(slow))
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("compiling after fork", compile_plans.compiling(slow))
compile_plans._compile_in_parallel([{"specialization": "0.5"}], torch.device("cpu"))
print("compiling at exit", compile_plans.compiling(slow))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_and_the_process_exit_wait_for_a_background_compile(tmp_path):
    """A fork waits for the background compile (a child must not inherit a half-held lock), and a
    process that ends while one runs finishes it first (into Triton's cache, for the next process)."""
    done_file = tmp_path / "built.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", BACKGROUND_THEN_FORK_AND_EXIT, str(done_file)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["compiling True", "compiling after fork False",
                                        "compiling at exit True"]
    assert done_file.read_text().splitlines() == ["built 1.0", "built 0.5"]


def test_the_sigmoid_pass_takes_cublas_while_the_gluon_kernel_compiles_unless_gluon_is_asked(monkeypatch):
    """``sigmoid_logits="auto"`` takes the cuBLAS route while a plan builds the Gluon kernel in the
    background, and the Gluon route once it is built; ``"gluon"`` waits for it."""
    from hf_infcl.ops.triton import gluon_sigmoid

    if not gluon_sigmoid.available():
        pytest.skip("this Triton has no Gluon")
    assert compile_plans._in_background(gluon_sigmoid._sigmoid_tile_kernel)
    building, waited = [True], []
    monkeypatch.setattr(gluon_sigmoid, "usable", lambda queries, keys, has_mask: True)
    monkeypatch.setattr(compile_plans, "compiling", lambda kernel: building[0])

    def wait_for_background(kernel):
        waited.append(kernel)
        building[0] = False

    monkeypatch.setattr(compile_plans, "wait_for_background", wait_for_background)
    operands = types.SimpleNamespace(queries=None, keys=None)
    problem = types.SimpleNamespace(kernel=operands, gemm=operands, labels={})
    assert not TritonBlocks()._gluon_dots(problem) and not waited
    assert TritonBlocks(sigmoid_logits="gluon")._gluon_dots(problem)
    assert waited == [gluon_sigmoid._sigmoid_tile_kernel]
    assert TritonBlocks()._gluon_dots(problem)  # built: the Gluon route


def test_the_softmax_forward_takes_stats_while_the_gluon_kernel_compiles_unless_gluon_is_asked(monkeypatch):
    """``softmax_statistics="auto"`` takes the statistics kernel of .stats while a plan builds the
    Gluon kernel in the background, and the Gluon one once it is built; ``"gluon"`` waits for it."""
    from hf_infcl.ops.triton import gluon_stats

    if gluon_stats.gluon is None:
        pytest.skip("this Triton has no Gluon")
    assert compile_plans._in_background(gluon_stats._stats_tile_kernel)
    building, waited = [True], []
    monkeypatch.setattr(gluon_stats, "usable", lambda queries, keys: True)
    monkeypatch.setattr(gluon_stats, "AUTO_MIN_WORK", 256 * 384 * 768)  # these shapes' work, scaled down
    monkeypatch.setattr(compile_plans, "compiling", lambda kernel: building[0])

    def wait_for_background(kernel):
        waited.append(kernel)
        building[0] = False

    monkeypatch.setattr(compile_plans, "wait_for_background", wait_for_background)
    operands = types.SimpleNamespace(queries=torch.empty(256, 768), keys=torch.empty(384, 768))
    problem = types.SimpleNamespace(kernel=operands, bias=None, labels={})
    assert not TritonBlocks()._gluon_statistics(problem) and not waited
    assert TritonBlocks(softmax_statistics="gluon")._gluon_statistics(problem)
    assert waited == [gluon_stats._stats_tile_kernel]
    assert TritonBlocks()._gluon_statistics(problem)  # built: the Gluon kernel
    assert not TritonBlocks(softmax_statistics="triton")._gluon_statistics(problem)
    partial = types.SimpleNamespace(queries=torch.empty(200, 768), keys=operands.keys)
    assert not TritonBlocks()._gluon_statistics(types.SimpleNamespace(kernel=partial, bias=None, labels={}))
    narrow = types.SimpleNamespace(queries=torch.empty(256, 256), keys=torch.empty(384, 256))
    assert not TritonBlocks()._gluon_statistics(types.SimpleNamespace(kernel=narrow, bias=None, labels={}))
    assert TritonBlocks(softmax_statistics="gluon")._gluon_statistics(
        types.SimpleNamespace(kernel=narrow, bias=None, labels={}))  # by name: any width
    less_work = types.SimpleNamespace(queries=torch.empty(128, 768), keys=operands.keys)
    assert not TritonBlocks()._gluon_statistics(types.SimpleNamespace(kernel=less_work, bias=None, labels={}))
    # from c = AUTO_MAX_WIDTH on, .stats (more work than the narrower shapes: not the rule of work)
    for width, gluon_by_auto in ((gluon_stats.AUTO_MAX_WIDTH - 16, True), (gluon_stats.AUTO_MAX_WIDTH, False),
                                 (2 * gluon_stats.AUTO_MAX_WIDTH, False)):
        wide = types.SimpleNamespace(queries=torch.empty(256, width), keys=torch.empty(384, width))
        assert TritonBlocks()._gluon_statistics(
            types.SimpleNamespace(kernel=wide, bias=None, labels={})) == gluon_by_auto, width
        assert TritonBlocks(softmax_statistics="gluon")._gluon_statistics(
            types.SimpleNamespace(kernel=wide, bias=None, labels={}))  # by name: any width


def test_recording_lists_the_keys_met_and_the_kernels_compiled(monkeypatch):
    from triton import knobs

    def before(**hook):
        raise AssertionError("the recording's hook replaces this one while it runs")

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", before)
    monkeypatch.setattr(compile_plans, "_compile_in_parallel",
                        lambda entries, device: pytest.fail("nothing compiles from plans while recording"))
    with compile_plans.recording() as recorded:
        compile_plans.prepare(("one",), torch.device("cpu"))
        compile_plans.prepare(("one",), torch.device("cpu"))
        knobs.runtime.jit_post_compile_hook(fn=types.SimpleNamespace(jit_function=plan_kernels.copy_kernel),
                                            compile={"specialization_data": '{"name": "copy_kernel"}'})
    assert knobs.runtime.jit_post_compile_hook is before
    assert compile_plans._RECORDING is None
    assert recorded["keys"] == [repr(("one",))]
    assert recorded["kernels"] == [{"module": "tests.helpers.plan_kernels", "name": "copy_kernel",
                                    "digest": compile_plans.source_digest(plan_kernels.copy_kernel),
                                    "specialization": '{"name": "copy_kernel"}'}]


def test_the_source_digest_changes_with_a_kernels_source_and_line():
    kernel = plan_kernels.copy_kernel
    digest = compile_plans.source_digest(kernel)
    moved = types.SimpleNamespace(src=kernel.src, starting_line_number=kernel.starting_line_number + 1)
    edited = types.SimpleNamespace(src=kernel.src + "\n", starting_line_number=kernel.starting_line_number)
    same = types.SimpleNamespace(src=kernel.src, starting_line_number=kernel.starting_line_number)
    assert compile_plans.source_digest(same) == digest
    assert len({digest, compile_plans.source_digest(moved), compile_plans.source_digest(edited)}) == 3


# --------------------------------------------------------------------------------------------
# The shipped plans

SHIPPED = sorted(compile_plans.SHIPPED_DIRECTORY.glob("*.json.gz"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.name)
def test_every_shipped_plan_names_current_kernels_of_the_package(path):
    """Each entry names a JIT function of the package whose source is the one recorded: after a
    kernel changes, its plans are recorded again (scripts/record_compile_plans.py on that GPU),
    else a fresh machine's first call compiles that kernel after its plan, one kernel at a time."""
    import importlib

    from triton.runtime import JITFunction

    table = compile_plans._read(path)
    assert table["plans"] and all(table["plans"].values())
    stale = set()
    for plan in table["plans"].values():
        for entry_id in plan:
            entry = table["kernels"][entry_id]
            assert entry["module"].startswith("hf_infcl.ops.triton.")
            kernel = getattr(importlib.import_module(entry["module"]), entry["name"])
            assert isinstance(kernel, JITFunction)
            assert json.loads(entry["specialization"])["name"].endswith(entry["name"])
            if entry["digest"] != compile_plans.source_digest(kernel):
                stale.add(f"{entry['module']}.{entry['name']}")
    assert not stale, (f"kernels changed since {path.name} was recorded: {sorted(stale)}; record its plans "
                       "again with scripts/record_compile_plans.py on that GPU")


@pytest.mark.parametrize("device", [H200, "NVIDIA H100 80GB HBM3"])
def test_the_shipped_plans_list_the_gluon_statistics_kernel_where_auto_takes_it(device):
    """At 32k rows, as much work as the Gluon kernel's rule asks for at every width from
    ``gluon_stats.AUTO_MIN_WIDTH``, a plan lists that kernel exactly where ``softmax_statistics="auto"``
    takes it: below ``AUTO_MAX_WIDTH``. A plan past that bound that still listed it would compile it
    in the background for nothing, and a short process would wait for that compile at its exit."""
    from hf_infcl.ops.triton import gluon_stats

    rows = max(load_recording_script().SIZES.values())
    listed = {(dtype, width): "_stats_tile_kernel" in {entry["name"] for entry in compile_plans.shipped_plan(
                  device, "3.6.0", repr(key_of(dtype, width, rows, rows)))}
              for dtype in (torch.bfloat16, torch.float16, torch.float32) for width in COMMON_WIDTHS}
    expected = {(dtype, width): gluon_stats.AUTO_MIN_WIDTH <= width < gluon_stats.AUTO_MAX_WIDTH
                for dtype, width in listed}
    assert listed == expected


@pytest.mark.parametrize("device", [H200, "NVIDIA H100 80GB HBM3"])
def test_the_plans_of_the_h200_and_the_h100_cover_the_default_calls_at_the_common_widths(device):
    """The softmax call of every common width, dtype and size class has a plan, as the first call
    measured in benchmarks/README.md (32k rows and keys, c = 512, bf16) does. (The H100's were
    recorded on an H200 under the H100's name: ``record_compile_plans.py --as-device``.)"""
    path = compile_plans.plan_path(compile_plans.SHIPPED_DIRECTORY, device, "3.6.0")
    if not path.exists():
        pytest.fail(f"no shipped plans for the {device}: {path}")
    recorded_rows = load_recording_script().SIZES.values()  # one batch of each size class
    missing = [(dtype, width, rows) for dtype in (torch.bfloat16, torch.float16, torch.float32)
               for width in COMMON_WIDTHS for rows in recorded_rows
               if not compile_plans.shipped_plan(device, "3.6.0", repr(key_of(dtype, width, rows, rows)))]
    assert not missing


FRESH_FIRST_CALL = """
import json, sys, torch
import torch.nn.functional as F
import triton
from triton import knobs
from hf_infcl import contrastive_loss
from hf_infcl.ops import reference
from hf_infcl.ops.triton import compile_plans
from hf_infcl.ops.triton.device import device_name
rows, width, kind, calls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
compiles = []  # per call: (kernel, whether compiled ahead of its launch)
def record(**hook):
    compiles[-1].append((hook["fn"].jit_function.fn.__name__, hook["is_manual_warmup"]))
knobs.runtime.jit_post_compile_hook = record
features = [F.normalize(torch.randn(rows, width, device="cuda"), dim=1).bfloat16().requires_grad_()
            for _ in range(2)]
log_scale = torch.tensor(2.6593, device="cuda", requires_grad=True)
bias = torch.tensor(-10.0, device="cuda", requires_grad=True) if kind == "sigmoid" else None
leaves = [*features, log_scale] + ([bias] if bias is not None else [])
exact = [tensor.detach().double().requires_grad_() for tensor in leaves]
expected = reference.per_row_loss(exact[0], exact[1], exact[2].exp(), *exact[3:], loss=kind).mean()
expected_grads = torch.autograd.grad(expected, exact)
errors, building = [], []
for call in range(calls):
    compiles.append([])
    loss = contrastive_loss(*features, log_scale.exp(), bias, loss=kind)
    grads = torch.autograd.grad(loss, leaves)
    building.append(any(compile_plans.compiling(kernel) for kernel in compile_plans._BACKGROUND_KERNELS))
    errors.append([((got.double() - want).norm() / want.norm()).item()
                   for got, want in zip([loss, *grads], [expected, *expected_grads])])
    compile_plans.wait_for_background()
knobs.runtime.jit_post_compile_hook = None
plans = compile_plans.plan_path(compile_plans.SHIPPED_DIRECTORY, device_name(torch.device("cuda")),
                                triton.__version__)
print("RESULT " + json.dumps({"compiles": compiles, "errors": errors, "building": building,
                              "shipped": plans.exists()}))
"""


def fresh_first_call(tmp_path, rows: int, width: int, loss: str = "softmax",
                     calls: int = 1) -> tuple[dict, str]:
    """A fresh process's first ``calls`` calls (bf16, learnable scale, and bias for the sigmoid
    loss) with an empty Triton cache and an empty tuning store, as on a fresh machine: per call,
    its ``compiles`` (kernel, compiled ahead of its launch), the norm-wise relative ``errors`` of
    its loss and gradients from the float64 reference, and whether a plan was still ``building``
    a kernel in the background after it (each call waits for that before the next); whether plans
    are ``shipped`` for this GPU; and the process's stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "HF_INFCL_CACHE": str(tmp_path / "store")}
    env.pop("HF_INFCL_TRITON_AUTOTUNE", None)
    env.pop("HF_INFCL_COMPILE_PLANS", None)
    done = subprocess.run([sys.executable, "-c", FRESH_FIRST_CALL, str(rows), str(width), loss, str(calls)],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ")[-1]), done.stderr


@pytest.mark.gpu
def test_a_fresh_machines_first_call_finds_its_kernels_compiled_by_the_plan(tmp_path):
    """At 8k x 512 (a shipped plan's kind of call) the first call compiles its plan's kernels in
    parallel, then compiles nothing itself, and its loss and gradients are the float64
    reference's (bf16's norm-wise 1e-2, docs/contract.md)."""
    result, _ = fresh_first_call(tmp_path, 8192, 512)
    if not result["shipped"]:
        pytest.skip("no compile plans are shipped for this GPU and Triton release")
    compiles = result["compiles"][0]
    ahead = [name for name, planned in compiles if planned]
    assert len(ahead) >= 5 and len(ahead) == len(compiles), compiles
    assert max(result["errors"][0]) < 1e-2, result["errors"]


@pytest.mark.gpu
def test_a_fresh_machines_first_sigmoid_call_takes_cublas_while_its_plan_builds_the_gluon_kernel(tmp_path):
    """At 8k x 768 the first sigmoid call compiles nothing after its plan and does not wait for the
    Gluon kernel, which the plan builds in the background (the call takes the cuBLAS route); the
    next call, once it is built, takes the Gluon kernel without compiling it. Both calls' loss and
    gradients are the float64 reference's."""
    from hf_infcl.ops.triton import gluon_sigmoid

    if not gluon_sigmoid.usable(*[torch.ones(8, 16, device=CUDA, dtype=torch.bfloat16)] * 2, has_mask=False):
        pytest.skip("the Gluon kernel needs a Hopper GPU and a Triton with Gluon")
    result, _ = fresh_first_call(tmp_path, 8192, 768, loss="sigmoid", calls=2)
    if not result["shipped"]:
        pytest.skip("no compile plans are shipped for this GPU and Triton release")
    first, second = result["compiles"]
    gluon_built_ahead = ["_sigmoid_tile_kernel", True]  # (a list: through JSON)
    assert first and all(planned for _, planned in first), first
    assert gluon_built_ahead in first + second, result["compiles"]
    assert result["building"][0] or gluon_built_ahead in first  # the compile may end during the call
    assert all(planned for _, planned in second) and not result["building"][1], result
    assert max(max(errors) for errors in result["errors"]) < 1e-2, result["errors"]


@pytest.mark.gpu
def test_a_tuning_first_call_finds_every_candidate_compiled_before_the_autotuner_times_it(tmp_path):
    """At a width with no shipped choice (c = 200, 8k rows) both autotuned kernels tune: their
    candidates are all compiled ahead, none while the autotuner times them, and the loss and
    gradients are the float64 reference's."""
    result, stderr = fresh_first_call(tmp_path, 8192, 200)
    assert "hf_infcl: autotuning" in stderr  # no saved choice: it tuned
    tuned = [(name, ahead) for name, ahead in result["compiles"][0]
             if name in ("_stats_kernel", "_grad_tile_kernel")]
    assert sum(ahead for _, ahead in tuned) >= 8 and all(ahead for _, ahead in tuned), tuned
    assert max(result["errors"][0]) < 1e-2, result["errors"]


def load_recording_script():
    import importlib.util

    path = ROOT / "scripts" / "record_compile_plans.py"
    spec = importlib.util.spec_from_file_location("record_compile_plans", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_recording_script_lists_its_cases_and_refuses_bad_options(capsys):
    script = load_recording_script()
    assert script.main(["--dry-run", "--widths", "512", "--dtypes", "bf16", "--losses", "sigmoid"]) == 0
    assert capsys.readouterr().out.splitlines() == ["sigmoid 512 bf16 0", "sigmoid 512 bf16 1",
                                                    "sigmoid 512 bf16 2", "3 cases"]
    for size_class, rows in script.SIZES.items():  # each case's rows lie in its class
        assert launch.problem_size_class(rows, rows) == size_class
    for argv, message in [(["--jobs", "0"], "--jobs must be positive"),
                          (["--size-classes", "3"], "--size-classes: unknown [3]")]:
        with pytest.raises(SystemExit):
            script.parse_options(argv)
        assert message in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The autotuner's candidates, compiled in parallel before it times them


def test_the_candidates_compile_with_the_arguments_the_autotuner_launches_them_with(monkeypatch, caplog):
    """Every candidate the width keeps, with its own copy of the tensor descriptors (whose block
    shapes its pre-hook sets), its options and the heuristics of its block sizes; a candidate that
    fails to compile is logged and the others are built."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    def set_blocks(arguments):
        arguments["desc"].block_shape = [arguments["BLOCK_M"], arguments["BLOCK_K"]]

    warmed, built = [], []

    class Compiled:
        def __init__(self, arguments):
            self.arguments = arguments

        def _init_handles(self):
            built.append(self.arguments["BLOCK_M"])

    class Body:
        arg_names = ["x", "desc", "c"]

        def warmup(self, grid, **arguments):
            if arguments["BLOCK_M"] == 32:
                raise RuntimeError("ptxas ran out of registers")
            warmed.append(arguments)
            return Compiled(arguments)

    shapes = [(64, 64, 32, 4, 3), (128, 64, 64, 8, 3), (32, 64, 32, 4, 4), (128, 128, 256, 8, 2)]
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s,
                             pre_hook=set_blocks) for m, n, k, w, s in shapes]
    even_k = lambda arguments: arguments["c"] % arguments["BLOCK_K"] == 0  # noqa: E731
    kernel = types.SimpleNamespace(name="test-r1", body=Body(), tuner=types.SimpleNamespace(configs=configs),
                                   heuristics={"EVEN_K": even_k})
    monkeypatch.setattr(compile_plans, "_make_device_caches", lambda kernels, device: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    x = torch.zeros(64, 96)
    descriptor = TensorDescriptor.from_tensor(x, [16, 16])
    with caplog.at_level("DEBUG", logger="hf_infcl"):
        compile_plans.compile_candidates(kernel, lambda meta: (1,), (x, descriptor), {"c": 96},
                                         torch.device("cpu"))
    # c = 96: no K step above 128; the 32-row candidate fails
    assert sorted(built) == [64, 128] and "out of registers" in caplog.text
    for arguments in warmed:
        assert arguments["x"] is x and arguments["c"] == 96
        assert arguments["desc"] is not descriptor
        assert arguments["desc"].block_shape == [arguments["BLOCK_M"], arguments["BLOCK_K"]]
        assert arguments["EVEN_K"] == (96 % arguments["BLOCK_K"] == 0)
    assert {(a["num_warps"], a["num_stages"]) for a in warmed} == {(4, 3), (8, 3)}
    assert descriptor.block_shape == [16, 16]  # the launch's own descriptor is left as it was


def test_the_candidates_compile_only_when_the_launch_tunes(monkeypatch, tmp_path):
    """The tuning store says whether a launch tunes: not with a saved choice, yes without one."""
    from hf_infcl.ops.triton.tuning_store import TuningStore

    class Tuner:
        cache = {}

    store = TuningStore(tmp_path, shipped=None)
    with store.tuned(Tuner(), "grad_tile", (512, 2, "torch.bfloat16"), H200, "3.6.0", dict) as tunes:
        assert tunes
        Tuner.cache[(512, 2, "torch.bfloat16")] = types.SimpleNamespace(
            kwargs={"BLOCK_M": 64}, num_warps=4, num_stages=3)
    with store.tuned(Tuner(), "grad_tile", (512, 2, "torch.bfloat16"), H200, "3.6.0", dict) as tunes:
        assert not tunes  # in the tuner's cache now


def test_a_launch_compiles_its_candidates_first_only_when_it_tunes(monkeypatch, tmp_path):
    """launch(): a key without a saved choice compiles its candidates, then tunes (and saves); the
    same key in a later process loads the saved choice and compiles nothing ahead."""
    import triton

    from hf_infcl.ops.triton.tuning_store import TuningStore

    class Tuner:
        keys, arg_names = ["c", "size_class"], ["x", "c", "size_class"]

        def __init__(self):
            self.cache, self.best_config = {}, None

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                key = (args[1], args[2], "torch.float32")
                self.cache.setdefault(key, triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=3))
                self.best_config = self.cache[key]
            return run

    compiled = []
    monkeypatch.setattr(launch, "_tunes", lambda: True)
    monkeypatch.setattr(launch, "device_name", lambda device: H200)
    monkeypatch.setattr(launch, "TUNING_STORE", TuningStore(tmp_path, shipped=None))
    monkeypatch.setattr(compile_plans, "compile_candidates",
                        lambda kernel, grid, args, kwargs, device: compiled.append(args))
    x = torch.zeros(4)
    for _process in range(2):
        monkeypatch.setattr(launch, "_CHOSEN", {})
        kernel = launch.TunedKernel("test-r1", None, {}, Tuner(), triton.Config)
        launch.launch(kernel, (1,), torch.device("cpu"), x, 512, 2)
        assert kernel.tuner.best_config.kwargs == {"BLOCK_M": 64}
        assert compiled == [(x, 512, 2)]  # the first process's launch only: the second loaded


def test_candidates_that_cannot_be_compiled_ahead_leave_it_to_the_autotuner(caplog):
    """Whatever fails before the threads start (here a kernel without a JIT body) is logged; the
    launch goes on to the autotuner, which compiles its candidates itself."""
    kernel = types.SimpleNamespace(name="stand-in-r0", body=None, tuner=None, heuristics={})
    with caplog.at_level("DEBUG", logger="hf_infcl"):
        compile_plans.compile_candidates(kernel, (1,), (), {}, torch.device("cpu"))
    assert "compiling the candidates of stand-in-r0 in parallel failed" in caplog.text


def test_the_recording_script_reads_a_cases_process_and_reports_a_failed_one(monkeypatch, capsys):
    script = load_recording_script()
    outcomes = {
        "512": subprocess.CompletedProcess([], 0, 'RECORDED {"keys": ["k"], "kernels": [], "seconds": 1.0}\n',
                                           "hf_infcl: autotuning stats-r5 for (512, 2)"),
        "768": subprocess.CompletedProcess([], 1, "", "CUDA error: out of memory"),
    }
    monkeypatch.setattr(script.subprocess, "run", lambda command, **options: outcomes[command[5]])
    recorded = script.record_case(("softmax", 512, "bf16", 2), {})
    assert recorded == {"keys": ["k"], "kernels": [], "seconds": 1.0, "tuned": True}
    assert script.record_case(("softmax", 768, "bf16", 2), {}) is None
    assert "softmax 768 bf16 2: the first call failed" in capsys.readouterr().err


def test_the_recording_process_records_the_case_that_tune_shipped_runs(tmp_path):
    """The recording's child process runs ``tune_shipped.run_case`` (here a stand-in that says what
    it was asked) inside ``compile_plans.recording`` and prints what was recorded; each case also
    runs on the route a first call takes while its plan builds a Gluon kernel: the sigmoid loss's
    cuBLAS route, the softmax loss's statistics kernel of .stats."""
    script = load_recording_script()
    (tmp_path / "tune_shipped.py").write_text(
        "from hf_infcl.ops.triton import compile_plans\n"
        "def run_case(loss, width, dtype, size_class, rows=None, backend='triton'):\n"
        "    assert compile_plans._RECORDING is not None\n"
        "    import torch\n"
        "    route = backend if isinstance(backend, str) else (\n"
        "        backend.sigmoid_logits if loss == 'sigmoid' else backend.softmax_statistics)\n"
        "    try:\n"
        "        device = torch.cuda.get_device_name(0)\n"
        "    except (AssertionError, RuntimeError):  # no CUDA\n"
        "        device = None\n"
        "    print('CASE', loss, width, dtype, size_class, rows, route, '|', device)\n"
        "    return 1.5\n")
    for loss, routes, as_device in [("sigmoid", ["triton", "gemm"], None),
                                    ("softmax", ["triton", "triton"], "NVIDIA H100 80GB HBM3")]:
        command = [sys.executable, "-c", script.CHILD, str(tmp_path), loss, "768", "fp16", "0", "1024"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("RECORD_AS_DEVICE", None)
        if as_device:  # --as-device: the case runs under another GPU's name
            env["RECORD_AS_DEVICE"] = as_device
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        cases = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("CASE")]
        assert [case for case, _ in cases] == [f"CASE {loss} 768 fp16 0 1024 {route}" for route in routes]
        real = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "None"
        assert {device for _, device in cases} == {as_device or real}
        assert json.loads(done.stdout.split("RECORDED ")[-1]) == {"keys": [], "kernels": [], "seconds": 1.5}


def test_refreshing_digests_keeps_entries_whose_parameters_are_unchanged(tmp_path, capsys):
    """``--refresh-digests``: an entry whose kernel's body changed gets the current digest (under its
    new id, in every plan that lists it); one whose parameters changed stays stale, and the script
    says so and fails."""
    script = load_recording_script()
    path = compile_plans.plan_path(tmp_path, H200, "3.6.0")
    signature = {name: "*fp32" for name in plan_kernels.copy_kernel.arg_names}
    same_parameters = json.dumps({"name": "copy_kernel", "signature": signature})
    body_edited = dict(entry("copy_kernel", same_parameters), digest="an older body")
    compile_plans.add_plan(path, "first", [body_edited])
    compile_plans.add_plan(path, "second", [body_edited])
    assert script.main(["--refresh-digests", "--shipped", str(tmp_path)]) == 0
    current = dict(body_edited, digest=compile_plans.source_digest(plan_kernels.copy_kernel))
    for key in ("first", "second"):
        assert compile_plans.shipped_plan(H200, "3.6.0", key, tmp_path) == [current]
    assert len(compile_plans._read(path)["kernels"]) == 1

    parameters_changed = dict(entry("copy_kernel", json.dumps({"signature": {"source": "*fp32"}})),
                              digest="an older kernel")
    compile_plans.add_plan(path, "third", [parameters_changed])
    assert script.main(["--refresh-digests", "--shipped", str(tmp_path)]) == 1
    table = compile_plans._read(path)  # (shipped_plan keeps the file it read first)
    assert [table["kernels"][entry_id] for entry_id in table["plans"]["third"]] == [parameters_changed]
    assert "record these kernels' plans again on the GPU: ['tests.helpers.plan_kernels.copy_kernel']" in \
        capsys.readouterr().err
