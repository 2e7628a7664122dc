"""An RMSNorm, the linear(s) that read it and the SwiGLU gate: one op.

At decode each is a small kernel of its own (the RMSNorm before q/k/v, the
one before gate/up, the SiLU·mul before down). `mrv2::norm_linear(x, nw,
eps, [w...], [b...], gated)` (compile_backend/kernels/norm_linear.py) does
their work inside the GEMM that reads them. It takes the Llama family's
RMSNorm as Dynamo records it, before a `linear` or `mrv2::sibling_linear`,
and `silu(g) * u` over that linear's two halves; either part alone too (a
pick of rows between norm and linear moves before the norm). Fires only
when every intermediate is used inside the pattern, dtypes and devices
agree, nothing is marked eager and no `motion_barrier` (effects.py) lies
between the norm and the linear; the report says why for each norm or gate
not taken. The pattern, every condition, Note [rows before the norm] and
the measurements: docs/design.md, "RMSNorm, projection and gate".
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from .effects import call_nodes_and_barriers
from .fx_nodes import (
    ADD_TARGETS, MUL_TARGETS, erase_replaced, example_value, graph_input_value, insert_call,
    linear_args, op_label, registered_op, source_line,
)
from .pass_base import FusionPass


def _is_call(node: Any, targets: tuple[Any, ...] = (), method: str | None = None) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if method is not None and node.op == "call_method" and node.target == method:
        return True
    return node.op == "call_function" and node.target in targets


def _binary(node: torch.fx.Node, targets: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """(a, b) of `a <op> b` with no keyword arguments (None: not one)."""
    if node.op == "call_function" and node.target in targets and len(node.args) == 2 \
            and not node.kwargs:
        return node.args[0], node.args[1]
    return None


def _last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _dtype_of(node: Any) -> torch.dtype | None:
    v = example_value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


class _Norm:
    """A matched RMSNorm: `out = (a * rsqrt(mean(a^2) + eps)).to(x.dtype) * nw`."""

    def __init__(self, weight: torch.fx.Node, eps: float, nodes: list[torch.fx.Node]) -> None:
        self.weight, self.eps = weight, float(eps)
        self.nodes = nodes  # the pattern's nodes in graph order; nodes[-1] is the output
        # Rows picked from the norm's output before the linear (Note [rows
        # before the norm]): the getitem node and its index; index None when
        # it picks every row (the fused op then reads the norm's input whole).
        self.rows: torch.fx.Node | None = None
        self.index: tuple[Any, ...] | None = None

    @property
    def x(self) -> Any:
        """The norm's input, read from its first node (`x.to(float32)`) when
        asked: a rewrite before this one may have replaced it."""
        return self.nodes[0].args[0]


def _to_dtype(node: Any) -> tuple[torch.fx.Node, torch.dtype] | None:
    """(input, dtype) of `t.to(dtype)` / `t.to(dtype=dtype)` / `t.float()`."""
    if _is_call(node, method="float") and len(node.args) == 1 and not node.kwargs:
        return node.args[0], torch.float32
    if not _is_call(node, method="to"):
        return None
    args, kw = node.args, dict(node.kwargs)
    if len(args) == 2 and isinstance(args[1], torch.dtype) and not kw:
        return args[0], args[1]
    if len(args) == 1 and set(kw) == {"dtype"} and isinstance(kw["dtype"], torch.dtype):
        return args[0], kw["dtype"]
    return None


def _plain(i: Any) -> bool:
    """An int, or a slice of ints or None with step 1."""
    if type(i) is int:
        return True
    return isinstance(i, slice) and i.step in (None, 1) and all(
        v is None or type(v) is int for v in (i.start, i.stop))


def _row_pick(x: Any) -> tuple[torch.fx.Node, tuple[Any, ...] | None] | None:
    """(h, index) when `x` is `h[index]`, the norm output's only use, with
    ints and plain slices (int or no bounds, step 1) over leading dimensions
    only: a pick of rows, which commutes with a norm over the last dimension.
    index is None when the pick keeps every row."""
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function"
            and x.target is operator.getitem and len(x.args) == 2 and not x.kwargs
            and len(x.users) == 1):  # the linear alone reads the picked rows
        return None
    h, index = x.args
    hv = example_value(h)
    if not isinstance(h, torch.fx.Node) or not isinstance(hv, torch.Tensor) or len(h.users) != 1:
        return None
    index = index if isinstance(index, tuple) else (index,)
    if not index or len(index) > hv.dim() or not all(_plain(i) for i in index):
        return None
    if len(index) == hv.dim() and index[-1] != slice(None):
        return None  # a pick of features, not of rows
    return h, None if _picks_every_row(index, hv.shape) else index


def _picks_every_row(index: tuple[Any, ...], shape: torch.Size) -> bool:
    """Every slice keeps its whole dimension (known from the slice alone, or
    from a static size), and no int drops one."""
    for sl, size in zip(index, shape):
        if not isinstance(sl, slice):
            return False
        if sl.start in (None, 0) and sl.stop is None:
            continue
        if type(size) is not int or sl.indices(size) != (0, size, 1):
            return False
    return True


def match_rms_norm(h: Any) -> tuple[_Norm | None, str | None]:
    """The RMSNorm whose output is `h`, or (None, why not) when `h` looks
    like one but is not exactly the pattern; (None, None): not a norm."""
    if not isinstance(h, torch.fx.Node):
        return None, None
    mul = _binary(h, MUL_TARGETS)
    if mul is None:
        return None, None
    for nw, c in (mul, mul[::-1]):
        cast = _to_dtype(c)
        if cast is None or not isinstance(nw, torch.fx.Node) or nw.op != "placeholder":
            continue
        n, dtype = cast
        nm = _binary(n, MUL_TARGETS) if isinstance(n, torch.fx.Node) else None
        if nm is None:
            continue
        for a, r in (nm, nm[::-1]):
            if not (_is_call(r, (torch.rsqrt,), method="rsqrt") and len(r.args) == 1
                    and not r.kwargs):
                continue
            e = r.args[0]
            add = _binary(e, ADD_TARGETS) if isinstance(e, torch.fx.Node) else None
            if add is None:
                continue
            m, eps = add if isinstance(add[1], (int, float)) else add[::-1]
            if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not \
                    _is_mean_of_square(m, a):
                continue
            a_in = _to_dtype(a)
            if a_in is None or a_in[1] != torch.float32:
                continue
            x = a_in[0]
            return _checked_norm(h, x, nw, float(eps), dtype, [a, m.args[0], m, e, r, n, c, h])
    return None, None


def _is_mean_of_square(m: Any, a: Any) -> bool:
    """`m` is `a.pow(2).mean(-1, keepdim=True)` (or torch.pow / torch.mean)."""
    if not (_is_call(m, (torch.mean,), method="mean") and m.args):
        return False
    p = m.args[0]
    av = example_value(a)
    ndim = av.dim() if isinstance(av, torch.Tensor) else -1
    dim = m.args[1] if len(m.args) > 1 else m.kwargs.get("dim")
    keepdim = m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False)
    extra = set(m.kwargs) - {"dim", "keepdim"}
    if extra or keepdim is not True or not _last_dim(dim, ndim) or len(m.args) > 3:
        return False
    if not (_is_call(p, (torch.pow, operator.pow), method="pow") and len(p.args) == 2
            and not p.kwargs):
        return False
    return p.args[0] is a and p.args[1] in (2, 2.0)


def _checked_norm(h: torch.fx.Node, x: Any, nw: torch.fx.Node, eps: float, dtype: torch.dtype,
                  nodes: list[torch.fx.Node]) -> tuple[_Norm | None, str | None]:
    """The norm, if its values and users allow fusing (else why not)."""
    a, p, m, e, r, n, c, _ = nodes
    xd = _dtype_of(x)
    if xd is None:
        return None, "no example value for the norm's input"
    if dtype != xd:
        return None, f"the norm casts to {dtype}, not to its input's dtype {xd}"
    wv = graph_input_value(nw, 1)
    if wv is None or wv.dtype != xd:
        return None, (f"the norm's weight is not a 1-D graph input of the input's dtype {xd} "
                      f"(got {_dtype_of(nw)})")
    if eps < 0:
        return None, f"eps {eps} < 0"
    if set(a.users) != {p, n}:
        return None, "the norm's fp32 input has users outside the norm"
    for node in (p, m, e, r, n, c):
        if len(node.users) != 1:
            return None, f"`{node.name}` inside the norm has {len(node.users)} users"
    if len(h.users) != 1:
        return None, f"the norm's output has {len(h.users)} users (fusing needs the linear only)"
    return _Norm(nw, eps, nodes), None


class _Gate:
    """`silu(g) * u` over the two halves of a linear's output."""

    def __init__(self, product: torch.fx.Node, nodes: list[torch.fx.Node]) -> None:
        self.product = product
        self.nodes = nodes  # halves, chunk, silu, product: erased after the rewrite


