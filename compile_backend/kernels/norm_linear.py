"""RMSNorm, a linear (or sibling linears) and the SwiGLU gate as one op: `mrv2::norm_linear`.

    norm_linear(x [..., K], norm_weight [K] | None, eps, [w_0, ..., w_n], [b_i] or [], gated)
        h = rms_norm_ref(x, norm_weight, eps)          (x itself when norm_weight is None)
        y = torch.cat([F.linear(h, w_i, b_i) for i], -1)                # [..., N = sum N_i]
        gated:  g, u = y.chunk(2, -1);  y = silu(g) * u                  # [..., N / 2]
        == y

On CUDA, bf16/fp16, weights packed back to back (`packed_view`): up to 16
rows (`skinny_pays`) one launch of the skinny kernel (skinny_linear.py);
more rows, the norm (rms_norm.py), the packed linear (cuBLAS) and the gate
(silu_mul.py), the unfused launch count. Elsewhere the reference (eager).
Note [norm and gate in the GEMM]: docs/design.md, "RMSNorm, projection and gate".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import register_op

from .rms_norm import rms_norm, rms_norm_ref
from .sibling_linear import packed_weight_and_bias, sibling_linear_ref
from .silu_mul import silu_mul, silu_mul_ref
from .skinny_linear import SKINNY_DTYPES, check_norm_weight, skinny_linear, skinny_pays


def norm_linear_ref(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                    weights: list[torch.Tensor], biases: list[torch.Tensor],
                    gated: bool) -> torch.Tensor:
    """Plain torch, op by op as eager runs it (module docstring)."""
    h = rms_norm_ref(x, norm_weight, eps) if norm_weight is not None else x
    y = sibling_linear_ref(h, weights, biases)
    return silu_mul_ref(y) if gated else y


def out_features(weights: list[torch.Tensor], gated: bool) -> int:
    n = sum(w.shape[0] for w in weights)
    return n // 2 if gated else n


def check_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                      weights: list[torch.Tensor], biases: list[torch.Tensor],
                      gated: bool) -> None:
    if not weights:
        raise ValueError("norm_linear: no weights (give the linear's weight, or the siblings')")
    K = x.shape[-1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != K or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(
                f"norm_linear: each weight must be [N, {K}] of x's dtype ({x.dtype}) on {x.device}; "
                f"got {tuple(w.shape)} {w.dtype} on {w.device}")
    if biases and (len(biases) != len(weights) or any(
            tuple(b.shape) != (w.shape[0],) or b.dtype != x.dtype or b.device != x.device
            for b, w in zip(biases, weights))):
        raise ValueError(f"norm_linear: give one bias [N_i] of x's dtype per weight, or none; got "
                         f"{[tuple(b.shape) for b in biases]} for weights "
                         f"{[tuple(w.shape) for w in weights]}")
    if norm_weight is not None:
        check_norm_weight("norm_linear", x, norm_weight, eps)
    if gated and sum(w.shape[0] for w in weights) % 2:
        raise ValueError("norm_linear: gated needs an even number of output features "
                         "(the gate's columns, then the up projection's)")


@define_op("mrv2::norm_linear")
def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                weights: list[torch.Tensor], biases: list[torch.Tensor],
                gated: bool) -> torch.Tensor:
    """RMSNorm -> linear(s) -> optional SiLU·mul (module docstring)."""
    check_norm_linear(x, norm_weight, eps, weights, biases, gated)
    packed = packed_weight_and_bias(weights, biases)
    if packed is not None and skinny_pays(x, packed[0], gated, norm=norm_weight is not None):
        return skinny_linear(x, *packed, norm_weight=norm_weight, eps=eps, gated=gated)
    if packed is not None and unfused_here(x):
        return _unfused(x, norm_weight, eps, *packed, gated)
    return norm_linear_ref(x, norm_weight, eps, weights, biases, gated).contiguous()


def unfused_here(x: torch.Tensor) -> bool:
    """Run the three-launch form (norm, linear, gate) for x? On CUDA in bf16
    or fp16, where the reference's op-by-op norm and gate would launch a
    kernel per op; fp32 keeps the reference, equal to eager bit for bit."""
    return x.is_cuda and x.dtype in SKINNY_DTYPES and x.stride(-1) == 1


def _unfused(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
             weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """The norm, the packed linear and the gate as separate launches, with
    the reference's roundings. The linear is cuBLAS's, as in the unfused
    graph: the plain skinny kernel there measured the same at 32 rows and
    1.5% slower at 64 (llama8b FULL decode on an H100)."""
    h = rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    return gate_after(F.linear(h, weight, bias), gated)


def gate_after(y: torch.Tensor, gated: bool) -> torch.Tensor:
    """The gate's launch on the packed linear's output (y itself when not gated)."""
    return silu_mul(y) if gated else y


register_op("mrv2::norm_linear", capture_safe=True)


@torch.library.register_fake("mrv2::norm_linear")
def _(x, norm_weight, eps, weights, biases, gated):
    check_norm_linear(x, norm_weight, eps, weights, biases, gated)
    return x.new_empty((*x.shape[:-1], out_features(weights, gated)))
