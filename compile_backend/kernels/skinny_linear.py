"""Linears of a few rows (decode: M <= 64; plain ones up to 512) in one Triton
kernel, with the residual add in its epilogue (`mrv2::linear_add`), optionally
an RMSNorm of x in its prologue and SiLU·mul in its epilogue (`mrv2::norm_linear`).

    skinny_linear(x [M, K], weight [N, K], bias [N] | None, residual [M, N_out] | None,
                  norm_weight [K] | None, eps, gated)
        h = rms_norm(x, norm_weight, eps)                 (x when norm_weight is None)
        y = F.linear(h, weight, bias)                                 # [M, N]
        gated: y = silu(y[:, :N/2]) * y[:, N/2:]                      # [M, N_out = N/2]
        == y (+ residual)                                             # [M, N_out]

Used where its grid beats cuBLAS (`skinny_pays`; `MRV2_SKINNY_GEMM=0/1`
overrides; 65-512 rows only with MRV2_WIDE_GEMM=1). Note [skinny GEMMs],
[split K], [wide rows]: docs/design.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compile_backend.core import stream_buffers
from compile_backend.core.counters import counters
from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import register_op

from ._device import (cdiv, env, interpreting, next_pow2, pdl_meta, pdl_release, pdl_wait,
                      sm_count, upcast_dots)
from ._launch import Launch, LayoutMemo, launch_here, layout

SKINNY_ENV = "MRV2_SKINNY_GEMM"  # "0": never the kernel, "1": whenever the inputs allow
MAX_ROWS = 64  # decode batches up to 64 tokens: rows padded to a 16, 32 or 64-row tile
# Note [wide rows]: the plain kernel (no norm, not gated) also takes 65..WIDE_ROWS
# rows in 128-row tiles (b256's linear_add without torch's addmm), where
# MRV2_WIDE_GEMM=1 asks for it: off, measured slower than cuBLAS's addmm.
# With the norm or the gate inside, up to FUSED_ROWS rows: the 32- and 64-row
# fused tiles lose to the three-launch form (llama8b FULL decode on an H100,
# fuse_norm_linear on: b32 10.49 ms against 7.09 off; norm_linear.py).
FUSED_ROWS = 16
WIDE_ROWS = 512
WIDE_ENV = "MRV2_WIDE_GEMM"
SKINNY_DTYPES = (torch.bfloat16, torch.float16)
# Note [split K]: one arrival counter per column tile of a launch, per stream.
ARRIVALS = "skinny_linear.arrivals"
ARRIVAL_SLOTS = 8192  # (row, column) tiles a split launch may have (more: one split)
stream_buffers.declare(ARRIVALS, ARRIVAL_SLOTS, torch.int32)
# Meta-parameters by row tile (BLOCK_M): the best of a sweep for the o and
# down projections of llama-8B on the H200 (bench/results/skinny_gemm_sweep*.json).
# The 16-row tile splits K in two over 64-column tiles (Note [split K];
# bench/results/skinny_gemm_split.md: o 12.4 -> 12.0 µs and down 32.5 -> 31.4
# at one row; 12.5 and 32.7 -> 32.4 at 16), where the split grid fits one
# wave of the SMs (`one_wave_split`: not qkv, gate_up, lm_head).
CONFIGS = {
    16: {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4, "SPLIT_K": 2},
    32: {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
    64: {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
    # Note [wide rows]: Hopper's usual GEMM tile (wgmma, 128 KiB of shared
    # memory, no spills with Triton 3.6: bench/results/kernel_asm.md); split
    # in two so that 256 rows of a 4096-column weight make 128 programs.
    # Picked offline; 1.6-1.9x slower than cuBLAS's addmm on an H100
    # (bench/results/skinny_gemm_wide.md), so off: bench/skinny_gemm.py --rows 128,256 --sweep.
    128: {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "SPLIT_K": 2},
}
# With the norm's prologue or the gate's second weight tile (compile_backend/kernels/norm_linear.py),
# by (BLOCK_M, gated); BLOCK_N counts output columns (gated, a program also
# reads the up projection's BLOCK_N rows). Picked offline from the TTGIR and
# ptxas of the GPU machine's Triton 3.6 for sm_90a (bench/kernel_asm.py,
# bench/results/kernel_asm.md): no register spills, every load of the main
# loop pipelined, 2-4x the weight bytes in flight of the tiles before. The
# 16-row plain tile is the best of an H100 sweep (qkv at one row: 30.9 µs,
# against 48.8 for the offline pick and 23.6 unfused: bench/results/norm_linear_h100.md).
# With Note [norm sums on the tensor cores] qkv at 1-16 rows beats the
# unfused sequence (21.4 and 22.1 µs against 23.6 and 24.2 on an H100). It
# does not split K: split in two (192 programs for qkv where it has 96) it
# took 24.6 and 25.4 µs once the benchmark ran the splits for real, and
# the 21.4 was that split tile run as one split (the erratum under "Split K"
# in docs/design.md; bench/results/norm_linear_split_h100_s21.md).
# The 16-row gated tile is from an H100 sweep at one row: 83.5 µs, 1% from
# its best (32 x 256, which spills 8 bytes without the norm under Triton
# 3.6's ptxas), against 90.4 for the 16-column tile before and 87.1
# unfused. The 32- and 64-row tiles lose (2.1x for qkv at 64), so the op
# takes them only where MRV2_SKINNY_GEMM=1 forces the kernel (FUSED_ROWS;
# bench/results/norm_linear_h100.md).
FUSED_CONFIGS = {
    (16, False): {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
    (32, False): {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
    (64, False): {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
    (16, True): {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
    (32, True): {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
    (64, True): {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
}


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, nw_ptr, out_ptr, part_ptr, arrive_ptr,
    M, N, K, K_SPLIT, eps,
    stride_xm, stride_wn, stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    # One program: out[m0:m0+BLOCK_M, n0:n0+BLOCK_N] over K (SPLIT_K == 1), or
    # its part [k_lo, k_lo + K_SPLIT) of K (program_id(1); Note [split K]).
    # Tile t = program_id(0) is row tile t % tiles_m of column tile t //
    # tiles_m: a column tile's row tiles run side by side and share its weight
    # in L2 (one row tile up to 64 rows; Note [wide rows]). x [M, K] and w
    # [N, K] have unit stride along K. The output has N_out columns: N, or
    # N / 2 when GATED (weight rows [0, N/2) are the gate's, [N/2, N) the up's).
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_n = tile // tiles_m
    n0 = pid_n * BLOCK_N
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    if GATED:
        N_out = N // 2
    else:
        N_out = N
    offs_m = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N_out
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None] * stride_wn  # [BN, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:  # the up projection's rows N/2 + n, beside the gate's rows n
        u_rows = w_ptr + (N_out + offs_n)[:, None] * stride_wn  # [BN, 1]
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if NORM:  # sum_k x[m, k]^2 on the diagonal of x x^T: Note [norm sums on the tensor cores]
        gram = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    # Note [programmatic dependent launch]: nothing is read before the wait,
    # not even the weight (the kernel just before may compute it: a dequant).
    pdl_wait(PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_hi
        # Every load of the tile first, so that their latencies overlap: the
        # norm's arithmetic between them would put a memory round trip before
        # the weight's (measured 3-4x slower: bench/results/norm_linear.md).
        xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        wt = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        if GATED:
            ut = tl.load(u_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        if NORM:  # the dot takes x * nw rounded to x's dtype; rstd scales the sum after the loop
            nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
            xs = xt
            if UPCAST:  # Note [interpreter bf16 dots]
                xs = xs.to(tl.float32)
            gram = tl.dot(xs, tl.trans(xs), gram)  # [BM, BM]
            xt = (xt.to(tl.float32) * nw[None, :]).to(x_ptr.dtype.element_ty)
        if UPCAST:  # Note [interpreter bf16 dots]
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc)  # [BM, BN]
        if GATED:
            if UPCAST:
                ut = ut.to(tl.float32)
            acc_u = tl.dot(xt, tl.trans(ut), acc_u)  # [BM, BN]
    pdl_release(PDL)
    mask = m_ok[:, None] & n_ok[None, :]
    if NORM:  # [BM]: sum of x^2 over this program's run of K, the Gram matrix's diagonal
        diag = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
        ss_row = tl.sum(tl.where(diag, gram, 0.0), 1)
    finish = True  # this program writes its tile (SPLIT_K == 1: every program)
    if SPLIT_K > 1:  # Note [split K]: the last of the tile's programs to arrive finishes it
        parts = part_ptr + offs_m[:, None] * N_out + offs_n[None, :]  # [BM, BN] of split 0
        tl.store(parts + tl.program_id(1) * M * N_out, acc, mask=mask)
        if NORM:  # each (split, tile)'s row sums [BM], after the parts: no two programs share one
            ss_parts = part_ptr + SPLIT_K * M * N_out + tile * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(ss_parts + tl.program_id(1) * tl.num_programs(0) * BLOCK_M, ss_row)
        tl.debug_barrier()  # every thread's part is stored before the arrival releases them
        arrived = tl.atomic_add(arrive_ptr + tile, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()  # and every thread reads the parts only after the acquire
        finish = arrived == SPLIT_K - 1
        if finish:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # in split order: the sum does not depend on who came last
                acc += tl.load(parts + s * M * N_out, mask=mask, other=0.0, cache_modifier=".cg")
            if NORM:
                ss_row = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for s in range(SPLIT_K):
                    ss_row += tl.load(ss_parts + s * tl.num_programs(0) * BLOCK_M, cache_modifier=".cg")
            tl.atomic_xchg(arrive_ptr + tile, 0, sem="relaxed", scope="gpu")  # re-armed
    if finish:
        if NORM:  # rstd[m] = 1 / sqrt(mean_k x[m, k]^2 + eps); padded rows have acc 0 and are not stored
            rstd = 1.0 / tl.sqrt(ss_row / K + eps)  # [BM]
            acc = acc * rstd[:, None]
            if GATED:
                acc_u = acc_u * rstd[:, None]
        if HAS_BIAS:  # the packed bias [N]: entries n (gate) and N/2 + n (up) when GATED
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_ptr + N_out + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:  # silu(g) * u in fp32: g * sigmoid(g) * u
            acc = acc * tl.sigmoid(acc) * acc_u
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def row_tile(M: int) -> int:
    """The dot tile's rows for M rows: 16, 32 or 64 (tl.dot needs >= 16), and
    128 above MAX_ROWS (Note [wide rows])."""
    return max(16, next_pow2(M)) if M <= MAX_ROWS else 128


def skinny_config(M: int, N: int, K: int, config: dict | None = None, gated: bool = False,
                  norm: bool = False, num_sms: int | None = None) -> dict:
    """The kernel's meta-parameters for M rows and a [N, K] weight (`config`
    overrides); BLOCK_M is the row tile. With a norm or gated: FUSED_CONFIGS
    (a gated program reads BLOCK_N gate rows and BLOCK_N up rows). Given
    `num_sms`, the table's split is kept only where the split grid fits one
    wave (`one_wave_split`)."""
    block_m = row_tile(M)
    if (gated or norm) and M > MAX_ROWS:
        raise ValueError(f"skinny_linear: with a norm or gated, at most {MAX_ROWS} rows (got {M}): "
                         "use norm_linear's torch path (mrv2::norm_linear chooses it)")
    table = FUSED_CONFIGS[(block_m, gated)] if (gated or norm) else CONFIGS[block_m]
    cfg = dict(table, BLOCK_M=block_m)
    if interpreting():  # small tiles: the interpreter's tests reach the masks cheaply
        cfg.update(BLOCK_N=16, BLOCK_K=32)
    if num_sms is not None and cfg.get("SPLIT_K", 1) > 1:
        tiles = grid_tiles(M, N // 2 if gated else N, cfg)
        cfg["SPLIT_K"] = one_wave_split(cfg["SPLIT_K"], tiles, num_sms)
    cfg.update(config or {})
    return cfg


def grid_tiles(M: int, n_out: int, cfg: dict) -> int:
    """The (row, column) tiles of a launch over M rows and n_out output
    columns: its grid's first axis (times SPLIT_K programs in all)."""
    return cdiv(n_out, cfg["BLOCK_N"]) * cdiv(M, cfg["BLOCK_M"])


