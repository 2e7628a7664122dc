"""mrv2::unified_attention against its torch reference (rel. error per
dtype: kernel_cases.REL_TOL), over decode, prefill, mixed, padded and long
batches and head sizes from 1 to MAX_HEAD_DIM."""

import os

import pytest
import torch

from kernel_cases import (stable_seed, DEVICES, DTYPE_IDS, DTYPES, GPU_HEAD_DIMS, SMALL_HEAD_DIMS, assert_close_rel,
                          gen, paged_batch, randn)
from kernels.unified_attention import (MAX_HEAD_DIM, num_kv_splits, unified_attention,
                                       unified_attention_ref)

@pytest.fixture(autouse=True)
def _gpu_dot_limits(monkeypatch):
    """Triton's interpreter accepts tl.dot of any size; the GPU needs every
    dimension >= 16 (Note [dot tiles]). Make the interpreter check that too."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import interpreter_builder

        monkeypatch.setitem(interpreter_builder.codegen_fns, "min_dot_size", lambda a, b: (16, 16, 16))


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
         num_splits=None):
    q_lens, seq_lens, pad = CASES[case] if isinstance(case, str) else case
    g = gen(seed)
    batch = paged_batch(q_lens, seq_lens, block_size, device, g, pad_tokens=pad)
    shape = (batch.num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = randn(shape, dtype, device, g)
    v_cache = randn(shape, dtype, device, g)
    query = randn((batch.num_tokens, num_heads, head_dim), dtype, device, g)
    scale = head_dim ** -0.5
    out = unified_attention(query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                            batch.block_table, scale, batch.max_query_len, batch.max_seq_len,
                            num_splits=num_splits)
    ref = unified_attention_ref(query.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(),
                                batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                                batch.block_table.cpu(), scale)
    n = int(batch.query_start_loc[-1])
    assert torch.isfinite(out).all()
    assert (out[n:] == 0).all(), "padding tokens must get zeros"
    return out, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
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
    kernels/unified_attention.py): the split-KV decode and the prefill kernel,
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
    """Splits of uneven coverage (some empty for the short request) merge exactly."""
    out, ref = _run("long_decode", torch.float32, 64, device, seed=7, num_splits=num_splits)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_decode_in_cuda_graph():
    """Captured once, replayed on new seq_lens/queries: no host syncs, and the
    grid does not depend on tensor values."""
    g = gen(5)
    dtype, D, H, KVH, bs = torch.bfloat16, 128, 8, 2, 16
    batch = paged_batch([1] * 8, [1000] * 8, bs, "cuda", g)
    kc = randn((batch.num_blocks, bs, KVH, D), dtype, "cuda", g)
    vc = randn((batch.num_blocks, bs, KVH, D), dtype, "cuda", g)
    q = randn((8, H, D), dtype, "cuda", g)
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
    q.copy_(randn((8, H, D), dtype, "cuda", g))
    graph.replay()
    ref = unified_attention_ref(q.float().cpu(), kc.float().cpu(), vc.float().cpu(),
                                batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                                batch.block_table.cpu(), 0.1)
    assert_close_rel(out, ref, dtype)
