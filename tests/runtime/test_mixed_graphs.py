"""A FULL plan's mixed graphs made from its decode graphs
(CompilationConfig.derive_mixed_graphs; runtime/mixed_graphs.py,
runtime/graph_surgery.py, core/op_recording.py): each replay equals eager on
random mixed and decode schedules, several of them through one runner; an op
that cannot be recorded makes the plan record its mixed graphs, said and
counted. On the CPU the stand-in derives by running the step under the mixed
graph's metadata (what the derived CUDA graph does); the GPU test replays the
derived CUDA graphs themselves."""

import logging

import pytest
import torch

import compile_backend as cb
from compile_backend.core import op_recording
from compile_backend.debug.dump import update_manifest_runtime
from compile_backend.demo.engine import Engine
from compile_backend.demo.models import build_model, preset
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from compile_backend.runtime.mixed_graphs import MixedGraphs
from runtime_helpers import (CAPTURE_SIZES, _torch_reference_kernels, copy_batch,  # noqa: F401 (fixture)
                             kv_config, random_schedule)


def _engine(mode, derive, device="cpu", dtype=torch.float32, model="hybrid", sizes=CAPTURE_SIZES,
            kv=None):
    m = build_model(model, preset("tiny", num_layers=2, dtype=dtype))
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=sizes, piece_compiler="eager",
                               derive_mixed_graphs=derive)
    return Engine(m.to(device), kv or kv_config(), cfg, device, prefill_chunk=8, progress=False)


def _schedules_equal_eager(engines, seeds, atol, rtol):
    """Each step's logits and every buffer of each engine's model equal the
    eager engine's, after every step of every schedule."""
    ref = engines["none"]
    for seed in seeds:  # one runner, several schedules: request churn, new slots
        for step, batch in enumerate(random_schedule(seed, steps=12)):
            want = ref.runner.execute(copy_batch(batch)).clone()
            for name, e in engines.items():
                if e is ref:
                    continue
                got = e.runner.execute(copy_batch(batch))
                torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                                           msg=lambda s: f"{name}, seed {seed}, step {step}: {s}")
                # every KV cache, conv state and compressor state the step wrote
                ref_buffers = dict(ref.runner.model.named_buffers())
                for b_name, b in e.runner.model.named_buffers():
                    torch.testing.assert_close(
                        b, ref_buffers[b_name], atol=atol, rtol=rtol,
                        msg=lambda s: f"{name}, seed {seed}, step {step}, {b_name}: {s}")


def test_recordable_notes_each_call_once_with_its_range_and_aliases():
    calls = []

    def inner(x):
        calls.append("inner")
        return x + 1

    wrapped_inner = op_recording.recordable("t::inner", inner)

    def outer(x, scale=2.0):
        calls.append("outer")
        return wrapped_inner(x) * scale

    op = op_recording.recordable("t::outer", outer)
    ticks = iter(range(100))
    x = torch.randn(3)
    with op_recording.recording({"t::outer", "t::inner"}, lambda: next(ticks), lambda t: t[:]) as rec:
        y = op(x, scale=3.0)
    torch.testing.assert_close(y, (x + 1) * 3.0)
    assert [c.name for c in rec.calls] == ["t::outer"]  # the inner call is the outer's
    (call,) = rec.calls
    assert (call.first, call.end) == (0, 1) and call.kwargs == {"scale": 3.0}
    assert call.args[0] is not x and call.args[0].data_ptr() == x.data_ptr()
    assert op(x) is not None and len(calls) == 4  # no recorder: plain calls
    assert op_recording.all_recordable(["t::outer", "t::nobody"]) == ["t::nobody"]
    # a returned tensor: made again into the first call's result (`into`), or not repeatable
    twice = op_recording.recordable("t::twice", lambda v: v * 2,
                                    into=lambda out, v: torch.mul(v, 2, out=out))
    plain = op_recording.recordable("t::plain", lambda v: v * 2)
    with op_recording.recording({"t::twice", "t::plain"}, lambda: 0, lambda t: t) as rec:
        first = twice(x)
        plain(x)
    x.add_(1)
    again, lost = rec.calls
    assert again.repeatable and again.again() is first and torch.equal(first, x * 2)
    assert not lost.repeatable
    with pytest.raises(AssertionError, match="do not nest"):
        with op_recording.recording(set(), int, lambda t: t), \
                op_recording.recording(set(), int, lambda t: t):
            pass


