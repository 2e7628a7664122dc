"""mrv2::kv_compress against its torch reference and against the definition
(softmax over a group's scores, computed directly); one step == several steps
with the state carried (bit-exact in fp32, REL_TOL otherwise).

Tolerances: per-token outputs and cache entries within kernel_cases.REL_TOL
(fp32 state; outputs rounded once to the key dtype)."""

import pytest
import torch

from kernel_cases import (stable_seed, DEVICES, DTYPE_IDS, DTYPES, GPU_HEAD_DIMS, assert_close_rel, gen, paged_batch,
                          randn, search_in_steps)
from compile_backend.kernels.kv_compress import kv_compress, kv_compress_ref

KVH = 2
NUM_SLOTS = 5


def _state(num_slots, D, device, g):
    # Random (not empty) state: a kernel that reads it where it must not shows.
    return (randn((num_slots, KVH), torch.float32, device, g),
            randn((num_slots, KVH), torch.float32, device, g).abs() + 0.5,
            randn((num_slots, KVH, D), torch.float32, device, g))


# name: (q_lens, seq_lens, state_indices, padding tokens)
CASES = {
    "prefill_from_zero": ([13, 8], [13, 8], [1, 3], 0),
    "decode_mid_group": ([1, 1, 1], [6, 8, 9], [0, 2, 4], 0),
    "mixed_continuing": ([1, 11, 3], [22, 17, 3], [4, 0, 2], 0),
    "padding_rows": ([6, 1, 0, 0], [10, 7, 0, 0], [2, 1, -1, -1], 3),
    "long_crossing_blocks": ([150], [157], [3], 0),
    # one token per request (the decode shortcut), a stateless request, padding
    "decode_padding": ([1, 1, 1, 0], [6, 3, 9, 0], [0, -1, 4, -1], 2),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.slow_on_cpu)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ratio", [4, 3])
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow_on_cpu)
                                  if c == "long_crossing_blocks" else c for c in CASES])
