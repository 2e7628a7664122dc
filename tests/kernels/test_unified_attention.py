"""mrv2::unified_attention against its torch reference (rel. error per
dtype: kernel_cases.REL_TOL), over decode, prefill, mixed, padded and long
batches and head sizes from 1 to MAX_HEAD_DIM."""

import importlib

import pytest
import torch

from kernel_cases import (stable_seed, DEVICES, DTYPE_IDS, DTYPES, GPU_HEAD_DIMS, SMALL_HEAD_DIMS, assert_close_rel,
                          gen, paged_batch, randn)
from kernel_cases import gpu_dot_limits  # noqa: F401  (autouse: tl.dot's GPU minimum)
from compile_backend.kernels.unified_attention import (MAX_HEAD_DIM, num_kv_splits, unified_attention,
                                       unified_attention_ref)

# name: (q_lens, seq_lens, padding tokens beyond qsl[B])
CASES = {
    "decode": ([1, 1, 1, 1], [5, 17, 33, 64], 0),
    "prefill": ([7, 20], [7, 20], 0),
    "mixed": ([1, 9, 1, 24], [40, 30, 1, 50], 0),
    "padding_rows": ([3, 1, 0, 0], [20, 9, 0, 0], 3),
    "decode_padding": ([1, 1, 0], [33, 2, 0], 2),
    "long_decode": ([1, 1], [333, 310], 0),
    "long_prefill": ([40], [340], 0),
}


