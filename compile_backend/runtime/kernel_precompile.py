"""Triton kernels compiled ahead of the captures that need them, on worker
threads, instead of one at a time in per-size warm-ups; what a plan compiled
is saved beside the warm-start entry and loaded, all at once, by the next
start (docs/design.md, "Kernels compiled ahead, in parallel").

    pre = KernelPrecompiler(threads=8, workers=7)
    pre.start_workers(CompileWorkers)  # a cold start: processes compile (kernel_workers.py)
    with pre.active():            # the jit_cache_hook: every compile request recorded
        pre.preload(saved)        # a warm start: the list a cold start saved
        with pre.deferring():     # a dry warm-up: requests go to the pool, launches skipped
            step(...)             # (deferring_eager: only those made outside a capture)
        pre.wait()                # compiled, modules loaded on this thread
    pre.saved_list()              # [(kernel, specialization)] for the next start
A request: a JITFunction and its serialised specialisation (JITFunction.preload).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

import torch

from compile_backend.core.counters import counters
from compile_backend.core.qualified_names import qualified_name
from compile_backend.core.qualified_names import resolve as resolve_name
from compile_backend.runtime import jit_guard, kernel_workers

logger = logging.getLogger(__name__)

MAX_THREADS = 16
# `wait_for`: seconds a request may sit in the worker processes' queue before
# this process's threads take the queue (a worker compiles one of our kernels
# in 0.5-2 s on an H100; one still importing takes longer).
QUEUED_S = 3.0


def default_threads() -> int:
    """One worker per core, at most MAX_THREADS (ptxas runs as a process per
    kernel; Triton's passes run in C++)."""
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


def _knobs() -> Any:
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    ok = hasattr(knobs.runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")
    return knobs if ok else None


def available() -> bool:
    """Can this Triton compile a kernel from a recorded request (hook and preload)?"""
    return _knobs() is not None


def compiles_here() -> bool:
    """Does Triton compile kernels in this process? Not where it interprets
    them (TRITON_INTERPRET=1: CPU tensors), so a dry run buys nothing there."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def kernel_name(jit_function: Any) -> str:
    """`module:qualname` of a JITFunction's Python function (how a saved list names it)."""
    return qualified_name(getattr(jit_function, "fn", None))


def resolve(name: str) -> Any:
    """The JITFunction a saved `module:qualname` names (imports its module)."""
    obj = resolve_name(name)
    if not hasattr(obj, "preload"):
        raise TypeError(f"{name} is not a Triton JIT function")
    return obj


class KernelPrecompiler:
    """Collects Triton compile requests and compiles them on a thread pool."""

    def __init__(self, threads: int = 0, workers: int = 0) -> None:
        self.threads = threads or default_threads()
        self.workers = workers  # processes that compile, once started (start_workers)
        self._procs: Any = None  # their CompileWorkers
        self._target: dict[str, Any] | None = None
        self._where: dict[tuple[str, str], str] = {}  # request -> the counter its compile adds to
        self._worker_failures = 0
        self._said = threading.Lock()
        self.specs: set[tuple[str, str]] = set()  # every request seen: (kernel name, specialization)
        self._sent: set[tuple[str, str]] = set()  # submitted once per process of this plan
        self._futures: dict[tuple[str, str], concurrent.futures.Future] = {}  # not yet waited for
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._deferring = False
        self._deferring_eager = False
        self._active = False
        self.last_request: tuple[str, str] | None = None
        self.wait_s = 0.0  # host seconds wait() blocked
        # request -> [perf_counter at its submission, at its compile's end
        # (None until then), what asked (`asking`)]: when a plan asked for
        # each kernel, what met it, and how long it took to come (the
        # startup bench's timeline)
        self.timeline: dict[tuple[str, str], list[Any]] = {}
        self.asker = ""
        self._collect: set[tuple[str, str]] | None = None  # `collecting`'s set

    # ---- the hook ------------------------------------------------------------

    def _hook(self, previous: Any) -> Any:
        def hook(*args: Any, **kwargs: Any) -> Any:
            if jit_guard.compiling_ahead_here():  # a worker's own compile: let it through
                return previous(*args, **kwargs) if previous is not None else None
            info, compile_ = kwargs.get("fn"), kwargs.get("compile") or {}
            jit_function = getattr(info, "jit_function", None)
            spec = compile_.get("specialization_data")
            if jit_function is not None and spec is not None:
                key = (kernel_name(jit_function), spec)
                self.specs.add(key)
                self.last_request = key  # a capture refused it, if the guard raises next
                if self._collect is not None:
                    self._collect.add(key)
                if self._deferring or (self._deferring_eager and not jit_guard.capturing()):
                    self._submit(key, jit_function, compile_.get("device"))
                    return True  # Triton: do not compile or launch now
            return previous(*args, **kwargs) if previous is not None else None

        return hook

    @contextlib.contextmanager
    def active(self, keep: bool = False) -> Iterator["KernelPrecompiler"]:
        """Install the hook (chained to one already set); on exit wait for
        what is still compiling and shut the pool down. Re-entrant: an inner
        `active()` of the same precompiler changes nothing. `keep`: on exit
        leave what is still compiling, and the pool, to the next `active()`
        (a cold start's first step hands its early scouts' kernels on to the
        plan, which loads them as they come: runner/model_runner.py)."""
        knobs = _knobs()
        if knobs is None or self._active:
            yield self
            return
        self._active = True
        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook(previous)
        try:
            yield self
            if not keep:
                self.wait()
        finally:
            self._active = False
            knobs.runtime.jit_cache_hook = previous
            if self._pool is not None and not keep:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    @contextlib.contextmanager
    def _setting(self, attr: str, value: Any) -> Iterator[Any]:
        """`attr` set to `value` inside (yielded), put back after."""
        before = getattr(self, attr)
        setattr(self, attr, value)
        try:
            yield value
        finally:
            setattr(self, attr, before)

    def asking(self, label: str) -> contextlib.AbstractContextManager[str]:
        """Requests submitted inside are the timeline's as `label`'s (the
        graph or dry step the runner is running)."""
        return self._setting("asker", label)

    def collecting(self) -> contextlib.AbstractContextManager[set[tuple[str, str]]]:
        """Every request made inside, handed over before or not, into the
        set yielded (the kernels a graph's attempt and dry warm-up met)."""
        return self._setting("_collect", set())

    def deferring(self) -> contextlib.AbstractContextManager[bool]:
        """While active, a request is submitted to the pool and its launch skipped."""
        return self._setting("_deferring", True)

    def deferring_eager(self) -> contextlib.AbstractContextManager[bool]:
        """While active, a request made outside a graph capture (a PIECEWISE
        step's eager attention between its pieces' captures) is submitted to
        the pool and its launch skipped: in a plan its outputs are a dummy
        batch's, read by nothing but the next captures, which do not read
        values. A request inside a capture goes on to the guard, which
        refuses it (the graph waits for the pool). Without it a cold plan
        compiled those kernels one after another in line."""
        return self._setting("_deferring_eager", True)

    # ---- compiling -------------------------------------------------------------

    def _submit(self, key: tuple[str, str], jit_function: Any, device: Any) -> bool:
        """Hand one request to the pool; False where it was handed over already."""
        if key in self._sent:
            return False
        self._sent.add(key)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="mrv2-precompile")
        counters["kernels_precompiled"] += 1
        if self._procs is not None:  # a worker process compiles, a thread then loads
            remote = self._procs.submit(kernel_workers.REMOTE,
                                        kernel_workers.compile_job(*key, self._target),
                                        local=_not_taken)
            self._futures[key] = self._pool.submit(self._compile_after, remote, jit_function, key,
                                                   device)
        else:
            self._futures[key] = self._pool.submit(_compile, jit_function, key[1], device)
        stamps = self.timeline[key] = [time.perf_counter(), None, self.asker]
        self._futures[key].add_done_callback(lambda _, at=stamps: at.__setitem__(1, time.perf_counter()))
        return True

    def _compile_after(self, remote: concurrent.futures.Future, jit_function: Any,
                       key: tuple[str, str], device: Any) -> Any:
        """On a thread: wait for a worker process's compile of `key`, then
        load it from Triton's disk cache. Where no worker process had taken
        it when the caller waited, or the worker failed (counted, the first
        failure logged as a warning), the thread compiles it here."""
        try:
            where, _ = remote.result()
            if where == "worker":
                self._where[key] = "kernels_compiled_in_workers"  # counted by wait(), on the caller
        except Exception as e:  # noqa: BLE001 - compiled here instead, as without workers
            self._where[key] = "kernel_worker_fallbacks"
            with self._said:
                self._worker_failures += 1
                level = logging.WARNING if self._worker_failures == 1 else logging.DEBUG
            logger.log(level, "mrv2: a compile worker could not compile %s (%s); it compiles in "
                       "this process (counted in kernel_worker_fallbacks; precompile_workers=0 "
                       "compiles every kernel here from the start)", key[0],
                       str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return _compile(jit_function, key[1], device)

    # ---- worker processes ------------------------------------------------------

    def start_workers(self, spawn: Callable[..., Any], target: dict[str, Any] | None = None) -> bool:
        """Start the worker processes (they import torch and the kernels while
        this process goes on); requests from now on compile there. `spawn`:
        `CompileWorkers` (compile/compile_workers.py), called as spawn(n,
        preload, env=...). `target`: the Triton target to compile for
        (default: this process's, which needs a driver: Triton compiling
        here). False where none start."""
        if self._procs is not None:
            return True
        if self.workers <= 0 or not available() or (target is None and not compiles_here()):
            return False
        if target is None:
            try:
                target = kernel_workers.current_target()
            except Exception as e:  # noqa: BLE001 - no driver to name one: the threads compile
                logger.info("mrv2: no Triton target for compile workers (%s: %s); the plan's "
                            "kernels compile on threads", type(e).__name__, e)
                return False
        self._target = target
        self._procs = spawn(self.workers, kernel_workers.PRELOAD, env=kernel_workers.WORKER_ENV)
        return True

    def close_workers(self) -> None:
        """Let the worker processes go (each exits once its job is answered)."""
        if self._procs is not None:
            self._procs.close()
            self._procs = None

    def preload(self, saved: list[tuple[str, str]]) -> int:
        """Submit every (kernel name, specialization) of a saved list; one
        that no longer resolves is skipped (logged). Returns how many went."""
        sent = 0
        for name, spec in saved:
            try:
                jit_function = resolve(name)
            except Exception as e:  # noqa: BLE001 - a stale name: that kernel compiles when launched
                logger.info("mrv2: saved kernel %s not preloaded (%s: %s)", name, type(e).__name__, e)
                continue
            key = (name, spec)
            self.specs.add(key)
            if self._submit(key, jit_function, _current_device()):
                counters["kernels_preloaded"] += 1
                sent += 1
        return sent

    def wait(self) -> None:
        """Block until every submitted compile finished; load each module on
        this thread (`_finish`)."""
        t0 = time.perf_counter()
        self._queued_here()
        while self._futures:
            key, future = self._futures.popitem()
            concurrent.futures.wait([future])
            self._finish(key, future)
        self.wait_s += time.perf_counter() - t0

    def wait_for(self, keys: set[tuple[str, str]]) -> None:
        """Block until every one of `keys` still compiling has finished, and
        load each on this thread; the other compiles go on. Where one is not
        done within QUEUED_S (no worker process took it: one still importing,
        or dead), the queue goes to this process's threads, as in `wait`."""
        t0 = time.perf_counter()
        moved = False
        for key in [k for k in keys if k in self._futures]:
            future = self._futures[key]
            done, _ = concurrent.futures.wait([future], timeout=None if moved else QUEUED_S)
            if not done:
                self._queued_here()
                moved = True
                concurrent.futures.wait([future])
            self._finish(key, self._futures.pop(key))
        self.wait_s += time.perf_counter() - t0

    def wait_any(self) -> bool:
        """Block until at least one more submitted compile has finished, and
        load every finished one here (`settle`); False where none was left
        to wait for."""
        t0 = time.perf_counter()
        self._queued_here()
        pending = [f for f in self._futures.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        settled = self.settle()
        self.wait_s += time.perf_counter() - t0
        return bool(pending or settled)

    def settle(self) -> int:
        """Load, on this thread, every compile that has finished (as `wait`
        does, without blocking on the others); returns how many."""
        done = [key for key, future in self._futures.items() if future.done()]
        for key in done:
            self._finish(key, self._futures.pop(key))
        return len(done)

    def ready(self, keys: set[tuple[str, str]]) -> bool:
        """Is none of `keys` still compiling or unloaded (after `settle`: a
        capture that needs only these launches what is loaded)?"""
        return not any(key in self._futures for key in keys)

    def _queued_here(self) -> None:
        """The requests no worker process has taken yet go to the threads:
        this thread only waits now, so their compiles cost it nothing, and
        none waits on a worker still importing, or dead."""
        if self._procs is not None:
            self._procs.run_queued_here()

    def _finish(self, key: tuple[str, str], future: concurrent.futures.Future) -> None:
        """A finished compile: counted where it ran, its module loaded on this
        thread (a launch inside a capture then loads nothing). A compile that
        failed is logged and left to the launch (which raises its error)."""
        where = self._where.pop(key, None)  # a worker process's compile, or its fallback
        if where is not None:
            counters[where] += 1
        try:
            kernel = future.result()
        except Exception as e:  # noqa: BLE001 - the launch compiles again and reports it
            counters["kernels_precompile_failures"] += 1
            logger.warning("mrv2: compiling %s ahead failed (%s: %s); it compiles at launch",
                           key[0], type(e).__name__, e)
            return
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            init()

    def last_request_sent(self) -> bool:
        """Was the latest request already handed to the workers (a capture
        that needs it can wait for them rather than warm up again)?"""
        return self.last_request is not None and self.last_request in self._sent

    @property
    def pending(self) -> int:
        return sum(not f.done() for f in self._futures.values())

    def saved_list(self) -> list[tuple[str, str]]:
        """Every request seen, as a list a later process can `preload`."""
        return sorted(self.specs)


def _not_taken() -> None:
    """A worker request's form here (CompileWorkers.run_queued_here): nothing;
    the thread waiting for it compiles the kernel itself."""


def _current_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _compile(jit_function: Any, spec: str, device: Any) -> Any:
    """On a worker: compile (or load from Triton's disk cache) one kernel for
    one specialisation; Triton puts it in the JITFunction's kernel cache."""
    with jit_guard.compiling_ahead():
        if isinstance(device, int) and torch.cuda.is_available() \
                and torch.cuda.current_device() != device:
            torch.cuda.set_device(device)  # a worker thread starts on device 0
        kernel = jit_function.preload(spec)
    _build_launcher(kernel)
    return kernel


def _build_launcher(kernel: Any) -> None:
    """On a worker: the kernel's launcher, built where Triton builds one per
    signature. Triton 3.6 compiles it from C (a compiler run where its
    cache has none: a cold start) in `_init_handles`, which the
    loading thread runs (the module load must not run beside a capture);
    built here first, the loading thread finds it in Triton's cache and only
    imports it. Triton 3.9's launcher is generic (nothing to build). A
    failure is left to `_init_handles`, which builds it again and raises."""
    src, metadata = getattr(kernel, "src", None), getattr(kernel, "metadata", None)
    if src is None or metadata is None:
        return
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(src, metadata)
        counters["kernel_launchers_built"] += 1
    except Exception as e:  # noqa: BLE001 - _init_handles builds it again and reports it
        logger.debug("mrv2: %s's launcher not built ahead (%s: %s)", getattr(kernel, "name", "?"),
                     type(e).__name__, e)
