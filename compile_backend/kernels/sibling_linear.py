"""Sibling linear projections as one matmul: `mrv2::sibling_linear`.

    sibling_linear(x, [w_0, ..., w_n], [b_0, ..., b_n] or [])
        == torch.cat([F.linear(x, w_i, b_i) for i], dim=-1)      # [..., sum N_i]

The pass compile_backend/passes/fuse_sibling_linears.py writes it in place of
several `linear`s that read the same input (q/k/v, gate/up). When the weights
are consecutive row slices of one storage, in order (what `pack_siblings`,
compile_backend/core/packed_weights.py, makes of them), it runs ONE
`F.linear` over a view of that weight: one GEMV at decode, the weights read
once. Otherwise it runs the separate linears and concatenates: slower, never
wrong. The check compares storage pointers and offsets on the host; under a
CUDA graph it runs at capture. docs/design.md, section "Sibling linears".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import register_op
from compile_backend.core.packed_weights import pack_siblings, packed_view  # noqa: F401


def _check(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> None:
    if not weights:
        raise ValueError("sibling_linear: no weights")
    if biases and len(biases) != len(weights):
        raise ValueError(f"sibling_linear: {len(weights)} weights and {len(biases)} biases "
                         "(give one bias per weight, or none)")


def packed_weight_and_bias(weights: list[torch.Tensor], biases: list[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The [sum N_i, K] weight (and [sum N_i] bias, None without biases) the
    siblings are row slices of, or None when they are not packed."""
    weight = packed_view(weights)
    bias = packed_view(biases) if biases else None
    if weight is None or (biases and bias is None):
        return None
    return weight, bias


def sibling_linear_ref(x: torch.Tensor, weights: list[torch.Tensor],
                       biases: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat([F.linear(x, w, b) ...], -1)`: one F.linear over the packed
    weight when the siblings are packed, else one per sibling."""
    packed = packed_weight_and_bias(weights, biases)
    if packed is not None:
        return F.linear(x, *packed)
    outs = [F.linear(x, w, biases[i] if biases else None) for i, w in enumerate(weights)]
    return torch.cat(outs, dim=-1)


@define_op("mrv2::sibling_linear")
def sibling_linear(x: torch.Tensor, weights: list[torch.Tensor],
                   biases: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat([F.linear(x, w, b) ...], -1)`, as one matmul when the
    weights (and biases) are packed (module docstring)."""
    _check(x, weights, biases)
    return sibling_linear_ref(x, weights, biases)


register_op("mrv2::sibling_linear", capture_safe=True)


@torch.library.register_fake("mrv2::sibling_linear")
def _(x, weights, biases):
    _check(x, weights, biases)
    n = sum(w.shape[0] for w in weights)
    return x.new_empty((*x.shape[:-1], n))