def one_wave_split(split: int, tiles: int, num_sms: int) -> int:
    """Note [split K]: a table's split where `tiles` x split programs still
    fit one wave of the SMs, else one. Splitting K only pays where the column
    tiles alone leave SMs idle (o and down at 16 rows: 64 tiles, 128 programs
    split); a grid that fills them already pays the parts' round trip for
    nothing (H100, 16-row tile, 1 / 16 rows, split 2 against 1: lm_head 346.5
    / 370.1 µs against 340.5 / 348.4, gate_up 83.7 / 88.2 against 82.2 / 83.7,
    qkv 22.3 / 22.9 against 20.6 / 20.9; bench/results/split_sweep_h100_s21.md,
    split_sweep_rest_h100_s22.md)."""
    return split if tiles * split <= num_sms else 1


def skinny_allowed(x: torch.Tensor, weight: torch.Tensor, fused: bool = False) -> bool:
    """Can the kernel take these operands (dtype, rows, strides)? `fused`:
    with a norm or gated, which take at most MAX_ROWS rows (the plain kernel
    WIDE_ROWS)."""
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    rows = MAX_ROWS if fused else WIDE_ROWS
    return (x.dtype in SKINNY_DTYPES and weight.dtype == x.dtype and weight.dim() == 2
            and 1 <= M <= rows and x.shape[-1] == weight.shape[1] and weight.shape[0] > 0
            and x.stride(-1) == 1 and weight.stride(1) == 1 and x.device == weight.device)


