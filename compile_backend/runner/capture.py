"""Capture-time input preparation and graph-mode lowering."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from compile_backend.runner.block_tables import BlockTables
from compile_backend.core.config import CUDAGraphMode
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.input_buffers import InputBuffers
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.runner.metadata_builders import CaptureSupport
from compile_backend.runner.model_state import AttentionGroup, ModelState

logger = logging.getLogger(__name__)


def prepare_inputs_to_capture(
    num_reqs: int,
    num_tokens: int,
    model_state: ModelState,
    input_buffers: InputBuffers,
    block_tables: BlockTables,
    attn_groups: list[AttentionGroup],
    kv_cache_config: KVCacheConfig,
    full_cudagraph: bool,
    uniform_decode: bool | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Write a dummy batch into the persistent buffers and build its metadata.

    Note [why PIECEWISE still builds metadata]: attention-like ops (sconv, the
    KV compressor) are not breakpoints, so they run *inside* piecewise graphs
    and execute during capture: they need their metadata then. So metadata is
    built at every capture. `for_capture=full_cudagraph`: a FULL graph captures
    the attention kernels too, whose metadata must hold worst-case bounds; in
    PIECEWISE, attention runs eagerly between graphs and gets exact metadata
    (some backends cannot build capturable metadata for prefill at all), while
    attention-like builders are capturable whatever the flag (see
    Note [attention-like metadata is always capturable]).

    `uniform_decode`: whether the graph being captured serves uniform decode
    batches only (the batch descriptor's flag); None infers it from
    num_tokens == num_reqs, which a mixed FULL graph of few tokens shares.
    """
    batch = InputBatch.make_dummy(
        num_reqs, num_tokens, kv_cache_config.max_model_len, kv_cache_config.block_size
    )
    batch.uniform_decode_graph = uniform_decode
    input_buffers.write(batch)
    slot_mappings = block_tables.write(batch)
    attn_metadata = model_state.prepare_attn(
        batch,
        CUDAGraphMode.FULL if full_cudagraph else CUDAGraphMode.PIECEWISE,
        block_tables,
        slot_mappings,
        attn_groups,
        kv_cache_config,
        for_capture=full_cudagraph,
    )
    return attn_metadata, slot_mappings


def lower_graph_mode(
    requested: CUDAGraphMode, builders: Sequence[Any]
) -> tuple[CUDAGraphMode, str | None]:
    """The most the builders allow of `requested`, and why it was lowered."""
    for b in builders:
        if b.attention_like and b.capture_support is not CaptureSupport.ALWAYS:
            raise ValueError(
                f"the {b.kind!r} metadata builder serves attention-like ops, which run "
                f"inside captured graphs in every mode, but declares capture support "
                f"{b.capture_support.name}; it must build capturable metadata always "
                "(CaptureSupport.ALWAYS) or its op must be registered as a breakpoint"
            )
    attention = [b for b in builders if not b.attention_like]
    if not attention or not requested.has_full:
        return requested, None
    weakest = min(attention, key=lambda b: b.capture_support)
    support = weakest.capture_support
    lowered = requested
    if support is CaptureSupport.NEVER:
        lowered = CUDAGraphMode.NONE if requested is CUDAGraphMode.FULL_DECODE_ONLY else CUDAGraphMode.PIECEWISE
    elif support < CaptureSupport.ALWAYS and requested is CUDAGraphMode.FULL:
        lowered = CUDAGraphMode.FULL_AND_PIECEWISE
    if lowered is requested:
        return requested, None
    reason = (
        f"graph mode lowered from {requested.value} to {lowered.value}: the "
        f"{weakest.kind!r} metadata builder supports capture {support.name}"
    )
    logger.warning("%s", reason)
    return lowered, reason
