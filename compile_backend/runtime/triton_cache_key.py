"""Triton's cache key computed on a thread when a runner is built.

`triton.runtime.cache.triton_key()` hashes Triton's sources and libtriton
(0.43 s on the H100 host, 0.85 s on a 2-core CPU machine), once per process,
at its first Triton compile or cache lookup: in a warm start, on the main
thread in the middle of the step's load. Reading and hashing (1 MiB chunks)
hold no interpreter lock, so a thread computes it beside the load's imports.
The function caches its result: a later caller gets it free; one that comes
while the thread hashes computes it again (never wrong, only not faster).

    key = start()        # None: cached already, interpreting, or no such Triton
    key.stats()          # {"triton_key_s": the thread's seconds} once done
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)


def _key_function() -> Callable[[], str] | None:
    """Triton's cached key function (3.x: triton.runtime.cache), None without one."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return None
    return triton_key if hasattr(triton_key, "cache_info") else None


def _cached(fn: Callable[[], str]) -> bool:
    return fn.cache_info().currsize > 0  # type: ignore[attr-defined]


class KeyThread:
    """The thread computing the key; `stats()` reports it once it finished."""

    def __init__(self, fn: Callable[[], str]) -> None:
        self.seconds: float | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="mrv2-triton-key",
                                        daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], str]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the main thread computes it when it needs it
            self.error = f"{type(e).__name__}: {e}"
            logger.debug("mrv2: Triton's cache key on a thread failed (%s)", self.error)
            return
        self.seconds = time.perf_counter() - t0

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        if self._thread.is_alive():
            return {}
        if self.error is not None:
            return {"triton_key_error": self.error}
        return {"triton_key_s": round(self.seconds or 0.0, 4)}


def start() -> KeyThread | None:
    """Start hashing on a thread, unless the key is cached already, Triton
    interprets (TRITON_INTERPRET=1: nothing compiles) or this Triton has no
    cached key function."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    fn = _key_function()
    if fn is None or _cached(fn):
        return None
    _walk_here()
    return KeyThread(fn)


def _walk_here() -> None:
    """The key walks Triton's compiler, backends and language folders with
    pkgutil, which imports the packages it finds: walk them here first, on
    the caller's thread (3 ms once they are imported), so the worker imports
    nothing while the caller's thread imports (two threads importing
    modules that import each other can deadlock)."""
    import pkgutil

    import triton

    root = os.path.dirname(os.path.abspath(triton.__file__))
    for folder in ("compiler", "backends", "language"):
        for _ in pkgutil.walk_packages([os.path.join(root, folder)], prefix=f"triton.{folder}."):
            pass
