"""The runtime on a real GPU: CUDA graphs replayed against eager, every mode,
several steps of mixed prefill and decode with state carried between steps."""

import pytest
import torch

import compile_backend as cb
from compile_backend.demo.engine import Engine
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.demo.models import build_model, preset

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
MODES = ["piecewise", "full", "full_decode_only", "full_and_piecewise"]


def _engine(mode, piece_compiler="eager", debug_checks=False, dtype=torch.bfloat16):
    model = build_model("hybrid", preset("tiny", num_layers=2, hidden_size=256, num_heads=4,
                                         num_kv_heads=2, dtype=dtype)).cuda()
    kv = KVCacheConfig(num_blocks=256, block_size=16, max_model_len=256, max_num_reqs=8,
                       max_num_tokens=64)
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=SIZES,
                               piece_compiler=piece_compiler, debug_checks=debug_checks)
    return Engine(model, kv, cfg, "cuda", prefill_chunk=12, max_admit_per_step=3, progress=False)


def _forced_run(mode, prompts, new_tokens, **kw):
    """Generate with tokens forced from a fixed stream (so that both runs see the
    same inputs whatever their argmax), returning every step's logits."""
    torch._dynamo.reset()
    stream = torch.Generator().manual_seed(1)
    logits = []
    with torch.no_grad():
        engine = _engine(mode, **kw)
        engine.runner.capture()
        engine.generate(prompts, new_tokens,
                        sample=lambda l: torch.randint(0, 256, (l.shape[0],), generator=stream).tolist(),
                        on_step=lambda l: logits.append(l.float().cpu()))
    return logits, engine


@pytest.mark.parametrize("piece_compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_replay_equals_eager_every_mode(mode, piece_compiler):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 1, 25, 6, 30)]
    ref, _ = _forced_run("none", prompts, 12, piece_compiler=piece_compiler)
    cb.reset_counters()
    out, engine = _forced_run(mode, prompts, 12, piece_compiler=piece_compiler)
    assert len(out) == len(ref) and len(out) > 10
    for step, (a, b) in enumerate(zip(out, ref)):
        err = (a - b).norm() / b.norm()
        assert err < 2e-2, f"step {step}: relative error {err:.3e}"  # bf16 tolerance
    assert cb.counters["cudagraph_replays"] > 0
    assert cb.counters["dynamo_graphs"] == 1


def test_piecewise_capture_runs_attention_like_ops_with_real_metadata():
    """Regression: PIECEWISE capture must build metadata (the seed's bug); the
    attention-like ops execute during capture, attention does not."""
    torch._dynamo.reset()
    with torch.no_grad():
        engine = _engine("piecewise")
        trace = []
        captures = engine.runner.capture(trace)
    assert len(captures) == len(SIZES)
    assert all(rec.for_capture == {"attention": False, "sconv": False, "compressor": False}
               for rec in captures)
    events = [e for _, e in trace if e.endswith("@capture")]
    assert events.count("sconv@capture") == 2 * len(SIZES)  # 2 layers per capture
    assert events.count("kv_compress@capture") == 2 * len(SIZES)
    assert "unified_attention@capture" not in events


def test_debug_mode_catches_a_moved_persistent_metadata_tensor():
    torch._dynamo.reset()
    with torch.no_grad():
        engine = _engine("full_and_piecewise", debug_checks=True)
        engine.runner.capture()
        prompts = [[1, 2, 3], [4, 5]]
        engine.generate(prompts, 3)
        buf = engine.runner.input_buffers
        buf.seq_lens = buf.seq_lens.clone()
        with pytest.raises(RuntimeError, match="seq_lens moved since capture"):
            engine.generate(prompts, 3)


def _draft_tokens(mode, k=3):
    from compile_backend.runner.draft_runner import DraftRunner
    from compile_backend.runner.input_batch import InputBatch

    torch._dynamo.reset()
    with torch.no_grad():
        engine = _engine(mode, dtype=torch.float32)
        engine.runner.capture()
        draft = DraftRunner(engine.runner, k)
        captured = draft.capture()
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 20, 3)]
        blocks = [engine.blocks.allocate(3) for _ in prompts]
        cblocks = [engine.compressed_blocks.allocate(1) for _ in prompts]
        lens = [len(p) for p in prompts]
        logits = engine.runner.execute(InputBatch(
            [t for p in prompts for t in p], lens, lens, [0, 1, 2],
            block_ids=blocks, compressed_block_ids=cblocks))
        last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(3)], device=logits.device)
        first = logits[last].argmax(-1).tolist()
        out = draft.propose(InputBatch(first, [1, 1, 1], [n + 1 for n in lens], [0, 1, 2],
                                       block_ids=blocks, compressed_block_ids=cblocks))
    return out.cpu(), captured


