"""core/frozen_gc.py: the collector frozen for a scope and thawed after, even
on error; a caller's own freeze is left as it is. An object is frozen when the
collector no longer lists it (gc.get_objects walks generations 0-2, not the
permanent one); counts alone drift as frozen objects die."""

import gc

import pytest

from compile_backend.core.frozen_gc import frozen_gc


def _collected(obj) -> bool:
    """Whether a collection would walk `obj` (it is not frozen)."""
    return any(o is obj for o in gc.get_objects())


def test_frozen_inside_thawed_after_also_on_error():
    gc.unfreeze()
    keep = [object() for _ in range(10)]  # a tracked container to freeze
    assert _collected(keep)
    with frozen_gc():
        assert not _collected(keep)
        made_inside = [object()]
        assert _collected(made_inside)  # only what existed at entry is frozen
    assert gc.get_freeze_count() == 0 and _collected(keep)
    with pytest.raises(RuntimeError), frozen_gc():
        assert not _collected(keep)
        raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0 and _collected(keep)


def test_a_callers_freeze_stays():
    gc.unfreeze()
    keep = [object()]
    gc.freeze()
    try:
        with frozen_gc():
            assert not _collected(keep)
        assert not _collected(keep)  # not thawed by the scope
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert _collected(keep)


def _collections_by_generation(fn) -> list[int]:
    """How many collections of each generation start while `fn` runs."""
    seen = [0, 0, 0]

    def count(phase, info):
        if phase == "start":
            seen[info["generation"]] += 1

    gc.callbacks.append(count)
    try:
        fn()
    finally:
        gc.callbacks.remove(count)
    return seen


def _churn():
    """Objects that live past young collections, as an import's do: more than
    a quarter of what the collector tracks, which sets off a full collection
    (CPython's rule), as young collections promote them."""
    kept = [[] for _ in range(len(gc.get_objects()) // 2 + 100_000)]
    del kept


def test_no_full_collection_starts_by_itself_inside_and_thresholds_come_back():
    before = gc.get_threshold()
    outside = _collections_by_generation(_churn)
    assert outside[2] > 0  # without the scope, the churn sets off full collections

    def inside():
        with frozen_gc():
            assert gc.get_threshold()[:2] == before[:2]
            _churn()
    seen = _collections_by_generation(inside)
    assert seen[2] == 0 and seen[0] > 0, seen  # young ones go on
    assert gc.get_threshold() == before

    def explicit():
        with frozen_gc():
            gc.collect()
    assert _collections_by_generation(explicit)[2] == 1  # gc.collect() still collects
    with pytest.raises(RuntimeError), frozen_gc():
        raise RuntimeError("inside")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
