"""Metadata builders: one per op family, behind one protocol.

    builder.kind                    the `metadata_kind` of the layers it serves
    builder.capture_support         what graphs its metadata can be captured in
    builder.attention_like          its ops run inside captured graphs in every mode
    builder.persistent_tensors()    name -> tensor whose address a graph keeps
    builder.build(batch, *, for_capture) -> the op family's metadata dataclass

A runner constructs one builder per kind its model's layers use
(`builder_cls(kv_cache_config, input_buffers, block_tables)`; a user's kind:
`register_metadata_builder`). Every tensor a builder hands out is a view of
a persistent buffer; `for_capture` makes the Python ints an op bakes into a
graph worst cases for the padded size. Note [attention-like metadata is
always capturable]: docs/design.md, section "Metadata builders".
"""

from __future__ import annotations

import inspect
import operator
from typing import Protocol

import torch

from compile_backend.runner.attention_metadata import AttentionMetadata, CompressorMetadata, SConvMetadata
from compile_backend.runner.block_tables import BlockTables
from compile_backend.core.graph_mode import CaptureSupport, CUDAGraphMode, lower_graph_mode
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.input_buffers import InputBuffers
from compile_backend.runner.kv_cache_config import KVCacheConfig


class MetadataBuilder(Protocol):
    kind: str
    capture_support: CaptureSupport
    attention_like: bool

    def persistent_tensors(self) -> dict[str, torch.Tensor]: ...

    def build(self, batch: InputBatch, *, for_capture: bool): ...


class BaseMetadataBuilder:
    """Keeps what every builder reads: the cache layout, the step's persistent
    input buffers and the block tables (their tensors are the views to hand
    out). Subclasses set `kind` (and `capture_support`, `attention_like` where
    the defaults do not fit) and define `persistent_tensors` and `build`."""

    kind = ""
    capture_support = CaptureSupport.ALWAYS
    attention_like = False

    def __init__(self, cfg: KVCacheConfig, buffers: InputBuffers, tables: BlockTables) -> None:
        self.cfg, self.buffers, self.tables = cfg, buffers, tables


class AttentionMetadataBuilder(BaseMetadataBuilder):
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
            # A graph replays any batch of its StepGraph's sizes: bound, don't measure.
            # The single-token decode path only in uniform-decode graphs: a mixed
            # graph's dummy batch of T tokens over T requests looks like decode
            # but must serve prefills too (regression: tests/runtime/test_cuda_graph.py,
            # random schedules through the Triton kernels).
            graph = batch.graph
            max_query_len = 1 if graph is not None and graph.uniform_decode else T
            max_seq_len = self.cfg.max_model_len
        else:
            max_query_len = batch.max_query_len
            # The bound here too (an upper bound is all the op asks): decode's
            # split count then depends on the padded request count alone, so an
            # eager decode step (PIECEWISE, NONE) launches a kernel variant its
            # plan's capture compiled; the exact value made a new one whenever
            # a context crossed a split boundary (docs/design.md, "The
            # metadata contract"). A request's splits still follow its runtime
            # length (Note [one-launch decode]).
            max_seq_len = self.cfg.max_model_len
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


class AttentionLikeMetadataBuilder(BaseMetadataBuilder):
    """An attention-like op family's builder: per-request views of persistent
    tensors, the padded request count and max_query_len (see Note
    [attention-like metadata is always capturable]). Subclasses set `kind`,
    `metadata_cls` and `views`, metadata field -> the persistent tensor it
    views ("buffers.<name>" or "tables.<name>"; query_start_loc [B+1], the
    rest [B, ...]); the other fields of `metadata_cls` are num_reqs,
    max_query_len and for_capture."""

    attention_like = True
    metadata_cls: type
    views: dict[str, str]

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        return {name: operator.attrgetter(path)(self) for name, path in self.views.items()}

    def build(self, batch: InputBatch, *, for_capture: bool):
        B = batch.num_reqs_padded
        views = {name: t[: B + 1] if name == "query_start_loc" else t[:B]
                 for name, t in self.persistent_tensors().items()}
        graph = batch.graph
        if graph is not None and graph.uniform_decode:
            max_query_len = 1  # one token per request, by the graph's construction
        else:
            max_query_len = batch.num_tokens_padded
        return self.metadata_cls(**views, num_reqs=B, max_query_len=max_query_len,
                                 for_capture=for_capture)


