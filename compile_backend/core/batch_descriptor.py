"""The small hashable key that picks a CUDA graph."""

from __future__ import annotations

from typing import NamedTuple


class BatchDescriptor(NamedTuple):
    num_tokens: int  # padded token count (a capture size)
    num_reqs: int | None = None  # FULL graphs only: padded request count
    uniform_decode: bool = False  # every request has exactly one query token

    def relaxed(self) -> "BatchDescriptor":
        """The key a PIECEWISE graph is stored under: token count alone."""
        return BatchDescriptor(self.num_tokens)
