"""A hybrid decoder: each layer runs paged attention (breakpoint), a short
convolution with per-request state (sconv) and a KV compressor, both
attention-like, side by side on the layer's input, then a SwiGLU MLP.

    r = norm(x); q, k, v = qkv(r)
    x = x + o(attn(q, k, v)) + conv_out(sconv(conv_in(r))) + comp_out(compress(k, score(r)))
    x = x + mlp(norm(x))

sconv and the compressor depend only on the layer input, so the segment pass
can keep them in the captured segment before the attention breakpoint. Tensor
parallel (`tp_size`, default: the process group's size; README.md, "Tensor
parallelism"): the conv's channels and the compressor's KV heads (one score
per KV head) are split, and the three partial sums share one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from compile_backend.kernels.layers import KVCompressor, ShortConv

from compile_backend.core.parallel import TensorParallel

from .blocks import Decoder, RMSNorm, SelfAttention, SwiGLU, tensor_parallel
from .config import ModelConfig
from .sharding import column_linear, row_linear, shard_rows


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        C, KVH, D = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
        self.tp = tp
        self.input_norm = RMSNorm(C)
        self.attention = SelfAttention(cfg, index, tp)
        self.conv_in = column_linear(C, C, tp)  # [T, C/N]: this rank's channels
        self.conv = shard_rows(  # weight [C/N, K], bias [C/N], state [slots, C/N, K-1]
            ShortConv(tp.shard(C), cfg.conv_kernel, layer_name=f"layers.{index}.conv"),
            tp, "weight", "bias")
        self.conv_out = row_linear(C, C, tp)
        self.score = column_linear(C, KVH, tp)  # [T, KVH/N]
        self.compress = KVCompressor(tp.shard(KVH), D, cfg.compress_ratio,
                                     layer_name=f"layers.{index}.compress")
        self.comp_out = row_linear(KVH * D, C, tp)
        self.post_norm = RMSNorm(C)
        self.mlp = SwiGLU(cfg, tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        r = self.input_norm(x)
        q, k, v = self.attention.project(r)  # k [T, KVH, D], before rotary
        conv = self.conv_out(self.conv(self.conv_in(r)))
        comp = self.comp_out(self.compress(k, self.score(r)).reshape(T, -1))
        if self.tp.size == 1:  # TP=1 sums in its own order: no collective, same numbers
            x = x + self.attention.attend(q, k, v, positions) + conv + comp
        else:  # three partial sums [T, C], one all-reduce
            x = x + self.tp.all_reduce(self.attention.attend(q, k, v, positions) + conv + comp)
        return x + self.tp.all_reduce(self.mlp(self.post_norm(x)))


class HybridDecoder(Decoder):
    def __init__(self, cfg: ModelConfig, tp_size: int | None = None) -> None:
        tp = tensor_parallel(cfg, tp_size, hidden_size=cfg.hidden_size)  # conv channels
        super().__init__(cfg, [HybridLayer(cfg, i, tp) for i in range(cfg.num_layers)], tp)
