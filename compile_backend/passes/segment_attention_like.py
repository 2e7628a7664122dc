"""Keep attention-like ops inside captured segments, and order the graph so
that it splits into as few pieces as the data and the mutations allow.

The splitter (compile_backend/compile/split.py) cuts wherever the node kind
changes in graph order: eager (breakpoints, capture fallbacks, and tuple
accessors of their outputs) or captured (everything else). Attention-like
ops are never eager (this pass logs each one that a `namespace::*` entry of
splitting_ops covers). The pass moves independent nodes across breakpoints
so that breakpoints cluster and captured nodes join a neighbouring captured
segment: a topological order with the fewest kind changes (a greedy that is
optimal), kept only when it saves a segment. Which moves are allowed is
effects.py's (data, storages written and read, barriers, the RNG). An
example, the rules and the proof: docs/design.md, "The FX passes".
"""

from __future__ import annotations

import bisect
import heapq
import logging
from typing import Any, Hashable

import torch
import torch.fx

from compile_backend.core.counters import counters
from compile_backend.core.op_registry import OpRegistry, OpRole, is_eager_node, node_op_name

from .effects import node_effects, output_roots
from .fx_nodes import is_tuple_getitem
from .pass_base import Mrv2Pass, PassReport

logger = logging.getLogger(__name__)

EAGER, CAPTURED = "eager", "captured"


def node_kinds(nodes: list[torch.fx.Node], roles: OpRegistry) -> dict[torch.fx.Node, str]:
    """EAGER or CAPTURED, as the splitter will see them. A tuple accessor of an
    eager node is eager: the splitter keeps it with its producer."""
    kind: dict[torch.fx.Node, str] = {}
    for n in nodes:
        if is_tuple_getitem(n) and kind.get(n.args[0]) == EAGER:
            kind[n] = EAGER
        else:
            kind[n] = EAGER if is_eager_node(n, roles) else CAPTURED
    return kind


def count_segments(order: list[torch.fx.Node], kind: dict[torch.fx.Node, str]) -> int:
    """Pieces the splitter makes from this order (tuple accessors of eager
    nodes never open a segment: they stay with their producer)."""
    segments, last = 0, None
    for n in order:
        if is_tuple_getitem(n) and kind.get(n.args[0]) == EAGER:
            continue
        if kind[n] != last:
            segments, last = segments + 1, kind[n]
    return segments


def dependency_graph(nodes: list[torch.fx.Node]) -> tuple[list[list[int]], list[str]]:
    """preds[i]: indices that must come before nodes[i]; barriers: their names."""
    index = {n: i for i, n in enumerate(nodes)}
    roots: dict[torch.fx.Node, set[Hashable]] = {}
    for n in nodes[0].graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            roots[n] = output_roots(n, roots)
    effects = []
    for n in nodes:
        effects.append(node_effects(n, roots))
        roots[n] = output_roots(n, roots)
    written = set().union(*(e.writes for e in effects)) if effects else set()

    preds: list[list[int]] = [[] for _ in nodes]
    last_writer: dict[Hashable, int] = {}
    readers: dict[Hashable, list[int]] = {}
    last_barrier, since_barrier = None, []
    barriers = []
    for i, (n, eff) in enumerate(zip(nodes, effects)):
        p = {index[a] for a in n.all_input_nodes if a in index}
        for r in (eff.reads | eff.writes) & written:
            if r in last_writer:
                p.add(last_writer[r])
        for r in eff.writes:
            p.update(readers.pop(r, []))
            last_writer[r] = i
        for r in (eff.reads - eff.writes) & written:
            readers.setdefault(r, []).append(i)
        if eff.barrier:
            p.update(since_barrier)
            since_barrier = []
            barriers.append(n.name)
        if last_barrier is not None:
            p.add(last_barrier)
        if eff.barrier:
            last_barrier = i
        else:
            since_barrier.append(i)
        p.discard(i)
        preds[i] = sorted(p)
    return preds, barriers


