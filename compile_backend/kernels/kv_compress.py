"""KV compressor (DeepSeek-V4 style; attention-like, carries state).

key [T, KVH, D], score [T, KVH] -> out [T, KVH, D]. Request b's tokens sit at
positions seq_lens[b] - q_len ... seq_lens[b] - 1; position p is in group
p // ratio. A group's compressed entry is sum_i softmax(score)_i * key_i over
its `ratio` tokens; it is written to compressed_cache
[num_blocks, block_size, KVH, D] at slot
block_table[b, g // block_size] * block_size + g % block_size once complete.
A group still open at the end of the step is carried in per-request fp32
state (online softmax): state_max [S, KVH], state_sum [S, KVH], state_acc
[S, KVH, D]. out[t] is the running value of t's group up to and including t
(acc / sum). Padding rows (state index -1) touch no state or cache; tokens
outside a request output 0. One step and the same tokens over several give
bit-identical fp32 results. docs/design.md, section "Ops with per-request state".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import OpRole, register_op

from ._checks import (
    FLOAT_DTYPES, check_device, check_ids, check_int, check_paged_metadata, check_tensor,
)
from ._device import BATCH_INTS, SEARCH, next_pow2, request_grid, request_tile, use_triton
from ._metadata import layer_metadata


@triton.jit(do_not_specialize=BATCH_INTS)
def _kv_compress_kernel(
    key_ptr, score_ptr, cache_ptr, state_max_ptr, state_sum_ptr, state_acc_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, state_idx_ptr, block_table_ptr, num_reqs, num_tokens,
    stride_k_t, stride_k_h, stride_sc_t, stride_sc_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    stride_sm_slot, stride_sa_slot, stride_sa_h,
    RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ONE_TOKEN: tl.constexpr, SEARCH: tl.constexpr,
):
    # Programs (tile j of request b, kv head h) over tiles of RATIO tokens
    # (Note [request tiles] in _device.py): program j folds local group j of
    # request b. Program j == 0 owns the state: it folds the first group
    # (which may continue the carried state) and, when the step spans several
    # groups, also the last one (whose end state is carried on), so reads and
    # writes of a slot's state happen in one program. A request has at least
    # n_groups - 1 programs. Tokens of requests without a state (and of the
    # padding pseudo-request) get output 0: tile j writes its RATIO rows.
    h = tl.program_id(1)
    b, q_start, q_len, j, pad_row = request_tile(qsl_ptr, num_reqs, num_tokens, RATIO, SEARCH,
                                                 ONE_TOKEN)
    seq_len = tl.load(seq_lens_ptr + b, mask=b < num_reqs, other=0)
    slot = tl.load(state_idx_ptr + b, mask=b < num_reqs, other=-1).to(tl.int64)
    real = (slot >= 0) & (q_len > 0)
    start_pos = seq_len - q_len
    g0 = start_pos // RATIO
    n_groups = tl.where(real, (seq_len - 1) // RATIO - g0 + 1, 0)

    # Pass A: local group j (j == 0 always; 0 < j < n_groups - 1 otherwise).
    ga = g0 + j
    a_on = real & ((j == 0) | (j < n_groups - 1))
    lo_a = tl.where(a_on, tl.maximum(start_pos, ga * RATIO), 0)
    hi_a = tl.where(a_on, tl.minimum(seq_len, (ga + 1) * RATIO), 0)
    # Pass B: the last group, by program 0, when there are several.
    b_on = real & (j == 0) & (n_groups > 1)
    gb = g0 + n_groups - 1
    lo_b = tl.where(b_on, gb * RATIO, 0)
    hi_b = tl.where(b_on, seq_len, 0)
    len_a = hi_a - lo_a
    n_steps = len_a + hi_b - lo_b

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    owns_state = real & (j == 0)
    carry_in = owns_state & (start_pos % RATIO != 0)
    sm_off = slot * stride_sm_slot + h
    m = tl.load(state_max_ptr + sm_off, mask=carry_in, other=float("-inf"))
    ssum = tl.load(state_sum_ptr + sm_off, mask=carry_in, other=0.0)
    sa_off = slot * stride_sa_slot + h * stride_sa_h + d
    # Note [scalar masks] in _device.py: scalar conditions enter as bounds.
    acc = tl.load(state_acc_ptr + sa_off, mask=d < tl.where(carry_in, HEAD_DIM, 0), other=0.0)

    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    for i in range(0, n_steps):
        pos = tl.where(i < len_a, lo_a + i, lo_b + (i - len_a))
        t = (q_start + pos - start_pos).to(tl.int64)
        group_start = pos % RATIO == 0
        m = tl.where(group_start, float("-inf"), m)
        ssum = tl.where(group_start, 0.0, ssum)
        acc = tl.where(group_start, 0.0, acc)
        k = tl.load(key_ptr + t * stride_k_t + h * stride_k_h + d, mask=d_ok, other=0.0).to(tl.float32)
        sc = tl.load(score_ptr + t * stride_sc_t + h * stride_sc_h).to(tl.float32)
        m_new = tl.maximum(m, sc)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(sc - m_new)
        ssum = ssum * alpha + beta
        acc = acc * alpha + beta * k
        m = m_new
        val = acc / ssum
        tl.store(out_ptr + t * stride_o_t + h * stride_o_h + d,
                 val.to(out_ptr.dtype.element_ty), mask=d_ok)
        done = pos % RATIO == RATIO - 1  # the group is complete: into the cache
        g = pos // RATIO
        blk = tl.load(bt_row + g // BLOCK_SIZE, mask=done, other=0).to(tl.int64)
        c_off = blk * stride_c_blk + (g % BLOCK_SIZE) * stride_c_off + h * stride_c_h + d
        tl.store(cache_ptr + c_off, val.to(cache_ptr.dtype.element_ty),
                 mask=d < tl.where(done, HEAD_DIM, 0))

    # Note [read before write]: all threads' state reads precede the writes.
    tl.debug_barrier()
    tl.store(state_max_ptr + sm_off, m, mask=owns_state)
    tl.store(state_sum_ptr + sm_off, ssum, mask=owns_state)
    tl.store(state_acc_ptr + sa_off, acc, mask=d < tl.where(owns_state, HEAD_DIM, 0))

    # Zero rows: this tile's tokens when the request folds none, and pad_row.
    zero = tl.zeros([BLOCK_D], out_ptr.dtype.element_ty)
    n_zero = tl.where(real, 0, tl.minimum(tl.maximum(q_len - j * RATIO, 0), RATIO))
    for i in range(0, n_zero):
        t = (q_start + j * RATIO + i).to(tl.int64)
        tl.store(out_ptr + t * stride_o_t + h * stride_o_h + d, zero, mask=d_ok)
    if ONE_TOKEN:
        tl.store(out_ptr + pad_row.to(tl.int64) * stride_o_t + h * stride_o_h + d, zero,
                 mask=d < tl.where(pad_row >= 0, HEAD_DIM, 0))


def kv_compress(
    key: torch.Tensor,
    score: torch.Tensor,
    compressed_cache: torch.Tensor,
    state_max: torch.Tensor,
    state_sum: torch.Tensor,
    state_acc: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    state_indices: torch.Tensor,
    block_table: torch.Tensor,
    ratio: int,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher. key [T, KVH, D] (last dim contiguous); score [T, KVH];
    compressed_cache [num_blocks, block_size, KVH, D] of key's dtype; state
    tensors fp32 contiguous; metadata int32 as in CompressorMetadata.
    `max_query_len` (Python int) bounds every request's token count; the grid
    scales with T (Note [request tiles]), 1 takes the decode shortcut. Any
    head size D >= 1 works (no tl.dot; one [BLOCK_D] vector per program).
    Writes every row of `out` ([T, KVH, D] like key; new when None), returns it.

    Index checks (compile_backend/kernels/_checks.py, Note [index checks]) run for CPU tensors,
    and for CUDA ones under `set_debug_checks(True)`. Without them the kernel
    trusts query_start_loc to stay within the T tokens; each request with
    tokens and a state to have seq_len >= its token count, within its
    block_table row; its state index to lie in [-1, num_slots); and the
    block ids of its complete groups (its first ceil((seq_len // ratio) /
    block_size) entries) to lie in [0, num_blocks). Anything else reads and
    writes other memory."""
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_device("key", key)
    T, KVH, D = key.shape
    check_tensor("score", score, shape=(T, KVH), dtypes=FLOAT_DTYPES, device=device)
    check_tensor("compressed_cache", compressed_cache, ndim=4, dtypes=(key.dtype,), dtype_of="key", device=device,
                 contiguous=True)
    check_tensor("compressed_cache", compressed_cache, shape=(None, None, KVH, D))
    check_tensor("state_max", state_max, ndim=2, dtypes=(torch.float32,), device=device,
                 contiguous=True)
    S = state_max.shape[0]
    check_tensor("state_max", state_max, shape=(S, KVH))
    check_tensor("state_sum", state_sum, shape=(S, KVH), dtypes=(torch.float32,), device=device,
                 contiguous=True)
    check_tensor("state_acc", state_acc, shape=(S, KVH, D), dtypes=(torch.float32,), device=device,
                 contiguous=True)
    B = check_paged_metadata(device, query_start_loc, seq_lens, block_table)
    check_tensor("state_indices", state_indices, shape=(B,), dtypes=(torch.int32,), device=device)
    check_int("ratio", ratio, 1)
    check_int("max_query_len", max_query_len, 0)
    if out is not None:
        check_tensor("out", out, shape=(T, KVH, D), dtypes=(key.dtype,), dtype_of="key",
                     device=device, last_dim_contiguous=True)
    _check_ids(key, compressed_cache, state_max, query_start_loc, seq_lens, state_indices,
               block_table, ratio)

    if out is None:
        out = torch.empty((T, KVH, D), dtype=key.dtype, device=device)
    if T == 0:
        return out
    one_token = max_query_len == 1
    _kv_compress_kernel[(request_grid(T, B, ratio, one_token), KVH)](
        key, score, compressed_cache, state_max, state_sum, state_acc, out,
        query_start_loc, seq_lens, state_indices, block_table, B, T,
        key.stride(0), key.stride(1), score.stride(0), score.stride(1), out.stride(0), out.stride(1),
        compressed_cache.stride(0), compressed_cache.stride(1), compressed_cache.stride(2),
        block_table.stride(0), state_max.stride(0), state_acc.stride(0), state_acc.stride(1),
        RATIO=ratio, HEAD_DIM=D, BLOCK_D=next_pow2(D), BLOCK_SIZE=compressed_cache.shape[1],
        ONE_TOKEN=one_token, SEARCH=SEARCH, num_warps=1 if D <= 128 else 2,
    )
    return out


