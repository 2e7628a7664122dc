"""Growing caches run with the attention: what reads a cache that the graph
grows by concatenation at every call runs eagerly, so the pieces keep graphs.

transformers' DynamicCache appends each step's keys with `torch.cat([cache,
new], dim)`: in Dynamo's graph the old cache is an input of symbolic length
s, the cat (s + 1) a graph output and the attention's operand. A piece that
took such a tensor, or s itself (`arange(s, s + 1)` positions), would have a
new shape or value at every call, and a graph per size replays at most once.
This pass finds the growing lengths (a placeholder's symbolic size that a
returned cat extends) and marks every node that reads or makes a value of
such a length to run with the breakpoints (`WITH_BREAKPOINT`: a choice, not
a capture fallback); the segment pass puts them beside the attention.
docs/design.md, "Growing caches run with the attention".
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from compile_backend.core.counters import counters
from compile_backend.core.op_registry import WITH_BREAKPOINT, OpRegistry, OpRole

from .fx_nodes import example_value, op_label
from .pass_base import Mrv2Pass, PassReport

logger = logging.getLogger(__name__)

_CATS = (torch.cat, torch.concat, torch.ops.aten.cat.default)


def _symbols(value: Any) -> set:
    """The free symbols of a fake tensor's shape, or of a SymInt (empty for
    anything else, or a value without symbols)."""
    if isinstance(value, torch.Tensor):
        return set().union(*(free_symbols(d) for d in value.shape)) if value.shape else set()
    if isinstance(value, torch.SymInt):
        return set(free_symbols(value))
    return set()


def _cat_parts(node: torch.fx.Node) -> tuple[list[Any], int] | None:
    if node.op != "call_function" or node.target not in _CATS:
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    return list(tensors), dim


def growing_lengths(graph: torch.fx.Graph) -> dict[Any, str]:
    """symbol -> the placeholder it is the length of, for every placeholder
    whose symbolic size along `dim` a returned `cat([placeholder, ...], dim)`
    extends (a cache the graph grows at every call)."""
    out = next(n for n in graph.nodes if n.op == "output")
    returned = set(out.all_input_nodes)
    found: dict[Any, str] = {}
    for node in graph.nodes:
        parts = _cat_parts(node)
        if parts is None or node not in returned:
            continue
        tensors, dim = parts
        first = tensors[0] if tensors else None
        if not isinstance(first, torch.fx.Node) or first.op != "placeholder":
            continue
        old, new = example_value(first), example_value(node)
        if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
            continue
        d = dim % old.dim() if old.dim() else 0
        length = old.shape[d] if old.dim() else None
        if isinstance(length, torch.SymInt) and len(free_symbols(length)) == 1:
            grown = new.shape[d]
            if isinstance(grown, torch.SymInt) and free_symbols(grown) == free_symbols(length):
                found[next(iter(free_symbols(length)))] = first.name
    return found


class GrowingCachesPass(Mrv2Pass):
    """See the module docstring."""

    MAX_LISTED = 50

    def __init__(self, roles: OpRegistry, enabled: bool = True) -> None:
        self.roles = roles
        self.enabled = enabled

    def settings(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "roles": self.roles.summary()}

    def apply(self, graph: torch.fx.Graph) -> PassReport:
        lengths = growing_lengths(graph) if self.enabled else {}
        if not lengths:
            return PassReport(changed=False, details={"growing": [], "marked": 0})
        grows = set(lengths)
        reason = (f"reads a cache the graph grows at every call ({', '.join(sorted(set(lengths.values())))}"
                  "): runs with the attention, so the pieces between keep fixed shapes")
        marked: list[str] = []
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            role = self.roles.role(node)
            if role is OpRole.BREAKPOINT:
                continue
            reads = any(_symbols(example_value(a)) & grows for a in node.all_input_nodes)
            if not reads and not _symbols(example_value(node)) & grows:
                continue
            if role is not OpRole.ORDINARY:
                # Attention-like ops stay captured, collectives stay where they are.
                logger.info("mrv2: %s reads a growing cache but is %s: left in its piece",
                            op_label(node), role.value)
                continue
            node.meta[WITH_BREAKPOINT] = reason
            marked.append(node.name)
        counters["pass_growing_cache_nodes"] += len(marked)
        logger.info("mrv2: %d nodes read caches that grow at every call (%s): they run with the "
                    "attention", len(marked), ", ".join(sorted(set(lengths.values()))))
        return PassReport(changed=bool(marked), details={
            "growing": sorted(set(lengths.values())), "marked": len(marked),
            "nodes": marked[: self.MAX_LISTED]})
