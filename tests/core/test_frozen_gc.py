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