def _check_ids(key, compressed_cache, state_max, query_start_loc, seq_lens, state_indices,
               block_table, ratio):
    check_ids("kv_compress", num_tokens=key.shape[0], query_start_loc=query_start_loc,
              seq_lens=seq_lens, block_table=block_table,
              cache=("compressed_cache", compressed_cache), positions_per_entry=ratio,
              state_indices=state_indices, states=("state_max", state_max.shape[0]))


def kv_compress_ref(key, score, compressed_cache, state_max, state_sum, state_acc,
                    query_start_loc, seq_lens, state_indices, block_table, ratio) -> torch.Tensor:
    """Plain torch, token by token (all heads at once), with `kv_compress`'s
    tensor arguments and ratio; updates the cache and the state in place.
    Index checks as in `kv_compress`."""
    _check_ids(key, compressed_cache, state_max, query_start_loc, seq_lens, state_indices,
               block_table, ratio)
    out = torch.zeros_like(key)
    block_size = compressed_cache.shape[1]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    idx = state_indices.tolist()
    for b in range(len(idx)):
        q0, q1, S, slot = qsl[b], qsl[b + 1], lens[b], idx[b]
        if slot < 0 or q1 <= q0:
            continue
        start = S - (q1 - q0)
        m, s, acc = state_max[slot].clone(), state_sum[slot].clone(), state_acc[slot].clone()
        for pos in range(start, S):
            if pos % ratio == 0:
                m.fill_(float("-inf")); s.zero_(); acc.zero_()
            t = q0 + pos - start
            sc = score[t].float()  # [KVH]
            m_new = torch.maximum(m, sc)
            alpha, beta = torch.exp(m - m_new), torch.exp(sc - m_new)
            s = s * alpha + beta
            acc = acc * alpha[:, None] + beta[:, None] * key[t].float()
            m = m_new
            val = acc / s[:, None]
            out[t] = val.to(key.dtype)
            if pos % ratio == ratio - 1:
                g = pos // ratio
                blk = int(block_table[b, g // block_size])
                compressed_cache[blk, g % block_size] = val.to(compressed_cache.dtype)
        state_max[slot], state_sum[slot], state_acc[slot] = m, s, acc
    return out


def _kv_compress_into(out, key, score, compressed_cache, state_max, state_sum, state_acc,
                      layer_name, ratio) -> torch.Tensor:
    """The op, its result written into `out` (None: a new tensor)."""
    meta = layer_metadata(layer_name, "kv_compress")  # CompressorMetadata
    args = (key, score, compressed_cache, state_max, state_sum, state_acc,
            meta.query_start_loc, meta.seq_lens, meta.state_indices, meta.block_table, ratio)
    if use_triton(key):
        return kv_compress(*args, meta.max_query_len, out=out)
    y = kv_compress_ref(*args)
    return y if out is None else out.copy_(y)


@define_op(
    "mrv2::kv_compress",
    mutates_args=("compressed_cache", "state_max", "state_sum", "state_acc"),
    schema="(Tensor key, Tensor score, Tensor(a!) compressed_cache, Tensor(b!) state_max, "
    "Tensor(c!) state_sum, Tensor(d!) state_acc, str layer_name, int ratio) -> Tensor",
    into=_kv_compress_into,  # a FULL plan's derived mixed graph writes the decode graph's output
)
def kv_compress_op(key, score, compressed_cache, state_max, state_sum, state_acc, layer_name,
                   ratio) -> torch.Tensor:  # types: the schema
    return _kv_compress_into(None, key, score, compressed_cache, state_max, state_sum, state_acc,
                             layer_name, ratio)


# Attention-like: its metadata is capturable for any batch (Note [attention-like
# metadata is always capturable]), so it never splits a graph and runs captured.
register_op("mrv2::kv_compress", role=OpRole.ATTENTION_LIKE, layer_keyed=True, capture_safe=True)


@torch.library.register_fake("mrv2::kv_compress")
def _(key, score, compressed_cache, state_max, state_sum, state_acc, layer_name, ratio):
    return torch.empty_like(key)
