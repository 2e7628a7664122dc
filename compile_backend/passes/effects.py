"""What a node does besides computing its value, as the passes that move or
fuse nodes must know it: the storages it reads and writes (views alias their
base, through the fake values Dynamo records), whether its effects are
unknown (a barrier), and whether computation may move across it
(`motion_barrier`).

Contract: `output_roots` and `node_effects` take `roots`, the storages of
the nodes before this one, filled in graph order; both are conservative
(what cannot be seen counts as aliasing everything, or as a barrier). Which
orders this allows: docs/design.md, "The FX passes".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from compile_backend.core.op_registry import OpRegistry, OpRole, node_op_name

from .fx_nodes import (
    bare_name,
    example_value,
    is_python_builtin,
    is_tensor_method,
    is_torch_level,
    op_tags,
    runs_eagerly,
    schema_overloads,
    sets_global_state,
)

_RNG: Hashable = "rng-state"  # the pseudo-tensor random ops write

_INPLACE_OPERATORS = frozenset({
    "setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
    "iand", "ior", "ixor", "ilshift", "irshift", "imatmul",
})
_EFFECTFUL_METHODS = frozenset({"record_stream", "register_hook", "retain_grad", "backward"})
_RANDOM_NAMES = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "bernoulli", "multinomial", "normal", "poisson", "dropout",
})
_PURE_HIGHER_ORDER = frozenset({"higher_order::flex_attention"})


@dataclass
class Effects:
    """What a node touches: storages read and written, or 'anything' (barrier)."""

    reads: set[Hashable] = field(default_factory=set)
    writes: set[Hashable] = field(default_factory=set)
    barrier: bool = False


def _is_inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def output_roots(node: torch.fx.Node, roots: dict[torch.fx.Node, set[Hashable]]) -> set[Hashable]:
    """Storages a node's value may share. From the recorded fake value when
    there is one; otherwise assume it may alias every input (conservative)."""
    val = example_value(node)
    tensors = [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]
    if tensors:
        try:
            return {StorageWeakRef(t.untyped_storage()) for t in tensors}
        except Exception:  # noqa: BLE001 (tensors without storage: sparse, nested)
            pass
    if val is not None and not tensors:
        return set()  # a SymInt, a float, None: no storage
    overloads = schema_overloads(node.target)
    if overloads and not any(r.alias_info for ov in overloads for r in ov._schema.returns):
        return {node}  # the schema promises fresh outputs
    out: set[Hashable] = {node}
    for arg in node.all_input_nodes:
        out |= roots.get(arg, set())
    return out


def _arg_nodes(value: Any) -> list[torch.fx.Node]:
    return [v for v in tree_leaves(value) if isinstance(v, torch.fx.Node)]


def node_effects(node: torch.fx.Node, roots: dict[torch.fx.Node, set[Hashable]]) -> Effects:
    """Classify one call node; unknown means barrier."""

    def roots_of(values: Any) -> set[Hashable]:
        out: set[Hashable] = set()
        for n in _arg_nodes(values):
            out |= roots.get(n, set())
        return out

    eff = Effects(reads=roots_of([node.args, node.kwargs]))
    target = node.target
    name = bare_name(node)
    if node.op == "call_module":
        owner = node.graph.owning_module
        mod = owner.get_submodule(node.target) if owner is not None else None
        eff.barrier = mod is None or not type(mod).__module__.startswith("torch.nn.")
        return eff
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        for ov in schema_overloads(target):  # union over overloads: conservative
            for i, arg in enumerate(ov._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                if i < len(node.args):
                    eff.writes |= roots_of(node.args[i])
                if arg.name in node.kwargs:
                    eff.writes |= roots_of(node.kwargs[arg.name])
        if _has_registered_effect(target):
            eff.barrier = True
    elif isinstance(target, torch._ops.HigherOrderOperator):
        eff.barrier = node_op_name(node) not in _PURE_HIGHER_ORDER
        return eff
    elif sets_global_state(node):
        eff.barrier = True
        return eff
    elif node.op == "call_method" or is_tensor_method(target):
        if name in _EFFECTFUL_METHODS:
            eff.barrier = True
        elif _is_inplace_name(name) or name == "__setitem__" or (
            name.startswith("__i") and f"i{name[3:-2]}" in _INPLACE_OPERATORS  # __iadd__
        ):
            eff.writes |= roots_of(node.args[:1])
    elif is_python_builtin(node):
        if name in _INPLACE_OPERATORS:
            eff.writes |= roots_of(node.args[:1])
    elif is_torch_level(node):
        if _is_inplace_name(name) or _inplace_flag(node):
            eff.writes |= roots_of(node.args[:1])
    else:
        eff.barrier = True
        return eff
    if "out" in node.kwargs:
        eff.writes |= roots_of(node.kwargs["out"])
    if name in _RANDOM_NAMES or "nondeterministic_seeded" in op_tags(node):
        eff.writes.add(_RNG)
        eff.reads.add(_RNG)
    return eff


def _inplace_flag(node: torch.fx.Node) -> bool:
    """`F.relu(x, inplace=True)`, also when `inplace` is passed by position."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        params = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return False
    if "inplace" not in params:
        return False
    i = params.index("inplace")
    return i < len(node.args) and node.args[i] is True


def _has_registered_effect(op: Any) -> bool:
    """Ops registered as effectful (`aten._print`, profiler records, ...)."""
    try:
        from torch._higher_order_ops.effects import _get_effect
    except ImportError:  # older torch: no registry to ask
        return False
    for ov in schema_overloads(op):
        try:
            if _get_effect(ov) is not None:
                return True
        except Exception:  # noqa: BLE001 (the registry's API moves between versions)
            return False
    return False


def motion_barrier(node: torch.fx.Node, roles: OpRegistry,
                   roots: dict[torch.fx.Node, set[Hashable]]) -> bool:
    """No computation may move across this node: it writes something, runs
    eagerly, or is a breakpoint, attention-like op or collective. `roots`:
    the storages of the nodes before it (`output_roots`, filled in graph
    order)."""
    if runs_eagerly(node, roles):
        return True
    if roles.role(node) is not OpRole.ORDINARY:
        return True
    eff = node_effects(node, roots)
    return eff.barrier or bool(eff.writes)


def call_nodes_and_barriers(graph: torch.fx.Graph,
                            roles: OpRegistry) -> Iterator[tuple[torch.fx.Node, bool]]:
    """Each call node of `graph` in order (no placeholder, get_attr or
    output), and whether it is a `motion_barrier`. The storages are filled
    as the walk goes, so the graph must not change while it runs."""
    roots: dict[torch.fx.Node, set[Hashable]] = {}
    for node in graph.nodes:
        if node.op not in ("placeholder", "get_attr", "output"):
            yield node, motion_barrier(node, roles, roots)
        roots[node] = output_roots(node, roots)
