"""What an engine owns around a model: its attention groups and the one
place metadata is built, for serving and for capture alike."""

from __future__ import annotations

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
    """Group the model's layers by `metadata_kind` (kernels/layers.py)."""
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
        groups.append(AttentionGroup(BUILDERS[kind](cfg, buffers, tables), names))
        cfg.groups.append(KVCacheGroup(name=kind, kind=kind, layer_names=names))
    return groups


class ModelState:
    """The persistent step state a model's graphs read (cache layout, input
    buffers, block tables, attention groups) and the one place its metadata
    is built. Engines keep one per model (a draft model has its own)."""

    # Serving builds logged before the log stops growing (a server runs
    # millions of steps); capture builds are always logged, and
    # counters["metadata_builds"] counts every build.
    MAX_LOGGED_SERVING_BUILDS = 1024

    def __init__(self, kv_cache_config: KVCacheConfig, input_buffers: InputBuffers,
                 block_tables: BlockTables, attn_groups: list[AttentionGroup]) -> None:
        self.kv_cache_config = kv_cache_config
        self.input_buffers = input_buffers
        self.block_tables = block_tables
        self.attn_groups = attn_groups
        self.build_log: list[dict[str, Any]] = []  # for the debug dump and tests
        self.serving_builds_logged = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, kv_cache_config: KVCacheConfig,
                  device: torch.device) -> "ModelState":
        """Allocate the buffers and tables of `kv_cache_config` on `device` and
        group `model`'s layers by metadata kind."""
        buffers = InputBuffers.allocate(kv_cache_config, device)
        tables = BlockTables(kv_cache_config, device)
        return cls(kv_cache_config, buffers, tables,
                   attention_groups_for(model, kv_cache_config, buffers, tables))

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
        out: dict[str, Any] = {}
        for group in self.attn_groups:
            meta = group.builder.build(batch, for_capture=graph.for_capture)
            for name in group.layer_names:
                out[name] = meta
            counters["metadata_builds"] += 1
            if not batch.is_dummy:
                if self.serving_builds_logged >= self.MAX_LOGGED_SERVING_BUILDS:
                    continue
                self.serving_builds_logged += 1
            self.build_log.append({
                "kind": group.builder.kind, "for_capture": graph.for_capture,
                "mode": graph.mode.value, "uniform_decode": graph.uniform_decode,
                "dummy": batch.is_dummy, "num_tokens": graph.num_tokens,
                "num_reqs": graph.num_reqs,
            })
        return out
