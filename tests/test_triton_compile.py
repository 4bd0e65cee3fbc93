"""The statistics and gradient-tile kernels compile for Hopper (sm_90) on a machine without a GPU, with
and without the score filter and its guide, in each loss and direction; so do the kernel that
counts and lists the guided filter's left-out entries and the one-pass Matryoshka kernels.

The interpreter (``tests/helpers/triton_interpreted.py``) runs the kernels as Python, so it cannot see
what only Triton's compiler rejects: a name bound in one branch of a runtime ``if`` and used after it,
or a Python constant that the compiler makes a tensor, so that a branch on it stops being static.
Each variant is compiled here, to the cubin, with the ptxas that Triton ships.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the kernels compile only outside the interpreter", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_infcl.ops.triton import grad_tile, left_out, matryoshka, stats  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
_INDEX_POINTERS = {"row_group_ptr", "key_group_ptr", "positive_ptr", "query_id_ptr", "key_owner_ptr",
                   "row_id_ptr"}
# the guided score filter's left-out counts and list (hf_infcl.ops.triton.left_out), and the
# Matryoshka prefixes' segment bounds (hf_infcl.ops.triton.matryoshka)
_INT32_POINTERS = {"counts_ptr", "entries_ptr", "count_ptr", "bounds_ptr"}


def _signature(kernel, half_pointers: set[str]) -> dict[str, str]:
    """Argument types as a launch with bf16 features, int64 indices and fp32 statistics gives them."""
    signature = {}
    for name in kernel.arg_names:
        if name.isupper():
            signature[name] = "constexpr"
        elif name in half_pointers:
            signature[name] = "*bf16"
        elif name in _INDEX_POINTERS:
            signature[name] = "*i64"
        elif name in _INT32_POINTERS:
            signature[name] = "*i32"
        elif name.endswith(("_ptr", "_desc")):
            signature[name] = "*fp32"
        else:
            signature[name] = "i64" if name == "key_offset" else "i32"
    return signature


def _compile(kernel, half_pointers: set[str], switches: dict) -> None:
    compiled = triton.compile(ASTSource(kernel, _signature(kernel, half_pointers), switches), target=HOPPER,
                              options={"num_warps": 8, "num_stages": 3})
    assert compiled.asm["cubin"]


# (loss, direction): the statistics kernel's runtime branches under the filter
STATS_VARIANTS = {
    "softmax-fused-columns": dict(SIGMOID=False, FUSED_COLUMNS=True, COLUMNS=False),
    "softmax-keys-outer": dict(SIGMOID=False, FUSED_COLUMNS=False, COLUMNS=True),
    "sigmoid-rows": dict(SIGMOID=True, FUSED_COLUMNS=False, COLUMNS=False),
}


# the filter's switches: none, on the model's own scores, on a guide's
FILTERS = {"no-filter": dict(FILTER=False, GUIDE=False), "filter": dict(FILTER=True, GUIDE=False),
           "guide": dict(FILTER=True, GUIDE=True)}


def _stats_switches(variant: str, filter_name: str, hardness: int = 0) -> dict:
    return dict(HAS_BIAS=True, HAS_MASK=False, PRECISION="tf32", UPCAST=False, HARDNESS=hardness,
                **FILTERS[filter_name], GROUP_POSITIVES=False,
                BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, EVEN_K=True, EVEN_GUIDE_K=True, ROUND_GUIDE=False,
                FULL=True, LOG2=True, **STATS_VARIANTS[variant])


_STATS_HALF_POINTERS = {"outer_ptr", "inner_ptr", "guide_outer_ptr", "guide_inner_ptr"}


@pytest.mark.parametrize("hardness", [0, 1])
@pytest.mark.parametrize("filter_name", list(FILTERS))
@pytest.mark.parametrize("variant", list(STATS_VARIANTS))
def test_stats_kernel_compiles_for_hopper(variant, filter_name, hardness):
    if hardness and variant != "softmax-fused-columns":
        pytest.skip("the hardness offset is of the softmax rows")
    _compile(stats._stats_kernel, _STATS_HALF_POINTERS, _stats_switches(variant, filter_name, hardness))


@pytest.mark.parametrize("group_positives", [False, True])
@pytest.mark.parametrize("listing", [False, True], ids=["count", "list"])
def test_left_out_kernel_compiles_for_hopper(listing, group_positives):
    """Counting each row's left-out entries (a row sum per tile), and listing them (an atomic, scans
    and scattered stores in a runtime branch), both directions' flags, with the group mask or
    several positives."""
    _compile(left_out._find_left_out_kernel, {"guide_q_ptr", "guide_k_ptr"},
             dict(HAS_MASK=not group_positives, GROUP_POSITIVES=group_positives, COLUMNS=True, LIST=listing,
                  PRECISION="tf32", UPCAST=False, ROUND_GUIDE=False, EVEN_K=True, FULL=not listing,
                  BLOCK_M=128, BLOCK_N=128, BLOCK_K=64))


GRAD_VARIANTS = {
    "softmax-symmetric": dict(SIGMOID=False, ONE_PASS=False, COLUMNS=True),
    "softmax-rows": dict(SIGMOID=False, ONE_PASS=False, COLUMNS=False),
    "sigmoid": dict(SIGMOID=True, ONE_PASS=False, COLUMNS=False),
    "sigmoid-one-pass": dict(SIGMOID=True, ONE_PASS=True, COLUMNS=False),
}


@pytest.mark.parametrize("group_positives", [False, True])
@pytest.mark.parametrize("filter_name", [*FILTERS, "clamped"])
@pytest.mark.parametrize("variant", list(GRAD_VARIANTS))
def test_grad_tile_kernel_compiles_for_hopper(variant, filter_name, group_positives):
    """"clamped": no filter, the exponents clamped at 0 (the listed backward of
    hf_infcl.ops.triton.left_out)."""
    clamped = filter_name == "clamped"
    if clamped and variant.startswith("sigmoid"):
        pytest.skip("the exponents clamped are the softmax loss's")
    switches = dict(HAS_BIAS=True, HAS_MASK=False, PRECISION="tf32", UPCAST=False, HARDNESS=0,
                    **FILTERS["no-filter" if clamped else filter_name], CLAMP=clamped,
                    GROUP_POSITIVES=group_positives, SCALED_G=True, TMA=False,
                    BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EVEN_K=True, EVEN_GUIDE_K=True, ROUND_GUIDE=False,
                    FULL=not group_positives, LOG2=True, **GRAD_VARIANTS[variant])
    _compile(grad_tile._grad_tile_kernel,
             {"q_ptr", "k_ptr", "q_desc", "k_desc", "g_ptr", "guide_q_ptr", "guide_k_ptr"}, switches)


# (loss, direction) of the one-pass Matryoshka kernels; every variant with the group mask and without
PREFIX_VARIANTS = {
    "softmax-rows": dict(SIGMOID=False, COLUMNS=False),
    "softmax-columns": dict(SIGMOID=False, COLUMNS=True),
    "sigmoid-rows": dict(SIGMOID=True, COLUMNS=False),
}


@pytest.mark.parametrize("has_mask", [False, True], ids=["nomask-even-segments", "mask-masked-segments"])
@pytest.mark.parametrize("variant", list(PREFIX_VARIANTS))
def test_matryoshka_kernels_compile_for_hopper(variant, has_mask):
    """Five terms, each term's statistics in its column of the running arrays (statistics), and
    the terms walked from the widest with a segment taken off after each (gradient tiles); the
    group mask with the masked loads of prefixes off the K step, or neither."""
    even = not has_mask
    switches = dict(TERMS=5, HAS_BIAS=True, HAS_MASK=has_mask, PRECISION="tf32", UPCAST=False,
                    BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EVEN_SEGMENTS=even, FULL=not has_mask,
                    LOG2=not PREFIX_VARIANTS[variant]["SIGMOID"], **PREFIX_VARIANTS[variant])
    _compile(matryoshka._prefix_stats_kernel, {"outer_ptr", "inner_ptr"},
             dict(switches, TERMS_P2=8, FUSED_COLUMNS=variant == "softmax-rows"))
    if variant != "softmax-columns":  # the gradient tiles are (rows, keys) whatever the statistics
        _compile(matryoshka._prefix_grad_kernel, {"q_ptr", "k_ptr", "h_ptr"},
                 dict(switches, COLUMNS=variant == "softmax-rows", SCALED_G=True))
