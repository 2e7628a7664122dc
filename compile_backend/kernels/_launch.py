"""Launching a compiled Triton kernel again without `JITFunction.run`.

`kernel[grid](*args, **meta)` costs tens of microseconds of host time per
launch (binding, the specialization key, the lookup, the launch hooks).
`Launch` is one launch with everything but the tensors fixed: with
`bind=True` its first call watches what Triton hands the compiled kernel's
launcher and, when that is what a direct call would pass, later calls of the
same specialization call that launcher directly (kept per kernel, device,
grid, meta-parameters and each argument's dtype and 16-byte alignment or
value); anything unexpected, an active launch hook or the interpreter keeps
the normal launch, logged once. `LayoutMemo` keeps a launcher's checked
launches by their arguments' layout (Note [checked layouts] below). Note
[bound launch]: docs/design.md, section "Attention plans and bound launches".
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ._device import PDL_ENV, env

logger = logging.getLogger(__name__)

try:
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # a Triton without knobs: never bind
    _knobs = _JITFunction = None

# (kernel, device, grid, meta, argument specialization) -> direct launcher, or
# None where binding failed (normal launches from then on).
_BOUND: dict[tuple, Callable[[int, tuple], None] | None] = {}
_logged: set[str] = set()
_MISSING = object()


def _log_once(reason: str, kernel: Any) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.info("Triton kernels launch through kernel[grid] (%s; first seen for %s)",
                    reason, getattr(kernel, "__name__", kernel))


def _inactive(hook: object) -> bool:
    """No hook, or an empty chain of them (Triton 3.6+ keeps a HookChain)."""
    return hook is None or (type(hook).__name__ == "HookChain" and not getattr(hook, "calls", True))


def hooks_unset() -> bool:
    """No Triton launch hook is active (Note [bound launch])."""
    if _knobs is None:
        return False
    rt = _knobs.runtime
    return _inactive(rt.launch_enter_hook) and _inactive(rt.launch_exit_hook)


def _spec(a: object) -> object:
    """What of an argument shapes Triton's specialization: a tensor's dtype
    and 16-byte alignment, an int's or bool's exact value, a float's type."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, float):
        return float
    return type(a), a


def _same(seen: tuple, want: tuple) -> bool:
    if len(seen) != len(want):
        return False
    for s, w in zip(seen, want):
        if s is w:
            continue
        if isinstance(s, torch.Tensor) or isinstance(w, torch.Tensor) or type(s) is not type(w) or s != w:
            return False
    return True


class Launch:
    """kernel[grid](*args, **meta) with grid and meta fixed; `launch(stream,
    args)` launches it on `stream` (the current stream of the current device,
    which `kernel[grid]` would use too)."""

    __slots__ = ("kernel", "grid", "meta", "bind", "_fast")

    def __init__(self, kernel: Any, grid: tuple[int, ...], meta: dict[str, Any], *, bind: bool) -> None:
        self.kernel, self.grid, self.meta = kernel, grid, meta
        self.bind = bind and _JITFunction is not None and isinstance(kernel, _JITFunction)
        self._fast: Callable[[int, tuple], None] | None = None

    def normal(self, args: tuple) -> None:
        self.kernel[self.grid](*args, **self.meta)

    def launch(self, stream: int, args: tuple) -> None:
        fast = self._fast
        if fast is not None:
            fast(stream, args)
        elif self.bind:
            self._first(stream, args)
        else:
            self.normal(args)

    def _first(self, stream: int, args: tuple) -> None:
        if not hooks_unset():  # a profiler's hooks see Triton's own launch; bind later
            self.normal(args)
            return
        key = (self.kernel, current_device(), self.grid, tuple(sorted(self.meta.items())),
               tuple(map(_spec, args)))
        fast = _BOUND.get(key, _MISSING)
        if fast is _MISSING:
            fast = self._bind_launch(stream, args)  # launches
            if fast is _MISSING:  # its compile was deferred: nothing ran, bind at a later call
                return
            _BOUND[key] = fast
        elif fast is not None:
            fast(stream, args)
        else:
            self.normal(args)
        # Later calls of this plan pass arguments of the same specialization.
        self._fast = fast if fast is not None else (lambda _stream, a: self.normal(a))

    def _bind_launch(self, stream: int, args: tuple) -> Any:
        """Launch normally, watching the compiled kernel's launcher; return a
        direct launcher if the call matches Note [bound launch], else None
        (_MISSING, launching nothing, where a hook deferred the compile)."""
        kernel, grid, meta = self.kernel, self.grid, self.meta
        try:
            compiled = kernel.run(*args, grid=grid, warmup=True, **meta)  # compiles, no launch
            if compiled is None:  # a compile hook deferred it (runtime/kernel_precompile.py)
                return _MISSING
            launcher = compiled.run  # loads the module
            cls = type(launcher)
            original, own = cls.__call__, "__call__" in cls.__dict__
            tail = tuple(meta[name] for name in kernel.arg_names[len(args):])
        except Exception as e:  # noqa: BLE001 (any surprise: the normal launch decides)
            self.normal(args)
            _log_once(f"cannot bind: {type(e).__name__}: {e}", kernel)
            return None
        seen: list[tuple] = []

        def watch(this, *a):
            if this is launcher:
                seen.append(a)
            return original(this, *a)

        try:
            cls.__call__ = watch
        except (TypeError, AttributeError):
            self.normal(args)
            _log_once(f"launcher type {cls.__name__} cannot be watched", kernel)
            return None
        try:
            ret = kernel[grid](*args, **meta)
        finally:
            if own:
                cls.__call__ = original
            else:
                del cls.__call__
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        function, packed = compiled.function, compiled.packed_metadata
        enter, exit_ = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        want = (g0, g1, g2, stream, function, packed, enter, exit_, *args, *tail)
        if ret is not compiled or len(seen) != 1 or not _same(seen[0][:6] + seen[0][7:], want):
            got = seen[0][:6] + seen[0][7:] if len(seen) == 1 else ()
            diff = next((i for i, (a, b) in enumerate(zip(got, want)) if not _same((a,), (b,))), None)
            _log_once(f"the launch does not match Note [bound launch] ({len(seen)} calls, "
                      f"{len(got)} vs {len(want)} arguments, first difference at {diff})", kernel)
            return None

        def fast(stream: int, args: tuple) -> None:
            launcher(g0, g1, g2, stream, function, packed, None, enter, exit_, *args, *tail)

        return fast


