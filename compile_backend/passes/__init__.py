"""FX passes that run on the Dynamo graph before it is split into pieces.

PassManager (pass_manager.py) runs them in a fixed, documented order:
capture safety, the all-reduce rewrite, sibling-linear fusion,
linear + residual fusion, norm + linear fusion, rotary into the decode
attention (FULL graphs), growing caches beside the attention, then segment
ordering. Each
pass is a class with `__call__(graph)` and `uuid()` (pass_base.py, with the
fusion passes' skeleton `FusionPass`); the node helpers they share are in
fx_nodes.py, the effect analysis in effects.py.
"""

# The capture-safe facts live in the op registry (compile_backend/core/op_registry.py);
# their registration functions are also here, where callers have found them.
from compile_backend.core.op_registry import (
    capture_safe_ops,
    register_capture_safe,
    unregister_capture_safe,
)

from .capture_safety import CaptureSafetyError, CaptureSafetyPass
from .fuse_linear_residual import FuseLinearResidualPass
from .fuse_norm_linear import FuseNormLinearPass
from .fuse_residual_norm import FuseResidualNormPass
from .fuse_rope_attention import FuseRopeAttentionPass
from .fuse_sibling_linears import FuseSiblingLinearsPass
from .growing_caches import GrowingCachesPass
from .pass_base import FusionPass, Mrv2Pass, PassReport
from .pass_manager import PassManager
from .segment_attention_like import SegmentAttentionLikePass
from .symmetric_all_reduce import SymmetricAllReducePass

__all__ = [
    "CaptureSafetyError",
    "CaptureSafetyPass",
    "GrowingCachesPass",
    "FuseLinearResidualPass",
    "FuseNormLinearPass",
    "FuseResidualNormPass",
    "FuseRopeAttentionPass",
    "FuseSiblingLinearsPass",
    "FusionPass",
    "Mrv2Pass",
    "PassManager",
    "PassReport",
    "SegmentAttentionLikePass",
    "SymmetricAllReducePass",
    "capture_safe_ops",
    "register_capture_safe",
    "unregister_capture_safe",
]
