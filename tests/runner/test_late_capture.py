"""Graphs captured late, by a serving step (`ModelRunner.execute`) instead of
`capture()`: after `release_graphs()`, or at a size `capture()` left out.

The contract: such a FULL graph is built from `for_capture=True` metadata like
any FULL capture (worst-case Python ints for its padded size: max_seq_len =
max_model_len, max_query_len = the padded tokens, 1 only in uniform-decode
graphs), and then serves every later batch of its padded size (decode,
prefill, mixed, longer sequences than the batch that captured it). After every
step, logits and every cache and state buffer are compared with an eager
runner's, and at the end every FULL graph's baked metadata is checked.

CPU: graphs are the strict stand-in (a replay runs with the metadata seen at
capture), attention runs through the interpreted Triton kernels, whose decode
path is chosen by the baked max_query_len. The sizes make that bite: capture
sizes [2, 8] over 4 requests, so a decode batch of 3 requests pads to 8 tokens
(past every decode size) and captures the mixed FULL graph that later
prefills of 8 tokens replay. Captured from exact metadata (max_query_len 1),
that graph replays a prefill through the decode kernel."""

from unittest import mock

import pytest
import torch

import compile_backend as cb
from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph
from compile_backend.demo.models import build_model, preset
from compile_backend.runner.attention_metadata import AttentionMetadata
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import kv_config

SIZES = [2, 8]
MAX_MODEL_LEN = 64
BLOCKS_PER_REQ = 4  # 4 blocks of 16 tokens: max_model_len
# Small enough for the interpreter: one layer, one KV head.
SMALL = dict(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
MIXED_8 = StepGraph(CUDAGraphMode.FULL, 8, 4).key
DECODE_2 = StepGraph.full_decode(2).key
MIXED_2 = StepGraph(CUDAGraphMode.FULL, 2, 2).key


def _runner(model, mode, device="cpu"):
    cfg = kv_config(max_model_len=MAX_MODEL_LEN, max_num_reqs=4, max_num_tokens=8)
    m = build_model(model, preset("tiny", **SMALL)).to(device)
    m.bind_caches(cfg.num_blocks, cfg.block_size, cfg.max_num_reqs, device)
    config = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=SIZES,
                                  piece_compiler="eager")
    return ModelRunner(m, cfg, config, device, progress=False)


def _schedule(specs, seed=0):
    """One batch factory per step (each runner gets its own InputBatch:
    execute pads the one it is given). A spec is [(slot, new tokens), ...];
    sequences grow across steps."""
    lens, gen, out = [0] * 4, torch.Generator().manual_seed(seed), []
    for spec in specs:
        for s, q in spec:
            lens[s] += q
        assert max(lens) <= MAX_MODEL_LEN, lens
        slots, qlens, seq = [s for s, _ in spec], [q for _, q in spec], [lens[s] for s, _ in spec]
        ids = torch.randint(0, 256, (sum(qlens),), generator=gen).tolist()
        blocks = [[1 + BLOCKS_PER_REQ * s + i for i in range(BLOCKS_PER_REQ)] for s in slots]

        def make(ids=ids, qlens=qlens, seq=seq, slots=slots, blocks=blocks):
            return InputBatch(list(ids), list(qlens), list(seq), list(slots), block_ids=blocks,
                              compressed_block_ids=[[1 + s] for s in slots])

        out.append(make)
    return out


