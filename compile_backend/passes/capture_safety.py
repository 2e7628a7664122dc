"""Capture safety: find the ops that a CUDA graph cannot capture and keep each
one out of the graphs, with a reason that names the op and its source line.

Every node that would land in a captured segment (anything but a breakpoint,
its tuple accessors, an attention-like op, or a node already marked eager) is
checked; the first finding (a `cudagraph_unsafe` tag, a host sync, a
data-dependent shape, an op the pass cannot look into, a CPU tensor in a
CUDA graph, a collective on a host backend, a value read from the device)
sets `node.meta[EAGER_REASON]`, and the splitter gives that node an eager
piece, so only that piece falls back. Each reason is logged once per
compile; with `strict_capture` the pass raises `CaptureSafetyError` listing
every finding with its fix. The checks, which ops are trusted and an
example: docs/design.md, "Capture safety".
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_leaves

from compile_backend.core.counters import counters
from compile_backend.core.parallel import group_backend
from compile_backend.core.op_registry import (
    EAGER_REASON, OpRegistry, OpRole, is_eager_node, node_op_name,
)

from .fx_nodes import (
    bare_name,
    example_value,
    is_python_builtin,
    is_torch_level,
    is_tuple_getitem,
    op_label,
    op_tags,
    sets_global_state,
    source_line,
)
from .pass_base import Mrv2Pass, PassReport

logger = logging.getLogger(__name__)

class CaptureSafetyError(RuntimeError):
    """strict_capture is on and some op cannot be captured."""


# Python callables Dynamo leaves in graphs that do host-side bookkeeping only:
# they read no tensor and launch nothing, so a capture loses nothing.
_HOST_ONLY = frozenset({torch._C._log_api_usage_once})

_HOST_SYNC_NAMES = frozenset({
    "item", "tolist", "cpu", "numpy", "_local_scalar_dense", "is_nonzero",
    "__bool__", "__int__", "__float__", "__index__", "__complex__",
})
_DYNAMIC_SHAPE_NAMES = frozenset({
    "nonzero", "argwhere", "unique", "unique_consecutive", "_unique", "_unique2",
    "masked_select", "bincount",
})


def _is_bool_tensor_index(idx: Any) -> bool:
    for leaf in tree_leaves(idx):
        val = example_value(leaf)
        if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
            return True
    return False


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [v for v in tree_leaves(list(values)) if isinstance(v, torch.Tensor)]


_DERIVED = "uses a value read from the device"


def _unbacked(value: Any) -> set[Any]:
    out: set[Any] = set()
    for leaf in tree_leaves(value):
        try:
            out |= free_unbacked_symbols(leaf)
        except Exception:  # noqa: BLE001 (leaves that carry no symbols)
            pass
    return out


def _input_values(node: torch.fx.Node) -> list[Any]:
    return [example_value(n) for n in node.all_input_nodes]


_HOST_COLLECTIVE = "collective on process group"


def _collective_group(node: torch.fx.Node, roles: OpRegistry) -> str | None:
    """The process-group name a functional collective runs on: its last
    string argument (`all_reduce(x, "sum", "0")`: "0"); a `wait_tensor`
    waits on its producer's group."""
    if node_op_name(node) == "_c10d_functional::wait_tensor":
        producer = node.args[0] if node.args else None
        if isinstance(producer, torch.fx.Node) and roles.role(producer) is OpRole.COLLECTIVE:
            return _collective_group(producer, roles)
        return None
    names = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, str)]
    return node.kwargs.get("group_name", names[-1] if names else None)


def _host_collective(node: torch.fx.Node, graph_has_cuda: bool, roles: OpRegistry) -> str | None:
    """Why a collective in a CUDA graph cannot be captured, or None (NCCL; a
    CPU-only graph, which is never captured; a group this process cannot see)."""
    if not graph_has_cuda or roles.role(node) is not OpRole.COLLECTIVE:
        return None
    name = _collective_group(node, roles)
    backend = group_backend(name) if name is not None else None
    if backend is None or "nccl" in backend:
        return None
    return (f"{_HOST_COLLECTIVE} {name!r} with backend {backend!r}, which runs it on the host "
            "(a CUDA graph captures NCCL collectives only)")


def _fix_for(node: torch.fx.Node, roles: OpRegistry) -> str:
    name = node_op_name(node) or ""
    if roles.role(node) is OpRole.COLLECTIVE:
        return ("make the process group with the NCCL backend for CUDA tensors "
                "(torch.distributed.init_process_group('nccl'))")
    custom = isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                                      torch._ops.HigherOrderOperator))
    if custom and name.split("::")[0] not in ("aten", "prims"):
        return (f"name it in splitting_ops to run it eagerly between graphs, or, if it is "
                f"safe to capture, call passes.register_capture_safe({name!r})")
    if node.op == "call_function" and not (is_torch_level(node) or is_python_builtin(node)):
        return ("let Dynamo trace into it, or wrap it in a torch.library.custom_op and "
                "name that in splitting_ops (or passes.register_capture_safe it)")
    return "move it out of the compiled step (or compute it on the device without a sync)"