LAYER_CALLS = {  # the layer-keyed ops a layer calls whose launches differ by form, in order
    # (rope_and_cache launches the same for every batch of a size: not recorded)
    "hybrid": ["mrv2::sconv", "mrv2::kv_compress", "mrv2::unified_attention"],
    "llama": ["mrv2::unified_attention"],
}


@pytest.mark.parametrize("model", ["hybrid", "llama"])
def test_derived_mixed_graphs_replay_equal_eager(model, monkeypatch):
    """Every decode size's mixed graph is derived (hybrid: attention, the
    short convolution and the KV compressor differ between the two), each
    from a recording of every layer's layer-keyed calls."""
    recorded, outs = [], []
    keep = MixedGraphs.keep
    monkeypatch.setattr(MixedGraphs, "keep", lambda self, graph, entry, calls: (
        recorded.append((graph.num_tokens, [c.name for c in calls])),
        outs.append([c.out is not None for c in calls]), keep(self, graph, entry, calls)))
    torch._dynamo.reset()
    cb.reset_counters()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engines = {"none": _engine("none", False, model=model),
                   "full": _engine("full", False, model=model),
                   "derived": _engine("full", True, model=model)}
        for e in engines.values():
            e.runner.capture()
        decode = engines["derived"].runner.decode_sizes
        assert cb.counters["mixed_graphs_derived"] == len(decode) > 0
        assert cb.counters["mixed_graph_refusals"] == 0
        assert recorded == [(s, LAYER_CALLS[model] * 2) for s in sorted(decode, reverse=True)]
        # sconv and kv_compress return their result: made again into its address
        assert all(o == [n != "mrv2::unified_attention" for n in LAYER_CALLS[model] * 2]
                   for o in outs)
        records = engines["derived"].runner.captures
        assert [r.graph for r in records if r.derived] == [
            r.graph for r in records if not r.graph.uniform_decode and r.graph.num_tokens in decode]
        plan = engines["derived"].runner.capture_plan()
        assert [g.num_tokens for g in plan] == sorted((g.num_tokens for g in plan), reverse=True)
        _schedules_equal_eager(engines, seeds=(3, 4), atol=1e-5, rtol=1e-5)
    assert cb.counters["cudagraph_replays"] > 20


@pytest.mark.parametrize("why, said", [("op", "mrv2::sconv"), ("graphs", "no graph API here")])
def test_what_cannot_be_derived_is_recorded_said_and_counted(why, said, monkeypatch, caplog,
                                                             tmp_path):
    """An op whose dispatcher path is not watched (its decode launches would
    stay), or a torch / driver without the graph API: the mixed graphs are
    recorded as before, and the debug dump says so."""
    if why == "op":
        monkeypatch.setattr(op_recording, "_RECORDABLE", op_recording._RECORDABLE - {"mrv2::sconv"})
    else:
        monkeypatch.setattr(StandInGraphs, "can_derive", lambda self: "no graph API here")
    torch._dynamo.reset()
    cb.reset_counters()
    with use_graph_backend(StandInGraphs()), torch.no_grad(), \
            caplog.at_level(logging.INFO, logger="compile_backend.runtime.mixed_graphs"):
        engines = {"none": _engine("none", False), "derived": _engine("full", True)}
        for e in engines.values():
            e.runner.capture()
        n = len(engines["derived"].runner.decode_sizes)
        assert cb.counters["mixed_graphs_derived"] == 0
        assert cb.counters["mixed_graph_refusals"] == n
        refusals = engines["derived"].runner.full_graph.mixed.refusals
        assert list(refusals.values()) == [n] and said in next(iter(refusals))
        lines = [r.getMessage() for r in caplog.records if "not derived" in r.getMessage()]
        assert len(lines) == 1 and said in lines[0]
        manifest = update_manifest_runtime(tmp_path, engines["derived"].runner)
        (shown,) = [f for f in manifest["fallbacks"] if f["kind"] == "mixed_graph_recorded"]
        assert shown["count"] == n and said in shown["reason"]
        _schedules_equal_eager(engines, seeds=(5,), atol=1e-5, rtol=1e-5)


