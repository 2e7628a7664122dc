"""Warm start and guard-free steps (compile/guard_free.py, compile/step_cache.py,
compile/step_artifacts.py): a second process loads the saved step without
tracing; a corrupt, stale or mismatched entry is compiled again, never used;
runner steps skip Dynamo's guards except under debug_checks."""

import json
import logging
import os
import pickle
import subprocess
import sys

import pytest
import torch

import compile_backend as cb
from compile_backend.compile import step_cache
from compile_backend.demo.cli import main as cli_main
from compile_backend.demo.engine import Engine
from compile_backend.demo.models import build_model, preset
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import kv_config, random_prompts

HERE = os.path.dirname(os.path.abspath(__file__))
# The CPU graph stand-in's dispatch mode: torch imports Dynamo at its first op.
STANDIN_MODE = "_UndoWrites.__torch_dispatch__"


def _worker(cache, *extra, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    if "cuda" not in extra:
        env["TRITON_INTERPRET"] = "1"
    env.pop("MRV2_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "warm_start_worker.py"),
                           "--cache", str(cache), *extra],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _entries(cache):
    folder = step_cache.steps_dir(str(cache))
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".mrv2"))


def test_a_second_process_loads_the_step_without_tracing_and_equals_eager(tmp_path):
    cold, _ = _worker(tmp_path)
    assert cold["how"] == "compiled" and cold["traced"]["fullgraph_capture"] == 1
    assert cold["counters"]["piece_compiles"] == 3  # 4 identical layers: first, middle, last
    warm, _ = _worker(tmp_path)
    assert warm["how"] == "loaded"
    # Loaded without Dynamo (compile/direct_step.py): mrv2 does not import it.
    # Here the CPU graph stand-in's dispatch mode does, at its first capture
    # (torch wraps such a mode's dispatch in Dynamo's disable, imported then);
    # a CUDA graph has no such mode (the GPU test asserts no import at all).
    assert cold["dynamo_imported"] and warm["dynamo_importer"] in (None, STANDIN_MODE), warm
    assert warm["path"] == "direct" and warm["counters"]["direct_loads"] == 1
    assert warm["traced"] == {"fullgraph_capture": 0, "frames": 0}, warm
    assert "dynamo_graphs" not in warm["counters"] and "piece_compiles" not in warm["counters"]
    assert warm["counters"]["cache_hits"] == 1 and warm["counters"]["steps_loaded"] == 1
    for run in (cold, warm):  # every step's logits and every KV cache, against eager
        assert run["logits_equal"] and run["caches_equal"], run
        assert run["counters"]["cudagraph_replays"] > 0
    assert len(_entries(tmp_path)) == 1


@pytest.mark.slow  # two processes that trace
def test_a_warm_start_imports_no_dynamo(tmp_path):
    """Without graphs (no stand-in's dispatch mode either), a warm process
    loads and serves the step and never imports Dynamo, nor sympy's users:
    the step, its graphs and its call come without it (compile/direct_step.py,
    compile/graph_codec.py). Both equal eager."""
    cold, _ = _worker(tmp_path, "--mode", "none")
    warm, _ = _worker(tmp_path, "--mode", "none")
    assert (cold["how"], warm["how"], warm["path"]) == ("compiled", "loaded", "direct")
    assert cold["dynamo_imported"] and not warm["dynamo_imported"], warm
    for run in (cold, warm):
        assert run["logits_equal"] and run["caches_equal"], run


