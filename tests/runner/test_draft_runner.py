"""The speculative-decoding draft path (CPU, graphs are the stand-in; the
sessions test also on the GPU): tokens, and every buffer after each call,
against eager."""

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.core.graph_mode import StepGraph
from compile_backend.runner.draft_runner import DraftRunner
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import make_engine, random_prompts


@pytest.fixture(autouse=True)
def _torch_reference_kernels(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


K = 3


def _propose(mode):
    """Prefill three requests, then draft K tokens for each."""
    torch._dynamo.reset()
    prompts = random_prompts([5, 9, 3], seed=3)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        engine = make_engine(mode)
        engine.runner.capture()
        draft = DraftRunner(engine.runner, K)
        builds_before = len(engine.runner.model_state.build_log)
        captured = draft.capture()
        engine.draft_builds = engine.runner.model_state.build_log[builds_before:]
        block = engine.blocks.allocate(3 * 2)
        blocks = [block[2 * i: 2 * i + 2] for i in range(3)]
        cblocks = [engine.compressed_blocks.allocate(1) for _ in range(3)]
        prefill = InputBatch([t for p in prompts for t in p], [len(p) for p in prompts],
                             [len(p) for p in prompts], [0, 1, 2], block_ids=blocks,
                             compressed_block_ids=cblocks)
        logits = engine.runner.execute(prefill)
        last = torch.tensor([4, 13, 16])
        first = logits[last].argmax(-1).tolist()
        decode = InputBatch(first, [1, 1, 1], [len(p) + 1 for p in prompts], [0, 1, 2],
                            block_ids=blocks, compressed_block_ids=cblocks)
        return draft.propose(decode), captured, engine


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise", "piecewise"])
def test_draft_tokens_equal_an_eager_autoregressive_loop(mode):
    ref, _, _ = _propose("none")
    out, captured, engine = _propose(mode)
    assert out.shape == (3, K)
    assert torch.equal(out, ref)
    if mode == "piecewise":
        assert captured == []  # the main runner's piecewise graphs serve the loop
    else:
        sizes = [s for s in engine.runner.decode_sizes]
        assert captured == [StepGraph.full_decode(n) for n in sorted(sizes, reverse=True)]
        # captured through prepare_inputs_to_capture with a FULL step (for_capture):
        # every build the draft's capture made (warm-up and capture alike)
        assert engine.draft_builds and all(b["dummy"] for b in engine.draft_builds)
        assert all(b["for_capture"] and b["mode"] == "full" for b in engine.draft_builds)
        assert cb.counters["cudagraph_replays"] >= 1


def test_draft_path_rejects_a_batch_that_is_not_decode():
    torch._dynamo.reset()
    with use_graph_backend(StandInGraphs()):
        engine = make_engine("full")
        draft = DraftRunner(engine.runner, 2)
        with pytest.raises(ValueError, match="uniform decode"):
            draft.propose(InputBatch([1, 2], [2], [2], [0], block_ids=[[1]], compressed_block_ids=[[1]]))
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        DraftRunner(engine.runner, 0)


def _draft_engine(mode, derive=False, device="cpu", **options):
    from compile_backend.demo.engine import Engine
    from compile_backend.demo.models import build_model, preset
    from runtime_helpers import CAPTURE_SIZES, kv_config

    model = build_model("hybrid", preset("tiny", num_layers=2, dtype=torch.float32)).to(device)
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=CAPTURE_SIZES,
                               piece_compiler="eager", derive_mixed_graphs=derive, **options)
    engine = Engine(model, kv_config(), cfg, device, prefill_chunk=8, progress=False)
    engine.runner.capture()
    draft = DraftRunner(engine.runner, K)
    draft.capture()
    return engine, draft


