"""The CUDA-graph runtime on the CPU: everything but real replay (graphs are
the stand-in of graph_standin.py, which replays with capture-time state)."""

import math

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime.cuda_graph import CUDAGraphWrapper
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runner.input_batch import InputBatch
from compile_backend.core.graph_mode import CaptureSupport, StepGraph, lower_graph_mode
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import (CAPTURE_SIZES, _torch_reference_kernels, copy_batch, generate,  # noqa: F401 (fixture)
                             make_engine, random_prompts, random_schedule)

Mode = cb.CUDAGraphMode


# ---- dummy batches -----------------------------------------------------------


def test_dummy_batch_of_256_requests_and_496_tokens_stays_within_max_model_len():
    """Regression: the upstream dummy batch gave the last request the whole
    remainder (496 - 255 = 241 tokens), past max_model_len."""
    b = InputBatch.make_dummy(256, 496, max_model_len=2)
    assert sum(b.query_lens) == 496 and b.num_reqs == 256
    assert max(b.query_lens) == 2 == math.ceil(496 / 256)
    assert all(s <= 2 for s in b.seq_lens)


@pytest.mark.parametrize("reqs,tokens", [(1, 1), (3, 10), (7, 64), (64, 64), (5, 256), (256, 257)])
def test_dummy_batch_invariants(reqs, tokens):
    b = InputBatch.make_dummy(reqs, tokens, max_model_len=1024)
    assert sum(b.query_lens) == tokens and len(b.query_lens) == reqs
    assert max(b.query_lens) <= math.ceil(tokens / reqs)
    assert all(q >= 1 for q in b.query_lens)
    assert b.req_slots == [-1] * reqs  # capture touches no request's state
    assert all(ids and set(ids) == {0} for ids in b.block_ids)  # null block only


def test_dummy_batch_that_cannot_fit_raises_with_fix():
    with pytest.raises(ValueError, match="more than max_model_len=4"):
        InputBatch.make_dummy(2, 64, max_model_len=4)


# ---- metadata at every capture ----------------------------------------------------


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_and_piecewise", "full_decode_only"])
def test_metadata_is_built_at_every_capture_with_the_right_for_capture(mode):
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = make_engine(mode)
        trace = []
        captures = engine.runner.capture(trace)
    assert captures, "nothing captured"
    for rec in captures:
        want = rec.graph.mode is cb.CUDAGraphMode.FULL
        assert rec.for_capture == {"attention": want, "sconv": want, "compressor": want}, rec
    # attention-like ops ran *during* capture (piecewise and full) with metadata
    captured_events = {e for _, e in trace if e.endswith("@capture")}
    assert {"sconv@capture", "kv_compress@capture"} <= captured_events
    full = [r for r in captures if r.graph.mode is cb.CUDAGraphMode.FULL]
    if full:  # in FULL graphs the attention breakpoint is captured too
        assert "unified_attention@capture" in captured_events
    else:
        assert "unified_attention@capture" not in captured_events


def test_piecewise_capture_that_skips_metadata_fails(monkeypatch):
    """Regression (the seed's bug): PIECEWISE capture once skipped metadata;
    attention-like ops inside the piecewise graphs then cannot run at capture."""
    from compile_backend.runner.model_state import ModelState

    real = ModelState.prepare_attn

    def skip_when_piecewise(self, batch):
        if batch.is_dummy and not batch.graph.for_capture:
            return {}
        return real(self, batch)

    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = make_engine("piecewise")
        monkeypatch.setattr(ModelState, "prepare_attn", skip_when_piecewise)
        with pytest.raises(Exception, match="no attention metadata for layer"):
            engine.runner.capture()


# ---- mode lowering --------------------------------------------------------------


class _Builder:
    def __init__(self, kind, support, attention_like=False):
        self.kind, self.capture_support, self.attention_like = kind, support, attention_like


