"""Rotary positions on q and k, and this step's keys and values into the
paged KV cache, in one kernel.

q [T, H, D] -> q_rot [T, H, D] (returned); k [T, KVH, D] rotated and v
[T, KVH, D] as is -> key_cache/value_cache [num_blocks, block_size, KVH, D]
at slot_mapping[t] = block * block_size + offset; slot -1 (a padding token)
writes nothing to the caches, but its q_rot is still written. Rotary is the
half-split layout of the reference models' `Rotary`, all in fp32:
    angle = float(positions[t]) * inv_freq          # [D/2], inv_freq upcast to fp32
    x1, x2 = x[..., :D/2], x[..., D/2:]              # upcast to fp32
    x_rot = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
rounded to the output dtype once. docs/design.md, section "Rotary and the KV
write in one kernel".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_backend.core.direct_calls import direct_custom_op
from compile_backend.core.op_registry import OpRole, register_op

from ._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_device, check_ids, check_kv_caches,
                      check_tensor)
from ._debug import index_checks_on
from ._device import interpreting, next_pow2, pdl_meta, pdl_release, pdl_wait, round_to, use_triton
from ._launch import Launch, LayoutMemo, launch_here, layout
from ._metadata import layer_metadata
from .reshape_and_cache import reshape_and_cache_ref


# Note [rotary's fused multiply-adds]: x1 cos - x2 sin is written as
# fma(x1, cos, -(x2 sin)) and x2 cos + x1 sin as fma(x2, cos, x1 sin), here and
# in the decode attention's rotary (compile_backend/kernels/unified_attention.py,
# Note [rotary inside decode attention]). Left to the compiler, which product
# it fuses into the add depends on the code around it, so the two kernels
# rounded some fp32 keys one ulp apart on the GPU; spelled out, both give the
# same bits (within one rounding of the torch reference either way).
@triton.jit
def _rope_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, inv_freq_ptr, out_ptr,
    key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h,
    stride_c_blk, stride_c_off, stride_c_h,
    GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr, WRITE_CACHE: tl.constexpr,
    RNE_BF16: tl.constexpr, PDL: tl.constexpr,
):
    # Program (t, g): token t, KV head g and its GROUP query heads
    # g * GROUP .. (g + 1) * GROUP - 1. Each row is read as its two halves.
    t = tl.program_id(0)
    g = tl.program_id(1)
    t64 = t.to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    in_half = j < HALF
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    # Note [programmatic dependent launch]: the layer's slots (attention
    # metadata) before the wait; the arguments (the kernel just before may
    # compute any of them) and every store after it.
    pdl_wait(PDL)
    inv = tl.load(inv_freq_ptr + j, mask=in_half, other=0.0).to(tl.float32)
    pos = tl.load(positions_ptr + t).to(tl.float32)
    ang = pos * inv
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    pdl_release(PDL)

    # q: every token, padding included.
    i = tl.arange(0, BLOCK_G)
    qh = g * GROUP + i
    q_mask = (i[:, None] < GROUP) & in_half[None, :]
    src = q_ptr + t64 * stride_q_t + qh[:, None] * stride_q_h + j[None, :]
    x1 = tl.load(src, mask=q_mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=q_mask).to(tl.float32)
    c2, s2 = cos[None, :], sin[None, :]
    dst = out_ptr + t64 * stride_o_t + qh[:, None] * stride_o_h + j[None, :]
    qty: tl.constexpr = out_ptr.dtype.element_ty
    # Note [rotary's fused multiply-adds]: one fma each, spelled out.
    tl.store(dst, round_to(tl.fma(x1, c2, -(x2 * s2)), qty, RNE_BF16), mask=q_mask)
    tl.store(dst + HALF, round_to(tl.fma(x2, c2, x1 * s2), qty, RNE_BF16), mask=q_mask)

    if WRITE_CACHE:
        # Scalar conditions enter masks as bounds (Note [scalar masks] in _device.py).
        kv_mask = j < tl.where(slot >= 0, HALF, 0)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        ksrc = k_ptr + t64 * stride_k_t + g * stride_k_h + j
        k1 = tl.load(ksrc, mask=kv_mask).to(tl.float32)
        k2 = tl.load(ksrc + HALF, mask=kv_mask).to(tl.float32)
        vsrc = v_ptr + t64 * stride_v_t + g * stride_v_h + j
        v1 = tl.load(vsrc, mask=kv_mask)
        v2 = tl.load(vsrc + HALF, mask=kv_mask)
        cdst = blk * stride_c_blk + off * stride_c_off + g * stride_c_h + j
        kty: tl.constexpr = key_cache_ptr.dtype.element_ty
        tl.store(key_cache_ptr + cdst, round_to(tl.fma(k1, cos, -(k2 * sin)), kty, RNE_BF16),
                 mask=kv_mask)
        tl.store(key_cache_ptr + cdst + HALF, round_to(tl.fma(k2, cos, k1 * sin), kty, RNE_BF16),
                 mask=kv_mask)
        tl.store(value_cache_ptr + cdst, v1, mask=kv_mask)
        tl.store(value_cache_ptr + cdst + HALF, v2, mask=kv_mask)


def _check_args(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping, out,
                device_check: bool):
    """Every argument check of `rope_and_cache` (ValueError); returns (T, H, KVH, D)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_device("q", q) if device_check else q.device
    T, H, D = q.shape
    if D < 2 or D % 2:
        raise ValueError(f"q: expected an even head size (rotary's half-split layout), got "
                         f"shape {tuple(q.shape)} (head size {D})")
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), dtype_of="q", device=device,
                 last_dim_contiguous=True)
    check_tensor("k", k, shape=(T, None, D))
    KVH = k.shape[1]
    if KVH == 0 or H % KVH:
        raise ValueError(f"k: expected a number of KV heads that divides q's {H} heads, got "
                         f"shape {tuple(k.shape)} ({KVH} KV heads)")
    check_tensor("v", v, shape=(T, KVH, D), dtypes=(q.dtype,), dtype_of="q", device=device,
                 last_dim_contiguous=True)
    check_tensor("positions", positions, shape=(T,), dtypes=INDEX_DTYPES, device=device)
    check_tensor("inv_freq", inv_freq, shape=(D // 2,), dtypes=FLOAT_DTYPES, device=device,
                 contiguous=True)
    check_kv_caches(key_cache, value_cache, dtype=q.dtype, dtype_of="q", device=device,
                    shape=(None, None, KVH, D))
    check_tensor("slot_mapping", slot_mapping, shape=(T,), dtypes=(torch.int64,), device=device)
    if out is not None:
        check_tensor("out", out, shape=(T, H, D), dtypes=(q.dtype,), dtype_of="q", device=device,
                     last_dim_contiguous=True)
    check_ids("rope_and_cache", slot_mapping=slot_mapping, cache=("key_cache", key_cache))
    return T, H, KVH, D


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher. q [T, H, D], k/v [T, KVH, D] of one dtype (last dim
    contiguous, any token and head strides: column slices of a fused qkv
    output work), D even, H a multiple of KVH; positions [T] int32/int64;
    inv_freq [D/2] (fp32, or the model's dtype); caches [num_blocks,
    block_size, KVH, D] contiguous and of q's dtype; slot_mapping [T] int64;
    out [T, H, D] (optional, last dim contiguous). Returns q_rot (`out`, or
    a new contiguous tensor). Checks everything before writing anything.

    Index checks (compile_backend/kernels/_checks.py, Note [index checks]) run for CPU tensors,
    and for CUDA ones under `set_debug_checks(True)`. Without them the kernel
    trusts every slot to lie in [-1, num_blocks * block_size); any other
    slot writes outside the caches."""
    entry, checked = _LAUNCHES.entry(
        q.device, layout(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping, out),
        lambda: _plan(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping, out))
    if not checked and index_checks_on(q.device):
        check_ids("rope_and_cache", slot_mapping=slot_mapping, cache=("key_cache", key_cache))
    launch, shape, write_cache, ints = entry
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    if launch is not None:
        # Without cache blocks (nothing bound yet: every slot is -1) the kernel
        # writes only q_rot; out stands in for the empty caches' pointers.
        kc, vc = (key_cache, value_cache) if write_cache else (out, out)
        launch_here(launch, (q, k, v, positions, inv_freq, out, kc, vc, slot_mapping, *ints))
    return out


# Checked launches by layout (Note [checked layouts] in compile_backend/kernels/_launch.py):
# (Launch or None for no tokens, out's shape, whether the caches are written,
# the launch's int arguments).
_LAUNCHES = LayoutMemo()


def _plan(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping, out) -> tuple:
    """Check a call (ValueError) and derive its launch (`_LAUNCHES`' entries)."""
    T, H, KVH, D = _check_args(q, k, v, positions, inv_freq, key_cache, value_cache,
                               slot_mapping, out, device_check=True)
    write_cache = key_cache.numel() > 0
    if T == 0:
        return None, (T, H, D), write_cache, ()
    # out's strides: its own, or those of the contiguous [T, H, D] made for it.
    out_strides = (out.stride(0), out.stride(1)) if out is not None else (H * D, D)
    cs = key_cache.stride()[:3] if write_cache else (0, 0, 0)
    ints = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *out_strides, *cs)
    group = H // KVH
    half = D // 2
    block_g, block_half = next_pow2(group), next_pow2(half)
    meta = dict(GROUP=group, HALF=half, BLOCK_SIZE=key_cache.shape[1],
                BLOCK_G=block_g, BLOCK_HALF=block_half, WRITE_CACHE=write_cache,
                RNE_BF16=interpreting() and q.dtype == torch.bfloat16,
                num_warps=max(1, min(4, block_g * block_half // 256)), **pdl_meta(q.device))
    return Launch(_rope_and_cache_kernel, (T, KVH), meta, bind=q.is_cuda), (T, H, D), write_cache, ints


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> rotated, in x's dtype: the reference models' `Rotary`
    (compile_backend/demo/models/blocks.py), the same torch operations."""
    ang = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_and_cache_ref(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping,
                       out=None) -> torch.Tensor:
    """Plain torch, with `rope_and_cache`'s arguments (the tests' reference and
    the CPU fallback): `rotary_ref` on q and k, then `reshape_and_cache_ref`.
    Argument and index checks as in `rope_and_cache` (device aside)."""
    _check_args(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping, out,
                device_check=False)
    q_rot = rotary_ref(q, positions, inv_freq)
    reshape_and_cache_ref(rotary_ref(k, positions, inv_freq), v, key_cache, value_cache,
                          slot_mapping)
    if out is None:
        return q_rot
    out.copy_(q_rot)
    return out


def rope_and_cache_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layer_name: str,
) -> torch.Tensor:
    meta = layer_metadata(layer_name, "rope_and_cache")  # AttentionMetadata
    fn = rope_and_cache if use_triton(q) else rope_and_cache_ref
    return fn(q, k, v, positions, inv_freq, key_cache, value_cache, meta.slot_mapping)


# Eager pieces call it without the dispatcher (compile_backend/core/direct_calls.py).
rope_and_cache_op = direct_custom_op(
    "mrv2::rope_and_cache",
    mutates_args=("key_cache", "value_cache"),
    schema="(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor inv_freq, "
    "Tensor(a!) key_cache, Tensor(b!) value_cache, str layer_name) -> Tensor",
    same_launches=True,  # reads only the slot mapping: one launch for every batch of a size
)(rope_and_cache_impl)
# Attention-like, as reshape_and_cache: the KV write needs only the slot
# mapping, a persistent buffer, so it runs inside the piece before attention.
register_op("mrv2::rope_and_cache", role=OpRole.ATTENTION_LIKE, layer_keyed=True,
            capture_safe=True)


@torch.library.register_fake("mrv2::rope_and_cache")
def _(q, k, v, positions, inv_freq, key_cache, value_cache, layer_name):
    return q.new_empty(q.shape)