def test_matches_reference(case, ratio, dtype, head_dim, device, max_query_len=None):
    q_lens, seq_lens, idx, pad = CASES[case]
    g = gen(stable_seed(case, ratio, head_dim))
    bs = 4  # compressed-cache block size: long requests cross several blocks
    batch = paged_batch(q_lens, seq_lens, bs, device, g, pad_tokens=pad, entries_per_pos=ratio)
    T = batch.num_tokens
    key = randn((T, KVH, head_dim), dtype, device, g)
    score = randn((T, KVH), dtype, device, g, scale=2.0)
    cache = randn((batch.num_blocks, bs, KVH, head_dim), dtype, device, g)
    state = _state(NUM_SLOTS, head_dim, device, g)
    cache_r, state_r = cache.clone().cpu(), [s.clone().cpu() for s in state]
    state_indices = torch.tensor(idx, dtype=torch.int32, device=device)
    poisoned = torch.full_like(key, float("nan"))  # every row must be written
    out = kv_compress(key, score, cache, *state, batch.query_start_loc, batch.seq_lens,
                      state_indices, batch.block_table, ratio,
                      batch.max_query_len if max_query_len is None else max_query_len, out=poisoned)
    assert out is poisoned
    ref = kv_compress_ref(key.cpu(), score.cpu(), cache_r, *state_r, batch.query_start_loc.cpu(),
                          batch.seq_lens.cpu(), state_indices.cpu(), batch.block_table.cpu(), ratio)
    assert_close_rel(out, ref, dtype, "per-token output")
    assert_close_rel(cache, cache_r, dtype, "compressed cache")
    for name, a, b in zip(("max", "sum", "acc"), state, state_r):
        assert torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6), f"state_{name}"
    assert (out[int(batch.query_start_loc[-1]):] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [4, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_small_head_sizes(dtype, head_dim, device):
    """Head sizes below 16 and not powers of two (masked [BLOCK_D] vectors)."""
    test_matches_reference("mixed_continuing", 3, dtype, head_dim, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["mixed_continuing", "padding_rows", "decode_padding"])
def test_padded_bound_and_search(case, device, monkeypatch):
    """max_query_len = the padded token count (what PIECEWISE passes): the
    grid scales with T (Note [request tiles]); a search chunk of 2 requests
    makes each program scan query_start_loc in several steps."""
    search_in_steps(monkeypatch, "compile_backend.kernels.kv_compress")
    q_lens, _, _, pad = CASES[case]
    test_matches_reference(case, 3, torch.float32, 64, device, max_query_len=sum(q_lens) + pad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("head_dim", GPU_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_sizes_gpu(dtype, head_dim):
    for case in CASES:
        test_matches_reference(case, 4, dtype, head_dim, "cuda")


def _definition(key, score, ratio):
    """Per-token running value and complete groups' entries, straight from the
    definition, for one sequence starting at position 0. key [L, H, D]."""
    L = key.shape[0]
    out = torch.empty(key.shape, dtype=torch.float64)
    groups = []
    for p in range(L):
        g0 = (p // ratio) * ratio
        w = torch.softmax(score[g0: p + 1].double(), dim=0)  # [n, H]
        out[p] = (w[..., None] * key[g0: p + 1].double()).sum(0)
        if p % ratio == ratio - 1:
            groups.append(out[p])
    return out, groups


def _run_steps(keys, scores, steps, ratio, dtype, device, bs=4):
    """Requests' sequences (from position 0) fed in `steps` chunks, batched."""
    D = keys[0].shape[-1]
    B = len(keys)
    n_groups = [k.shape[0] // ratio for k in keys]
    table = torch.zeros(B, max(n_groups) // bs + 2, dtype=torch.int32)
    for b in range(B):
        table[b, : table.shape[1]] = torch.arange(b * table.shape[1], (b + 1) * table.shape[1]) + 1
    table = table.to(device)
    cache = torch.zeros(B * table.shape[1] + 1, bs, KVH, D, dtype=dtype, device=device)
    state = [torch.full((B, KVH), float("nan"), device=device),
             torch.full((B, KVH), float("nan"), device=device),
             torch.full((B, KVH, D), float("nan"), device=device)]
    outs = [[] for _ in range(B)]
    done = [0] * B
    for s in range(max(len(st) for st in steps)):
        q_lens = [st[s] if s < len(st) else 0 for st in steps]
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        seq_lens = torch.tensor([done[b] + q_lens[b] for b in range(B)], dtype=torch.int32, device=device)
        idx = torch.tensor([b if q else -1 for b, q in enumerate(q_lens)], dtype=torch.int32, device=device)
        key = torch.cat([k[done[b]: done[b] + q_lens[b]] for b, k in enumerate(keys)])
        score = torch.cat([sc[done[b]: done[b] + q_lens[b]] for b, sc in enumerate(scores)])
        out = kv_compress(key, score, cache, *state, qsl, seq_lens, idx, table, ratio, max(q_lens))
        for b in range(B):
            outs[b].append(out[int(qsl[b]):int(qsl[b + 1])])
            done[b] += q_lens[b]
    return [torch.cat(o) for o in outs], cache, state, table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ratio", [4, 5])
def test_one_step_equals_many_steps_and_definition(ratio, dtype, device):
    g = gen(41 + ratio)
    D = 64
    lens = [27, 9, 1]
    keys = [randn((n, KVH, D), dtype, device, g) for n in lens]
    scores = [randn((n, KVH), dtype, device, g, scale=2.0) for n in lens]
    one = _run_steps(keys, scores, [[n] for n in lens], ratio, dtype, device)
    many = _run_steps(keys, scores, [[1, 2, 6, 1, 1, 13, 3], [3, 1, 1, 4], [1]], ratio, dtype, device)
    for a, b in zip(one[0], many[0]):
        if dtype == torch.float32:
            assert torch.equal(a, b)
        else:
            assert_close_rel(b, a, dtype)
    if dtype == torch.float32:
        assert torch.equal(one[1], many[1])
        for sa, sb in zip(one[2], many[2]):
            assert torch.equal(sa, sb)
    # Both equal the definition.
    outs, cache, _, table = many
    for b, (k, sc) in enumerate(zip(keys, scores)):
        want, groups = _definition(k.cpu(), sc.cpu(), ratio)
        assert_close_rel(outs[b], want, dtype, "definition")
        for gi, entry in enumerate(groups):
            blk = int(table[b, gi // 4])
            assert_close_rel(cache[blk, gi % 4], entry, dtype, f"group {gi}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("bound", ["exact", "padded"])
def test_large_gpu(bound):
    """Many groups per request and > SEARCH requests; `padded` passes
    max_query_len = T, as PIECEWISE does."""
    g = gen(9)
    D, ratio = 128, 4
    q_lens = [4096, 1, 1, 333] + [1] * 300
    seq_lens = [4096, 5001, 77, 1000] + [2000 + i for i in range(300)]
    batch = paged_batch(q_lens, seq_lens, 16, "cuda", g, pad_tokens=3, entries_per_pos=ratio)
    T = batch.num_tokens
    key = randn((T, KVH, D), torch.bfloat16, "cuda", g)
    score = randn((T, KVH), torch.bfloat16, "cuda", g, scale=2.0)
    cache = torch.zeros(batch.num_blocks, 16, KVH, D, dtype=torch.bfloat16, device="cuda")
    state = _state(len(q_lens), D, "cuda", g)
    cache_r, state_r = cache.clone(), [s.clone() for s in state]
    idx = torch.arange(len(q_lens), dtype=torch.int32, device="cuda")
    out = kv_compress(key, score, cache, *state, batch.query_start_loc, batch.seq_lens, idx,
                      batch.block_table, ratio, batch.max_query_len if bound == "exact" else T,
                      out=torch.full_like(key, float("nan")))
    ref = kv_compress_ref(key, score, cache_r, *state_r, batch.query_start_loc, batch.seq_lens,
                          idx, batch.block_table, ratio)
    assert_close_rel(out, ref, torch.bfloat16)
    assert_close_rel(cache, cache_r, torch.bfloat16)
