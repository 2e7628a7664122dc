"""Capture is as strict on the CPU as on a GPU, and never hands out what it
recorded (CPU, graphs are the strict stand-in)."""

import logging

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime.cuda_graph import CUDAGraphWrapper
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runner.draft_runner import DraftRunner
from compile_backend.runtime.graph_standin import StandInGraphs
from compile_backend.testing import EagerMismatch, check_against_eager
from backend_models import TOY_OPTIONS, StatefulSDPA, ToyHybrid, plain_calls
from runtime_helpers import make_engine

EAGER = {"piece_compiler": "eager"}


@pytest.fixture
def torch_reference_kernels(monkeypatch):
    """The runner tests here are about capture, not kernels: ops take their
    torch references (the interpreted kernels have tests of their own)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_standin_capture_writes_nothing_and_poisons_new_outputs():
    state, counts = torch.randn(4), torch.arange(3)
    before = state.clone()

    def step(x):
        state.add_(x)  # a write the capture must not make
        return x * 2, x.to(torch.int64), state[:2]

    graphs = StandInGraphs()
    g = graphs.new_graph()
    x = torch.randn(4)
    with graphs.capture(g, graphs.pool(), (x,)):
        doubled, ints, view = step(x)

    class Entry:
        inputs, outputs = [x], (doubled, ints, view)

    graphs.after_capture(g, step, Entry, None)
    assert torch.equal(state, before)
    assert doubled.isnan().all()  # new memory: garbage, as on a GPU
    assert (ints == torch.iinfo(torch.int64).min).all()
    assert torch.equal(view, before[:2])  # aliases a tensor that predates capture: untouched
    g.replay()  # replay runs it: the write happens, the outputs are real
    torch.testing.assert_close(state, before + x)
    torch.testing.assert_close(doubled, x * 2)
    assert counts.tolist() == [0, 1, 2]


def test_standin_undoes_writes_of_ops_that_bypass_the_dispatcher_into_arguments():
    graphs = StandInGraphs()
    g = graphs.new_graph()
    buf = torch.randn(8)
    before = buf.clone()
    with graphs.capture(g, graphs.pool(), (buf,)):
        buf.numpy()[:] = 0  # no dispatcher: caught because buf is an argument
    assert torch.equal(buf, before)


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_and_piecewise"])
def test_plain_compile_of_a_stateful_model_equals_eager_every_call(mode):
    """Five calls per shape: warm-up, capture (returns the replay), replays."""
    with use_graph_backend(StandInGraphs()):
        report = check_against_eager(ToyHybrid(), plain_calls([6, 3], 5), [mode],
                                     options={**EAGER, **TOY_OPTIONS})
    assert report[mode].calls == 10
    assert report[mode].captures >= 2 and report[mode].replays > report[mode].captures


def test_plain_compile_full_captures_the_whole_graph_lazily():
    with use_graph_backend(StandInGraphs()):
        report = check_against_eager(StatefulSDPA(), plain_calls([6, 3], 5), ["full"],
                                     options=EAGER)
    step = cb.compiled_steps()[-1]
    assert step.full_graph is not None and step.full_blocker is None
    assert report["full"].captures == 2  # one FULL graph per shape, nothing else
    assert all(not w.entries for w in step.wrappers)  # the pieces' wrappers stay idle


def test_plain_compile_full_with_runner_metadata_ops_runs_piecewise_and_says_why(caplog):
    with use_graph_backend(StandInGraphs()), caplog.at_level(logging.WARNING):
        report = check_against_eager(ToyHybrid(), plain_calls([4], 3), ["full"],
                                     options={**EAGER, **TOY_OPTIONS})
    step = cb.compiled_steps()[-1]
    assert step.full_graph is None and "toy::" in step.full_blocker
    assert "its pieces run as PIECEWISE graphs" in step.full_blocker
    said = [r for r in caplog.records if "no FULL graph without a runner" in r.getMessage()]
    assert len(said) == 1 and cb.counters["full_graph_fallbacks"] == 1
    assert report["full"].captures == 2  # the two captured pieces


def test_returning_what_capture_recorded_is_caught(monkeypatch):
    """The check this helper exists for: with the old capture (outputs of the
    capturing call handed out, no replay), call 1 differs from eager."""

    def old_capture(self, key, args, ctx, own_pool=False):
        cuda_graph = self.graphs.new_graph()
        with self.graphs.capture(cuda_graph, object(), args):
            outputs = self.fn(*args)
        from compile_backend.runtime.cuda_graph import CapturedGraph

        entry = CapturedGraph(cuda_graph, list(args), tuple(
            (i, a.data_ptr()) for i, a in enumerate(args) if isinstance(a, torch.Tensor)), outputs)
        self._keep(key, entry)
        self.graphs.after_capture(cuda_graph, self.fn, entry, ctx)
        return outputs

    monkeypatch.setattr(CUDAGraphWrapper, "_capture", old_capture)
    with use_graph_backend(StandInGraphs()), pytest.raises(EagerMismatch, match=r"call 1 .*piecewise"):
        check_against_eager(ToyHybrid(), plain_calls([6], 3), ["piecewise"],
                            options={**EAGER, **TOY_OPTIONS})


def test_check_against_eager_wants_three_calls_per_shape():
    with pytest.raises(ValueError, match="fewer than 3 times"):
        check_against_eager(ToyHybrid(), plain_calls([6], 2), ["piecewise"])
    with pytest.raises(ValueError, match="unknown cudagraph mode"):
        check_against_eager(ToyHybrid(), plain_calls([6], 3), ["fast"])


def test_the_pytest_plugin_provides_the_helper(mrv2_check_against_eager):
    assert mrv2_check_against_eager is check_against_eager


def _bound_state(runner):
    """Every buffer of the model (KV caches, conv and compressor state), filled
    with random values so that a stray write shows."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _, b in runner.model.named_buffers():
            if b.dtype.is_floating_point:
                b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return {n: b.clone() for n, b in runner.model.named_buffers()}


