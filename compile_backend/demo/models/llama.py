"""A Llama-like decoder: RMSNorm, rotary positions, GQA paged attention, SwiGLU.

Tensor parallel (`tp_size`, default: the process group's size): attention
and MLP are split across ranks (blocks.py); each layer all-reduces the
attention's and the MLP's partial outputs, two collectives per layer."""

from __future__ import annotations

import torch
from torch import nn

from compile_backend.core.parallel import TensorParallel

from .blocks import Decoder, RMSNorm, SelfAttention, SwiGLU, tensor_parallel
from .config import ModelConfig


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.tp = tp
        self.input_norm = RMSNorm(cfg.hidden_size)
        self.attention = SelfAttention(cfg, index, tp)
        self.post_norm = RMSNorm(cfg.hidden_size)
        self.mlp = SwiGLU(cfg, tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # all_reduce: the sum of the ranks' partial outputs (identity on one rank)
        x = x + self.tp.all_reduce(self.attention(self.input_norm(x), positions))
        return x + self.tp.all_reduce(self.mlp(self.post_norm(x)))


class LlamaDecoder(Decoder):
    def __init__(self, cfg: ModelConfig, tp_size: int | None = None) -> None:
        tp = tensor_parallel(cfg, tp_size)
        super().__init__(cfg, [LlamaLayer(cfg, i, tp) for i in range(cfg.num_layers)], tp)
