"""A Triton kernel for the compile plans' tests to name (tests/test_compile_plans.py)."""

import triton
import triton.language as tl


@triton.jit
def copy_kernel(source, target, count, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(target + offsets, tl.load(source + offsets, mask=offsets < count), mask=offsets < count)


NOT_A_KERNEL = 3
