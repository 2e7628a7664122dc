"""cuBLAS's first calls made beside a warm start's load
(compile_backend/runtime/gemm_warmup.py): a step's GEMMs recorded with the
token dimension marked, saved beside the warm-start entry, and run at every
capture size on a thread by the next start, whose replays still equal eager.
On CPU the runner's device check is widened to "cpu" (the mechanism is the
same; only cuBLAS's first-call cost is missing)."""

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F

import compile_backend as cb
from compile_backend.compile import step_cache
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runtime import gemm_warmup
from compile_backend.runtime.gemm_warmup import TOKENS, GemmProblem
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs

from toy_jit import toy_runner

SIZES = [1, 2, 4, 8, 16]
lib = torch.library.Library("gemm_warmup_test", "DEF")
lib.define("scaled_linear(Tensor x, Tensor w) -> Tensor")
lib.impl("scaled_linear", lambda x, w: 2 * torch.mm(x, w.t()), "CompositeExplicitAutograd")


def _step_gemms(T, gen):
    w = torch.randn(24, 16, generator=gen)
    wd = torch.randn(16, 40, generator=gen)
    x = torch.randn(T, 16, generator=gen)
    h = torch.randn(T, 40, generator=gen)
    r = torch.randn(3, 24, generator=gen)

    def step():
        y = F.linear(x, w)  # aten::linear -> mm [T, 16] x [16, 24]
        z = torch.addmm(x, h, wd.t(), beta=0.5)  # [T, 16] + [T, 40] x [40, 16]
        torch.ops.gemm_warmup_test.scaled_linear(x, w)  # an mm inside a custom op: the same mm
        torch.addmm(r[0], x[:3], w.t())  # three rows, a bias: not the token count
        F.linear(x, w)  # a repeat: recorded once
        return y, z

    return step, (w, wd)


def test_record_marks_the_token_dimension_and_sees_gemms_inside_custom_ops():
    T = 8
    step, _ = _step_gemms(T, torch.Generator().manual_seed(1))
    problems = gemm_warmup.record(step, T)
    assert problems == [
        GemmProblem("mm", "float32", ((TOKENS, 16), (16, 24)), (None, (1, 16))),
        GemmProblem("addmm", "float32", ((TOKENS, 16), (TOKENS, 40), (40, 16)),
                    (None, None, (1, 40)), beta=0.5),
        GemmProblem("addmm", "float32", ((24,), (3, 16), (16, 24)), ((1,), (16, 1), (1, 16))),
    ]
    # A saved list reads back equal; one that does not parse warms nothing.
    assert gemm_warmup.loads(json.loads(json.dumps(gemm_warmup.dumps(problems)))) == problems
    assert gemm_warmup.loads([{"op": "conv", "dtype": "float32", "shapes": [], "strides": []}]) == []


def test_record_keeps_a_token_row_slice_of_a_wider_buffer_and_drops_a_transposed_input():
    gen = torch.Generator().manual_seed(2)
    T = 6
    wide = torch.randn(T, 48, generator=gen)
    w = torch.randn(16, 32, generator=gen)
    xt = torch.randn(32, T, generator=gen).t()  # [T, 32], column-major: strides (1, T)
    problems = gemm_warmup.record(lambda: (torch.mm(wide[:, :32], w.t()), torch.mm(xt, w.t())), T)
    assert problems == [GemmProblem("mm", "float32", ((TOKENS, 32), (32, 16)), ((48, 1), (1, 32)))]


