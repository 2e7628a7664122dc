"""A real Triton kernel made a JITFunction whatever TRITON_INTERPRET says, so
that a CPU test can have it compiled for a GPU target without a GPU (what
tests/runtime/test_kernel_workers.py's compile worker does)."""

import triton.language as tl
from triton.runtime.jit import JITFunction


def scale(x_ptr, y_ptr, n, s, BLOCK: tl.constexpr):
    # Program p: y[p*BLOCK : (p+1)*BLOCK] = x * s (masked to n)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, x * s, mask=i < n)


scale = JITFunction(scale)  # the module's name for it is the function's: how a worker finds it
