"""The precompiler (compile_backend/runtime/kernel_precompile.py) on its own:
requests recorded, deferred ones compiled on worker threads and loaded on
the caller's, workers let through by the capture guard, a saved list
preloaded, a failed compile left to the launch. The kernel is tests/toy_jit.py's
stand-in for a Triton JITFunction."""

import json
import logging
import threading

import pytest

import compile_backend as cb
from compile_backend.core.forward_context import ForwardContext, set_forward_context
from compile_backend.runtime import jit_guard, kernel_precompile
from compile_backend.runtime.kernel_precompile import KernelPrecompiler, kernel_name, resolve

import toy_jit
from toy_jit import toy_kernel

triton = pytest.importorskip("triton")
if not kernel_precompile.available():
    pytest.skip("this Triton cannot compile a recorded request", allow_module_level=True)


@pytest.fixture(autouse=True)
def _fresh():
    toy_kernel.reset()
    toy_kernel.delay_s = 0.0
    cb.reset_counters()
    yield
    toy_kernel.reset()


def test_outside_deferring_a_request_compiles_in_line_and_is_recorded():
    pre = KernelPrecompiler(threads=2)
    with pre.active():
        assert toy_kernel.run((False, True)) is True
    assert [c for c, _, _ in toy_kernel.log] == [(False, True)]
    assert toy_kernel.log[0][1] == threading.current_thread().name
    assert pre.saved_list() == [(kernel_name(toy_kernel), json.dumps([False, True]))]
    assert cb.counters["kernels_precompiled"] == 0


def test_deferred_requests_compile_on_workers_and_load_on_the_caller():
    toy_kernel.delay_s = 0.05
    pre = KernelPrecompiler(threads=4)
    with pre.active():
        with pre.deferring():
            launched = [toy_kernel.run(cfg) for cfg in [(True, False), (False, False), (True, False)]]
        # skipped, as Triton skips a hooked launch (the repeat: skipped, or
        # launched if a worker finished the first request already)
        assert launched[:2] == [False, False]
        pre.wait()
        assert toy_kernel.run((True, False)) and toy_kernel.run((False, False))  # now compiled
    assert cb.counters["kernels_precompiled"] == 2  # the repeated request went once
    assert sorted(c for c, _, _ in toy_kernel.log) == [(False, False), (True, False)]
    assert all(t.startswith("mrv2-precompile") for _, t, _ in toy_kernel.log)
    me = threading.current_thread().name
    assert sorted(toy_kernel.handles) == [((False, False), me), ((True, False), me)]
    assert pre.pending == 0 and pre.wait_s >= 0


def test_ready_settle_and_wait_any_load_each_compile_as_it_ends():
    """A slow and a fast compile: `collecting` sees every request (one sent
    before too); `wait_any` returns once the fast one ended and loads it
    here, leaving the slow one compiling; `ready` says which keys a capture
    could launch; with nothing left, `wait_any` answers False."""
    toy_kernel.delays = {(True, False): 0.0, (False, False): 1.0}
    pre = KernelPrecompiler(threads=2)
    name = kernel_name(toy_kernel)
    fast, slow = ((name, json.dumps(list(c))) for c in [(True, False), (False, False)])
    with pre.active():
        with pre.deferring(), pre.collecting() as first:
            toy_kernel.run((False, False))
            toy_kernel.run((True, False))
        with pre.deferring(), pre.collecting() as again:
            toy_kernel.run((False, False))  # sent already: still collected
        assert first == {fast, slow} and again == {slow}
        assert pre.wait_any()
        me = threading.current_thread().name
        assert pre.ready({fast}) and not pre.ready({slow}) and not pre.ready({fast, slow})
        assert toy_kernel.handles == [((True, False), me)]  # loaded here, the slow one not yet
        assert pre.ready({("other", "[]")})  # never sent: nothing to wait for
        while not pre.ready({slow}):
            assert pre.wait_any()
        assert pre.settle() == 0 and not pre.wait_any()
    assert sorted(toy_kernel.handles) == [((False, False), me), ((True, False), me)]
    assert pre.wait_s > 0.5


def test_wait_for_loads_its_keys_only_and_keep_hands_the_rest_to_the_next_active():
    """wait_for(keys) returns once those compiles are loaded here, the others
    still compiling; active(keep=True) leaves them and the pool to the next
    active(), which loads them at its end (a cold start's first step and
    its plan: runner/model_runner.py, early_scouts)."""
    pre = KernelPrecompiler(threads=2)
    mine, later = (False, True), (True, False)
    gate = threading.Event()
    toy_kernel.gates[later] = gate
    try:
        with pre.active(keep=True):
            with pre.deferring(), pre.collecting() as own:
                assert toy_kernel.run(mine) is False
            with pre.deferring():
                assert toy_kernel.run(later) is False
            pre.wait_for(own)
            me = threading.current_thread().name
            assert toy_kernel.handles == [(mine, me)]  # loaded here
            assert pre.pending == 1 and not pre.ready({(kernel_name(toy_kernel), json.dumps(later))})
        assert pre._pool is not None and pre.pending == 1  # kept: still compiling
    finally:
        gate.set()
    with pre.active():
        pass
    assert sorted(toy_kernel.handles) == sorted([(mine, me), (later, me)])
    assert pre._pool is None and cb.counters["kernels_precompiled"] == 2