# Served before release_graphs, from capture()'s graphs.
WARM = [
    [(0, 3), (1, 2), (2, 2), (3, 1)],  # 8 tokens
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # decode of 4: pads to 8 (no decode size 4)
]
# Each padded size is first met by a short batch (a decode where one fits),
# then served by batches of that padded size with longer sequences.
LATE = [
    [(0, 1), (1, 1), (2, 1)],  # decode of 3 -> 8 tokens: the mixed graph of 8 captures
    [(0, 5), (1, 1), (2, 1), (3, 1)],  # 8 tokens, a prefill of 5: replays it
    [(0, 1), (1, 1)],  # decode of 2: the uniform-decode graph of 2 captures
    [(2, 8)],  # one prefill of 8 tokens: the mixed graph of 8
    [(3, 1)],  # decode of 1, longer sequence: the decode graph of 2
    [(1, 2)],  # a prefill of 2 tokens: the mixed graph of 2 (FULL mode) captures
    [(0, 1), (3, 1)],  # decode of 2, longest sequences
    [(0, 2), (1, 2), (2, 2), (3, 2)],  # 8 tokens over 4 requests, longest sequences
    [(2, 1), (3, 1)],  # decode of 2
    [(3, 2)],  # a prefill of 2, longer: the mixed graph of 2
]
# The FULL graphs LATE's steps capture in FULL mode when nothing is captured.
LATE_CAPTURES_FULL = {0: {MIXED_8}, 2: {DECODE_2}, 5: {MIXED_2}}
# In FULL_AND_PIECEWISE mixed batches run PIECEWISE: the decode graph is the FULL one.
LATE_CAPTURES_FULL_AND_PIECEWISE = {2: {DECODE_2}}


def _serve(runner, reference, batches, tag, tol=1e-4):
    """Execute every batch on both runners, comparing logits, caches and
    state after each step; returns, per step, (the FULL graphs it captured,
    its metadata builds)."""
    steps = []
    for i, make in enumerate(batches):
        before = set(runner.full_graph.entries)
        builds_before = len(runner.model_state.build_log)
        want = reference.execute(make()).clone()
        got = runner.execute(make())
        torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                   msg=lambda m: f"{tag}, step {i} logits: {m}")
        ref_buffers = dict(reference.model.named_buffers())
        for name, b in runner.model.named_buffers():
            torch.testing.assert_close(b, ref_buffers[name], atol=tol, rtol=tol,
                                       msg=lambda m: f"{tag}, step {i} buffer {name}: {m}")
        steps.append((set(runner.full_graph.entries) - before,
                      runner.model_state.build_log[builds_before:]))
    return steps


def _late_captures(steps):
    """{step: the FULL graphs it captured}, checking that each such step
    built every group's metadata with for_capture=True."""
    late = {i: new for i, (new, _) in enumerate(steps) if new}
    for i in late:
        builds = steps[i][1]
        assert builds and all(b["for_capture"] and not b["dummy"] and b["mode"] == "full"
                              for b in builds), (i, builds)
    return late


def _check_for_capture(runner, steps):
    """_late_captures, and every FULL graph holds its padded size's bounds
    (the stand-in replays with the metadata its capture saw)."""
    late = _late_captures(steps)
    for key, entry in runner.full_graph.entries.items():
        graph = entry.cuda_graph.ctx.graph  # the graph the stand-in captured under
        assert graph.key == key, (graph, key)
        baked = entry.cuda_graph.ctx.attn_metadata
        assert baked, graph
        for layer, meta in baked.items():
            assert meta.for_capture, (graph, layer)
            bound = 1 if graph.uniform_decode else graph.num_tokens
            assert meta.max_query_len == bound, (graph, layer, meta.max_query_len)
            if isinstance(meta, AttentionMetadata):
                assert meta.max_seq_len == MAX_MODEL_LEN, (graph, layer, meta.max_seq_len)
    return late


MODES = ["full", "full_and_piecewise"]
LLAMA, HYBRID = "llama", pytest.param("hybrid", marks=pytest.mark.slow)


@pytest.mark.parametrize("model", [LLAMA, HYBRID])
@pytest.mark.parametrize("mode", MODES)
def test_graphs_captured_after_release_graphs_serve_every_later_batch(model, mode):
    batches = _schedule(WARM + LATE)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, reference = _runner(model, mode), _runner(model, "none")
        runner.capture()
        assert all(c.for_capture["attention"] == (c.graph.mode is cb.CUDAGraphMode.FULL) for c in runner.captures)
        _serve(runner, reference, batches[:len(WARM)], f"{mode}, before release")
        captures = cb.counters["cudagraph_captures"]
        assert cb.release_graphs() > 0 and not runner.full_graph.entries
        steps = _serve(runner, reference, batches[len(WARM):], f"{mode}, after release")
        late = _check_for_capture(runner, steps)
    assert late == (LATE_CAPTURES_FULL if mode == "full" else LATE_CAPTURES_FULL_AND_PIECEWISE)
    recaptured = cb.counters["cudagraph_captures"] - captures
    if mode == "full":
        assert recaptured == 3  # the pieces run inside the FULL graphs
    else:  # the decode graph, and the pieces of the PIECEWISE graphs of 8 and 2
        assert recaptured > 1


