"""What this machine can run: the graph mode a request gets here, and the
device a runner is asked for."""

from __future__ import annotations

import logging

import torch

from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.runtime.graph_pool import graph_backend_overridden

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


def check_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device, or ValueError naming it and the fix when
    this machine cannot hold a runner there (a CUDA device on a machine
    without CUDA, or past the GPUs it has). Without this, a runner on a
    missing GPU fails deep inside its buffers, in torch's `pin_memory=True
    requires a CUDA ...`."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r}: this machine has no CUDA device "
            "(torch.cuda.is_available() is False). Run on a GPU, or pass device='cpu' "
            "(choose it at run time: 'cuda' if torch.cuda.is_available() else 'cpu'); on a "
            "CPU graph modes run as none unless captured with compile_backend.standin_graphs()")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(
            f"device {str(device)!r}: this machine has {count} CUDA device"
            f"{'' if count == 1 else 's'} (cuda:0..cuda:{count - 1})")
    return dev


def graphs_here(mode: CUDAGraphMode | str | None = None) -> str:
    """What captures graphs in this process now, as a line for a report: the
    CPU stand-in (`compile_backend.standin_graphs()`), another graph backend
    set by `use_graph_backend`, CUDA, or nothing (and how to see capture)."""
    from compile_backend.runtime.graph_pool import current_graph_backend
    from compile_backend.runtime.graph_standin import STANDIN_NOTE, StandInGraphs

    if mode is not None and CUDAGraphMode.parse(mode) is CUDAGraphMode.NONE:
        return "graphs: none (mode none)"
    if graph_backend_overridden():
        graphs = current_graph_backend()
        if isinstance(graphs, StandInGraphs):
            return STANDIN_NOTE
        return f"graphs: {type(graphs).__name__} (set by use_graph_backend)"
    if torch.cuda.is_available():
        return "graphs: CUDA"
    return ("graphs: none (no CUDA device, so graph modes run as none: run on a GPU, or "
            "capture with the CPU stand-in, compile_backend.standin_graphs())")
