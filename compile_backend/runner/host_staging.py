"""Persistent step-input buffers carved out of one device arena, written
through a pinned host twin of it.

Every field is a typed, shaped view of the device arena, so its address
never changes (graphs read the inputs where they were captured). Values go
into the twin with a plain memory move from a host `array`, and one queued
(`non_blocking`) copy moves the twin's used range, [0, `upto` bytes), to the
device: everything the step reads must lie in it, and the twin must hold the
right values for all of it (a field written at an earlier step keeps its
twin values). `write()` waits until the copy queued last time has run before
it rewrites the twin. On a CPU device the copy is immediate. docs/design.md,
section "Step inputs: one device arena, one pinned copy".
"""

from __future__ import annotations

import array
import ctypes
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

# array.array typecodes for the dtypes step inputs use
_TYPECODE = {torch.int64: "q", torch.int32: "i", torch.bool: "b"}
_ALIGN = 16  # bytes: every field starts aligned (vector loads in kernels)


def host_array(dtype: torch.dtype, values: Sequence[int] = ()) -> array.array:
    """A growable host array for `dtype` (filling one is cheaper than turning a
    list into a tensor)."""
    return array.array(_TYPECODE[dtype], values)


@dataclass(frozen=True)
class Field:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: int  # initial value, host and device


@dataclass(frozen=True)
class _Slot:
    offset: int  # bytes into the arena
    numel: int
    itemsize: int
    typecode: str


class HostStaging:
    def __init__(self, device: torch.device | str, fields: Sequence[Field]) -> None:
        self.device = torch.device(device)
        self.asynchronous = self.device.type == "cuda"
        self._slots: dict[str, _Slot] = {}
        offset = 0
        for f in fields:
            assert f.dtype in _TYPECODE and f.name not in self._slots, (f.name, f.dtype)
            numel, item = math.prod(f.shape), f.dtype.itemsize
            self._slots[f.name] = _Slot(offset, numel, item, _TYPECODE[f.dtype])
            offset += -(-numel * item // _ALIGN) * _ALIGN
        self.nbytes = offset
        self.host = torch.zeros(offset, dtype=torch.uint8, pin_memory=self.asynchronous)
        self._host_ptr = self.host.data_ptr()
        self.arena = torch.empty(offset, dtype=torch.uint8, device=self.device)
        self.views: dict[str, torch.Tensor] = {}
        for f in fields:
            slot = self._slots[f.name]
            host = self._typed(self.host, slot, f.dtype)
            host.fill_(f.fill)
            self.views[f.name] = self._typed(self.arena, slot, f.dtype).view(f.shape)
        self.arena.copy_(self.host)
        self._done: torch.cuda.Event | None = None

    @staticmethod
    def _typed(buf: torch.Tensor, slot: _Slot, dtype: torch.dtype) -> torch.Tensor:
        return buf[slot.offset: slot.offset + slot.numel * slot.itemsize].view(dtype)

    def end(self, name: str, elements: int) -> int:
        """Byte offset just past the first `elements` elements of `name`."""
        slot = self._slots[name]
        assert elements <= slot.numel, (name, elements, slot.numel)
        return slot.offset + elements * slot.itemsize

    @contextmanager
    def write(self, upto: int | None = None) -> Iterator["HostStaging"]:
        """Scope of one step's puts: waits until the twin is free, then queues
        one copy of its first `upto` bytes (all of it by default)."""
        if self._done is not None:
            self._done.synchronize()
        yield self
        n = self.nbytes if upto is None else upto
        self.arena[:n].copy_(self.host[:n], non_blocking=self.asynchronous)
        if self.asynchronous:
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record()

    def put(self, name: str, values: array.array, start: int = 0) -> None:
        """Twin of `name`, flattened: [start, start + len(values)) = values."""
        slot = self._slots[name]
        n = len(values)
        assert values.typecode == slot.typecode, (name, values.typecode, slot.typecode)
        assert start + n <= slot.numel, (name, start, n, slot.numel)
        if n:
            ctypes.memmove(self._host_ptr + slot.offset + start * slot.itemsize,
                           values.buffer_info()[0], n * slot.itemsize)
