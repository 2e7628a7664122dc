"""What an engine owns around a model: its attention groups and the one
place metadata is built, for serving and for capture alike."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from compile_backend.runner.block_tables import BlockTables
from compile_backend.core.counters import counters
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.input_buffers import InputBuffers
from compile_backend.runner.kv_cache_config import KVCacheConfig, KVCacheGroup
from compile_backend.runner.metadata_builders import BUILDERS, MetadataBuilder


@dataclass
class AttentionGroup:
    """A metadata builder and the layers it serves (they share one build)."""

    builder: MetadataBuilder
    layer_names: list[str] = field(default_factory=list)


def attention_groups_for(
    model: torch.nn.Module, cfg: KVCacheConfig, buffers: InputBuffers, tables: BlockTables
) -> list[AttentionGroup]:
    """Group the model's layers by `metadata_kind` (compile_backend/kernels/layers.py)."""
    by_kind: dict[str, list[str]] = {}
    for module in model.modules():
        kind = getattr(module, "metadata_kind", None)
        if kind is not None:
            by_kind.setdefault(kind, []).append(module.layer_name)
    groups = []
    for kind, names in by_kind.items():
        if kind not in BUILDERS:
            raise ValueError(
                f"layer kind {kind!r} (layers {names}) has no metadata builder; known: "
                f"{sorted(BUILDERS)}. Register one before building the runner: "
                f"compile_backend.register_metadata_builder({kind!r}, YourBuilder) (README, "
                "\"Your own attention-like ops\")")
        builder = BUILDERS[kind](cfg, buffers, tables)
        groups.append(AttentionGroup(builder, names))
        cfg.groups.append(KVCacheGroup(name=kind, kind=kind, layer_names=names,
                                       block_fields=_block_fields(builder, tables)))
    return groups


def _block_fields(builder: MetadataBuilder, tables: BlockTables) -> tuple[str, ...]:
    """The batch fields whose rows `builder`'s metadata reads: a view of the
    block table or slot mapping (built from block_ids), or of the compressed
    block table. Tensors are matched by address, so a builder that hands out
    a slice of a table counts as reading it."""
    ptrs = {t.data_ptr() for t in builder.persistent_tensors().values()}
    reads = {"block_ids": (tables.block_table, tables.slot_mapping),
             "compressed_block_ids": (tables.compressed_block_table,)}
    return tuple(f for f, ts in reads.items() if any(t.data_ptr() in ptrs for t in ts))


_MISSING = object()


def vocab_size_of(model: torch.nn.Module) -> tuple[int | None, str]:
    """(the number of token ids `model` embeds, where it was read): token ids
    are checked against it on the host, since past it an id indexes past the
    input embedding (IndexError with eager pieces; with Inductor's, a device
    assert that aborts the process). Read, in order, from `model.vocab_size`
    (None declares input ids that are not token ids: they are not checked),
    `model.get_input_embeddings().num_embeddings` (Hugging Face's convention,
    which the demo models follow) and `model.config.vocab_size`. A model
    with none of them is refused: a runner that cannot check its token ids
    is a crash waiting for the first bad one."""
    declared = getattr(model, "vocab_size", _MISSING)
    if declared is not _MISSING:
        return (None if declared is None else _positive(declared, "model.vocab_size", True),
                "model.vocab_size")
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            rows = getattr(get(), "num_embeddings", None)
        except NotImplementedError:  # transformers' default on a model without one
            rows = None
        if rows is not None:
            where = "model.get_input_embeddings()"
            return _positive(rows, f"{where}.num_embeddings", False), where
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is not None:
        return _positive(size, "model.config.vocab_size", False), "model.config.vocab_size"
    raise ValueError(
        f"cannot tell the vocabulary size of {type(model).__name__} (no vocab_size attribute, "
        "no get_input_embeddings(), no config.vocab_size), so token ids could not be checked "
        "before they index its embedding. Declare it before building the runner: "
        "model.vocab_size = N (the number of token ids it embeds), or model.vocab_size = None "
        "for a model whose input_ids are not token ids (they are then not checked)")