def _halves(y: torch.fx.Node, n_out: int) -> tuple[torch.fx.Node, torch.fx.Node,
                                                    list[torch.fx.Node]] | None:
    """(gate half, up half, their nodes) when `y`'s only users split its
    last dimension in two equal halves."""
    users = list(y.users)
    yv = example_value(y)
    ndim = yv.dim() if isinstance(yv, torch.Tensor) else -1
    half = n_out // 2
    if len(users) == 2 and all(_is_call(u, (torch.narrow,), method="narrow") and not u.kwargs
                               and len(u.args) == 4 and u.args[0] is y for u in users):
        by_start = {u.args[2]: u for u in users if _last_dim(u.args[1], ndim) and u.args[3] == half}
        if set(by_start) == {0, half}:
            return by_start[0], by_start[half], [by_start[0], by_start[half]]
    if len(users) == 1 and _is_call(users[0], (torch.chunk,), method="chunk"):
        ch = users[0]
        chunks = ch.args[1] if len(ch.args) > 1 else ch.kwargs.get("chunks")
        dim = ch.args[2] if len(ch.args) > 2 else ch.kwargs.get("dim", 0)
        items = list(ch.users)
        if chunks == 2 and _last_dim(dim, ndim) and len(items) == 2 and all(
                i.op == "call_function" and i.target is operator.getitem for i in items):
            by_index = {i.args[1]: i for i in items}
            if set(by_index) == {0, 1}:
                return by_index[0], by_index[1], [ch, by_index[0], by_index[1]]
    return None