def test_draft_loop_captured_as_one_full_graph_equals_eager():
    ref, _ = _draft_tokens("none")
    out, captured = _draft_tokens("full")
    assert len(captured) == len([s for s in SIZES if s <= 8])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mode", MODES)
def test_random_schedules_equal_eager(mode):
    """Random mixed batches, small ones included (a FULL mixed graph of T
    tokens over T requests must not take the decode path), fp32."""
    from runtime_helpers import copy_batch as _copy, random_schedule as _random_schedule

    torch._dynamo.reset()
    with torch.no_grad():
        ref_engine, engine = _engine("none", dtype=torch.float32), _engine(mode, dtype=torch.float32)
        ref_engine.runner.capture()
        engine.runner.capture()
        for step, batch in enumerate(_random_schedule(7, steps=16)):
            ref = ref_engine.runner.execute(_copy(batch)).clone()
            out = engine.runner.execute(_copy(batch))
            torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4,
                                       msg=lambda s: f"step {step}: {s}")


_FIRST_CAPTURE = """
import torch
from compile_backend.runtime.graph_pool import TorchCUDAGraphs
g = torch.Generator(device="cuda").manual_seed(23)
x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, generator=g) / 32
b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=g)
step = lambda: torch.nn.functional.linear(x, w, b) + x @ w
step()
torch.cuda.synchronize()
graphs = TorchCUDAGraphs()
graph = graphs.new_graph()
with graphs.capture(graph, graphs.pool()):
    out = step()
torch.cuda.synchronize()
graph.replay()
torch.cuda.synchronize()
in_pools = sum(blk["size"] for seg in torch.cuda.memory._snapshot()["segments"]
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
               for blk in seg["blocks"] if blk["state"] == "active_allocated")
print(in_pools, out.untyped_storage().nbytes(), (out.float() - step().float()).abs().max().item())
"""


def test_a_process_first_capture_keeps_only_its_output_in_graph_memory():
    """The capture stream's cuBLAS workspaces are made before the first
    capture (warm_capture_stream), so they never land in a graph's pool: a
    fresh process's first graph keeps exactly its output allocated."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_CAPTURE], capture_output=True, text=True,
                         timeout=300, check=True)
    in_pools, output, err = out.stdout.split()[-3:]
    assert int(in_pools) == int(output), out.stdout  # allocated in graph pools: the output alone
    assert float(err) < 0.1  # bf16 sums of 1024 products of unit-scale values


def test_a_stream_buffer_declared_after_the_first_capture_exists_in_the_next():
    """A kernel module imported after the capture stream was warmed declares
    a per-stream buffer: the next warm_capture_stream makes it for the capture
    stream (the fast path compares declared counts), so a capture finds it
    zeroed instead of None."""
    from compile_backend.core import stream_buffers
    from compile_backend.runtime.graph_pool import capture_stream, warm_capture_stream

    dev = torch.device("cuda")
    warm_capture_stream(dev)  # warmed at today's count
    name = "test_late_declared_counter"
    stream_buffers.declare(name, 64, torch.int32)
    warm_capture_stream(dev)  # the count moved: the new buffer is made now
    stream = capture_stream(dev)
    seen = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            seen.append(stream_buffers.buffer(name, dev))  # inside the capture: made before, or None
    assert seen[0] is not None and seen[0].shape == (64,) and seen[0].dtype == torch.int32
    assert int(seen[0].abs().sum()) == 0
