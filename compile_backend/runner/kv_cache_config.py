"""How the KV cache and the per-request state are laid out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class KVCacheGroup:
    """Layers that share one block table (and so one metadata build)."""

    name: str  # "attention", "compressed", "sconv", ...
    kind: str  # metadata kind: "attention" | "compressor" | "sconv" | a registered one
    layer_names: list[str] = field(default_factory=list)
    # The InputBatch fields whose rows its metadata reads ("block_ids" for the
    # block table or slot mapping, "compressed_block_ids"): a batch must give
    # every request a row of each (InputBatch.check_against).
    block_fields: tuple[str, ...] = ()


@dataclass
class KVCacheConfig:
    num_blocks: int  # block 0 is the null block: never given to a request
    block_size: int = 16
    max_model_len: int = 2048
    max_num_reqs: int = 256
    max_num_tokens: int = 8192
    compress_ratio: int = 4  # KV-compressor group size (tokens per compressed entry)
    groups: list[KVCacheGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1) or self.block_size <= 0:
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        for name in ("max_model_len", "max_num_reqs", "max_num_tokens", "compress_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def num_compressed_blocks(self) -> int:
        """Blocks of the KV compressor's paged cache: it is bound with as many
        blocks as the KV cache (models' `bind_caches`), block 0 the null block."""
        return self.num_blocks

    @property
    def max_batch_tokens(self) -> int:
        """The most tokens one batch can hold: max_num_tokens, and no more than
        max_num_reqs requests of max_model_len tokens each."""
        return min(self.max_num_tokens, self.max_num_reqs * self.max_model_len)

    @property
    def max_blocks_per_req(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def max_compressed_blocks_per_req(self) -> int:
        return math.ceil(math.ceil(self.max_model_len / self.compress_ratio) / self.block_size)

    def group(self, kind: str) -> KVCacheGroup | None:
        return next((g for g in self.groups if g.kind == kind), None)

    def groups_reading(self, block_field: str) -> list[KVCacheGroup]:
        """The groups whose metadata reads `block_field`'s rows ("block_ids",
        "compressed_block_ids"); none: the model has no such cache."""
        return [g for g in self.groups if block_field in g.block_fields]
