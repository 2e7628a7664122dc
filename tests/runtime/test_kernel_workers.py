"""Triton kernels compiled in worker processes (compile_backend/runtime/
kernel_workers.py) for kernel_precompile.py: a deferred request goes to a
worker with the target and Triton's cache folder, and a thread of this
process then loads the worker's binary; a worker that fails is counted, said
once, and the kernel compiles here. The slow test compiles a real kernel
for sm_90 in a real worker (no GPU needed) and this process's load of it is
a cache hit."""

import logging
from concurrent.futures import Future

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime import kernel_precompile, kernel_workers
from compile_backend.runtime.kernel_precompile import KernelPrecompiler, kernel_name

from toy_jit import toy_kernel

triton = pytest.importorskip("triton")
if not kernel_precompile.available():
    pytest.skip("this Triton cannot compile a recorded request", allow_module_level=True)

SM90 = {"backend": "cuda", "arch": 90, "warp_size": 32}


@pytest.fixture(autouse=True)
def _fresh():
    toy_kernel.reset()
    cb.reset_counters()
    yield
    toy_kernel.reset()


class _Pool:
    """CompileWorkers' face: each job answered at once, by `answer(job)`."""

    def __init__(self, n, preload, env=None, answer=lambda job: 0.01):
        self.n, self.preload, self.env, self.answer = n, preload, env, answer
        self.jobs, self.closed = [], False

    def submit(self, remote, job, local=None):
        self.jobs.append((remote, job))
        future = Future()
        try:
            future.set_result(("worker", self.answer(job)))
        except Exception as e:  # noqa: BLE001 - as a worker's error reaches the caller
            future.set_exception(e)
        return future

    def run_queued_here(self):
        return 0  # every job was answered at once

    def close(self):
        self.closed = True


def test_a_deferred_request_goes_to_a_worker_and_a_thread_here_loads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    pools = []
    pre = KernelPrecompiler(threads=2, workers=3)
    assert pre.start_workers(lambda *a, **k: pools.append(_Pool(*a, **k)) or pools[-1], target=SM90)
    (pool,) = pools
    assert pool.n == 3 and pool.preload == kernel_workers.PRELOAD
    assert pool.env["CUDA_VISIBLE_DEVICES"] == ""  # a worker holds no GPU
    with pre.active():
        with pre.deferring():
            assert toy_kernel.run((True, False)) is False  # launch skipped, request sent
        pre.wait()
        assert toy_kernel.run((True, False)) is True
    spec = '[true, false]'
    assert pool.jobs == [(kernel_workers.REMOTE, (kernel_name(toy_kernel), spec, SM90, str(tmp_path)))]
    assert [c for c, _, _ in toy_kernel.log] == [(True, False)]  # the load here, on a thread
    assert toy_kernel.log[0][1].startswith("mrv2-precompile")
    assert cb.counters["kernels_compiled_in_workers"] == 1
    assert cb.counters["kernel_worker_fallbacks"] == 0
    pre.close_workers()
    assert pool.closed and pre.start_workers(lambda *a, **k: _Pool(*a, **k), target=SM90)


def test_a_failed_worker_compile_is_counted_said_once_and_compiled_here(caplog):
    def fail(job):
        raise RuntimeError("Traceback ...\nCompilationError: no ptxas here")

    pre = KernelPrecompiler(threads=2, workers=1)
    pre.start_workers(lambda *a, **k: _Pool(*a, **k, answer=fail), target=SM90)
    with caplog.at_level(logging.DEBUG, logger="compile_backend.runtime.kernel_precompile"), \
            pre.active():
        with pre.deferring():
            toy_kernel.run((True, True))
            toy_kernel.run((False, True))
        pre.wait()
    assert sorted(c for c, _, _ in toy_kernel.log) == [(False, True), (True, True)]  # compiled here
    assert cb.counters["kernel_worker_fallbacks"] == 2
    assert cb.counters["kernels_compiled_in_workers"] == 0
    said = [r for r in caplog.records if "could not compile" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG]
    assert "no ptxas here" in said[0].getMessage()
    assert "precompile_workers=0" in said[0].getMessage()  # what to do about it


class _BusyPool(_Pool):
    """Workers that take no job (busy, still importing, or dead): each waits
    in the queue until the caller runs the queued ones here."""

    def submit(self, remote, job, local=None):
        self.jobs.append((remote, job, local, Future()))
        return self.jobs[-1][3]

    def run_queued_here(self):
        for _, _, local, future in self.jobs:
            if not future.done():
                future.set_result(("here", local()))
        return len(self.jobs)


