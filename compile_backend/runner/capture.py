"""Capture-time input preparation: the dummy batch a graph is captured with,
written where the graphs read, and its metadata (docs/design.md, "The
metadata contract"); and the prefill shapes a cold plan runs dry, whose
kernels no capture meets."""

from __future__ import annotations

from typing import Any

from compile_backend.core.graph_mode import StepGraph
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.runner.model_state import ModelState

# (requests, tokens) of the prefills a cold plan runs dry: one request and
# several, a token count 16 divides and one it does not. The prefill form of
# the request-tile kernels (attention, sconv, the KV compressor) takes both
# counts unspecialised (Note [batch ints unspecialised] in kernels/_device.py)
# and needs one shape; the others cover the classes Triton makes of an int
# (equal to 1, a multiple of 16, neither) in any kernel of the step that
# still specialises one.
PREFILL_DRY_SHAPES = ((1, 17), (1, 32), (3, 17), (3, 48))


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


def dry_prefill_graphs(kv: KVCacheConfig) -> list[StepGraph]:
    """Eager steps of PREFILL_DRY_SHAPES that these caches can hold. A plan's
    dummy batches look like decode (one token a request), so a PIECEWISE
    plan's eager attention never meets the prefill kernels, and a cold
    start's first prefill compiled them in line."""
    return [StepGraph.eager(tokens, reqs) for reqs, tokens in PREFILL_DRY_SHAPES
            if reqs <= kv.max_num_reqs and tokens <= kv.max_batch_tokens
            and -(-tokens // reqs) <= kv.max_model_len]
