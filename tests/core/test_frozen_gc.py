"""core/frozen_gc.py: the collector frozen for a scope and thawed after, even
on error; a caller's own freeze is left as it is."""

import gc

import pytest

from compile_backend.core.frozen_gc import frozen_gc


def test_frozen_inside_thawed_after_also_on_error():
    gc.unfreeze()
    keep = [object() for _ in range(10)]  # something to freeze
    with frozen_gc():
        assert gc.get_freeze_count() >= len(keep)
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_gc():
        raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0


def test_a_callers_freeze_stays():
    gc.unfreeze()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_gc():
            pass
        assert gc.get_freeze_count() == frozen  # not thawed by the scope
    finally:
        gc.unfreeze()
