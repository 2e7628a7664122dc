"""The registry of op roles (README.md, "Op roles").

Everything that asks "what is this op?" asks an `OpRegistry`: the splitter,
the passes and the debug dump. Ops are named `namespace::name`
(`aten::scaled_dot_product_attention`, `mrv2::unified_attention`,
`higher_order::flex_attention`); `namespace::*` names a whole namespace.
"""

from __future__ import annotations

import enum
import importlib
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
    # (passes/capture_safety.py keeps a gloo one out of graphs).
    COLLECTIVE = "collective"
    ORDINARY = "ordinary"


# Process-wide defaults. Strings only: resolving `mrv2::*` would import the
# kernels, which the registry must not do at import time.
_DEFAULT_ROLES: dict[str, OpRole] = {
    "aten::scaled_dot_product_attention": OpRole.BREAKPOINT,
    "aten::_scaled_dot_product_flash_attention": OpRole.BREAKPOINT,
    "aten::_scaled_dot_product_efficient_attention": OpRole.BREAKPOINT,
    "aten::_scaled_dot_product_flash_attention_for_cpu": OpRole.BREAKPOINT,
    "higher_order::flex_attention": OpRole.BREAKPOINT,
    "mrv2::unified_attention": OpRole.BREAKPOINT,
    # The KV write needs only the slot mapping, a persistent buffer: it runs
    # inside the piece before attention, off the eager region's host path.
    "mrv2::reshape_and_cache": OpRole.ATTENTION_LIKE,
    "mrv2::sconv": OpRole.ATTENTION_LIKE,
    "mrv2::kv_compress": OpRole.ATTENTION_LIKE,
    "_c10d_functional::*": OpRole.COLLECTIVE,  # functional collectives and their wait_tensor
}

# Ops that use their `layer_name` argument only to find that layer's metadata
# in the forward context (through ForwardContext.metadata, which follows layer
# aliases). Pieces that differ only in these names are one piece: they share
# one compiled artifact (compile_backend/compile/layer_sharing.py).
_LAYER_KEYED_OPS: set[str] = {
    "mrv2::reshape_and_cache", "mrv2::unified_attention", "mrv2::sconv", "mrv2::kv_compress",
}
LAYER_NAME_ARG = "layer_name"

# Python-level callables that Dynamo leaves in its graphs, by the op they are.
_PYTHON_ALIASES: dict[Callable[..., Any], str] = {
    torch.nn.functional.scaled_dot_product_attention: "aten::scaled_dot_product_attention",
    torch._C._nn.scaled_dot_product_attention: "aten::scaled_dot_product_attention",
    operator.getitem: "python::getitem",
}

# Namespaces whose ops live in this project's modules, imported on demand.
_NAMESPACE_MODULES = {"mrv2": "compile_backend.kernels"}


def register_op_role(name: str, role: "OpRole | str") -> None:
    """Add a process-wide default role (e.g. for a library's own attention op)."""
    _DEFAULT_ROLES[check_op_name(name)] = _parse_role(role)


def register_layer_keyed_op(name: str) -> None:
    """Declare that op `name` uses its `layer_name` argument only to look up
    the layer's metadata with `get_forward_context().metadata(layer_name)`
    (or `resolve_layer(layer_name)`): identical layers holding it then compile
    once. Without this, a user's op keeps its per-layer name in the compiled
    code, and each layer's piece compiles on its own (correct, slower start)."""
    resolve_op_name(name)
    ns, op = name.split("::")
    schema = getattr(getattr(torch.ops, ns), op).default._schema
    if not any(a.name == LAYER_NAME_ARG for a in schema.arguments):
        raise ValueError(f"{name} has no argument named {LAYER_NAME_ARG!r} (schema: {schema}); "
                         "name the layer argument `layer_name`")
    _LAYER_KEYED_OPS.add(name)


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
    """Raise if `namespace::name` names no registered op (misuse tier)."""
    check_op_name(name)
    ns, op = name.split("::")
    if ns in _NAMESPACE_MODULES:
        importlib.import_module(_NAMESPACE_MODULES[ns])
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
            "Register the op (torch.library.custom_op) before torch.compile, or fix "
            "the name; it must be 'namespace::name' as in torch.ops.namespace.name"
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
    """Roles by op name. Built from the defaults plus a config's additions.

    Precedence: attention-like beats breakpoint (an attention-like op is never a
    split point, even if a namespace wildcard names it as one); exact names beat
    namespace wildcards.
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

    def summary(self) -> dict[str, list[str]]:
        return {r.value: self.names(r)
                for r in (OpRole.BREAKPOINT, OpRole.ATTENTION_LIKE, OpRole.COLLECTIVE)}


# node.meta key a pass sets (to a reason string) to keep a node out of graphs.
EAGER_REASON = "mrv2_eager_reason"


def is_eager_node(node: torch.fx.Node, roles: OpRegistry) -> bool:
    return roles.role(node) is OpRole.BREAKPOINT or EAGER_REASON in node.meta