def _positive(value: Any, where: str, none_allowed: bool) -> int:
    try:
        size = operator.index(value)
    except TypeError:
        size = 0
    if isinstance(value, bool) or size < 1:
        raise ValueError(f"{where} must be a positive int{' or None' if none_allowed else ''}, "
                         f"got {value!r}")
    return size


class ModelState:
    """The persistent step state a model's graphs read (cache layout, input
    buffers, block tables, attention groups) and the one place its metadata
    is built. Engines keep one per model (a draft model has its own)."""

    # Serving builds logged before the log stops growing (a server runs
    # millions of steps); capture builds are always logged, and
    # counters["metadata_builds"] counts every build.
    MAX_LOGGED_SERVING_BUILDS = 1024

    def __init__(self, kv_cache_config: KVCacheConfig, input_buffers: InputBuffers,
                 block_tables: BlockTables, attn_groups: list[AttentionGroup],
                 vocab_size: int | None = None, vocab_source: str = "") -> None:
        self.kv_cache_config = kv_cache_config
        self.input_buffers = input_buffers
        self.block_tables = block_tables
        self.attn_groups = attn_groups
        # Token ids must be below it (None: not checked); vocab_size_of says where from.
        self.vocab_size, self.vocab_source = vocab_size, vocab_source
        self.build_log: list[dict[str, Any]] = []  # for the debug dump and tests
        self.serving_builds_logged = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, kv_cache_config: KVCacheConfig,
                  device: torch.device) -> "ModelState":
        """Allocate the buffers and tables of `kv_cache_config` on `device`,
        group `model`'s layers by metadata kind and read its vocabulary size
        (vocab_size_of: raises ValueError, with the fix, where there is none)."""
        vocab = vocab_size_of(model)  # before allocating: a refused model costs nothing
        buffers = InputBuffers.allocate(kv_cache_config, device)
        tables = BlockTables(kv_cache_config, device)
        return cls(kv_cache_config, buffers, tables,
                   attention_groups_for(model, kv_cache_config, buffers, tables), *vocab)

    def check(self, batch: InputBatch) -> None:
        """Raise ValueError for a batch this model's buffers, tables or
        vocabulary cannot take, before anything is written
        (InputBatch.check_against; BlockTables.write checks block ids)."""
        batch.check_against(self.kv_cache_config, vocab_size=self.vocab_size,
                            vocab_source=self.vocab_source)

    def write(self, batch: InputBatch) -> None:
        """Write a padded batch (`batch.graph` set) into the persistent buffers.
        Block tables first: their write checks every changed row's block ids
        before it writes anything, so a bad id leaves every buffer as it was."""
        assert batch.graph is not None, "pad the batch to its graph first (InputBatch.pad_to)"
        self.block_tables.write(batch)
        self.input_buffers.write(batch)

    def prepare_attn(self, batch: InputBatch) -> dict[str, Any]:
        """layer name -> metadata, every group built once, for the graph the
        batch is padded to (`for_capture` when that is FULL). The batch must
        already be in the persistent buffers (`write`): builders hand out
        views of them."""
        graph = batch.graph
        assert graph is not None, "pad the batch to its graph first (InputBatch.pad_to)"
        for_capture = graph.for_capture  # the contract's flag: derived here alone
        out: dict[str, Any] = {}
        for group in self.attn_groups:
            meta = group.builder.build(batch, for_capture=for_capture)
            for name in group.layer_names:
                out[name] = meta
            counters["metadata_builds"] += 1
            if not batch.is_dummy:
                if self.serving_builds_logged >= self.MAX_LOGGED_SERVING_BUILDS:
                    continue
                self.serving_builds_logged += 1
            self.build_log.append({
                "kind": group.builder.kind, "for_capture": for_capture,
                "mode": graph.mode.value, "uniform_decode": graph.uniform_decode,
                "dummy": batch.is_dummy, "num_tokens": graph.num_tokens,
                "num_reqs": graph.num_reqs,
            })
        return out
