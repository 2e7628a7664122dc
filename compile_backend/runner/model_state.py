"""What an engine owns around a model: its attention groups and the one
place metadata is built, for serving and for capture alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from compile_backend.runner.block_tables import BlockTables
from compile_backend.core.config import CUDAGraphMode
from compile_backend.core.counters import counters
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.kv_cache_config import KVCacheConfig, KVCacheGroup
from compile_backend.runner.metadata_builders import BUILDERS, MetadataBuilder


@dataclass
class AttentionGroup:
    """A metadata builder and the layers it serves (they share one build)."""

    builder: MetadataBuilder
    layer_names: list[str] = field(default_factory=list)


def attention_groups_for(
    model: torch.nn.Module, cfg: KVCacheConfig, buffers, tables: BlockTables
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
    # Serving builds logged before the log stops growing (a server runs
    # millions of steps); capture builds are always logged, and
    # counters["metadata_builds"] counts every build.
    MAX_LOGGED_SERVING_BUILDS = 1024

    def __init__(self, attn_groups: list[AttentionGroup]) -> None:
        self.attn_groups = attn_groups
        self.build_log: list[dict[str, Any]] = []  # for the debug dump and tests
        self.serving_builds_logged = 0

    def prepare_attn(
        self,
        input_batch: InputBatch,
        cudagraph_mode: CUDAGraphMode,
        block_tables: BlockTables,
        slot_mappings: torch.Tensor,
        attn_groups: list[AttentionGroup],
        kv_cache_config: KVCacheConfig,
        *,
        for_capture: bool,
    ) -> dict[str, Any]:
        """layer name -> metadata, every group built once. The inputs must
        already be in the persistent buffers (InputBuffers.write,
        BlockTables.write): builders hand out views of them."""
        assert slot_mappings.data_ptr() == block_tables.slot_mapping.data_ptr(), (
            "slot mappings must be the persistent buffer's view")
        out: dict[str, Any] = {}
        for group in attn_groups:
            meta = group.builder.build(input_batch, for_capture=for_capture)
            for name in group.layer_names:
                out[name] = meta
            counters["metadata_builds"] += 1
            if not input_batch.is_dummy:
                if self.serving_builds_logged >= self.MAX_LOGGED_SERVING_BUILDS:
                    continue
                self.serving_builds_logged += 1
            self.build_log.append({
                "kind": group.builder.kind, "for_capture": for_capture,
                "mode": cudagraph_mode.value, "dummy": input_batch.is_dummy,
                "num_tokens": input_batch.num_tokens_padded,
                "num_reqs": input_batch.num_reqs_padded,
            })
        return out
