"""The garbage collector frozen for a scope: what exists when it starts is
moved to the permanent generation, so a collection inside (triggered by
allocations, or called by torch: Inductor's cache load runs gc.collect per
artifact) walks only the objects made since. A caller that froze objects
itself keeps them frozen: gc.unfreeze() would thaw its objects too, so then
nothing is frozen here. Used by a runner's capture plan
(runtime/graph_pool.py) and the first step's compile or load
(compile/guard_free.py)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
