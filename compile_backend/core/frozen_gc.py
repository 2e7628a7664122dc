"""The garbage collector frozen for a scope: what exists when it starts is
moved to the permanent generation, so a collection inside (triggered by
allocations, or called by torch: Inductor's cache load runs gc.collect per
artifact) walks only the objects made since; and no collection of the oldest
generation starts by itself inside (its threshold raised, restored after),
as the import of Dynamo alone set off two, 0.1 s each, on the CPU machine.
Young collections go on; an explicit gc.collect() collects as it would. A
caller that froze objects itself keeps them frozen (gc.unfreeze() would thaw
its objects too). Used by a runner's capture plan (runtime/graph_pool.py), a
runner's first step with the import of Dynamo it makes
(runner/model_runner.py) and the first step's compile or load
(compile/guard_free.py)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

# The oldest generation's threshold inside: never reached by its count
# (one per young collection).
NO_FULL_COLLECTION = 2**30


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    freeze = gc.get_freeze_count() == 0
    thresholds = gc.get_threshold()
    if freeze:
        gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], NO_FULL_COLLECTION)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()
