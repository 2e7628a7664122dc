"""Building blocks shared by the reference models."""

from __future__ import annotations

import torch
from torch import nn

from kernels.layers import PagedAttention

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding, half-split layout."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, heads, D]; positions [T]
        ang = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class SelfAttention(nn.Module):
    """q/k/v projections, rotary positions, paged GQA attention, output projection."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.H, self.KVH, self.D = H, KVH, D
        # Separate projections: slices of one fused output are not contiguous,
        # and a contiguity check on them would specialise the token count to != 1.
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, KVH * D, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, KVH * D, bias=False)
        self.rotary = Rotary(D, cfg.rope_theta)
        self.attn = PagedAttention(H, KVH, D, layer_name=f"layers.{index}.attn")
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=False)

    def project(self, r: torch.Tensor):
        """r [T, hidden] -> q [T, H*D], k [T, KVH, D], v [T, KVH*D]."""
        T = r.shape[0]
        return self.q_proj(r), self.k_proj(r).view(T, self.KVH, self.D), self.v_proj(r)

    def attend(self, q, k, v, positions: torch.Tensor) -> torch.Tensor:
        T = q.shape[0]
        q = self.rotary(q.view(T, self.H, self.D), positions)
        return self.o_proj(self.attn(q, self.rotary(k, positions), v))

    def forward(self, r: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.project(r), positions)


class Decoder(nn.Module):
    """Embedding -> layers -> norm -> logits, seeded random weights in
    cfg.dtype. Subclasses make the layers."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.init_weights()
        self.to(cfg.dtype)

    def init_weights(self) -> "Decoder":
        """Seeded random weights; small std keeps activations in range. Drawn
        on the parameters' device (a model built under `torch.device("cuda")`
        never holds its weights on the host), from one generator in module
        order: the same seed on the same device type gives the same weights."""
        device = self.embed.weight.device
        gen = torch.Generator(device=device).manual_seed(self.cfg.seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    continue  # norms start at one
                for p in module.parameters(recurse=False):
                    std = 0.1 if p.dim() == 1 else (1.0 if isinstance(module, nn.Embedding) else 0.05)
                    p.normal_(0.0, std, generator=gen)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions [T] -> logits [T, vocab] (fp32)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x)).float()

    def bind_caches(self, num_blocks: int, block_size: int, num_slots: int,
                    device: torch.device | str) -> None:
        """Allocate every layer's KV cache and per-request state."""
        for m in self.modules():
            if hasattr(m, "bind_kv_cache"):
                m.bind_kv_cache(num_blocks, block_size, self.cfg.dtype, device)
            elif hasattr(m, "bind_state"):
                m.bind_state(num_slots, self.cfg.dtype, device)
            elif hasattr(m, "bind_cache"):
                m.bind_cache(num_blocks, block_size, num_slots, self.cfg.dtype, device)
