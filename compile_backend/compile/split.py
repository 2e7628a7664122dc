"""Cut an FX graph at attention breakpoints: a pure function returning data.

    split_graph(gm, roles) -> (split_gm, pieces)

Each run of consecutive eager nodes (breakpoints, plus nodes a pass marked
`node.meta[EAGER_REASON]` because they cannot be captured) becomes one eager
piece; everything between them becomes a piece to capture. A tuple `getitem`
on an eager node stays with its producer, so a breakpoint that returns a tuple
and the next breakpoint still merge into one eager piece.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from compile_backend.core.op_registry import (
    EAGER_REASON, OpRegistry, OpRole, is_eager_node, node_op_name,
)


# Nodes that carry no computation worth listing among a piece's ops.
_BOOKKEEPING = ("python::getitem",)


@dataclass
class Piece:
    index: int
    name: str  # attribute of split_gm: "submod_<index>"
    captured: bool  # False: runs eagerly (breakpoints or a capture fallback)
    ops: list[str] = field(default_factory=list)  # op names in order
    breakpoints: list[str] = field(default_factory=list)
    attention_like: list[str] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)  # all-reduces etc. (role collective)
    eager_reasons: list[str] = field(default_factory=list)  # fallbacks, with source line
    # indices of its inputs it writes (set by the piece compiler's fake run)
    written_inputs: frozenset[int] = field(default_factory=frozenset)
    # the identical piece whose compiled artifact this one runs (None: its own)
    compiled_as: str | None = None
    # how a captured piece is compiled: "inductor", or "eager" (as traced:
    # the eager piece compiler, or too few ops for Inductor to fuse); set by
    # the piece compiler, with the ops it could fuse (compile/fusible.py)
    compiled_with: str | None = None
    fusible_ops: list[str] = field(default_factory=list)
    # compiled_as's layer names -> this piece's (None: the same layers)
    layer_alias: dict[str, str] | None = None
    graph_module: torch.fx.GraphModule | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "captured": self.captured,
            "ops": self.ops,
            "breakpoints": self.breakpoints,
            "attention_like": self.attention_like,
            "collectives": self.collectives,
            "eager_reasons": self.eager_reasons,
            "written_inputs": sorted(self.written_inputs),
            "compiled_as": self.compiled_as,
            "compiled_with": self.compiled_with,
            "fusible_ops": self.fusible_ops,
        }


def assign_partitions(gm: torch.fx.GraphModule, roles: OpRegistry) -> dict[torch.fx.Node, int]:
    """Partition id per computing node, in graph order; ids count up from 0."""
    part: dict[torch.fx.Node, int] = {}
    eager_parts: set[int] = set()
    current, current_eager = -1, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        producer = node.args[0] if node.args else None
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(producer, torch.fx.Node)
            and part.get(producer) in eager_parts
        ):
            part[node] = part[producer]  # tuple accessor stays with its producer
            continue
        eager = is_eager_node(node, roles)
        if eager != current_eager:
            current, current_eager = current + 1, eager
            if eager:
                eager_parts.add(current)
        part[node] = current
    return part


def split_graph(
    gm: torch.fx.GraphModule, roles: OpRegistry
) -> tuple[torch.fx.GraphModule, list[Piece]]:
    part = assign_partitions(gm, roles)
    # keep_original_order=True: nodes run in the traced order, so an in-place
    # mutation (a KV-cache write, a state update) is never moved past a reader.
    split_gm = split_module(gm, gm, lambda n: part[n], keep_original_order=True)

    by_part: dict[int, list[torch.fx.Node]] = {}
    for node, p in part.items():
        by_part.setdefault(p, []).append(node)
    pieces = []
    for p in sorted(by_part):
        nodes = by_part[p]
        names = [node_op_name(n) for n in nodes]
        captured = not any(is_eager_node(n, roles) for n in nodes)
        piece = Piece(
            index=p,
            name=f"submod_{p}",
            captured=captured,
            ops=[n for n in names if n and n not in _BOOKKEEPING],
            breakpoints=[node_op_name(n) for n in nodes if roles.role(n) is OpRole.BREAKPOINT],
            attention_like=[
                node_op_name(n) for n in nodes if roles.role(n) is OpRole.ATTENTION_LIKE
            ],
            collectives=[node_op_name(n) for n in nodes if roles.role(n) is OpRole.COLLECTIVE],
            eager_reasons=[n.meta[EAGER_REASON] for n in nodes if EAGER_REASON in n.meta],
            graph_module=getattr(split_gm, f"submod_{p}"),
        )
        pieces.append(piece)
    assert [q.index for q in pieces] == list(range(len(pieces))), [q.index for q in pieces]
    return split_gm, pieces