def test_a_derived_graph_goes_with_its_source():
    """A decode graph evicted (graphs_per_shape) takes the graphs made from it:
    they address its memory."""
    from compile_backend.core.graph_mode import CUDAGraphMode
    from compile_backend.runtime.cuda_graph import CapturedGraph, CUDAGraphWrapper

    graphs = StandInGraphs()
    w = CUDAGraphWrapper(lambda: None, CUDAGraphMode.FULL, graphs=graphs, graphs_per_shape=1,
                         derive_mixed=True)

    def entry(graph):
        return CapturedGraph(cuda_graph=graph, inputs=[], tensor_ptrs=(), outputs=None)

    source, other = entry(graphs.new_graph()), entry(graphs.new_graph())
    w._keep("decode", source)
    w._keep("mixed", entry(graphs.derive(source.cuda_graph, graphs.new_graph(), [])))
    w._keep("unrelated", other)
    w._keep("decode", entry(graphs.new_graph()))  # evicts the source
    assert "mixed" not in w.entries and "mixed" not in w.variants
    assert w.entries["unrelated"] is other and w.entries["decode"] is not source


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["hybrid", "llama"])
def test_derived_mixed_cuda_graphs_replay_equal_eager_on_the_gpu(model):
    """The derived CUDA graphs themselves (clone, child graphs, instantiate),
    fp32 through the Triton kernels, against eager and against recorded
    mixed graphs, on random schedules through one runner."""
    torch._dynamo.reset()
    cb.reset_counters()
    kv = KVCacheConfig(num_blocks=256, block_size=16, max_model_len=256, max_num_reqs=8,
                       max_num_tokens=64)
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    with torch.no_grad():
        engines = {"none": _engine("none", False, "cuda", model=model, sizes=sizes, kv=kv),
                   "full": _engine("full", False, "cuda", model=model, sizes=sizes, kv=kv),
                   "derived": _engine("full", True, "cuda", model=model, sizes=sizes, kv=kv)}
        for e in engines.values():
            e.runner.capture()
        refusals = engines["derived"].runner.full_graph.mixed.refusals
        assert refusals == {}, refusals
        assert cb.counters["mixed_graphs_derived"] == len(engines["derived"].runner.decode_sizes)
        _schedules_equal_eager(engines, seeds=(3, 4, 5), atol=2e-4, rtol=2e-4)


class _FakeDriver:
    """Graphs as lists of [type, launch] nodes; what graph_surgery.derive asks of the driver."""

    def __init__(self, graphs):
        self.graphs, self.destroyed, self.plain = graphs, [], []

    def nodes(self, g):
        return [(g, i) for i in range(len(self.graphs[g]))]

    def node_type(self, node):
        return self.graphs[node[0]][node[1]][0]

    def clone(self, g):
        self.graphs["clone"] = [list(n) for n in self.graphs[g]]
        return "clone"

    def in_clone(self, node, clone):
        return (clone, node[1])

    def take_launch(self, g, node, other):
        self.graphs[g][node[1]][1] = self.graphs[other[0]][other[1]][1]
        self.plain.append(node[1])

    def instantiate(self, g):
        return "exec"

    def destroy(self, g, e):
        self.destroyed.append((g, e))


