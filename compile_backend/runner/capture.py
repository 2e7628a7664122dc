"""Capture-time input preparation: the dummy batch a graph is captured with,
written where the graphs read, and its metadata."""

from __future__ import annotations

from typing import Any

import torch

from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_state import ModelState


def prepare_inputs_to_capture(
    num_reqs: int,
    num_tokens: int,
    model_state: ModelState,
    full_cudagraph: bool,
    uniform_decode: bool | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Write a dummy batch into `model_state`'s persistent buffers and build
    its metadata; returns (layer name -> metadata, the slot-mapping view [T]).

    Note [why PIECEWISE still builds metadata]: attention-like ops (sconv, the
    KV compressor) are not breakpoints, so they run *inside* piecewise graphs
    and execute during capture: they need their metadata then. So metadata is
    built at every capture. `for_capture=full_cudagraph`: a FULL graph captures
    the attention kernels too, whose metadata must hold worst-case bounds; in
    PIECEWISE, attention runs eagerly between graphs and gets exact metadata
    (some backends cannot build capturable metadata for prefill at all), while
    attention-like builders are capturable whatever the flag (see
    Note [attention-like metadata is always capturable]).

    `uniform_decode`: whether the FULL graph being captured serves uniform
    decode batches only (the batch descriptor's flag); None infers it from
    num_tokens == num_reqs, which a mixed FULL graph of few tokens shares:
    the runner always says which.
    """
    if uniform_decode is None:
        uniform_decode = full_cudagraph and num_tokens == num_reqs
    mode = CUDAGraphMode.FULL if full_cudagraph else CUDAGraphMode.PIECEWISE
    step = StepGraph(mode, num_tokens, num_reqs, uniform_decode)
    cfg = model_state.kv_cache_config
    batch = InputBatch.make_dummy(num_reqs, num_tokens, cfg.max_model_len, cfg.block_size)
    batch.pad_to(step)
    model_state.write(batch)
    return model_state.prepare_attn(batch), model_state.block_tables.slot_mapping[:num_tokens]
