"""Which inputs a graph writes, read off one run on fake tensors.

A CUDA graph writes the addresses it saw at capture. When an input it
writes arrives at a new address, a replay must not copy it into the
capture-time tensor (the caller's tensor would miss the write), so the
runtime has to know, per piece and for the whole graph, which inputs are
written. Dynamo graphs are torch-level (`index_copy_`, `copy_`, a custom op
with `mutates_args`, an in-place method on a view of an argument); every one
of these bumps the version counter that a tensor shares with its views (the
dispatcher's ADInplaceOrView step, fake tensors included). So the piece
compiler's fake run reads each tensor input's version before and after a
piece: writes through views are seen, two inputs that are views of one
tensor are both counted (conservative), and a tensor without a version
counter (made under inference_mode) counts as written.

A dispatch mode reading op schemas would see the same writes, but sitting
above the fake mode it changes how some ops run on symbolic shapes (torch
2.11 fails `constant_pad_nd` that way), so versions are read instead.
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
