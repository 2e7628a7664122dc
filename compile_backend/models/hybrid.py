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

from kernels.layers import KVCompressor, PagedAttention, ShortConv

from .blocks import Decoder, RMSNorm, Rotary, SwiGLU
from .config import ModelConfig


class HybridLayer(nn.Module):
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
        q, k, v = self.q_proj(r), self.k_proj(r), self.v_proj(r)
        k = k.view(T, self.KVH, self.D)
        conv = self.conv_out(self.conv(self.conv_in(r)))
        comp = self.comp_out(self.compress(k, self.score(r)).reshape(T, self.KVH * self.D))
        q = self.rotary(q.view(T, self.H, self.D), positions)
        attn = self.o_proj(self.attn(q, self.rotary(k, positions), v))
        x = x + attn + conv + comp
        return x + self.mlp(self.post_norm(x))


class HybridDecoder(Decoder):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, [HybridLayer(cfg, i) for i in range(cfg.num_layers)])
        self.init_weights()
        self.to(cfg.dtype)
