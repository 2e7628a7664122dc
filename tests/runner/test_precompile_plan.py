"""A runner's plan compiles its kernels ahead (compile_backend/runtime/kernel_precompile.py):
a graph whose capture would compile waits after a dry warm-up while workers
compile, the rest of the plan captures meanwhile, and a warm start loads the
saved kernel list before its first capture, so no capture or warm-up asks
Triton for a kernel. Every replay equals eager, over several sessions. The
kernel is tests/toy_jit.py's stand-in for a Triton JITFunction."""

import json
import os
import threading
from types import SimpleNamespace

import pytest
import torch

import compile_backend as cb
from compile_backend.compile import step_cache
from compile_backend.core.graph_plan import early_scout_graphs, scout_graphs
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runtime import kernel_precompile
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs

import toy_jit  # toy::jit_ahead
from compile_backend.runner.capture import PREFILL_DRY_SHAPES
from toy_jit import config_of, eager_config_of, toy_kernel, toy_runner

triton = pytest.importorskip("triton")
if not kernel_precompile.available():
    pytest.skip("this Triton cannot compile a recorded request", allow_module_level=True)

SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(autouse=True)
def _toy_compiles(monkeypatch):
    """The toy kernel compiles although Triton interprets here (no GPU): the
    runner's first step runs dry as it does where Triton compiles."""
    monkeypatch.setattr(kernel_precompile, "compiles_here", lambda: True)


def _runner(mode, cache_dir=None, state=None, eager_op=False, precompile_workers=0,
            prefill_op=False, early_scouts=False):
    """A new runner, as a new process builds it: the toy kernel's cache empty
    (compiles on threads unless `precompile_workers`). The plan's own waits
    are what most tests here watch: its scouts are not run dry in the first
    step's wait unless `early_scouts`."""
    toy_kernel.reset()
    toy_kernel.delay_s = 0.02
    runner, model = toy_runner(mode, SIZES, cache_dir, state, eager_op, prefill_op,
                               precompile_threads=3, precompile_workers=precompile_workers,
                               early_scouts=early_scouts)
    runner.warmup(max(SIZES))  # the first call compiles (or loads) the step, at the largest size
    return runner, model