@pytest.mark.parametrize(
    "requested, support, expected",
    [
        (Mode.FULL, CaptureSupport.ALWAYS, Mode.FULL),
        (Mode.FULL, CaptureSupport.UNIFORM_BATCH, Mode.FULL_AND_PIECEWISE),
        (Mode.FULL, CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE, Mode.FULL_AND_PIECEWISE),
        (Mode.FULL, CaptureSupport.NEVER, Mode.PIECEWISE),
        (Mode.FULL_AND_PIECEWISE, CaptureSupport.NEVER, Mode.PIECEWISE),
        (Mode.FULL_DECODE_ONLY, CaptureSupport.NEVER, Mode.NONE),
        (Mode.FULL_DECODE_ONLY, CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE, Mode.FULL_DECODE_ONLY),
        (Mode.PIECEWISE, CaptureSupport.NEVER, Mode.PIECEWISE),
    ],
)
def test_mode_is_lowered_to_what_every_builder_supports(requested, support, expected):
    builders = [_Builder("attention", support), _Builder("sconv", CaptureSupport.ALWAYS, True)]
    mode, reason = lower_graph_mode(requested, builders)
    assert mode is expected
    assert (reason is None) == (mode is requested)
    if reason:
        assert support.name in reason and "'attention'" in reason


def test_attention_like_builder_must_always_be_capturable():
    with pytest.raises(ValueError, match="must build capturable metadata always"):
        lower_graph_mode(Mode.PIECEWISE, [_Builder("sconv", CaptureSupport.UNIFORM_BATCH, True)])


# ---- dispatch and padding ------------------------------------------------------


def _batch(qlens, ctx=0):
    ids = [1] * sum(qlens)
    return InputBatch(ids, list(qlens), [q + ctx for q in qlens], list(range(len(qlens))),
                      block_ids=[[1, 2, 3, 4]] * len(qlens),
                      compressed_block_ids=[[1]] * len(qlens))


@pytest.mark.parametrize(
    "mode, qlens, expected",
    [
        ("full_and_piecewise", [1, 1, 1], StepGraph(Mode.FULL, 4, 4, uniform_decode=True)),
        ("full_and_piecewise", [5, 1], StepGraph(Mode.PIECEWISE, 8, 4)),
        ("piecewise", [1, 1, 1], StepGraph(Mode.PIECEWISE, 4, 4)),
        ("full", [3, 9], StepGraph(Mode.FULL, 16, 4)),
        ("full", [1], StepGraph(Mode.FULL, 1, 1, uniform_decode=True)),
        ("full_decode_only", [2, 1], StepGraph.eager(3, 2)),
        ("piecewise", [20, 20], StepGraph.eager(40, 2)),  # larger than every size
    ],
)
def test_dispatch_pads_to_the_nearest_capture_size(mode, qlens, expected):
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()):
        engine = make_engine(mode, max_num_tokens=40)
        runner = engine.runner
        runner.plan = cb.GraphPlan(runner.mode, [s for s in CAPTURE_SIZES if s <= 32], 4)
        runner.captured = True
        assert runner.dispatch(_batch(qlens)) == expected
    if expected.mode is Mode.NONE and sum(qlens) > 32:
        assert cb.counters["eager_no_graph"] == 1
    if mode == "full_decode_only" and expected.mode is Mode.NONE:
        assert cb.counters["eager_mixed_batch"] == 1


def test_padded_buffers_follow_the_padding_convention():
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()):
        engine = make_engine("piecewise")
    runner = engine.runner
    batch = _batch([3, 1], ctx=5).pad_to(StepGraph.eager(8, 4))
    runner.model_state.write(batch)
    slots = runner.block_tables.slot_mapping[:8]
    buf = runner.input_buffers
    assert buf.query_start_loc[:5].tolist() == [0, 3, 4, 4, 4]
    assert buf.seq_lens[:4].tolist() == [8, 6, 0, 0]
    assert buf.state_indices[:4].tolist() == [0, 1, -1, -1]
    assert buf.positions[:8].tolist() == [5, 6, 7, 5, 0, 0, 0, 0]
    assert slots[4:].tolist() == [-1] * 4
    assert runner.block_tables.block_table[2:4].abs().sum().item() == 0  # null block


# ---- numerics through the stand-in, all modes ------------------------------------------


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_and_piecewise", "full_decode_only"])
def test_tokens_equal_eager_with_state_carried_across_steps(mode):
    _tokens_equal_eager(mode)


