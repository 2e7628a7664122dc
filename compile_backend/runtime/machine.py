"""What this machine can run: the graph mode a request gets here, and the
device a runner is asked for."""

from __future__ import annotations

import logging

import torch

from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.runtime.cuda_graph import graph_backend_overridden

logger = logging.getLogger(__name__)

_warned_no_cuda = False


def graph_mode_on_this_machine(requested: CUDAGraphMode) -> tuple[CUDAGraphMode, str | None]:
    """The mode that can run here, and why it differs from the request: graph
    modes need CUDA, or a graph backend installed for the CPU (the stand-in)."""
    global _warned_no_cuda
    if requested is CUDAGraphMode.NONE or torch.cuda.is_available() or graph_backend_overridden():
        return requested, None
    reason = (
        f"CUDA graphs are off (requested {requested.value}): torch.cuda.is_available() "
        "is False, so pieces run without graphs (mode none)"
    )
    if not _warned_no_cuda:
        logger.warning("%s", reason)
        _warned_no_cuda = True
    return CUDAGraphMode.NONE, reason