# Note [checked layouts]: a launcher's argument checks, and everything it
# derives for its launch (grid, meta-parameters, the strides it passes), are
# functions of its tensors' shapes, strides, dtypes and devices and of its
# Python scalars; whether a bound launch fits also needs each tensor's
# 16-byte alignment. `layout` is that tuple. A launcher that has checked a
# call keeps what it derived under the call's layout (a `LayoutMemo`), with
# a `Launch` made with bind=True on CUDA; a later call of the same layout (the
# next layer of a step, the next capture of the same size, the next step)
# skips the checks and the derivation and launches through the bound
# launcher (`launch_here`). The index checks, which read tensor values, still
# run where they run (CPU tensors, `set_debug_checks(True)`). A call whose
# layout was never checked, or with a non-tensor where a tensor goes, takes
# the checked path, which raises for bad input as before and remembers
# nothing then.


def layout(*tensors: object) -> tuple | None:
    """Shape, strides, dtype, device and 16-byte alignment of each tensor
    (None stays None); None if any other object is among them."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        elif isinstance(t, torch.Tensor):
            out.append((t.shape, t.stride(), t.dtype, t.device, not t.data_ptr() & 15))
        else:
            return None
    return tuple(out)


class LayoutMemo:
    """What a launcher derived from a checked call, by layout (plus the
    current CUDA device: a bound launch belongs to its context). Bounded:
    emptied when full (a model has a few dozen layouts)."""

    __slots__ = ("_entries", "_limit")

    def __init__(self, limit: int = 4096) -> None:
        self._entries: dict[tuple, Any] = {}
        self._limit = limit

    @staticmethod
    def key(device: torch.device, parts: tuple) -> tuple:
        """`parts` (a layout and scalars) with what else a launch depends on:
        the current CUDA device, and the switches read when it was derived
        (the interpreter, MRV2_PDL)."""
        return (current_device() if device.type == "cuda" else -1,
                env("TRITON_INTERPRET"), env(PDL_ENV), parts)

    def entry(self, device: torch.device, parts: tuple | None,
              make: Callable[[], Any]) -> tuple[Any, bool]:
        """(what `make` derived for `parts` on `device`, whether `make` ran
        now: the call was checked). `make` checks the call (it raises for
        misuse, and nothing is kept then); `parts` None (a layout with a
        non-tensor in it) is never kept."""
        key = self.key(device, parts) if parts is not None else None
        found = self._entries.get(key) if key is not None else None
        if found is not None:
            return found, False
        found = make()
        if key is not None:
            if len(self._entries) >= self._limit:
                self._entries.clear()
            self._entries[key] = found
        return found, True

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


def launch_here(launch: Launch, args: tuple) -> None:
    """Launch on the current device's current stream (where kernel[grid]
    would): bound where it may be (Note [bound launch]: a Launch made with
    bind=True, no Triton launch hook active), else through kernel[grid]."""
    if launch.bind and hooks_unset():
        launch.launch(current_stream(current_device()), args)
    else:
        launch.normal(args)


def current_device() -> int:
    """The current CUDA device's index (what Triton launches on)."""
    return torch._C._cuda_getDevice()


def current_stream(device_index: int) -> int:
    """The raw current CUDA stream of a device, as Triton's launch reads it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def stream_capturing() -> bool:
    return torch._C._cuda_isCurrentStreamCapturing()


__all__ = ["Launch", "LayoutMemo", "current_device", "current_stream", "hooks_unset", "launch_here",
           "layout", "stream_capturing"]
