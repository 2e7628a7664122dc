"""The floor of one decode step, per kernel class: max(bytes / bandwidth,
FLOPs / peak). Bytes alone (the HBM floor) are blind to GEMMs that compute
bounds (llama8b's gate_up at batch 256 runs at about 535 TFLOP/s); FLOPs
alone are blind to GEMVs. A class is bound by whichever is slower, and the
step's floor is the sum over classes (kernels of one step run one after
another).

Classes, for a step of T query tokens over `tokens_read` cached tokens:
  embedding   the T rows it reads (not the table: a lookup reads T rows)
  gemm        every nn.Linear (lm_head included): its weight (and bias)
              once, 2 * T * in * out FLOPs
  attention   every PagedAttention layer's KV read (K and V of every token
              read), 4 * T * context * heads * head_dim FLOPs (QK^T and PV)
  other       the remaining parameters (norms, conv and compressor weights)
Activations are left out: at decode they are megabytes against gigabytes.

`gemm_peak_flops(device)` measures the bf16 GEMM peak (a large square
matmul, median of timed repeats with CUDA events); `copy_bandwidth` in
bench/timing.py measures the bandwidth.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Work:
    bytes: int
    flops: int

    def __add__(self, other: "Work") -> "Work":
        return Work(self.bytes + other.bytes, self.flops + other.flops)


def step_work(model: nn.Module, num_tokens: int, tokens_read: int,
              context: int) -> dict[str, Work]:
    """Bytes read and FLOPs of one step by kernel class (module docstring).
    num_tokens: query tokens of the step (the batch at decode); tokens_read:
    cached tokens all requests read (batch x (context + 1) at decode);
    context: tokens one request attends to (for FLOPs)."""
    from compile_backend.kernels.layers import PagedAttention

    work = {"embedding": Work(0, 0), "gemm": Work(0, 0), "attention": Work(0, 0),
            "other": Work(0, 0)}
    counted: set[int] = set()
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            w = m.weight
            work["embedding"] += Work(num_tokens * w.shape[1] * w.element_size(), 0)
            counted.add(id(w))
        elif isinstance(m, nn.Linear):
            params = [p for p in (m.weight, m.bias) if p is not None]
            nbytes = sum(p.numel() * p.element_size() for p in params)
            work["gemm"] += Work(nbytes, 2 * num_tokens * m.in_features * m.out_features)
            counted.update(id(p) for p in params)
        elif isinstance(m, PagedAttention):
            elt = torch.finfo(m.k_cache.dtype).bits // 8 if m.k_cache is not None else 2
            kv = 2 * tokens_read * m.num_kv_heads * m.head_dim * elt
            work["attention"] += Work(kv, 4 * num_tokens * context * m.num_heads * m.head_dim)
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in counted)
    work["other"] = Work(rest, 0)
    return work


def floor_seconds(work: dict[str, Work], bandwidth: float, peak_flops: float | None) -> float:
    """Sum over classes of max(bytes / bandwidth, FLOPs / peak); without a
    peak (not measured) the bytes alone."""
    total = 0.0
    for w in work.values():
        t = w.bytes / bandwidth
        if peak_flops:
            t = max(t, w.flops / peak_flops)
        total += t
    return total


def bound_by(work: dict[str, Work], bandwidth: float, peak_flops: float) -> dict[str, str]:
    """Which limit binds each class: "bytes" or "flops"."""
    return {c: "flops" if w.flops / peak_flops > w.bytes / bandwidth else "bytes"
            for c, w in work.items()}


def gemm_peak_flops(device: str, n: int = 8192, reps: int = 20) -> float | None:
    """FLOP/s of an n x n x n bf16 matmul (median of `reps`, CUDA events after
    warm-up); None off CUDA (a CPU has no meaningful peak for this floor)."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / statistics.median(times)
