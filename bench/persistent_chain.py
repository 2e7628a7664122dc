"""Does one persistent kernel over a chain of decode GEMVs beat a launch per GEMV?

    python bench/persistent_chain.py [--rows 1,16] [--layers 12] [--hidden 4096]
                                     [--out bench/results/persistent_chain.md]
    python bench/persistent_chain.py --dry-run    (CPU plumbing, tiny shapes; numbers mean nothing)

Issue #37 item 1: every decode GEMV pays about 4 µs beyond its bytes
(docs/design.md, "Decode at llama8b"); launch latency, the first DRAM round
trip and the last program's tail are the suspects, and only overlap across
GEMVs can hide them. Before building a persistent per-layer kernel, this
measures the form on its simplest chain: `--layers` GEMVs y[i+1] = y[i] +
y[i] W[i]^T (square `--hidden` weights, an o projection with its residual),
each its own weight so no replay finds one in L2, at `--rows` rows.

Variants, each captured in one CUDA graph (median replay / layers):
  launches            a launch of the production kernel per GEMV
                      (`mrv2::linear_add`'s skinny kernel, PDL on where it is)
  persistent          one launch of `_chain_kernel`: one program per column
                      tile, all resident, a grid barrier (an arrival counter)
                      between GEMVs
  persistent+preload  the same, each program loading its next weight tile
                      before the barrier (the weights are the chain's own:
                      nothing writes them)
  persistent+l2       the same, each program asking L2 (Hopper's bulk
                      prefetch) for the first `--l2-row-bytes` of each of
                      its rows of the next weight once its K loop is done,
                      so the barrier's wait and the other programs' tail
                      stream the next GEMV's first tiles (GPU only)
Outputs are checked against a float64 reference chain and each other
(bf16, one rounding per GEMV), and bit-equal from replay to replay.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import report  # noqa: E402
from timing import graph_us_per  # noqa: E402
from compile_backend.kernels._device import upcast_dots  # noqa: E402
from l2_prefetch import l2_prefetch_rows, l2_prefetch_supported  # noqa: E402

# A column tile per program; the K loop as the skinny kernel's 32-row tile.
BLOCK_N, BLOCK_K, WARPS, STAGES = 32, 256, 4, 4
# persistent+l2: a quarter of each 8 KiB row of a 4096-wide weight, 8 MiB of
# the next 32 MiB weight across the grid (what ~2.5 µs of HBM time brings).
L2_ROW_BYTES = 2048
REL_TOL = 3e-2  # bf16 over a dozen GEMVs, each rounded once, against float64


@triton.jit
def _chain_kernel(y_ptr, w_ptr, count_ptr, M, N, L,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRELOAD: tl.constexpr, L2_ROW_BYTES: tl.constexpr, UPCAST: tl.constexpr):
    # y [L + 1, M, N]: y[0] the input, y[i + 1] = y[i] + y[i] @ W[i]^T; w [L, N, N].
    # Program p owns column tile p of every GEMV (grid = cdiv(N, BLOCK_N), all
    # resident: at most one program per SM). Between GEMVs a grid barrier:
    # each program stores its tile, adds one to the counter (release, after a
    # CTA barrier) and spins until all programs of this GEMV arrived (acquire).
    # count_ptr: one int32, zero at launch. L2_ROW_BYTES > 0 (a multiple of 16,
    # at most a row's bytes; GPU only): once its K loop is done, a program asks
    # L2 for the first L2_ROW_BYTES of each of its BLOCK_N rows of W[layer + 1].
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None] * N  # [BN, 1] of W[0]
    k_first = 0
    if PRELOAD:  # the first K tile of W[0]; later ones load before each barrier
        k_first = BLOCK_K
        w_first = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < N)[None, :],
                          other=0.0)
    for layer in range(L):
        x_rows = y_ptr + layer * M * N + offs_m[:, None] * N  # [BM, 1] of y[layer]
        w_layer = w_rows + layer * N * N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_first, N, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < N
            xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_layer + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:  # Note [interpreter bf16 dots]
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(xt, tl.trans(wt), acc)
        if L2_ROW_BYTES > 0:  # this program's rows of W[layer + 1]: its column tile's
            if layer + 1 < L:
                l2_prefetch_rows(w_ptr + (layer + 1) * N * N, N, N, L2_ROW_BYTES, pid, P)
        if PRELOAD:  # the preloaded tile last: a fixed order
            k_ok = offs_k < N
            xt = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wt = w_first
            if UPCAST:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(xt, tl.trans(wt), acc)
        mask = m_ok[:, None] & n_ok[None, :]
        acc += tl.load(x_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + (layer + 1) * M * N + offs_m[:, None] * N + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask)
        if PRELOAD:  # the next weight's first tile streams while the others finish
            nxt = offs_k < tl.where(layer + 1 < L, N, 0)  # past the last weight: nothing
            w_first = tl.load(w_layer + N * N + offs_k[None, :], mask=n_ok[:, None] & nxt[None, :],
                              other=0.0)
        tl.debug_barrier()  # every thread's store is issued before the arrival releases them
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        target = (layer + 1) * P
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()  # and every thread reads y[layer + 1] only after the acquire


def persistent_chain(y: torch.Tensor, w: torch.Tensor, count: torch.Tensor, preload: bool,
                     block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                     l2_row_bytes: int = 0) -> torch.Tensor:
    """y [L + 1, M, N] (y[0] given; the rest written), w [L, N, N], count one
    int32 (zeroed here). The grid (one program per column tile) must fit the
    GPU at once: the barrier waits for every program. `l2_row_bytes`: the
    bytes of each next-weight row asked of L2 (0: none; a CUDA GPU of compute
    capability 9 or later)."""
    L, N = w.shape[0], w.shape[1]
    if l2_row_bytes and (l2_row_bytes % 16 or not 0 < l2_row_bytes <= N * w.element_size()):
        raise ValueError(f"persistent_chain: l2_row_bytes must be a multiple of 16 in (0, "
                         f"{N * w.element_size()}] (a row's bytes), got {l2_row_bytes}")
    if l2_row_bytes and not l2_prefetch_supported(w.device):
        raise ValueError("persistent_chain: the L2 prefetch needs a CUDA GPU of compute capability "
                         ">= 9 (Hopper's bulk prefetch); leave l2_row_bytes at 0 here")
    M = y.shape[1]
    tiles = triton.cdiv(N, block_n)
    if y.is_cuda and tiles > torch.cuda.get_device_properties(y.device).multi_processor_count:
        raise ValueError(f"persistent_chain: {tiles} column tiles exceed the SMs; the grid "
                         "barrier needs every program resident (a wider --block-n)")
    count.zero_()
    _chain_kernel[(tiles,)](y, w, count, M, N, L, BLOCK_M=max(16, triton.next_power_of_2(M)),
                            BLOCK_N=block_n, BLOCK_K=block_k, PRELOAD=preload,
                            L2_ROW_BYTES=l2_row_bytes,
                            UPCAST=upcast_dots(y.dtype), num_warps=WARPS, num_stages=STAGES)
    return y[L]


def launches_chain(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same chain as a launch per GEMV (mrv2::linear_add's kernel)."""
    from compile_backend.kernels.skinny_linear import skinny_linear

    for i in range(w.shape[0]):
        skinny_linear(y[i], w[i], None, y[i], out=y[i + 1])
    return y[w.shape[0]]


