"""Unified paged attention over a mixed batch (the breakpoint op).

query [T, H, D] -> out [T, H, D]. Request b owns queries qsl[b]:qsl[b+1] and
attends causally to its first seq_lens[b] cached tokens, found through
block_table[b] in caches [num_blocks, block_size, KVH, D]. The query at index i
of a request with q_len queries sits at position seq_lens[b] - q_len + i and
sees keys at positions <= that. Grouped-query attention: query head h reads kv
head h // (H // KVH).

Two paths, picked by the Python int `max_query_len`:
  * prefill / mixed (max_query_len > 1): one program per (request, query tile,
    kv head); the tile's rows are BLOCK_Q tokens x the kv head's query heads.
  * decode (max_query_len == 1): split-KV ("flash decoding"): one program per
    (request, kv head, split) writes a partial result, a reduce kernel merges
    the splits. The number of splits comes from num_reqs, KVH, max_seq_len and
    the SM count, never from tensor values (the op runs inside CUDA graphs).

Output rows of tokens that belong to no request (padding beyond qsl[B]) are 0.
Configs are chosen by functions, not autotuned: autotuning would benchmark
during the first call, which may be a CUDA-graph capture.

Note [dot tiles]: on the GPU, `tl.dot` needs every dimension >= 16 (the
interpreter does not check). The head dimension of every tile (BLOCK_D) is
padded to at least 16, its extra columns masked to 0 on load and never
stored, so any head size from 1 to MAX_HEAD_DIM works; the row tiles
(BLOCK_M, BLOCK_H) and key tiles (TILE_N) are at least 16 too.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from compile_backend.core.direct_calls import direct_custom_op

from ._common import (
    FLOAT_DTYPES, cdiv, check_device, check_ids, check_int, check_kv_caches, check_tensor,
    dot_precision, interpreting, layer_metadata, next_pow2, upcast_dots, use_triton,
)

LOG2E = 1.4426950408889634
# Smallest number of keys a split should own; below this the reduce costs more
# than the extra parallelism gains.
MIN_SPLIT_LEN = 256
MAX_SPLITS = 128
# Note [dot tiles]: the smallest tl.dot dimension on the GPU.
DOT_MIN = 16
# Largest head size: a program holds [BLOCK_M, BLOCK_D] fp32 accumulators and
# stages [TILE_N, BLOCK_D] key/value tiles in shared memory.
MAX_HEAD_DIM = 256


@triton.jit
def _kv_tile_step(
    q, m, l, acc, q_pos, k_cache_ptr, v_cache_ptr, bt_row, start, end, kvh, d, d_ok,
    scale_log2, stride_c_blk, stride_c_off, stride_c_h,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the paged keys [start, start + TILE_N)
    (those below `end`) for R query rows, shared by prefill and decode.
    q [R, BLOCK_D]; m, l [R] (running max, in log2 units, and sum); acc
    [R, BLOCK_D]; q_pos [R] absolute query positions, read only when CAUSAL
    (a key is visible to a row at or before its position). Returns m, l, acc."""
    pos = start + tl.arange(0, TILE_N)
    pos_ok = pos < end
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    kv_off = blk * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_off + kvh * stride_c_h
    kv_mask = pos_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [R, TILE_N]
    if CAUSAL:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_ok[None, :], s, float("-inf"))
    else:
        s = tl.where(pos_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    q_tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - q_len

    # Rows: BLOCK_Q tokens x QUERIES_PER_KV heads (rows past BLOCK_Q*QPK unused).
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // QUERIES_PER_KV  # index within the request
    head = kvh * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + tok  # absolute position of each row's query

    # Keys this tile can see: up to the position of its last valid query.
    last_tok = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    kv_end = tl.where(last_tok > q_tile * BLOCK_Q, tl.minimum(context_len + last_tok, seq_len), 0)

    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    for start in range(0, kv_end, TILE_N):
        m, l, acc = _kv_tile_step(
            q, m, l, acc, q_pos, k_cache_ptr, v_cache_ptr, bt_row, start, kv_end, kvh, d, d_ok,
            scale_log2, stride_c_blk, stride_c_off, stride_c_h,
            BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, CAUSAL=True, UPCAST=UPCAST,
            DOT_PRECISION=DOT_PRECISION)

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64)
    tl.store(out_ptr + o_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2,
    stride_q_t, stride_q_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
    QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.where(q_len > 0, tl.load(seq_lens_ptr + b), 0)
    # Each split owns a TILE_N-aligned range of this request's own keys.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    hr = tl.arange(0, BLOCK_H)
    head = kvh * QUERIES_PER_KV + hr
    h_ok = hr < QUERIES_PER_KV
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                mask=(hr < tl.where(q_len > 0, QUERIES_PER_KV, 0))[:, None] & d_ok[None, :],
                other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    for start in range(lo, hi, TILE_N):
        # one query token: every key of the split is visible (q_pos unused)
        m, l, acc = _kv_tile_step(
            q, m, l, acc, m, k_cache_ptr, v_cache_ptr, bt_row, start, hi, kvh, d, d_ok,
            scale_log2, stride_c_blk, stride_c_off, stride_c_h,
            BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, CAUSAL=False, UPCAST=UPCAST,
            DOT_PRECISION=DOT_PRECISION)

    pm = b.to(tl.int64) * stride_pm_b + head * stride_pm_h + split
    tl.store(part_m_ptr + pm, m, mask=h_ok)
    tl.store(part_l_ptr + pm, l, mask=h_ok)
    pa = b.to(tl.int64) * stride_pa_b + head[:, None] * stride_pa_h + split * stride_pa_s + d[None, :]
    tl.store(part_acc_ptr + pa, acc, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, qsl_ptr,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
    stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pm = b.to(tl.int64) * stride_pm_b + head * stride_pm_h + sp
    m = tl.load(part_m_ptr + pm, mask=s_ok, other=-1.0e30)
    l = tl.load(part_l_ptr + pm, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp2(m - m_all)  # empty splits: m = -1e30 => weight 0
    denom = tl.sum(l * w, 0)
    pa = b.to(tl.int64) * stride_pa_b + head * stride_pa_h + sp[:, None] * stride_pa_s + d[None, :]
    acc = tl.load(part_acc_ptr + pa, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_o_t + head * stride_o_h + d,
             out.to(out_ptr.dtype.element_ty), mask=d < tl.where(q_len > 0, HEAD_DIM, 0))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: any small number


def num_kv_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits for the decode path: enough (request, kv head, split) programs
    for about four per SM, but no split shorter than MIN_SPLIT_LEN keys."""
    want = cdiv(4 * _sm_count(device), max(num_reqs * num_kv_heads, 1))
    by_len = max(1, cdiv(max_seq_len, MIN_SPLIT_LEN))
    return max(1, min(want, by_len, MAX_SPLITS))


def _dot_dim(n: int) -> int:
    """A tl.dot tile dimension covering n: a power of two >= DOT_MIN."""
    return max(DOT_MIN, next_pow2(n))


def _tiles(head_dim: int, dtype: torch.dtype) -> dict:
    if interpreting():  # small tiles: more loop trips, cheap to interpret
        return dict(BLOCK_M=16, TILE_N=32, num_warps=4, num_stages=1)
    big = head_dim > 128 or dtype == torch.float32
    # fp32 heads over 128: one stage keeps the [TILE_N, 256] fp32 key/value
    # tiles within shared memory (stages change no numerics).
    stages = 1 if head_dim > 128 and dtype == torch.float32 else 2 if big else 3
    return dict(BLOCK_M=64, TILE_N=32 if big else 64, num_warps=4, num_stages=stages)


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Launcher. query [T, H, D] (last dim contiguous); caches
    [num_blocks, block_size, KVH, D] contiguous, query's dtype; query_start_loc
    [B+1] int32; seq_lens [B] int32; block_table [B, max_blocks] int32.
    `max_query_len` / `max_seq_len` bound the batch (Python ints, shape the
    grid); `num_splits` overrides the decode split count and `config` the
    tiles (BLOCK_M, TILE_N, num_warps, num_stages) for tests and benchmarks;
    tile sizes are rounded up to powers of two >= 16 (Note [dot tiles]).

    Index checks (kernels/_common.py, Note [index checks]) run for CPU tensors,
    and for CUDA ones under `set_debug_checks(True)`. Without them the kernels
    trust that query_start_loc stays within the T tokens, that each request
    with queries has seq_len >= its query count and within its block_table
    row, and that the block ids it reads (its first ceil(seq_len /
    block_size)) lie in [0, num_blocks); anything else reads other memory."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_device("query", query)
    T, H, D = query.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"query: expected a head size in [1, {MAX_HEAD_DIM}], got {D} "
                         f"(shape {tuple(query.shape)})")
    check_kv_caches(key_cache, value_cache, dtype=query.dtype, dtype_of="query", device=device,
                    shape=(None, None, None, D))
    KVH, block_size = key_cache.shape[2], key_cache.shape[1]
    if KVH == 0 or H % KVH != 0:
        raise ValueError(f"query: expected a number of heads divisible by the cache's {KVH} kv heads, got {H}")
    if block_size & (block_size - 1):
        raise ValueError(f"key_cache: expected a power-of-two block size, got {block_size}")
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    B = query_start_loc.shape[0] - 1
    check_tensor("seq_lens", seq_lens, shape=(B,), dtypes=(torch.int32,), device=device)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device,
                 last_dim_contiguous=True)
    check_tensor("block_table", block_table, shape=(B, None))
    check_int("max_query_len", max_query_len, 0)
    check_int("max_seq_len", max_seq_len, 0)
    check_ids("unified_attention", num_tokens=T, query_start_loc=query_start_loc,
              seq_lens=seq_lens, block_table=block_table, cache=("key_cache", key_cache))

    out = torch.zeros_like(query)  # padding tokens stay 0
    if B <= 0 or max_query_len == 0 or T == 0:
        return out
    qpk = H // KVH
    scale_log2 = float(scale) * LOG2E
    cfg = {**_tiles(D, query.dtype), **(config or {})}
    tile_n = _dot_dim(cfg["TILE_N"])
    common = dict(HEAD_DIM=D, BLOCK_D=_dot_dim(D), BLOCK_SIZE=block_size,
                  UPCAST=upcast_dots(query.dtype), DOT_PRECISION=dot_precision(query.dtype))
    if max_query_len == 1:
        S = num_splits or num_kv_splits(B, KVH, max_seq_len, device)
        # One scratch allocation: [B, H, S, D] partial sums, then [B, H, S] max and sum.
        scratch = torch.empty(B * H * S * (D + 2), dtype=torch.float32, device=device)
        part_acc = scratch[: B * H * S * D].view(B, H, S, D)
        part_m = scratch[B * H * S * D: B * H * S * (D + 1)].view(B, H, S)
        part_l = scratch[B * H * S * (D + 1):].view(B, H, S)
        _decode_split_kernel[(B, KVH, S)](
            query, key_cache, value_cache, part_acc, part_m, part_l,
            query_start_loc, seq_lens, block_table, scale_log2,
            query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_m.stride(0), part_m.stride(1),
            QUERIES_PER_KV=qpk, BLOCK_H=_dot_dim(qpk), TILE_N=tile_n,
            NUM_SPLITS=S, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
        )
        _decode_reduce_kernel[(B, H)](
            part_acc, part_m, part_l, out, query_start_loc,
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_m.stride(0), part_m.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=D, BLOCK_D=next_pow2(D), NUM_SPLITS=S, BLOCK_S=next_pow2(S),
            num_warps=4,
        )
        return out

    block_m = max(_dot_dim(cfg["BLOCK_M"]), next_pow2(qpk))
    block_q = block_m // qpk
    grid = (B, cdiv(max_query_len, block_q), KVH)
    _prefill_kernel[grid](
        query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, scale_log2,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        QUERIES_PER_KV=qpk, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
    )
    return out


def unified_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch, one request at a time, math in fp32 (fp64 for fp64 input).
    Index checks as in `unified_attention`."""
    T, H, D = query.shape
    check_ids("unified_attention", num_tokens=T, query_start_loc=query_start_loc,
              seq_lens=seq_lens, block_table=block_table, cache=("key_cache", key_cache))
    _, block_size, KVH, _ = key_cache.shape
    acc_dtype = torch.promote_types(query.dtype, torch.float32)
    out = torch.zeros_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q0, q1, S = qsl[b], qsl[b + 1], lens[b]
        L = q1 - q0
        if L <= 0 or S <= 0:
            continue
        blocks = block_table[b, : math.ceil(S / block_size)].long()
        k = key_cache[blocks].reshape(-1, KVH, D)[:S].to(acc_dtype)
        v = value_cache[blocks].reshape(-1, KVH, D)[:S].to(acc_dtype)
        k = k.repeat_interleave(H // KVH, dim=1)  # [S, H, D]
        v = v.repeat_interleave(H // KVH, dim=1)
        q = query[q0:q1].to(acc_dtype)  # [L, H, D]
        s = torch.einsum("lhd,shd->hls", q, k) * scale
        q_pos = torch.arange(S - L, S, device=query.device)
        visible = torch.arange(S, device=query.device)[None, :] <= q_pos[:, None]  # [L, S]
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[q0:q1] = torch.einsum("hls,shd->lhd", p, v).to(query.dtype)
    return out


def unified_attention_impl(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layer_name: str,
    scale: float,
) -> torch.Tensor:
    meta = layer_metadata(layer_name, "unified_attention")  # AttentionMetadata
    if use_triton(query):
        return unified_attention(
            query, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
            meta.block_table, scale, meta.max_query_len, meta.max_seq_len,
        )
    return unified_attention_ref(
        query, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
        meta.block_table, scale,
    )


# Eager pieces call it without the dispatcher (compile_backend/core/direct_calls.py).
unified_attention_op = direct_custom_op(
    "mrv2::unified_attention",
    mutates_args=(),
    schema="(Tensor query, Tensor key_cache, Tensor value_cache, str layer_name, float scale) "
    "-> Tensor",
)(unified_attention_impl)


@unified_attention_op.register_fake
def _(query, key_cache, value_cache, layer_name, scale):
    return torch.empty_like(query)
