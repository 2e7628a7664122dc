"""Unified paged attention over a mixed batch (the breakpoint op).

query [T, H, D] -> out [T, H, D]. Request b owns queries qsl[b]:qsl[b+1] and
attends causally to its first seq_lens[b] cached tokens, found through
block_table[b] in caches [num_blocks, block_size, KVH, D]. The query at index i
of a request with q_len queries sits at position seq_lens[b] - q_len + i and
sees keys at positions <= that. Grouped-query attention: query head h reads kv
head h // (H // KVH). `out` is an out-parameter; rows past qsl[B] come out 0,
written by the kernels. Prefill and mixed batches (max_query_len != 1) run one
program per (query tile, kv head), decode runs split-KV in one launch or two;
eager pieces call `unified_attention_direct` (compile_backend/kernels/attention_plan.py).
Note [one-launch decode], Note [dot tiles]: docs/design.md, sections "Unified
attention: two paths" and "Decode attention in one launch".
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch
import triton
import triton.language as tl

from compile_backend.core import stream_buffers
from compile_backend.core.counters import counters
from compile_backend.core.direct_calls import register_direct_impl
from compile_backend.core.forward_context import get_forward_context, resolve_layer
from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import OpRole, register_op

from ._checks import (
    FLOAT_DTYPES, check_device, check_ids, check_int, check_kv_caches, check_paged_metadata,
    check_tensor,
)
from ._debug import debug_checks_on
from ._device import (
    BATCH_INTS, SEARCH, cdiv, dot_precision, interpreting, next_pow2, pdl_meta, pdl_release, pdl_wait,
    request_grid, request_tile, round_to, upcast_dots, use_triton,
)
from ._device import sm_count as _sm_count  # a module name tests replace (a GPU's count)
from ._launch import Launch, current_device, current_stream, hooks_unset, stream_capturing
from ._metadata import layer_metadata
from .attention_plan import aligned, find_plan, keep_plan, plannable

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
# Smallest number of keys a split of the one-launch decode should own; below this merging the
# splits costs more than the extra parallelism gains. `config["MIN_SPLIT_LEN"]`
# overrides it per call (benchmarks).
MIN_SPLIT_LEN = 256
# The two-launch form's splits (fixed at capture by max_seq_len) are at least
# this long. It runs where the (request, kv head) programs are few (B x KVH
# below 2 x SMs), so more, shorter splits buy parallelism there; measured at
# llama-8B shapes in bench/results/decode_splits.md.
TWO_LAUNCH_MIN_SPLIT_LEN = 64
# Which decode form runs: config["TWO_LAUNCH"] if given, else this environment
# variable (1: two launches, 0: one launch; for comparisons,
# bench/kernel_speed.py --decode-compare), else `one_launch_pays`.
TWO_LAUNCH_ENV = "MRV2_DECODE_TWO_LAUNCH"
# One launch pays once the (request, kv head) programs alone fill every SM
# this many times over. Measured on the H200 at llama-8B shapes
# (bench/results/decode_attention.md): at B=64 (512 programs, 132 SMs) one
# launch is 1.00-1.15x the two-launch form, at B=256 1.01-1.06x; at B=1 and
# B=8 (8 and 64 programs) it is 0.49-0.94x, because the last split's merge
# of 4 heads x S splits runs in one program where the reduce kernel spreads
# it over B x H programs, and the merge code costs the split programs
# occupancy.
ONE_LAUNCH_PROGRAMS_PER_SM = 2
# Elements of one [heads, splits, head dim] fp32 tile the merge loads at a time.
_MERGE_ELEMS = 4096
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
def _split_attend(q, k_cache_ptr, v_cache_ptr, bt_row, lo, hi, kvh, d, d_ok, scale_log2,
                  stride_c_blk, stride_c_off, stride_c_h, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One decode split: the query heads q [BLOCK_H, BLOCK_D] of one token
    over keys [lo, hi) of the request's block table row `bt_row` (every key
    visible: one query token). Returns the online softmax's m, l [BLOCK_H]
    and acc [BLOCK_H, BLOCK_D], unnormalised. Shared by both decode forms."""
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, TILE_N):  # q_pos unused (CAUSAL off): m stands in
        m, l, acc = _kv_tile_step(
            q, m, l, acc, m, k_cache_ptr, v_cache_ptr, bt_row, start, hi, kvh, d, d_ok,
            scale_log2, stride_c_blk, stride_c_off, stride_c_h,
            BLOCK_SIZE=BLOCK_SIZE, TILE_N=TILE_N, CAUSAL=False, UPCAST=UPCAST,
            DOT_PRECISION=DOT_PRECISION)
    return m, l, acc


