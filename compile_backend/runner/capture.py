"""Capture-time input preparation: the dummy batch a graph is captured with,
written where the graphs read, and its metadata (docs/design.md, "The
metadata contract")."""

from __future__ import annotations

from typing import Any

from compile_backend.core.graph_mode import StepGraph
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_state import ModelState


def prepare_inputs_to_capture(graph: StepGraph, model_state: ModelState) -> dict[str, Any]:
    """Write a dummy batch of `graph`'s padded sizes into `model_state`'s
    persistent buffers and build its metadata for `graph`; returns layer
    name -> metadata.

    Note [why PIECEWISE still builds metadata]: attention-like ops (sconv, the
    KV compressor) are not breakpoints, so they run *inside* piecewise graphs
    and execute during capture: they need their metadata then. So metadata is
    built at every capture, with `for_capture=graph.for_capture` (exactly when
    the graph is FULL): a FULL graph captures the attention kernels too, whose
    metadata must hold worst-case bounds; in PIECEWISE, attention runs eagerly
    between graphs and gets exact metadata, but for max_seq_len's bound
    (metadata_builders.py says why) (some backends cannot build
    capturable metadata for prefill at all), while attention-like builders
    are capturable whatever the flag (see Note [attention-like metadata is
    always capturable]). `graph.uniform_decode` says whether a FULL graph
    serves decode batches only: a dummy batch of T tokens over T requests
    looks like decode either way.
    """
    cfg = model_state.kv_cache_config
    batch = InputBatch.make_dummy(graph.num_reqs, graph.num_tokens, cfg.max_model_len,
                                  cfg.block_size)
    batch.pad_to(graph)
    model_state.write(batch)
    return model_state.prepare_attn(batch)
