"""Model sizes. `tiny` runs on 2 CPU cores in seconds (`deep` is tiny at
llama8b's 32 layers, for host costs per layer); `bench` is the
benchmark size (8 layers, hidden 2048, 32 heads, 4 KV heads); `llama8b` has
Llama-3-8B's shape (32 layers, hidden 4096, 32 heads / 8 KV heads,
intermediate 14336, vocab 128256: about 16 GB of bf16 weights; build it under
`with torch.device("cuda"):` so its random weights are drawn there)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    conv_kernel: int = 4  # short-convolution width
    compress_ratio: int = 4  # KV-compressor group size
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


PRESETS = {
    "tiny": ModelConfig(),
    # tiny's widths at llama8b's depth: a layer's host costs (ops, pieces,
    # guards, loads) as many times as llama8b pays them, on the CPU machine
    "deep": ModelConfig(num_layers=32),
    "small": ModelConfig(vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8,
                         num_kv_heads=2, intermediate_size=1408),
    "bench": ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=8, num_heads=32,
                         num_kv_heads=4, intermediate_size=5632),
    "llama8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                           num_kv_heads=8, intermediate_size=14336, rope_theta=500000.0),
}


def preset(name: str, **changes) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**changes)