class SConvMetadataBuilder(AttentionLikeMetadataBuilder):
    kind = "sconv"
    metadata_cls = SConvMetadata
    views = {"query_start_loc": "buffers.query_start_loc",
             "state_indices": "buffers.state_indices",
             "has_initial_state": "buffers.has_initial_state"}


class CompressorMetadataBuilder(AttentionLikeMetadataBuilder):
    kind = "compressor"
    metadata_cls = CompressorMetadata
    views = {"query_start_loc": "buffers.query_start_loc", "seq_lens": "buffers.seq_lens",
             "state_indices": "buffers.state_indices",
             "block_table": "tables.compressed_block_table"}


BUILDERS: dict[str, type] = {
    "attention": AttentionMetadataBuilder,
    "sconv": SConvMetadataBuilder,
    "compressor": CompressorMetadataBuilder,
}

_PROTOCOL = ("kind: str, capture_support: CaptureSupport, attention_like: bool, "
             "persistent_tensors(self) -> dict[str, Tensor], build(self, batch, *, for_capture)")


def register_metadata_builder(kind: str, builder_cls: type) -> type:
    """Make layers whose `metadata_kind` is `kind` buildable by ModelRunner:
    it constructs `builder_cls(kv_cache_config, input_buffers, block_tables)`
    and calls its `build` once per step and at every capture (README, "Your
    own attention-like ops"). Process-wide; registering the same class again
    does nothing. Returns `builder_cls`. Raises TypeError or ValueError,
    with the fix, for a class that does not follow the protocol."""
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"a metadata kind is a non-empty string, got {kind!r}")
    if not isinstance(builder_cls, type):
        raise TypeError(
            f"register_metadata_builder({kind!r}, ...) takes the builder class (the runner "
            f"constructs it), got {builder_cls!r}")
    name = f"{builder_cls.__module__}.{builder_cls.__qualname__}"
    missing = [m for m in ("persistent_tensors", "build")
               if not callable(getattr(builder_cls, m, None))]
    missing += [a for a in ("kind", "capture_support", "attention_like")
                if not hasattr(builder_cls, a)]
    if missing:
        raise TypeError(
            f"metadata builder {name} lacks {missing}; a builder has {_PROTOCOL} "
            "(subclass compile_backend.BaseMetadataBuilder for the constructor and defaults)")
    if builder_cls.kind != kind:
        raise ValueError(
            f"metadata builder {name} declares kind {builder_cls.kind!r} but is registered as "
            f"{kind!r}; set `kind = {kind!r}` on the class")
    if not isinstance(builder_cls.capture_support, CaptureSupport):
        raise TypeError(
            f"metadata builder {name}: capture_support must be a CaptureSupport member "
            f"({', '.join(c.name for c in CaptureSupport)}), got {builder_cls.capture_support!r}")
    if not isinstance(builder_cls.attention_like, bool):
        raise TypeError(
            f"metadata builder {name}: attention_like must be True or False, got "
            f"{builder_cls.attention_like!r}")
    try:
        inspect.signature(builder_cls).bind(None, None, None)
    except TypeError:
        raise TypeError(
            f"metadata builder {name} must be constructible as builder_cls(kv_cache_config, "
            f"input_buffers, block_tables); its signature is {inspect.signature(builder_cls)}"
        ) from None
    # The rule the runner applies to its builders (an attention-like builder
    # must always be capturable), checked now rather than at the first runner.
    lower_graph_mode(CUDAGraphMode.PIECEWISE, [builder_cls])
    known = BUILDERS.get(kind)
    if known is not None and known is not builder_cls:
        raise ValueError(
            f"metadata kind {kind!r} is already registered to "
            f"{known.__module__}.{known.__qualname__}; give {name} (and its layers' "
            "metadata_kind) another kind name")
    BUILDERS[kind] = builder_cls
    return builder_cls
