"""Short causal depthwise convolution with per-request state (attention-like).

x [T, C], weight [C, K] -> out [T, C]:
    out[t, c] = bias[c] + sum_k weight[c, k] * u[t - (K-1) + k, c]
where u is the request's inputs preceded by its K-1 previous inputs, which are
read from conv_state[state_indices[b]] ([C, K-1], oldest first; zeros when
has_initial_state[b] is False). The op then stores the request's last K-1
inputs back into that slot. state_indices[b] == -1 marks a padding row: no
state read or written, its tokens' output (like any token outside a request)
is 0, written by the kernel. One step and the same tokens split over several
steps give bit-identical results in every dtype. docs/design.md, section
"Ops with per-request state".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import OpRole, register_op

from ._checks import FLOAT_DTYPES, check_device, check_ids, check_int, check_tensor
from ._device import BATCH_INTS, SEARCH, cdiv, interpreting, next_pow2, request_grid, request_tile, use_triton
from ._metadata import layer_metadata


@triton.jit
def _conv_rows(x_ptr, state_row, weight_ptr, q_start, tok, t_ok, c, c_ok, c_init,
               stride_x_t, stride_w_c, stride_w_k, stride_s_k,
               KERNEL_SIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
               WITH_STATE: tl.constexpr):
    """fp32 [ROWS, BLOCK_C]: for the request's tokens `tok` ([ROWS], where
    t_ok), sum over taps k in order of weight[c, k] * u[tok - (K-1) + k, c]; u
    is the request's input x, before it (src < 0) its K-1 state entries when
    WITH_STATE, else 0 (rows that read no state, or requests without one)."""
    acc = tl.zeros([ROWS, BLOCK_C], tl.float32)
    for k in tl.static_range(KERNEL_SIZE):
        src = tok - (KERNEL_SIZE - 1) + k  # < 0: one of the K-1 inputs held in the state
        in_x = src >= 0
        u = tl.load(x_ptr + (q_start + src).to(tl.int64)[:, None] * stride_x_t + c[None, :],
                    mask=(t_ok & in_x)[:, None] & c_ok[None, :], other=0.0)
        if WITH_STATE:
            sv = tl.load(state_row + (KERNEL_SIZE - 1 + src)[:, None] * stride_s_k,
                         mask=(t_ok & ~in_x)[:, None] & c_init[None, :], other=0.0)
            u = tl.where(in_x[:, None], u, sv)
        w = tl.load(weight_ptr + c * stride_w_c + k * stride_w_k, mask=c_ok, other=0.0)
        acc += u.to(tl.float32) * w.to(tl.float32)[None, :]
    return acc


@triton.jit(do_not_specialize=BATCH_INTS)
def _sconv_kernel(
    x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, state_idx_ptr, has_init_ptr,
    stride_x_t, stride_w_c, stride_w_k, stride_s_slot, stride_s_c, stride_s_k, stride_o_t,
    C, num_reqs, num_tokens,
    KERNEL_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, SUB_T: tl.constexpr,
    BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_TOKEN: tl.constexpr, SEARCH: tl.constexpr,
):
    # Program (tile of BLOCK_T tokens of one request, channel block): Note
    # [request tiles] in _device.py; the tile's rows go in chunks of SUB_T,
    # only as many as the request has there. Tokens of requests without a
    # state (and of the padding pseudo-request) get output 0.
    c_blk = tl.program_id(1)
    b, q_start, q_len, t_tile, pad_row = request_tile(qsl_ptr, num_reqs, num_tokens, BLOCK_T, SEARCH,
                                                      ONE_TOKEN)
    slot = tl.load(state_idx_ptr + b, mask=b < num_reqs, other=-1).to(tl.int64)
    real = slot >= 0
    has_init = (tl.load(has_init_ptr + b, mask=b < num_reqs, other=0) != 0) & real
    c = c_blk * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    c_init = c < tl.where(has_init, C, 0)  # Note [scalar masks] in _device.py
    state_row = state_ptr + slot * stride_s_slot + c[None, :] * stride_s_c  # [1, BLOCK_C]
    bias = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    n_out = tl.where(real, q_len, 0)  # tokens with a convolution; the others get 0

    # Rows below K-1 of tile 0 read the state when the request has one: the
    # state pass computes them; the chunks skip them (and all their loads).
    state_rows = tl.where(has_init & (t_tile == 0), KERNEL_SIZE - 1, 0)
    t0 = t_tile * BLOCK_T
    rows = tl.minimum(tl.maximum(q_len - t0, 0), BLOCK_T)
    for r0 in range(tl.where(rows <= state_rows, rows, 0), rows, SUB_T):
        tok = t0 + r0 + tl.arange(0, SUB_T)  # index within the request
        t_ok = tok < n_out
        acc = _conv_rows(x_ptr, state_row, weight_ptr, q_start, tok, t_ok, c, c_ok, c_init,
                         stride_x_t, stride_w_c, stride_w_k, stride_s_k,
                         KERNEL_SIZE=KERNEL_SIZE, ROWS=SUB_T, BLOCK_C=BLOCK_C, WITH_STATE=False)
        acc = tl.where(t_ok[:, None], acc + bias[None, :], 0.0)
        tl.store(out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_o_t + c[None, :],
                 acc.to(out_ptr.dtype.element_ty),
                 mask=((tok < q_len) & (tok >= state_rows))[:, None] & c_ok[None, :])
    # The state pass: rows below min(K-1, q_len) of tile 0 of a request with state.
    j = tl.arange(0, BLOCK_K)
    s_ok = j < tl.minimum(state_rows, q_len)
    acc = _conv_rows(x_ptr, state_row, weight_ptr, q_start, j, s_ok, c, c_ok, c_init,
                     stride_x_t, stride_w_c, stride_w_k, stride_s_k,
                     KERNEL_SIZE=KERNEL_SIZE, ROWS=BLOCK_K, BLOCK_C=BLOCK_C, WITH_STATE=True)
    tl.store(out_ptr + (q_start + j).to(tl.int64)[:, None] * stride_o_t + c[None, :],
             (acc + bias[None, :]).to(out_ptr.dtype.element_ty), mask=s_ok[:, None] & c_ok[None, :])
    if ONE_TOKEN:
        tl.store(out_ptr + pad_row.to(tl.int64) * stride_o_t + c,
                 tl.zeros([BLOCK_C], out_ptr.dtype.element_ty), mask=c < tl.where(pad_row >= 0, C, 0))

    # New state = the last K-1 entries of (old state ++ this step's inputs).
    # Only tile 0 reads the old state (BLOCK_T >= K-1), so only it writes it.
    src = q_len - (KERNEL_SIZE - 1) + j  # [BLOCK_K]
    in_x = src >= 0
    upd = j < tl.where(real & (q_len > 0) & (t_tile == 0), KERNEL_SIZE - 1, 0)
    m = upd[:, None] & c_ok[None, :]
    xv = tl.load(x_ptr + (q_start + src).to(tl.int64)[:, None] * stride_x_t + c[None, :],
                 mask=m & in_x[:, None], other=0.0)
    sv = tl.load(state_row + (KERNEL_SIZE - 1 + src)[:, None] * stride_s_k,
                 mask=upd[:, None] & c_init[None, :] & (~in_x)[:, None], other=0.0)
    new = tl.where(in_x[:, None], xv, sv.to(xv.dtype))  # [BLOCK_K, BLOCK_C]
    # Note [read before write]: every thread's state reads must land before any
    # thread overwrites the slot (a read of entry j+q_len by one thread and the
    # write of entry j by another may alias).
    tl.debug_barrier()
    tl.store(state_row + j[:, None] * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=m)


def sconv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    max_query_len: int,
    config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher. x [T, C] (last dim contiguous); weight [C, K] (K >= 2); bias
    [C] or None; conv_state [num_slots, C, K-1] of x's dtype, updated in place;
    query_start_loc [B+1] int32; state_indices [B] int32; has_initial_state [B]
    bool. `max_query_len` (Python int) bounds every request's token count; the
    grid scales with T (Note [request tiles]), 1 takes the decode shortcut.
    `config` overrides the tile sizes (block_t: tokens per program, sub_t:
    rows per step within it, block_c, num_warps; benchmarks).
    Any channel count C >= 1 and width K >= 2 work (channels are tiled).
    Writes every row of `out` ([T, C] like x; new when None) and returns it.

    Index checks (compile_backend/kernels/_checks.py, Note [index checks]) run for CPU tensors,
    and for CUDA ones under `set_debug_checks(True)`. Without them the kernel
    trusts query_start_loc to stay within the T tokens and every state index
    to lie in [-1, num_slots); anything else reads and writes other memory."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_device("x", x)
    T, C = x.shape
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("weight", weight, shape=(C, None))
    K = weight.shape[1]
    if K < 2:
        raise ValueError(f"weight: expected a kernel width K >= 2 (shape [C, K]), got shape {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, shape=(C,), dtypes=FLOAT_DTYPES, device=device)
    check_tensor("conv_state", conv_state, ndim=3, dtypes=(x.dtype,), dtype_of="x", device=device)
    check_tensor("conv_state", conv_state, shape=(None, C, K - 1))
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    B = query_start_loc.shape[0] - 1
    check_tensor("state_indices", state_indices, shape=(B,), dtypes=(torch.int32,), device=device)
    check_tensor("has_initial_state", has_initial_state, shape=(B,), dtypes=(torch.bool,), device=device)
    check_int("max_query_len", max_query_len, 0)
    if out is not None:
        check_tensor("out", out, shape=(T, C), dtypes=(x.dtype,), dtype_of="x", device=device,
                     last_dim_contiguous=True)
    check_ids("sconv", num_tokens=T, query_start_loc=query_start_loc, state_indices=state_indices,
              states=("conv_state", conv_state.shape[0]))

    if out is None:
        out = torch.empty((T, C), dtype=x.dtype, device=device)
    if T == 0:
        return out
    small = interpreting()
    cfg = dict(block_t=16 if small else 64, sub_t=4 if small else 16, block_c=64 if small else 128,
               num_warps=4)
    cfg.update(config or {})
    block_t = max(next_pow2(K - 1), min(cfg["block_t"], next_pow2(max_query_len)))
    sub_t = min(next_pow2(cfg["sub_t"]), block_t)
    block_c = min(next_pow2(C), cfg["block_c"])
    assert block_t >= K - 1, block_t  # Note [read before write]: only tile 0 reads the state
    one_token = max_query_len == 1
    grid = (request_grid(T, B, block_t, one_token), cdiv(C, block_c))
    _sconv_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, out,
        query_start_loc, state_indices, has_initial_state,
        x.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out.stride(0),
        C, B, T,
        KERNEL_SIZE=K, BLOCK_K=next_pow2(K - 1), BLOCK_T=block_t, SUB_T=sub_t, BLOCK_C=block_c,
        HAS_BIAS=bias is not None, ONE_TOKEN=one_token, SEARCH=SEARCH, num_warps=cfg["num_warps"],
    )
    return out


def sconv_ref(x, weight, bias, conv_state, query_start_loc, state_indices,
              has_initial_state) -> torch.Tensor:
    """Plain torch, one request at a time, with `sconv`'s tensor arguments;
    updates conv_state in place. Index checks as in `sconv`."""
    check_ids("sconv", num_tokens=x.shape[0], query_start_loc=query_start_loc,
              state_indices=state_indices, states=("conv_state", conv_state.shape[0]))
    C, K = weight.shape
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros_like(x)
    qsl = query_start_loc.tolist()
    idx = state_indices.tolist()
    init = has_initial_state.tolist()
    w = weight.to(acc_dtype)
    for b in range(len(idx)):
        q0, q1, slot = qsl[b], qsl[b + 1], idx[b]
        if slot < 0 or q1 <= q0:
            continue
        prev = conv_state[slot].T if init[b] else x.new_zeros(K - 1, C)  # [K-1, C]
        u = torch.cat([prev.to(x.dtype), x[q0:q1]])  # [K-1+L, C]
        windows = u.to(acc_dtype).unfold(0, K, 1)  # [L, C, K]
        y = (windows * w).sum(-1)
        if bias is not None:
            y = y + bias.to(acc_dtype)
        out[q0:q1] = y.to(x.dtype)
        conv_state[slot] = u[-(K - 1):].T.to(conv_state.dtype)
    return out


def _sconv_into(out: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, conv_state: torch.Tensor, layer_name: str) -> torch.Tensor:
    """The op, its result written into `out` (None: a new tensor)."""
    meta = layer_metadata(layer_name, "sconv")  # SConvMetadata
    if use_triton(x):
        return sconv(x, weight, bias, conv_state, meta.query_start_loc, meta.state_indices,
                     meta.has_initial_state, meta.max_query_len, out=out)
    y = sconv_ref(x, weight, bias, conv_state, meta.query_start_loc, meta.state_indices,
                  meta.has_initial_state)
    return y if out is None else out.copy_(y)


@define_op(
    "mrv2::sconv",
    mutates_args=("conv_state",),
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, str layer_name) "
    "-> Tensor",
    into=_sconv_into,  # a FULL plan's derived mixed graph writes the decode graph's output
)
def sconv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    layer_name: str,
) -> torch.Tensor:
    return _sconv_into(None, x, weight, bias, conv_state, layer_name)


# Attention-like: its metadata is capturable for any batch (Note [attention-like
# metadata is always capturable]), so it never splits a graph and runs captured.
register_op("mrv2::sconv", role=OpRole.ATTENTION_LIKE, layer_keyed=True, capture_safe=True)


@torch.library.register_fake("mrv2::sconv")
def _(x, weight, bias, conv_state, layer_name):
    return torch.empty_like(x)
