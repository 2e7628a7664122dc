"""Small device buffers that a kernel keeps from one launch to the next, one
per (device, stream), zeroed when made and left zeroed by every launch
(the split-K GEMM's arrival counters: compile_backend/kernels/skinny_linear.py, Note [split K]).

Why per stream: launches on one stream run one after another (with
programmatic dependent launch too: a kernel touches such a buffer only after
`griddepcontrol.wait`, when the kernel before it has completed), so one
buffer per stream is never used by two launches at once; two streams get two.

Why made outside any capture: inside a capture a `torch.zeros` is recorded,
not run, so a buffer made there would start as garbage in eager launches on
the same stream. `buffer()` therefore makes one only outside a capture and
answers None inside one where none exists yet (the kernel then takes a path
that needs none); `warm_stream_buffers()` makes every declared buffer for
the current stream, and the capture stream gets them before its first
capture (compile_backend/runtime/graph_pool.py, `warm_capture_stream`).

A CUDA graph holds the addresses of the buffers of the stream it was
captured on (the capture stream) and replays on the caller's stream: its
launches and the eager launches on that stream are ordered, so they share
nothing at once. Replaying two such graphs on two streams at the same time
would share the capture stream's buffers: the runtime never does that.
"""

from __future__ import annotations

import torch

_declared: dict[str, tuple[int, torch.dtype]] = {}
_buffers: dict[tuple[str, str, int], torch.Tensor] = {}


def declare(name: str, numel: int, dtype: torch.dtype) -> None:
    """A kernel module's buffer, made per stream on first use (or warm-up)."""
    _declared[name] = (numel, dtype)


def _stream_key(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: one stream
        return 0
    return torch.cuda.current_stream(device).cuda_stream


def buffer(name: str, device: torch.device) -> torch.Tensor | None:
    """The current stream's zeroed buffer `name` on `device`, made now if
    missing; None inside a capture where it is missing (module docstring)."""
    key = (name, str(device), _stream_key(device))
    buf = _buffers.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        numel, dtype = _declared[name]
        buf = _buffers[key] = torch.zeros(numel, dtype=dtype, device=device)
    return buf


def warm_stream_buffers(device: torch.device) -> None:
    """Make every declared buffer for the current stream of `device` (outside a capture)."""
    for name in _declared:
        buffer(name, device)