@pytest.mark.parametrize("mode", [  # full_and_piecewise captures both kinds of graph
    pytest.param("piecewise", marks=pytest.mark.slow), pytest.param("full", marks=pytest.mark.slow),
    "full_and_piecewise"])
def test_capture_leaves_every_cache_and_state_unchanged(mode, torch_reference_kernels):
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner = make_engine(mode).runner
        before = _bound_state(runner)
        runner.capture()
        DraftRunner(runner, 2).capture()
        for name, b in runner.model.named_buffers():
            assert torch.equal(b, before[name]), f"{name} changed during capture"


def _decode_batch(engine):
    from compile_backend.runner.input_batch import InputBatch

    blocks = [engine.blocks.allocate(1) for _ in range(3)]
    cblocks = [engine.compressed_blocks.allocate(1) for _ in range(3)]
    return InputBatch([5, 6, 7], [1, 1, 1], [4, 2, 9], [0, 1, 2], block_ids=blocks,
                      compressed_block_ids=cblocks)


def test_draft_propose_refuses_an_uncaptured_size_and_writes_nothing(torch_reference_kernels):
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = make_engine("full")
        engine.runner.capture()
        draft = DraftRunner(engine.runner, 2)
        buffers = engine.runner.input_buffers
        before = buffers.input_ids.clone(), buffers.seq_lens.clone()
        with pytest.raises(RuntimeError, match=r"no draft graph for 4 requests x 2 draft tokens.*"
                                               r"captured: none.*DraftRunner.capture\(\)"):
            draft.propose(_decode_batch(engine))
        assert torch.equal(buffers.input_ids, before[0]) and torch.equal(buffers.seq_lens, before[1])
        draft.capture(sizes=[1, 2])
        with pytest.raises(RuntimeError, match=r"no draft graph for 4 requests.*captured: \[2, 1\] requests"):
            draft.propose(_decode_batch(engine))
        with pytest.raises(ValueError, match="not decode sizes"):
            draft.capture(sizes=[3])


def test_grad_enabled_runs_uncompiled_with_a_warning_that_names_the_fix():
    model = StatefulSDPA()
    compiled = torch.compile(model, backend="mrv2", options=EAGER)
    x = torch.randn(5, 16)
    with pytest.warns(UserWarning, match=r"torch.no_grad\(\) or torch.inference_mode\(\)"):
        out = compiled(x)
    assert out.requires_grad  # autograd still works: backward reaches the weights
    out.sum().backward()
    assert model.qkv.weight.grad is not None and cb.counters["grad_fallbacks"] == 1


class PositionInput(torch.nn.Module):
    """Takes a Python int that changes every call (as a decode position does)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.register_buffer("state", torch.randn(16))

    def forward(self, x, pos: int):
        self.state.add_(x.mean(0))
        h = torch.nn.functional.scaled_dot_product_attention(*(self.a(x).view(1, 1, -1, 16),) * 3)
        return h.view(-1, 16) * pos + self.state


def test_plain_compile_full_gives_up_the_whole_graph_when_an_int_input_changes(caplog):
    g = torch.Generator().manual_seed(2)
    calls = [(torch.randn(5, 16, generator=g), pos) for pos in range(3, 9)]
    with use_graph_backend(StandInGraphs()), caplog.at_level(logging.WARNING):
        report = check_against_eager(PositionInput(), calls, ["full"], options=EAGER)
    step = cb.compiled_steps()[-1]
    assert step.full_graph is None and "change between calls of one input shape" in step.full_blocker
    assert report["full"].replays > 0  # the pieces were captured instead


def test_the_shared_pool_is_renewed_once_its_backends_graphs_died():
    """A graph outliving its backend (Dynamo's cache holds wrappers, and with
    them graphs) keeps its own pool alive, not the next backend's: once that
    backend's graphs all died, its shared pool is taken anew. The stand-in's
    pools refuse a capture into a freed pool's handle, as the allocator does."""
    import gc

    from compile_backend.runtime.graph_pool import register_graph, shared_graph_pool

    def capture_one(graphs):
        g = graphs.new_graph()
        pool = shared_graph_pool(graphs, g)
        register_graph(g)  # as a wrapper's capture does
        with graphs.capture(g, pool):
            pass
        return g

    with use_graph_backend(StandInGraphs()) as first:
        outliving = capture_one(first)
    with use_graph_backend(StandInGraphs()) as second:
        for _ in range(2):  # the second capture comes after the first graph died
            capture_one(second)
            gc.collect()
    assert outliving is not None
