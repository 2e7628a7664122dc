"""The registry of op facts (README.md, "Op roles").

Everything that asks "what is this op?" (the splitter, the passes, layer
sharing, the debug dump) asks an `OpRegistry`. An op, named `namespace::name`
(`namespace::*`: a whole namespace), has a role (breakpoint, attention-like,
collective: process-wide defaults that a config edits for one compile), and
may be layer-keyed and capture-safe (both process-wide, read when asked).
Whoever defines an op declares its facts once, beside the definition:
    register_op("mylib::attn", role="breakpoint", layer_keyed=True, capture_safe=True)
This project's own kernels (compile_backend/kernels/) do so when imported;
core names none of them and imports no kernel. docs/design.md, section "Op
facts live in one registry".
"""

from __future__ import annotations

import enum
import logging
import operator
from typing import Any, Callable, Iterable

import torch
import torch.fx

logger = logging.getLogger(__name__)


class OpRole(enum.Enum):
    BREAKPOINT = "breakpoint"  # split there; runs eagerly between piecewise graphs
    ATTENTION_LIKE = "attention_like"  # never split; always inside a captured segment
    # A collective across ranks (tensor parallelism's all-reduce): never split,
    # captured like an ordinary op when its group's backend is NCCL
    # (compile_backend/passes/capture_safety.py keeps a gloo one out of graphs).
    COLLECTIVE = "collective"
    ORDINARY = "ordinary"


# ---- process-wide facts ------------------------------------------------------

# Default roles: torch's own ops here, every other op through register_op.
_DEFAULT_ROLES: dict[str, OpRole] = {
    "aten::scaled_dot_product_attention": OpRole.BREAKPOINT,
    "aten::_scaled_dot_product_flash_attention": OpRole.BREAKPOINT,
    "aten::_scaled_dot_product_efficient_attention": OpRole.BREAKPOINT,
    "aten::_scaled_dot_product_flash_attention_for_cpu": OpRole.BREAKPOINT,
    "higher_order::flex_attention": OpRole.BREAKPOINT,
    "_c10d_functional::*": OpRole.COLLECTIVE,  # functional collectives and their wait_tensor
}

# Ops that use their `layer_name` argument only to find that layer's metadata
# in the forward context (through ForwardContext.metadata, which follows layer
# aliases). Pieces that differ only in these names are one piece: they share
# one compiled artifact (compile_backend/compile/layer_sharing.py).
_LAYER_KEYED_OPS: set[str] = set()
LAYER_NAME_ARG = "layer_name"

# Namespaces whose ops a CUDA graph may capture, subject to the capture-safety
# pass's other checks (host syncs, dynamic shapes, CPU tensors): torch's own
# ops and its functional collectives (NCCL ones are captured; the pass keeps
# host ones out).
TRUSTED_NAMESPACES = ("aten", "prims", "_c10d_functional")

# Ops (`ns::op`) and namespaces (`ns::*`) declared capture-safe.
_CAPTURE_SAFE_OPS: set[str] = set()

# Python-level callables that Dynamo leaves in its graphs, by the op they are.
_PYTHON_ALIASES: dict[Callable[..., Any], str] = {
    torch.nn.functional.scaled_dot_product_attention: "aten::scaled_dot_product_attention",
    torch._C._nn.scaled_dot_product_attention: "aten::scaled_dot_product_attention",
    operator.getitem: "python::getitem",
}


def register_op(name: str, *, role: "OpRole | str | None" = None, layer_keyed: bool = False,
                capture_safe: bool = False) -> None:
    """Declare process-wide facts about op `name` (one call, beside the op's
    definition; the op must be registered already):
      role          its default role in every compile: an OpRole or its value
                    ("breakpoint", "attention_like", "collective", "ordinary");
                    a config's splitting_ops / attention_like_ops /
                    non_splitting_ops still edit it per compile;
      layer_keyed   it uses its `layer_name` argument only to look up the
                    layer's metadata (`get_forward_context().metadata(layer_name)`
                    or `resolve_layer(layer_name)`): identical layers holding it
                    then compile once. Without this a user's op keeps its
                    per-layer name in the compiled code, and each layer's piece
                    compiles on its own (correct, slower start). Exact names only;
      capture_safe  a CUDA graph may capture it: no host syncs, no
                    data-dependent shapes, no CPU work. `ns::*` vouches for a
                    whole namespace.
    Every fact is checked before any is recorded (ValueError naming the fix)."""
    if role is None and not layer_keyed and not capture_safe:
        raise ValueError(f"register_op({name!r}) declares nothing: pass role=..., "
                         "layer_keyed=True and/or capture_safe=True")
    resolve_op_name(name)
    parsed = None if role is None else _parse_role(role)
    if layer_keyed:
        _check_layer_keyed(name)
    if parsed is not None:
        _DEFAULT_ROLES[name] = parsed
    if layer_keyed:
        _LAYER_KEYED_OPS.add(name)
    if capture_safe:
        _CAPTURE_SAFE_OPS.add(name)


