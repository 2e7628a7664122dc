"""A linear_add and the norm_linear that normalizes its sum become one op.

On the residual stream of a transformer layer, `h = mrv2::linear_add(x, w,
b, r)` (o_proj or down_proj with its residual) is read by the next
`mrv2::norm_linear(h, nw, ...)` (the norm before gate/up or the next
layer's q/k/v). `mrv2::residual_norm_linear(x, w, b, r, nw, ...)`
(compile_backend/kernels/residual_norm_linear.py) returns both: above 64
rows on a GPU the add runs inside the norm's launch. Fires only for a
norm_linear with a norm whose input is a linear_add's output, neither
marked eager, no `motion_barrier` (effects.py) between them, and every
other user of the sum after the norm_linear (the fused op takes the
norm_linear's place). The report says why for each pair not taken.
Note [residual norm]: docs/design.md, "Residual, norm and projection".
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from compile_backend.core.op_registry import node_op_name

from .effects import call_nodes_and_barriers
from .fx_nodes import erase_replaced, example_value, insert_call, keep_meta, op_label, source_line
from .pass_base import FusionPass

LINEAR_ADD = "mrv2::linear_add"
NORM_LINEAR = "mrv2::norm_linear"


def _runs(node: Any, name: str) -> bool:
    """Is `node` a call of the op `name` ("mrv2::...")?"""
    return isinstance(node, torch.fx.Node) and node_op_name(node) == name


class FuseResidualNormPass(FusionPass):
    """See the module docstring. `enabled=False` (config
    `fuse_residual_norm`): the graph stays as it is. A match is
    (linear_add, norm_linear)."""

    OP = "residual_norm_linear"  # compile_backend/kernels/residual_norm_linear.py
    COUNTER = "pass_residual_norm_fused"
    LOG = "mrv2: fused %d linear_add + norm_linear pair(s) into mrv2::residual_norm_linear"

    def unfused(self, match: tuple[torch.fx.Node, torch.fx.Node], reason: str) -> dict[str, Any]:
        add, norm = match
        return {"linear_add": add.name, "norm_linear": norm.name, "reason": reason,
                "source": source_line(norm)}

    def find(self, graph: torch.fx.Graph,
             not_fused: list[dict[str, Any]]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
        """(linear_add, norm_linear) pairs, in graph order."""
        order = {n: i for i, n in enumerate(graph.nodes)}
        matches: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        blocked: dict[torch.fx.Node, torch.fx.Node] = {}  # linear_add -> a barrier after it
        open_: list[torch.fx.Node] = []  # linear_adds no barrier has followed yet
        for node, barrier in call_nodes_and_barriers(graph, self.roles):
            if _runs(node, NORM_LINEAR) and _runs(node.args[0], LINEAR_ADD):
                add = node.args[0]
                why = self._why_not(add, node, order, blocked)
                if why is None:
                    matches.append((add, node))
                else:
                    not_fused.append(self.unfused((add, node), why))
            if _runs(node, LINEAR_ADD):
                open_.append(node)
            elif barrier:
                for add in open_:
                    blocked.setdefault(add, node)
                open_.clear()
        return matches

    def _why_not(self, add: torch.fx.Node, norm: torch.fx.Node, order: dict[torch.fx.Node, int],
                 blocked: dict[torch.fx.Node, torch.fx.Node]) -> str | None:
        """Why the pair cannot become one op (None: it can)."""
        if norm.kwargs or add.kwargs or len(norm.args) != 6 or len(add.args) != 4:
            return "the calls do not pass their arguments by position"
        if norm.args[1] is None:
            return "the norm_linear has no norm (nothing to add inside)"
        if self.eager(add) or self.eager(norm):
            return f"the {'linear_add' if self.eager(add) else 'norm_linear'} runs eagerly"
        if add in blocked:
            barrier = blocked[add]
            return (f"`{op_label(barrier)}` ({barrier.name}) between them writes something, "
                    "runs eagerly or is a breakpoint, attention-like op or collective")
        early = [u.name for u in add.users if u is not norm and order[u] < order[norm]]
        if early:
            return f"the sum is read before the norm_linear (by {', '.join(early)})"
        if not isinstance(example_value(add), torch.Tensor):
            return "no example value for the sum"
        return None

    def fuse(self, graph: torch.fx.Graph, match: tuple[torch.fx.Node, torch.fx.Node],
             op: Any) -> dict[str, Any]:
        """(h, y) = op(x, w, b, r, nw, eps, ws, bs, gated) at the norm_linear's
        place; h takes the linear_add's uses, y the norm_linear's."""
        add, norm = match
        fused = insert_call(graph, norm, op, (*add.args, *norm.args[1:]), like=norm)
        value = example_value(fused)  # (h, y) as fakes, or None
        outs = []
        for i, old in enumerate((add, norm)):
            with graph.inserting_before(norm):
                item = graph.call_function(operator.getitem, (fused, i))
            keep_meta(item, old)
            key = "example_value" if "example_value" in old.meta else "val"
            if value is not None:
                item.meta[key] = value[i]
            outs.append(item)
        entry = {"node": fused.name, "linear_add": add.name, "norm_linear": norm.name,
                 "weight": add.args[1].name, "norm_weight": norm.args[1].name,
                 "source": source_line(norm)}
        add.replace_all_uses_with(outs[0])
        norm.replace_all_uses_with(outs[1])
        erase_replaced(graph, [norm, add])
        return entry


def fused_residual_norms(pass_log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pairs this pass fused, from a PassManager log."""
    return FuseResidualNormPass.fused_in(pass_log)
