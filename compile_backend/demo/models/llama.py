"""A Llama-like decoder: RMSNorm, rotary positions, GQA paged attention, SwiGLU."""

from __future__ import annotations

import torch
from torch import nn

from .blocks import Decoder, RMSNorm, SelfAttention, SwiGLU
from .config import ModelConfig


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size)
        self.attention = SelfAttention(cfg, index)
        self.post_norm = RMSNorm(cfg.hidden_size)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x), positions)
        return x + self.mlp(self.post_norm(x))


class LlamaDecoder(Decoder):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, [LlamaLayer(cfg, i) for i in range(cfg.num_layers)])