@pytest.mark.slow
@pytest.mark.interpreted_kernels
def test_tokens_equal_eager_through_the_triton_kernels():
    """The same through Triton's interpreter on the CPU (the kernels the GPU runs)."""
    _tokens_equal_eager("full_and_piecewise", [5, 12, 3], max_new_tokens=3)


def _tokens_equal_eager(mode, lengths=(5, 12, 3, 20, 9), max_new_tokens=6):
    prompts = random_prompts(lengths)
    ref, _ = generate("none", prompts, max_new_tokens)
    cb.reset_counters()
    out, engine = generate(mode, prompts, max_new_tokens)
    assert out == ref
    assert cb.counters["cudagraph_replays"] > 0
    # Every graph reads its inputs where they were at capture: the attention
    # output is allocated in the piece before (an out-parameter), so a replay
    # copies nothing in.
    assert cb.counters["replay_input_copies"] == 0
    assert cb.counters["dynamo_graphs"] == 1
    assert engine.stats.steps > 3


def test_minimum_pieces_for_the_hybrid_model():
    """attention + sconv + compressor per layer: 2 layers -> 2 eager + 3 captured."""
    generate("piecewise", random_prompts([4]), max_new_tokens=1)
    step = cb.compiled_steps()[-1]
    assert [p.captured for p in step.pieces] == [True, False, True, False, True]
    for p in step.pieces:
        if p.captured:
            assert not p.breakpoints
        else:
            assert p.breakpoints == ["mrv2::unified_attention"]  # one eager call per layer
    captured = [p for p in step.pieces if p.captured]
    assert sum(p.attention_like.count("mrv2::sconv") for p in captured) == 2
    # the KV write (with rotary) runs inside the piece before its layer's attention
    assert [p.attention_like.count("mrv2::rope_and_cache") for p in captured] == [1, 1, 0]


# ---- address checks ------------------------------------------------------------------


def test_debug_checks_catch_a_moved_persistent_metadata_tensor():
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = make_engine("piecewise", debug_checks=True)
        engine.runner.capture()
        prompts = random_prompts([3])
        engine.generate(prompts, 2)  # fine while nothing moves
        buf = engine.runner.input_buffers
        buf.state_indices = buf.state_indices.clone()  # a builder now hands out a new tensor
        with pytest.raises(RuntimeError, match=r"state_indices moved since capture"):
            engine.generate(prompts, 2)


def test_debug_checks_catch_a_moved_stable_input_and_copy_others():
    graphs = StandInGraphs()
    with use_graph_backend(graphs):
        weight = torch.randn(4)
        w = CUDAGraphWrapper(lambda x, wt: x * wt, Mode.PIECEWISE, name="piece",
                             debug_checks=True, stable_inputs=[1], input_names=["x", "weight"],
                             written_inputs=())
        ctx = cb.ForwardContext(graph=cb.StepGraph(Mode.PIECEWISE, 4, 4))
        with cb.set_forward_context(ctx):
            x0 = torch.randn(4)
            x0_before = x0.clone()
            w(x0, weight)  # capture
            x1 = torch.randn(4)  # new address: a graph reading a private buffer
            torch.testing.assert_close(w(x1, weight), x1 * weight)
            assert cb.counters["address_captures"] == 1
            x2 = torch.randn(4)  # copied into that buffer: no capture
            torch.testing.assert_close(w(x2, weight), x2 * weight)
            assert cb.counters["address_captures"] == 1
            assert cb.counters["replay_input_copies"] == 2
            assert torch.equal(x0, x0_before)  # the caller's old tensor is never written
            with pytest.raises(RuntimeError, match=r"input 1 \(weight\) moved since capture"):
                w(x1, weight.clone())


