"""RMSNorm of each row in one small kernel: the norm of `mrv2::norm_linear`
where its rows are too many for the norm inside the GEMM.

    rms_norm(x [..., K], weight [K], eps) -> [..., K] in x's dtype
        h = round(x * rsqrt(mean_k x^2 + eps))     (fp32 statistics, rounded to x's dtype)
        == round(h * weight)                        (as rms_norm_ref: two roundings)

One program per row; every row is read twice (the second time from L1/L2).
docs/design.md, section "RMSNorm, projection and gate".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import interpreting, next_pow2, pdl_meta, pdl_release, pdl_wait, round_to
from ._launch import Launch, LayoutMemo, launch_here, layout

MAX_BLOCK_K = 4096  # columns a program holds at once (K = 4096: one pass each)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Llama family computes it: fp32 statistics, the
    normalized x rounded to x's dtype, then times the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, K, stride_xm, stride_om, eps,
                     BLOCK_K: tl.constexpr, RNE_BF16: tl.constexpr, PDL: tl.constexpr):
    # Program m: row m of x [M, K] and out [M, K] (unit stride along K).
    m = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + m * stride_xm
    o_row = out_ptr + m * stride_om
    offs = tl.arange(0, BLOCK_K)
    pdl_wait(PDL)  # Note [programmatic dependent launch]: x may be the kernel before's output
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        xk = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        ss += xk * xk
    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    pdl_release(PDL)
    ty = out_ptr.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        ok = k < K
        xk = tl.load(x_row + k, mask=ok, other=0.0).to(tl.float32)
        h = round_to(xk * rstd, ty, RNE_BF16).to(tl.float32)  # rounded as the reference rounds it
        w = tl.load(w_ptr + k, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_row + k, round_to(h * w, ty, RNE_BF16), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launcher (module docstring). x [..., K] with unit stride along K, on a
    GPU or under the interpreter; weight [K] of x's dtype; eps >= 0. The
    caller checks the operands (norm_linear's checks). A layout seen before
    launches through its bound launch (Note [checked layouts] in _launch.py)."""
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    plan, _ = _LAUNCHES.entry(x.device, (layout(x, weight), float(eps)), lambda: _NormPlan(x, eps))
    return plan.run(x, weight)


_LAUNCHES = LayoutMemo()


class _NormPlan:
    """One layout's launch: x's rows M, K, and the bound launch."""

    def __init__(self, x: torch.Tensor, eps: float) -> None:
        K = x.shape[-1]
        self.K, self.M, self.shape, self.eps = K, x.numel() // K if K else 0, x.shape, float(eps)
        block_k = min(MAX_BLOCK_K, next_pow2(K))
        meta = dict(BLOCK_K=block_k, RNE_BF16=interpreting() and x.dtype == torch.bfloat16,
                    num_warps=4 if block_k <= 2048 else 8, **pdl_meta(x.device))
        self.launch = Launch(_rms_norm_kernel, (self.M,), meta, bind=x.is_cuda)

    def run(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        if self.M == 0:
            return out
        x2 = x.reshape(self.M, self.K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        launch_here(self.launch, (x2, weight, out, self.K, x2.stride(0), self.K, self.eps))
        return out