class _Raw:
    def __init__(self, name):
        self.name = name

    def raw_cuda_graph(self):
        return self.name


def test_derive_pairs_launches_one_for_one_and_refuses_what_does_not_pair(monkeypatch):
    """runtime/graph_surgery.derive against a model of the driver (the GPU
    test and bench/graph_surgery.py run the real one)."""
    from compile_backend.runtime import graph_surgery

    K = 0  # a kernel node
    fake = _FakeDriver({"decode": [[K, "norm"], [K, "split"], [K, "reduce"], [K, "o"]],
                        "side": [[K, "prefill"], [K, "pad"]]})
    monkeypatch.setattr(graph_surgery, "_driver", fake)
    made = graph_surgery.derive(_Raw("decode"), _Raw("side"), [(1, 3, 0, 2)])
    assert [n[1] for n in fake.graphs["clone"]] == ["norm", "prefill", "pad", "o"]
    assert [n[1] for n in fake.graphs["decode"]] == ["norm", "split", "reduce", "o"]  # a clone's
    assert fake.plain == [1, 2] and made.exec_ == "exec"
    made.keep = []
    made.graph = made.exec_ = 0  # nothing real to destroy
    for pairs, kinds in (([(1, 3, 0, 1)], None), ([(3, 5, 0, 2)], None), ([(1, 3, 0, 2)], 1)):
        if kinds is not None:
            fake.graphs["side"][0][0] = kinds  # a memcpy node, say
        with pytest.raises(graph_surgery.GraphSurgeryError):
            graph_surgery.derive(_Raw("decode"), _Raw("side"), pairs)
        assert fake.destroyed[-1] == ("clone", 0)  # the clone is not left behind


KERNEL_PATHS = ["reference", pytest.param("triton", marks=pytest.mark.interpreted_kernels)]


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_sconv_into_writes_the_op_result_into_the_tensor_given(path):
    """What a derived graph's side capture runs for an op that returns a
    tensor: the same result and state update as the op, written into `out`."""
    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from compile_backend.runner.attention_metadata import SConvMetadata

    g = torch.Generator().manual_seed(41)
    C, K = 6, 4
    meta = SConvMetadata(query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
                         state_indices=torch.tensor([1, 0], dtype=torch.int32),
                         has_initial_state=torch.tensor([True, False]), num_reqs=2, max_query_len=3)
    x, w, b = torch.randn(4, C, generator=g), torch.randn(C, K, generator=g), torch.randn(C, generator=g)
    state = torch.randn(2, C, K - 1, generator=g)
    state_op, state_into = state.clone(), state.clone()
    out = torch.full((4, C), float("nan"))
    with set_forward_context(ForwardContext({"l0": meta})):
        want = torch.ops.mrv2.sconv(x, w, b, state_op, "l0")
        got = op_recording._INTO["mrv2::sconv"](out, x, w, b, state_into, "l0")
    assert got is out and torch.equal(out, want)
    assert torch.equal(state_into, state_op) and not torch.equal(state_op, state)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kv_compress_into_writes_the_op_result_into_the_tensor_given(path):
    """kv_compress's `into`: the op's result, compressed cache and running
    state, with the result written into `out` (the launcher's `out=` under
    the interpreter). Requests start mid-group, cross a group end and carry
    state; ratio 4 so every request emits at least one compressed entry."""
    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from compile_backend.runner.attention_metadata import CompressorMetadata

    g = torch.Generator().manual_seed(43)
    T, KVH, D, ratio = 9, 2, 16, 4
    # request 0: positions 2..6 (5 tokens), request 1: 8..11, request 2: padding
    meta = CompressorMetadata(query_start_loc=torch.tensor([0, 5, 9, 9], dtype=torch.int32),
                              seq_lens=torch.tensor([7, 12, 0], dtype=torch.int32),
                              state_indices=torch.tensor([2, 0, -1], dtype=torch.int32),
                              block_table=torch.tensor([[3, 1], [2, 0], [0, 0]], dtype=torch.int32),
                              num_reqs=3, max_query_len=5)
    key, score = torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, generator=g)
    tensors = {"cache": torch.randn(4, 2, KVH, D, generator=g),
               "max": torch.randn(3, KVH, generator=g), "sum": torch.rand(3, KVH, generator=g) + 0.5,
               "acc": torch.randn(3, KVH, D, generator=g)}
    by_op = {k: v.clone() for k, v in tensors.items()}
    by_into = {k: v.clone() for k, v in tensors.items()}
    out = torch.full((T, KVH, D), float("nan"))

    def state(t):
        return t["cache"], t["max"], t["sum"], t["acc"]

    with set_forward_context(ForwardContext({"l0": meta})):
        want = torch.ops.mrv2.kv_compress(key, score, *state(by_op), "l0", ratio)
        got = op_recording._INTO["mrv2::kv_compress"](out, key, score, *state(by_into), "l0",
                                                      ratio)
    assert got is out and torch.equal(out, want)
    for name in tensors:
        assert torch.equal(by_into[name], by_op[name]), name
    assert not torch.equal(by_op["cache"], tensors["cache"])  # a group ended: an entry written


