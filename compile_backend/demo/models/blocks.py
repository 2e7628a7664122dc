"""Building blocks shared by the reference models."""

from __future__ import annotations

import torch
from torch import nn

from compile_backend.core.parallel import TensorParallel, check_divides
from compile_backend.kernels.layers import PagedAttention
from compile_backend.kernels.rope_and_cache import rotary_ref

from .config import ModelConfig
from .sharding import column_linear, row_linear


def tensor_parallel(cfg: ModelConfig, tp_size: int | None, **more_dims: int) -> TensorParallel:
    """This process's rank and the TP size (None: the process group's, 1
    without one), after checking that the size divides every split
    dimension: heads, KV heads, the MLP's width, and `more_dims`."""
    if tp_size is not None:  # the sizes first: that error names the sizes that work
        check_divides(tp_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                      intermediate_size=cfg.intermediate_size, **more_dims)
    tp = TensorParallel.current(tp_size)
    check_divides(tp.size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                  intermediate_size=cfg.intermediate_size, **more_dims)
    return tp


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
    """Rotary position embedding, half-split layout (`rotary_ref`). SelfAttention
    uses only its `inv_freq`: mrv2::rope_and_cache computes this function
    inside the KV-cache write (compile_backend/kernels/rope_and_cache.py)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, heads, D]; positions [T]
        return rotary_ref(x, positions, self.inv_freq)


class SwiGLU(nn.Module):
    """With TP: gate_up column-parallel (each rank: its gate and up columns),
    down row-parallel; the output is this rank's partial sum."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        I = cfg.intermediate_size  # noqa: E741
        self.gate_up = column_linear(cfg.hidden_size, 2 * I, tp, chunks=2)  # [T, 2*I/N]
        self.down = row_linear(I, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class SelfAttention(nn.Module):
    """q/k/v projections, rotary positions, paged GQA attention, output projection.

    With TP: q/k/v column-parallel and o row-parallel, so each rank holds
    H/N heads and KVH/N KV heads (its KV cache too) and returns its partial
    sum of the output; rank r's q heads use rank r's KV heads, as at TP=1."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        H, KVH, D = tp.shard(cfg.num_heads), tp.shard(cfg.num_kv_heads), cfg.head_dim
        self.H, self.KVH, self.D = H, KVH, D  # this rank's heads
        # Separate projections: slices of one fused output are not contiguous,
        # and a contiguity check on them would specialise the token count to != 1.
        self.q_proj = column_linear(cfg.hidden_size, cfg.num_heads * D, tp)
        self.k_proj = column_linear(cfg.hidden_size, cfg.num_kv_heads * D, tp)
        self.v_proj = column_linear(cfg.hidden_size, cfg.num_kv_heads * D, tp)
        self.rotary = Rotary(D, cfg.rope_theta)
        self.attn = PagedAttention(H, KVH, D, layer_name=f"layers.{index}.attn")
        self.o_proj = row_linear(cfg.num_heads * D, cfg.hidden_size, tp)

    def project(self, r: torch.Tensor):
        """r [T, hidden] -> q [T, H*D], k [T, KVH, D], v [T, KVH*D]."""
        T = r.shape[0]
        return self.q_proj(r), self.k_proj(r).view(T, self.KVH, self.D), self.v_proj(r)

    def attend(self, q, k, v, positions: torch.Tensor) -> torch.Tensor:
        """q, k un-rotated: the attention layer applies `self.rotary`'s
        frequencies to both as it writes the KV cache (one kernel,
        mrv2::rope_and_cache; the same function as `self.rotary`)."""
        return self.o_proj(self.attn(q, k, v, positions, self.rotary.inv_freq))

    def forward(self, r: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.project(r), positions)


class Decoder(nn.Module):
    """Embedding -> layers -> norm -> logits, seeded random weights in
    cfg.dtype. Subclasses make the layers.

    Tensor parallelism (`tp`): the layers hold their shards (sharding.py);
    the embedding and lm_head are replicated, so every rank computes the
    whole [T, vocab] logits and samples the same tokens with no gather (a
    vocab-parallel lm_head would read 1/N of its weight per rank for an
    all-gather of the logits per step)."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module],
                 tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
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
        order: the same seed on the same device type gives the same weights.
        A tensor-parallel shard (`module.tp_shards`) is drawn at its full TP=1
        shape and this rank keeps its part, so every TP size draws the same
        numbers in the same order and computes TP=1's function."""
        device = self.embed.weight.device
        gen = torch.Generator(device=device).manual_seed(self.cfg.seed)
        tp = self.tp
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    continue  # norms start at one
                shards = getattr(module, "tp_shards", {})
                for name, p in module.named_parameters(recurse=False):
                    std = 0.1 if p.dim() == 1 else (1.0 if isinstance(module, nn.Embedding) else 0.05)
                    shard = shards.get(name)
                    if shard is None:
                        p.normal_(0.0, std, generator=gen)
                        continue
                    full = p.new_empty(shard.full_shape(p.shape, tp.size)).normal_(0.0, std, generator=gen)
                    p.copy_(shard.take(full, tp.rank, tp.size))
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions [T] -> logits [T, vocab] (fp32)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x)).float()

    def get_input_embeddings(self) -> nn.Embedding:
        """Hugging Face's name for it: the runner reads the vocabulary size
        from it to check token ids."""
        return self.embed

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