def match_gate(y: torch.fx.Node, n_out: int) -> tuple[_Gate | None, str | None]:
    """`silu(g) * u` over `y`'s halves, or (None, why not) when `y` is split
    in halves but not gated that way; (None, None): not split in halves."""
    if n_out % 2:
        return None, None
    found = _halves(y, n_out)
    if found is None:
        return None, None
    g, u, split_nodes = found
    if len(g.users) != 1:
        return None, f"the gate half has {len(g.users)} users"
    s = next(iter(g.users))
    silu = _is_call(s, (F.silu, torch.nn.functional.silu)) and s.args == (g,) and \
        not s.kwargs.get("inplace", False) and set(s.kwargs) <= {"inplace"}
    if not silu:
        return None, f"the gate half goes to `{op_label(s)}`, not silu"
    if len(s.users) != 1 or len(u.users) != 1:
        return None, "the silu or the up half has other users than their product"
    prod = next(iter(s.users))
    operands = _binary(prod, MUL_TARGETS)
    if operands is None or set(operands) != {s, u} or next(iter(u.users)) is not prod:
        return None, "silu(gate) is not multiplied by the up half"
    return _Gate(prod, [*split_nodes, s, prod]), None


@dataclass
class _Match:
    """A linear `y` (its weights and biases: graph inputs, which no rewrite
    replaces) and the norm before it and/or the gate after it."""

    y: torch.fx.Node
    weights: list[Any]
    biases: list[Any]
    norm: _Norm | None
    gate: _Gate | None

    @property
    def x(self) -> Any:
        """The linear's input, read when asked: fusing the gate of an earlier
        linear replaces its product, which may be this input."""
        args = linear_args(self.y)
        return args[0] if args is not None else self.y.args[0]  # sibling_linear(x, ...)


