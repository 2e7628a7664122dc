"""Small device buffers that a kernel keeps from one launch to the next, one
per (device, stream), zeroed when made and left zeroed by every launch
(the split-K GEMM's arrival counters: compile_backend/kernels/skinny_linear.py).

    declare(name, numel, dtype)   # a kernel module's buffer, made per stream on first use
    buffer(name, device)          # the current stream's; None inside a capture before one exists
    warm_stream_buffers(device)   # every declared buffer for the current stream, now

Launches on one stream never overlap, so one buffer per stream is never used
by two launches at once. A buffer is made only outside a capture (inside one
a `torch.zeros` is recorded, not run): the capture stream gets its buffers
before its first capture (runtime/graph_pool.py, `warm_capture_stream`).
docs/design.md, section "Buffers kept per stream between launches".
"""

from __future__ import annotations

import torch

_declared: dict[str, tuple[int, torch.dtype]] = {}
_buffers: dict[tuple[str, str, int], torch.Tensor] = {}


def declared_count() -> int:
    """How many buffers are declared (a capture stream warmed at this count
    has them all)."""
    return len(_declared)


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
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one key
        device = torch.device("cuda", torch.cuda.current_device())
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