def skinny_fills(M: int, N: int, K: int, num_sms: int, gated: bool = False,
                 norm: bool = False) -> bool:
    """Is the grid for M rows and a [N, K] weight (N / 2 output columns when
    gated) wide enough to beat cuBLAS?
    Measured (bench/results/skinny_gemm.md): up to 16 rows a grid of a
    quarter of the SMs wins (64 programs on 132 SMs: 0.81-0.85x); with more
    rows it takes nine tenths (128 programs: 0.78-0.95x; 64: 0.92-1.19x).
    A split launch counts each (tile, split) as a program. With the norm or
    the gate inside, only up to FUSED_ROWS rows.
    `MRV2_SKINNY_GEMM=0/1` overrides the rule. Above MAX_ROWS rows (Note
    [wide rows]): only where MRV2_WIDE_GEMM=1 (and MRV2_SKINNY_GEMM is not 0)."""
    choice = env(SKINNY_ENV)
    if M > MAX_ROWS:
        return choice != "0" and env(WIDE_ENV) == "1"
    if choice in ("0", "1"):
        return choice == "1"
    if (gated or norm) and M > FUSED_ROWS:
        return False
    return _grid_fills(M, N, K, num_sms, gated, norm, interpreting())


@functools.lru_cache(maxsize=4096)
def _grid_fills(M: int, N: int, K: int, num_sms: int, gated: bool, norm: bool,
                interpreter: bool) -> bool:
    """skinny_fills' rule without the switches (a function of its arguments
    and the config tables: kept, as every layer of a step asks again)."""
    n_out = N // 2 if gated else N
    cfg = skinny_config(M, N, K, gated=gated, norm=norm, num_sms=num_sms)
    programs = grid_tiles(M, n_out, cfg) * (1 if gated else cfg.get("SPLIT_K", 1))
    return 4 * programs >= num_sms if M <= 16 else 10 * programs >= 9 * num_sms