def unregister_op(name: str) -> None:
    """Forget every process-wide fact `register_op` recorded about `name`
    (the built-in defaults included)."""
    _DEFAULT_ROLES.pop(check_op_name(name), None)
    _LAYER_KEYED_OPS.discard(name)
    _CAPTURE_SAFE_OPS.discard(name)


def register_op_role(name: str, role: "OpRole | str") -> None:
    """Add a process-wide default role (e.g. for a library's own attention op):
    `register_op(name, role=role)`."""
    register_op(name, role=role)


def register_layer_keyed_op(name: str) -> None:
    """Declare that op `name` is layer-keyed: `register_op(name, layer_keyed=True)`."""
    register_op(name, layer_keyed=True)


def register_capture_safe(name: str) -> None:
    """Vouch that custom op `ns::op` (or every op of `ns::*`) can be captured:
    no host syncs, no data-dependent shapes, no CPU work
    (`register_op(name, capture_safe=True)`)."""
    register_op(name, capture_safe=True)


def unregister_capture_safe(name: str) -> None:
    _CAPTURE_SAFE_OPS.discard(name)


def capture_safe_ops() -> list[str]:
    """Ops and namespaces declared capture-safe (not the trusted namespaces)."""
    return sorted(_CAPTURE_SAFE_OPS)


def _check_layer_keyed(name: str) -> None:
    ns, op = name.split("::")
    if op == "*":
        raise ValueError(f"layer_keyed needs one op, not the pattern {name!r}: its schema "
                         f"must have an argument named {LAYER_NAME_ARG!r}")
    packet = getattr(getattr(torch.ops, ns), op)
    schema = packet.default._schema
    if not any(a.name == LAYER_NAME_ARG for a in schema.arguments):
        raise ValueError(f"{name} has no argument named {LAYER_NAME_ARG!r} (schema: {schema}); "
                         "name the layer argument `layer_name`")


def layer_name_position(target: Any) -> int | None:
    """Position of the `layer_name` argument of a layer-keyed op's overload
    (None: the target is not one)."""
    if isinstance(target, torch._ops.OpOverloadPacket):  # Dynamo's graphs call packets
        if target._qualified_op_name not in _LAYER_KEYED_OPS:
            return None
        target = target.default
    if not isinstance(target, torch._ops.OpOverload) or target._schema.name not in _LAYER_KEYED_OPS:
        return None
    names = [a.name for a in target._schema.arguments]
    return names.index(LAYER_NAME_ARG) if LAYER_NAME_ARG in names else None


def _parse_role(role: "OpRole | str") -> OpRole:
    if isinstance(role, OpRole):
        return role
    try:
        return OpRole(str(role).lower().replace("-", "_"))
    except ValueError:
        raise ValueError(
            f"unknown op role {role!r}; valid roles: {[r.value for r in OpRole]}"
        ) from None


def check_op_name(name: str) -> str:
    if not isinstance(name, str) or name.count("::") != 1 or not all(name.split("::")):
        raise ValueError(
            f"op name {name!r} is not of the form 'namespace::name' "
            "(for example 'mylib::my_attention' or 'mylib::*')"
        )
    return name


def resolve_op_name(name: str) -> None:
    """Raise if `namespace::name` names no registered op (misuse tier). Ops
    resolve once the module defining them was imported; this imports nothing."""
    check_op_name(name)
    ns, op = name.split("::")
    if op == "*":
        if ns != "higher_order" and not any(
                n.startswith(ns + "::") for n in torch._C._dispatch_get_all_op_names()):
            raise ValueError(
                f"op pattern {name!r} matches no op: no op of namespace {ns!r} is registered. "
                "Register the namespace's ops (torch.library.custom_op, or import the library "
                "that defines them) before torch.compile, or fix the namespace")
        return
    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        packet = None
    if packet is None:
        raise ValueError(
            f"op {name!r} does not resolve: torch.ops.{ns}.{op} does not exist. "
            "Register the op (torch.library.custom_op, or import the library that defines "
            "it) before torch.compile, or fix the name; it must be 'namespace::name' as in "
            "torch.ops.namespace.name"
        )


