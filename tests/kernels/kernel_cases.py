"""Pure helpers for the kernel tests: devices, tolerances, random batches.

Kernel tests run on two devices: "cpu" through Triton's interpreter (CI; needs
TRITON_INTERPRET=1, which conftest sets when there is no GPU) and "cuda"
(marked `gpu`, compiled for real on the H200).
"""

from __future__ import annotations

import importlib
import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1"
        ),
        id="cpu",
    ),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")],
        id="cuda",
    ),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# Head sizes off the usual 64/128: below tl.dot's minimum of 16 (the kernels
# pad the tiles' head dimension) and not powers of two (masked columns).
SMALL_HEAD_DIMS = [4, 8, 12, 24]
# On the GPU: every size from 1 to the largest the attention layer accepts.
GPU_HEAD_DIMS = [1, 4, 8, 12, 24, 40, 96, 256]

# Relative error ||out - ref|| / ||ref|| allowed per dtype, against a fp32
# reference computed from the same (rounded) inputs. bf16/fp16 outputs carry
# one final rounding (2^-8 / 2^-11 relative) plus rounded P in P@V.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture(autouse=True)
def gpu_dot_limits(monkeypatch):
    """Triton's interpreter accepts tl.dot of any size; the GPU needs every
    dimension >= 16 (Note [dot tiles]). Make the interpreter check that too.
    Autouse in the test modules that import it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import interpreter_builder

        monkeypatch.setitem(interpreter_builder.codegen_fns, "min_dot_size", lambda a, b: (16, 16, 16))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    err = rel_err(out, ref)
    assert err <= REL_TOL[dtype], f"{what} rel. error {err:.3g} > {REL_TOL[dtype]:.3g} ({dtype})"


def assert_one_rounding(out, ref, x, dtype, what):
    """out within one rounding to `dtype` of ref, plus fp32 noise (cos/sin of
    another library, a fused multiply-add) relative to the rotated rows' size."""
    out, ref = out.double().cpu(), ref.double().cpu()
    mag = x.double().cpu().abs().amax(-1, keepdim=True)  # per row
    allowed = torch.finfo(dtype).eps * ref.abs() + 1e-5 * mag
    err = (out - ref).abs()
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    bad = err > allowed
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off by more than one {dtype} "
                           f"rounding, max excess {float((err - allowed).max()):.3g}")


def stable_seed(*parts) -> int:
    """A seed from the case's values that is the same in every process
    (`hash()` of a str changes with PYTHONHASHSEED, so a failure would not rerun)."""
    return zlib.crc32(repr(parts).encode()) % 2**31


def gen(seed: int, device: str = "cpu") -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(shape, dtype, device, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(dtype=dtype, device=device)


@dataclass
class PagedBatch:
    """A batch for paged attention / compressor tests. Padding requests have
    q_len 0, seq_len 0, block 0 everywhere; padding tokens (beyond qsl[B]) have
    slot -1."""

    q_lens: list[int]
    seq_lens_list: list[int]
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int  # T (padded)
    num_blocks: int
    block_size: int

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)


def paged_batch(q_lens, seq_lens, block_size, device, g, pad_tokens=0, extra_blocks=3,
                entries_per_pos=1) -> PagedBatch:
    """Random distinct physical blocks for every request (block 0 is the null
    block and never used by a real request). `entries_per_pos` > 1 divides
    positions into groups (compressor: one cache entry per group)."""
    B = len(q_lens)
    need = [math.ceil(math.ceil(s / entries_per_pos) / block_size) for s in seq_lens]
    max_blocks = max(max(need, default=0), 1) + 1
    num_blocks = 1 + sum(need) + extra_blocks
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(B, max_blocks, dtype=torch.int32)
    slots = []
    for b in range(B):
        mine = [perm.pop() for _ in range(need[b])]
        table[b, : need[b]] = torch.tensor(mine, dtype=torch.int32)
        for p in range(seq_lens[b] - q_lens[b], seq_lens[b]):
            e = p // entries_per_pos  # cache entry of position p
            slots.append(mine[e // block_size] * block_size + e % block_size)
    T = sum(q_lens) + pad_tokens
    slots += [-1] * pad_tokens
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return PagedBatch(
        q_lens=list(q_lens), seq_lens_list=list(seq_lens),
        query_start_loc=qsl.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_table=table.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        num_tokens=T, num_blocks=num_blocks, block_size=block_size,
    )


def state_batch(q_lens, state_indices, device, pad_tokens=0):
    """query_start_loc [B+1] int32 and state_indices [B] int32 on `device`."""
    qsl = torch.tensor([0] + list(torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()),
                       dtype=torch.int32)
    return qsl.to(device), torch.tensor(state_indices, dtype=torch.int32).to(device), sum(q_lens) + pad_tokens


def search_in_steps(monkeypatch, kernel_module: str, requests: int = 2) -> None:
    """Make a request-tile kernel's programs scan query_start_loc `requests`
    entries at a time (Note [request tiles]), so that a few requests already
    take several steps of the search."""
    monkeypatch.setattr(importlib.import_module(kernel_module), "SEARCH", requests)
