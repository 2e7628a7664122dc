"""Which inputs a graph writes, read off one run on fake tensors.

A replay must never satisfy a moved input that the graph writes with a copy,
so the runtime needs, per piece and for the whole graph, the inputs a graph
writes. Every in-place write in a torch-level graph bumps the version counter
a tensor shares with its views (fake tensors included), so the piece
compiler's fake run reads each tensor input's version before and after a
piece. Conservative: two inputs that view one tensor both count, and a
tensor without a version counter (made under inference_mode) counts as
written. docs/design.md, section "A replay never writes into a private copy
of a caller's tensor".
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def versions(args: Sequence[Any]) -> list[int | None]:
    """The version of each tensor argument (None for other arguments)."""
    return [_version(a) if isinstance(a, torch.Tensor) else None for a in args]


def written_inputs(args: Sequence[Any], before: Sequence[int | None]) -> frozenset[int]:
    """Indices of the tensor `args` written since `before = versions(args)`."""
    out = set()
    for i, (a, v) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor):
            now = _version(a)
            if now is None or v is None or now != v:
                out.add(i)
    return frozenset(out)