def _run(case, dtype, head_dim, device, seed, num_heads=4, num_kv_heads=2, block_size=16,
         num_splits=None, config=None):
    q_lens, seq_lens, pad = CASES[case] if isinstance(case, str) else case
    g = gen(seed)
    batch = paged_batch(q_lens, seq_lens, block_size, device, g, pad_tokens=pad)
    shape = (batch.num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = randn(shape, dtype, device, g)
    v_cache = randn(shape, dtype, device, g)
    query = randn((batch.num_tokens, num_heads, head_dim), dtype, device, g)
    scale = head_dim ** -0.5
    poisoned = torch.full_like(query, float("nan"))  # every row must be written
    out = unified_attention(query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                            batch.block_table, scale, batch.max_query_len, batch.max_seq_len,
                            num_splits=num_splits, config=config, out=poisoned)
    assert out is poisoned
    ref = unified_attention_ref(query.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(),
                                batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                                batch.block_table.cpu(), scale)
    n = int(batch.query_start_loc[-1])
    assert torch.isfinite(out).all(), "every row is written"
    assert (out[n:] == 0).all(), "padding tokens must get zeros"
    return out, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.slow_on_cpu)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype, head_dim, device):
    out, ref = _run(case, dtype, head_dim, device, seed=stable_seed(case, head_dim))
    assert_close_rel(out, ref, dtype, case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", SMALL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_small_head_sizes(case, dtype, head_dim, device):
    """Head sizes below tl.dot's 16 and not powers of two (Note [dot tiles] in
    compile_backend/kernels/unified_attention.py): the decode and the prefill kernel,
    within REL_TOL, on fresh random inputs."""
    out, ref = _run(case, dtype, head_dim, device, seed=stable_seed(case, head_dim, 5))
    assert_close_rel(out, ref, dtype, f"{case} D={head_dim}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_small_config_tiles_round_up(case, device):
    """Tile overrides below tl.dot's 16 (or not powers of two) are rounded up."""
    g = gen(17)
    batch = paged_batch(*CASES[case][:2], 16, device, g)
    shape = (batch.num_blocks, 16, 2, 4)
    kc, vc = randn(shape, torch.float32, device, g), randn(shape, torch.float32, device, g)
    q = randn((batch.num_tokens, 4, 4), torch.float32, device, g)
    args = (q, kc, vc, batch.query_start_loc, batch.seq_lens, batch.block_table, 0.5)
    out = unified_attention(*args, batch.max_query_len, batch.max_seq_len,
                            config=dict(BLOCK_M=2, TILE_N=12))
    ref = unified_attention_ref(*(a.cpu() for a in args[:-1]), 0.5)
    assert_close_rel(out, ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("head_dim", GPU_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_head_sizes_gpu(case, dtype, head_dim):
    """Every case compiled for real at head sizes 1 .. MAX_HEAD_DIM."""
    assert max(GPU_HEAD_DIMS) == MAX_HEAD_DIM
    out, ref = _run(case, dtype, head_dim, "cuda", seed=stable_seed(case, head_dim, 6))
    assert_close_rel(out, ref, dtype, f"{case} D={head_dim}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3, 5])
def test_decode_split_counts(num_splits, device):
    """Splits of uneven coverage (the last one shorter) merge exactly; the
    kernel picks fewer splits than the grid has where splits of 64 keys do
    not fill it (Note [one-launch decode])."""
    out, ref = _run("long_decode", torch.float32, 64, device, seed=7, num_splits=num_splits,
                    config=dict(MIN_SPLIT_LEN=64))
    assert_close_rel(out, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 1), (8, 2), (2, 2)])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_gqa_ratios(num_heads, num_kv_heads, case, device):
    out, ref = _run(case, torch.float16, 64, device, seed=11, num_heads=num_heads,
                    num_kv_heads=num_kv_heads)
    assert_close_rel(out, ref, torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_other_block_sizes(block_size, case, device):
    out, ref = _run(case, torch.float32, 64, device, seed=13, block_size=block_size)
    assert_close_rel(out, ref, torch.float32)


def test_split_count_policy():
    """Long contexts at small batch get many splits; big batches few; short
    contexts never get splits shorter than MIN_SPLIT_LEN."""
    cuda_like = torch.device("cpu")
    assert num_kv_splits(1, 8, 32768, cuda_like) >= 2
    assert num_kv_splits(1, 8, 100, cuda_like) == 1
    assert num_kv_splits(4096, 8, 32768, cuda_like) == 1


# Larger shapes, compiled for real.
BIG = {
    "decode_b64_ctx4096": ([1] * 64, [4096 - 7 * i for i in range(64)], 0),
    "decode_b1_ctx32768": ([1], [32768], 0),
    "prefill_2x1024_ctx": ([1024, 700, 1], [3000, 700, 2048], 5),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(BIG))
def test_large_gpu(case, dtype):
    out, ref = _run(BIG[case], dtype, 128, "cuda", seed=3, num_heads=32, num_kv_heads=8)
    assert_close_rel(out, ref, dtype, case)


def _gpu_decode(seed: int, seq_len: int):
    """8 decode requests of `seq_len` cached tokens on the GPU (bf16, 8 heads
    over 2 KV heads, head dim 128, block size 16): (generator, batch, k cache,
    v cache, query), the generator left for the replay's new values."""
    g = gen(seed)
    dtype, H, KVH, D, bs = torch.bfloat16, 8, 2, 128, 16
    batch = paged_batch([1] * 8, [seq_len] * 8, bs, "cuda", g)
    kc = randn((batch.num_blocks, bs, KVH, D), dtype, "cuda", g)
    vc = randn((batch.num_blocks, bs, KVH, D), dtype, "cuda", g)
    return g, batch, kc, vc, randn((8, H, D), dtype, "cuda", g)


def _assert_matches_ref(out, q, kc, vc, batch):
    ref = unified_attention_ref(q.float().cpu(), kc.float().cpu(), vc.float().cpu(),
                                batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                                batch.block_table.cpu(), 0.1)
    assert_close_rel(out, ref, q.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_decode_in_cuda_graph():
    """Captured once, replayed on new seq_lens/queries: no host syncs, and the
    grid does not depend on tensor values."""
    g, batch, kc, vc, q = _gpu_decode(seed=5, seq_len=1000)
    args = lambda: unified_attention(q, kc, vc, batch.query_start_loc, batch.seq_lens,  # noqa: E731
                                     batch.block_table, 0.1, 1, 1000)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        args()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = args()
    batch.seq_lens.copy_(torch.tensor([1000 - 97 * i for i in range(8)], dtype=torch.int32))
    q.copy_(randn(q.shape, q.dtype, "cuda", g))
    graph.replay()
    _assert_matches_ref(out, q, kc, vc, batch)


# The direct path (Note [attention plans] in compile_backend/kernels/attention_plan.py): what eager pieces call once per
# layer. Steps of successive metadata; each step runs several layers (own
# caches, same shapes: one plan per step, shared scratch).
# name: (q_lens, seq_lens, padding tokens)
STEPS_SMALL = [
    ([1, 1, 1, 1], [40, 17, 90, 64], 0),  # decode
    ([1, 1, 0], [33, 2, 0], 2),  # decode with a padding request and padding tokens
    ([3, 1, 9, 0], [20, 9, 30, 0], 3),  # mixed, padded
    ([1, 1, 1, 1], [41, 18, 91, 65], 0),  # decode again: a new step, a new plan
]
# On the GPU: several KV splits (long contexts at small batch) and several
# query tiles per request (long prefills), with padding.
STEPS_GPU = [
    ([1] * 6, [3000, 1, 2500, 17, 4000, 999], 0),
    ([1, 1, 1, 0], [5000, 3333, 64, 0], 5),
    ([300, 1, 77, 0], [1200, 4000, 77, 0], 9),
    ([1] * 6, [3001, 2, 2501, 18, 4001, 1000], 0),
]


def _meta(batch):
    from compile_backend.runner.attention_metadata import AttentionMetadata

    return AttentionMetadata(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        block_table=batch.block_table, slot_mapping=batch.slot_mapping,
        num_reqs=len(batch.q_lens), max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len)


def _run_direct_steps(steps, device, dtype, num_layers=3, H=8, KVH=2, D=64, bs=16, seed=0):
    """Each step: fresh metadata and inputs; each layer: the direct call into
    a poisoned output, against the checked launcher (bit-identical: the same
    kernels on the same inputs) and the reference (REL_TOL). Returns the
    steps' metadata objects."""
    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from compile_backend.kernels.unified_attention import unified_attention_direct

    g = gen(seed)
    metas = []
    for q_lens, seq_lens, pad in steps:
        batch = paged_batch(q_lens, seq_lens, bs, device, g, pad_tokens=pad)
        meta = _meta(batch)
        metas.append(meta)
        ctx = ForwardContext(attn_metadata={f"l{i}": meta for i in range(num_layers)}, trace=[])
        shape = (batch.num_blocks, bs, KVH, D)
        for i in range(num_layers):
            kc, vc = randn(shape, dtype, device, g), randn(shape, dtype, device, g)
            q = randn((batch.num_tokens, H, D), dtype, device, g)
            out = torch.full_like(q, float("nan"))
            with set_forward_context(ctx):
                unified_attention_direct(q, kc, vc, out, f"l{i}", D ** -0.5)
            checked = unified_attention(q, kc, vc, batch.query_start_loc, batch.seq_lens,
                                        batch.block_table, D ** -0.5, batch.max_query_len,
                                        batch.max_seq_len)
            assert torch.equal(out, checked), f"step {len(metas)} layer {i}: direct != checked"
            ref = unified_attention_ref(q.cpu().float(), kc.cpu().float(), vc.cpu().float(),
                                        batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                                        batch.block_table.cpu(), D ** -0.5)
            assert_close_rel(out, ref, dtype, f"step {len(metas)} layer {i}")
        assert [e for _, e in ctx.trace] == ["unified_attention"] * num_layers
    return metas


@pytest.mark.parametrize("device", DEVICES)
def test_direct_calls_over_steps(device, monkeypatch):
    """One full check and one plan per step (shared by the step's layers);
    every call equals the checked launcher and the reference; padding rows 0."""
    ua = importlib.import_module("compile_backend.kernels.unified_attention")  # the package exports a function so named
    checks = []
    real_check = ua._check
    monkeypatch.setattr(ua, "_check", lambda *a, **k: (checks.append(1), real_check(*a, **k)))
    steps = STEPS_SMALL if device == "cpu" else STEPS_GPU
    metas = _run_direct_steps(steps, device, torch.float32 if device == "cpu" else torch.bfloat16)
    # the checked launcher's own calls (one per layer) plus one per step's plan
    assert len(checks) == len(steps) * 3 + len(steps)
    assert all(len(m.attention_plans) == 1 for m in metas)


def test_plans_live_in_a_declared_metadata_field():
    """The plan cache is AttentionMetadata's declared field, which the kernels
    name by PLANS_FIELD (they never import the runner): no constructor
    argument, not in tensors(), repr or equality; a replace() copy starts
    empty. A metadata object without the field keeps no plans."""
    import dataclasses

    from compile_backend.kernels.attention_plan import PLANS_FIELD, find_plan, keep_plan
    from compile_backend.runner.attention_metadata import AttentionMetadata

    (f,) = [f for f in dataclasses.fields(AttentionMetadata) if f.name == PLANS_FIELD]
    assert f.default is None and not (f.init or f.repr or f.compare)
    batch = paged_batch([1, 2], [5, 9], 16, "cpu", gen(0))
    meta = _meta(batch)
    q = kc = torch.zeros(3, 2, 16)
    keep_plan(meta, "plan", q, kc, kc, q)
    assert find_plan(meta, q, kc, kc, q) == "plan" and find_plan(meta, q[:2], kc, kc, q[:2]) is None
    assert PLANS_FIELD not in meta.tensors() and PLANS_FIELD not in repr(meta)
    assert meta == _meta(batch) and dataclasses.replace(meta).attention_plans is None

    class Bare:  # a user's metadata class without the field
        pass

    bare = Bare()
    keep_plan(bare, "plan", q, kc, kc, q)
    assert find_plan(bare, q, kc, kc, q) is None and not hasattr(bare, PLANS_FIELD)


def test_plans_made_in_a_capture_are_the_captures_own():
    """While mrv2 captures a graph (ForwardContext.capture_plans set by
    runtime/cuda_graph.py), plans are kept in that capture's dict, per
    metadata object, and never on the metadata: a plan made in a capture
    holds the capture's scratch and stream, so no call outside it may find
    it, and one made outside is not found inside."""
    from compile_backend.core.forward_context import ForwardContext
    from compile_backend.kernels.attention_plan import find_plan, keep_plan

    batch = paged_batch([1, 2], [5, 9], 16, "cpu", gen(0))
    meta, other = _meta(batch), _meta(batch)
    q = kc = torch.zeros(3, 2, 16)
    ctx = ForwardContext(attn_metadata={"l": meta})
    keep_plan(meta, "step plan", q, kc, kc, q, ctx)  # no capture: the metadata's field
    ctx.capture_plans = {}
    assert find_plan(meta, q, kc, kc, q, ctx) is None
    keep_plan(meta, "capture plan", q, kc, kc, q, ctx)
    assert find_plan(meta, q, kc, kc, q, ctx) == "capture plan"
    assert find_plan(other, q, kc, kc, q, ctx) is None  # another metadata object
    assert list(meta.attention_plans.values()) == ["step plan"]
    ctx.capture_plans = None  # the capture ended
    assert find_plan(meta, q, kc, kc, q, ctx) == "step plan"


@pytest.mark.parametrize("device", DEVICES)
def test_direct_call_checks_misuse(device):
    """The first call of a step runs the launcher's checks: a bad output
    raises naming it, and so does one whose shape differs from a plan's."""
    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from compile_backend.kernels.unified_attention import unified_attention_direct

    g = gen(3)
    batch = paged_batch([1, 1], [20, 9], 16, device, g)
    kc = randn((batch.num_blocks, 16, 2, 16), torch.float32, device, g)
    q = randn((batch.num_tokens, 4, 16), torch.float32, device, g)
    ctx = ForwardContext(attn_metadata={"l": _meta(batch)})
    with set_forward_context(ctx):
        with pytest.raises(ValueError, match=r"output: expected shape \(2, 4, 16\)"):
            unified_attention_direct(q, kc, kc, q.new_empty(2, 4, 8), "l", 0.25)
        unified_attention_direct(q, kc, kc, torch.empty_like(q), "l", 0.25)  # builds the plan
        with pytest.raises(ValueError, match=r"output: expected dtype float32"):
            unified_attention_direct(q, kc, kc, q.half(), "l", 0.25)
        with pytest.raises(ValueError, match="key_cache"):
            unified_attention_direct(q, kc.half(), kc, torch.empty_like(q), "l", 0.25)


@pytest.mark.parametrize("device", DEVICES)
def test_direct_calls_under_debug_checks(device, monkeypatch):
    """With debug_checks on, every direct call runs the full checks."""
    from compile_backend.kernels import debug_checks

    ua = importlib.import_module("compile_backend.kernels.unified_attention")
    checks = []
    real_check = ua._check
    monkeypatch.setattr(ua, "_check", lambda *a, **k: (checks.append(1), real_check(*a, **k)))
    with debug_checks():
        _run_direct_steps(STEPS_SMALL[:2], device, torch.float32, num_layers=2)
    assert len(checks) == 2 * 2 * 2  # direct + checked launcher, every layer of every step


@pytest.mark.parametrize("device", DEVICES)
def test_op_writes_output(device):
    """Through the dispatcher: the op writes its out-parameter, checked."""
    from compile_backend.core.forward_context import ForwardContext, set_forward_context

    g = gen(4)
    batch = paged_batch([2, 1, 0], [12, 30, 0], 16, device, g, pad_tokens=2)
    kc = randn((batch.num_blocks, 16, 2, 16), torch.float32, device, g)
    vc = randn((batch.num_blocks, 16, 2, 16), torch.float32, device, g)
    q = randn((batch.num_tokens, 4, 16), torch.float32, device, g)
    out = torch.full_like(q, float("nan"))
    with set_forward_context(ForwardContext(attn_metadata={"l": _meta(batch)})):
        assert torch.ops.mrv2.unified_attention(q, kc, vc, out, "l", 0.25) is None
        with pytest.raises(ValueError, match="output: expected a 3-d tensor|output: expected shape"):
            torch.ops.mrv2.unified_attention(q, kc, vc, out[0], "l", 0.25)
    ref = unified_attention_ref(q.cpu(), kc.cpu(), vc.cpu(), batch.query_start_loc.cpu(),
                                batch.seq_lens.cpu(), batch.block_table.cpu(), 0.25)
    assert_close_rel(out, ref, torch.float32)
    assert (out[3:] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_direct_calls_bind_gpu():
    """On the GPU the direct path launches through bound launchers (Note
    [bound launch] in compile_backend/kernels/_launch.py): after a decode and a prefill step,
    each of the two kernels has one bound, none that failed to bind."""
    from compile_backend.kernels import _launch
    from compile_backend.kernels.unified_attention import (
        _decode_kernel, _decode_reduce_kernel, _decode_split_kernel, _prefill_kernel)

    _run_direct_steps(STEPS_GPU[:3], "cuda", torch.bfloat16)
    # Small batches take the two-launch decode on a GPU (one_launch_pays).
    one = any(k[0] is _decode_kernel for k in _launch._BOUND)
    decode = (_decode_kernel,) if one else (_decode_split_kernel, _decode_reduce_kernel)
    for kernel in (*decode, _prefill_kernel):
        bound = [v for k, v in _launch._BOUND.items() if k[0] is kernel]
        assert bound and all(v is not None for v in bound), (kernel, _launch._logged)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_direct_calls_with_launch_hook_gpu(monkeypatch):
    """A Triton launch hook (a profiler) turns the plans off: every launch
    goes through Triton and the hook sees it; results unchanged."""
    import triton

    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: seen.append(1))
    _run_direct_steps(STEPS_GPU[:2], "cuda", torch.bfloat16, num_layers=2)
    assert len(seen) >= 2 * 2 * 2  # 2 steps x 2 layers x (direct + checked), one launch each


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_direct_call_in_cuda_graph():
    """A step's plan (built by an eager call) is not used while a CUDA graph
    is captured: the captured call allocates its own scratch in the graph's
    pool, and the replay on new values equals the reference."""
    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from compile_backend.kernels.unified_attention import unified_attention_direct

    g, batch, kc, vc, q = _gpu_decode(seed=12, seq_len=2000)
    out = torch.full_like(q, float("nan"))
    ctx = ForwardContext(attn_metadata={"l": _meta(batch)})
    with set_forward_context(ctx):
        unified_attention_direct(q, kc, vc, out, "l", 0.1)  # eager: builds the plan
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            unified_attention_direct(q, kc, vc, out, "l", 0.1)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            unified_attention_direct(q, kc, vc, out, "l", 0.1)
    batch.seq_lens.copy_(torch.tensor([2000 - 211 * i for i in range(8)], dtype=torch.int32))
    q.copy_(randn(q.shape, q.dtype, "cuda", g))
    out.fill_(float("nan"))
    graph.replay()
    _assert_matches_ref(out, q, kc, vc, batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("seq_len", [2000, 300])
def test_plans_inside_mrv2_captures_gpu(seq_len, monkeypatch):
    """Inside a capture mrv2 started (ForwardContext.capture_plans, as
    runtime/cuda_graph.py sets it, on the warmed capture stream), the first
    layer's call checks and builds a plan that the other layers use (bound
    launches, the plan's scratch from the graph's pool); the plan stays the
    capture's. Replays on new lengths and queries: every layer equals the
    reference. Several layers' launches share the decode scratch, one after
    the other on the stream, as in eager steps."""
    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from compile_backend.runtime import graph_pool

    ua = importlib.import_module("compile_backend.kernels.unified_attention")
    checks = []
    real_check = ua._check
    monkeypatch.setattr(ua, "_check", lambda *a, **k: (checks.append(1), real_check(*a, **k)))
    g, batch, kc0, vc0, q0 = _gpu_decode(seed=13, seq_len=seq_len)
    layers = [(kc0, vc0, q0)] + [(torch.randn_like(kc0), torch.randn_like(vc0), torch.randn_like(q0))
                                 for _ in range(2)]
    outs = [torch.full_like(q0, float("nan")) for _ in layers]
    meta = _meta(batch)
    ctx = ForwardContext(attn_metadata={f"l{i}": meta for i in range(3)})

    def step():
        for i, ((kc, vc, q), out) in enumerate(zip(layers, outs)):
            ua.unified_attention_direct(q, kc, vc, out, f"l{i}", 0.1)

    with set_forward_context(ctx):
        step()  # eager: compiles, builds the step's plan
        torch.cuda.synchronize()
        graph_pool.warm_capture_stream()
        checks.clear()
        ctx.capturing, ctx.capture_plans = True, {}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=graph_pool.capture_stream()):
            step()
        assert len(checks) == 1 and len(ctx.capture_plans) == 1, (checks, ctx.capture_plans)
        ctx.capturing, ctx.capture_plans = False, None
    assert meta.attention_plans is not None and len(meta.attention_plans) == 1  # the eager one
    for r in range(2):
        lens = [max(1, seq_len - 97 * i - 13 * r) for i in range(8)]
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for kc, vc, q in layers:
            q.copy_(randn(q.shape, q.dtype, "cuda", g))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for (kc, vc, q), out in zip(layers, outs):
            _assert_matches_ref(out, q, kc, vc, batch)
