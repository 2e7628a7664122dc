"""A linear and the residual add after it become one op.

`residual + linear(x, w, b)` (the o_proj and down_proj of a transformer
layer: `h = x + o_proj(attn)`, `out = h + down_proj(mlp)`) is replaced by
ONE `mrv2::linear_add(x, w, b, residual)` (compile_backend/kernels/skinny_linear.py):
at decode on a GPU one Triton kernel that adds bias and residual in its
epilogue, where Inductor's `addmm` copies the residual and often runs a
split-K reduce after the GEMM. Fires only for weights (and biases) that are
graph inputs, a linear whose one user is the add, a residual of exactly the
output's shape, dtype and device, nothing marked eager, and no
`motion_barrier` (effects.py) between the linear and the add. The report
says, for each add of a linear not fused, why. Before/after, every
condition and the measurements: docs/design.md, "Linear + residual".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .effects import call_nodes_and_barriers
from .fx_nodes import (
    ADD_TARGETS, erase_replaced, example_value, graph_input_value, insert_call, linear_args,
    op_label, source_line,
)
from .pass_base import FusionPass


def _add_operands(node: torch.fx.Node) -> tuple[Any, Any] | None:
    """The two operands of `a + b` / `torch.add(a, b, ...)` (None: not one)."""
    if node.op != "call_function" or node.target not in ADD_TARGETS or len(node.args) != 2:
        return None
    return node.args[0], node.args[1]


def _is_linear(value: Any) -> bool:
    return isinstance(value, torch.fx.Node) and linear_args(value) is not None


def _same_shape(a: torch.Size, b: torch.Size) -> bool:
    """Equal without adding a guard (sizes may be symbolic)."""
    return len(a) == len(b) and all(statically_known_true(i == j) for i, j in zip(a, b))


class FuseLinearResidualPass(FusionPass):
    """See the module docstring. `enabled=False` (config
    `fuse_linear_residual`): the pass leaves the graph as it is. A match is
    (add, linear)."""

    OP = "linear_add"  # compile_backend/kernels/skinny_linear.py
    COUNTER = "pass_linear_residual_fused"
    LOG = "mrv2: fused %d linear + residual add(s) into mrv2::linear_add"

    def unfused(self, match: tuple[torch.fx.Node, torch.fx.Node], reason: str) -> dict[str, Any]:
        add, y = match
        return {"linear": y.name, "add": add.name, "reason": reason, "source": source_line(add)}

    # ---- finding the pairs ---------------------------------------------------------

    def find(self, graph: torch.fx.Graph,
             not_fused: list[dict[str, Any]]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
        """(add, linear) pairs to fuse, in graph order."""
        matches: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        open_: set[torch.fx.Node] = set()  # linears no barrier has followed yet
        blocked: dict[torch.fx.Node, torch.fx.Node] = {}  # linear -> the barrier after it
        for node, barrier in call_nodes_and_barriers(graph, self.roles):
            operands = _add_operands(node)
            if operands is not None:
                found = self._match(node, operands, open_, blocked, not_fused)
                if found is not None:
                    matches.append((node, found))
                    open_.discard(found)
            if linear_args(node) is not None and not self.eager(node):
                open_.add(node)
            elif barrier:
                for linear in open_:
                    blocked[linear] = node
                open_.clear()
        return matches

    def _match(self, add: torch.fx.Node, operands: tuple[Any, Any], open_: set[torch.fx.Node],
               blocked: dict[torch.fx.Node, torch.fx.Node],
               not_fused: list[dict[str, Any]]) -> torch.fx.Node | None:
        """The linear operand of `add` to fuse it with, or None (the reasons
        for each linear operand go to `not_fused`)."""
        a, b = operands
        tried = [(b, a)] if a is b else [(b, a), (a, b)]  # `r + linear(x)` first
        reasons = []
        for y, r in tried:
            if not _is_linear(y):
                continue
            why = self._why_not(add, y, r, open_, blocked)
            if why is None:
                return y
            reasons.append({"linear": y.name, "add": add.name, "reason": why,
                            "source": source_line(add)})
        not_fused += reasons
        return None

    def _why_not(self, add: torch.fx.Node, y: torch.fx.Node, r: Any, open_: set[torch.fx.Node],
                 blocked: dict[torch.fx.Node, torch.fx.Node]) -> str | None:
        """Why `add = r + y` (y a linear) cannot become one linear_add (None: it can)."""
        if add.kwargs:
            return f"the add has keyword arguments ({', '.join(sorted(add.kwargs))})"
        if self.eager(add):
            return "the add runs eagerly"
        if self.eager(y):
            return "the linear runs eagerly"
        if len(y.users) != 1:
            return f"the linear's output has {len(y.users)} users (fusing needs the add only)"
        if r is y:
            return "the add adds the linear's output to itself"
        x, w, b = linear_args(y)
        wv = graph_input_value(w, 2)
        if wv is None:
            return "the weight is not a 2-D graph input (a parameter or buffer)"
        bv = None
        if b is not None:
            bv = graph_input_value(b, 1)
            if bv is None:
                return "the bias is not a 1-D graph input (a parameter or buffer)"
        rv = example_value(r)
        if not isinstance(r, torch.fx.Node) or not isinstance(rv, torch.Tensor):
            return f"the other operand is not a tensor ({type(rv if rv is not None else r).__name__})"
        xv, yv = example_value(x), example_value(y)
        if not isinstance(xv, torch.Tensor) or not isinstance(yv, torch.Tensor):
            return "no example values for the linear's input or output"
        if not _same_shape(rv.shape, yv.shape):
            return (f"the add broadcasts: residual {tuple(rv.shape)}, linear output "
                    f"{tuple(yv.shape)}")
        tensors = {"x": xv, "weight": wv, "output": yv, "residual": rv}
        if bv is not None:
            tensors["bias"] = bv
        for what in ("dtype", "device"):
            if len({getattr(t, what) for t in tensors.values()}) != 1:
                return f"{what}s differ: " + ", ".join(
                    f"{k} {getattr(t, what)}" for k, t in tensors.items())
        if xv.dim() < 1 or not statically_known_true(xv.shape[-1] == wv.shape[1]):
            return (f"the input's last dimension is not the weight's second: x "
                    f"{tuple(xv.shape)}, weight {tuple(wv.shape)}")
        if y in blocked:
            barrier = blocked[y]
            return (f"`{op_label(barrier)}` ({barrier.name}) between the linear and the add "
                    "writes something, runs eagerly or is a breakpoint, attention-like op "
                    "or collective")
        if y not in open_:
            return "the linear cannot move to the add"
        return None

    # ---- rewriting -------------------------------------------------------------------------

    def fuse(self, graph: torch.fx.Graph, match: tuple[torch.fx.Node, torch.fx.Node],
             op: Any) -> dict[str, Any]:
        """z = op(x, w, b, r) at the add's place; the add and the linear go."""
        add, y = match
        x, w, b = linear_args(y)
        r = add.args[0] if add.args[1] is y else add.args[1]
        fused = insert_call(graph, add, op, (x, w, b, r), like=add)
        entry = {
            "node": fused.name,
            "linear": y.name,
            "add": add.name,
            "weight": w.name,
            "bias": b.name if b is not None else None,
            "residual": r.name,
            "source": source_line(add),
        }
        add.replace_all_uses_with(fused)
        erase_replaced(graph, [add, y])
        return entry


def fused_pairs(pass_log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The linear + add pairs this pass fused, from a PassManager log."""
    return FuseLinearResidualPass.fused_in(pass_log)
