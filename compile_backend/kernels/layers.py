"""nn.Modules that models use. Each takes a `layer_name` and calls the mrv2
ops with it; the ops read that layer's metadata from the forward context, so
a model never passes metadata through `forward`.

`metadata_kind` tells a runner which metadata a layer needs:
"attention" -> AttentionMetadata, "sconv" -> SConvMetadata,
"compressor" -> CompressorMetadata. Caches and state are non-persistent
buffers, empty until bound (`bind_*`) by whoever owns the memory.

Sizes are checked at construction (ValueError): a layer accepts exactly the
sizes its kernels handle (head sizes 1..MAX_HEAD_DIM for attention, any
channel count for sconv, any head size for the compressor).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import kv_compress as _kv_compress  # noqa: F401  (registers mrv2::kv_compress)
from . import reshape_and_cache as _reshape_and_cache  # noqa: F401
from . import rope_and_cache as _rope_and_cache  # noqa: F401
from . import rope_attention as _rope_attention  # noqa: F401  (the pass's fused op)
from . import sconv as _sconv  # noqa: F401
from . import unified_attention as _unified_attention  # noqa: F401
from .unified_attention import MAX_HEAD_DIM

DEFAULT_BLOCK_SIZE = 16


def _check_size(name: str, value: object, minimum: int, maximum: int | None = None,
                why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        want = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {want}{why}, got {value!r}")


def _heads(x: torch.Tensor, T, heads: int, head_dim: int) -> torch.Tensor:
    """[T, heads * head_dim] or [T, heads, head_dim] -> [T, heads, head_dim].
    A tensor already of that shape is passed on as is: reshaping a strided
    one (a column slice of a fused projection, viewed per head) makes the
    piece compiler's shape checks guard on the token count != 1."""
    if x.dim() == 3 and x.shape[1] == heads and x.shape[2] == head_dim:
        return x
    return x.reshape(T, heads, head_dim)


class PagedAttention(nn.Module):
    """Writes k/v into the paged cache, then attends (mrv2::reshape_and_cache,
    mrv2::unified_attention). q [T, H*D] or [T, H, D]; k, v [T, KVH*D] or
    [T, KVH, D] -> [T, H*D].

    With `positions` [T] and `inv_freq` [D/2] (a rotary module's buffer),
    q and k are un-rotated: one kernel applies rotary (half-split layout) to
    both and writes the rotated k and v into the cache (mrv2::rope_and_cache),
    and the attention reads the rotated q it returns."""

    metadata_kind = "attention"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_name: str,
                 scale: float | None = None) -> None:
        super().__init__()
        _check_size("num_heads", num_heads, 1)
        _check_size("num_kv_heads", num_kv_heads, 1)
        _check_size("head_dim", head_dim, 1, MAX_HEAD_DIM,
                    " (the attention kernels hold [tile, head_dim] fp32 accumulators)")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_name = layer_name
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        empty = torch.empty(0, DEFAULT_BLOCK_SIZE, num_kv_heads, head_dim)
        self.register_buffer("k_cache", empty, persistent=False)
        self.register_buffer("v_cache", empty.clone(), persistent=False)

    def bind_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None,
                inv_freq: torch.Tensor | None = None) -> torch.Tensor:
        if (positions is None) != (inv_freq is None):
            raise ValueError("PagedAttention: pass positions and inv_freq together (rotary "
                             "inside the cache write), or neither")
        T = q.shape[0]
        q = _heads(q, T, self.num_heads, self.head_dim)
        k = _heads(k, T, self.num_kv_heads, self.head_dim)
        v = _heads(v, T, self.num_kv_heads, self.head_dim)
        if positions is None:
            torch.ops.mrv2.reshape_and_cache(k, v, self.k_cache, self.v_cache, self.layer_name)
        else:
            q = torch.ops.mrv2.rope_and_cache(q, k, v, positions, inv_freq, self.k_cache,
                                              self.v_cache, self.layer_name)
        # Allocated here, before the breakpoint op: under torch.compile the
        # allocation belongs to the preceding graph piece, and the next piece
        # reads the output where the op wrote it (a replay copies nothing).
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        torch.ops.mrv2.unified_attention(q, self.k_cache, self.v_cache, out, self.layer_name, self.scale)
        return out.view(T, self.num_heads * self.head_dim)


class ShortConv(nn.Module):
    """Causal depthwise conv1d of width `kernel_size` with per-request state
    (mrv2::sconv). x [T, C] -> [T, C]."""

    metadata_kind = "sconv"

    def __init__(self, channels: int, kernel_size: int, layer_name: str, bias: bool = True) -> None:
        super().__init__()
        _check_size("channels", channels, 1)
        _check_size("kernel_size", kernel_size, 2)
        self.channels, self.kernel_size, self.layer_name = channels, kernel_size, layer_name
        self.weight = nn.Parameter(torch.randn(channels, kernel_size) / math.sqrt(kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        self.register_buffer("conv_state", torch.empty(0, channels, kernel_size - 1), persistent=False)

    def bind_state(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.conv_state = torch.zeros(num_slots, self.channels, self.kernel_size - 1,
                                      dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mrv2.sconv(x, self.weight, self.bias, self.conv_state, self.layer_name)


class KVCompressor(nn.Module):
    """Groups of `ratio` tokens -> one softmax(score)-weighted key each, into a
    paged compressed cache (mrv2::kv_compress). key [T, KVH, D], score
    [T, KVH] -> running compressed value per token [T, KVH, D]."""

    metadata_kind = "compressor"

    def __init__(self, num_kv_heads: int, head_dim: int, ratio: int, layer_name: str) -> None:
        super().__init__()
        _check_size("num_kv_heads", num_kv_heads, 1)
        _check_size("head_dim", head_dim, 1)
        _check_size("ratio", ratio, 1)
        self.num_kv_heads, self.head_dim, self.ratio = num_kv_heads, head_dim, ratio
        self.layer_name = layer_name
        self.register_buffer("compressed_cache",
                             torch.empty(0, DEFAULT_BLOCK_SIZE, num_kv_heads, head_dim), persistent=False)
        self.register_buffer("state_max", torch.empty(0, num_kv_heads), persistent=False)
        self.register_buffer("state_sum", torch.empty(0, num_kv_heads), persistent=False)
        self.register_buffer("state_acc", torch.empty(0, num_kv_heads, head_dim), persistent=False)

    def bind_cache(self, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype,
                   device: torch.device | str) -> None:
        H, D = self.num_kv_heads, self.head_dim
        self.compressed_cache = torch.zeros(num_blocks, block_size, H, D, dtype=dtype, device=device)
        self.state_max = torch.zeros(num_slots, H, dtype=torch.float32, device=device)
        self.state_sum = torch.zeros(num_slots, H, dtype=torch.float32, device=device)
        self.state_acc = torch.zeros(num_slots, H, D, dtype=torch.float32, device=device)

    def forward(self, key: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        return torch.ops.mrv2.kv_compress(key, score, self.compressed_cache, self.state_max,
                                          self.state_sum, self.state_acc, self.layer_name, self.ratio)