def skinny_pays(x: torch.Tensor, weight: torch.Tensor, gated: bool = False,
                norm: bool = False) -> bool:
    """Use the kernel for F.linear(x, weight) (followed by SiLU·mul when
    gated)? (module docstring)"""
    if not (x.is_cuda and skinny_allowed(x, weight, fused=gated or norm)):
        return False
    M = x.numel() // x.shape[-1]
    return skinny_fills(M, weight.shape[0], weight.shape[1], sm_count(x.device), gated, norm)


def check_norm_weight(op: str, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> None:
    """Raise (naming `op`) unless norm_weight is [K] of x's dtype and device
    and eps >= 0."""
    K = x.shape[-1]
    if (tuple(norm_weight.shape) != (K,) or norm_weight.dtype != x.dtype
            or norm_weight.device != x.device):
        raise ValueError(f"{op}: norm_weight must be [{K}] of x's dtype ({x.dtype}) on "
                         f"{x.device}, got {tuple(norm_weight.shape)} {norm_weight.dtype} on "
                         f"{norm_weight.device}")
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be a number >= 0, got {eps}")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, config: dict | None = None,
                  out: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, gated: bool = False) -> torch.Tensor:
    """Launcher. x [..., K] with M = prod(leading dims) in 1..MAX_ROWS (up to
    WIDE_ROWS without norm_weight and not gated), unit stride along K;
    weight [N, K] with unit stride along K (a row slice of a packed weight
    is fine); bias [N] or None; norm_weight [K] or None (then x is
    RMS-normalized with `eps` first); gated: the output is
    silu(y[:, :N/2]) * y[:, N/2:] of y = the linear (N even). residual
    [..., N_out] or None, N_out = N / 2 when gated, else N.
    Returns [..., N_out] in x's dtype (new, or `out`, a contiguous [..., N_out])."""
    key = layout(x, weight, bias, residual, norm_weight, out) if config is None else None
    # A config (tests, benchmarks) is not remembered.
    plan, _ = _LAUNCHES.entry(
        x.device, (key, float(eps), bool(gated)) if key is not None else None,
        lambda: _SkinnyPlan(x, weight, bias, residual, config, out, norm_weight, eps, gated))
    return plan.run(x, weight, bias, residual, out, norm_weight)


