"""Host twins of persistent device buffers, for asynchronous step inputs.

A step's inputs (token ids, positions, block tables, ...) are built on the host
and copied into persistent device buffers. From pageable memory each copy
blocks the host until the device has drained the queue ahead of it, so the
host cannot prepare step i+1 while step i still runs. Here every persistent
buffer has a pinned host twin: values go into the twin, and the copy into the
device buffer is queued without blocking.

Reuse hazard: a twin must not be rewritten before the copy queued from it last
time has run. `write()` therefore waits on an event recorded after the
previous copies (normally long done: it only waits when the host runs more
than one step ahead). On a CPU device twins are plain tensors and copies are
immediate.
"""

from __future__ import annotations

import array
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

# array.array typecodes for the dtypes persistent buffers use
_TYPECODE = {torch.int64: "q", torch.int32: "i", torch.bool: "b"}


def host_array(dtype: torch.dtype) -> array.array:
    """An empty growable host array for `dtype` (cheaper to fill than a list
    turned into a tensor: see `HostStaging.put`)."""
    return array.array(_TYPECODE[dtype])


class HostStaging:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.asynchronous = self.device.type == "cuda"
        self._twins: dict[tuple, torch.Tensor] = {}  # _key(device buffer) -> host twin
        self._done: torch.cuda.Event | None = None

    @staticmethod
    def _key(buf: torch.Tensor) -> tuple:
        return (buf.data_ptr(), buf.dtype, buf.numel())

    def register(self, buf: torch.Tensor) -> torch.Tensor:
        """Give `buf` (a persistent device tensor) a host twin of its size, now
        rather than at its first `put`."""
        assert buf.is_contiguous() and buf.dtype in _TYPECODE, (buf.dtype, buf.stride())
        key = self._key(buf)
        if key not in self._twins:
            self._twins[key] = torch.empty(
                buf.numel(), dtype=buf.dtype, pin_memory=self.asynchronous)
        return buf

    @contextmanager
    def write(self) -> Iterator["HostStaging"]:
        """Scope of one step's puts: waits until the twins are free, and marks
        them busy again once the copies are queued."""
        if self._done is not None:
            self._done.synchronize()
        yield self
        if self.asynchronous:
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record()

    def put(self, buf: torch.Tensor, values: array.array | Sequence) -> None:
        """buf.view(-1)[:len(values)] = values, through the host twin."""
        twin = self._twins.get(self._key(buf))
        if twin is None:  # a buffer replaced after allocation: give it a twin now
            twin = self._twins[self._key(self.register(buf))]
        n = len(values)
        assert n <= twin.numel(), (n, twin.numel())
        if n == 0:
            return
        if not isinstance(values, array.array):
            values = array.array(_TYPECODE[buf.dtype], values)
        assert values.typecode == _TYPECODE[buf.dtype], (values.typecode, buf.dtype)
        twin[:n].copy_(torch.frombuffer(values, dtype=buf.dtype))
        buf.view(-1)[:n].copy_(twin[:n], non_blocking=self.asynchronous)