def test_a_capture_has_its_own_plan_dict_and_leaves_the_context_as_it_was():
    """While the wrapper captures, the forward context says so and holds that
    capture's own (empty) attention plan dict (Note [attention plans] in
    compile_backend/kernels/attention_plan.py); afterwards it is as before,
    also for a capture inside another's (an outer capture keeps its own dict)."""
    seen = []

    def piece(x):
        ctx = cb.get_forward_context()
        seen.append((ctx.capturing, ctx.capture_plans))
        if ctx.capture_plans is not None:
            ctx.capture_plans["made here"] = True
        return x * 2

    with use_graph_backend(StandInGraphs()):
        w = CUDAGraphWrapper(piece, Mode.PIECEWISE, name="piece", written_inputs=())
        ctx = cb.ForwardContext(graph=cb.StepGraph(Mode.PIECEWISE, 4, 4))
        with cb.set_forward_context(ctx):
            w(torch.randn(4))  # capture
            assert (ctx.capturing, ctx.capture_plans) == (False, None)
            outer = {"outer's": True}
            ctx.capturing, ctx.capture_plans = True, outer
            w2 = CUDAGraphWrapper(piece, Mode.PIECEWISE, name="inner", written_inputs=())
            w2(torch.randn(4))
            assert ctx.capturing is True and ctx.capture_plans is outer
            assert outer == {"outer's": True}
    captured = [(c, p) for c, p in seen if c]
    assert len(captured) == 2 and all(p == {"made here": True} for _, p in captured)
    assert captured[0][1] is not captured[1][1]


def test_plain_torch_compile_captures_lazily_on_the_second_call():
    """No runner: the first call of a shape warms up, the second captures, the third replays."""
    import copy

    from backend_models import TOY_OPTIONS, ToyHybrid

    model = ToyHybrid()
    eager = copy.deepcopy(model)
    graphs = StandInGraphs()
    with use_graph_backend(graphs), torch.no_grad():
        f = torch.compile(model, backend="mrv2",
                          options={"piece_compiler": "eager", "cudagraph_mode": "piecewise",
                                   **TOY_OPTIONS})
        for i in range(4):
            x = torch.randn(6, 16)
            torch.testing.assert_close(f(x), eager(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.state, eager.state)
    assert cb.counters["lazy_warmups"] == 2  # two captured pieces
    assert cb.counters["cudagraph_captures"] == 2
    # the capturing call replays once (its outputs come from that replay), then calls 3 and 4
    assert cb.counters["cudagraph_replays"] == 2 + 4


def test_released_graphs_are_captured_again_on_the_next_call():
    """release_graphs frees every graph (they outlive runners and
    torch._dynamo.reset()); a compiled model keeps working: each piece
    captures again on its next call (lazily captured graphs have pools of their own)."""
    import copy

    from backend_models import TOY_OPTIONS, ToyHybrid

    from compile_backend.runtime import graph_pool

    cb.release_graphs()  # earlier tests' graphs
    model = ToyHybrid()
    eager = copy.deepcopy(model)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        f = torch.compile(model, backend="mrv2",
                          options={"piece_compiler": "eager", "cudagraph_mode": "piecewise",
                                   **TOY_OPTIONS})
        for _ in range(3):  # warm up, capture, replay
            x = torch.randn(6, 16)
            torch.testing.assert_close(f(x), eager(x), atol=1e-5, rtol=1e-5)
        assert cb.counters["cudagraph_captures"] == 2
        assert cb.release_graphs() == 2
        assert not graph_pool._pool_graphs and graph_pool._shared is None
        for _ in range(2):  # the shape is warm: capture, then replay
            x = torch.randn(6, 16)
            torch.testing.assert_close(f(x), eager(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.state, eager.state)
        assert cb.counters["cudagraph_captures"] == 4


def test_debug_checks_through_the_backend_name_a_moved_parameter():
    """The backend marks parameters and buffers as stable inputs of each piece."""
    from backend_models import TOY_OPTIONS, ToyHybrid

    model = ToyHybrid()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        f = torch.compile(model, backend="mrv2", options={
            "piece_compiler": "eager", "debug_checks": True, **TOY_OPTIONS})
        x = torch.randn(4, 16)
        for _ in range(3):  # warm-up, capture, replay
            f(x)
        wrapper = cb.compiled_steps()[-1].wrappers[0]
        assert [wrapper.input_names[i] for i in sorted(wrapper.stable_inputs)] == [
            "l_self_modules_a_parameters_weight_", "l_self_modules_a_parameters_bias_"]
        model.a.weight.data = model.a.weight.data.clone()  # same Parameter, new memory
        with pytest.raises(RuntimeError, match=r"l_self_modules_a_parameters_weight_\) moved"):
            f(x)


@pytest.mark.parametrize("seed", [
    pytest.param(0, marks=[pytest.mark.interpreted_kernels, pytest.mark.slow]),  # the Triton kernels, interpreted
    1, pytest.param(2, marks=pytest.mark.slow)])
def test_random_schedules_replay_equal_eager_in_every_mode(seed):
    """Fresh random batches (sizes, prefill/decode mix, request churn): every
    mode's logits equal eager's at every step (fp32, same kernels). Through
    the Triton kernels this catches Python ints baked at capture that a replay
    outgrows (e.g. an attention-like builder handing out an exact
    max_query_len instead of the padded size's bound)."""
    modes = ["piecewise", "full", "full_and_piecewise", "full_decode_only"]
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engines = {m: make_engine(m) for m in ["none"] + modes}
        for e in engines.values():
            e.runner.capture()
        for step, batch in enumerate(random_schedule(seed)):
            ref = engines["none"].runner.execute(copy_batch(batch)).clone()
            for m in modes:
                out = engines[m].runner.execute(copy_batch(batch))
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                           msg=lambda s: f"{m}, step {step}: {s}")
    assert cb.counters["cudagraph_replays"] > 10


@pytest.mark.parametrize("uniform, expected", [(True, 1), (False, 4)])
def test_full_capture_metadata_follows_the_descriptor_not_the_dummy_batch(uniform, expected):
    """Regression: a FULL mixed-batch graph of 4 tokens over 4 requests was
    captured with max_query_len=1 (its dummy batch looks like decode), so it
    replayed prefills through the single-token decode kernel."""
    from compile_backend.runner.capture import prepare_inputs_to_capture

    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()):
        r = make_engine("full").runner
    meta = prepare_inputs_to_capture(StepGraph(Mode.FULL, 4, 4, uniform_decode=uniform),
                                        r.model_state)
    assert meta["layers.0.attn"].max_query_len == expected
    assert meta["layers.0.attn"].max_seq_len == r.kv_cache_config.max_model_len
    # attention-like: the padded bound, except in uniform-decode graphs (one token
    # per request by construction; the padded T would size their grids by T)
    assert meta["layers.0.conv"].max_query_len == expected
    assert meta["layers.0.compress"].max_query_len == expected
    meta = prepare_inputs_to_capture(StepGraph(Mode.PIECEWISE, 4, 4), r.model_state)
    assert meta["layers.0.conv"].max_query_len == 4  # PIECEWISE: serves any 4-token batch
    assert r.capture_plan().count(StepGraph(Mode.FULL, 4, 4)) == 1
    assert r.capture_plan().count(StepGraph(Mode.FULL, 4, 4, uniform_decode=True)) == 1


