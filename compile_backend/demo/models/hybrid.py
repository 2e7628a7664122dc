"""A hybrid decoder: each layer runs paged attention (breakpoint), a short
convolution with per-request state (sconv) and a KV compressor, both
attention-like, side by side on the layer's input, then a SwiGLU MLP.

    r = norm(x); q, k, v = qkv(r)
    x = x + o(attn(q, k, v)) + conv_out(sconv(conv_in(r))) + comp_out(compress(k, score(r)))
    x = x + mlp(norm(x))

sconv and the compressor depend only on the layer input, so the segment pass
can keep them in the captured segment before the attention breakpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.layers import KVCompressor, ShortConv

from .blocks import Decoder, RMSNorm, SelfAttention, SwiGLU
from .config import ModelConfig


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        KVH, D = cfg.num_kv_heads, cfg.head_dim
        self.input_norm = RMSNorm(cfg.hidden_size)
        self.attention = SelfAttention(cfg, index)
        self.conv_in = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.conv = ShortConv(cfg.hidden_size, cfg.conv_kernel, layer_name=f"layers.{index}.conv")
        self.conv_out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.score = nn.Linear(cfg.hidden_size, KVH, bias=False)
        self.compress = KVCompressor(KVH, D, cfg.compress_ratio, layer_name=f"layers.{index}.compress")
        self.comp_out = nn.Linear(KVH * D, cfg.hidden_size, bias=False)
        self.post_norm = RMSNorm(cfg.hidden_size)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        r = self.input_norm(x)
        q, k, v = self.attention.project(r)  # k [T, KVH, D], before rotary
        conv = self.conv_out(self.conv(self.conv_in(r)))
        comp = self.comp_out(self.compress(k, self.score(r)).reshape(T, -1))
        x = x + self.attention.attend(q, k, v, positions) + conv + comp
        return x + self.mlp(self.post_norm(x))


class HybridDecoder(Decoder):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, [HybridLayer(cfg, i) for i in range(cfg.num_layers)])