def greedy_order(preds: list[list[int]], kinds: list[str], start: str) -> list[int]:
    """Phases of alternating kind, each scheduling every ready node of its kind
    (original order within a phase)."""
    n = len(kinds)
    succs: list[list[int]] = [[] for _ in range(n)]
    missing = [len(p) for p in preds]
    for i, p in enumerate(preds):
        for j in p:
            succs[j].append(i)
    ready: dict[str, list[int]] = {EAGER: [], CAPTURED: []}
    for i in range(n):
        if missing[i] == 0:
            ready[kinds[i]].append(i)
    order: list[int] = []
    phase = start
    while len(order) < n:
        heap = ready[phase]
        heapq.heapify(heap)
        if not heap:
            other = CAPTURED if phase == EAGER else EAGER
            assert ready[other], f"dependency cycle among {n - len(order)} nodes"
            phase = other
            continue
        while heap:
            i = heapq.heappop(heap)
            order.append(i)
            for s in succs[i]:
                missing[s] -= 1
                if missing[s] == 0:
                    if kinds[s] == phase:
                        heapq.heappush(heap, s)
                    else:
                        ready[kinds[s]].append(s)
        phase = CAPTURED if phase == EAGER else EAGER
    return order


def _moved(order: list[int]) -> list[int]:
    """Indices outside a longest increasing subsequence: the fewest nodes
    whose moves explain the new order."""
    tails: list[int] = []  # tails[k]: smallest tail of an increasing run of length k+1
    tail_pos: list[int] = []
    parent = [-1] * len(order)
    for pos, v in enumerate(order):
        k = bisect.bisect_left(tails, v)
        parent[pos] = tail_pos[k - 1] if k else -1
        if k == len(tails):
            tails.append(v)
            tail_pos.append(pos)
        else:
            tails[k], tail_pos[k] = v, pos
    keep = set()
    pos = tail_pos[-1] if tail_pos else -1
    while pos != -1:
        keep.add(order[pos])
        pos = parent[pos]
    return [v for v in order if v not in keep]


class SegmentAttentionLikePass(Mrv2Pass):
    """See the module docstring."""

    MAX_LISTED = 50  # names listed in the log details

    def __init__(self, roles: OpRegistry, reorder: bool = True) -> None:
        self.roles = roles
        self.reorder = reorder

    def settings(self) -> dict[str, Any]:
        return {"reorder": self.reorder, "roles": self.roles.summary()}

    def apply(self, graph: torch.fx.Graph) -> PassReport:
        nodes = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
        details: dict[str, Any] = {}
        attention_like = sorted({
            node_op_name(n) for n in nodes if self.roles.role(n) is OpRole.ATTENTION_LIKE
        })
        conflicts = self.roles.wildcard_conflicts(attention_like)
        for name in conflicts:
            logger.info(
                "mrv2: %s is attention-like; splitting_ops covers it with %s::*, but it is "
                "never a split point and stays in a captured segment", name, name.split("::")[0],
            )
        details["attention_like"] = attention_like
        details["attention_like_not_split"] = conflicts
        if not nodes:
            details.update(segments_before=0, segments_after=0, moved=[])
            return PassReport(changed=False, details=details)

        kind = node_kinds(nodes, self.roles)
        before = count_segments(nodes, kind)
        details["segments_before"] = before
        details["segments_after"] = before
        details["moved"] = []
        if not self.reorder or before <= 2:
            return PassReport(changed=False, details=details)

        preds, barriers = dependency_graph(nodes)
        kinds = [kind[n] for n in nodes]
        best = None
        for start in (CAPTURED, EAGER):
            order = greedy_order(preds, kinds, start)
            segs = count_segments([nodes[i] for i in order], kind)
            key = (segs, len(_moved(order)))
            if best is None or key < best[0]:
                best = (key, order)
        (after, _), order = best
        details["barriers"] = barriers[: self.MAX_LISTED]
        if after >= before:
            return PassReport(changed=False, details=details)

        self._rewrite(graph, [nodes[i] for i in order])
        moved = [nodes[i].name for i in _moved(order)]
        details.update(segments_after=after, num_moved=len(moved), moved=moved[: self.MAX_LISTED])
        counters["pass_nodes_moved"] += len(moved)
        counters["pass_segments_saved"] += before - after
        logger.info("mrv2: reordered %d nodes: %d -> %d segments", len(moved), before, after)
        return PassReport(changed=True, details=details)

    @staticmethod
    def _rewrite(graph: torch.fx.Graph, order: list[torch.fx.Node]) -> None:
        """Placeholders and attributes first, then `order`, then the output."""
        fixed = [n for n in graph.nodes if n.op in ("placeholder", "get_attr")]
        output = [n for n in graph.nodes if n.op == "output"]
        cursor = None
        for n in fixed + order + output:
            if cursor is None:
                first = next(iter(graph.nodes))
                if first is not n:
                    first.prepend(n)
            elif cursor.next is not n:
                cursor.append(n)
            cursor = n
