"""Every capture path replayed on a real GPU against eager: plain
torch.compile (lazy capture), Hugging Face generate, the runner with requests
longer than a query tile and contexts with several KV splits, the draft
loop, and capture leaving caches untouched."""

import pytest
import torch

import compile_backend as cb
from compile_backend.runner.draft_runner import DraftRunner
from compile_backend.demo.engine import Engine
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.demo.models import build_model, preset
from compile_backend.testing import check_against_eager
from backend_models import TOY_OPTIONS, StatefulSDPA, ToyHybrid, plain_calls

pytestmark = pytest.mark.gpu

ALL_MODES = ["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]
GRAPH_MODES = ALL_MODES[1:]


@pytest.mark.parametrize("piece_compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", ["piecewise", "full"])
@pytest.mark.parametrize("model_cls", [ToyHybrid, StatefulSDPA])
def test_plain_compile_of_a_stateful_model_equals_eager(model_cls, mode, piece_compiler):
    """Five calls per shape (warm-up, capture, three replays): outputs and the
    mutated state equal eager after every call."""
    torch.manual_seed(0)
    model = model_cls().cuda()
    report = check_against_eager(
        model, plain_calls([7, 40], 5, device="cuda"), [mode],
        options={"piece_compiler": piece_compiler, **TOY_OPTIONS}, atol=1e-4, rtol=1e-4)
    assert report[mode].captures >= 2 and report[mode].replays > report[mode].captures


def _hf_model(arch):
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    cfg = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_cls(cfg).cuda().eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_hf_generate_with_a_static_cache_equals_eager_every_mode(arch):
    model = _hf_model(arch)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3)).cuda()

    def generate(m):  # greedy, 32 tokens; HF's own auto-compile off: eager is eager
        return m.generate(ids, max_new_tokens=32, do_sample=False, cache_implementation="static",
                          disable_compile=True, pad_token_id=0)

    report = check_against_eager(model, [generate], ALL_MODES, options={"piece_compiler": "eager"})
    for mode in GRAPH_MODES:
        # full_decode_only without a runner: one FULL graph, or eager when it
        # cannot be one (Mistral passes its decode position as an int input)
        ran_eagerly = mode == "full_decode_only" and report[mode].full_graph_fallbacks
        assert report[mode].replays > 0 or ran_eagerly, mode


def _engine(mode, dtype=torch.float32, **kv):
    """Contexts up to 2048 (FULL graphs bound by max_model_len: many KV splits)
    and prefill chunks of 96 tokens (several query tiles per request)."""
    model = build_model("hybrid", preset("tiny", num_layers=2, hidden_size=256, num_heads=4,
                                         num_kv_heads=2, dtype=dtype)).cuda()
    base = dict(num_blocks=600, block_size=16, max_model_len=2048, max_num_reqs=8,
                max_num_tokens=256)
    base.update(kv)
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                               piece_compiler="eager")
    return Engine(model, KVCacheConfig(**base), cfg, "cuda", prefill_chunk=96,
                  max_admit_per_step=3, progress=False)


def _forced_logits(mode, prompts, new_tokens):
    torch._dynamo.reset()
    stream = torch.Generator().manual_seed(1)
    logits = []
    with torch.no_grad():
        engine = _engine(mode)
        engine.runner.capture()
        engine.generate(prompts, new_tokens,
                        sample=lambda l: torch.randint(0, 256, (l.shape[0],), generator=stream).tolist(),
                        on_step=lambda l: logits.append(l.float().cpu()))
    return logits


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_long_requests_and_many_kv_splits_equal_eager(mode):
    from compile_backend.kernels.unified_attention import num_kv_splits

    assert num_kv_splits(8, 2, 2048, torch.device("cuda")) > 1
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (700, 150, 90, 1200, 40)]
    ref = _forced_logits("none", prompts, 10)
    out = _forced_logits(mode, prompts, 10)
    assert len(out) == len(ref) > 10
    for step, (a, b) in enumerate(zip(out, ref)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda s: f"step {step}: {s}")


def _buffers(model):
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _, b in model.named_buffers():
            if b.dtype.is_floating_point:
                b.copy_(torch.randn(b.shape, generator=g).to(b.dtype).to(b.device))
    return {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_capture_leaves_every_cache_and_state_unchanged(mode):
    torch._dynamo.reset()
    with torch.no_grad():
        runner = _engine(mode, max_model_len=256, num_blocks=64).runner
        before = _buffers(runner.model)
        runner.capture()
        DraftRunner(runner, 3).capture()
        torch.cuda.synchronize()
        for name, b in runner.model.named_buffers():
            assert torch.equal(b, before[name]), f"{name} changed during capture ({mode})"


def test_draft_propose_before_capture_and_for_an_uncaptured_size_raises():
    torch._dynamo.reset()
    with torch.no_grad():
        engine = _engine("full", max_model_len=256, num_blocks=64)
        engine.runner.capture()
        draft = DraftRunner(engine.runner, 3)
        blocks = [engine.blocks.allocate(2) for _ in range(3)]
        cblocks = [engine.compressed_blocks.allocate(1) for _ in range(3)]
        batch = InputBatch([5, 6, 7], [1, 1, 1], [4, 2, 9], [0, 1, 2], block_ids=blocks,
                           compressed_block_ids=cblocks)
        with pytest.raises(RuntimeError, match="no draft graph for 4 requests x 3 draft tokens"):
            draft.propose(batch)
        draft.capture(sizes=[1, 2])
        with pytest.raises(RuntimeError, match=r"captured: \[2, 1\] requests"):
            draft.propose(batch)
