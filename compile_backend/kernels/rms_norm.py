"""RMSNorm of each row in one small kernel: the norm of `mrv2::norm_linear`
where its rows are too many for the norm inside the GEMM; with a residual,
the add before it too (`mrv2::residual_norm_linear` at wide rows).

    rms_norm(x [..., K], weight [K], eps) -> [..., K] in x's dtype
        h = round(x * rsqrt(mean_k x^2 + eps))     (fp32 statistics, rounded to x's dtype)
        == round(h * weight)                        (as rms_norm_ref: two roundings)
    add_rms_norm(x, residual, weight, eps) -> (s, rms_norm(s, weight, eps)),  s = round(x + residual)

One program per row; every row is read twice (the second time from L1/L2).
docs/design.md, sections "RMSNorm, projection and gate", "Residual, norm and projection".
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
def _row(x_row, r_row, k, ok, ty: tl.constexpr, ADD: tl.constexpr, RNE_BF16: tl.constexpr):
    """x's columns k of one row in fp32; with ADD, x + residual rounded to
    x's dtype first (torch's add: fp32 sum, one rounding)."""
    xk = tl.load(x_row + k, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        rk = tl.load(r_row + k, mask=ok, other=0.0).to(tl.float32)
        xk = round_to(xk + rk, ty, RNE_BF16).to(tl.float32)
    return xk


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, s_ptr, w_ptr, out_ptr, K, stride_xm, stride_rm, stride_sm,
                     stride_om, eps, BLOCK_K: tl.constexpr, ADD: tl.constexpr,
                     RNE_BF16: tl.constexpr, PDL: tl.constexpr):
    # Program m: row m of x [M, K], out [M, K] and, with ADD, residual [M, K]
    # and the sum s [M, K] (unit stride along K; without ADD r_ptr, s_ptr are x_ptr).
    m = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + m * stride_xm
    r_row = r_ptr + m * stride_rm
    o_row = out_ptr + m * stride_om
    offs = tl.arange(0, BLOCK_K)
    ty = out_ptr.dtype.element_ty
    pdl_wait(PDL)  # Note [programmatic dependent launch]: x may be the kernel before's output
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        xk = _row(x_row, r_row, k, k < K, ty, ADD, RNE_BF16)
        if ADD:
            tl.store(s_ptr + m * stride_sm + k, xk.to(ty), mask=k < K)  # exact: already rounded
        ss += xk * xk
    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    pdl_release(PDL)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        ok = k < K
        xk = _row(x_row, r_row, k, ok, ty, ADD, RNE_BF16)  # recomputed: the same bits as stored
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
    plan, _ = _LAUNCHES.entry(x.device, (layout(x, weight), float(eps)),
                              lambda: _NormPlan(x, eps, add=False))
    return plan.run(x, weight)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (s, rms_norm(s)) with s = x + residual rounded to x's dtype
    (module docstring), in one launch. residual of x's shape and dtype, unit
    stride along K; otherwise as `rms_norm`."""
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    plan, _ = _LAUNCHES.entry(x.device, (layout(x, residual, weight), float(eps)),
                              lambda: _NormPlan(x, eps, add=True))
    return plan.run(x, weight, residual)


_LAUNCHES = LayoutMemo()


class _NormPlan:
    """One layout's launch: x's rows M, K, whether a residual is added, and
    the bound launch."""

    def __init__(self, x: torch.Tensor, eps: float, add: bool) -> None:
        K = x.shape[-1]
        self.K, self.M, self.shape, self.eps = K, x.numel() // K if K else 0, x.shape, float(eps)
        self.add = add
        block_k = min(MAX_BLOCK_K, next_pow2(K))
        meta = dict(BLOCK_K=block_k, ADD=add, RNE_BF16=interpreting() and x.dtype == torch.bfloat16,
                    num_warps=4 if block_k <= 2048 else 8, **pdl_meta(x.device))
        self.launch = Launch(_rms_norm_kernel, (self.M,), meta, bind=x.is_cuda)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        t2 = t.reshape(self.M, self.K)
        return t2 if t2.stride(-1) == 1 else t2.contiguous()

    def run(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, out): s = x + residual (a new tensor) with a residual, else x itself."""
        out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        s = torch.empty(self.shape, dtype=x.dtype, device=x.device) if self.add else x
        if self.M == 0:
            return s, out
        x2 = self._rows(x)
        r2 = self._rows(residual) if self.add else x2
        s2 = s.view(self.M, self.K) if self.add else x2
        launch_here(self.launch, (x2, r2, s2, weight, out, self.K, x2.stride(0), r2.stride(0),
                                  s2.stride(0), self.K, self.eps))
        return s, out
