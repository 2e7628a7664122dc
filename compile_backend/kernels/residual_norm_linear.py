"""A linear's residual add, the RMSNorm of the sum and the linear(s) after it
as one op: `mrv2::residual_norm_linear` (a layer's o or down projection and
the next norm_linear on the residual stream).

    residual_norm_linear(x, w, b, residual, norm_weight, eps, [w_i], [b_i], gated)
        h = residual + F.linear(x, w, b)                          (mrv2::linear_add)
        y = norm_linear(h, norm_weight, eps, [w_i], [b_i], gated)  (mrv2::norm_linear)
        == (h, y)

Where linear_add runs the skinny kernel (decode up to 64 rows) the two ops,
as they run alone. Above, on CUDA in bf16/fp16 (both ops would run torch's
GEMM, the add and the norm as launches of their own): the GEMM, ONE launch
for the add and the norm (`add_rms_norm`), the packed GEMM and the gate;
bit for bit the two ops' result. Note [residual norm]: docs/design.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import register_op

from .norm_linear import check_norm_linear, gate_after, norm_linear, out_features, unfused_here
from .rms_norm import add_rms_norm
from .sibling_linear import packed_weight_and_bias
from .skinny_linear import check_linear_add, linear_add, skinny_pays


def residual_norm_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             weights: list[torch.Tensor], biases: list[torch.Tensor],
                             gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ops, one after the other (module docstring)."""
    h = linear_add(x, weight, bias, residual)
    return h, norm_linear(h, norm_weight, eps, weights, biases, gated)


def _check(x, weight, bias, residual, norm_weight, eps, weights, biases, gated) -> None:
    check_linear_add(x, weight, bias, residual)
    check_norm_linear(residual, norm_weight, eps, weights, biases, gated)  # h: residual's shape


def wide_here(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
              packed_weight: torch.Tensor, gated: bool) -> bool:
    """Run the add inside the norm's launch? Where neither op runs the skinny
    kernel (so linear_add is torch's GEMM then an add, norm_linear the norm's
    launch then torch's GEMM) and the norm's kernel runs (CUDA, bf16/fp16)."""
    return (x.numel() > 0 and unfused_here(residual) and not skinny_pays(x, weight)
            and not skinny_pays(residual, packed_weight, gated, norm=True))


@define_op("mrv2::residual_norm_linear")
def residual_norm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         weights: list[torch.Tensor], biases: list[torch.Tensor],
                         gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + linear(x), norm_linear of it) (module docstring)."""
    _check(x, weight, bias, residual, norm_weight, eps, weights, biases, gated)
    packed = packed_weight_and_bias(weights, biases)
    if packed is None or not wide_here(x, weight, residual, packed[0], gated):
        return residual_norm_linear_ref(x, weight, bias, residual, norm_weight, eps, weights,
                                        biases, gated)
    h, n = add_rms_norm(F.linear(x, weight, bias), residual, norm_weight, eps)
    return h, gate_after(F.linear(n, *packed), gated)


register_op("mrv2::residual_norm_linear", capture_safe=True)


@torch.library.register_fake("mrv2::residual_norm_linear")
def _(x, weight, bias, residual, norm_weight, eps, weights, biases, gated):
    _check(x, weight, bias, residual, norm_weight, eps, weights, biases, gated)
    h = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return h, residual.new_empty((*residual.shape[:-1], out_features(weights, gated)))
