"""Typed metadata, one dataclass per op family: written by a metadata builder
(compile_backend/runner/metadata_builders.py), read by the op through the forward
context. B = padded number of requests, T = padded number of tokens.

Padding convention (docs/design.md, "Metadata builders"): padding requests own
zero query tokens (query_start_loc repeats its last value), have seq_len 0,
block 0 (the null block) in every block-table entry, state index -1; padding
tokens have slot -1 (no KV write) and position 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class Metadata:
    """Base of every metadata dataclass, users' own included: `tensors()`
    lets debug checks verify that no tensor moved since capture."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (for address checks and the dump)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }


@dataclass
class AttentionMetadata(Metadata):
    """For `mrv2::reshape_and_cache` and `mrv2::unified_attention`."""

    query_start_loc: torch.Tensor  # [B+1] int32: request b owns queries qsl[b]:qsl[b+1]
    seq_lens: torch.Tensor  # [B] int32: cached tokens incl. this step's, per request
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token, -1 = none
    num_reqs: int  # B
    max_query_len: int  # 1 => uniform single-token decode (split-KV path)
    max_seq_len: int  # upper bound of seq_lens (the runner's builder: max_model_len)
    for_capture: bool = False
    # This step's launch plans of unified attention's direct path: None, then
    # {key: plan} (Note [attention plans] in compile_backend/kernels/attention_plan.py, which
    # reaches the field by this name). Not an argument, not in repr or
    # equality; a dataclasses.replace copy starts with none.
    attention_plans: dict | None = field(default=None, init=False, repr=False, compare=False)


@dataclass
class SConvMetadata(Metadata):
    """For `mrv2::sconv` (short convolution with per-request state)."""

    query_start_loc: torch.Tensor  # [B+1] int32
    state_indices: torch.Tensor  # [B] int32: conv-state slot, -1 = padding row
    has_initial_state: torch.Tensor  # [B] bool: False => state reads as zeros
    num_reqs: int
    max_query_len: int
    for_capture: bool = False


@dataclass
class CompressorMetadata(Metadata):
    """For `mrv2::kv_compress` (DeepSeek-V4 style KV compressor).

    Request b's tokens this step sit at positions
    seq_lens[b] - (qsl[b+1] - qsl[b]) ... seq_lens[b] - 1; position p belongs to
    group p // ratio. A request starting at position 0 has no carried state.
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    state_indices: torch.Tensor  # [B] int32: compressor-state slot, -1 = padding
    block_table: torch.Tensor  # [B, max_compressed_blocks] int32 (compressed cache)
    num_reqs: int
    max_query_len: int
    for_capture: bool = False
