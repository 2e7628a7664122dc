"""The FX node helpers the passes share: what a node calls and where it came
from, its recorded fake value, which namespace its op belongs to, linears
and adds, and the small rewrite steps of a fusion (a new call node with the
old node's metadata and its fake value; erasing what it replaced).

Nothing here edits a graph unless asked to, and nothing reads effects: which
values a node writes or reads through is compile_backend/passes/effects.py.
The file list of passes/ and the rules they share: docs/design.md, "The FX
passes".
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from compile_backend.core.op_registry import (
    EAGER_REASON, OpRegistry, is_eager_node, node_op_name,
)

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def source_line(node: torch.fx.Node) -> str:
    """`file.py:12 in fn: <code>` of the user line that made `node`."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.search(lines[i])
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = f"{m['file'].rsplit('/', 1)[-1]}:{m['line']} in {m['fn']}"
            return f"{where}: {code}" if code else where
    stack = node.meta.get("source_fn_stack")
    if stack:
        return f"from `{stack[-1][0]}` (no source line recorded)"
    return "(no source line recorded)"


def op_label(node: torch.fx.Node) -> str:
    """Human name of a node's op: `toy::attn`, `torch.nonzero`, `Tensor.item`."""
    name = node_op_name(node) or node.op
    if name.startswith("method::"):
        return "Tensor." + name[len("method::"):]
    t = node.target
    if node.op == "call_function" and not isinstance(
            t, (torch._ops.OperatorBase, torch._ops.OpOverloadPacket)):
        if is_tensor_method(t):
            return f"Tensor.{t.__name__}"
        module = getattr(t, "__module__", None) or "torch"
        module = {"_operator": "operator", "torch._C._VariableFunctions": "torch"}.get(module, module)
        return f"{module}.{getattr(t, '__name__', name)}"
    return name


def bare_name(node: torch.fx.Node) -> str:
    """The op's short name (`nonzero`, `add_`, `item`), for name-based rules."""
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return (node_op_name(node) or "").split("::")[-1]
    return getattr(t, "__name__", "") or ""


def registered_op(namespace: str, name: str) -> torch._ops.OpOverload | None:
    """`torch.ops.<namespace>.<name>.default`, or None when it is not
    registered (an op a pass writes into the graph lives in compile_backend/kernels/, which
    passes do not import: the backend imports it before the passes run)."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def schema_overloads(target: Any) -> list[torch._ops.OpOverload]:
    """The overload(s) a schema-carrying target may dispatch to."""
    if isinstance(target, torch._ops.OpOverload):
        return [target]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, o) for o in target.overloads()]
    return []


_ATEN_CACHE: dict[str, list[torch._ops.OpOverload]] = {}


def aten_overloads_named(name: str) -> list[torch._ops.OpOverload]:
    """aten overloads of that bare name: how a python-level torch call
    (`torch.nonzero`, `x.item()`) is checked against aten's tags."""
    if name not in _ATEN_CACHE:
        try:
            packet = getattr(torch.ops.aten, name)
            _ATEN_CACHE[name] = schema_overloads(packet)
        except (AttributeError, RuntimeError):
            _ATEN_CACHE[name] = []
    return _ATEN_CACHE[name]


# (node.op, node.target) -> the op's tag names: a property of the op alone,
# asked for every node by several passes (a 32-layer graph: ~4500 asks).
_TAGS_CACHE: dict[tuple[str, Any], frozenset[str]] = {}


