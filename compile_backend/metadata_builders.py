"""Metadata builders: one per op family, behind one protocol.

    builder.capture_support         what graphs its metadata can be captured in
    builder.persistent_tensors()    name -> tensor whose address a graph keeps
    builder.build(batch, *, for_capture) -> the op family's metadata dataclass

Every tensor a builder hands out is a view of a persistent buffer (InputBuffers,
BlockTables), so its address is the same at capture and at every replay of the
same padded size. What `for_capture` changes is the Python ints an op bakes
into a graph (grid sizes): with it, they are worst cases for the padded size
(max_seq_len = max_model_len); without it, exact values for eager execution.

Note [attention-like metadata is always capturable]: sconv and the compressor
run inside captured segments in every mode, PIECEWISE included, where
`for_capture` is False. Their builders ignore the flag: request count and
max_query_len are always the padded batch's (the same at capture and at any
replay of that size), and their tensors are persistent views. One exception,
as safe: in a uniform-decode graph (`batch.uniform_decode_graph` is True, set
only for FULL graphs that replay one-token-per-request batches alone)
max_query_len is 1. The padded T there would size the kernels' grids by T
tokens per request: at 256 requests, 65 compressor groups per request instead
of 1 (66560 programs for 1024 with work).
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from .attention_metadata import AttentionMetadata, CompressorMetadata, SConvMetadata
from .block_tables import BlockTables
from .input_batch import InputBatch
from .input_buffers import InputBuffers
from .kv_cache_config import KVCacheConfig


class CaptureSupport(enum.IntEnum):
    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


class MetadataBuilder(Protocol):
    kind: str
    capture_support: CaptureSupport
    attention_like: bool

    def persistent_tensors(self) -> dict[str, torch.Tensor]: ...

    def build(self, batch: InputBatch, *, for_capture: bool): ...


class _Builder:
    kind = ""
    capture_support = CaptureSupport.ALWAYS
    attention_like = False

    def __init__(self, cfg: KVCacheConfig, buffers: InputBuffers, tables: BlockTables) -> None:
        self.cfg, self.buffers, self.tables = cfg, buffers, tables


class AttentionMetadataBuilder(_Builder):
    kind = "attention"

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        return {
            "query_start_loc": self.buffers.query_start_loc,
            "seq_lens": self.buffers.seq_lens,
            "block_table": self.tables.block_table,
            "slot_mapping": self.tables.slot_mapping,
        }

    def build(self, batch: InputBatch, *, for_capture: bool) -> AttentionMetadata:
        B, T = batch.num_reqs_padded, batch.num_tokens_padded
        if for_capture:
            # A graph replays any batch of its descriptor: bound, don't measure.
            # The single-token decode path only in uniform-decode graphs: a mixed
            # graph's dummy batch of T tokens over T requests looks like decode
            # but must serve prefills too (regression: tests/test_runtime.py,
            # random schedules through the Triton kernels).
            uniform = batch.uniform_decode_graph
            if uniform is None:
                uniform = batch.uniform_decode and B == T
            max_query_len = 1 if uniform else T
            max_seq_len = self.cfg.max_model_len
        else:
            max_query_len = batch.max_query_len
            max_seq_len = max(batch.seq_lens, default=0)
        return AttentionMetadata(
            query_start_loc=self.buffers.query_start_loc[: B + 1],
            seq_lens=self.buffers.seq_lens[:B],
            block_table=self.tables.block_table[:B],
            slot_mapping=self.tables.slot_mapping[:T],
            num_reqs=B,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            for_capture=for_capture,
        )


class SConvMetadataBuilder(_Builder):
    kind = "sconv"
    attention_like = True

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        return {
            "query_start_loc": self.buffers.query_start_loc,
            "state_indices": self.buffers.state_indices,
            "has_initial_state": self.buffers.has_initial_state,
        }

    def build(self, batch: InputBatch, *, for_capture: bool) -> SConvMetadata:
        # See Note [attention-like metadata is always capturable].
        B = batch.num_reqs_padded
        return SConvMetadata(
            query_start_loc=self.buffers.query_start_loc[: B + 1],
            state_indices=self.buffers.state_indices[:B],
            has_initial_state=self.buffers.has_initial_state[:B],
            num_reqs=B,
            max_query_len=_attention_like_max_query_len(batch),
            for_capture=for_capture,
        )


def _attention_like_max_query_len(batch: InputBatch) -> int:
    """See Note [attention-like metadata is always capturable]."""
    if batch.uniform_decode_graph is True:
        assert batch.uniform_decode or batch.num_reqs == 0, batch.query_lens
        return 1
    return batch.num_tokens_padded


class CompressorMetadataBuilder(_Builder):
    kind = "compressor"
    attention_like = True

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        return {
            "query_start_loc": self.buffers.query_start_loc,
            "seq_lens": self.buffers.seq_lens,
            "state_indices": self.buffers.state_indices,
            "block_table": self.tables.compressed_block_table,
        }

    def build(self, batch: InputBatch, *, for_capture: bool) -> CompressorMetadata:
        # See Note [attention-like metadata is always capturable].
        B = batch.num_reqs_padded
        return CompressorMetadata(
            query_start_loc=self.buffers.query_start_loc[: B + 1],
            seq_lens=self.buffers.seq_lens[:B],
            state_indices=self.buffers.state_indices[:B],
            block_table=self.tables.compressed_block_table[:B],
            num_reqs=B,
            max_query_len=_attention_like_max_query_len(batch),
            for_capture=for_capture,
        )


BUILDERS = {
    "attention": AttentionMetadataBuilder,
    "sconv": SConvMetadataBuilder,
    "compressor": CompressorMetadataBuilder,
}
