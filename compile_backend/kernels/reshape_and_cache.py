"""Write this step's keys and values into the paged KV cache.

key/value [T, KVH, D] -> key_cache/value_cache [num_blocks, block_size, KVH, D]
at slot_mapping[t] = block * block_size + offset; slot -1 (a padding token)
writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_backend.core.direct_calls import direct_custom_op
from compile_backend.core.op_registry import OpRole, register_op

from ._checks import FLOAT_DTYPES, check_device, check_ids, check_kv_caches, check_tensor
from ._device import next_pow2, use_triton
from ._metadata import layer_metadata


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_c_blk, stride_c_off, stride_c_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: copies its [KVH, D] key and value rows.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    # Scalar conditions enter masks as bounds (Note [scalar masks] in _device.py).
    h_lim = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < h_lim) & (d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_k_t + h[:, None] * stride_k_h + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_v_t + h[:, None] * stride_v_h + d[None, :], mask=mask)
    dst = blk * stride_c_blk + off * stride_c_off + h[:, None] * stride_c_h + d[None, :]
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launcher. key/value [T, KVH, D] (last dim contiguous), caches
    [num_blocks, block_size, KVH, D] contiguous and of key's dtype,
    slot_mapping [T] int64. Checks everything before writing anything.

    Index checks (compile_backend/kernels/_checks.py, Note [index checks]) run for CPU tensors,
    and for CUDA ones under `set_debug_checks(True)`. Without them the kernel
    trusts every slot to lie in [-1, num_blocks * block_size); any other
    slot writes outside the caches."""
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = check_device("key", key)
    T, KVH, D = key.shape
    check_tensor("value", value, shape=(T, KVH, D), dtypes=(key.dtype,), dtype_of="key", device=device,
                 last_dim_contiguous=True)
    check_kv_caches(key_cache, value_cache, dtype=key.dtype, dtype_of="key", device=device,
                    shape=(None, None, KVH, D))
    check_tensor("slot_mapping", slot_mapping, shape=(T,), dtypes=(torch.int64,), device=device)
    check_ids("reshape_and_cache", slot_mapping=slot_mapping, cache=("key_cache", key_cache))
    block_size = key_cache.shape[1]
    if T == 0 or key_cache.shape[0] == 0:
        return
    _reshape_and_cache_kernel[(T,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=KVH, HEAD_DIM=D, BLOCK_SIZE=block_size,
        BLOCK_H=next_pow2(KVH), BLOCK_D=next_pow2(D),
        num_warps=4 if KVH * D >= 1024 else 1,
    )


def reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Plain torch, in place, with `reshape_and_cache`'s arguments (the tests'
    reference and the CPU fallback). Index checks as in `reshape_and_cache`."""
    check_ids("reshape_and_cache", slot_mapping=slot_mapping, cache=("key_cache", key_cache))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    key_cache[blk, off] = key[keep].to(key_cache.dtype)
    value_cache[blk, off] = value[keep].to(value_cache.dtype)


def reshape_and_cache_impl(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layer_name: str,
) -> None:
    meta = layer_metadata(layer_name, "reshape_and_cache")  # AttentionMetadata
    fn = reshape_and_cache if use_triton(key) else reshape_and_cache_ref
    fn(key, value, key_cache, value_cache, meta.slot_mapping)


# Eager pieces call it without the dispatcher (compile_backend/core/direct_calls.py).
reshape_and_cache_op = direct_custom_op(
    "mrv2::reshape_and_cache",
    mutates_args=("key_cache", "value_cache"),
    schema="(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "str layer_name) -> ()",
    same_launches=True,  # reads only the slot mapping: one launch for every batch of a size
)(reshape_and_cache_impl)
# Attention-like: the KV write needs only the slot mapping, a persistent buffer,
# so it runs inside the piece before attention, off the eager region's host path.
register_op("mrv2::reshape_and_cache", role=OpRole.ATTENTION_LIKE, layer_keyed=True,
            capture_safe=True)


@torch.library.register_fake("mrv2::reshape_and_cache")
def _(key, value, key_cache, value_cache, layer_name):
    return None
