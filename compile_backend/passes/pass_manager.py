"""`PassManager`: the passes of one compile, in a fixed order.

    manager = PassManager.from_config(config, roles)
    manager(gm.graph)   # edits in place, before split_graph
    manager.log         # one JSON-friendly entry per pass run
    manager.uuid()      # hash of the members' uuids (part of compile-cache keys)

The order: CaptureSafetyPass, SymmetricAllReducePass, FuseSiblingLinearsPass,
FuseLinearResidualPass, FuseNormLinearPass, FuseRopeAttentionPass,
GrowingCachesPass, SegmentAttentionLikePass. Safety first, the rewrites
after it (they leave alone what it marked eager), then what runs with the
attention by choice (earlier, it would stop the fusions there), the segment
order last (it sees the final graph and the final eager set). Why each
stands where it does: docs/design.md, "The FX passes".
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
from .fuse_residual_norm import FuseResidualNormPass
from .fuse_rope_attention import FuseRopeAttentionPass
from .fuse_sibling_linears import FuseSiblingLinearsPass
from .growing_caches import GrowingCachesPass
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
            FuseResidualNormPass(roles, enabled=config.fuse_residual_norm),
            FuseRopeAttentionPass(roles, enabled=config.fuse_rope_attention,
                                  mode=config.cudagraph_mode),
            GrowingCachesPass(roles, enabled=config.growing_caches_eager),
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
