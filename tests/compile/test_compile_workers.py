"""Compile workers (compile/compile_workers.py): jobs run in fresh worker
processes or, where no worker has taken them, in the caller's; a failed job
or a dead worker fails its future with the reason; what a job prints never
reaches the answers. The piece's job (compile/worker_compile.py) pickles
views of a buffer and names the modules of its custom ops; a model's own ops
compile in a worker (slow tier, as tests/compile/test_warm_start.py's runner
cases)."""

import copy
import os
import zlib

import pytest
import torch

import compile_backend as cb
from compile_backend.compile.compile_workers import CompileWorkers, WorkerError, auto_workers


@pytest.fixture
def workers():
    pool = CompileWorkers(1)
    yield pool
    pool.close(wait=True)


def test_a_job_runs_in_a_worker_and_its_prints_do_not_corrupt_the_answers(workers):
    data = os.urandom(4096)
    printed = workers.submit("builtins:print", "a line on the worker's stdout")
    assert printed.result(timeout=60) == ("worker", None)
    for _ in range(3):
        assert workers.submit("zlib:crc32", data).result(timeout=60) == ("worker", zlib.crc32(data))


def test_a_failing_job_fails_its_future_with_the_workers_traceback(workers):
    future = workers.submit("zlib:decompress", b"not zlib data")
    with pytest.raises(WorkerError, match="zlib.error"):
        future.result(timeout=60)
    assert workers.submit("zlib:adler32", b"abc").result(timeout=60) == ("worker", zlib.adler32(b"abc"))


def test_a_dead_worker_fails_its_job_and_the_caller_runs_what_is_left(tmp_path, monkeypatch):
    """With one of two workers dead, the other takes what is queued, and the
    caller may run it; once the last one died, every queued job and every
    later one fails at once (a thread waiting on one would otherwise wait
    for ever, as the kernel precompiler's do: it compiles the kernel itself)."""
    pool = CompileWorkers(2)
    try:
        dead = pool.submit("os:_exit", 3)
        with pytest.raises(WorkerError, match=r"died \(exit code 3\)"):
            dead.result(timeout=60)
        assert pool.submit("zlib:crc32", b"abc").result(timeout=60) == ("worker", zlib.crc32(b"abc"))
        left = pool.submit("zlib:crc32", b"xyz", local=lambda: "ran here")
        assert pool.run_queued_here() in (0, 1)  # the live worker may have taken it first
        assert left.result(timeout=60) in (("here", "ran here"), ("worker", zlib.crc32(b"xyz")))
        last = pool.submit("os:_exit", 4)
        with pytest.raises(WorkerError, match=r"died \(exit code 4\)"):
            last.result(timeout=60)
        after = pool.submit("zlib:crc32", b"q", local=lambda: "here")
        with pytest.raises(WorkerError, match="no compile worker is left"):
            after.result(timeout=5)
    finally:
        pool.close(wait=True)
    # A worker that dies before it is ready fails the jobs queued for it.
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get the caller's import path
    pool = CompileWorkers(1, preload=["dies_on_import"])
    try:
        queued = pool.submit("zlib:crc32", b"a", local=lambda: "here")
        with pytest.raises(WorkerError, match="no compile worker is left"):
            queued.result(timeout=60)
    finally:
        pool.close(wait=True)


def test_jobs_wait_for_a_worker_that_is_still_importing_and_the_caller_may_take_them(
        tmp_path, monkeypatch):
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get the caller's import path
    pool = CompileWorkers(1, preload=["slow_to_import"])
    try:
        first = pool.submit("zlib:crc32", b"a", local=lambda: "first, here")
        second = pool.submit("zlib:crc32", b"b", local=None)  # a worker's only
        assert not pool.wait_ready(timeout=0.1)
        assert pool.run_queued_here() == 1  # the worker is still importing
        assert first.result(timeout=1) == ("here", "first, here")
        assert second.result(timeout=60) == ("worker", zlib.crc32(b"b"))
        assert pool.wait_ready(timeout=0)
    finally:
        pool.close(wait=True)
    assert all(p.returncode == 0 for p in pool._procs)