def test_a_step_graph_is_decided_once_and_refuses_a_piecewise_uniform_decode():
    """One frozen value per step: a PIECEWISE graph serves any batch of its
    size, so it cannot bake in the decode shortcut (max_query_len 1)."""
    from compile_backend.runner.capture import prepare_inputs_to_capture

    graph = StepGraph(Mode.FULL, 8, 8, uniform_decode=True)
    with pytest.raises(AttributeError):
        graph.uniform_decode = False  # frozen
    assert graph.for_capture and graph.key == (8, 8, True) and graph == StepGraph.full_decode(8)
    # PIECEWISE graphs are held by token count alone: pieces see no request count
    assert StepGraph(Mode.PIECEWISE, 8, 4).key == StepGraph(Mode.PIECEWISE, 8, 8).key == 8
    assert not StepGraph(Mode.PIECEWISE, 8, 4).for_capture
    assert StepGraph.eager(3, 2).key is None
    with pytest.raises(ValueError, match="serves any batch of its size"):
        StepGraph(Mode.PIECEWISE, 8, 8, uniform_decode=True)
    with pytest.raises(ValueError, match="one token per request"):
        StepGraph(Mode.FULL, 8, 4, uniform_decode=True)



# ---- the replay's host path over many inputs -----------------------------------

