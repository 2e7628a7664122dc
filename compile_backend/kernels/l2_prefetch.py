"""Bytes of a tensor brought from HBM into L2, without reading them anywhere.

    l2_prefetch(t [any shape, contiguous], nbytes=None, programs=8) -> bytes asked for

Hopper's `cp.async.bulk.prefetch.L2.global` asks for a range and returns at
once: nothing lands in a register or shared memory, and L2, where global
memory is coherent, sees any later write. So a prefetch changes no value
and is safe anywhere in a stream: issued for the next GEMM's weight just
before a latency-bound kernel (decode attention), HBM can stream the weight
while that kernel leaves it idle (Note [weight prefetch into L2],
docs/design.md, "Hiding the fixed cost between kernels"). Only on CUDA
devices of capability 9.0+; elsewhere (CPU, interpreter, older GPUs, ROCm)
it issues nothing and returns 0. The reference is the identity.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import _cuda_major, interpreting, pdl_meta, pdl_release, pdl_wait

CHUNK = 16 << 10  # bytes per prefetch instruction (a multiple of 16)
LANES = 128  # prefetch instructions a program issues at once (one per thread at 4 warps)


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr,
                        PDL: tl.constexpr):
    # base_ptr: uint8, 16-byte aligned; nbytes a multiple of 16. Program p
    # issues chunks p * LANES + lane, then every num_programs * LANES after.
    # Under PDL the prefetches go out before the wait (they read nothing:
    # Note [programmatic dependent launch] in compile_backend/kernels/_device.py),
    # and the release comes after it, so the kernel after this one still
    # starts only once every kernel before this one has completed.
    lanes = tl.arange(0, LANES)
    n_chunks = tl.cdiv(nbytes, CHUNK)
    step = tl.num_programs(0) * LANES
    for c0 in range(tl.program_id(0) * LANES, n_chunks, step):
        c = c0 + lanes
        ok = c < n_chunks
        off = tl.where(ok, c.to(tl.int64) * CHUNK, 0)  # lanes past the end: the first 16 bytes
        size = tl.where(ok, tl.minimum(nbytes - off, CHUNK), 16).to(tl.int32)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                                  "=r,l,r", [base_ptr + off, size], dtype=tl.int32,
                                  is_pure=False, pack=1)
    pdl_wait(PDL)
    pdl_release(PDL)


def prefetch_supported(t: torch.Tensor) -> bool:
    """Can `l2_prefetch` issue anything for `t` (module docstring)?"""
    if not t.is_cuda or interpreting() or torch.version.hip:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _cuda_major(index) >= 9


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None, programs: int = 8) -> int:
    """Launcher: prefetch the first `nbytes` of contiguous `t` (all of it by
    default) into L2 on the current stream, from `programs` programs; the
    bytes asked for (rounded down to 16, from a 16-byte aligned start), or 0
    where nothing was issued (not supported here, or nothing to ask for)."""
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ValueError("l2_prefetch: give a contiguous tensor (its bytes are one range); got "
                         f"{type(t).__name__}" + (f" with strides {tuple(t.stride())}"
                                                  if isinstance(t, torch.Tensor) else ""))
    if programs < 1:
        raise ValueError(f"l2_prefetch: programs must be >= 1, got {programs}")
    total = t.numel() * t.element_size()
    if nbytes is None:
        nbytes = total
    if not 0 <= nbytes <= total:
        raise ValueError(f"l2_prefetch: nbytes must be in [0, {total}] (the tensor's size), got {nbytes}")
    if not prefetch_supported(t):
        return 0
    skip = (-t.data_ptr()) % 16  # to the first 16-byte boundary
    nbytes = max(0, nbytes - skip) // 16 * 16
    if nbytes == 0:
        return 0
    base = t.reshape(-1).view(torch.uint8)[skip:]
    grid = (max(1, min(programs, triton.cdiv(nbytes, CHUNK * LANES))),)
    _l2_prefetch_kernel[grid](base, nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=4,
                              **pdl_meta(t.device))
    return nbytes
