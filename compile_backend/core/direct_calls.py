"""Breakpoint ops called without the dispatcher, where eager pieces run them.

In PIECEWISE (and NONE) steps the attention ops run eagerly between graphs,
once per layer. Through the dispatcher a Python custom op passes several Python
layers (autograd, ADInplaceOrView for mutating ops, the backend's alias check)
before its implementation runs: tens of microseconds of host time per call,
which the device waits for between two graph replays. An op may register its
implementation here (`register_direct_impl`, or `direct_custom_op` when defining
it); after compiling, every eager
piece's call of such an op is rewritten to call the implementation directly,
but only while grad is off (inference): with grad on it goes through the
dispatcher as before, so autograd still sees it. Under an active dispatch
mode (a profiler, the CUDA-graph stand-in's write tracking) it goes through
the dispatcher too, so the mode sees the op.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.fx

from compile_backend.core.op_definition import define_op
from compile_backend.core.op_recording import recordable
from compile_backend.core.op_registry import check_op_name, qualified_name

_DIRECT_IMPLS: dict[str, Callable[..., Any]] = {}


def register_direct_impl(name: str, impl: Callable[..., Any]) -> None:
    """`impl` takes the op's arguments (as the FX node passes them) and does
    exactly what the op's registered implementation does."""
    _DIRECT_IMPLS[check_op_name(name)] = recordable(name, impl, every_call=False)


def direct_custom_op(name: str, *, mutates_args, schema: str, same_launches: bool = False,
                     into: Callable[..., Any] | None = None):
    """`define_op(name, ...)(impl)` (core/op_definition.py) that also registers
    `impl` as the op's direct implementation (one name for both)."""

    def wrap(impl: Callable[..., Any]):
        op = define_op(name, mutates_args=mutates_args, schema=schema,
                       same_launches=same_launches, into=into)(impl)
        register_direct_impl(name, impl)
        return op

    return wrap


def direct_call(op: Any) -> Callable[..., Any] | None:
    """A plain function calling `op`'s direct implementation when grad is off
    and no dispatch mode is active (and `op` itself otherwise); None if the
    op registered none."""
    impl = _DIRECT_IMPLS.get(qualified_name(op))
    if impl is None:
        return None

    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() or torch._C._len_torch_dispatch_stack():
            return op(*args, **kwargs)
        return impl(*args, **kwargs)

    # FX code generation names the callee after these.
    name = _mangled(qualified_name(op))
    call.__name__ = call.__qualname__ = name
    return call


def rewrite_direct_calls(gm: torch.fx.GraphModule) -> int:
    """Point `gm`'s calls of registered ops at their direct calls (once:
    nodes already rewritten are left alone); returns how many were rewritten."""
    n = 0
    for node in gm.graph.nodes:
        # Dynamo leaves the packet (torch.ops.ns.op) or an overload (its .default)
        if node.op != "call_function" or not isinstance(
                node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            continue
        fn = direct_call(node.target)
        if fn is not None:
            node.target = fn
            n += 1
    if n:
        gm.recompile()
    return n


def _mangled(name: str) -> str:
    """The name FX code calls a direct call by: mrv2::reshape_and_cache ->
    direct_mrv2_reshape_and_cache."""
    return "direct_" + name.replace("::", "_")


def public_code(code: str) -> str:
    """FX code with direct calls shown as the ops they call
    (`torch.ops.mrv2.unified_attention`), as the user's model wrote them."""
    for name in _DIRECT_IMPLS:
        ns, op = name.split("::")
        # FX prefixes the callee with its module's path: ..._direct_calls_direct_mrv2_op
        code = re.sub(rf"\b\w*{_mangled(name)}\b", f"torch.ops.{ns}.{op}", code)
    return code
