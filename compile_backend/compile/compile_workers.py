"""Worker processes that compile while the caller goes on.

    workers = CompileWorkers(2)                     # started now: they import torch meanwhile
    future = workers.submit("module:function", arg, local=fn)
    workers.run_queued_here()                       # the caller runs what no worker took yet
    where, value = future.result()                  # where: "worker" or "here"
    workers.close()                                 # they exit once idle

A worker is `python -m compile_backend.compile.compile_workers`: a fresh
interpreter (no fork of a process holding CUDA, no re-import of the caller's
script) reading length-prefixed pickles (function, argument) on stdin and
answering on its own copy of stdout (prints go to stderr). It takes jobs
once its preloads are imported; one that dies fails the job it held.
docs/design.md, section "Cold compile in parallel"."""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any, BinaryIO, Callable, Sequence

from compile_backend.core.qualified_names import resolve

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")  # each message: its byte count, then its pickle


class WorkerError(RuntimeError):
    """A job a worker could not do: its traceback, or how the worker died."""


def auto_workers() -> int:
    """Workers for `compile_workers=None`: an Inductor compile keeps about two
    cores busy (its Python and its compiler processes), so one per two cores
    beside the caller's, at most 3 (a transformer has 3 distinct pieces:
    first, layer, last). None on 2 cores, where they only contend (measured:
    docs/design.md, "Cold compile in parallel")."""
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(0, min(3, cores // 2 - 1))


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _recv(stream: BinaryIO) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the stream ended")
    (size,) = _LEN.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the stream ended inside a message")
    return pickle.loads(data)


class _Job:
    __slots__ = ("future", "remote", "arg", "local")

    def __init__(self, remote: str, arg: Any, local: Callable[[], Any] | None) -> None:
        self.future: Future = Future()
        self.remote, self.arg, self.local = remote, arg, local


class CompileWorkers:
    """`n` worker processes, started at construction; `preload`: modules
    each imports before its first job (while the caller traces); `env`:
    variables set for them beside the caller's."""

    def __init__(self, n: int, preload: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        assert n >= 1, n
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        env = {**os.environ, **(env or {})}
        # The caller's import path (a source checkout, a test's folders; "" is its cwd).
        env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p or os.curdir) for p in sys.path if os.path.isdir(p or os.curdir))
        self._procs = [
            subprocess.Popen([sys.executable, "-m", __name__, *preload], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
            for _ in range(n)]
        self._ready = [threading.Event() for _ in self._procs]  # set: ready, or dead at start
        self._serving = len(self._procs)  # workers not yet gone (under _lock)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, args=(p, e), daemon=True,
                                          name=f"mrv2-compile-worker-{p.pid}")
                         for p, e in zip(self._procs, self._ready)]
        for t in self._threads:
            t.start()
        self.closed = False

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every worker has imported its preloads (or died)."""
        return all(e.wait(timeout) for e in self._ready)

    def submit(self, remote: str, arg: Any, local: Callable[[], Any] | None = None) -> Future:
        """Queue `resolve(remote)(arg)` for a worker; `local`: the same work in
        this process, for `run_queued_here`. The future's result is
        (where, value), where "worker" or "here"."""
        assert not self.closed
        job = _Job(remote, arg, local)
        with self._lock:  # where every worker is gone, no thread would ever take it
            if self._serving == 0:
                _no_worker_left(job)
            else:
                self._queue.put(job)
        return job.future

    def run_queued_here(self) -> int:
        """Run, in this thread, the queued jobs no worker has taken (those with
        a local form; others go back to the queue); returns how many ran."""
        ran, skipped = 0, []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None or job.local is None:
                skipped.append(job)
                continue
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(("here", job.local()))
            except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
                job.future.set_exception(e)
            ran += 1
        with self._lock:  # back to the workers, or failed where none is left to take them
            for job in skipped:
                if self._serving == 0 and job is not None:
                    _no_worker_left(job)
                else:
                    self._queue.put(job)
        return ran

    def _fail_queued(self) -> None:
        """Every queued job fails with WorkerError (its caller compiles the
        work itself); the close markers go."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _no_worker_left(job)

    def close(self, wait: bool = False) -> None:
        """Stop the workers: each exits when its stdin closes, which its thread
        does once the jobs it took are answered; one still importing is
        killed (it took no job). `wait`: until they exited (the caller
        otherwise goes on while they tear down)."""
        if not self.closed:
            self.closed = True
            for _ in self._threads:
                self._queue.put(None)
            for proc, ready in zip(self._procs, self._ready):
                if not ready.is_set():
                    proc.kill()
        if wait:
            for t in self._threads:
                t.join()

    def _serve(self, proc: subprocess.Popen, started: threading.Event) -> None:
        try:
            # Jobs wait in the queue (where the caller may take them) until this
            # worker has imported what it preloads.
            ready = _recv(proc.stdout) == ("ready", None)
        except (OSError, EOFError, pickle.PickleError, ValueError):
            ready = False
        started.set()
        try:
            while ready:
                job = self._queue.get()
                if job is None:
                    return
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    _send(proc.stdin, (job.remote, job.arg))
                    status, value = _recv(proc.stdout)
                except (OSError, EOFError, pickle.PickleError, ValueError) as e:
                    # Its pipe closed as it exited: wait a little for the
                    # exit code (poll alone can come before the exit).
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    job.future.set_exception(WorkerError(
                        f"compile worker {proc.pid} died (exit code {proc.returncode}): "
                        f"{type(e).__name__}: {e}"))
                    return  # it takes no more jobs
                if status == "ok":
                    job.future.set_result(("worker", value))
                else:
                    job.future.set_exception(WorkerError(value))
        finally:
            with self._lock:
                self._serving -= 1
                if self._serving == 0:  # nothing would take what is queued: each fails now
                    self._fail_queued()
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _no_worker_left(job: _Job) -> None:
    """Fail `job`: every worker died (a thread waiting on its future would
    otherwise wait for ever; its caller compiles the work itself)."""
    if job.future.set_running_or_notify_cancel():
        job.future.set_exception(WorkerError(
            "no compile worker is left (each died or failed to start): compile it in this "
            "process"))


def _worker_main(preload: Sequence[str]) -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the jobs print goes to stderr, not into the answers
    sys.stdout = sys.stderr
    for name in preload:  # the caller traces meanwhile
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a job that needs it reports the error
            traceback.print_exc()
    _send(out, ("ready", None))
    inp = sys.stdin.buffer
    while True:
        try:
            remote, arg = _recv(inp)
        except EOFError:
            return
        try:
            answer = ("ok", resolve(remote)(arg))
            pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)  # an answer that cannot go back
        except BaseException:  # noqa: BLE001 - sent back, the caller decides
            answer = ("error", traceback.format_exc())
        _send(out, answer)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