def _draft_calls(seed, sessions=4, slots=4):
    """Each session's calls as a caller makes them: new requests (1-4, in
    random slots, prompts of random lengths, starting at position 0)
    prefilled, then two proposals, the second from the first's last
    token. Yields (what, call(engine, draft) -> tensor)."""
    import random

    rng = random.Random(seed)
    for session in range(sessions):
        count = (3, 1, 4, 2)[session % 4]  # 3: padded to a captured 4
        chosen = sorted(rng.sample(range(slots), count))
        prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 24))] for _ in chosen]
        lens = [len(p) for p in prompts]
        blocks = [[1 + 4 * s + i for i in range(4)] for s in chosen]
        cblocks = [[1 + s] for s in chosen]
        state = {}

        def prefill(engine, draft, prompts=prompts, lens=lens, chosen=chosen, blocks=blocks,
                    cblocks=cblocks, state=state):
            logits = engine.runner.execute(InputBatch(
                [t for p in prompts for t in p], lens, lens, chosen, block_ids=blocks,
                compressed_block_ids=cblocks))
            last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))])
            state.setdefault("first", logits[last.to(logits.device)].argmax(-1).tolist())
            return logits

        def propose(engine, draft, round, lens=lens, chosen=chosen, blocks=blocks,
                    cblocks=cblocks, state=state):
            # the reference's tokens feed both engines: a flipped argmax shows in the
            # compared output, never in the next call's inputs
            tokens, seq = (state["first"], [n + 1 for n in lens]) if round == 0 else \
                state[f"after{round - 1}"]
            out = draft.propose(InputBatch(tokens, [1] * len(tokens), seq, chosen,
                                           block_ids=blocks, compressed_block_ids=cblocks))
            state.setdefault(f"after{round}", ([int(t) for t in out[:, -1]],
                                               [s + K for s in seq]))
            return out

        yield f"session {session} prefill", prefill
        for r in range(2):
            yield f"session {session} proposal {r}", lambda e, d, r=r: propose(e, d, r)


def _draft_sessions_equal_eager(mode, derive=False, device="cpu", seed=11, **options):
    ref, ref_draft = _draft_engine("none", device=device)
    engine, draft = _draft_engine(mode, derive, device, **options)
    for what, call in _draft_calls(seed):
        want = call(ref, ref_draft).clone()
        got = call(engine, draft)
        # every path hands its result back on the runner's device
        assert got.device.type == want.device.type == device, (what, got.device, want.device)
        if want.is_floating_point():
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"{mode}, {what}: {m}")
        else:
            assert torch.equal(got, want), (mode, what, got, want)
        ref_buffers = dict(ref.runner.model.named_buffers())
        for name, b in engine.runner.model.named_buffers():
            torch.testing.assert_close(b, ref_buffers[name], atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"{mode}, {what}, {name}: {m}")
    return engine


# (mode, derive_mixed_graphs, fuse_rope_attention)
SESSION_CASES = [pytest.param("full", False, False, id="full"),
                 pytest.param("full", True, False, id="full-derive"),
                 pytest.param("full", False, True, id="full-rope"),
                 pytest.param("full_and_piecewise", False, False, id="full_and_piecewise"),
                 pytest.param("piecewise", False, False, id="piecewise")]


@pytest.mark.parametrize("mode, derive, rope", SESSION_CASES)
def test_draft_sessions_equal_eager_after_every_call(mode, derive, rope):
    """Several sessions through one runner and draft loop, as a caller makes
    them (new requests in reused slots, batches of 1-4 requests padded to
    the captured sizes), each call's output and every buffer of the model
    (KV caches, conv and compressor states) against eager's. full-rope: the
    FULL graphs with rotary and the KV write inside the attention op."""
    torch._dynamo.reset()
    cb.reset_counters()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        _draft_sessions_equal_eager(mode, derive, fuse_rope_attention=rope)
    if mode != "piecewise":
        assert cb.counters["cudagraph_replays"] >= 8
    if derive:
        assert cb.counters["mixed_graphs_derived"] > 0
    assert (cb.counters["pass_rope_attention_fused"] > 0) == rope


@pytest.mark.gpu
@pytest.mark.parametrize("mode, derive, rope",
                         [c for c in SESSION_CASES if c.values[0] != "full_and_piecewise"])
def test_draft_sessions_equal_eager_after_every_call_on_the_gpu(mode, derive, rope):
    """The same sessions with CUDA graphs and the Triton kernels, fp32
    (full-rope: the fused decode launches inside the captured draft loop)."""
    torch._dynamo.reset()
    cb.reset_counters()
    with torch.no_grad():
        _draft_sessions_equal_eager(mode, derive, device="cuda", fuse_rope_attention=rope)
    if rope:
        assert cb.counters["rope_attention_fused_captured"] > 0