def test_a_side_pool_is_renewed_once_its_graphs_died():
    """The allocator frees a pool with its last graph (the stand-in, like
    torch, then refuses a capture into its handle); ReusedPool takes a new
    handle then, and shares the old one while a graph captured into it lives."""
    import gc

    from compile_backend.runtime.graph_pool import ReusedPool

    graphs = StandInGraphs()
    pool = ReusedPool(graphs)
    kept = []
    for _ in range(2):
        g = graphs.new_graph()
        with graphs.capture(g, pool.for_capture(g)):
            pass
        kept.append(g)
    first = pool.handle
    del g, kept[:]
    gc.collect()
    late = graphs.new_graph()
    with pytest.raises(RuntimeError, match="whose graphs have all died"):
        with graphs.capture(late, first):
            pass
    with graphs.capture(late, pool.for_capture(late)):
        pass
    assert pool.handle is not first


def test_a_refused_size_leaves_the_next_sizes_derivable(monkeypatch):
    """The largest size's derivation fails after its side capture (whose
    graph then dies, and with it the side pool's only graph): that size's
    mixed graph is recorded and every smaller size is still derived."""
    calls = []
    derive = StandInGraphs.derive

    def failing_first(self, source, side, pairs):
        calls.append(len(pairs))
        if len(calls) == 1:
            raise RuntimeError("nodes that do not pair")
        return derive(self, source, side, pairs)

    monkeypatch.setattr(StandInGraphs, "derive", failing_first)
    torch._dynamo.reset()
    cb.reset_counters()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engines = {"none": _engine("none", False), "derived": _engine("full", True)}
        for e in engines.values():
            e.runner.capture()
        decode = engines["derived"].runner.decode_sizes
        assert len(calls) == len(decode) > 1
        assert cb.counters["mixed_graph_refusals"] == 1
        assert cb.counters["mixed_graphs_derived"] == len(decode) - 1
        _schedules_equal_eager(engines, seeds=(6,), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only"])
def test_modes_without_full_mixed_graphs_record_no_source(mode):
    """Where mixed batches do not replay FULL graphs, the switch changes
    nothing: no decode graph is recorded as a source, none is derived."""
    torch._dynamo.reset()
    cb.reset_counters()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engines = {"none": _engine("none", False), mode: _engine(mode, True)}
        for e in engines.values():
            e.runner.capture()
        assert engines[mode].runner.full_graph.mixed is None
        assert cb.counters["mixed_graphs_derived"] == cb.counters["mixed_graph_refusals"] == 0
        _schedules_equal_eager(engines, seeds=(7,), atol=1e-5, rtol=1e-5)
