"""The SwiGLU gate of a packed gate/up output in one small kernel: the gate of
`mrv2::norm_linear` where its rows are too many for the gate inside the GEMM.

    silu_mul(y [..., N]) -> [..., N / 2] in y's dtype
        g, u = y[..., :N/2], y[..., N/2:]
        == round(round(silu(g)) * u)               (as silu_mul_ref: two roundings)

docs/design.md, section "RMSNorm, projection and gate".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._device import cdiv, interpreting, pdl_meta, pdl_release, pdl_wait, round_to
from ._launch import Launch, LayoutMemo, launch_here, layout

BLOCK = 1024  # output columns a program writes


def silu_mul_ref(y: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of y's halves, op by op in y's dtype."""
    g, u = y.chunk(2, dim=-1)
    return F.silu(g) * u


@triton.jit
def _silu_mul_kernel(y_ptr, out_ptr, N_OUT, stride_ym, stride_om,
                     BLOCK: tl.constexpr, RNE_BF16: tl.constexpr, PDL: tl.constexpr):
    # Program (m, j): out[m, j*BLOCK : (j+1)*BLOCK] of y [M, 2 * N_OUT] (unit stride along N).
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N_OUT
    pdl_wait(PDL)  # Note [programmatic dependent launch]: y is the kernel before's output
    g = tl.load(y_ptr + m * stride_ym + n, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + m * stride_ym + N_OUT + n, mask=ok, other=0.0).to(tl.float32)
    pdl_release(PDL)
    ty = out_ptr.dtype.element_ty
    s = round_to(g / (1.0 + tl.exp(-g)), ty, RNE_BF16).to(tl.float32)  # torch's silu, rounded
    tl.store(out_ptr + m * stride_om + n, round_to(s * u, ty, RNE_BF16), mask=ok)


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """Launcher (module docstring). y [..., N] with N even and unit stride
    along N, on a GPU or under the interpreter. A layout seen before
    launches through its bound launch (Note [checked layouts] in _launch.py)."""
    N = y.shape[-1]
    assert N % 2 == 0, f"silu_mul: the gate's and the up projection's halves need an even N, got {N}"
    plan, _ = _LAUNCHES.entry(y.device, (layout(y),), lambda: _GatePlan(y))
    return plan.run(y)


_LAUNCHES = LayoutMemo()


class _GatePlan:
    """One layout's launch: y's rows M, N, and the bound launch."""

    def __init__(self, y: torch.Tensor) -> None:
        N = y.shape[-1]
        self.N, self.M, self.n_out = N, y.numel() // N if N else 0, N // 2
        self.shape = (*y.shape[:-1], self.n_out)
        meta = dict(BLOCK=BLOCK, RNE_BF16=interpreting() and y.dtype == torch.bfloat16,
                    num_warps=4, **pdl_meta(y.device))
        self.launch = Launch(_silu_mul_kernel, (self.M, cdiv(self.n_out, BLOCK)), meta, bind=y.is_cuda)

    def run(self, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=y.dtype, device=y.device)
        if self.M == 0 or self.n_out == 0:
            return out
        y2 = y.reshape(self.M, self.N)
        if y2.stride(-1) != 1:
            y2 = y2.contiguous()
        launch_here(self.launch, (y2, out, self.n_out, y2.stride(0), self.n_out))
        return out