def _sessions_equal_eager(runner, model, sessions=3):
    """Several sessions of steps at every size (new random ids each), each
    step's logits against the model run eagerly on the same buffers."""
    for session in range(sessions):
        gen = torch.Generator().manual_seed(100 + session)
        for t in (1, 2, 3, 4, 7, 8, 16):
            ids = torch.randint(0, 64, (t,), generator=gen).tolist()
            batch = InputBatch(ids, [1] * t, [1 + i % 3 for i in range(t)], list(range(t))) \
                if t <= 4 else InputBatch(ids, [t], [t], [0])
            assert runner.dispatch(batch).mode is not cb.CUDAGraphMode.NONE
            out = runner.execute(batch).clone()
            ids_t = runner.input_buffers.input_ids[:t].clone()
            pos_t = runner.input_buffers.positions[:t].clone()
            # fp32: a graph runs the padded size, whose GEMMs may sum in
            # another order than eager's at t rows (2e-6 seen on one CPU)
            torch.testing.assert_close(out, model(ids_t, pos_t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graphs_that_need_kernels_wait_while_workers_compile_them(mode):
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, model = _runner(mode)
        at_warmup = {c for c, _, _ in toy_kernel.log}
        runner.capture()
        plan = runner.capture_plan()
        new = {config_of(g.num_tokens) for g in plan} - at_warmup
        assert len(new) == 2  # T=2 (neither) and T=1
        # The cold plan's dry prefills, before its first capture, asked for
        # T=2's (17 tokens: neither); only T=1's is met by a capture first.
        prefilled = {config_of(t) for _, t in PREFILL_DRY_SHAPES}
        met = new - prefilled
        assert met == {config_of(1)}
        # A graph that met a new kernel waited (one whose kernel a worker had
        # finished by then did not); one dry warm-up per configuration met.
        meets_new = [g for g in plan if config_of(g.num_tokens) in new]
        waits = cb.counters["capture_waits"]
        assert len(met) <= waits <= len(meets_new) - (mode == "full")
        assert cb.counters["capture_warmups"] == len(met)
        # FULL: a size's mixed graph waits without an attempt while its decode
        # graph waits for the kernel (captures_deferred); none was refused twice.
        deferred = cb.counters["captures_deferred"]
        assert (deferred >= 1) == (mode == "full") and cb.counters["capture_rewaits"] == 0
        waited = runner.capture_stats["graphs_waited"]
        assert waited == waits + deferred
        # The plan's wait seconds leave out the first step's (its dry run waited too).
        assert runner._precompiler.wait_s - runner.capture_stats["compile_wait_s"] > 0
        # The first step ran dry once: its kernel compiled on a worker too.
        assert cb.counters["first_step_dry_runs"] == 1
        assert cb.counters["kernels_precompiled"] == len(new) + len(at_warmup) == 3
        assert runner.capture_stats["kernels_recorded"] == 3  # the first step's and the plan's
        assert runner.capture_stats["kernels_by_name"] == {"toy_kernel": 3}
        assert all(t.startswith("mrv2-precompile") for _, t, _ in toy_kernel.log)
        # The new kernels compiled once each, on workers, none inside a capture.
        ahead = [(c, t) for c, t, _ in toy_kernel.log if c in new]
        assert sorted(c for c, _ in ahead) == sorted(new)
        assert all(t.startswith("mrv2-precompile") for _, t in ahead)
        assert not any(capturing for _, t, capturing in toy_kernel.log if t == "MainThread")
        # Every graph of the plan captured once: those that waited last, in plan order.
        assert sorted(r.graph.key for r in runner.captures) == sorted(g.key for g in plan)
        # A waiting graph's record holds its refused attempt and dry warm-up too.
        assert sum(r.warmup_s > 0 for r in runner.captures) == len(met)
        assert all(r.seconds >= r.warmup_s >= 0 for r in runner.captures)
        last = [r.graph for r in runner.captures[-waited:]]
        assert set(last) <= set(meets_new) and last == [g for g in plan if g in last]
        _sessions_equal_eager(runner, model)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_plan_meets_its_new_kernels_at_its_scout_sizes_before_the_rest(mode):
    """The toy kernel's configuration at T=1 is new to the plan (the dry
    prefills, before the first capture, ask for the one of 2, 3 and 6):
    largest first, the plan meets it at its last size; scouts first (the
    default: 16, then 8, 4, 2, 1, then 12, 6, 3) before 12, 6 and 3, so it
    compiles while they capture. The timeline says when each kernel was
    asked for and came. Replays equal eager either way."""
    sizes = [1, 2, 3, 4, 6, 8, 12, 16]
    for scouts in (True, False):
        with use_graph_backend(StandInGraphs()), torch.no_grad():
            toy_kernel.reset()
            toy_kernel.delay_s = 0.02
            runner, model = toy_runner(mode, sizes, precompile_threads=3, precompile_workers=0,
                                       scout_sizes_first=scouts, early_scouts=False)
            runner.warmup(max(sizes))
            runner.capture()
            # one dry warm-up, at 1 (FULL: its decode graph's; its mixed graph then
            # waits for the kernel that warm-up sent)
            assert [r.graph.num_tokens for r in runner.captures if r.warmup_s > 0] == [1]
            # The attempts' order, read from the graphs that did not wait: in
            # the plan's order, less those that waited (2, 3 and 6 may or may
            # not, as the prefills' kernel is ready before them or not; 16, 12,
            # 8 and 4 use the first step's).
            order = [16, 8, 4, 2, 1, 12, 6, 3] if scouts else [16, 12, 8, 6, 4, 3, 2, 1]
            waited = runner.capture_stats["graphs_waited"]
            firsts = list(dict.fromkeys(r.graph.num_tokens for r in runner.captures[:-waited]))
            assert {16, 12, 8, 4} <= set(firsts) and 1 not in firsts
            assert firsts == [t for t in order if t in firsts]
            timeline = runner.capture_stats["kernel_timeline"]
            assert [name for name, _, _, _ in timeline] == ["toy_kernel"] * 3
            assert timeline[0][1] < 0 <= timeline[1][1] <= timeline[2][1]  # the first step's, then the plan's
            assert all(ready is not None and ready >= asked for _, asked, ready, _ in timeline)
            # what asked: the first step's dry run, a dry prefill (17 tokens), the graph at 1
            assert timeline[0][3] == "first step 16" and timeline[1][3] == "prefill 1x17"
            assert timeline[2][3] in ("piecewise 1", "full decode 1")
            assert sorted(r.graph.key for r in runner.captures) == sorted(
                g.key for g in runner.capture_plan())
            _sessions_equal_eager(runner, model, sessions=2)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_waiting_graph_is_captured_once_its_kernels_come_not_after_the_slowest(mode):
    """Two kernels compile while the plan captures: the dry prefills' (the
    configuration of 2, 3 and 6), slow, and the one of 1, fast. The graphs
    that waited for the fast one are captured while the slow one still
    compiles, before those that wait for it, although 2 comes before 1 in
    the plan; a graph of a size whose first graph waits (FULL's mixed graph)
    waits without an attempt of its own. Replays equal eager."""
    sizes = [1, 2, 3, 4, 6, 8, 12, 16]
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        toy_kernel.reset()
        toy_kernel.delay_s = 0.02
        runner, model = toy_runner(mode, sizes, precompile_threads=3, precompile_workers=0,
                                   early_scouts=False)
        runner.warmup(max(sizes))
        slow = config_of(2)
        toy_kernel.delays[slow] = 1.5
        runner.capture()
        waited = runner.capture_stats["graphs_waited"]
        last = [r.graph.num_tokens for r in runner.captures[-waited:]]
        assert set(last) == {1, 2, 3, 6}
        assert last.index(1) < last.index(2)  # 2 first in the plan (scouts: 16, 8, 4, 2, 1, ...)
        assert max(i for i, t in enumerate(last) if t == 1) < min(
            i for i, t in enumerate(last) if t != 1)
        # every graph of a waiting size but its first (FULL: decode graphs at 1-4 requests)
        assert cb.counters["captures_deferred"] == sum(
            g.num_tokens in (1, 2, 3, 6) for g in runner.capture_plan()) - 4
        assert cb.counters["capture_rewaits"] == 0
        assert sorted(r.graph.key for r in runner.captures) == sorted(
            g.key for g in runner.capture_plan())
        _sessions_equal_eager(runner, model, sessions=2)


def test_under_tensor_parallelism_the_waiting_graphs_keep_the_plans_order(monkeypatch):
    """A rank of a tensor-parallel group (the model's `tp` of size 2) does not
    capture waiting graphs as their kernels come (that order follows compile
    times, which differ between ranks): it waits for every kernel and
    captures them in the plan's order, 2 before 1 although 1's kernel came
    first."""
    from types import SimpleNamespace

    sizes = [1, 2, 3, 4, 6, 8, 12, 16]
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        toy_kernel.reset()
        toy_kernel.delay_s = 0.02
        runner, model = toy_runner("piecewise", sizes, precompile_threads=3, precompile_workers=0,
                                   early_scouts=False)
        runner.warmup(max(sizes))
        model.tp = SimpleNamespace(size=2)
        toy_kernel.delays[config_of(2)] = 0.5
        runner.capture()
        waited = runner.capture_stats["graphs_waited"]
        last = [r.graph.num_tokens for r in runner.captures[-waited:]]
        assert last == [2, 1, 6, 3]  # the plan's order (scouts: 16, 8, 4, 2, 1, 12, 6, 3)
        _sessions_equal_eager(runner, model, sessions=1)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_kernel_that_fails_to_compile_ahead_is_compiled_in_line_by_its_graph(mode, monkeypatch):
    """The configuration of 1 fails on the compile threads (counted, logged)
    and compiles where it is launched: its graph, refused again by no new
    kernel, leaves the captures-as-kernels-come loop and warms up in line
    before its capture, as before that loop; every graph is captured once
    and replays equal eager."""
    import threading

    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, model = _runner(mode)
        real = toy_kernel.preload

        def flaky(spec):
            on_thread = threading.current_thread().name.startswith("mrv2-precompile")
            if on_thread and tuple(json.loads(spec)) == config_of(1):
                raise RuntimeError("ptxas died")
            return real(spec)

        monkeypatch.setattr(toy_kernel, "preload", flaky)
        runner.capture()
        assert cb.counters["kernels_precompile_failures"] == 1
        assert cb.counters["capture_rewaits"] >= 1
        inline = [c for c, t, _ in toy_kernel.log if t == "MainThread"]
        assert inline == [config_of(1)]  # by its graph's warm-up, outside any capture
        assert not any(capturing for _, _, capturing in toy_kernel.log)
        assert sorted(r.graph.key for r in runner.captures) == sorted(
            g.key for g in runner.capture_plan())
        _sessions_equal_eager(runner, model)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_kernels_of_ops_between_the_pieces_compile_on_workers(mode):
    """PIECEWISE runs a breakpoint op (attention) eagerly between its pieces'
    captures. In a plan the new kernels it meets go to the workers (their
    launches skipped: a dummy batch's values, read by no capture), none
    compiles in line on the main thread; by the plan's end each is compiled
    once and loaded, and every replay equals eager. Regression: a cold plan
    compiled them in line, one after another (4 on an H100, llama8b: the
    cold PIECEWISE plan's "other" 3.11 s against the warm one's 0.68).
    FULL captures the op inside its graphs: its kernels wait as graphs do."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, model = _runner(mode, eager_op=True)
        at_warmup = {c for c, _, _ in toy_kernel.log}
        runner.capture()
        plan = runner.capture_plan()
        eager_new = {eager_config_of(g.num_tokens) for g in plan} - at_warmup
        # new at T=4, where the piece's kernel is not (no dry warm-up there sends it)
        assert eager_new == {eager_config_of(4)} and config_of(4) in at_warmup
        compiled = [c for c, _, _ in toy_kernel.log]
        assert eager_new <= set(compiled) and len(compiled) == len(set(compiled))  # each once
        assert all(t.startswith("mrv2-precompile") for _, t, _ in toy_kernel.log), toy_kernel.log
        assert cb.counters["triton_compiles"] == 0  # none in line
        assert eager_new <= {c for c, t in toy_kernel.handles if t == "MainThread"}  # loaded
        assert sorted(r.graph.key for r in runner.captures) == sorted(g.key for g in plan)
        _sessions_equal_eager(runner, model)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_cold_start_asks_for_its_scouts_kernels_in_the_first_steps_wait(mode):
    """early_scouts: right after the first step's dry run, the plan's scout
    graphs (graph_plan.early_scout_graphs) and first prefills run dry, so every
    kernel of the plan is asked for before the first step returns (the
    timeline's requests all before the plan, by the first step, the "early"
    scouts or the dry prefills); the plan then finds them compiled: no
    capture refused, no dry warm-up, the prefills not run again. Off, the
    plan meets T=1's kernel at its capture and waits for it. Every kernel
    compiles on a worker, none in line, and replays equal eager over
    several sessions either way."""
    for early in (True, False):
        with use_graph_backend(StandInGraphs()), torch.no_grad():
            runner, model = _runner(mode, early_scouts=early)
            plan = runner.capture_plan()
            asked = {by for _, _, by in runner._precompiler.timeline.values()}
            scouts = scout_graphs(plan)
            assert {g.num_tokens for g in scouts} == {16, 8, 4, 2, 1}
            if early:
                assert cb.counters["scout_dry_runs"] == len(early_scout_graphs(plan))
                # each request by the first step, an early scout or a dry prefill
                assert any(by.startswith("early") for by in asked)
                assert all(by == "first step 16" or by.startswith(("early ", "prefill "))
                           for by in asked)
                runner._precompiler.wait()  # what the first step's real run waits for, and more
            else:
                assert cb.counters["scout_dry_runs"] == 0 and not any(b.startswith("early") for b in asked)
            runner.capture()
            timeline = runner.capture_stats["kernel_timeline"]
            if early:
                assert all(at < 0 for _, at, _, _ in timeline)  # every request before the plan
                assert cb.counters["capture_waits"] == 0 and cb.counters["capture_warmups"] == 0
                assert cb.counters["prefill_dry_runs"] == len(PREFILL_DRY_SHAPES)  # once, early
            else:
                assert cb.counters["capture_waits"] >= 1 and cb.counters["capture_warmups"] >= 1
                assert any(by == f"{mode}{' decode' if mode == 'full' else ''} 1"
                           for _, at, _, by in timeline if at >= 0)
            assert {c for c, _, _ in toy_kernel.log} >= {config_of(g.num_tokens) for g in plan}
            assert all(t.startswith("mrv2-precompile") for _, t, _ in toy_kernel.log)
            assert sorted(r.graph.key for r in runner.captures) == sorted(g.key for g in plan)
            _sessions_equal_eager(runner, model)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_the_first_step_waits_for_its_own_kernels_not_its_early_scouts(mode):
    """early_scouts: the scouts' kernels compile on past the first step (it
    waits for its own only: on an H100 waiting for all of them made a cold
    llama8b start ~3 s longer), and the plan loads them as they come. Here
    the scouts' compiles block on a gate that opens only after the first
    step has run for real; the plan then captures every graph, with no dry
    warm-up of its own, and replays equal eager over several sessions."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        toy_kernel.reset()
        toy_kernel.delay_s = 0.02
        own = config_of(max(SIZES))
        later = {config_of(t) for t in SIZES} - {own}
        gate = threading.Event()
        toy_kernel.gates.update({cfg: gate for cfg in later})
        runner, model = toy_runner(mode, SIZES, precompile_threads=3, precompile_workers=0,
                                   early_scouts=True)
        try:
            runner.warmup(max(SIZES))
            pre = runner._precompiler
            assert cb.counters["scout_dry_runs"] == len(early_scout_graphs(runner.capture_plan()))
            assert own in {c for c, t in toy_kernel.handles if t == "MainThread"}  # loaded, used
            compiled = {c for c, _, _ in toy_kernel.log}
            assert own in compiled and not compiled & later  # the scouts' still compiling
            assert pre.pending >= 1 and pre._pool is not None  # handed on to the plan
        finally:
            gate.set()
        runner.capture()
        assert {c for c, _, _ in toy_kernel.log} >= later
        assert later <= {c for c, t in toy_kernel.handles if t == "MainThread"}
        assert cb.counters["capture_warmups"] == 0 and cb.counters["triton_compiles"] == 0
        assert sorted(r.graph.key for r in runner.captures) == sorted(
            g.key for g in runner.capture_plan())
        _sessions_equal_eager(runner, model)


def test_early_scouts_run_only_in_a_cold_start_of_one_rank(tmp_path):
    """Not in a warm start (its saved kernel list loads before the first
    capture) and not under tensor parallelism (every rank must run the same
    eager steps, whatever its own saved list says)."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        cold, model = _runner("full", cache_dir=str(tmp_path), early_scouts=True)
        assert cb.counters["scout_dry_runs"] == len(early_scout_graphs(cold.capture_plan()))
        cold.capture()  # saves the kernel list
        warm, _ = _runner("full", cache_dir=str(tmp_path), state=model.state_dict(),
                          early_scouts=True)
        assert cb.counters["scout_dry_runs"] == 0 and cb.counters["first_step_dry_runs"] == 1
        toy_kernel.reset()
        rank, ranked = toy_runner("full", SIZES, precompile_threads=3, precompile_workers=0,
                                  early_scouts=True)
        ranked.tp = SimpleNamespace(size=2)
        rank.warmup(max(SIZES))
        assert cb.counters["scout_dry_runs"] == 0 and cb.counters["first_step_dry_runs"] == 1
        rank.capture()
        _sessions_equal_eager(rank, ranked, sessions=1)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_cold_plan_runs_prefills_dry_so_the_first_real_one_compiles_nothing_in_line(
        mode, tmp_path):
    """A plan's dummy batches are a few tokens a request, so an op's prefill
    kernel (toy::jit_prefill's, from position 8) is met by no capture: a
    cold plan runs its prefill shapes dry, the kernel compiles on a worker,
    is saved, and the steps after (prefills among them) ask for nothing in
    line; a warm start, with the list, runs none. Replays equal eager."""
    from compile_backend.runner.capture import PREFILL_DRY_SHAPES

    with use_graph_backend(StandInGraphs()), torch.no_grad():
        cold, model = _runner(mode, cache_dir=str(tmp_path), prefill_op=True)
        at_warmup = {c for c, _, _ in toy_kernel.log}
        assert ("prefill", True) not in at_warmup  # the first step's dummy batch: 4 tokens a request
        cold.capture()
        assert cb.counters["prefill_dry_runs"] == len(PREFILL_DRY_SHAPES)
        ahead = [t for c, t, _ in toy_kernel.log if c == ("prefill", True)]
        assert len(ahead) == 1 and ahead[0].startswith("mrv2-precompile")  # on a worker, once
        saved = step_cache.read_kernels(cold.compiled.cache_path)
        assert json.dumps(["prefill", True]) in {spec for _, spec in saved}
        _sessions_equal_eager(cold, model)
        assert not any(t == "MainThread" for _, t, _ in toy_kernel.log)  # nothing in line

        warm, model = _runner(mode, cache_dir=str(tmp_path), state=model.state_dict(),
                              prefill_op=True)
        warm.capture()
        assert cb.counters["prefill_dry_runs"] == 0
        _sessions_equal_eager(warm, model, sessions=1)
        assert not any(t == "MainThread" for _, t, _ in toy_kernel.log)

        # Under tensor parallelism every rank runs them (their steps' collectives
        # must match), whatever its own saved list says.
        rank, model = _runner(mode, cache_dir=str(tmp_path), state=model.state_dict(),
                              prefill_op=True)
        rank.model.tp = SimpleNamespace(size=2)
        rank.capture()
        assert cb.counters["prefill_dry_runs"] == len(PREFILL_DRY_SHAPES)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_warm_start_loads_the_saved_kernels_before_capturing_and_compiles_none_in_the_plan(
        mode, tmp_path):
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        cold, model = _runner(mode, cache_dir=str(tmp_path))
        cold.capture()
        assert cold.compiled.how == "compiled"
        saved = step_cache.read_kernels(cold.compiled.cache_path)
        assert len(saved) == 3 and os.path.exists(step_cache.kernels_path(cold.compiled.cache_path))
        _sessions_equal_eager(cold, model, sessions=1)

        warm, model = _runner(mode, cache_dir=str(tmp_path), state=model.state_dict())
        assert warm.compiled.how == "loaded"
        warm.capture()
        # The first step's dry run sent its kernel; the saved list sent the other two.
        assert cb.counters["kernels_preloaded"] == 2 and cb.counters["kernels_precompiled"] == 3
        assert len(toy_kernel.log) == 3
        assert all(t.startswith("mrv2-precompile") for _, t, _ in toy_kernel.log)
        # No capture and no warm-up asked Triton for a kernel: nothing waited.
        assert cb.counters["triton_compiles"] == 0
        assert cb.counters["capture_waits"] == cb.counters["capture_warmups"] == 0
        assert [r.graph for r in warm.captures] == warm.capture_plan()  # in the plan's order
        assert warm.capture_stats["kernels_unsaved"] == []
        _sessions_equal_eager(warm, model)
        # `mrv2 cache clear` takes the kernel list with the entry.
        assert step_cache.clear_entries(str(tmp_path)) == 1
        assert not os.path.exists(step_cache.kernels_path(cold.compiled.cache_path))


def test_a_kernel_the_saved_list_lacks_is_named_in_the_warm_starts_stats(tmp_path, caplog):
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        cold, model = _runner("piecewise", cache_dir=str(tmp_path))
        cold.capture()
        assert cold.capture_stats["kernels_unsaved"] == []  # nothing saved before it
        saved = step_cache.read_kernels(cold.compiled.cache_path)
        os.remove(step_cache.kernels_path(cold.compiled.cache_path))  # write_kernels merges
        step_cache.write_kernels(cold.compiled.cache_path, saved[1:])  # one left out

        warm, model = _runner("piecewise", cache_dir=str(tmp_path), state=model.state_dict())
        with caplog.at_level("INFO", logger="compile_backend.runner.model_runner"):
            warm.capture()
        unsaved = warm.capture_stats["kernels_unsaved"]
        assert [(u["kernel"], u["specialization"]) for u in unsaved] == [saved[0]]
        assert unsaved[0]["saved_of_it"] == len(saved) - 1  # the toy's other configurations
        assert "compiled in a warm start's plan" in caplog.text
        # The warm start adds it to the list: the next start loads it too.
        assert step_cache.read_kernels(cold.compiled.cache_path) == saved
        _sessions_equal_eager(warm, model, sessions=1)


def test_an_unreadable_kernel_list_is_an_empty_one(tmp_path):
    entry = str(tmp_path / "steps" / "abc.mrv2")
    os.makedirs(os.path.dirname(entry))
    with open(step_cache.kernels_path(entry), "w") as f:
        f.write("{not json")
    assert step_cache.read_kernels(entry) == []
    step_cache.write_kernels(entry, [("m:k", "{}")])
    step_cache.write_kernels(entry, [("m:k", "{}"), ("m:j", "{}")])  # merged, not replaced
    assert step_cache.read_kernels(entry) == [("m:j", "{}"), ("m:k", "{}")]


@pytest.mark.slow  # full tier: two compile worker processes (each imports torch)
def test_a_cold_start_compiles_in_worker_processes_and_a_warm_one_starts_none(tmp_path,
                                                                             monkeypatch):
    """A start without a saved kernel list starts its worker processes with
    its first step: every kernel of the first step and the plan compiles
    there (into the shared folder), this process only loads them, and the
    workers are let go after the plan. A warm start loads the saved list on
    threads and starts none. Replays equal eager in both."""
    from compile_backend.compile import compile_workers
    from compile_backend.runtime import kernel_workers

    disk = tmp_path / "disk"
    disk.mkdir()
    monkeypatch.setenv(toy_jit.DISK_ENV, str(disk))
    monkeypatch.setattr(kernel_workers, "current_target",
                        lambda: {"backend": "cuda", "arch": 90, "warp_size": 32})
    started = []

    class Recorded(compile_workers.CompileWorkers):
        """Recorded, and leaving every job to the workers (the runner's waits
        would hand one not yet taken to the threads: tests/runtime/
        test_kernel_workers.py has that path)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

        def run_queued_here(self):
            return 0

    monkeypatch.setattr(compile_workers, "CompileWorkers", Recorded)
    cache = str(tmp_path / "cache")
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        cold, model = _runner("full", cache_dir=cache, precompile_workers=2)
        cold.capture()
        assert len(started) == 1 and started[0].closed  # let go after the plan
        on_disk = toy_jit.compiled_on_disk(str(disk))
        assert len(on_disk) == 3 and os.getpid() not in on_disk.values()  # all in workers
        assert toy_kernel.log == [] and sorted(toy_kernel.loads) == sorted(on_disk)  # loaded here
        assert cb.counters["kernels_compiled_in_workers"] == cb.counters["kernels_precompiled"] == 3
        assert cb.counters["kernel_worker_fallbacks"] == 0
        _sessions_equal_eager(cold, model)

        warm, model = _runner("full", cache_dir=cache, state=model.state_dict(), precompile_workers=2)
        warm.capture()
        assert len(started) == 1  # none for a warm start
        assert toy_kernel.log == [] and sorted(toy_kernel.loads) == sorted(on_disk)
        assert cb.counters["kernels_compiled_in_workers"] == 0
        _sessions_equal_eager(warm, model)
