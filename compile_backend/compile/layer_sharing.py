"""Identical layers compile once.

A transformer's layers trace to pieces that differ only in the layer name
their attention-like ops carry (`mrv2::reshape_and_cache(k, v, kc, vc,
"layers.3.attn")`). The name is a constant in the compiled code, so compiled
as it is, every layer's piece would compile on its own (about 1.6 s a layer
with Inductor on an 8B model).

Ops declared layer-keyed (core/op_registry.py: they use the name only to find
the layer's metadata in the forward context) have their names left out of the
piece's key: the first layer's piece is compiled, and every later identical
piece runs that artifact under a layer alias (the first layer's names -> its
own), which `ForwardContext.metadata` follows. The alias costs one global
assignment per call of the piece's callable, and nothing on a CUDA-graph
replay, which never calls it.

    key, names = piece_key(gm, fake_args)      # names: layer names, op order
    alias = layer_alias_for(rep_names, names)  # None: the same layers
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx

from compile_backend.core.forward_context import call_as_layers
from compile_backend.core.op_registry import LAYER_NAME_ARG, layer_name_position


def _sizes(x: Any) -> list[Any]:
    """A tensor's sizes and strides, or the value itself."""
    return [*x.shape, *x.stride()] if isinstance(x, torch.Tensor) else [x]


def piece_symbols(fake_args: Sequence[Any]) -> set[Any]:
    """The size symbols of a piece's inputs (sympy symbols of the ShapeEnv)."""
    return {free for a in fake_args for d in _sizes(a) if isinstance(d, torch.SymInt)
            for free in d.node.expr.free_symbols}


def shape_env_mark(fake_args: Sequence[Any]) -> tuple[Any, int, dict[Any, Any]] | None:
    """What the inputs' ShapeEnv knows now (its guards and replacements), for
    `constrained_since`; None when the inputs carry no symbols."""
    env = next((d.node.shape_env for a in fake_args for d in _sizes(a)
                if isinstance(d, torch.SymInt)), None)
    return None if env is None else (env, len(env.guards), dict(env.replacements))


def constrained_since(mark: tuple[Any, int, dict[Any, Any]] | None, symbols: set[Any]) -> bool:
    """Did the ShapeEnv gain a guard or a replacement on any of `symbols`
    since `mark`? (An Inductor compile may assume, and guard, something of its
    piece's sizes: `s50 >= 2`, `s50 == 16`; that holds for those symbols only.)"""
    if mark is None:
        return False
    env, n_guards, replacements = mark
    touched = {free for g in env.guards[n_guards:] for free in g.expr.free_symbols}
    for sym, expr in env.replacements.items():
        if replacements.get(sym) is not expr:
            touched |= {sym, *expr.free_symbols}
    return bool(touched & symbols)


def _specs(fake_args: Sequence[Any], rename: bool) -> str:
    """The inputs' specs (dtype, shape, stride, device; a SymInt's expression;
    another value's repr). `rename`: their size symbols renamed in order of
    first appearance (c0, c1, ...), each with its value range. Dynamo may
    give each layer's tensors symbols of their own (an HF DynamicCache: layer
    0's keys s50 long, layer 1's s80), which the compiled code reads from its
    arguments: pieces equal up to that renaming, ranges included, are the
    same piece, unless compiling one assumed something of its own symbols
    (`constrained_since`; the piece compiler then keys it without renaming)."""
    names: dict[Any, Any] = {}
    ranges: list[str] = []

    def sym(v: Any) -> str:
        node = v.node
        expr = node.expr
        if not rename:
            return str(expr)
        for free in sorted(expr.free_symbols, key=str):
            if free not in names:
                names[free] = sympy.Symbol(f"c{len(names)}", integer=True)
                env = getattr(node, "shape_env", None)
                ranges.append(f"{names[free]} {env.var_to_range.get(free) if env else None}")
        return str(expr.xreplace(names))

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

    specs = ";".join(spec(a) for a in fake_args)
    return specs + "|" + ";".join(ranges)


def piece_key(gm: torch.fx.GraphModule, fake_args: Sequence[Any],
              rename_symbols: bool = True) -> tuple[str | None, list[str]]:
    """(key under which identical pieces share a compiled artifact, the
    piece's layer names). The key is None when the piece holds module
    attributes (its code alone does not define it). `rename_symbols`: size
    symbols by first appearance (`_specs`), else by their own names."""
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
    text = "\n".join(lines) + "|" + _specs(fake_args, rename_symbols)
    return hashlib.sha256(text.encode()).hexdigest()[:16], names


def layer_alias_for(compiled_names: Sequence[str], names: Sequence[str]) -> dict[str, str] | None:
    """The alias under which an artifact compiled with `compiled_names` serves
    a piece with `names` (equal keys: the same pattern of names); None when
    they are the same layers."""
    assert len(compiled_names) == len(names), (compiled_names, names)
    if list(compiled_names) == list(names):
        return None
    return dict(zip(compiled_names, names))


class AsLayer:
    """A piece's compiled artifact, compiled for another layer, run as this
    piece's layer(s)."""

    def __init__(self, fn: Callable[..., Any], alias: dict[str, str]) -> None:
        self.fn = fn
        self.alias = alias

    def __call__(self, *args: Any) -> Any:
        return call_as_layers(self.alias, self.fn, *args)

    def __repr__(self) -> str:
        return f"AsLayer({self.alias})"