@triton.jit(do_not_specialize=BATCH_INTS)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2, num_reqs, num_tokens,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SEARCH: tl.constexpr,
):
    kvh = tl.program_id(1)
    b, q_start, q_len, q_tile, _ = request_tile(qsl_ptr, num_reqs, num_tokens, BLOCK_Q, SEARCH, False)
    # The padding pseudo-request (b == num_reqs) has no keys: its rows come out 0.
    seq_len = tl.load(seq_lens_ptr + b, mask=b < num_reqs, other=0)
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
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Note [rotary inside decode attention]: the fused op (compile_backend/kernels/
# rope_attention.py) hands the decode kernels q and this step's k un-rotated
# and k, v not yet in the caches. Each program rotates its query heads as it
# loads them (rope_and_cache's half-split layout and fp32 math, rounded to
# q's dtype once). The one program of a (request, kv head) whose split ends
# at seq_len first writes the token's rotated key and its value at the
# token's slot, then passes a barrier, then attends over its split as any
# other: it reads that slot back like every cached key. It is the slot's only
# reader in the launch: the slot is position seq_len - 1 of the request's
# block table (as every metadata builder makes it), which only that split
# covers, and other kv heads' programs read other bytes of the row. The
# barrier (bar.sync) makes the program's own global writes visible to all of
# its threads before their loads. So the output and the caches are the bits
# of rope_and_cache then the attention kernel, one launch fewer.
@triton.jit
def _rope_angles(pos_ptr, t, inv_freq_ptr, d, HEAD_DIM: tl.constexpr):
    """cos, sin [BLOCK_D] of token t's position for lanes d (lanes d and
    d + D/2 share an angle), each lane's partner lane and first-half flag."""
    HALF: tl.constexpr = HEAD_DIM // 2
    first = d < HALF
    j = tl.where(first, d, d - HALF)
    inv = tl.load(inv_freq_ptr + j, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    ang = tl.load(pos_ptr + t).to(tl.float32) * inv
    return tl.cos(ang), tl.sin(ang), tl.where(first, d + HALF, d - HALF), first


@triton.jit
def _rotate(ptr, offs, partner_offs, mask, first, cos, sin, RNE_BF16: tl.constexpr):
    """The rotated rows at ptr + offs (their partner lanes at partner_offs),
    in ptr's dtype: x1 cos - x2 sin, x2 cos + x1 sin as rope_and_cache."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptr + partner_offs, mask=mask, other=0.0).to(tl.float32)
    # Note [rotary's fused multiply-adds] (compile_backend/kernels/rope_and_cache.py).
    return round_to(tl.where(first, tl.fma(x, cos, -(xp * sin)), tl.fma(x, cos, xp * sin)),
                    ptr.dtype.element_ty, RNE_BF16)


@triton.jit
def _rotary_query_and_new_key(q_ptr, q_rows, q_mask, last, t, kvh, kn_ptr, vn_ptr, pos_ptr,
                              inv_freq_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_kn_t,
                              stride_kn_h, stride_vn_t, stride_vn_h, stride_c_blk, stride_c_off,
                              stride_c_h, d, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              RNE_BF16: tl.constexpr):
    """Note [rotary inside decode attention], one program's part before its
    key loop: its query heads (q_ptr + q_rows + lane, q_mask) of token t
    rotated, returned [BLOCK_H, BLOCK_D]; where `last`, token t's rotated key
    and value for kv head kvh written at slot_mapping[t] (slot -1: nothing);
    then a barrier, so the program's loads of that slot see the write."""
    cos, sin, partner, first = _rope_angles(pos_ptr, t, inv_freq_ptr, d, HEAD_DIM)
    q = _rotate(q_ptr, q_rows + d[None, :], q_rows + partner[None, :], q_mask, first[None, :],
                cos[None, :], sin[None, :], RNE_BF16)
    t64 = t.to(tl.int64)
    slot = tl.load(slot_ptr + tl.where(last, t, 0)).to(tl.int64)
    slot = tl.where(last, slot, -1)
    mask = d < tl.where(slot >= 0, HEAD_DIM, 0)  # Note [scalar masks]
    k_row = t64 * stride_kn_t + kvh * stride_kn_h
    k = _rotate(kn_ptr, k_row + d, k_row + partner, mask, first, cos, sin, RNE_BF16)  # [BLOCK_D]
    v = tl.load(vn_ptr + t64 * stride_vn_t + kvh * stride_vn_h + d, mask=mask, other=0.0)
    dst = ((slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_off
           + kvh * stride_c_h + d)
    tl.store(k_cache_ptr + dst, k, mask=mask)  # k's dtype is the cache's (checked)
    tl.store(v_cache_ptr + dst, v, mask=mask)
    tl.debug_barrier()
    return q


@triton.jit(do_not_specialize=BATCH_INTS)
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tickets_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2, num_reqs, num_tokens, min_split_len,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
    QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HM: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SEARCH: tl.constexpr, PDL: tl.constexpr,
):
    """Note [one-launch decode]. Program (p, kvh, split), p < max(B, T):
    request p's query heads of kv head kvh over one split of its keys, and
    (split 0) the zero row p when p lies past qsl[B] (Note [request tiles],
    ONE_TOKEN). q is rotated and the caches hold this step's keys."""
    _decode_program(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tickets_ptr,
        qsl_ptr, seq_lens_ptr, block_table_ptr,
        scale_log2, num_reqs, num_tokens, min_split_len,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h,
        stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
        stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
        q_ptr, q_ptr, q_ptr, q_ptr, q_ptr, 0, 0, 0, 0,
        QUERIES_PER_KV, BLOCK_H, BLOCK_HM, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, NUM_SPLITS,
        BLOCK_S, CHUNK, UPCAST, DOT_PRECISION, SEARCH, PDL,
        ROPE=False, RNE_BF16=False)


@triton.jit(do_not_specialize=BATCH_INTS)
def _decode_rope_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tickets_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2, num_reqs, num_tokens, min_split_len,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
    kn_ptr, vn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
    stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
    QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HM: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SEARCH: tl.constexpr, PDL: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """_decode_kernel with Note [rotary inside decode attention]: q and this
    step's k un-rotated, k and v [T, KVH, D] not yet in the caches."""
    _decode_program(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tickets_ptr,
        qsl_ptr, seq_lens_ptr, block_table_ptr,
        scale_log2, num_reqs, num_tokens, min_split_len,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h,
        stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
        stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
        kn_ptr, vn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
        stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
        QUERIES_PER_KV, BLOCK_H, BLOCK_HM, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, NUM_SPLITS,
        BLOCK_S, CHUNK, UPCAST, DOT_PRECISION, SEARCH, PDL,
        ROPE=True, RNE_BF16=RNE_BF16)


@triton.jit
def _decode_program(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tickets_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2, num_reqs, num_tokens, min_split_len,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
    kn_ptr, vn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
    stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
    QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HM: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SEARCH: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr, RNE_BF16: tl.constexpr,
):
    """The body of both one-launch decode kernels (ROPE: Note [rotary inside
    decode attention])."""
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b, q_start, q_len, _, pad_row = request_tile(qsl_ptr, num_reqs, num_tokens, 1, SEARCH, True)
    hr = tl.arange(0, BLOCK_H)
    head = kvh * QUERIES_PER_KV + hr
    h_ok = hr < QUERIES_PER_KV
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # Note [programmatic dependent launch]: the metadata above and seq_len
    # below are read before the wait (the step's inputs: the kernel before
    # this one writes q and the caches, never them); q, the caches and every
    # store come after it.
    seq_len = tl.load(seq_lens_ptr + b, mask=b < num_reqs, other=0)
    pdl_wait(PDL)
    # Rows of no request come out 0 (Note [scalar masks]: conditions as bounds).
    n_zero = tl.where(pad_row >= 0, tl.where(split == 0, QUERIES_PER_KV, 0), 0)
    tl.store(out_ptr + pad_row.to(tl.int64) * stride_o_t + head[:, None] * stride_o_h + d[None, :],
             tl.zeros([BLOCK_H, BLOCK_D], out_ptr.dtype.element_ty),
             mask=(hr < n_zero)[:, None] & d_ok[None, :])

    # The splits this request uses, from its runtime length: as many as
    # NUM_SPLITS allows with at least min_split_len keys each (one for a
    # short context), each a TILE_N-aligned range; every used split is
    # non-empty and the others exit here.
    seq_len = tl.where(q_len > 0, seq_len, 0)
    n_want = tl.minimum(tl.maximum(seq_len // min_split_len, 1), NUM_SPLITS)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, n_want), TILE_N) * TILE_N, TILE_N)
    n_split = tl.cdiv(seq_len, per_split)
    if split < n_split:
        lo = split * per_split
        hi = tl.minimum(lo + per_split, seq_len)
        q_rows = q_start.to(tl.int64) * stride_q_t + head[:, None] * stride_q_h
        q_mask = h_ok[:, None] & d_ok[None, :]
        if ROPE:  # the last split (hi == seq_len) writes the new key
            q = _rotary_query_and_new_key(
                q_ptr, q_rows, q_mask, hi == seq_len, q_start, kvh, kn_ptr, vn_ptr, pos_ptr,
                inv_freq_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_kn_t, stride_kn_h,
                stride_vn_t, stride_vn_h, stride_c_blk, stride_c_off, stride_c_h, d, HEAD_DIM,
                BLOCK_SIZE, RNE_BF16)
        else:
            q = tl.load(q_ptr + q_rows + d[None, :], mask=q_mask, other=0.0)  # [BLOCK_H, BLOCK_D]
        m, l, acc = _split_attend(q, k_cache_ptr, v_cache_ptr, block_table_ptr + b.to(tl.int64) * stride_bt_b,
                                  lo, hi, kvh, d, d_ok, scale_log2, stride_c_blk, stride_c_off,
                                  stride_c_h, BLOCK_H, BLOCK_D, BLOCK_SIZE, TILE_N, UPCAST,
                                  DOT_PRECISION)
        pdl_release(PDL)
        o_rows = out_ptr + q_start.to(tl.int64) * stride_o_t
        if n_split == 1:  # the whole context in this program: no scratch, no ticket
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(o_rows + head[:, None] * stride_o_h + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
        else:
            pm = b.to(tl.int64) * stride_pm_b + head * stride_pm_h + split
            tl.store(part_m_ptr + pm, m, mask=h_ok, cache_modifier=".cg")
            tl.store(part_l_ptr + pm, l, mask=h_ok, cache_modifier=".cg")
            pa = (b.to(tl.int64) * stride_pa_b + head[:, None] * stride_pa_h + split * stride_pa_s
                  + d[None, :])
            tl.store(part_acc_ptr + pa, acc, mask=h_ok[:, None] & d_ok[None, :], cache_modifier=".cg")
            # Every thread's partial stores, then one release: the barrier
            # orders them before the thread that performs the atomic (Note
            # [one-launch decode], memory ordering).
            tl.debug_barrier()
            ticket_ptr = tickets_ptr + b * tl.num_programs(1) + kvh
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == n_split - 1:  # the last split of (b, kvh) to finish merges
                tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                tl.debug_barrier()
                hm = tl.arange(0, BLOCK_HM)
                hm_ok = hm < QUERIES_PER_KV
                head_m = kvh * QUERIES_PER_KV + hm
                m_rows = b.to(tl.int64) * stride_pm_b + head_m * stride_pm_h
                sp = tl.arange(0, BLOCK_S)
                sp_mask = hm_ok[:, None] & (sp < n_split)[None, :]
                # L1 is not coherent across SMs: partials are read from L2 (.cg).
                m_s = tl.load(part_m_ptr + m_rows[:, None] + sp[None, :], mask=sp_mask,
                              other=-1.0e30, cache_modifier=".cg")
                l_s = tl.load(part_l_ptr + m_rows[:, None] + sp[None, :], mask=sp_mask,
                              other=0.0, cache_modifier=".cg")
                m_all = tl.max(m_s, 1)  # [BLOCK_HM]
                denom = tl.sum(l_s * tl.exp2(m_s - m_all[:, None]), 1)
                merged = tl.zeros([BLOCK_HM, BLOCK_D], tl.float32)
                c = tl.arange(0, CHUNK)
                a_rows = b.to(tl.int64) * stride_pa_b + head_m * stride_pa_h
                for s0 in range(0, n_split, CHUNK):
                    s = s0 + c
                    c_mask = hm_ok[:, None] & (s < n_split)[None, :]  # [BLOCK_HM, CHUNK]
                    w = tl.exp2(tl.load(part_m_ptr + m_rows[:, None] + s[None, :], mask=c_mask,
                                        other=-1.0e30, cache_modifier=".cg") - m_all[:, None])
                    w = tl.where(c_mask, w, 0.0)
                    a = tl.load(part_acc_ptr + a_rows[:, None, None] + s[None, :, None] * stride_pa_s
                                + d[None, None, :], mask=c_mask[:, :, None] & d_ok[None, None, :],
                                other=0.0, cache_modifier=".cg")  # [BLOCK_HM, CHUNK, BLOCK_D]
                    merged += tl.sum(a * w[:, :, None], 1)
                out = merged / tl.where(denom > 0, denom, 1.0)[:, None]
                tl.store(o_rows + head_m[:, None] * stride_o_h + d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=hm_ok[:, None] & d_ok[None, :])


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
    PDL: tl.constexpr,
):
    """The two-launch decode's split: Note [one-launch decode]."""
    _decode_split_program(
        q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        qsl_ptr, seq_lens_ptr, block_table_ptr,
        scale_log2,
        stride_q_t, stride_q_h,
        stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
        stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
        q_ptr, q_ptr, q_ptr, q_ptr, q_ptr, 0, 0, 0, 0,
        QUERIES_PER_KV, BLOCK_H, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, NUM_SPLITS, UPCAST,
        DOT_PRECISION, PDL,
        ROPE=False, RNE_BF16=False)


@triton.jit
def _decode_split_rope_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2,
    stride_q_t, stride_q_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
    kn_ptr, vn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
    stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
    QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """_decode_split_kernel with Note [rotary inside decode attention]."""
    _decode_split_program(
        q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        qsl_ptr, seq_lens_ptr, block_table_ptr,
        scale_log2,
        stride_q_t, stride_q_h,
        stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
        stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
        kn_ptr, vn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
        stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
        QUERIES_PER_KV, BLOCK_H, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, NUM_SPLITS, UPCAST,
        DOT_PRECISION, PDL,
        ROPE=True, RNE_BF16=RNE_BF16)


@triton.jit
def _decode_split_program(
    q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2,
    stride_q_t, stride_q_h,
    stride_c_blk, stride_c_off, stride_c_h, stride_bt_b,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
    kn_ptr, vn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
    stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
    QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    ROPE: tl.constexpr, RNE_BF16: tl.constexpr,
):
    # Program (b, kvh, split) writes every partial entry of its heads and split,
    # empty ones too (m = -1e30, l = 0), so scratch needs no initialisation.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    has_query = tl.load(qsl_ptr + b + 1) > q_start
    seq_len = tl.where(has_query, tl.load(seq_lens_ptr + b), 0)
    # Each split owns a TILE_N-aligned range of this request's own keys.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    hr = tl.arange(0, BLOCK_H)
    head = kvh * QUERIES_PER_KV + hr
    h_ok = hr < QUERIES_PER_KV
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pdl_wait(PDL)  # the metadata above before it, as in _decode_kernel; q and the caches after
    q_rows = q_start.to(tl.int64) * stride_q_t + head[:, None] * stride_q_h
    q_mask = (hr < tl.where(has_query, QUERIES_PER_KV, 0))[:, None] & d_ok[None, :]
    if ROPE:
        # The split that ends at seq_len writes the new key (empty splits past
        # it start at or after it); q_start may be T for a request with no query.
        q = _rotary_query_and_new_key(
            q_ptr, q_rows, q_mask, (lo < seq_len) & (hi == seq_len),
            tl.where(has_query, q_start, 0), kvh, kn_ptr, vn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
            k_cache_ptr, v_cache_ptr, stride_kn_t, stride_kn_h, stride_vn_t, stride_vn_h,
            stride_c_blk, stride_c_off, stride_c_h, d, HEAD_DIM, BLOCK_SIZE, RNE_BF16)
    else:
        q = tl.load(q_ptr + q_rows + d[None, :], mask=q_mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    m, l, acc = _split_attend(q, k_cache_ptr, v_cache_ptr, block_table_ptr + b.to(tl.int64) * stride_bt_b,
                              lo, hi, kvh, d, d_ok, scale_log2, stride_c_blk, stride_c_off,
                              stride_c_h, BLOCK_H, BLOCK_D, BLOCK_SIZE, TILE_N, UPCAST, DOT_PRECISION)
    pdl_release(PDL)

    pm = b.to(tl.int64) * stride_pm_b + head * stride_pm_h + split
    tl.store(part_m_ptr + pm, m, mask=h_ok)
    tl.store(part_l_ptr + pm, l, mask=h_ok)
    pa = b.to(tl.int64) * stride_pa_b + head[:, None] * stride_pa_h + split * stride_pa_s + d[None, :]
    tl.store(part_acc_ptr + pa, acc, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=BATCH_INTS)
def _decode_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, qsl_ptr, num_reqs, num_tokens,
    stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
    stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, SEARCH: tl.constexpr, PDL: tl.constexpr,
):
    # Program (p, head), p < max(B, T): request p's output row (when p < B and
    # it has its query) and the zero row p when p lies past qsl[B] (Note
    # [request tiles], ONE_TOKEN).
    head = tl.program_id(1)
    b, q_start, q_len, _, pad_row = request_tile(qsl_ptr, num_reqs, num_tokens, 1, SEARCH, True)
    b = tl.minimum(b, num_reqs - 1).to(tl.int64)  # partials exist for b < B only
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pdl_wait(PDL)  # the metadata before it; the partials (the split kernel's) after
    pdl_release(PDL)
    pm = b * stride_pm_b + head * stride_pm_h + sp
    m = tl.load(part_m_ptr + pm, mask=s_ok, other=-1.0e30)
    l = tl.load(part_l_ptr + pm, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp2(m - m_all)  # empty splits: m = -1e30 => weight 0
    denom = tl.sum(l * w, 0)
    pa = b * stride_pa_b + head * stride_pa_h + sp[:, None] * stride_pa_s + d[None, :]
    acc = tl.load(part_acc_ptr + pa, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    o_head = out_ptr + head * stride_o_h + d
    tl.store(o_head + q_start.to(tl.int64) * stride_o_t, out.to(out_ptr.dtype.element_ty),
             mask=d < tl.where(q_len > 0, HEAD_DIM, 0))
    tl.store(o_head + pad_row.to(tl.int64) * stride_o_t, tl.zeros([BLOCK_D], out_ptr.dtype.element_ty),
             mask=d < tl.where(pad_row >= 0, HEAD_DIM, 0))


@functools.lru_cache(maxsize=None)
def one_launch_pays(num_reqs: int, num_kv_heads: int, device: torch.device) -> bool:
    """The one-launch decode for this grid, or the two-launch form? One launch
    once num_reqs x KVH programs fill the SMs ONE_LAUNCH_PROGRAMS_PER_SM times
    (a decision of the plan, fixed in a captured graph); always off a GPU, so
    the interpreter's tests run the kernel that needs them most."""
    if device.type != "cuda":
        return True
    return num_reqs * num_kv_heads >= ONE_LAUNCH_PROGRAMS_PER_SM * _sm_count(device)


def decode_form(num_reqs: int, num_kv_heads: int, device: torch.device,
                config: dict | None = None) -> tuple[bool, int]:
    """(two launches?, min split length) of a decode plan: config["TWO_LAUNCH"]
    if given, else $MRV2_DECODE_TWO_LAUNCH (1 or 0), else `one_launch_pays`;
    config["MIN_SPLIT_LEN"] if given, else the form's default."""
    config = config or {}
    two = config.get("TWO_LAUNCH")
    if two is None:
        env = os.environ.get(TWO_LAUNCH_ENV, "")
        two = env == "1" if env in ("0", "1") else not one_launch_pays(num_reqs, num_kv_heads, device)
    min_split = config.get("MIN_SPLIT_LEN", TWO_LAUNCH_MIN_SPLIT_LEN if two else MIN_SPLIT_LEN)
    check_int("config['MIN_SPLIT_LEN']", min_split, 1)
    return bool(two), min_split


def num_kv_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                  min_split_len: int = MIN_SPLIT_LEN) -> int:
    """Splits for the decode path (the grid's third axis, fixed at capture):
    enough (request, kv head, split) programs for about four per SM, but no
    split shorter than `min_split_len` keys at `max_seq_len`. The one-launch
    kernel uses fewer where a request's runtime length is shorter (Note
    [one-launch decode])."""
    want = cdiv(4 * _sm_count(device), max(num_reqs * num_kv_heads, 1))
    by_len = max(1, cdiv(max_seq_len, min_split_len))
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


def _check(query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table,
           max_query_len, max_seq_len, num_splits=None) -> None:
    """Every check of the launcher (ValueError naming the argument); `output`
    may be None (the launcher allocates it)."""
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
    if output is not None:
        _check_output(query, output, device)
    check_paged_metadata(device, query_start_loc, seq_lens, block_table)
    check_int("max_query_len", max_query_len, 0)
    check_int("max_seq_len", max_seq_len, 0)
    if num_splits is not None:
        check_int("num_splits", num_splits, 1)
    check_ids("unified_attention", num_tokens=T, query_start_loc=query_start_loc,
              seq_lens=seq_lens, block_table=block_table, cache=("key_cache", key_cache))


def _check_output(query: torch.Tensor, output: object, device: torch.device) -> None:
    check_tensor("output", output, shape=tuple(query.shape), dtypes=(query.dtype,),
                 dtype_of="query", device=device, last_dim_contiguous=True)


class _Plan:
    """The launches of one attention call, all but query, caches, output and
    scale fixed: `run(query, key_cache, value_cache, output, scale_log2,
    stream)`. Built from checked arguments (`_check`); the direct path keeps
    one per step (Note [attention plans] in compile_backend/kernels/attention_plan.py)."""

    __slots__ = ("query_start_loc", "seq_lens", "block_table", "max_query_len", "max_seq_len",
                 "device_index", "stream", "in_capture", "run")

    def __init__(self, query, key_cache, output, query_start_loc, seq_lens, block_table,
                 max_query_len, max_seq_len, num_splits=None, config=None, *, bind=False,
                 rope=False):
        self.query_start_loc, self.seq_lens, self.block_table = query_start_loc, seq_lens, block_table
        self.max_query_len, self.max_seq_len = max_query_len, max_seq_len
        if query.is_cuda:
            self.device_index = current_device()
            self.stream = current_stream(self.device_index)
            self.in_capture = stream_capturing()  # then only that capture may use it
        else:
            self.device_index, self.stream, self.in_capture = -1, 0, False
        T, H, D = query.shape
        KVH, block_size = key_cache.shape[2], key_cache.shape[1]
        B = query_start_loc.shape[0] - 1
        qpk = H // KVH
        cfg = {**_tiles(D, query.dtype), **(config or {})}
        common = dict(HEAD_DIM=D, BLOCK_D=_dot_dim(D), BLOCK_SIZE=block_size,
                      TILE_N=_dot_dim(cfg["TILE_N"]), UPCAST=upcast_dots(query.dtype),
                      DOT_PRECISION=dot_precision(query.dtype), num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"])
        strides = (query.stride(0), query.stride(1), output.stride(0), output.stride(1),
                   key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0))
        if T == 0:
            self.run = _no_launch
        elif max_query_len == 1 and B > 0:
            two, min_split = decode_form(B, KVH, query.device, cfg)
            S = num_splits or num_kv_splits(B, KVH, max_seq_len, query.device, min_split)
            # Note [interpreter bf16 rounding]: the rotary rounds by hand there.
            rope_meta = dict(RNE_BF16=interpreting() and query.dtype == torch.bfloat16) if rope else None
            self.run = _decode_run(B, T, H, KVH, D, qpk, query.device, query_start_loc, seq_lens,
                                   block_table, strides, common, S, min_split, bool(two), bind,
                                   rope_meta)
        else:
            assert not rope, "rotary inside attention: decode batches only"
            block_m = max(_dot_dim(cfg["BLOCK_M"]), next_pow2(qpk))
            block_q = block_m // qpk
            prefill = Launch(_prefill_kernel, (request_grid(T, B, block_q, False), KVH),
                             dict(QUERIES_PER_KV=qpk, BLOCK_M=block_m, BLOCK_Q=block_q,
                                  SEARCH=SEARCH, **common), bind=bind)
            fixed = (query_start_loc, seq_lens, block_table)
            tail = (B, T, *strides)

            def run(q, kc, vc, out, scale_log2, stream):
                prefill.launch(stream, (q, kc, vc, out, *fixed, scale_log2, *tail))

            self.run = run

    def ready(self, meta, query, key_cache, value_cache, output) -> int | None:
        """The stream to launch on if this plan may serve this call (Note
        [attention plans]), else None."""
        if (meta.query_start_loc is not self.query_start_loc or meta.seq_lens is not self.seq_lens
                or meta.block_table is not self.block_table or meta.max_query_len != self.max_query_len
                or meta.max_seq_len != self.max_seq_len or debug_checks_on()
                or not aligned(query, key_cache, value_cache, output)):
            return None
        if self.device_index < 0:
            check_ids("unified_attention", num_tokens=query.shape[0],
                      query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                      block_table=self.block_table, cache=("key_cache", key_cache))
            return 0
        if (stream_capturing() != self.in_capture or not hooks_unset()
                or current_device() != self.device_index):
            return None
        stream = current_stream(self.device_index)
        return stream if stream == self.stream else None


def _no_launch(q, kc, vc, out, scale_log2, stream) -> None:
    pass


# Note [decode tickets]: the one-launch decode's per-(request, kv head)
# arrival counters. Each launch leaves every counter it used at 0 (the last
# split resets it), so they are zeroed once, when made, and never again: no
# zeroing launch per call or per replay. That only holds for memory that
# nothing else writes, so the counters cannot be a per-call temporary like the
# partials' scratch (which may come from a CUDA graph's pool, where other
# tensors of the same capture reuse its memory after the call; the partials
# tolerate that because the kernel writes them before it reads them). They
# are a per-stream buffer (compile_backend/core/stream_buffers.py: made
# outside any capture, never freed, one per stream so launches on one stream
# never share it with another's): a capture stream gets it before its first
# capture (`warm_capture_stream` in compile_backend/runtime/graph_pool.py),
# the main stream at its first eager decode. A launch needs one counter per
# (request, kv head) only when it splits the keys, which happens only below
# 4 x SMs programs (`num_kv_splits`), so TICKET_SLOTS covers any GPU; a
# launch needing more (an explicit `num_splits`) or a capture on a stream
# without the buffer (a capture mrv2 did not start) takes the two-launch
# path, logged once and counted (`decode_two_launch_fallbacks`). Sizing the
# buffer by the first decode that asked, as before, left a warm start's
# captures without it (its warm-up at the largest batch splits nothing): its
# FULL graphs for 33-64 requests on the H200 took the two-launch path and
# compiled a kernel the cold start never had.
TICKETS = "unified_attention.tickets"
TICKET_SLOTS = 8192
stream_buffers.declare(TICKETS, TICKET_SLOTS, torch.int32)
_logged_fallback: set[bool] = set()  # causes logged (True: too many pairs)


def decode_tickets(device: torch.device, n: int) -> torch.Tensor | None:
    """Note [decode tickets]: the current stream's zeroed counters (at least
    `n`), or None: more than TICKET_SLOTS, or a capture on a stream without them."""
    if n > TICKET_SLOTS:
        return None
    return stream_buffers.buffer(TICKETS, device)


def _no_tickets(B: int, KVH: int) -> None:
    """Count and log (once per cause) a one-launch decode that takes two launches."""
    counters["decode_two_launch_fallbacks"] += 1
    many = B * KVH > TICKET_SLOTS
    if many not in _logged_fallback:
        _logged_fallback.add(many)
        why = (f"{B} requests x {KVH} kv heads need more than the {TICKET_SLOTS} ticket counters"
               if many else "a capture on a stream without ticket counters (a capture mrv2's "
               "graph pool did not start: its streams get them before their first capture)")
        logger.warning("decode attention: the split + reduce launches instead of one: %s "
                       "(Note [decode tickets] in compile_backend/kernels/unified_attention.py)", why)


def merge_chunk(block_hm: int, block_d: int, block_s: int) -> int:
    """The one-launch decode's merge chunk (CHUNK): splits merged per step of
    its merge loop, a power of two with a [block_hm, chunk, block_d] tile of
    at most _MERGE_ELEMS elements (at least one split)."""
    chunk = max(1, min(block_s, _MERGE_ELEMS // (block_hm * block_d)))
    return 1 << (chunk.bit_length() - 1)


def _decode_run(B, T, H, KVH, D, qpk, device, query_start_loc, seq_lens, block_table, strides,
                common, S, min_split, two_launch, bind, rope=None):
    """The decode launch (Note [one-launch decode]), with its scratch
    (`_split_partials`; none for S == 1) and the stream's ticket counters
    (Note [decode tickets]). `two_launch` (or a capture without tickets): the
    split kernel and the reduce kernel instead. `rope` (their extra meta, or
    None): the kernels of Note [rotary inside decode attention], whose runs
    take the rope arguments (k, v, positions, inv_freq, slot_mapping, then k's
    and v's token and head strides)."""
    tickets = None
    if S > 1 and not two_launch:
        tickets = decode_tickets(device, B * KVH)
        if tickets is None:
            _no_tickets(B, KVH)
            two_launch = True
    if two_launch:
        return _decode_two_launch_run(B, T, H, KVH, D, qpk, device, query_start_loc, seq_lens,
                                      block_table, strides, common, S, bind, rope)
    if S > 1:
        part_acc, part_m, part_l = _split_partials(B, H, S, D, device)
        part_strides = (part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
                        part_m.stride(0), part_m.stride(1))
    else:  # never read or written: one split writes the output itself
        scratch = torch.empty(8, dtype=torch.float32, device=device)
        part_acc = part_m = part_l = scratch[:4]
        tickets = scratch[4:].view(torch.int32)
        part_strides = (0,) * 5
    block_hm = next_pow2(qpk)
    block_s = next_pow2(S)
    chunk = merge_chunk(block_hm, common["BLOCK_D"], block_s)
    kernel = Launch(_decode_kernel if rope is None else _decode_rope_kernel,
                    (request_grid(T, B, 1, True), KVH, S),
                    dict(QUERIES_PER_KV=qpk, BLOCK_H=_dot_dim(qpk), BLOCK_HM=block_hm,
                         NUM_SPLITS=S, BLOCK_S=block_s, CHUNK=chunk, SEARCH=SEARCH, **common,
                         **pdl_meta(device), **(rope or {})),
                    bind=bind)
    mid = (part_acc, part_m, part_l, tickets, query_start_loc, seq_lens, block_table)
    tail = (B, T, min_split, *strides, *part_strides)

    def run(q, kc, vc, out, scale_log2, stream, rope_args=()):
        kernel.launch(stream, (q, kc, vc, out, *mid, scale_log2, *tail, *rope_args))

    return run


def _split_partials(B: int, H: int, S: int, D: int, device: torch.device):
    """One fp32 allocation for the splits' partials: sums [B, H, S, D], then
    maxima and sums [B, H, S], each at a 16-byte aligned offset."""
    n_acc, n_ml = B * H * S * D, B * H * S
    a, m = cdiv(n_acc, 4) * 4, cdiv(n_ml, 4) * 4
    scratch = torch.empty(a + 2 * m, dtype=torch.float32, device=device)
    return (scratch[:n_acc].view(B, H, S, D), scratch[a: a + n_ml].view(B, H, S),
            scratch[a + m: a + m + n_ml].view(B, H, S))


def _decode_two_launch_run(B, T, H, KVH, D, qpk, device, query_start_loc, seq_lens, block_table,
                           strides, common, S, bind, rope=None):
    """The two-launch decode (split kernel, then reduce kernel), with its
    scratch (`_split_partials`). Every split writes a partial, empty or not.
    `rope`: as `_decode_run`'s."""
    part_acc, part_m, part_l = _split_partials(B, H, S, D, device)
    split = Launch(_decode_split_kernel if rope is None else _decode_split_rope_kernel, (B, KVH, S),
                   dict(QUERIES_PER_KV=qpk, BLOCK_H=_dot_dim(qpk), NUM_SPLITS=S, **common,
                        **pdl_meta(device), **(rope or {})), bind=bind)
    reduce = Launch(_decode_reduce_kernel, (request_grid(T, B, 1, True), H),
                    dict(HEAD_DIM=D, BLOCK_D=next_pow2(D), NUM_SPLITS=S, BLOCK_S=next_pow2(S),
                         SEARCH=SEARCH, num_warps=4, **pdl_meta(device)), bind=bind)
    parts = (part_acc, part_m, part_l)
    part_strides = (part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
                    part_m.stride(0), part_m.stride(1))
    split_mid = (*parts, query_start_loc, seq_lens, block_table)
    split_tail = (*strides[:2], *strides[4:], *part_strides)
    reduce_tail = (query_start_loc, B, T, *part_strides, *strides[2:4])

    def run(q, kc, vc, out, scale_log2, stream, rope_args=()):
        split.launch(stream, (q, kc, vc, *split_mid, scale_log2, *split_tail, *rope_args))
        reduce.launch(stream, (*parts, out, *reduce_tail))

    return run


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher. query [T, H, D] (last dim contiguous); caches
    [num_blocks, block_size, KVH, D] contiguous, query's dtype; query_start_loc
    [B+1] int32; seq_lens [B] int32; block_table [B, max_blocks] int32.
    `max_query_len` / `max_seq_len` bound the batch (Python ints, shape the
    grid); `num_splits` overrides the decode split count and `config` the
    tiles (BLOCK_M, TILE_N, num_warps, num_stages) and the decode's
    MIN_SPLIT_LEN and TWO_LAUNCH (Note [one-launch decode]) for tests and
    benchmarks; tile sizes are rounded up to powers of two >= 16 (Note [dot
    tiles]).
    Writes into `out` ([T, H, D], query's dtype, last dim contiguous) when
    given, else into a new tensor; returns it. Every row is written (rows of
    no request: 0).

    Index checks (compile_backend/kernels/_checks.py, Note [index checks]) run for CPU tensors,
    and for CUDA ones under `set_debug_checks(True)`. Without them the kernels
    trust that query_start_loc stays within the T tokens, that each request
    with queries has seq_len >= its query count and within its block_table
    row, and that the block ids it reads (its first ceil(seq_len /
    block_size)) lie in [0, num_blocks); anything else reads other memory."""
    _check(query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
           max_query_len, max_seq_len, num_splits)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    plan = _Plan(query, key_cache, out, query_start_loc, seq_lens, block_table, max_query_len,
                 max_seq_len, num_splits, config)
    plan.run(query, key_cache, value_cache, out, float(scale) * LOG2E, plan.stream)
    return out


def unified_attention_ref(query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                          scale) -> torch.Tensor:
    """Plain torch, one request at a time, math in fp32 (fp64 for fp64 input),
    with `unified_attention`'s tensor arguments and scale. Index checks as in
    `unified_attention`."""
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


def unified_attention_impl(query, key_cache, value_cache, output, layer_name, scale) -> None:
    """The op (types: its schema below): every argument checked on every
    call (ValueError)."""
    _attend_checked(layer_metadata(layer_name, "unified_attention"), query, key_cache,
                    value_cache, output, scale)


def _attend_checked(meta, query, key_cache, value_cache, output, scale) -> None:
    if use_triton(query):
        unified_attention(query, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                          meta.block_table, scale, meta.max_query_len, meta.max_seq_len, out=output)
        return
    _check_output(query, output, query.device)
    output.copy_(unified_attention_ref(query, key_cache, value_cache, meta.query_start_loc,
                                       meta.seq_lens, meta.block_table, scale))


def unified_attention_direct(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    scale: float,
) -> None:
    """What eager pieces call instead of the op (compile_backend/core/
    direct_calls.py): the op's effect, through the step's plan where one
    serves (Note [attention plans] in compile_backend/kernels/attention_plan.py), else through
    the checked path."""
    ctx = get_forward_context()
    meta = ctx.attn_metadata.get(resolve_layer(layer_name))
    plan = find_plan(meta, query, key_cache, value_cache, output, ctx)
    if plan is not None:
        stream = plan.ready(meta, query, key_cache, value_cache, output)
        if stream is not None:
            if ctx.trace is not None:
                ctx.record(layer_name, "unified_attention")
            plan.run(query, key_cache, value_cache, output, scale * LOG2E, stream)
            return
    meta = layer_metadata(layer_name, "unified_attention")  # AttentionMetadata
    if not (use_triton(query) and plannable(query, key_cache, value_cache, output, ctx)):
        _attend_checked(meta, query, key_cache, value_cache, output, scale)
        return
    args = (meta.query_start_loc, meta.seq_lens, meta.block_table, meta.max_query_len,
            meta.max_seq_len)
    _check(query, key_cache, value_cache, output, *args)
    plan = _Plan(query, key_cache, output, *args, bind=query.is_cuda)
    keep_plan(meta, plan, query, key_cache, value_cache, output, ctx)
    plan.run(query, key_cache, value_cache, output, float(scale) * LOG2E, plan.stream)


unified_attention_op = define_op(
    "mrv2::unified_attention",
    mutates_args=("output",),
    schema="(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, str layer_name, "
    "float scale) -> ()",
)(unified_attention_impl)
register_direct_impl("mrv2::unified_attention", unified_attention_direct)
# A breakpoint: in PIECEWISE it runs eagerly, with the step's exact
# max_query_len / max_seq_len (they shape its grid); FULL graphs capture it
# with bounds (metadata built for_capture).
register_op("mrv2::unified_attention", role=OpRole.BREAKPOINT, layer_keyed=True, capture_safe=True)


@torch.library.register_fake("mrv2::unified_attention")
def _(query, key_cache, value_cache, output, layer_name, scale):
    return None
