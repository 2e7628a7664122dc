"""A Llama-like decoder: RMSNorm, rotary positions, GQA paged attention, SwiGLU."""

from __future__ import annotations

import torch
from torch import nn

from kernels.layers import PagedAttention

from .blocks import Decoder, RMSNorm, Rotary, SwiGLU
from .config import ModelConfig


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.H, self.KVH, self.D = H, KVH, D
        self.input_norm = RMSNorm(cfg.hidden_size)
        # Separate projections: slices of one fused output are not contiguous,
        # and a contiguity check on them would specialise the token count to != 1.
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, KVH * D, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, KVH * D, bias=False)
        self.rotary = Rotary(D, cfg.rope_theta)
        self.attn = PagedAttention(H, KVH, D, layer_name=f"layers.{index}.attn")
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=False)
        self.post_norm = RMSNorm(cfg.hidden_size)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        r = self.input_norm(x)
        q, k, v = self.q_proj(r), self.k_proj(r), self.v_proj(r)
        q = self.rotary(q.view(T, self.H, self.D), positions)
        k = self.rotary(k.view(T, self.KVH, self.D), positions)
        x = x + self.o_proj(self.attn(q, k, v))
        return x + self.mlp(self.post_norm(x))


class LlamaDecoder(Decoder):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, [LlamaLayer(cfg, i) for i in range(cfg.num_layers)])
        self.init_weights()
        self.to(cfg.dtype)