def reference_chain(y0: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64, with the kernels' one bf16 rounding per GEMV."""
    y = y0
    for i in range(w.shape[0]):
        y = (y.double() + y.double() @ w[i].double().T).to(y0.dtype)
    return y


def bench_rows(M: int, args, device: str, bw: float) -> list[dict]:
    g = torch.Generator().manual_seed(2000 + M)
    N, L = args.hidden, args.layers
    w = (torch.randn(L, N, N, generator=g) * N ** -0.5).to(torch.bfloat16).to(device)
    y0 = torch.randn(M, N, generator=g).to(torch.bfloat16).to(device)
    ref = reference_chain(y0, w)
    floor_us = N * N * 2 / bw * 1e6
    rows = []
    variants = ["launches", "persistent", "persistent+preload"]
    if args.l2_row_bytes and l2_prefetch_supported(w.device):
        variants.append("persistent+l2")
    for name in variants:
        y = torch.empty(L + 1, M, N, dtype=torch.bfloat16, device=device)
        y[0] = y0
        count = torch.zeros(1, dtype=torch.int32, device=device)
        if name == "launches":
            def fn(y=y):
                return launches_chain(y, w)
        else:
            def fn(y=y, count=count, preload=name.endswith("preload"),
                   l2=args.l2_row_bytes if name.endswith("l2") else 0):
                return persistent_chain(y, w, count, preload, args.block_n, l2_row_bytes=l2)
        first = fn().clone()
        err = ((first.double() - ref.double()).norm() / ref.double().norm()).item()
        if err > REL_TOL:
            raise AssertionError(f"{name} M={M}: rel. error {err:.3g} against the reference > {REL_TOL}")
        us = graph_us_per(fn, device, L)
        again = torch.equal(y[L], first)  # the graph's replays wrote y[L] again: the same bits
        rows.append(dict(rows=M, variant=name, gemv_us=us, floor_us=floor_us, rel_err=err,
                         replays_equal=again))
    return rows


def fmt(rows: list[dict], bw_text: str) -> list[str]:
    base = {r["rows"]: r["gemv_us"] for r in rows if r["variant"] == "launches"}
    out = [f"copy bandwidth {bw_text}; µs per GEMV (median replay of one CUDA graph of the "
           "chain / GEMVs); floor = the weight's bytes / copy bandwidth", ""]
    out += report.table(
        ["rows", "variant", "µs per GEMV", "vs launches", "floor µs", "beyond the floor µs",
         "rel. err vs float64", "replays bit-equal"], "rlrrrrrl",
        [(r["rows"], r["variant"], f"{r['gemv_us']:.2f}",
          report.dash(r["gemv_us"] / base[r["rows"]] if r["rows"] in base else None, ".3f"),
          f"{r['floor_us']:.2f}", f"{r['gemv_us'] - r['floor_us']:.2f}", f"{r['rel_err']:.1e}",
          "yes" if r["replays_equal"] else "NO") for r in rows])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--block-n", type=int, default=BLOCK_N, help="columns per program")
    ap.add_argument("--l2-row-bytes", type=int, default=L2_ROW_BYTES,
                    help="persistent+l2: bytes of each next-weight row asked of L2 (0: no such variant)")
    report.add_out(ap, default=os.path.join(report.RESULTS_DIR, "persistent_chain.md"))
    report.add_dry_run(ap)
    args = ap.parse_args(argv)
    rows_list = report.comma_list(args.rows, int)
    if args.dry_run:  # one program (the interpreter runs programs one after another)
        device, gpu, bw_samples = "cpu", "CPU dry run", [1e9]
        args.hidden, args.layers, args.block_n = 64, min(args.layers, 3), 64
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (or --dry-run on a CPU)")
        from timing import copy_bandwidth

        device, gpu = "cuda", torch.cuda.get_device_name()
        bw_samples = list(copy_bandwidth().samples)
    bw = statistics.median(bw_samples)
    rows = []
    for M in rows_list:
        rows += bench_rows(M, args, device, bw)
        print(f"M={M}: " + ", ".join(f"{r['variant']} {r['gemv_us']:.2f} µs"
                                     for r in rows if r["rows"] == M), flush=True)
    meta = report.run_meta("persistent_chain", argv, gpu)
    meta.update(copy_bandwidth_samples_GBps=[s / 1e9 for s in bw_samples], layers=args.layers,
                hidden=args.hidden, block_n=args.block_n, l2_row_bytes=args.l2_row_bytes)
    bw_text = f"{bw / 1e9:.0f} GB/s (median of {len(bw_samples)} rounds)"
    text = "\n".join([report.heading("A chain of decode GEMVs: a launch each or one persistent "
                                     "kernel", meta), "", f"Command: `{meta['command']}`", "",
                      *fmt(rows, bw_text)])
    report.print_and_write([text], None)
    report.write_md_and_json(args.out, text, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
