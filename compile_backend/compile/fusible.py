"""Which pieces Inductor can make faster: those with ops it could fuse.

Inductor turns a piece's aten compute into fewer, generated kernels; a custom
op that is not decomposed (`mrv2::norm_linear`, any CompositeExplicit op) is a
call it leaves as it is, and views, allocations and no-op casts launch
nothing. A piece with fewer than two ops it could fuse (llama's layers once
the passes made them norm_linear, linear_add and rope_and_cache between
views) launches the same kernels either way: compiling it costs Inductor's
compile, and at every start the load of Inductor's runtime and of the
artifact, for nothing. `fusible_ops` names what a piece holds that Inductor
could fuse; the piece compiler (piece_compiler.py) runs the piece as traced
where there is less of it than `CompilationConfig.inductor_min_fusible_ops`.
docs/design.md, "Inductor only where it fuses".
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from compile_backend.passes.fx_nodes import example_value

# Methods and torch functions that return a view (no kernel). Those that
# return sizes or flags need no entry: only nodes with a tensor value count.
VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
    "transpose", "permute", "t", "expand", "expand_as", "narrow", "chunk", "split",
    "tensor_split", "unbind", "select", "detach", "as_strided", "movedim", "swapaxes",
})
VIEW_FUNCTIONS = frozenset({
    torch.narrow, torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze, torch.transpose,
    torch.permute, torch.t, torch.chunk, torch.split, torch.tensor_split, torch.unbind,
    torch.select, torch.movedim, torch.swapaxes, torch.detach, torch.as_strided,
})
# Allocations: memory, no kernel.
EMPTY_FUNCTIONS = frozenset({torch.empty, torch.empty_like, torch.empty_strided})
EMPTY_METHODS = frozenset({"new_empty", "new_empty_strided"})
# Casts (and contiguous) that launch nothing when the dtype, the device and
# the layout stay.
CAST_METHODS = frozenset({"to", "float", "half", "bfloat16", "double", "type_as", "type",
                          "contiguous"})


def _opaque_custom_op(target: object) -> bool:
    """A custom op (not aten or prims) with no CompositeImplicit kernel:
    Inductor calls it as it is (one with that kernel is decomposed into aten
    ops, which it could fuse)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace in ("aten", "prims"):
        return False
    return not target.has_kernel_for_dispatch_key(
        torch._C.DispatchKey.CompositeImplicitAutograd)


def _basic_index(index: object) -> bool:
    """Indexing that gives a view: ints, slices, None and Ellipsis only."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


def _same_as_input(node: torch.fx.Node) -> bool:
    """A cast whose output has its input's dtype and device (no kernel)."""
    src, out = example_value(node.args[0]) if node.args else None, example_value(node)
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.dtype == out.dtype and src.device == out.device
            and (node.target != "contiguous" or src.is_contiguous()))


def _computes(node: torch.fx.Node) -> bool:
    """Does `node` launch work Inductor could fuse with its neighbours?"""
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if not isinstance(example_value(node), torch.Tensor):
        return False  # sizes, tuples of a custom op's outputs, None
    if node.op == "call_method":
        if node.target in VIEW_METHODS or node.target in EMPTY_METHODS:
            return False
        return not (node.target in CAST_METHODS and _same_as_input(node))
    if node.op != "call_function":
        return True  # a module call: whatever it holds
    target = node.target
    if target in VIEW_FUNCTIONS or target in EMPTY_FUNCTIONS or _opaque_custom_op(target):
        return False
    if target is operator.getitem:
        return not _basic_index(node.args[1])
    return True


def fusible_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes of `gm` Inductor could fuse, as `name (target)`, in order."""
    return [f"{n.name} ({getattr(n.target, '__name__', n.target)})"
            for n in gm.graph.nodes if _computes(n)]
