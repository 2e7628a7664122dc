"""Tensor parallelism's all-reduces become `mrv2::all_reduce`: one-shot over
symmetric memory for small messages, NCCL for the rest
(compile_backend/core/all_reduce.py says how and why).

Before:                                          After:
    ar = _c10d_functional.all_reduce(h, "sum", "0")    y = mrv2::all_reduce(h, 524288, "0")
    y = _c10d_functional.wait_tensor(ar)

Fires only when `tp_all_reduce` is not "nccl", for a "sum" `all_reduce`
whose every user is a `wait_tensor` (none marked eager), on a group whose
symmetric buffers are set up; elsewhere the functional collective stays,
counted in `counters["all_reduce_fallbacks"]` and logged once. The new op is
a collective on the same group, so the other passes' verdicts stay true:
docs/design.md, "The FX passes".
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from compile_backend.core.all_reduce import (
    fallback_reason, log_fallback_once, ready_groups, symmetric_all_reduce,
)
from compile_backend.core.counters import counters
from compile_backend.core.op_registry import EAGER_REASON, OpRegistry, node_op_name

from .fx_nodes import example_value, registered_op, source_line
from .pass_base import Mrv2Pass, PassReport

logger = logging.getLogger(__name__)

_ALL_REDUCE = "_c10d_functional::all_reduce"
_WAIT = "_c10d_functional::wait_tensor"
_NO_BUFFER = ("no symmetric buffer is set up for process group {group!r} (a ModelRunner of a "
              "tensor-parallel model sets one up when built; elsewhere call "
              "compile_backend.core.all_reduce.setup_all_reduce on every rank first)")
_NO_OP = ("mrv2::all_reduce is not registered: import compile_backend.kernels "
          "(the backend does, before the passes)")


def _op() -> Any:
    """The op the new node calls (compile_backend/kernels/all_reduce.py), or None."""
    return registered_op("mrv2", "all_reduce")


def _args(node: torch.fx.Node) -> tuple[Any, Any, Any]:
    args, kw = node.args, node.kwargs
    x = args[0] if len(args) > 0 else kw.get("input")
    op = args[1] if len(args) > 1 else kw.get("reduce_op")
    group = args[2] if len(args) > 2 else kw.get("group_name")
    return x, op, group


class SymmetricAllReducePass(Mrv2Pass):
    """See the module docstring. `mode` and `threshold`: the config's
    `tp_all_reduce` and `tp_all_reduce_threshold`."""

    def __init__(self, roles: OpRegistry, mode: str = "nccl", threshold: int = 512 * 1024) -> None:
        self.roles = roles
        self.mode = mode
        self.threshold = threshold

    def settings(self) -> dict[str, Any]:
        return {"mode": self.mode, "threshold": self.threshold,
                "groups_with_buffers": ready_groups() if self.mode != "nccl" else []}

    def apply(self, graph: torch.fx.Graph) -> PassReport:
        details: dict[str, Any] = {"mode": self.mode, "rewritten": [], "left_on_nccl": []}
        if self.mode == "nccl":
            return PassReport(changed=False, details=details)
        op = _op()
        for node in list(graph.nodes):
            if node.op != "call_function" or node_op_name(node) != _ALL_REDUCE:
                continue
            x, reduce_op, group = _args(node)
            waits = list(node.users)
            if (EAGER_REASON in node.meta or str(reduce_op).lower() != "sum"
                    or not isinstance(group, str) or not waits
                    or any(node_op_name(w) != _WAIT or EAGER_REASON in w.meta for w in waits)):
                continue
            why = None
            if op is None:
                why = _NO_OP
            elif symmetric_all_reduce(group) is None:
                why = fallback_reason(group) or _NO_BUFFER.format(group=group)
            if why is not None:
                details["left_on_nccl"].append({"node": node.name, "reason": why})
                log_fallback_once(why)
                continue
            details["rewritten"].append(self._rewrite(graph, node, waits, x, group, op))
        counters["all_reduce_fallbacks"] += len(details["left_on_nccl"])
        if details["rewritten"]:
            logger.info("mrv2: %d all-reduces become mrv2::all_reduce (one-shot up to %d bytes)",
                        len(details["rewritten"]), self.threshold)
        return PassReport(changed=bool(details["rewritten"]), details=details)

    def _rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node, waits: list[torch.fx.Node],
                 x: torch.fx.Node, group: str, op: Any) -> dict[str, Any]:
        with graph.inserting_before(node):
            new = graph.call_function(op, (x, self.threshold, group))
        new.meta.update({k: v for k, v in waits[0].meta.items()})
        val = example_value(x)
        if isinstance(val, FakeTensor):
            key = "example_value" if "example_value" in waits[0].meta else "val"
            with val.fake_mode:
                new.meta[key] = op(val, self.threshold, group)
        for w in waits:
            w.replace_all_uses_with(new)
            graph.erase_node(w)
        graph.erase_node(node)
        return {"node": new.name, "group": group, "source": source_line(new)}