def test_start_runs_every_problem_at_every_size_on_views_of_a_donor(monkeypatch):
    T = 8
    gen = torch.Generator().manual_seed(3)
    step, donors = _step_gemms(T, gen)
    problems = gemm_warmup.record(step, T)
    big = torch.randn(4096, generator=gen)  # enough elements for every operand
    seen = []

    def fake_script():
        def run(ops, a, b, c, beta, alpha):
            for i in range(len(ops)):
                seen.append((ops[i], a[i].shape, a[i].stride(), b[i].shape, b[i].stride(),
                             c[i].shape, beta[i], a[i].untyped_storage().data_ptr()))
            return len(ops)
        return run

    monkeypatch.setattr(gemm_warmup, "_script", fake_script)
    run = gemm_warmup.start(problems, [4, 2, 16], [torch.zeros(3, dtype=torch.int64), big], "cpu")
    run.join()
    assert run.error is None and run.calls == 2 * 3 + 1
    # Each problem at each size, largest first; one without the token dimension once.
    assert [(s[0], s[1][0]) for s in seen] == [(0, 16), (0, 4), (0, 2), (1, 16), (1, 4), (1, 2), (1, 3)]
    assert seen[3][1:6] == ((16, 40), (40, 1), (40, 16), (1, 40), (16, 16)) and seen[3][6] == 0.5
    assert all(s[7] == big.untyped_storage().data_ptr() for s in seen)  # no new buffer


def test_start_runs_the_scripted_problems_on_a_thread_and_a_scratch_buffer():
    T = 8
    step, donors = _step_gemms(T, torch.Generator().manual_seed(4))
    problems = gemm_warmup.record(step, T)
    run = gemm_warmup.start(problems, SIZES, donors[:1], "cpu")  # the donor is too small
    assert run._thread is not None and run._thread.name == "mrv2-gemm-warmup"
    stats = run.join().stats()
    assert stats["gemm_warmup_error"] is None and stats["gemm_warmup_calls"] == 2 * len(SIZES) + 1
    assert stats["gemm_warmup_s"] > 0 and run._thread is None


def test_a_failing_warmup_is_logged_at_join_and_raises_nothing(monkeypatch, caplog):
    problems = [GemmProblem("mm", "float32", ((TOKENS, 4), (4, 4)), (None, None))]

    def broken():
        def run(*args):
            raise RuntimeError("no cuBLAS here")
        return run

    monkeypatch.setattr(gemm_warmup, "_script", broken)
    with caplog.at_level(logging.WARNING, logger="compile_backend.runtime.gemm_warmup"):
        run = gemm_warmup.start(problems, [2], [], "cpu").join()
    assert "no cuBLAS here" in run.stats()["gemm_warmup_error"]
    assert "GEMM warm-up stopped" in caplog.text


def test_a_saved_list_that_does_not_fit_is_refused_without_raising(caplog):
    # Parses, but not as a GEMM: an addmm with two operands, a 3-D mm, a negative stride.
    for bad in ({"op": "addmm", "dtype": "float32", "shapes": [["T", 4], [4, 4]], "strides": [None, None]},
                {"op": "mm", "dtype": "float32", "shapes": [[2, "T", 4], [4, 4]], "strides": [None, None]},
                {"op": "mm", "dtype": "float32", "shapes": [["T", 4], [4, 4]], "strides": [None, [-1, 4]]}):
        assert gemm_warmup.loads([bad]) == []
    # Operands larger than this machine holds: logged, nothing started, no raise.
    huge = GemmProblem("mm", "float32", ((TOKENS, 1 << 42), (1 << 42, 2)), (None, None))
    with caplog.at_level(logging.WARNING, logger="compile_backend.runtime.gemm_warmup"):
        run = gemm_warmup.start([huge], [2], [], "cpu")
    assert run.calls == 0 and run._thread is None and run.stats()["gemm_warmup_error"]
    assert "no GEMM warm-up" in caplog.text


def test_warm_gemms_must_be_a_bool():
    assert cb.CompilationConfig().warm_gemms is True
    with pytest.raises(ValueError, match="warm_gemms must be True or False"):
        cb.CompilationConfig(warm_gemms="yes")


# ---- a runner: cold records, warm runs them beside the load -------------------