@pytest.mark.slow
def test_a_corrupt_entry_is_compiled_again_and_replaced(tmp_path):
    _worker(tmp_path)
    (entry,) = _entries(tmp_path)
    with open(entry, "r+b") as f:  # truncated mid-write, as a crash would leave it
        f.truncate(os.path.getsize(entry) // 2)
    run, err = _worker(tmp_path)
    assert run["how"] == "compiled" and run["counters"]["cache_bad_entries"] == 1
    assert "not used, compiling again: corrupt entry" in err
    assert run["logits_equal"] and run["caches_equal"]
    again, _ = _worker(tmp_path)  # the entry was written anew
    assert again["how"] == "loaded" and again["logits_equal"]


@pytest.mark.slow
def test_a_changed_option_misses_and_a_mismatched_entry_is_refused(tmp_path):
    _worker(tmp_path)
    (first,) = _entries(tmp_path)
    # other capture sizes: the same step (its token count is symbolic), loaded
    run, _ = _worker(tmp_path, "--capture-sizes", "1,2,4,8,16")
    assert run["how"] == "loaded" and run["logits_equal"] and run["caches_equal"], run
    assert len(_entries(tmp_path)) == 1
    # another option: another key, compiled and saved beside the first
    run, _ = _worker(tmp_path, "--min-fusible", "5")
    assert run["how"] == "compiled" and run["counters"]["cache_misses"] == 1
    assert len(_entries(tmp_path)) == 2
    # an entry whose header does not match what it is loaded for (a hash
    # collision, or a file copied in by hand) is refused with what differs
    second = next(e for e in _entries(tmp_path) if e != first)
    with open(first, "rb") as f:
        a = pickle.load(f)
    with open(second, "rb") as f:
        b = pickle.load(f)
    step_cache.write_entry(first, b["header"], b["aot"])
    run, err = _worker(tmp_path)
    assert run["how"] == "compiled" and run["counters"]["cache_bad_entries"] == 1
    assert "stale entry (saved for another config)" in err
    assert run["logits_equal"] and run["caches_equal"]
    assert a["header"] != b["header"]


def test_entry_header_changes_with_model_code_state_inputs_and_options():
    m = build_model("llama", preset("tiny", num_layers=2))
    cfg = cb.CompilationConfig(piece_compiler="eager")
    ids = torch.zeros(4, dtype=torch.int64)
    base, why = step_cache.entry_header(m, cfg, (ids, ids))
    assert why is None
    key = step_cache.entry_key(base)
    bigger = build_model("llama", preset("tiny", num_layers=3))
    assert step_cache.entry_key(step_cache.entry_header(bigger, cfg, (ids, ids))[0]) != key
    other = cb.CompilationConfig(piece_compiler="eager", fuse_norm_linear=False)
    assert step_cache.entry_key(step_cache.entry_header(m, other, (ids, ids))[0]) != key
    # the runner's plan is not the step: other capture sizes, the same entry
    plan = cb.CompilationConfig(piece_compiler="eager", capture_sizes=[1, 2],
                                capture_warmup="every_size")
    assert step_cache.entry_key(step_cache.entry_header(m, plan, (ids, ids))[0]) == key
    int32 = ids.to(torch.int32)
    assert step_cache.entry_key(step_cache.entry_header(m, cfg, (int32, ids))[0]) != key
    # where things go is not what runs
    moved = cb.CompilationConfig(piece_compiler="eager", cache_dir="/elsewhere")
    assert step_cache.entry_key(step_cache.entry_header(m, moved, (ids, ids))[0]) == key

    # What the guards on parameters and buffers checked, which a runner's
    # step no longer keeps (guard_free.guard_filter): strides, requires_grad.
    weight = next(p for p in m.parameters() if p.dim() == 2)
    data = weight.data
    weight.data = data.t().contiguous().t()  # same shape and values, column-major
    assert step_cache.entry_key(step_cache.entry_header(m, cfg, (ids, ids))[0]) != key
    weight.data = data
    weight.requires_grad_(not weight.requires_grad)
    assert step_cache.entry_key(step_cache.entry_header(m, cfg, (ids, ids))[0]) != key
    weight.requires_grad_(not weight.requires_grad)
    assert step_cache.entry_key(step_cache.entry_header(m, cfg, (ids, ids))[0]) == key

    class Patched(type(m)):  # same state, other code
        def forward(self, input_ids, positions):
            return super().forward(input_ids, positions) * 1.0

    m.__class__ = Patched
    assert step_cache.entry_key(step_cache.entry_header(m, cfg, (ids, ids))[0]) != key


def test_cache_dir_comes_from_the_environment_and_off_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv("MRV2_CACHE_DIR", str(tmp_path))
    assert cb.CompilationConfig().cache_dir == str(tmp_path)
    monkeypatch.setenv("MRV2_CACHE_DIR", "off")
    assert cb.CompilationConfig().cache_dir is None
    monkeypatch.delenv("MRV2_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cb.CompilationConfig().cache_dir == str(tmp_path / "xdg" / "mrv2")
    with pytest.raises(ValueError, match="cache_dir must be a folder path"):
        cb.CompilationConfig(cache_dir=3)


def test_cache_ls_and_clear(tmp_path, capsys):
    header = {"model_class": "m.M", "model": {}, "config": {"cudagraph_mode": "full"},
              "device": "cpu", "torch": "x"}
    step_cache.write_entry(step_cache.entry_path(str(tmp_path), header), header, b"aot")
    other = {**header, "torch": "y"}
    step_cache.write_entry(step_cache.entry_path(str(tmp_path), other), other, b"aot",
                           {"step": b"step", "plan": {"sources": [], "arg_names": [], "output": 0}})
    with open(os.path.join(step_cache.steps_dir(str(tmp_path)), "junk.mrv2"), "wb") as f:
        f.write(b"not a pickle")
    assert cli_main(["cache", "ls", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 entries" in out and "m.M" in out and "mode full" in out and "unreadable" in out
    assert "torch x  loads through Dynamo" in out and "torch y  loads without Dynamo" in out
    assert cli_main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 3 entries" in capsys.readouterr().out
    assert step_cache.list_entries(str(tmp_path)) == []


def _engine(mode, debug_checks=False, cache_dir=None, **options):
    m = build_model("llama", preset("tiny", num_layers=2))
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[1, 4, 8], piece_compiler="eager",
                               debug_checks=debug_checks, cache_dir=cache_dir, **options)
    return Engine(m, kv_config(), cfg, "cpu", prefill_chunk=8, progress=False)


def test_runner_steps_skip_dynamo_after_the_first_compile(monkeypatch):
    """After its first compile the runner never enters Dynamo: no frame is
    evaluated, whatever size comes."""
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = _engine("piecewise")
        engine.runner.capture()
        assert engine.runner.compiled.how == "compiled"
        import torch._dynamo.convert_frame as convert_frame

        def no_frames(*a, **k):
            raise AssertionError("a runner step entered Dynamo's frame evaluation")

        monkeypatch.setattr(convert_frame, "_compile", no_frames)
        monkeypatch.setattr(convert_frame, "fullgraph_capture", no_frames)
        out = engine.generate(random_prompts([5, 17, 2]), 3)  # eager sizes and graph sizes
    assert len(out) == 3


def _compiled_runner(debug_checks):
    """A captured mode-none runner (its step compiled), and 4 tokens of its
    input buffers."""
    engine = _engine("none", debug_checks=debug_checks)
    engine.runner.capture()
    runner = engine.runner
    return runner, runner.input_buffers.input_ids[:4], runner.input_buffers.positions[:4]


def test_debug_checks_run_the_guards_and_name_a_changed_input_dtype():
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, ids, pos = _compiled_runner(debug_checks=True)
        with pytest.raises(RuntimeError, match="no longer fits this call .*dtype"):
            runner.compiled(ids.to(torch.int32), pos)
        with pytest.raises(RuntimeError, match="no longer fits this call"):
            runner.compiled(ids[None], pos)  # another rank
        quiet = _engine("none")
        quiet.runner.capture()
        assert quiet.runner.compiled.how == "compiled"  # no guard runs without debug_checks


def test_runner_steps_keep_no_guard_on_parameters_unless_debug_checks():
    """A runner's step drops Dynamo's guards on the model's parameters and
    buffers (its cache key holds what they checked): a parameter changed in
    dtype after the compile goes unchecked without debug_checks, and is named
    at the next call with them."""
    from compile_backend.compile.guard_free import guard_filter

    class Entry:
        def __init__(self, name, guard_type="TENSOR_MATCH", is_global=False):
            self.name, self.guard_type, self.is_global = name, guard_type, is_global

    entries = [Entry("L['self']._modules['layers']._modules['0']._parameters['weight']"),
               Entry("L['self']._modules['norm']._buffers['scale']"),
               Entry("L['input_ids']"), Entry("L['self'].eps", "CONSTANT_MATCH"),
               Entry("G['torch']", "ID_MATCH", is_global=True)]
    assert guard_filter(False)(entries) == [False, False, True, True, False]
    assert guard_filter(True)(entries) == [True, True, True, True, False]

    torch._dynamo.reset()
    for debug_checks in (False, True):
        with use_graph_backend(StandInGraphs()), torch.no_grad():
            runner, ids, pos = _compiled_runner(debug_checks)
            norm = next(p for n, p in runner.model.named_parameters() if "norm" in n)
            norm.data = norm.data.double()
            if debug_checks:
                with pytest.raises(RuntimeError, match="no longer fits this call .*norm"):
                    runner.compiled(ids, pos)
            else:
                assert runner.compiled._aot.guard_check(runner.model, ids, pos)


def _eager_reference(prompts, new_tokens):
    """An uncompiled-graph engine's tokens, and its weights (for the engine
    under test, whose model is built with other random weights)."""
    torch._dynamo.reset()
    ref = _engine("none")
    ref.runner.capture()
    return ref.generate(prompts, new_tokens), ref.runner.model.state_dict()


def test_a_step_saved_in_this_process_loads_for_a_new_runner(tmp_path, caplog):
    """Save, then load for a second runner (a new model object of the same
    code and state): no trace, tokens equal the first runner's and eager's."""
    prompts = random_prompts([5, 9, 3])
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        want, state = _eager_reference(prompts, 4)
        outs = []
        for _ in range(2):
            torch._dynamo.reset()
            cb.reset_counters()
            torch.manual_seed(0)
            engine = _engine("full_and_piecewise", cache_dir=str(tmp_path))
            engine.runner.model.load_state_dict(state)
            with caplog.at_level(logging.INFO):
                engine.runner.capture()
            outs.append((engine.runner.compiled.how, engine.generate(prompts, 4),
                         dict(cb.counters)))
    (how0, got0, c0), (how1, got1, c1) = outs
    assert (how0, how1) == ("compiled", "loaded")
    assert c1.get("dynamo_graphs", 0) == 0 and c1["steps_loaded"] == 1
    assert got0 == want and got1 == want
    assert any("loaded the compiled step" in r.message for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True], ids=["workers", "workers_fail"])
def test_inductor_pieces_compiled_by_workers_equal_eager_and_load_warm(tmp_path, fail):
    """Inductor pieces compiled in worker processes (compile/compile_workers.py)
    run as those compiled here: every step's logits and every KV cache equal
    eager, and a second process loads the saved step. Where every worker's
    job fails, the pieces it held compile here instead (counted)."""
    extra = ["--compiler", "inductor", "--compile-workers", "2", "--capture-warmup", "on_demand",
             "--min-fusible", "0"]  # every piece Inductor's (llama's hold nothing to fuse)
    cold, err = _worker(tmp_path, *extra, *(["--workers-fail"] if fail else []))
    counts = cold["counters"]
    assert cold["how"] == "compiled"
    assert (counts["piece_compiles"], counts["inductor_compiles"]) == (3, 3), counts
    if fail:
        # Every job went to a worker (the script keeps this process from
        # draining the queue) and failed there; the caller compiled all three.
        assert counts["compile_worker_fallbacks"] == 3 and "compile_worker_compiles" not in counts
        assert "was not compiled by a compile worker, compiling it here" in err
    else:
        assert counts["compile_worker_compiles"] >= 1, counts
        assert "compile_worker_fallbacks" not in counts, err[-3000:]
    warm, _ = _worker(tmp_path, *extra)
    assert warm["how"] == "loaded" and "inductor_compiles" not in warm["counters"]
    for run in (cold, warm):
        assert run["logits_equal"] and run["caches_equal"], run
        assert run["counters"]["cudagraph_replays"] > 0


@pytest.mark.slow  # full tier: two processes that trace (about 20 s on 2 cores)
def test_llama_pieces_run_as_traced_and_a_warm_start_loads_no_inductor(tmp_path):
    """The Inductor piece compiler on llama: every captured piece holds only
    views and mrv2's ops once the passes ran (compile/fusible.py), so none is
    compiled by Inductor, and the second process loads the step without
    Inductor's runtime; both equal eager (every step's logits, every cache)."""
    extra = ["--compiler", "inductor", "--compile-workers", "0", "--capture-warmup", "on_demand"]
    cold, _ = _worker(tmp_path, *extra)
    warm, _ = _worker(tmp_path, *extra)
    assert (cold["how"], warm["how"]) == ("compiled", "loaded")
    captured = cold["counters"]["piece_compiles"] + cold["counters"].get("piece_compile_reuses", 0)
    assert "inductor_compiles" not in cold["counters"], cold["counters"]
    assert cold["counters"]["pieces_without_inductor"] == captured, cold["counters"]
    assert cold["compiled_with"] == warm["compiled_with"] == ["eager"] * captured
    assert warm["inductor_runtime_loaded"] == [], warm
    assert warm["path"] == "direct" and warm["dynamo_importer"] in (None, STANDIN_MODE), warm
    for run in (cold, warm):
        assert run["logits_equal"] and run["caches_equal"], run


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", ["inductor", "traced"])
@pytest.mark.parametrize("mode,decode", [("full_and_piecewise", "default"),
                                         ("full_and_piecewise", "one_launch"),
                                         ("piecewise", "default")])
def test_a_warm_started_runner_replays_equal_eager_on_the_gpu(tmp_path, mode, decode, pieces):
    """On the GPU, with Inductor pieces: the second process loads the saved
    step (Inductor artifacts and all) without tracing, and its replays equal
    eager (every step's logits, every KV cache at the end). one_launch: every
    decode takes the one-launch form with split keys (at this model's few
    requests the two-launch form would run), so FULL decode graphs need the
    ticket counters that a warm start's captures once lacked. traced: llama's
    pieces run as traced under the Inductor piece compiler (its default)."""
    extra = ["--device", "cuda", "--compiler", "inductor", "--mode", mode,
             "--capture-sizes", "1,2,4,8,16", "--capture-warmup", "on_demand",
             *(["--min-fusible", "0"] if pieces == "inductor" else [])]
    env = {"MRV2_DECODE_TWO_LAUNCH": "0"} if decode == "one_launch" else {}
    cold, _ = _worker(tmp_path, *extra, env_extra=env)
    warm, _ = _worker(tmp_path, *extra, env_extra=env)
    assert (cold["how"], warm["how"]) == ("compiled", "loaded"), (cold, warm)
    assert warm["traced"] == {"fullgraph_capture": 0, "frames": 0}
    assert "inductor_compiles" not in warm["counters"]
    # Without Dynamo's code (compile/direct_step.py); Inductor's artifacts
    # import Dynamo, traced pieces do not.
    assert warm["path"] == "direct", warm
    assert warm["dynamo_imported"] == (pieces == "inductor"), warm
    assert set(cold["compiled_with"]) == set(warm["compiled_with"]) == \
        {"inductor" if pieces == "inductor" else "eager"}
    # The cold start's Triton kernels, listed beside the entry, load before the
    # warm start's first capture: no capture or warm-up of its plan asks Triton.
    assert warm["counters"].get("kernels_preloaded", 0) > 0, warm["counters"]
    assert warm["counters"].get("capture_waits", 0) == 0, warm["counters"]
    assert warm["counters"].get("triton_compiles", 0) == 0, warm["counters"]
    # The cold start recorded its first step's GEMMs; the warm start made
    # cuBLAS's first calls of them on a thread beside its load
    # (runtime/gemm_warmup.py), before its first capture.
    assert cold["capture_stats"]["gemms_recorded"] > 0, cold["capture_stats"]
    assert warm["capture_stats"]["gemm_warmup_calls"] > 0, warm["capture_stats"]
    assert warm["capture_stats"]["gemm_warmup_error"] is None, warm["capture_stats"]
    for run in (cold, warm):
        assert run["logits_equal"] and run["caches_equal"], run
        assert run["counters"]["cudagraph_replays"] > 0
        assert "decode_two_launch_fallbacks" not in run["counters"], run["counters"]


def test_without_aot_compile_steps_go_through_dynamo_and_say_so(monkeypatch, caplog):
    """Where AOT compile fails (or this torch lacks it), the runner serves
    through plain torch.compile with guards: logged once, counted, one Dynamo
    graph for every size (the token dimension stays symbolic), tokens equal
    eager."""
    import torch._dynamo.aot_compile as aot

    def refuse(*a, **k):
        raise RuntimeError("no AOT here")

    monkeypatch.setattr(aot, "aot_compile_fullgraph", refuse)
    prompts = random_prompts([5, 17, 2])
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        want, state = _eager_reference(prompts, 3)
        torch._dynamo.reset()
        cb.reset_counters()
        engine = _engine("piecewise", cache_dir=None)
        engine.runner.model.load_state_dict(state)
        with caplog.at_level(logging.WARNING):
            engine.runner.capture()
            got = engine.generate(prompts, 3)
    assert engine.runner.compiled.how == "guarded" and not engine.runner.compiled.ready
    assert cb.counters["guarded_fallbacks"] == 1 and cb.counters["dynamo_graphs"] == 1
    assert any("go through Dynamo's guards: aot_compile failed" in r.message for r in caplog.records)
    assert got == want


def test_a_loaded_step_writes_its_debug_dump_where_this_runner_says(tmp_path):
    """The key leaves out where dumps go: a loaded step writes the compile
    dump of this runner's debug_dump_path, and the runtime section says it
    was loaded."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        for name in ("first", "second"):
            torch._dynamo.reset()
            engine = _engine("piecewise", cache_dir=str(tmp_path / "cache"),
                             debug_dump_path=str(tmp_path / name))
            engine.runner.capture()
            engine.generate(random_prompts([4]), 2)
            cb.update_manifest_runtime(str(tmp_path / name), engine.runner)
    first, second = (cb.read_manifest(str(tmp_path / n)) for n in ("first", "second"))
    assert first["runtime"]["step"]["how"] == "compiled"
    assert second["runtime"]["step"]["how"] == "loaded"
    assert second["runtime"]["step"]["cache_entry"] == first["runtime"]["step"]["cache_entry"]
    # The first call's phases, in the order they ran: a compile (saved after
    # its first run, which shows how to call the step without Dynamo), then a
    # load without Dynamo (which never wraps with torch.compile).
    assert list(first["runtime"]["step"]["phases"]) == ["key", "wrap", "compile", "first_run", "save"]
    assert second["runtime"]["step"]["path"] == "direct"
    assert list(second["runtime"]["step"]["phases"]) == \
        ["key", "read", "resolve", "deserialize", "first_run"]
    assert all(v >= 0 for v in second["runtime"]["step"]["phases"].values())
    # The load's deserialize by part: mrv2's graph and pieces (no Dynamo on
    # this path); the parts are inside that phase. A compile has none.
    parts = second["runtime"]["step"]["load_parts"]
    assert set(parts) == {"step_graph", "step_pieces"} and parts["step_graph"] > 0
    assert sum(parts.values()) <= second["runtime"]["step"]["phases"]["deserialize"] + 3e-3  # rounding
    assert first["runtime"]["step"]["load_parts"] == {}
    assert len(second["graphs"]) == 1
    assert [p["captured"] for p in second["graphs"][0]["pieces"]] == \
        [p["captured"] for p in first["graphs"][0]["pieces"]]


def test_a_step_saves_on_the_c_pickler_and_what_only_dill_pickles_falls_back(caplog):
    """step_artifacts pickles with GraphPickler's reductions on Python's C
    pickler (GraphPickler itself extends dill's pure-Python one where dill is
    installed); a payload the C pickler refuses is saved by GraphPickler,
    counted and logged. Both load with GraphPickler.loads."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler, Options

    from compile_backend.compile import step_artifacts

    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2 + 1)
    bare = step_artifacts._bare(gm)
    cb.reset_counters()
    data = step_artifacts._dumps({"graph": bare, "n": 3}, Options(ops_filter=None))
    assert cb.counters["step_pickle_fallbacks"] == 0
    back = GraphPickler.loads(data, FakeTensorMode())
    back["graph"].recompile()  # as load_step does: the pickler restores graphs, not their code
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(7))
    assert back["n"] == 3 and torch.equal(back["graph"](x), gm(x))

    pytest.importorskip("dill")
    with caplog.at_level(logging.INFO, logger="compile_backend.compile.step_artifacts"):
        data = step_artifacts._dumps({"f": lambda v: v + 1}, Options(ops_filter=None))
    assert cb.counters["step_pickle_fallbacks"] == 1 and "GraphPickler's own pickler" in caplog.text
    assert GraphPickler.loads(data, FakeTensorMode())["f"](2) == 3