def _capture_only(runner, sizes):
    """capture() with its plan narrowed to `sizes`: the runner's other sizes
    stay in dispatch, without a graph until a step meets them."""
    plan = [graph for graph in runner.capture_plan() if graph.num_tokens in sizes]
    with mock.patch.object(runner, "capture_plan", lambda: plan):
        runner.capture()


@pytest.mark.parametrize("model, mode, captured, late", [
    # 2 captured: the mixed graph of 8 is first met, by the decode of 3
    (LLAMA, "full", [2], {0: {MIXED_8}}),
    pytest.param(LLAMA, "full_and_piecewise", [8], LATE_CAPTURES_FULL_AND_PIECEWISE,
                 marks=pytest.mark.slow),
    pytest.param("hybrid", "full", [2], {0: {MIXED_8}}, marks=pytest.mark.slow),
    pytest.param("hybrid", "full_and_piecewise", [8], LATE_CAPTURES_FULL_AND_PIECEWISE,
                 marks=pytest.mark.slow),
])
def test_sizes_first_met_while_serving_capture_for_every_later_batch(model, mode, captured, late):
    batches = _schedule(LATE)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, reference = _runner(model, mode), _runner(model, "none")
        _capture_only(runner, captured)
        assert {c.graph.num_tokens for c in runner.captures} == set(captured)
        steps = _serve(runner, reference, batches, f"{mode}, captured {captured}")
        assert _check_for_capture(runner, steps) == late


def test_a_runner_without_capture_runs_eagerly():
    """dispatch picks no graph before capture(): a runner that never
    captured runs every step eagerly and captures nothing on demand."""
    batches = _schedule(LATE[:3])
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, reference = _runner("llama", "full"), _runner("llama", "none")
        _serve(runner, reference, batches, "no capture()")
    assert cb.counters["cudagraph_captures"] == 0 and not runner.full_graph.entries
    assert not any(b["for_capture"] for b in runner.model_state.build_log)


def test_piecewise_graphs_still_replay_after_a_full_capture():
    """The stand-in's capture lets Dynamo run the compiled step inside it (as
    torch.cuda.graph does). Regression: Dynamo skipped the model's frame
    under the stand-in's dispatch mode and went on skipping it, so after
    capture() (PIECEWISE graphs first, the FULL decode graph last) every
    mixed step ran uncompiled and no PIECEWISE graph replayed."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner = _runner("llama", "full_and_piecewise")
        runner.capture()
        assert runner.captures[-1].graph.mode is cb.CUDAGraphMode.FULL
        replays = cb.counters["cudagraph_replays"]
        runner.execute(_schedule(WARM)[0]())
        assert runner.dispatch(_schedule(WARM)[0]()).mode is CUDAGraphMode.PIECEWISE
    assert cb.counters["cudagraph_replays"] > replays


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_graphs_captured_after_release_graphs_serve_every_later_batch_on_the_gpu(mode):
    """CUDA graphs and the compiled Triton kernels: the same schedule, each
    step against an eager runner on the GPU (fp32; the tolerance of
    test_runtime_gpu.py, since padded and eager batches may take different
    kernels)."""
    batches = _schedule(WARM + LATE)
    with torch.no_grad():
        runner, reference = _runner("llama", mode, "cuda"), _runner("llama", "none", "cuda")
        assert runner.mode is CUDAGraphMode.parse(mode)
        runner.capture()
        _serve(runner, reference, batches[:len(WARM)], f"{mode}, before release", tol=2e-4)
        assert cb.release_graphs() > 0
        steps = _serve(runner, reference, batches[len(WARM):], f"{mode}, after release",
                       tol=2e-4)
    assert _late_captures(steps) == (
        LATE_CAPTURES_FULL if mode == "full" else LATE_CAPTURES_FULL_AND_PIECEWISE)