# Checked launches by layout (Note [checked layouts] in compile_backend/kernels/_launch.py).
_LAUNCHES = LayoutMemo()


class _SkinnyPlan:
    """One checked `skinny_linear` layout: shapes, config and the launch for
    each split count (`split_plan` decides per call: it depends on the
    stream's counters)."""

    def __init__(self, x, weight, bias, residual, config, out, norm_weight, eps, gated) -> None:
        """Every check of `skinny_linear` (ValueError), then what its launch needs."""
        fused = gated or norm_weight is not None
        if not skinny_allowed(x, weight, fused):
            raise ValueError(
                f"skinny_linear: needs x [..., K] with 1..{MAX_ROWS if fused else WIDE_ROWS} rows "
                f"({MAX_ROWS} with a norm or gated, {WIDE_ROWS} without) and unit stride along K, "
                f"weight [N, K] of x's dtype (one of {SKINNY_DTYPES}) with unit stride along K, "
                f"on one device; got x {tuple(x.shape)} {x.dtype} stride {tuple(x.stride())}, "
                f"weight {tuple(weight.shape)} {weight.dtype} stride {tuple(weight.stride())} "
                "(use F.linear for these)")
        N, K = weight.shape
        if gated and N % 2:
            raise ValueError(f"skinny_linear: gated needs an even N (the gate's rows, then the up "
                             f"projection's, as many), got weight {tuple(weight.shape)}")
        n_out = N // 2 if gated else N
        lead = tuple(x.shape[:-1])
        M = x.numel() // K if K else 0
        if bias is not None and (bias.shape != (N,) or bias.device != x.device):
            raise ValueError(f"skinny_linear: bias must be [{N}] on {x.device}, got {tuple(bias.shape)}")
        if norm_weight is not None:
            check_norm_weight("skinny_linear", x, norm_weight, eps)
        if residual is not None and (tuple(residual.shape) != (*lead, n_out)
                                     or residual.device != x.device):
            raise ValueError(f"skinny_linear: residual must be {(*lead, n_out)} on {x.device}, "
                             f"got {tuple(residual.shape)} on {residual.device}")
        if out is not None and (tuple(out.shape) != (*lead, n_out) or not out.is_contiguous()
                                or out.dtype != x.dtype):
            raise ValueError(f"skinny_linear: out must be a contiguous {(*lead, n_out)} {x.dtype} tensor")
        self.M, self.N, self.K, self.n_out, self.lead = M, N, K, n_out, lead
        self.eps, self.device, self.bind = float(eps), x.device, x.is_cuda
        self.cfg = skinny_config(M, N, K, config, gated, norm=norm_weight is not None,
                                 num_sms=sm_count(x.device) if x.is_cuda else None)
        self.tiles = grid_tiles(M, n_out, self.cfg)
        self.gated, self.norm = bool(gated), norm_weight is not None
        self.meta = dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                         NORM=norm_weight is not None, GATED=gated, BLOCK_M=self.cfg["BLOCK_M"],
                         BLOCK_N=self.cfg["BLOCK_N"], BLOCK_K=self.cfg["BLOCK_K"],
                         UPCAST=upcast_dots(x.dtype), num_warps=self.cfg["num_warps"],
                         num_stages=self.cfg["num_stages"], **pdl_meta(x.device))
        self.launches: dict[int, Launch] = {}  # by split count

    def run(self, x, weight, bias, residual, out, norm_weight) -> torch.Tensor:
        """Launch for these tensors (of the checked layout); returns the output."""
        M, K, n_out = self.M, self.K, self.n_out
        x2 = x.reshape(M, K)
        if norm_weight is not None and norm_weight.stride(0) != 1:
            norm_weight = norm_weight.contiguous()
        r2 = None
        if residual is not None:
            r2 = residual.reshape(M, n_out)
            if r2.stride(-1) != 1:
                r2 = r2.contiguous()
        if out is None:
            out = torch.empty((*self.lead, n_out), dtype=x.dtype, device=x.device)
        o2 = out.view(M, n_out)
        split, k_split, parts, arrivals = split_plan(self.cfg, M, n_out, K, self.tiles, self.device,
                                                     gated=self.gated, norm=self.norm)
        launch = self.launches.get(split)
        if launch is None:
            launch = self.launches[split] = Launch(_skinny_linear_kernel, (self.tiles, split),
                                                   dict(self.meta, SPLIT_K=split), bind=self.bind)
        launch_here(launch, (
            x2, weight, bias if bias is not None else weight, r2 if r2 is not None else o2,
            norm_weight if norm_weight is not None else weight, o2, parts, arrivals,
            M, self.N, K, k_split, self.eps,
            x2.stride(0), weight.stride(0), r2.stride(0) if r2 is not None else 0, o2.stride(0)))
        return out


