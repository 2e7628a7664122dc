"""FX graphs as plain data and back, for a saved step that loads without
Dynamo: each node's op, name, target and arguments, other nodes named by a
reference; a call_function's target by its qualified name, resolved again
(`torch.ops.mrv2.norm_linear.default`, `torch.narrow`, `_operator.getitem`).

    data = encode(gm)          # raises Unencodable: then GraphPickler saves it
    gm = decode(data)          # a GraphModule with its submodules, code not yet generated

Node metadata (fake values, sources) is not kept, as compile/step_artifacts.py
keeps none either. FX's GraphPickler does the same with more kinds of
targets, but importing it imports Dynamo and Inductor (about 1 s on the CPU
machine): docs/design.md, "A warm start without Dynamo".
"""

from __future__ import annotations

import importlib
import pickle
from typing import Any

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.node import _get_qualified_name, map_aggregate, map_arg


class Unencodable(Exception):
    """A graph this codec cannot save (the reason is the message)."""


class _Ref:
    """Another node of the graph, by name, in an encoded node's arguments."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        return (_Ref, (self.name,))


def resolve(qualified: str) -> Any:
    """The object a qualified name names: the longest importable module
    prefix, then attributes (`torch.ops.mrv2.norm_linear.default`)."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise Unencodable(f"no module in {qualified!r}")


def _target(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    try:
        name = _get_qualified_name(target)
        same = resolve(name) is target
    except Exception as e:  # noqa: BLE001 - any failure: this node cannot be named
        raise Unencodable(f"node {node.name}: its target {target!r} has no importable name "
                          f"({type(e).__name__}: {e})") from None
    if not same:
        raise Unencodable(f"node {node.name}: {name!r} names another object than its target")
    return name


def encode(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """`gm`'s graph and its GraphModule children as plain, picklable data.
    Raises Unencodable (with the reason) for a target without an importable
    name, a child that is not a GraphModule, or an argument pickle refuses."""
    nodes = []
    for node in gm.graph.nodes:
        args = map_arg(node.args, lambda n: _Ref(n.name))
        kwargs = map_arg(node.kwargs, lambda n: _Ref(n.name))
        nodes.append((node.op, node.name, _target(node), args, kwargs))
    children = {}
    for name, child in gm.named_children():
        if not isinstance(child, torch.fx.GraphModule):
            raise Unencodable(f"submodule {name} is a {type(child).__name__}, not a graph")
        children[name] = encode(child)
    data = {"nodes": nodes, "children": children}
    try:
        pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - e.g. a tensor subclass constant
        raise Unencodable(f"an argument cannot be pickled ({type(e).__name__}: {e})") from None
    return data


def decode(data: dict[str, Any]) -> torch.fx.GraphModule:
    """`encode`'s data as a GraphModule (lazy: its code is generated at its
    first call or `recompile`), with its children."""
    children = {name: decode(child) for name, child in data["children"].items()}
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    targets: dict[str, Any] = {}  # qualified name -> object, once per graph

    def load(a: Any) -> Any:
        return env[a.name] if isinstance(a, _Ref) else a

    for op, name, target, args, kwargs in data["nodes"]:
        args, kwargs = map_aggregate(args, load), map_aggregate(kwargs, load)
        if op == "output":
            graph.output(args[0])
            continue
        if op == "call_function":
            if target not in targets:
                targets[target] = resolve(target)
            target = targets[target]
        node = graph.create_node(op, target, args, kwargs, name=name)
        assert node.name == name, (node.name, name)  # later nodes refer to it by name
        env[name] = node
    return _LazyGraphModule(children, graph)