class CaptureSafetyPass(Mrv2Pass):
    """Mark every node that a CUDA graph cannot capture (see module docstring)."""

    def __init__(self, roles: OpRegistry, strict: bool = False) -> None:
        self.roles = roles
        self.strict = strict

    def settings(self) -> dict[str, Any]:
        return {
            "strict": self.strict,
            "roles": self.roles.summary(),
            "capture_safe": self.roles.capture_safe_ops(),
            "trusted_namespaces": list(self.roles.trusted_namespaces),
        }

    def apply(self, graph: torch.fx.Graph) -> PassReport:
        graph_has_cuda = any(
            t.device.type == "cuda"
            for n in graph.nodes
            for t in _tensors([example_value(n)])
        )
        findings: list[dict[str, Any]] = []
        eager: set[torch.fx.Node] = set()
        origins: dict[Any, str] = {}  # unbacked symbol -> the op that read it from the device
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self._note_new_symbols(node, origins)
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if is_eager_node(node, self.roles) or (
                is_tuple_getitem(node) and node.args[0] in eager
            ):
                eager.add(node)  # breakpoint, its accessors, or marked by an earlier pass
                continue
            if self.roles.role(node) is OpRole.ATTENTION_LIKE:
                continue  # trusted: it must be captured
            why = self._why_unsafe(node, graph_has_cuda, origins)
            self._note_new_symbols(node, origins)
            if why is None:
                continue
            reason = f"`{op_label(node)}` at {source_line(node)}: {why}; {_fix_for(node, self.roles)}"
            findings.append({
                "node": node.name, "op": op_label(node), "reason": reason,
                "derived": why.startswith(_DERIVED),
            })
            eager.add(node)
            if not self.strict:
                node.meta[EAGER_REASON] = reason

        if findings and self.strict:
            lines = "\n".join(f"  - {f['reason']}" for f in findings)
            raise CaptureSafetyError(
                f"strict_capture is on and {len(findings)} op(s) cannot be captured in a "
                f"CUDA graph:\n{lines}\nFix each as it says (remove it from the step, or "
                "register it as a breakpoint with splitting_ops), or set "
                "strict_capture=False to let those pieces fall back to eager."
            )
        counters["pass_capture_unsafe_ops"] += len(findings)
        host_collectives = sum(_HOST_COLLECTIVE in f["reason"] for f in findings)
        if host_collectives:
            counters["collective_fallbacks"] += host_collectives
        for f in {f["reason"]: f for f in findings}.values():  # each reason once, in order
            # Consumers of a device value follow from the finding that made it:
            # that one is the warning, they are detail.
            level = logging.INFO if f["derived"] else logging.WARNING
            logger.log(level, "mrv2 capture fallback: %s", f["reason"])
        return PassReport(
            changed=bool(findings),
            details={"graph_has_cuda": graph_has_cuda, "fallbacks": findings},
        )

    def _why_unsafe(
        self, node: torch.fx.Node, graph_has_cuda: bool, origins: dict[Any, str]
    ) -> str | None:
        name = bare_name(node)
        tags = op_tags(node)
        if "cudagraph_unsafe" in tags:
            return "the op is tagged torch.Tag.cudagraph_unsafe"
        host_collective = _host_collective(node, graph_has_cuda, self.roles)
        if host_collective:
            return host_collective
        if name in _HOST_SYNC_NAMES or "data_dependent_output" in tags:
            return "host sync (the CPU waits for a device value; a CUDA graph cannot capture it)"
        if self._dynamic_shape(node, name, tags):
            return ("output shape depends on the data (a CUDA graph replays fixed "
                    "shapes and would reuse the shape seen at capture)")
        opaque = self._opaque(node)
        if opaque:
            return opaque
        values = _input_values(node) + [example_value(node)]
        if graph_has_cuda and any(t.device.type == "cpu" for t in _tensors(values)):
            return ("works on a CPU tensor in a graph whose other tensors are on CUDA "
                    "(a CUDA graph does not capture CPU work)")
        unbacked = set()
        for n in node.all_input_nodes:
            unbacked |= _unbacked(example_value(n))
        if unbacked:
            syms = ", ".join(
                f"{s} from {origins.get(s, 'an input')}" for s in sorted(unbacked, key=str)
            )
            return (f"{_DERIVED} ({syms}); a replay would reuse the value seen at capture")
        return None

    @staticmethod
    def _note_new_symbols(node: torch.fx.Node, origins: dict[Any, str]) -> None:
        for s in _unbacked(example_value(node)):
            origins.setdefault(s, f"`{op_label(node)}` ({source_line(node).split(': ')[0]})")

    @staticmethod
    def _dynamic_shape(node: torch.fx.Node, name: str, tags: set[str]) -> bool:
        if is_tuple_getitem(node) or name == "__getitem__":
            return len(node.args) > 1 and _is_bool_tensor_index(node.args[1])
        if name == "index":  # aten.index: dynamic only with a boolean index
            return len(node.args) > 1 and _is_bool_tensor_index(node.args[1])
        if name == "repeat_interleave" and node.kwargs.get("output_size") is not None:
            return False
        if name == "where" and len(node.args) + len(node.kwargs) == 1:
            return True  # torch.where(cond) is nonzero
        return name in _DYNAMIC_SHAPE_NAMES or "dynamic_output_shape" in tags

    def _opaque(self, node: torch.fx.Node) -> str | None:
        if node.op == "call_module":
            mod = node.graph.owning_module.get_submodule(node.target) if node.graph.owning_module else None
            if mod is not None and type(mod).__module__.startswith("torch.nn."):
                return None
            return "user module called as a whole; its ops cannot be checked"
        if node.op == "call_method":
            return None
        target = node.target
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            if self.roles.is_capture_safe(node_op_name(node)):
                return None
            return "custom op not known to be capture-safe"
        if isinstance(target, torch._ops.HigherOrderOperator):
            if self.roles.is_capture_safe(node_op_name(node)):
                return None
            return "higher-order op not known to be capture-safe"
        if is_torch_level(node) or is_python_builtin(node) or sets_global_state(node):
            return None
        if target in _HOST_ONLY:
            return None
        return "python function opaque to the passes (its effects cannot be checked)"
