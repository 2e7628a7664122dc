"""Sibling linear projections become one matmul.

Several `linear`s that read the same input node with weights that are graph
inputs (q_proj, k_proj and v_proj; gate_proj and up_proj of a Hugging Face
MLP) become ONE `mrv2::sibling_linear(x, [w...], [b...])` followed by a
`torch.narrow` of its output per sibling: one GEMV at decode that reads the
weights once. The weights stay graph inputs; the backend packs each group
once (compile_backend/core/packed_weights.py) and the op checks the packing
at every run, so unpacked weights are slower, never wrong. Fires only when
the members share input, dtype and device, their weights (and biases, all
or none) are graph inputs that can be packed, and nothing between the first
and the last member is a `motion_barrier` (effects.py). Before/after, the
conditions and the outputs' strides: docs/design.md, "Sibling linears".
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from compile_backend.core.op_registry import EAGER_REASON
from compile_backend.core.packed_weights import can_pack

from .effects import call_nodes_and_barriers
from .fx_nodes import (
    erase_replaced, example_value, graph_input_value, insert_call, linear_args, source_line,
)
from .pass_base import FusionPass


def _real_tensor(node: torch.fx.Node) -> torch.Tensor | None:
    """The tensor Dynamo saw for a placeholder, when it is a real one."""
    grapharg = node.meta.get("grapharg")
    try:
        t = grapharg.example if grapharg is not None else None
    except Exception:  # noqa: BLE001 (a GraphArg whose example was released)
        return None
    if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
        return t
    return None


class FuseSiblingLinearsPass(FusionPass):
    """See the module docstring. `enabled=False` (config
    `fuse_sibling_linears`): the pass leaves the graph as it is. A match is
    a group: its members, the linears in graph order."""

    OP = "sibling_linear"  # compile_backend/kernels/sibling_linear.py
    COUNTER = "pass_linears_fused"  # linears, not groups
    LOG = "mrv2: fused %d groups of sibling linears (%d linears)"
    FUSED_KEY = "groups"

    def count(self, fused: list[dict[str, Any]]) -> int:
        return sum(len(g["weights"]) for g in fused)

    def log_args(self, fused: list[dict[str, Any]]) -> tuple[Any, ...]:
        return len(fused), self.count(fused)

    def listed(self, fused: list[dict[str, Any]]) -> dict[str, Any]:
        # Every group is listed: the backend packs the weights the groups name.
        return {"groups": fused}

    def unfused(self, members: list[torch.fx.Node], reason: str) -> dict[str, Any]:
        return {"linears": [m.name for m in members], "reason": reason}

    # ---- finding groups -------------------------------------------------------

    def _key(self, node: torch.fx.Node) -> tuple | None:
        """What siblings must share (None: this linear cannot be fused)."""
        parts = linear_args(node)
        if parts is None or EAGER_REASON in node.meta:
            return None
        x, w, b = parts
        wv = graph_input_value(w, 2)
        if not isinstance(x, torch.fx.Node) or wv is None:
            return None
        bv = None
        if b is not None:
            bv = graph_input_value(b, 1)
            if bv is None:
                return None
        xv = example_value(x)
        if isinstance(xv, torch.Tensor) and xv.dtype != wv.dtype:
            return None
        return (x, wv.dtype, wv.device, b is not None,
                None if bv is None else (bv.dtype, bv.device))

    def find(self, graph: torch.fx.Graph, not_fused: list) -> list[list[torch.fx.Node]]:
        """Groups of two or more, each closed by the first motion barrier
        after its first member: fusing computes every member at the first
        one's place."""
        groups: list[list[torch.fx.Node]] = []
        open_: dict[tuple, list[torch.fx.Node]] = defaultdict(list)

        def close() -> None:
            for members in open_.values():
                if len(members) >= 2:
                    why = self._unpackable(members)
                    if why is None:
                        groups.append(members)
                    else:
                        not_fused.append(self.unfused(members, why))
            open_.clear()

        for node, barrier in call_nodes_and_barriers(graph, self.roles):
            key = self._key(node)
            if key is not None:
                members = open_[key]
                weight = linear_args(node)[1]
                if all(linear_args(m)[1] is not weight for m in members):
                    members.append(node)
            elif barrier:
                close()
        close()
        return groups

    @staticmethod
    def _unpackable(members: list[torch.fx.Node]) -> str | None:
        """Why the real weights (or biases) cannot be packed, where known."""
        for i in (1, 2):
            nodes = [linear_args(m)[i] for m in members]
            if nodes[0] is None:
                continue
            tensors = [_real_tensor(n) for n in nodes]
            if any(t is None for t in tensors):
                continue  # unknown here: the op checks at every run
            why = can_pack(tensors)
            if why is not None:
                return f"{'weights' if i == 1 else 'biases'}: {why}"
        return None

    # ---- rewriting ---------------------------------------------------------------

    def fuse(self, graph: torch.fx.Graph, members: list[torch.fx.Node], op: Any) -> dict[str, Any]:
        """fused = op(x, [w...], [b...]) at the first member's place, then one
        `narrow` of its last dimension per member, in the members' order."""
        first = members[0]
        x = linear_args(first)[0]
        weights = [linear_args(m)[1] for m in members]
        biases = [linear_args(m)[2] for m in members]
        biases = [] if biases[0] is None else biases
        sizes = [example_value(w).shape[0] for w in weights]
        fused = insert_call(graph, first, op, (x, list(weights), list(biases)), like=first)
        start = 0
        for m, n in zip(members, sizes):
            part = insert_call(graph, first, torch.narrow, (fused, -1, start, n), like=m,
                               value_key_from=first)
            m.replace_all_uses_with(part)
            start += n
        erase_replaced(graph, members)
        return {
            "node": fused.name,
            "input": x.name,
            "weights": [w.name for w in weights],
            "biases": [b.name for b in biases],
            "out_features": [int(n) for n in sizes],
            "source": source_line(first),
        }


def fused_groups(pass_log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups this pass fused, from a PassManager log."""
    return FuseSiblingLinearsPass.fused_in(pass_log)
