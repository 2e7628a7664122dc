"""Rotary and the KV write move into the decode attention's launch.

`q_rot = rope_and_cache(q, k, v, positions, inv_freq, kc, vc, layer)` then
`unified_attention(q_rot, kc, vc, out, layer, scale)` (PagedAttention given
positions) becomes ONE `mrv2::rope_attention(q, k, v, positions, inv_freq,
kc, vc, out, layer, scale)` at the attention's place (on a GPU decode batch
one launch instead of two: compile_backend/kernels/rope_attention.py).
Fires for a rotated q whose one user is that attention, the same layer name
and cache nodes, an attention that is a breakpoint as the fused op is,
nothing marked eager, and no node between that reads or writes the caches
or is a `motion_barrier` (effects.py). Only with `fuse_rope_attention` on in
a graph compiled for cudagraph_mode FULL (elsewhere the fused op would run
at the eager breakpoint, its plan built per call). The report says, for
each pair not fused, why. docs/design.md, "Rotary inside decode attention".
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.fx

from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.core.op_registry import EAGER_REASON, WITH_BREAKPOINT, node_op_name

from .effects import motion_barrier, node_effects, output_roots
from .fx_nodes import erase_replaced, insert_call, op_label, schema_overloads, source_line
from .pass_base import FusionPass, PassReport

ROPE = "mrv2::rope_and_cache"
ATTENTION = "mrv2::unified_attention"
FUSED = "mrv2::rope_attention"
# The arguments of each op, by name (their schemas in compile_backend/kernels/).
_ROPE_ARGS = ("q", "k", "v", "positions", "inv_freq", "key_cache", "value_cache", "layer_name")
_ATTENTION_ARGS = ("query", "key_cache", "value_cache", "output", "layer_name", "scale")


def _bound(node: torch.fx.Node, names: tuple[str, ...]) -> dict[str, Any] | None:
    """The node's arguments by schema name (keywords and defaults included),
    or None when they do not bind to `names`."""
    overloads = schema_overloads(node.target)
    if not overloads:
        return None
    schema = overloads[0]._schema
    params = [a.name for a in schema.arguments]
    if len(node.args) > len(params) or set(node.kwargs) - set(params):
        return None
    out: dict[str, Any] = dict(zip(params, node.args))
    out.update(node.kwargs)
    for a in schema.arguments:
        if a.name not in out and a.has_default_value():
            out[a.name] = a.default_value
    return {n: out[n] for n in names} if all(n in out for n in names) else None


def _marked(node: torch.fx.Node) -> str | None:
    """Why a pass marked `node` to run eagerly (None: not marked). The
    attention runs eagerly by its role in PIECEWISE; that is no mark."""
    return node.meta.get(EAGER_REASON) or node.meta.get(WITH_BREAKPOINT)


class FuseRopeAttentionPass(FusionPass):
    """See the module docstring. `enabled`: config `fuse_rope_attention`;
    `mode`: the graph mode the graph is compiled for (config
    `cudagraph_mode`). Edits only when both allow it; otherwise the report's
    `disabled` says why. A match is (attention, rope_and_cache)."""

    OP = "rope_attention"  # compile_backend/kernels/rope_attention.py
    COUNTER = "pass_rope_attention_fused"
    LOG = "mrv2: fused %d rope_and_cache + unified_attention pair(s) into mrv2::rope_attention"

    def __init__(self, roles: Any, enabled: bool = True,
                 mode: CUDAGraphMode | str = CUDAGraphMode.FULL) -> None:
        mode = CUDAGraphMode.parse(mode)
        self.disabled: str | None = None
        if not enabled:
            self.disabled = "fuse_rope_attention is off"
        elif mode is not CUDAGraphMode.FULL:
            self.disabled = (
                f"cudagraph_mode is {mode.value}, not full: the fused op is a breakpoint, "
                "which outside a FULL graph runs eagerly with its plan built at every call, "
                "where rope_and_cache runs inside a captured piece")
        super().__init__(roles, enabled=self.disabled is None)

    def apply(self, graph: torch.fx.Graph) -> PassReport:
        report = super().apply(graph)
        if self.disabled is not None:
            report.details["disabled"] = self.disabled
        return report

    def unfused(self, match: tuple[torch.fx.Node | None, torch.fx.Node],
                reason: str) -> dict[str, Any]:
        """(attention, rope); attention None: a rope_and_cache that feeds none."""
        attn, rope = match
        bound = _bound(attn, _ATTENTION_ARGS) if attn is not None else _bound(rope, _ROPE_ARGS)
        layer = bound["layer_name"] if bound is not None else None
        return {"rope": rope.name, "attention": attn.name if attn is not None else None,
                "layer": layer if isinstance(layer, str) else None, "reason": reason,
                "source": source_line(attn if attn is not None else rope)}

    # ---- finding the pairs ---------------------------------------------------------

    def find(self, graph: torch.fx.Graph,
             not_fused: list[dict[str, Any]]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
        """(attention, rope_and_cache) pairs to fuse, in graph order."""
        matches: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        roots: dict[torch.fx.Node, set[Hashable]] = {}
        # rope node -> the storages of its caches, while nothing between has
        # touched them or been a barrier; then rope -> the node that did.
        open_: dict[torch.fx.Node, set[Hashable]] = {}
        blocked: dict[torch.fx.Node, torch.fx.Node] = {}
        seen_ropes: list[torch.fx.Node] = []
        taken: set[torch.fx.Node] = set()  # ropes matched or reported with an attention
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                roots[node] = output_roots(node, roots)
                continue
            name = node_op_name(node)
            if name == ATTENTION:
                rope = self._rope_of(node)
                if rope is not None:
                    taken.add(rope)
                    why = self._why_not(node, rope, open_, blocked)
                    if why is None:
                        matches.append((node, rope))
                    else:
                        not_fused.append(self.unfused((node, rope), why))
                    open_.pop(rope, None)
            self._close(node, open_, blocked, roots)
            if name == ROPE:
                seen_ropes.append(node)
                bound = _bound(node, _ROPE_ARGS)
                if bound is not None:
                    open_[node] = set()
                    for cache in (bound["key_cache"], bound["value_cache"]):
                        if isinstance(cache, torch.fx.Node):
                            open_[node] |= roots.get(cache, set())
            roots[node] = output_roots(node, roots)
        for rope in seen_ropes:
            if rope not in taken:
                users = ", ".join(f"`{op_label(u)}` ({u.name})" for u in rope.users) or "none"
                not_fused.append(self.unfused(
                    (None, rope), f"its rotated q feeds no {ATTENTION} directly (users: {users})"))
        return matches

    def _close(self, node: torch.fx.Node, open_: dict[torch.fx.Node, set[Hashable]],
               blocked: dict[torch.fx.Node, torch.fx.Node],
               roots: dict[torch.fx.Node, set[Hashable]]) -> None:
        """Close every open rope that `node` (after it in graph order, before
        its attention) keeps from moving to its attention."""
        if not open_:
            return
        barrier = motion_barrier(node, self.roles, roots)
        touched: set[Hashable] = set()
        if not barrier:
            eff = node_effects(node, roots)
            touched = eff.reads | eff.writes
        for rope, caches in list(open_.items()):
            if barrier or touched & caches:
                blocked[rope] = node
                del open_[rope]

    @staticmethod
    def _rope_of(attn: torch.fx.Node) -> torch.fx.Node | None:
        """The rope_and_cache node that is `attn`'s query, or None."""
        bound = _bound(attn, _ATTENTION_ARGS)
        q = bound["query"] if bound is not None else None
        if isinstance(q, torch.fx.Node) and node_op_name(q) == ROPE:
            return q
        return None

    def _why_not(self, attn: torch.fx.Node, rope: torch.fx.Node,
                 open_: dict[torch.fx.Node, set[Hashable]],
                 blocked: dict[torch.fx.Node, torch.fx.Node]) -> str | None:
        """Why this pair cannot become one rope_attention (None: it can)."""
        a, r = _bound(attn, _ATTENTION_ARGS), _bound(rope, _ROPE_ARGS)
        if a is None or r is None:
            return "the arguments do not bind to the ops' schemas"
        for what, node in (("rope_and_cache", rope), ("attention", attn)):
            mark = _marked(node)
            if mark is not None:
                return f"the {what} runs eagerly ({mark})"
        role, fused_role = self.roles.role(attn), self.roles.role_of_name(FUSED)
        if role is not fused_role:
            return (f"the attention's role is {role.value}, the fused op's {fused_role.value}: "
                    "the split would change")
        if len(rope.users) != 1:
            users = ", ".join(u.name for u in rope.users)
            return (f"the rotated q has {len(rope.users)} users ({users}; fusing needs the "
                    "attention only)")
        uses = [v for v in a.values() if v is rope]
        if len(uses) != 1:
            return "the attention reads the rotated q as another argument too"
        if a["layer_name"] != r["layer_name"]:
            return f"layer names differ: {r['layer_name']!r}, attention {a['layer_name']!r}"
        for cache in ("key_cache", "value_cache"):
            if a[cache] is not r[cache]:
                return (f"the {cache}s differ: {getattr(r[cache], 'name', r[cache])}, attention "
                        f"{getattr(a[cache], 'name', a[cache])}")
        if rope in blocked:
            barrier = blocked[rope]
            return (f"`{op_label(barrier)}` ({barrier.name}) between the rope_and_cache and the "
                    "attention reads or writes the caches, writes something, runs eagerly or is "
                    "a breakpoint, attention-like op or collective")
        if rope not in open_:
            return "the rope_and_cache cannot move to the attention"
        return None

    # ---- rewriting -------------------------------------------------------------------------

    def fuse(self, graph: torch.fx.Graph, match: tuple[torch.fx.Node, torch.fx.Node],
             op: Any) -> dict[str, Any]:
        """rope_attention(...) at the attention's place; both nodes go."""
        attn, rope = match
        a, r = _bound(attn, _ATTENTION_ARGS), _bound(rope, _ROPE_ARGS)
        args = (r["q"], r["k"], r["v"], r["positions"], r["inv_freq"], r["key_cache"],
                r["value_cache"], a["output"], a["layer_name"], a["scale"])
        fused = insert_call(graph, attn, op, args, like=attn)
        # The op returns (), as the attention: its value metadata as the
        # attention's (Dynamo records none for an op that returns nothing).
        for key in ("example_value", "val"):
            if key in attn.meta:
                fused.meta[key] = attn.meta[key]
            else:
                fused.meta.pop(key, None)
        entry = {
            "node": fused.name,
            "rope": rope.name,
            "attention": attn.name,
            "layer": a["layer_name"],
            "source": source_line(attn),
        }
        attn.replace_all_uses_with(fused)
        erase_replaced(graph, [attn, rope])
        return entry


def fused_rope_attentions(pass_log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rope_and_cache + attention pairs this pass fused, from a PassManager log."""
    return FuseRopeAttentionPass.fused_in(pass_log)