def test_a_worker_compiles_while_the_caller_captures_and_the_guard_chains():
    """The guard refuses the capturing thread's compiles, never a worker's."""
    toy_kernel.delay_s = 0.05
    pre = KernelPrecompiler(threads=2)
    ctx = ForwardContext()
    ctx.capturing = True
    with pre.active(), jit_guard.no_compile_in_capture():
        with pre.deferring():
            toy_kernel.run((True, False))
        with set_forward_context(ctx):
            with pytest.raises(jit_guard.CompileInCapture):
                toy_kernel.run((False, False))  # this thread captures: refused
            pre.wait()  # the worker's compile went through meanwhile
    # compiled once, on a worker, while this thread's forward context said "capturing"
    assert [(c, t.startswith("mrv2-precompile")) for c, t, _ in toy_kernel.log] == [((True, False), True)]
    assert cb.counters["triton_compiles"] == 1  # the request, asked outside the capture (once)


def test_a_saved_list_preloads_and_a_stale_name_is_skipped(caplog):
    saved = [(kernel_name(toy_kernel), json.dumps([True, False])),
             (kernel_name(toy_kernel), json.dumps([False, True])),
             ("toy_jit:no_such_kernel", "{}")]
    pre = KernelPrecompiler(threads=2)
    with caplog.at_level(logging.INFO), pre.active():
        assert pre.preload(saved) == 2
        pre.wait()
        assert toy_kernel.run((True, False)) and toy_kernel.run((False, True))
    assert cb.counters["kernels_preloaded"] == 2
    assert len(toy_kernel.log) == 2 and all(t.startswith("mrv2-precompile") for _, t, _ in toy_kernel.log)
    assert any("no_such_kernel not preloaded" in r.message for r in caplog.records)
    assert resolve(kernel_name(toy_kernel)) is toy_kernel
    with pytest.raises(TypeError, match="not a Triton JIT function"):
        resolve("toy_jit:config_of")


def test_a_failed_compile_is_logged_counted_and_left_to_the_launch(monkeypatch, caplog):
    def broken(spec):
        raise RuntimeError("ptxas died")

    pre = KernelPrecompiler(threads=2)
    with caplog.at_level(logging.WARNING), pre.active():
        monkeypatch.setattr(toy_kernel, "preload", broken)
        with pre.deferring():
            toy_kernel.run((True, True))
        pre.wait()
    assert cb.counters["kernels_precompile_failures"] == 1
    assert any("ptxas died" in r.message and "compiles at launch" in r.message
               for r in caplog.records)


def test_the_hook_is_restored_and_a_previous_one_still_hears_requests():
    heard = []
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: heard.append(kw["repr"])
    try:
        pre = KernelPrecompiler(threads=1)
        with pre.active():
            toy_kernel.run((False, False))
        assert heard == ["toy_kernel[(False, False)]"]
        assert triton.knobs.runtime.jit_cache_hook.__name__ == "<lambda>"
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


def test_threads_default_to_the_cores_and_the_option_is_checked():
    assert 1 <= kernel_precompile.default_threads() <= kernel_precompile.MAX_THREADS
    assert cb.CompilationConfig().precompile_threads == 0
    with pytest.raises(ValueError, match="precompile_threads must be an int >= 0"):
        cb.CompilationConfig(precompile_threads=-1)


def test_where_triton_interprets_nothing_compiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not kernel_precompile.compiles_here()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernel_precompile.compiles_here()


def test_a_worker_builds_the_kernels_launcher_and_a_failure_is_left_to_the_launch(monkeypatch):
    """After its compile a worker thread builds the kernel's launcher (Triton
    3.6 compiles one from C per signature, in `_init_handles` otherwise: on
    the loading thread, a cold start's cost); a kernel without src or
    metadata (the toy's) builds none, and a failed build is only counted
    out (the launch builds it again and raises)."""
    import types

    from triton.runtime import driver

    built = []

    def launcher_cls(src, metadata):
        if metadata == "broken":
            raise RuntimeError("gcc failed")
        built.append((src, metadata, threading.current_thread().name))

    monkeypatch.setattr(driver, "_active", types.SimpleNamespace(launcher_cls=launcher_cls))
    ok = types.SimpleNamespace(src="src", metadata="meta", name="k")
    bad = types.SimpleNamespace(src="src", metadata="broken", name="k")
    kernels = {"ok": ok, "bad": bad}
    jit = types.SimpleNamespace(preload=lambda spec: kernels[spec])
    pool = kernel_precompile.concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mrv2-precompile")
    with pool:
        assert pool.submit(kernel_precompile._compile, jit, "ok", None).result() is ok
        assert pool.submit(kernel_precompile._compile, jit, "bad", None).result() is bad
    assert [(s, m) for s, m, _ in built] == [("src", "meta")]
    assert built[0][2].startswith("mrv2-precompile")
    assert cb.counters["kernel_launchers_built"] == 1
    kernel_precompile._build_launcher(toy_kernel.preload(json.dumps([True, True])))  # no src: nothing
    assert len(built) == 1