def _runner(mode, cache_dir, state=None, warm_gemms=True):
    return toy_runner(mode, SIZES, cache_dir, state, warm_gemms=warm_gemms)


def _sessions_equal_eager(runner, model, sessions=2):
    for session in range(sessions):
        gen = torch.Generator().manual_seed(200 + session)
        for t in (1, 3, 4, 8, 16):
            ids = torch.randint(0, 64, (t,), generator=gen).tolist()
            out = runner.execute(InputBatch(ids, [t], [t], [0])).clone()
            ids_t = runner.input_buffers.input_ids[:t].clone()
            pos_t = runner.input_buffers.positions[:t].clone()
            torch.testing.assert_close(out, model(ids_t, pos_t), rtol=1e-6, atol=1e-6)


def _spy_starts(monkeypatch) -> list:
    """GEMM warm-ups on the CPU too; every gemm_warmup.start call's
    (problems, sorted sizes, run), in the list returned."""
    monkeypatch.setattr(gemm_warmup, "DEVICES", ("cuda", "cpu"))
    started = []
    real_start = gemm_warmup.start

    def spy(problems, sizes, donors, device):
        run = real_start(problems, sizes, donors, device)
        started.append((problems, sorted(sizes), run))
        return run

    monkeypatch.setattr(gemm_warmup, "start", spy)
    return started


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_warm_start_runs_the_gemms_its_cold_start_recorded_beside_its_load(mode, tmp_path,
                                                                              monkeypatch):
    started = _spy_starts(monkeypatch)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        cold, model = _runner(mode, str(tmp_path))
        cold.warmup(max(SIZES))
        assert cold.compiled.how == "compiled" and not started
        saved = gemm_warmup.loads(step_cache.read_gemms(cold.compiled.cache_path))
        # proj and head: F.linear with a bias, addmm over the token rows.
        assert [p.op for p in saved] == ["addmm", "addmm"]
        assert all(p.shapes[1][0] == TOKENS for p in saved)
        assert cold.capture_stats["gemms_recorded"] == 2
        cold.capture()
        _sessions_equal_eager(cold, model, sessions=1)

        warm, model = _runner(mode, str(tmp_path), state=model.state_dict())
        warm.capture()  # its first step (the load) comes inside capture()
        assert warm.compiled.how == "loaded"
        (problems, sizes, run), = started
        assert problems == saved and sizes == sorted({g.num_tokens for g in warm.capture_plan()})
        assert run._thread is None  # joined before the plan
        assert warm.capture_stats["gemm_warmup_calls"] == 2 * len(sizes)
        assert warm.capture_stats["gemm_warmup_error"] is None
        assert "gemms_recorded" not in warm.capture_stats  # a saved list: nothing recorded again
        _sessions_equal_eager(warm, model)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_cold_start_where_kernels_compile_ahead_runs_its_gemms_while_they_compile(
        mode, tmp_path, monkeypatch):
    """Where Triton compiles (forced here), a cold start records its GEMMs
    from a dry step right after the first step's dry run, saves them, and
    runs them at every size of the plan on a thread while the workers
    compile the first step's kernels; the recording step compiles nothing
    in line (its kernels are the workers'), the thread is joined before
    the plan, and replays equal eager."""
    from compile_backend.runtime import kernel_precompile
    from toy_jit import toy_kernel

    monkeypatch.setattr(kernel_precompile, "compiles_here", lambda: True)
    started = _spy_starts(monkeypatch)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        toy_kernel.reset()
        toy_kernel.delay_s = 0.05
        cold, model = toy_runner(mode, SIZES, str(tmp_path), precompile_threads=2,
                                 precompile_workers=0)
        cold.warmup(max(SIZES))
        saved = gemm_warmup.loads(step_cache.read_gemms(cold.compiled.cache_path))
        assert [p.op for p in saved] == ["addmm", "addmm"]
        (problems, sizes, run), = started
        assert problems == saved and sizes == sorted({g.num_tokens for g in cold.capture_plan()})
        assert run._thread is None  # joined before the first step returned
        assert cold.capture_stats["gemms_recorded"] == 2
        assert cold.capture_stats["gemm_warmup_calls"] == 2 * len(sizes)
        assert cold.capture_stats["gemm_warmup_error"] is None
        assert not any(t == "MainThread" for _, t, _ in toy_kernel.log)  # nothing compiled in line
        cold.capture()
        _sessions_equal_eager(cold, model)
        toy_kernel.reset()


