"""A linear and the residual add after it become one op.

`residual + linear(x, w, b)` (the o_proj and down_proj of a transformer
layer: `h = x + o_proj(attn)`, `out = h + down_proj(mlp)`) is replaced by
ONE `mrv2::linear_add(x, w, b, residual)` (compile_backend/kernels/skinny_linear.py). At
decode on a GPU (a few rows, where `skinny_pays` says the kernel wins) the
op is one Triton kernel that adds bias and residual in its epilogue;
otherwise it runs torch (`addmm`).
Inductor would turn the pattern into `addmm`, which on CUDA first copies the
residual into the output and then often runs a split-K reduce kernel after
cuBLAS' GEMM: launches that the one kernel does not need.

Before:                                 After:
    y = linear(x, w, b)                     z = mrv2::linear_add(x, w, b, r)
    z = r + y        (or y + r)

Fires only when all of these hold:
  - `linear(x, w, b)` with `w` a 2-D graph input (a parameter or buffer) and
    `b` None or a 1-D graph input; `x`'s last dimension is `w`'s second;
  - the add is `operator.add` or `torch.add` of two operands, no `alpha` or
    `out` (in-place adds, `+=`, are not matched);
  - the linear's output has exactly one user, the add;
  - the other operand `r` is a tensor node with exactly the linear output's
    shape (no broadcasting) and the dtype and device of `x`, `w` and the
    output (the shapes and dtypes are the nodes' example values);
  - neither node is marked eager, and no node between them writes anything,
    runs eagerly, sets global state or is a breakpoint, attention-like op or
    collective: the fused node computes the linear at the add's place
    (`motion_barrier`, compile_backend/passes/pass_base.py, the rule of the sibling pass).
The report lists what was fused and, for each add of a linear that was not,
why.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compile_backend.core.counters import counters

from .effects import motion_barrier, output_roots
from .fx_nodes import (
    ADD_TARGETS, example_value, graph_input_value, keep_meta, linear_args, op_label,
    registered_op, source_line, values_fake_mode,
)
from .pass_base import OptionalPass, PassReport

logger = logging.getLogger(__name__)

_NO_OP = ("mrv2::linear_add is not registered: import compile_backend.kernels "
          "(the backend does, before the passes)")


def _fused_op() -> Any:
    """The op the fused node calls (compile_backend/kernels/skinny_linear.py), or None."""
    return registered_op("mrv2", "linear_add")


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


class FuseLinearResidualPass(OptionalPass):
    """See the module docstring. `enabled=False` (config
    `fuse_linear_residual`): the pass leaves the graph as it is."""

    def apply(self, graph: torch.fx.Graph) -> PassReport:
        details: dict[str, Any] = {"enabled": self.enabled, "fused": [], "not_fused": []}
        if not self.enabled:
            return PassReport(changed=False, details=details)
        not_fused: list[dict[str, Any]] = []
        matches = self._find(graph, not_fused)
        op = _fused_op()
        if matches and op is None:
            not_fused += [{"linear": y.name, "add": add.name, "reason": _NO_OP,
                           "source": source_line(add)} for add, y in matches]
            matches = []
        fused = [self._fuse(graph, add, y, op) for add, y in matches]
        counters["pass_linear_residual_fused"] += len(fused)
        if fused:
            logger.info("mrv2: fused %d linear + residual add(s) into mrv2::linear_add", len(fused))
        details["fused"] = fused[: self.MAX_LISTED]
        details["not_fused"] = not_fused[: self.MAX_LISTED]
        details["num_fused"] = len(fused)
        return PassReport(changed=bool(fused), details=details)

    # ---- finding the pairs ---------------------------------------------------------

    def _find(self, graph: torch.fx.Graph,
              not_fused: list[dict[str, Any]]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
        """(add, linear) pairs to fuse, in graph order."""
        matches: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        open_: set[torch.fx.Node] = set()  # linears no barrier has followed yet
        blocked: dict[torch.fx.Node, torch.fx.Node] = {}  # linear -> the barrier after it
        roots: dict[torch.fx.Node, set[Hashable]] = {}
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                roots[node] = output_roots(node, roots)
                continue
            operands = _add_operands(node)
            if operands is not None:
                found = self._match(node, operands, open_, blocked, not_fused)
                if found is not None:
                    matches.append((node, found))
                    open_.discard(found)
            if linear_args(node) is not None and not self.eager(node):
                open_.add(node)
            elif motion_barrier(node, self.roles, roots):
                for linear in open_:
                    blocked[linear] = node
                open_.clear()
            roots[node] = output_roots(node, roots)
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

    @staticmethod
    def _fuse(graph: torch.fx.Graph, add: torch.fx.Node, y: torch.fx.Node, op: Any) -> dict[str, Any]:
        x, w, b = linear_args(y)
        r = add.args[0] if add.args[1] is y else add.args[1]
        meta_key = "example_value" if "example_value" in add.meta else "val"
        vals = [example_value(n) for n in (x, w, r)] + ([example_value(b)] if b is not None else [])
        fake_mode = values_fake_mode(vals)
        with graph.inserting_before(add):
            fused = graph.call_function(op, (x, w, b, r))
        keep_meta(fused, add)
        if fake_mode is not None:
            xv, wv, rv = vals[:3]
            with fake_mode:
                fused.meta[meta_key] = op(xv, wv, vals[3] if b is not None else None, rv)
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
        graph.erase_node(add)
        graph.erase_node(y)
        return entry


def fused_pairs(pass_log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The linear + add pairs this pass fused, from a PassManager log."""
    return [f for entry in pass_log if entry.get("pass") == FuseLinearResidualPass.__name__
            for f in entry.get("details", {}).get("fused", [])]
