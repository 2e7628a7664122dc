"""No Triton JIT compile inside a graph capture: the guard that lets a
runner's plan skip the eager warm-up before most captures
(docs/design.md, section "Capture warms up per kernel configuration").

A warm-up exists for what must not happen while a stream captures: a Triton
kernel compiled (or loaded from Triton's disk cache) for a new
specialisation. Triton calls its `jit_cache_hook` before compiling; the hook
installed here raises `CompileInCapture` while a capture is in progress,
before any CUDA call, and refuses Inductor's first-launch compile or
autotune the same way. The runner then drops that graph, runs the eager
warm-up (which compiles) and captures again. Outside a capture the hook only
counts (`triton_compiles`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Iterator

import torch

from compile_backend.core.counters import counters
from compile_backend.core.forward_context import get_forward_context, has_forward_context


class CompileInCapture(RuntimeError):
    """A Triton kernel would be compiled while a graph is captured."""

    def __init__(self, kernel: str) -> None:
        super().__init__(f"Triton would compile {kernel} during a graph capture")
        self.kernel = kernel


_worker = threading.local()


@contextlib.contextmanager
def compiling_ahead() -> Iterator[None]:
    """Marks this thread as a compile worker (runtime/kernel_precompile.py):
    its compiles are never refused, whatever the main thread captures."""
    _worker.active = True
    try:
        yield
    finally:
        _worker.active = False


def compiling_ahead_here() -> bool:
    return getattr(_worker, "active", False)


def capturing() -> bool:
    """Is a graph being captured on this thread now (CUDA or a stand-in)?"""
    if has_forward_context() and get_forward_context().capturing:
        return True  # the wrapper's capture (CUDA or a stand-in)
    return (torch.cuda.is_available() and torch.cuda.is_initialized()
            and torch.cuda.is_current_stream_capturing())


def _nothing_to_compile() -> bool:
    """No Triton loaded and no GPU: no kernel can compile here."""
    return "triton" not in sys.modules and not torch.cuda.is_available()


def _knobs() -> Any:
    """Triton's runtime knobs, or None (nothing to compile here, no Triton, a
    Triton without the hook)."""
    if _nothing_to_compile():
        return None
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs if hasattr(knobs.runtime, "jit_cache_hook") else None


def guard_available() -> bool:
    """Can captures skip their warm-up (Triton lets us see its compiles)?
    Without Triton there is nothing to compile; an old Triton without the
    hook: the runner warms up before every capture, as before."""
    return _nothing_to_compile() or _knobs() is not None


@contextlib.contextmanager
def no_compile_in_capture() -> Iterator[None]:
    """While active, a Triton compile asked for during a capture raises
    CompileInCapture; others are counted. Chains to a hook already set."""
    knobs = _knobs()
    if knobs is None:
        yield
        return
    previous = knobs.runtime.jit_cache_hook

    def hook(*args: Any, **kwargs: Any) -> Any:
        if compiling_ahead_here():  # a worker thread, never the capturing one
            return previous(*args, **kwargs) if previous is not None else None
        if capturing():
            name = kwargs.get("repr") or getattr(kwargs.get("fn"), "name", "a kernel")
            raise CompileInCapture(str(name).split("[", 1)[0])
        counters["triton_compiles"] += 1
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
        with _no_inductor_tuning_in_capture():
            yield
    finally:
        knobs.runtime.jit_cache_hook = previous


# Inductor's Triton kernels do not go through Triton's JIT: a kernel with
# several configurations benchmarks them at its first launch (a device
# synchronize, refused while a stream captures), and one loaded without its
# binaries compiles there. Seen on the H200: a FULL capture of a mixed batch
# with Inductor pieces reached a reduction's first launch.
_INDUCTOR_FIRST_LAUNCH = ("precompile", "autotune_to_one_config")


@contextlib.contextmanager
def _no_inductor_tuning_in_capture() -> Iterator[None]:
    """While active, Inductor's first-launch compile or autotune of a kernel
    raises CompileInCapture during a capture. Patched on entry: the caller
    enters after the model's first step (which imports Inductor's runtime
    when a piece uses it); nothing is patched when it is not loaded."""
    module = sys.modules.get("torch._inductor.runtime.triton_heuristics")
    cls = getattr(module, "CachingAutotuner", None)
    originals = {name: cls.__dict__[name] for name in _INDUCTOR_FIRST_LAUNCH
                 if cls is not None and name in cls.__dict__}

    def refusing(name: str, original: Any) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if capturing():
                kernel = getattr(getattr(self, "fn", None), "__name__", "an Inductor kernel")
                raise CompileInCapture(f"{kernel} ({name})")
            return original(self, *args, **kwargs)

        return method

    for name, original in originals.items():
        setattr(cls, name, refusing(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)