def test_no_list_without_a_cache_or_with_warm_gemms_off_and_a_bad_list_is_recorded_again(
        tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_warmup, "DEVICES", ("cuda", "cpu"))
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        off, _ = _runner("piecewise", str(tmp_path), warm_gemms=False)
        off.warmup(max(SIZES))
        assert not os.path.exists(step_cache._side_path(off.compiled.cache_path, step_cache.GEMMS_SUFFIX))
        none, _ = _runner("piecewise", None)
        none.warmup(max(SIZES))
        assert "gemms_recorded" not in none.capture_stats

        cold, model = _runner("piecewise", str(tmp_path))
        path = step_cache._side_path(cold.compiled.entry_for(
            (cold.input_buffers.input_ids[:16], cold.input_buffers.positions[:16])),
            step_cache.GEMMS_SUFFIX)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("{not json")
        cold.warmup(max(SIZES))
        assert cold.capture_stats["gemms_recorded"] == 2
        assert len(step_cache.read_gemms(cold.compiled.cache_path)) == 2
        # `mrv2 cache clear` removes the list with its entry.
        assert step_cache.clear_entries(str(tmp_path)) == 1 and not os.path.exists(path)


@pytest.mark.gpu
def test_on_the_gpu_bf16_gemms_recorded_run_on_a_thread_and_a_graph_captured_after_equals_eager():
    """Real cuBLAS: the recorded problems run at four sizes on a thread, off
    on the caller's stream, and a graph of the same
    GEMMs captured afterwards replays equal to eager on fresh inputs."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    wd = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)

    def gemms(x, h):
        return F.linear(x, w), torch.addmm(x, h, wd.t())

    T = 64
    x = torch.randn(T, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.randn(T, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    problems = gemm_warmup.record(lambda: gemms(x, h), T)
    assert [p.op for p in problems] == ["mm", "addmm"] and all(p.dtype == "bfloat16" for p in problems)
    run = gemm_warmup.start(problems, [1, 8, 24, 128], [w, wd], "cuda").join()
    assert run.error is None and run.calls == 8 and run.seconds > 0
    xs = torch.randn(24, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    hs = torch.randn(24, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph.capture_begin()
        out = gemms(xs, hs)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        xs.copy_(torch.randn(24, 512, device="cuda", dtype=torch.bfloat16, generator=gen))
        hs.copy_(torch.randn(24, 1024, device="cuda", dtype=torch.bfloat16, generator=gen))
        graph.replay()
        for got, want in zip(out, gemms(xs, hs)):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-1)  # bf16 sums of 512-1024 products


def test_a_recording_that_fails_leaves_the_first_step_and_saves_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(gemm_warmup, "DEVICES", ("cuda", "cpu"))

    def no_profiler(step, num_tokens):
        raise AttributeError("this torch's profiler has no event tree")

    monkeypatch.setattr(gemm_warmup, "record", no_profiler)
    with use_graph_backend(StandInGraphs()), torch.no_grad(), \
            caplog.at_level(logging.WARNING, logger="compile_backend.runner.model_runner"):
        runner, model = _runner("piecewise", str(tmp_path))
        runner.capture()
        assert cb.counters["gemm_record_failures"] == 1 and "could not record" in caplog.text
        assert step_cache.read_gemms(runner.compiled.cache_path) == []
        _sessions_equal_eager(runner, model, sessions=1)