class FuseNormLinearPass(FusionPass):
    """See the module docstring. `enabled=False` (config `fuse_norm_linear`):
    the pass leaves the graph as it is. A match is a `_Match`."""

    OP = "norm_linear"  # compile_backend/kernels/norm_linear.py
    COUNTER = "pass_norm_linear_fused"
    LOG = "mrv2: fused %d norm/linear/gate group(s) into mrv2::norm_linear"

    def unfused(self, m: _Match, reason: str) -> dict[str, Any]:
        return {"linear": m.y.name, "reason": reason, "source": source_line(m.y)}

    # ---- finding ------------------------------------------------------------------

    @staticmethod
    def _linear(node: torch.fx.Node, sibling: Any) -> tuple[Any, list[Any], list[Any]] | None:
        """(input, weights, biases) of a linear, or of `sibling` (the
        sibling_linear op), whose weights are graph inputs (None: not one)."""
        if sibling is not None and node.op == "call_function" and node.target is sibling:
            x, weights, biases = node.args
            return x, list(weights), list(biases)
        args = linear_args(node)
        if args is None:
            return None
        x, w, b = args
        if graph_input_value(w, 2) is None or (b is not None and graph_input_value(b, 1) is None):
            return None
        return x, [w], [] if b is None else [b]

    def find(self, graph: torch.fx.Graph, not_fused: list[dict[str, Any]]) -> list[_Match]:
        order: dict[torch.fx.Node, int] = {}  # call nodes: their position
        barriers: list[tuple[int, torch.fx.Node]] = []
        for i, (node, barrier) in enumerate(call_nodes_and_barriers(graph, self.roles)):
            order[node] = i
            if barrier:
                barriers.append((i, node))
        sibling = registered_op("mrv2", "sibling_linear")
        matches = []
        for y in list(graph.nodes):
            lin = self._linear(y, sibling) if y.op == "call_function" else None
            if lin is None or self.eager(y):
                continue
            x, weights, biases = lin
            picked = _row_pick(x)
            norm, why_norm = match_rms_norm(picked[0] if picked is not None else x)
            if norm is None and why_norm is None and picked is None and _is_call(
                    x, (operator.getitem,)) and match_rms_norm(x.args[0])[0] is not None:
                why_norm = (f"`{x.name}` between the norm and the linear indexes more than "
                            "rows (a step, a pick of features) or is read elsewhere")
            if norm is not None and picked is not None:
                norm.rows, norm.index = x, picked[1]
            if norm is not None:
                first = order[norm.nodes[0]]
                barrier = next((n for i, n in barriers if first < i < order[y]), None)
                eager = [n.name for n in norm.nodes if self.eager(n)]
                if eager:
                    norm, why_norm = None, f"the norm's {', '.join(eager)} run(s) eagerly"
                elif barrier is not None:
                    norm, why_norm = None, (
                        f"`{op_label(barrier)}` ({barrier.name}) between the norm and the linear "
                        "writes something, runs eagerly or is a breakpoint, attention-like op "
                        "or collective")
            n_out = sum(int(example_value(w).shape[0]) for w in weights
                        if isinstance(example_value(w), torch.Tensor))
            gate, why_gate = match_gate(y, n_out)
            if gate is not None and any(self.eager(n) for n in gate.nodes):
                gate, why_gate = None, "a node of the gate runs eagerly"
            for what, why in (("norm", why_norm), ("gate", why_gate)):
                if why is not None:
                    not_fused.append({"linear": y.name, "part": what, "reason": why,
                                      "source": source_line(y)})
            if (norm is None and gate is None) or not self._values_agree(x, norm, weights, biases):
                continue
            matches.append(_Match(y, weights, biases, norm, gate))
        return matches

    @staticmethod
    def _values_agree(x: Any, norm: _Norm | None, weights: list[Any], biases: list[Any]) -> bool:
        """The op's dtype/device rules hold for the example values."""
        vals = [example_value(n) for n in [norm.x if norm else x, *weights, *biases]
                + ([norm.weight] if norm else [])]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            return False
        return len({v.dtype for v in vals}) == 1 and len({v.device for v in vals}) == 1

    # ---- rewriting ---------------------------------------------------------------------

    def fuse(self, graph: torch.fx.Graph, m: _Match, op: Any) -> dict[str, Any]:
        """The op at the linear's place, reading the norm's input (or the
        linear's); it takes the uses of the gate's product (or the linear's),
        and the gate's, the linear's and the norm's nodes go."""
        y, x, weights, biases, norm, gate = m.y, m.x, m.weights, m.biases, m.norm, m.gate
        src = norm.x if norm is not None else x
        if norm is not None and norm.index is not None:  # Note [rows before the norm]
            src = insert_call(graph, y, operator.getitem, (src, norm.index), like=norm.rows)
        nw = norm.weight if norm is not None else None
        eps = norm.eps if norm is not None else 0.0
        out = gate.product if gate is not None else y
        fused = insert_call(graph, y, op, (src, nw, eps, list(weights), list(biases),
                                           gate is not None), like=y, value_key_from=out)
        entry = {
            "node": fused.name,
            "linear": y.name,
            "norm": norm.nodes[-1].name if norm is not None else None,
            "norm_weight": nw.name if nw is not None else None,
            "gated": gate is not None,
            "rows": None if norm is None or norm.rows is None else (
                "all" if norm.index is None else repr(norm.index)),
            "weights": [w.name for w in weights],
            "source": source_line(y),
        }
        out.replace_all_uses_with(fused)
        rows = [norm.rows] if norm is not None and norm.rows is not None else []
        erase_replaced(graph, ([*reversed(gate.nodes)] if gate is not None else []) + [y] + rows
                       + ([*reversed(norm.nodes)] if norm is not None else []))
        return entry


def fused_norm_linears(pass_log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What this pass fused, from a PassManager log."""
    return FuseNormLinearPass.fused_in(pass_log)