def _list_checked_ptrs_equal(tensors, ptrs, indices):
    """torch._C._tensors_data_ptrs_at_indices_equal's contract in Python: it
    takes lists only (pybind `py::list&`), an address per input position."""
    assert type(tensors) is list and type(ptrs) is list and type(indices) is list
    assert len(ptrs) == len(tensors)
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


@pytest.mark.parametrize("check", ["python", "list-taking", "torch"])
def test_the_address_check_finds_a_moved_input_in_either_implementation(check, monkeypatch):
    """The replay's address check (cuda_graph.addresses_match) runs torch's
    C++ loop where the build has it (CUDA) and a Python loop elsewhere: both
    find the one moved input among many, the wrapper then captures for the
    new address, and an unmoved call replays."""
    from compile_backend.runtime import cuda_graph

    if check == "torch" and getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None) is None:
        pytest.skip("this torch build has no _tensors_data_ptrs_at_indices_equal (CUDA builds do)")
    if check != "torch":
        monkeypatch.setattr(cuda_graph, "_data_ptrs_equal",
                            None if check == "python" else _list_checked_ptrs_equal)
    g = torch.Generator().manual_seed(11)
    weights = [torch.randn(4, generator=g) for _ in range(40)]  # read in place (fixed addresses)

    def step(cache, *ws):  # cache [4] written
        cache.add_(sum(ws))
        return cache * 2

    with use_graph_backend(StandInGraphs()):
        w = CUDAGraphWrapper(step, Mode.PIECEWISE, name="piece", written_inputs=[0],
                             stable_inputs=range(1, 41))
        ctx = cb.ForwardContext(graph=cb.StepGraph(Mode.PIECEWISE, 4, 4))
        with cb.set_forward_context(ctx):
            total = sum(weights)
            c1 = torch.randn(4, generator=g)
            want = c1 + total
            w(c1, *weights)  # capture
            torch.testing.assert_close(c1, want)
            for _ in range(2):  # in place: replays
                want = c1 + total
                torch.testing.assert_close(w(c1, *weights), want * 2)
                torch.testing.assert_close(c1, want)
            assert cb.counters["address_captures"] == 0
            c2 = torch.randn(4, generator=g)
            c1_before, want2 = c1.clone(), c2 + total
            torch.testing.assert_close(w(c2, *weights), want2 * 2)  # moved: its own graph
            torch.testing.assert_close(c2, want2)
            assert torch.equal(c1, c1_before)
            assert cb.counters["address_captures"] == 1
            want = c1 + total
            w(c1, *weights)  # back: the first graph, no capture
            torch.testing.assert_close(c1, want)
            assert cb.counters["address_captures"] == 1


def test_the_lazy_key_reads_only_the_inputs_that_can_change_shape():
    """Plain torch.compile hands every weight to the graph as an input. Their
    shapes are fixed (Dynamo guards them), so the key that picks a lazily
    captured graph leaves them out: it reads the dynamic input's shape and
    the size Dynamo passes as an int. Two sizes: two graphs, each replayed
    equal to eager on fresh inputs."""
    import copy

    from compile_backend.compile.compiled_step import FULL_GRAPH, compiled_steps

    g = torch.Generator().manual_seed(12)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    eager = copy.deepcopy(model)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        f = torch.compile(model, backend="mrv2",
                          options={"piece_compiler": "eager", "cudagraph_mode": "full"})
        for rows in (5, 5, 5, 7, 7, 7, 5, 7):
            x = torch.randn(rows, 16, generator=g)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(f(x), eager(x), atol=1e-5, rtol=1e-5)
    step = compiled_steps()[-1]
    names, stable = step.graph_inputs
    fixed = step.fixed_shape_inputs[FULL_GRAPH]
    assert set(stable) == {i for i, n in enumerate(names) if "parameters" in n} and len(stable) == 4
    assert set(stable) <= set(fixed)
    shaped, valued = step.full_graph._key_plan
    assert len(valued) == 1  # the input's rows, as an int
    # the one tensor input that is no weight: x, whose rows vary
    assert shaped == tuple(i for i in range(len(names)) if i not in stable and i not in valued)
    assert len(shaped) == 1 and shaped[0] not in fixed
    assert cb.counters["cudagraph_captures"] == 2