def qualified_name(target: Any) -> str:
    """`namespace::name` of an FX node target; python callables get
    `module.qualname` (e.g. `torch._C._nn.linear`)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order::{target.name()}"
    try:
        alias = _PYTHON_ALIASES.get(target)
    except TypeError:  # unhashable target
        alias = None
    if alias is not None:
        return alias
    if isinstance(target, str):  # call_method / call_module
        return target
    module = getattr(target, "__module__", None) or ""
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{qual}" if module else qual


def node_op_name(node: torch.fx.Node) -> str | None:
    """The op a call node runs, or None for placeholders/outputs/attrs."""
    if node.op == "call_function":
        return qualified_name(node.target)
    if node.op == "call_method":
        return f"method::{node.target}"
    if node.op == "call_module":
        return f"module::{node.target}"
    return None


class OpRegistry:
    """The op facts one compile sees (module docstring). Roles: a copy of the
    process-wide defaults plus a config's additions, less its removals.
    Capture-safe and layer-keyed facts: the process-wide ones, read when asked.

    Role precedence: attention-like beats breakpoint (an attention-like op is
    never a split point, even if a namespace wildcard names it as one); exact
    names beat namespace wildcards.
    """

    def __init__(self, roles: dict[str, OpRole] | None = None) -> None:
        self._roles: dict[str, OpRole] = dict(_DEFAULT_ROLES if roles is None else roles)
        self._overridden: set[str] = set()

    @classmethod
    def from_config(cls, config: Any) -> "OpRegistry":
        """Defaults + config.splitting_ops / attention_like_ops - non_splitting_ops.
        Every user-given name must resolve (raises otherwise)."""
        reg = cls()
        for name in config.splitting_ops:
            resolve_op_name(name)
            reg.register(name, OpRole.BREAKPOINT)
        for name in config.attention_like_ops:
            resolve_op_name(name)
            reg.register(name, OpRole.ATTENTION_LIKE)
        for name in config.non_splitting_ops:
            check_op_name(name)
            if name not in reg._roles:
                raise ValueError(
                    f"non_splitting_ops names {name!r}, which has no role to remove; "
                    f"ops with roles: {sorted(reg._roles)}"
                )
            reg.remove(name)
        return reg

    def register(self, name: str, role: "OpRole | str") -> None:
        role = _parse_role(role)
        if role is OpRole.BREAKPOINT and self._roles.get(name) is OpRole.ATTENTION_LIKE:
            # An attention-like op is never a split point (it must run inside
            # captured graphs); asking for it among splitting ops changes nothing.
            logger.warning(
                "%s is attention-like, so it stays inside captured segments although "
                "splitting_ops names it", name)
            self._overridden.add(name)
            return
        self._roles[check_op_name(name)] = role

    def remove(self, name: str) -> None:
        self._roles.pop(name, None)

    def names(self, role: OpRole) -> list[str]:
        return sorted(n for n, r in self._roles.items() if r is role)

    def role_of_name(self, name: str | None) -> OpRole:
        if name is None or "::" not in name:
            return OpRole.ORDINARY
        exact = self._roles.get(name)
        wildcard = self._roles.get(name.split("::")[0] + "::*")
        if exact is OpRole.ATTENTION_LIKE or (exact is None and wildcard is OpRole.ATTENTION_LIKE):
            return OpRole.ATTENTION_LIKE
        if exact is not None:
            return exact
        if wildcard is not None:
            return wildcard
        return OpRole.ORDINARY

    def role(self, node: torch.fx.Node) -> OpRole:
        return self.role_of_name(node_op_name(node))

    def wildcard_conflicts(self, names: Iterable[str]) -> list[str]:
        """Attention-like ops that splitting_ops named (exactly or by a
        namespace wildcard) and that are not split at."""
        out = []
        for name in names:
            if "::" not in name or self.role_of_name(name) is not OpRole.ATTENTION_LIKE:
                continue
            wildcard = self._roles.get(name.split("::")[0] + "::*")
            if wildcard is OpRole.BREAKPOINT or name in self._overridden:
                out.append(name)
        return out

    # ---- capture safety and layer keys (process-wide facts) ----

    @property
    def trusted_namespaces(self) -> tuple[str, ...]:
        """Namespaces whose every op is capture-safe (torch's own)."""
        return TRUSTED_NAMESPACES

    def is_capture_safe(self, name: str | None) -> bool:
        """May a CUDA graph capture op `name` (as far as anyone declared)? Its
        namespace is trusted, or it or its namespace (`ns::*`) was declared
        capture-safe. Says nothing of roles: the capture-safety pass trusts
        attention-like ops and breakpoints on their own."""
        if name is None or "::" not in name:
            return False
        ns = name.split("::")[0]
        return (ns in TRUSTED_NAMESPACES or name in _CAPTURE_SAFE_OPS
                or f"{ns}::*" in _CAPTURE_SAFE_OPS)

    def capture_safe_ops(self) -> list[str]:
        return capture_safe_ops()

    def is_layer_keyed(self, name: str | None) -> bool:
        return name in _LAYER_KEYED_OPS

    def layer_keyed_ops(self) -> list[str]:
        return sorted(_LAYER_KEYED_OPS)

    def summary(self) -> dict[str, list[str]]:
        return {r.value: self.names(r)
                for r in (OpRole.BREAKPOINT, OpRole.ATTENTION_LIKE, OpRole.COLLECTIVE)}


# node.meta key a pass sets (to a reason string) to keep a node out of graphs.
EAGER_REASON = "mrv2_eager_reason"
# node.meta key a pass sets (to a reason string) to run a node with the
# breakpoints by choice, not because it cannot be captured: not a fallback.
WITH_BREAKPOINT = "mrv2_with_breakpoint"


def is_eager_node(node: torch.fx.Node, roles: OpRegistry) -> bool:
    return (roles.role(node) is OpRole.BREAKPOINT or EAGER_REASON in node.meta
            or WITH_BREAKPOINT in node.meta)
