"""Identical layers compile once.

Pieces equal up to the layer names of layer-keyed ops (core/op_registry.py)
and the names of their size symbols share a key. The first is compiled; a
later one runs its artifact under a layer alias (the first layer's names ->
its own) that `ForwardContext.metadata` follows, where what the first
compile assumed of its symbols holds for its own (guarded from then on).
docs/design.md, section "Start in seconds" (identical layers compile once).

    key, names = piece_key(gm, fake_args)      # names: layer names, op order
    alias = layer_alias_for(rep_names, names)  # None: the same layers
    mark = shape_env_mark(fake_args)           # before compiling the first
    assumed = assumed_since(mark, piece_symbols(fake_args))   # after it
    assume_for(assumed, first_symbols, fake_args)             # a later sharer
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import sympy
import torch
import torch.fx

from compile_backend.core.op_registry import LAYER_NAME_ARG, layer_name_position


def _sizes(x: Any) -> list[Any]:
    """A tensor's sizes and strides, or the value itself."""
    return [*x.shape, *x.stride()] if isinstance(x, torch.Tensor) else [x]


def piece_symbols(fake_args: Sequence[Any]) -> list[Any]:
    """The size symbols of a piece's inputs (sympy symbols of its ShapeEnv)
    in order of first appearance: the order `piece_key` renames them in."""
    order: dict[Any, None] = {}
    for a in fake_args:
        for d in _sizes(a):
            if isinstance(d, torch.SymInt):
                order.update((free, None) for free in sorted(d.node.expr.free_symbols, key=str))
    return list(order)


def _shape_env(fake_args: Sequence[Any]) -> Any:
    return next((d.node.shape_env for a in fake_args for d in _sizes(a)
                 if isinstance(d, torch.SymInt)), None)


def shape_env_mark(fake_args: Sequence[Any]) -> tuple[Any, int, dict[Any, Any]] | None:
    """What the inputs' ShapeEnv knows now (its guards and replacements), for
    `assumed_since`; None when the inputs carry no symbols."""
    env = _shape_env(fake_args)
    return None if env is None else (env, len(env.guards), dict(env.replacements))


def assumed_since(mark: tuple[Any, int, dict[Any, Any]] | None, symbols: list[Any]) -> list[Any]:
    """What the ShapeEnv learned since `mark` about any of `symbols`: the
    guards added on them and their new replacements (as equalities). An
    Inductor compile may assume something of its piece's sizes and guard it
    (`s26 <= 4096` when it picks a reduction); that covers those symbols only."""
    if mark is None:
        return []
    env, n_guards, replacements = mark
    mine = set(symbols)
    found = [g.expr for g in env.guards[n_guards:] if g.expr.free_symbols & mine]
    found += [sympy.Eq(sym, expr) for sym, expr in env.replacements.items()
              if replacements.get(sym) is not expr and ({sym} | expr.free_symbols) & mine]
    return found


def assume_for(assumptions: list[Any], compiled_symbols: list[Any],
               fake_args: Sequence[Any]) -> bool:
    """Can a piece with `fake_args` run an artifact compiled under
    `assumptions` about `compiled_symbols` (a piece equal up to renaming)?
    Each assumption, renamed to this piece's symbols, must hold for its
    current sizes; then it is guarded here too (Dynamo recompiles when it
    stops holding), and the answer is yes. Nothing is guarded otherwise."""
    if not assumptions:
        return True
    env = _shape_env(fake_args)
    if env is None:
        return False
    renamed = [a.xreplace(dict(zip(compiled_symbols, piece_symbols(fake_args))))
               for a in assumptions]
    # torch 2.13 renamed the hints (var_to_val still answers, with a warning).
    values = getattr(env, "backed_var_to_val", None)
    if values is None:
        values = env.var_to_val
    if not all(_holds(r, values) for r in renamed):
        return False
    for r in renamed:
        env.evaluate_expr(r)
    return True


def _holds(expr: Any, values: dict[Any, Any]) -> bool:
    """Does `expr` hold at these sizes (False where a symbol has no value)?"""
    if not expr.free_symbols <= values.keys():
        return False
    try:
        return bool(expr.xreplace(values))
    except TypeError:  # not decided by the values alone
        return False


def _specs(fake_args: Sequence[Any]) -> str:
    """The inputs' specs (dtype, shape, stride, device; a SymInt's expression;
    another value's repr), their size symbols renamed in order of first
    appearance (c0, c1, ...), each with its value range. Dynamo may
    give each layer's tensors symbols of their own (an HF DynamicCache: layer
    0's keys s50 long, layer 1's s80), which the compiled code reads from its
    arguments: pieces equal up to that renaming, ranges included, are the
    same piece, once what compiling one assumed of its symbols holds for the
    other's (`assume_for`)."""
    names = {free: sympy.Symbol(f"c{i}", integer=True)
             for i, free in enumerate(piece_symbols(fake_args))}

    def sym(v: Any) -> str:
        return str(v.node.expr.xreplace(names))

    def size(d: Any) -> str:
        return sym(d) if isinstance(d, torch.SymInt) else str(d)

    def spec(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            shape = ",".join(size(d) for d in x.shape)
            stride = ",".join(size(d) for d in x.stride())
            return f"T({x.dtype},({shape}),({stride}),{x.device.type})"
        if isinstance(x, torch.SymInt):
            return f"S({sym(x)})"
        return f"{type(x).__name__}({x!r})"

    env = _shape_env(fake_args)
    ranges = [f"{c} {env.var_to_range.get(free) if env else None}" for free, c in names.items()]
    return ";".join(spec(a) for a in fake_args) + "|" + ";".join(ranges)


def piece_key(gm: torch.fx.GraphModule, fake_args: Sequence[Any]) -> tuple[str | None, list[str]]:
    """(key under which identical pieces share a compiled artifact, the
    piece's layer names). The key is None when the piece holds module
    attributes (its code alone does not define it)."""
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None, []
    # Node names carry the layer's index (l_self_modules_layers_modules_3_...):
    # describe the graph by node positions instead.
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    names: list[str] = []

    def arg(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: f"%{index[n]}")

    def layer(name: str) -> str:
        # By first occurrence: "the same layer twice" stays part of the key.
        if name not in names:
            names.append(name)
        return f"<layer {names.index(name)}>"

    lines = []
    for n in gm.graph.nodes:
        args, kwargs = n.args, n.kwargs
        pos = layer_name_position(n.target) if n.op == "call_function" else None
        if pos is not None and pos < len(args) and isinstance(args[pos], str):
            args = args[:pos] + (layer(args[pos]),) + args[pos + 1:]
        elif pos is not None and isinstance(kwargs.get(LAYER_NAME_ARG), str):
            kwargs = {**kwargs, LAYER_NAME_ARG: layer(kwargs[LAYER_NAME_ARG])}
        target = n.target if n.op != "placeholder" else ""
        lines.append(f"{n.op} {target} {arg(args)} {arg(kwargs)}")
    text = "\n".join(lines) + "|" + _specs(fake_args)
    return hashlib.sha256(text.encode()).hexdigest()[:16], names


def layer_alias_for(compiled_names: Sequence[str], names: Sequence[str]) -> dict[str, str] | None:
    """The alias under which an artifact compiled with `compiled_names` serves
    a piece with `names` (equal keys: the same pattern of names); None when
    they are the same layers."""
    assert len(compiled_names) == len(names), (compiled_names, names)
    if list(compiled_names) == list(names):
        return None
    return dict(zip(compiled_names, names))