def test_closing_kills_a_worker_still_importing(tmp_path, monkeypatch):
    """A compile whose pieces the caller compiled alone (its workers not ready
    yet) does not leave them importing torch beside the next work."""
    import time

    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = CompileWorkers(1, preload=["slow_to_import"])
    t0 = time.perf_counter()
    pool.close(wait=True)
    assert time.perf_counter() - t0 < 10
    assert pool._procs[0].returncode == -9


def test_a_job_whose_answer_cannot_be_pickled_fails_with_the_reason(workers):
    future = workers.submit("builtins:open", os.devnull)  # a file object: not picklable
    with pytest.raises(WorkerError, match="pickle"):
        future.result(timeout=60)
    assert workers.submit("zlib:crc32", b"q").result(timeout=60) == ("worker", zlib.crc32(b"q"))


def test_compile_workers_option():
    assert cb.CompilationConfig().compile_workers is None
    assert cb.CompilationConfig(compile_workers=0).compile_workers == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="compile_workers must be None or an int >= 0"):
            cb.CompilationConfig(compile_workers=bad)
    assert 0 <= auto_workers() <= 3


def test_a_piece_payload_pickles_views_of_a_buffer():
    """A piece that takes slices of one persistent buffer (the runner's input
    ids, say) goes to a worker with the view kept: GraphPickler alone fails
    on a view's base."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler, Options
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from compile_backend.compile.worker_compile import _PiecePickler

    mode = FakeTensorMode(shape_env=ShapeEnv())
    buffer = torch.randn(64, 8)
    fake = mode.from_tensor(buffer)
    args = (fake[4:20], fake[1:9, 2:6], fake)
    data = _PiecePickler.dumps(args, Options(ops_filter=None))
    back = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    for a, b in zip(args, back):
        assert (a.shape, a.stride(), a.storage_offset(), a._is_view()) == \
            (b.shape, b.stride(), b.storage_offset(), b._is_view())


def test_a_workers_job_names_the_modules_of_the_pieces_own_ops():
    import toy_ops  # noqa: F401  (registers toy::*)

    from compile_backend.compile.worker_compile import op_modules

    def f(x, state):
        y = torch.ops.toy.attn(x, x, x)
        return torch.ops.toy.state_mix(torch.relu(y), state)

    gm = torch.fx.symbolic_trace(f)
    assert op_modules(gm) == ["toy_ops"]


@pytest.mark.slow
def test_a_models_own_ops_reach_the_workers_and_its_pieces_equal_eager():
    """A piece that calls a test's attention-like op (toy::state_mix, which
    updates a buffer) compiles with Inductor in a worker, which imports the
    op's module first; outputs and the buffer equal eager after every call."""
    from backend_models import D, TOY_OPTIONS, ToyHybrid

    torch._dynamo.reset()
    cb.reset_counters()
    torch.manual_seed(5)
    model = ToyHybrid()
    eager = copy.deepcopy(model)
    backend = cb.backend(piece_compiler="inductor", compile_workers=1, inductor_min_fusible_ops=0,
                         **TOY_OPTIONS)  # every piece Inductor's, so the worker takes them
    backend.start_workers()
    assert backend._workers.wait_ready(timeout=120)  # so that the worker takes the pieces
    compiled = torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for t in (6, 3, 11):
            x = cb.mark_token_dim(torch.randn(t, D, generator=g))
            with cb.symbolic_tokens():
                out = compiled(x)
            torch.testing.assert_close(out, eager(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.state, eager.state, atol=1e-5, rtol=1e-5)
    assert cb.counters["compile_worker_compiles"] >= 1, dict(cb.counters)
    assert cb.counters["compile_worker_fallbacks"] == 0, dict(cb.counters)
