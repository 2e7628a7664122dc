"""Host seconds of a region by callee, unprofiled: each custom op of a
namespace (its default overload, as Inductor's generated code and the split
graph call it) and each loaded Inductor piece, timed with perf_counter and
kept as self time (a piece's figure leaves out the ops it called).

    with OpTimer() as t:
        runner.capture()
    t.rows()  # [(name, calls, self s)], biggest first
    # "piece": the loaded Inductor pieces' own code; "step": the compiled
    # step's own (its split graph, the eager pieces between graphs);
    # "replay": a CUDA graph's replay call; "capture inputs": the runner's
    # inputs and metadata for each graph of the plan; and what a cold start
    # adds: "triton compile in line", "precompile wait", "inductor autotune",
    # "synchronize", "gc.collect" (the region's thread only); and inside
    # norm_linear and linear_add: their norm and gate launches and cuBLAS's
    # F.linear

For measurement only (bench/startup.py --by-op): it swaps the packets'
`default` attributes, the direct calls' implementations (core/direct_calls.py)
and the loaded pieces' `__call__` while active, and puts them back after.
Costs about 1 µs a timed call.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch


class _Timed:
    """An op overload whose calls are timed; everything else (its name,
    schema, what a dispatch mode asks of it) is the overload's."""

    def __init__(self, overload: Any, timed: Callable[..., Any]) -> None:
        self._overload, self._call = overload, timed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._overload, name)


def _cold_callees() -> list[tuple[Any, str, str]]:
    """What a cold start adds to a capture, where this torch and Triton have
    it: Triton's compiles (or disk-cache loads) in line, the precompiler's
    waits for its workers, Inductor's first-launch tuning (its benchmarks),
    the device syncs and the garbage collections."""
    import gc

    from compile_backend.runtime import kernel_precompile

    found: list[tuple[Any, str, str]] = [
        (kernel_precompile.KernelPrecompiler, "wait", "precompile wait"),
        (kernel_precompile.KernelPrecompiler, "wait_any", "precompile wait"),
        (kernel_precompile.KernelPrecompiler, "settle", "precompile settle"),
        (torch.cuda, "synchronize", "synchronize"), (gc, "collect", "gc.collect")]
    try:
        from triton.runtime.jit import JITFunction

        found.append((JITFunction, "_do_compile", "triton compile in line"))
    except ImportError:
        pass
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        found += [(CachingAutotuner, "benchmark_all_configs", "inductor autotune"),
                  (CachingAutotuner, "precompile", "inductor precompile")]
    except ImportError:
        pass
    return [(owner, attr, name) for owner, attr, name in found if attr in owner.__dict__]


def _inner_callees() -> list[tuple[Any, str, str]]:
    """What norm_linear's three-launch form and linear_add's torch form call
    (their self time then leaves these out): the norm and gate kernels'
    launches and cuBLAS's GEMM (F.linear), looked up by name
    at each call, so a swap of the module attribute times them."""
    import importlib

    import torch.nn.functional as F

    # the module (the package's `norm_linear` is the op's function)
    norm_linear = importlib.import_module("compile_backend.kernels.norm_linear")
    found = [(norm_linear, "rms_norm", "norm_linear: rms_norm"),
             (norm_linear, "silu_mul", "norm_linear: silu_mul"),
             (F, "linear", "cuBLAS: F.linear")]
    return [(owner, attr, name) for owner, attr, name in found if attr in owner.__dict__]


class OpTimer:
    def __init__(self, namespaces: tuple[str, ...] = ("mrv2",)) -> None:
        self.namespaces = namespaces
        self.calls: dict[str, int] = {}
        self.self_s: dict[str, float] = {}
        self.total_s = 0.0
        self._stack: list[float] = []  # children's seconds of each open call
        self._undo: list[Callable[[], None]] = []

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        stack, calls, self_s = self._stack, self.calls, self.self_s
        clock, thread = time.perf_counter, threading.get_ident()

        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != thread:  # a worker thread's (precompiles): not the region's
                return fn(*args, **kwargs)
            stack.append(0.0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                took = clock() - t0
                children = stack.pop()
                if stack:
                    stack[-1] += took
                calls[name] = calls.get(name, 0) + 1
                self_s[name] = self_s.get(name, 0.0) + took - children
        return call

    def __enter__(self) -> "OpTimer":
        for qualname in torch._C._dispatch_get_all_op_names():
            ns, _, rest = qualname.partition("::")
            if ns not in self.namespaces or "." in rest:
                continue
            packet = getattr(getattr(torch.ops, ns), rest)
            overload = packet.default
            packet.default = _Timed(overload, self._timed(rest, overload))
            self._undo.append(lambda p=packet, o=overload: setattr(p, "default", o))
        # Eager pieces call breakpoint ops without the dispatcher (PIECEWISE's
        # attention: core/direct_calls.py); their compiled code holds the
        # direct implementation's wrapper, so its `impl` is timed in place.
        from compile_backend.core import direct_calls

        for qualname, wrapper in direct_calls._DIRECT_IMPLS.items():
            ns, _, rest = qualname.partition("::")
            if ns in self.namespaces:
                self._swap_cell(wrapper, "impl", rest)
        from compile_backend.compile.compiled_step import CompiledStep
        from compile_backend.compile.step_artifacts import _Loaded
        from compile_backend.runner import model_runner
        from compile_backend.runtime.cuda_graph import CUDAGraphWrapper

        for owner, attr, name in ((_Loaded, "__call__", "piece"), (CompiledStep, "__call__", "step"),
                                  (CUDAGraphWrapper, "_replay", "replay"),
                                  (model_runner, "prepare_inputs_to_capture", "capture inputs"),
                                  *_cold_callees(), *_inner_callees()):
            self._swap(owner, attr, name)
        self._t0 = time.perf_counter()
        return self

    def _swap_cell(self, fn: Any, var: str, name: str) -> None:
        """Time what `fn`'s closure variable `var` holds, as `name`."""
        cell = fn.__closure__[fn.__code__.co_freevars.index(var)]
        original = cell.cell_contents
        cell.cell_contents = self._timed(name, original)
        self._undo.append(lambda: setattr(cell, "cell_contents", original))

    def _swap(self, owner: Any, attr: str, name: str) -> None:
        """Time `owner.attr` (a class's method or a module's function) as `name`."""
        original = owner.__dict__[attr]
        timed = self._timed(name, original)
        setattr(owner, attr, (lambda obj, *args, _t=timed, **kwargs: _t(obj, *args, **kwargs))
                if isinstance(owner, type) else timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def __exit__(self, *exc: Any) -> None:
        self.total_s = time.perf_counter() - self._t0
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def rows(self) -> list[tuple[str, int, float]]:
        """(callee, calls, self seconds), biggest first, then "outside":
        the region's seconds that no timed callee holds."""
        rows = sorted(((n, self.calls[n], self.self_s[n]) for n in self.calls),
                      key=lambda r: -r[2])
        return rows + [("outside", 0, self.total_s - sum(r[2] for r in rows))]
