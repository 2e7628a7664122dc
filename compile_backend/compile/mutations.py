"""Which inputs a graph writes, read off one run on fake tensors.

A CUDA graph writes the addresses it saw at capture. When an input it
writes arrives at a new address, a replay must not copy it into the
capture-time tensor (the caller's tensor would miss the write), so the
runtime has to know, per piece and for the whole graph, which inputs are
written. Dynamo graphs are torch-level (`index_copy_`, `copy_`, a custom op
with `mutates_args`, an in-place method on a view of an argument); every one
of them reaches the dispatcher as an aten or custom op whose schema marks
the written argument (`Tensor(a!)`). So the piece compiler's fake run records
the storages written under a dispatch mode, and an input counts as written
when its storage is: writes through views are seen, and two inputs that
share a storage are both counted (conservative).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


class WriteRecorder(TorchDispatchMode):
    """Records the storage of every tensor an op writes (`Tensor(a!)` in its
    schema, `out=` included). Sits above the fake mode; runs nothing itself."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[StorageWeakRef] = []  # in order; a piece takes its slice

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if schema is not None:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
                self.written += [_storage(t) for t in pytree.tree_leaves(value)
                                 if isinstance(t, torch.Tensor)]
        return func(*args, **kwargs)


def written_inputs(args: Sequence[Any], written: Sequence[StorageWeakRef]) -> frozenset[int]:
    """Indices of the tensor `args` whose storage is in `written`."""
    seen = set(written)
    return frozenset(i for i, a in enumerate(args)
                     if isinstance(a, torch.Tensor) and _storage(a) in seen)
