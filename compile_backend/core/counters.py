"""Process-wide counters that tests and the debug dump read.

`counters` is one `collections.Counter` of ints, keyed by what happened
(graphs, pieces, compiles, captures, replays, fallbacks, what a pass fused);
the code that does a thing counts it, and `reset_counters()` clears them
all. Every key and what it counts: docs/manifest.md, section "`counters`".
"""

from __future__ import annotations

import collections

counters: collections.Counter[str] = collections.Counter()


def reset_counters() -> None:
    counters.clear()