def op_tags(node: torch.fx.Node) -> frozenset[str]:
    """Tag names (`cudagraph_unsafe`, `nondeterministic_seeded`, ...) of the
    op a node runs; python-level torch calls borrow the aten op's tags."""
    key = (node.op, node.target)
    if isinstance(node.target, torch._ops.OpOverloadPacket):  # overloads may be added later
        key += (tuple(node.target.overloads()),)
    try:
        return _TAGS_CACHE[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable target: asked each time
        return _op_tags(node)
    tags = _TAGS_CACHE[key] = _op_tags(node)
    return tags


def _op_tags(node: torch.fx.Node) -> frozenset[str]:
    overloads = schema_overloads(node.target)
    if not overloads and node.op in ("call_function", "call_method") and is_torch_level(node):
        overloads = aten_overloads_named(bare_name(node))
    return frozenset(str(t).rsplit(".", 1)[-1] for ov in overloads for t in ov.tags)


# Modules whose callables Dynamo leaves in graphs and that run aten ops.
_TORCH_MODULES = (
    "torch", "torch.functional", "torch.nn.functional", "torch._C._nn",
    "torch._C._linalg", "torch._C._fft", "torch._C._special", "torch.fft",
    "torch.linalg", "torch.special", "torch._C._VariableFunctions",
)
_PYTHON_MODULES = ("_operator", "operator", "math")
# Builtins Dynamo may leave on sizes and scalars; `print` and friends are not pure.
_PURE_BUILTINS = frozenset({"getattr", "hasattr", "isinstance", "len", "min", "max", "abs", "round"})


def is_torch_level(node: torch.fx.Node) -> bool:
    """A tensor method, or a function of torch's public op namespaces."""
    if node.op == "call_method":
        return True
    t = node.target
    if is_tensor_method(t):
        return True
    module = getattr(t, "__module__", None)
    if module is None and getattr(t, "__self__", None) is not None:
        module = getattr(t.__self__, "__module__", None)  # torch._VariableFunctionsClass
    return module in _TORCH_MODULES


def is_python_builtin(node: torch.fx.Node) -> bool:
    """`operator.*`, `math.*` and a few pure builtins."""
    if node.op != "call_function":
        return False
    module = getattr(node.target, "__module__", None)
    if module == "builtins":
        return getattr(node.target, "__name__", None) in _PURE_BUILTINS
    return module in _PYTHON_MODULES


def is_tensor_method(target: Any) -> bool:
    name = getattr(target, "__name__", None)
    return isinstance(name, str) and getattr(torch.Tensor, name, None) is target


def is_tuple_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def example_value(node: Any) -> Any:
    """The fake value Dynamo (`example_value`) or a fake-prop (`val`) recorded."""
    if not isinstance(node, torch.fx.Node):
        return None
    if "example_value" in node.meta:
        return node.meta["example_value"]
    return node.meta.get("val")


def values_fake_mode(values: list[Any]) -> Any:
    """The one fake mode of `values` (Dynamo's tracing mode, not the
    backend's), to compute a new node's value in; None unless every value is
    a FakeTensor of that one mode."""
    modes = {id(v.fake_mode): v.fake_mode for v in values if isinstance(v, FakeTensor)}
    if len(modes) != 1 or not all(isinstance(v, FakeTensor) for v in values):
        return None
    return next(iter(modes.values()))


# Functions that set torch's global state (Dynamo leaves them around `no_grad`
# and autocast regions): harmless to capture, but nothing may move across them.
_GLOBAL_STATE_NAMES = frozenset({
    "_set_grad_enabled", "set_grad_enabled", "_enter_autocast", "_exit_autocast",
    "set_autocast_enabled", "_set_autocast_enabled", "set_autocast_dtype",
})


def sets_global_state(node: torch.fx.Node) -> bool:
    t = node.target
    return (
        node.op == "call_function"
        and getattr(t, "__name__", None) in _GLOBAL_STATE_NAMES
        and (getattr(t, "__module__", None) or "").startswith("torch")
    )


# --- linears, adds and the rewrite steps of the fusion passes ----------------

LINEAR_TARGETS = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)
# Node metadata a new node takes from the node it replaces (dumps and source lines).
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr")


def linear_args(node: torch.fx.Node) -> tuple[Any, Any, Any] | None:
    """(input, weight, bias) of a `linear` call (None: not one)."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    args, kw = node.args, node.kwargs
    x = args[0] if len(args) > 0 else kw.get("input")
    w = args[1] if len(args) > 1 else kw.get("weight")
    b = args[2] if len(args) > 2 else kw.get("bias")
    return x, w, b


def graph_input_value(node: Any, ndim: int) -> torch.Tensor | None:
    """The fake value of a graph input of rank `ndim` (None: not one)."""
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    val = example_value(node)
    if not isinstance(val, torch.Tensor) or val.dim() != ndim:
        return None
    return val


def keep_meta(new: torch.fx.Node, old: torch.fx.Node) -> None:
    """`new` replaces `old`: it takes the metadata that names the user's code."""
    for k in _KEPT_META:
        if k in old.meta:
            new.meta[k] = old.meta[k]


ADD_TARGETS = (operator.add, torch.add)
MUL_TARGETS = (operator.mul, torch.mul)


def insert_call(graph: torch.fx.Graph, before: torch.fx.Node, op: Any, args: tuple[Any, ...],
                like: torch.fx.Node, value_key_from: torch.fx.Node | None = None) -> torch.fx.Node:
    """A new node `op(*args)` just before `before`, with the metadata that
    names `like`'s user code. Its fake value is computed when every node among
    `args` (lists included) has a fake value, all of one fake mode; it is
    stored under the key `value_key_from` (default `like`) uses: Dynamo's
    `example_value`, or a fake-prop's `val`."""
    with graph.inserting_before(before):
        new = graph.call_function(op, args)
    keep_meta(new, like)
    nodes = [a for a in tree_leaves(args) if isinstance(a, torch.fx.Node)]
    fake_mode = values_fake_mode([example_value(n) for n in nodes])
    if fake_mode is not None:
        key = "example_value" if "example_value" in (value_key_from or like).meta else "val"
        with fake_mode:
            new.meta[key] = op(*tree_map_only(torch.fx.Node, example_value, args))
    return new


def erase_replaced(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase `nodes` in this order (users before the nodes they use): a
    rewrite's replacement has taken every use they had."""
    for node in nodes:
        assert not node.users, (node, list(node.users))
        graph.erase_node(node)


def runs_eagerly(node: torch.fx.Node, roles: OpRegistry) -> bool:
    """Marked eager by the capture-safety pass, or eager by its op's role."""
    return EAGER_REASON in node.meta or is_eager_node(node, roles)