def test_requests_no_worker_took_compile_on_the_threads_when_the_caller_waits():
    """wait() hands what no worker process has taken to the threads (the
    caller only waits then, so they cost it nothing): no wait on a worker
    busy, still importing, or dead."""
    pools = []
    pre = KernelPrecompiler(threads=2, workers=2)
    pre.start_workers(lambda *a, **k: pools.append(_BusyPool(*a, **k)) or pools[-1], target=SM90)
    with pre.active():
        with pre.deferring():
            toy_kernel.run((True, False))
            toy_kernel.run((False, False))
        pre.wait()
        assert toy_kernel.run((True, False)) and toy_kernel.run((False, False))
    assert len(pools[0].jobs) == 2
    assert sorted(c for c, _, _ in toy_kernel.log) == [(False, False), (True, False)]
    assert all(t.startswith("mrv2-precompile") for _, t, _ in toy_kernel.log)
    assert cb.counters["kernels_compiled_in_workers"] == cb.counters["kernel_worker_fallbacks"] == 0


def test_wait_for_a_request_no_worker_takes_hands_the_queue_to_the_threads(monkeypatch):
    """wait_for(keys): where a key's job sits in the queue past QUEUED_S (no
    worker took it), the queue goes to this process's threads, as wait()'s
    does; the first step of a cold start never waits on a dead worker."""
    monkeypatch.setattr(kernel_precompile, "QUEUED_S", 0.05)
    pools = []
    pre = KernelPrecompiler(threads=2, workers=2)
    pre.start_workers(lambda *a, **k: pools.append(_BusyPool(*a, **k)) or pools[-1], target=SM90)
    with pre.active():
        with pre.deferring(), pre.collecting() as own:
            toy_kernel.run((True, False))
        pre.wait_for(own)
        assert toy_kernel.run((True, False))  # compiled on a thread, loaded here
    assert [c for c, _, _ in toy_kernel.log] == [(True, False)]
    assert all(t.startswith("mrv2-precompile") for _, t, _ in toy_kernel.log)


def test_no_workers_start_without_a_count_or_where_triton_does_not_compile(monkeypatch):
    spawned = []

    def spawn(*a, **k):
        spawned.append(a)
        return _Pool(*a, **k)

    assert not KernelPrecompiler(workers=0).start_workers(spawn, target=SM90)
    monkeypatch.setattr(kernel_precompile, "compiles_here", lambda: False)
    assert not KernelPrecompiler(workers=2).start_workers(spawn)  # this process's target: none
    assert spawned == []


def test_auto_workers_leave_small_machines_alone(monkeypatch):
    for cores, want in ((2, 0), (4, 0), (6, 2), (8, 3), (16, 3), (64, 3)):
        monkeypatch.setattr(kernel_workers.os, "sched_getaffinity", lambda pid, c=cores: set(range(c)))
        assert kernel_workers.auto_workers() == want, cores


@pytest.mark.slow  # full tier: a worker process (imports torch), then a real compile
def test_a_real_kernel_compiled_by_a_worker_is_a_cache_hit_here(tmp_path, monkeypatch):
    """offline_kernel.scale, requested as a launch on CPU tensors with the
    target-only driver active here (sm_90: no GPU), compiles in a worker
    process; the load on this side finds its binary in the cache folder."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import CompiledKernel

    from compile_backend.compile.compile_workers import CompileWorkers

    import offline_kernel

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(triton.runtime.driver, "_active",
                        kernel_workers.TargetOnlyDriver(GPUTarget(**SM90)))
    monkeypatch.setattr(CompiledKernel, "_init_handles", lambda self: None)  # no module to load here
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener",
                        lambda **kw: hits.append(kw.get("cache_hit")))
    class Patient(CompileWorkers):
        """Leaves every job to the worker (wait() would hand one not yet
        taken to the threads: that path has its own test)."""

        def run_queued_here(self):
            return 0

    pre = KernelPrecompiler(threads=1, workers=1)
    assert pre.start_workers(Patient, target=SM90)
    try:
        gen = torch.Generator().manual_seed(37)
        x, y = torch.randn(300, generator=gen), torch.empty(300)
        with pre.active():
            with pre.deferring():
                assert offline_kernel.scale[(3,)](x, y, 300, 2.0, BLOCK=128) is None  # not launched
            pre.wait()
    finally:
        pre.close_workers()
    assert cb.counters["kernels_compiled_in_workers"] == 1, dict(cb.counters)
    assert cb.counters["kernel_worker_fallbacks"] == 0
    assert hits == [True]  # this process compiled nothing: it loaded the worker's binary
    assert any(p.suffix == ".cubin" for p in tmp_path.rglob("*"))


def test_precompile_workers_is_none_or_a_count():
    assert cb.CompilationConfig().precompile_workers is None
    assert cb.CompilationConfig(precompile_workers=0).precompile_workers == 0
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="precompile_workers must be None or an int >= 0"):
            cb.CompilationConfig(precompile_workers=bad)
