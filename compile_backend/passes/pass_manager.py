"""`PassManager`: the passes of one compile, in a fixed order.

    manager = PassManager.from_config(config, roles)
    manager(gm.graph)   # edits in place, before split_graph
    manager.log         # one JSON-friendly entry per pass run
    manager.uuid()      # hash of the members' uuids (part of compile-cache keys)

The order, and why:
  1. CaptureSafetyPass        (always) marks the nodes a CUDA graph cannot
                              capture. Whether a node can be captured is a
                              property of the node and its values, not of its
                              position, so it is decided first...
  2. SymmetricAllReducePass  (edits only when `tp_all_reduce` is not "nccl")
                              replaces each all-reduce + wait by one
                              `mrv2::all_reduce`, a collective as well, on the
                              same group. After the safety pass: it leaves
                              alone what that pass marked eager, and its new
                              node is judged as the one it replaces was.
  3. FuseSiblingLinearsPass   (edits only when `fuse_sibling_linears`)
                              replaces linears that read one input by one
                              matmul (the backend then packs their weights,
                              compile/backend.py). After the
                              safety pass: it never fuses a linear marked
                              eager, nor across an eager node (nothing moves
                              across a piece boundary). Its new nodes are an
                              op declared capture-safe and `torch.narrow`s,
                              so the safety pass's verdicts stay true...
  4. FuseLinearResidualPass   (edits only when `fuse_linear_residual`)
                              replaces `residual + linear(x, w, b)` by one
                              `mrv2::linear_add` (one kernel at decode).
                              After the sibling pass: a linear both could
                              take (a sibling whose output is also added to
                              a residual) stays in its sibling group, which
                              saves more; what is left, o_proj and
                              down_proj, is this pass's. After the safety
                              pass for the sibling pass's reasons: it never
                              fuses a node marked eager nor across an eager
                              node, and its new node is an op declared
                              capture-safe...
  5. FuseNormLinearPass       (edits only when `fuse_norm_linear`) replaces
                              an RMSNorm and the linear or sibling_linear
                              that reads it, and a `silu(g) * u` over that
                              linear's halves, by one `mrv2::norm_linear`.
                              After the sibling pass: it takes the packed
                              q/k/v and gate/up groups, so one kernel
                              normalizes, projects and gates. Independent
                              of pass 4 (that one takes o_proj and down_proj,
                              which read no norm). Its new node is an op
                              declared capture-safe, and it never fuses a
                              node marked eager nor across an eager node.
  6. SegmentAttentionLikePass (always; it moves nodes only when
                              `reorder_for_fewer_pieces`) ...so that the
                              reorder sees the final graph and the final eager
                              set: a fallback op is eager like a breakpoint,
                              and the reorder can cluster it with breakpoints
                              instead of letting it cut a captured segment in
                              two.
Running safety and segments the other way round would minimise segments for a
kind assignment that the safety pass then changes.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch.fx

from compile_backend.core.op_registry import OpRegistry

from .capture_safety import CaptureSafetyPass
from .fuse_linear_residual import FuseLinearResidualPass
from .fuse_norm_linear import FuseNormLinearPass
from .fuse_sibling_linears import FuseSiblingLinearsPass
from .pass_base import Mrv2Pass
from .segment_attention_like import SegmentAttentionLikePass
from .symmetric_all_reduce import SymmetricAllReducePass

logger = logging.getLogger(__name__)


class PassManager:
    def __init__(self, passes: list[Mrv2Pass]) -> None:
        self.passes = list(passes)
        self.log: list[dict[str, Any]] = []

    @classmethod
    def from_config(cls, config: Any, roles: OpRegistry) -> "PassManager":
        return cls([
            CaptureSafetyPass(roles, strict=config.strict_capture),
            SymmetricAllReducePass(roles, mode=config.tp_all_reduce,
                                   threshold=config.tp_all_reduce_threshold),
            FuseSiblingLinearsPass(roles, enabled=config.fuse_sibling_linears),
            FuseLinearResidualPass(roles, enabled=config.fuse_linear_residual),
            FuseNormLinearPass(roles, enabled=config.fuse_norm_linear),
            SegmentAttentionLikePass(roles, reorder=config.reorder_for_fewer_pieces),
        ])

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            report = p(graph)
            graph.lint()  # every pass leaves a topologically valid graph
            self.log.append({
                "pass": p.name,
                "uuid": p.uuid(),
                "changed": report.changed,
                "details": report.details,
            })
            logger.debug("mrv2 pass %s: changed=%s %s", p.name, report.changed, report.details)

    def uuid(self) -> str:
        h = hashlib.sha256()
        for p in self.passes:
            h.update(f"{p.name}:{p.uuid()};".encode())
        return h.hexdigest()
