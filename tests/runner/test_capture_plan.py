"""Capture plans that fit the configuration, and option problems found when
the config is built. Regressions: a capture size no batch can reach failed
inside capture (a dummy batch past max_model_len); capture_sizes=[] failed in
capture() with "max() arg is an empty sequence"; a debug_dump_path that is a
file was found only after compiling."""

import gc
import logging

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime.cuda_graph import CUDAGraphWrapper
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.debug.dump import DumpPathError
from compile_backend.runtime.graph_standin import StandInGraphs
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.demo.models import build_model, preset
from runtime_helpers import kv_config
from runtime_helpers import _torch_reference_kernels  # noqa: F401 (autouse fixture)

Mode = cb.CUDAGraphMode


def _runner(mode, capture_sizes, **kv):
    cfg = kv_config(**kv)
    model = build_model("hybrid", preset("tiny", num_layers=1))
    model.bind_caches(cfg.num_blocks, cfg.block_size, cfg.max_num_reqs, "cpu")
    config = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=capture_sizes,
                                  piece_compiler="eager")
    return ModelRunner(model, cfg, config, "cpu", progress=False)


def test_sizes_no_batch_can_reach_are_dropped_with_one_log_line(caplog):
    """4 requests of at most 8 tokens: no batch has more than 32 tokens,
    although max_num_tokens is 64."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        with caplog.at_level(logging.INFO, logger="compile_backend.runner.model_runner"):
            r = _runner("full_and_piecewise", [1, 2, 4, 8, 16, 32, 48, 64, 128], max_model_len=8)
        lines = [rec.getMessage() for rec in caplog.records if "dropped" in rec.getMessage()]
        assert lines == ["capture sizes [48, 64, 128] dropped: no batch has more than 32 tokens "
                         "(max_num_tokens=64, max_num_reqs=4 x max_model_len=8)"]
        assert r.capture_sizes == [1, 2, 4, 8, 16, 32] and r.decode_sizes == [1, 2, 4]
        assert max(s.num_tokens for s in r.capture_plan()) == 32
        records = r.capture()  # every dummy batch fits max_model_len
    assert len(records) == len(r.capture_plan()) == 6 + 3


@pytest.mark.parametrize("mode, sizes, kv, message", [
    ("piecewise", [], {},  # refused by the config already
     r"capture_sizes is empty: cudagraph_mode piecewise needs at least one token count to "
     r"capture \(for example \[1, 2, 4, 8\]\); or use cudagraph_mode='none'"),
    ("piecewise", [128], {"max_model_len": 8},
     r"cudagraph_mode piecewise has no graph to capture: no size in capture_sizes=\[128\] is at "
     r"most 32, the most tokens a batch holds \(min\(max_num_tokens=64, max_num_reqs=4 x "
     r"max_model_len=8\)\)\. Add such a size to capture_sizes, or use cudagraph_mode='none'"),
    ("full", [128, 256], {"max_num_tokens": 64},
     r"cudagraph_mode full has no graph to capture: no size in capture_sizes=\[128, 256\]"),
    ("full_and_piecewise", [16, 32], {"max_model_len": 2},
     r"is at most 8, the most tokens a batch holds \(min\(max_num_tokens=64, max_num_reqs=4 x "
     r"max_model_len=2\)\)"),
    ("full_decode_only", [8, 16], {},
     r"cudagraph_mode full_decode_only has no graph to capture: no size in capture_sizes="
     r"\[8, 16\] is at most max_num_reqs=4 \(its graphs hold one token per request; "
     r"max_num_tokens=64, max_model_len=64\)"),
])
def test_an_empty_plan_is_refused_when_the_runner_is_built(mode, sizes, kv, message):
    with use_graph_backend(StandInGraphs()):
        with pytest.raises(ValueError, match=message):
            _runner(mode, sizes, **kv)
    assert cb.counters["dynamo_graphs"] == 0  # before anything compiled


def test_mode_none_without_capture_sizes_warms_up_at_the_largest_batch():
    """It warms up at max_num_tokens capped to what a dummy batch can hold."""
    with torch.no_grad():
        r = _runner("none", [], max_model_len=8)  # 4 requests x 8 tokens < 64
        assert r.capture() == []
        assert r.model_state.build_log[-1]["num_tokens"] == 32
        out = r.execute(InputBatch([5, 6, 7], [2, 1], [2, 4], [0, 1], block_ids=[[1], [2]],
                                   compressed_block_ids=[[1], [2]]))
    assert out.shape[0] == 3 and torch.isfinite(out).all()


@pytest.mark.parametrize("build", [
    lambda path: cb.CompilationConfig(debug_dump_path=path),
    lambda path: cb.CompilationConfig.from_options({"debug_dump_path": path}),
])
def test_a_dump_path_that_is_a_file_is_refused_when_the_config_is_built(tmp_path, build):
    taken = tmp_path / "taken"
    taken.write_text("keep")
    with pytest.raises(DumpPathError, match="is an existing file; give a folder path"):
        build(str(taken))
    with pytest.raises(DumpPathError, match="is a file"):
        build(taken / "dump")
    assert taken.read_text() == "keep" and sorted(tmp_path.iterdir()) == [taken]
    assert build(tmp_path / "new" / "dump").debug_dump_path == str(tmp_path / "new" / "dump")
    assert sorted(tmp_path.iterdir()) == [taken]  # checking creates nothing


def test_an_op_name_of_the_wrong_form_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match="'state_mix' is not of the form 'namespace::name'"):
        cb.CompilationConfig(attention_like_ops=["state_mix"])


class _CountingGraphs(StandInGraphs):
    """The stand-in, counting synchronizes and cache emptyings, and whether the
    garbage collector was frozen at each capture."""

    def __init__(self):
        super().__init__()
        self.syncs = self.empties = self.stat_reads = 0
        self.frozen_at_capture: list[bool] = []

    def memory_allocated(self):
        self.stat_reads += 1
        return super().memory_allocated()

    def synchronize(self):
        self.syncs += 1

    def empty_cache(self):
        self.empties += 1

    def capture(self, graph, pool, args=()):
        self.frozen_at_capture.append(gc.get_freeze_count() > 0)
        return super().capture(graph, pool, args)


def test_a_plan_synchronizes_and_empties_the_cache_once_with_the_collector_frozen():
    """Capture speed (issue #21): per graph, a synchronize before and after
    and an emptied allocator cache made a plan of many graphs slow. A plan
    does each once at its start and end, with the garbage collector frozen
    meanwhile (and unfrozen after, also when a capture fails; a caller's own
    frozen objects are left frozen); a capture alone (lazy, late) still does
    them per graph."""
    graphs = _CountingGraphs()
    with use_graph_backend(graphs), torch.no_grad():
        r = _runner("full_and_piecewise", [1, 2, 4])
        r.capture()
        assert len(graphs.graphs) > len(r.capture_plan())  # PIECEWISE: a graph per piece
        assert graphs.frozen_at_capture and all(graphs.frozen_at_capture)
        assert (graphs.syncs, graphs.empties) == (2, 2)
        assert gc.get_freeze_count() == 0
        assert all(c.pool_bytes == 0 and c.seconds > 0 for c in r.captures)
        # The allocator's stats (50-100 µs of host time a read on a GPU) are read
        # before and after each graph of the plan, not for each piece of one.
        assert graphs.stat_reads == 2 * len(r.capture_plan())

        graphs.syncs = graphs.empties = graphs.stat_reads = 0
        w = CUDAGraphWrapper(lambda x: x * 2, Mode.PIECEWISE, name="alone")
        ctx = cb.ForwardContext(graph=cb.StepGraph(Mode.PIECEWISE, 4, 4))
        with cb.set_forward_context(ctx):
            w(torch.randn(4))  # a capture outside a plan
        assert (graphs.syncs, graphs.empties) == (2, 1)
        assert graphs.stat_reads == 2 and next(iter(w.entries.values())).pool_bytes == 0
        assert graphs.frozen_at_capture[-1] is False

        r2 = _runner("piecewise", [1, 2])
        gc.freeze()  # a caller's own frozen objects stay frozen
        try:
            r2.capture()
            assert gc.get_freeze_count() > 0  # not thawed by the plan
        finally:
            gc.unfreeze()

        def fail(*args):
            assert gc.get_freeze_count() > 0  # frozen by the plan
            raise RuntimeError("capture failed")
        r2._capture_one = fail
        with pytest.raises(RuntimeError, match="capture failed"):
            r2.capture()
        assert gc.get_freeze_count() == 0




def test_a_dead_cycle_made_before_the_first_step_is_collected_before_the_first_capture():
    """A dead reference cycle made before the runner's first step (a model
    dropped for this one) is collected before the plan's first capture, so
    the device memory it holds is not kept out of the graphs' pool and
    until Python's next full collection. The first step's frozen collector (core/frozen_gc.py)
    returns it to the oldest generation: a plan that collected only the
    young generations (tried: 0.2-0.3 s faster on the H200 host) kept it."""
    events: list[str] = []

    class Held:
        def __del__(self):
            events.append("freed")

    with use_graph_backend(_CountingGraphs()), torch.no_grad():
        r = _runner("piecewise", [1, 2])
        capture_one = r._capture_one

        def first_capture_noted(*args, **kwargs):
            if "capture" not in events:
                events.append("capture")
            return capture_one(*args, **kwargs)

        r._capture_one = first_capture_noted
        gc.collect()
        gc.disable()  # no automatic collection in between: only the step's and the plan's own
        try:
            cycle = [Held()]
            cycle.append(cycle)
            del cycle
            r.warmup(2)  # the first step: compiled under the frozen collector
            assert events == []  # still there (frozen, then returned to the oldest generation)
            r.capture()
        finally:
            gc.enable()
    assert events == ["freed", "capture"]
