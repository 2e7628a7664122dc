"""Rotary, this step's KV write and decode attention in one launch.

`rope_and_cache` then `unified_attention` as one op (the breakpoint): q, k
un-rotated [T, H, D] / [T, KVH, D], v [T, KVH, D] -> out [T, H, D], and k
rotated and v written into the paged caches at slot_mapping. On a decode
batch (max_query_len == 1) the decode kernels of unified_attention.py run
with ROPE on: each program rotates its query heads as it loads them, and the
program whose split ends at seq_len writes this step's rotated key and value
at its slot before it reads its keys (that slot's only reader in the
launch): the bits of the two ops, one launch fewer. Anything else (a
prefill or mixed batch, unbound caches, plain CPU tensors) runs the two ops.
Written by FuseRopeAttentionPass (compile_backend/passes/fuse_rope_attention.py)
for FULL graphs only. docs/design.md, "Rotary inside decode attention".
"""

from __future__ import annotations

import torch

from compile_backend.core.counters import counters
from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import OpRole, register_op

from ._device import use_triton
from ._metadata import layer_metadata
from .rope_and_cache import _check_args as _check_rope, rope_and_cache, rope_and_cache_ref
from .unified_attention import (
    LOG2E, _check, _check_output, _Plan, unified_attention, unified_attention_ref,
)


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Launcher: `rope_and_cache`'s arguments (q, k, v, positions, inv_freq,
    caches, slot_mapping) and `unified_attention`'s (metadata, scale, bounds,
    num_splits, config); returns out [T, H, D]. Every check of both runs
    before anything is written. A decode batch runs one fused launch (two
    where the decode takes its split + reduce form); the new tokens' slots
    must be the positions seq_lens[b] - 1 of their requests' block tables,
    as every metadata builder makes them."""
    _check_rope(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping, None,
                device_check=True)
    _check(q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
           max_query_len, max_seq_len, num_splits)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not fused(q, key_cache, query_start_loc, max_query_len):
        q_rot = rope_and_cache(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping)
        return unified_attention(q_rot, key_cache, value_cache, query_start_loc, seq_lens,
                                 block_table, scale, max_query_len, max_seq_len, num_splits,
                                 config, out=out)
    plan = _Plan(q, key_cache, out, query_start_loc, seq_lens, block_table, max_query_len,
                 max_seq_len, num_splits, config, rope=True)
    rope = (k, v, positions, inv_freq, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1))
    plan.run(q, key_cache, value_cache, out, float(scale) * LOG2E, plan.stream, rope)
    counters["rope_attention_fused_launches"] += 1
    counters["rope_attention_fused_captured"] += int(plan.in_capture)  # replays run it too
    return out


def fused(q: torch.Tensor, key_cache: torch.Tensor, query_start_loc: torch.Tensor,
          max_query_len: int) -> bool:
    """Does this call take the fused decode launch (else the two ops)?"""
    return (use_triton(q) and max_query_len == 1 and q.shape[0] > 0
            and query_start_loc.shape[0] > 1 and key_cache.numel() > 0)


def rope_attention_ref(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping,
                       query_start_loc, seq_lens, block_table, scale) -> torch.Tensor:
    """Plain torch: `rope_and_cache_ref` (writes the caches), then
    `unified_attention_ref` on the rotated q. Returns out [T, H, D]."""
    q_rot = rope_and_cache_ref(q, k, v, positions, inv_freq, key_cache, value_cache, slot_mapping)
    return unified_attention_ref(q_rot, key_cache, value_cache, query_start_loc, seq_lens,
                                 block_table, scale)


def rope_attention_impl(q, k, v, positions, inv_freq, key_cache, value_cache, output,
                        layer_name, scale) -> None:
    """The op (types: its schema below): the layer's metadata, every argument
    checked on every call (ValueError)."""
    meta = layer_metadata(layer_name, "rope_attention")  # AttentionMetadata
    if use_triton(q):
        rope_attention(q, k, v, positions, inv_freq, key_cache, value_cache, meta.slot_mapping,
                       meta.query_start_loc, meta.seq_lens, meta.block_table, scale,
                       meta.max_query_len, meta.max_seq_len, out=output)
        return
    _check_output(q, output, q.device)  # the references check the rest
    output.copy_(rope_attention_ref(q, k, v, positions, inv_freq, key_cache, value_cache,
                                    meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                    meta.block_table, scale))


rope_attention_op = define_op(
    "mrv2::rope_attention",
    mutates_args=("key_cache", "value_cache", "output"),
    schema="(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor inv_freq, "
    "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!) output, str layer_name, "
    "float scale) -> ()",
)(rope_attention_impl)
# A breakpoint, as unified_attention: FULL graphs capture it with bounds
# (metadata built for_capture); the pass writes it only into FULL graphs.
register_op("mrv2::rope_attention", role=OpRole.BREAKPOINT, layer_keyed=True, capture_safe=True)


@torch.library.register_fake("mrv2::rope_attention")
def _(q, k, v, positions, inv_freq, key_cache, value_cache, output, layer_name, scale):
    return None