def split_plan(cfg: dict, M: int, n_out: int, K: int, tiles: int, device: torch.device,
               gated: bool, norm: bool) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """Note [split K]: (splits, K per split, the fp32 parts, the arrival
    counters) for a launch of `tiles` (row, column) tiles. The parts: [splits,
    M, n_out], then with a norm each (split, tile)'s row sums of x^2 [splits,
    tiles, BLOCK_M] (the epilogue's rstd needs all of K). One split (and
    placeholders for the two buffers) where cfg asks for one, or where no
    counters are at hand: inside a capture on a stream without them, or more
    tiles than ARRIVAL_SLOTS (counted: `skinny_split_k_fallbacks`). The gated
    variant never splits (its gate needs both products' whole sums). The
    placeholders are one-element tensors the kernel never reads."""
    split = int(cfg.get("SPLIT_K", 1))
    if split > 1 and gated:
        raise ValueError("skinny_linear: SPLIT_K > 1 is not for the gated kernel: its epilogue "
                         "reads all of K in one program")
    split = max(1, min(split, cdiv(K, cfg["BLOCK_K"])))  # no split without a K tile of its own
    arrivals = stream_buffers.buffer(ARRIVALS, device) if split > 1 and tiles <= ARRIVAL_SLOTS \
        else None
    if arrivals is None:
        if split > 1:
            counters["skinny_split_k_fallbacks"] += 1
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return 1, K, dummy, dummy
    k_split = cdiv(cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = cdiv(K, k_split)  # every split has a K tile (ragged K may need fewer)
    rows = split * tiles * cfg["BLOCK_M"] if norm else 0
    parts = torch.empty(split * M * n_out + rows, dtype=torch.float32, device=device)
    return split, k_split, parts, arrivals


def linear_add_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   residual: torch.Tensor) -> torch.Tensor:
    """Plain torch, as eager computes `residual + F.linear(x, weight, bias)`:
    the GEMM, then the add in place on its fresh output, so the op's torch
    form equals eager bit for bit. `addmm` (one rounding) copies the residual
    into its output first and was no faster at 64-256 rows on an H100 (Note
    [wide rows], docs/design.md)."""
    return F.linear(x, weight, bias).add_(residual)


def check_linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor) -> None:
    want = (*x.shape[:-1], weight.shape[0])
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or tuple(residual.shape) != want:
        raise ValueError(f"linear_add: expected x [..., K], weight [N, K] and residual [..., N] "
                         f"= {want}; got x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"residual {tuple(residual.shape)}")
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"linear_add: x, weight and residual need one dtype, got {x.dtype}, "
                         f"{weight.dtype}, {residual.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise ValueError(f"linear_add: bias must be [{weight.shape[0]}] of x's dtype ({x.dtype}) on "
                         f"{x.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}")


@define_op("mrv2::linear_add")
def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    """`residual + F.linear(x, weight, bias)`: the skinny kernel at decode
    (`skinny_pays`), else torch (`linear_add_ref`)."""
    check_linear_add(x, weight, bias, residual)
    if skinny_pays(x, weight):
        return skinny_linear(x, weight, bias, residual)
    return linear_add_ref(x, weight, bias, residual).contiguous()  # the fake's layout


register_op("mrv2::linear_add", capture_safe=True)


@torch.library.register_fake("mrv2::linear_add")
def _(x, weight, bias, residual):
    check_linear_add(x, weight, bias, residual)
    return torch.empty_like(residual, memory_format=torch.contiguous_format)
