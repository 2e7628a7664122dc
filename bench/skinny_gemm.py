"""Decode linears (M <= 64 rows; plain ones up to 512): the skinny Triton kernel
(compile_backend/kernels/skinny_linear.py) against cuBLAS, inside CUDA graphs, on one GPU.

    python bench/skinny_gemm.py [--shapes llama8b,bench] [--rows 1,16,32,64]
                                [--sweep] [--out bench/results]
    python bench/skinny_gemm.py --shapes llama8b --only o,down --rows 128,256 [--sweep]
    python bench/skinny_gemm.py --fused [--rows 1,16,32,64] [--unfused compiled|eager]

For each weight shape of a decode step (llama-8B: qkv, o, gate_up, down,
lm_head; the bench preset's too) and each row count: cuBLAS as a step runs
it (`F.linear`, or `torch.addmm(residual, x, w.t())` where the step adds a
residual: what Inductor emits, a memcpy of the residual and then the GEMM,
often with a split-K reduce), and the kernel with its default
meta-parameters (`skinny_config`), with the residual in its epilogue where
the step has one. `--sweep` also times every (BLOCK_N, BLOCK_K, num_warps,
num_stages) of a small grid and reports the best per shape; above 64 rows
(the 128-row tiles of Note [wide rows], docs/design.md) a grid of GEMM
tiles and splits instead (WIDE_SWEEP).

Timing: 12 calls captured in one CUDA graph, cycling through enough weight
copies that no call finds its weight in L2, median of do_bench's replays
(warm-up excluded) / 12. The floor: the bytes the call must move (weight,
x, output, residual) over the copy bandwidth measured in the same run.
Per preset and row count, a line through its shapes' times against their
floors gives the fixed cost per GEMV (issue #37: the intercept, beyond the
bytes). Writes skinny_gemm.md and skinny_gemm.json.

`--fused` times `mrv2::norm_linear` (compile_backend/kernels/norm_linear.py: RMSNorm in the
kernel's prologue, SiLU·mul in its epilogue) at llama-8B's shapes in bf16
against the unfused sequence a compiled model runs: "qkv" = RMSNorm, then
one F.linear over the packed [6144, 4096] q/k/v weight; "gate_up" = RMSNorm,
F.linear over the packed [28672, 4096] gate/up weight, silu(g) * u. The
unfused sequence goes through `torch.compile` (Inductor: one kernel for the
norm, cuBLAS for the GEMM, one for silu * mul), or with `--unfused eager` as
plain torch ops (a kernel per op); the fused op runs the kernel
(MRV2_SKINNY_GEMM=1). Same timing as above; the floor here is the weight's
bytes over the copy bandwidth. Writes norm_linear.md and norm_linear.json.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import copy_bandwidth, graph_ms, median_ms  # noqa: E402

from compile_backend.core.packed_weights import pack_siblings, packed_view  # noqa: E402
from compile_backend.kernels._device import sm_count  # noqa: E402
from compile_backend.kernels.norm_linear import norm_linear_ref  # noqa: E402
from compile_backend.kernels.rms_norm import rms_norm_ref  # noqa: E402
from compile_backend.kernels.skinny_linear import (  # noqa: E402
    MAX_ROWS, skinny_config, skinny_linear, skinny_pays)

BF16 = torch.bfloat16
L2_BYTES = 64 << 20  # more than the H200's 50 MB L2
CALLS = 12
# (name, N, K, residual): one decode step's linears.
SHAPES = {
    "llama8b": [("qkv", 6144, 4096, False), ("o", 4096, 4096, True),
                ("gate_up", 28672, 4096, False), ("down", 4096, 14336, True),
                ("lm_head", 128256, 4096, False)],
    "bench": [("qkv", 2560, 2048, False), ("o", 2048, 2048, True),
              ("gate_up", 11264, 2048, False), ("down", 2048, 5632, True),
              ("lm_head", 32000, 2048, False)],
}
SWEEP = {"BLOCK_N": [16, 32, 64], "BLOCK_K": [128, 256, 512], "num_warps": [4, 8],
         "num_stages": [3, 4]}
# --sweep above 64 rows: 128-row tiles (Note [wide rows] in compile_backend/kernels/skinny_linear.py).
WIDE_SWEEP = {"BLOCK_N": [64, 128, 256], "BLOCK_K": [32, 64], "num_warps": [8],
              "num_stages": [3, 4], "SPLIT_K": [1, 2, 4]}
# --split-sweep: split K (Note [split K] in compile_backend/kernels/skinny_linear.py) with
# wider column tiles (fewer re-reads of x at 64 rows).
SPLIT_SWEEP = {"BLOCK_N": [32, 64, 128], "BLOCK_K": [128, 256], "num_warps": [4],
               "num_stages": [4], "SPLIT_K": [1, 2, 4]}
# --fused: (name, the siblings' output features, gated) at llama-8B's hidden
# size; RMSNorm's eps as Llama-3 sets it.
FUSED = [("qkv", [4096, 1024, 1024], False), ("gate_up", [14336, 14336], True)]
FUSED_K = 4096
FUSED_EPS = 1e-5


def ms(fn) -> float:
    return median_ms(fn, warmup=25, rep=150)


def rotations(N, K) -> int:
    """Copies of a bf16 [N, K] weight that together pass L2 (1 to 4): timed
    calls rotate through them, so each reads its weight from HBM."""
    return max(1, min(4, -(-L2_BYTES // (N * K * 2))))


def operands(M, N, K, residual, g):
    copies = rotations(N, K)
    ws = [(torch.randn(N, K, generator=g, device="cuda") * K ** -0.5).to(BF16) for _ in range(copies)]
    x = torch.randn(M, K, generator=g, device="cuda").to(BF16)
    r = torch.randn(M, N, generator=g, device="cuda").to(BF16) if residual else None
    return ws, x, r


def check(out, ref, what, tol=1e-2):
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    if not err < tol:
        raise AssertionError(f"{what}: rel. error {err:.3g}")
    return err


def bench_shape(name, N, K, residual, M, bw, sweep, g):
    ws, x, r = operands(M, N, K, residual, g)
    ref = x.double() @ ws[0].double().T + (r.double() if residual else 0)
    nbytes = N * K * 2 + M * K * 2 + M * N * 2 * (2 if residual else 1)
    floor_us = nbytes / bw * 1e6
    if residual:
        cublas = [lambda w=w: torch.addmm(r, x, w.t()) for w in ws]
    else:
        cublas = [lambda w=w: torch.nn.functional.linear(x, w) for w in ws]
    check(cublas[0](), ref, f"{name} cuBLAS")
    row = {"shape": name, "N": N, "K": K, "M": M, "residual": residual, "floor_us": floor_us,
           "cublas_us": graph_ms(cublas, CALLS, ms) * 1e3}
    if residual:  # what eager runs for `r + linear(x)`: cuBLAS's plain GEMM, then the add
        mm_add = [lambda w=w: torch.mm(x, w.t()).add_(r) for w in ws]
        check(mm_add[0](), ref, f"{name} mm + add")
        row["cublas_mm_add_us"] = graph_ms(mm_add, CALLS, ms) * 1e3
    default = skinny_config(M, N, K, num_sms=sm_count(x.device))  # what the op runs
    configs = [default]
    if sweep:
        grid = SPLIT_SWEEP if sweep == "split" else WIDE_SWEEP if M > MAX_ROWS else SWEEP
        block_m = default["BLOCK_M"]
        configs += [c for c in (dict(zip(grid, v), BLOCK_M=block_m)
                                for v in itertools.product(*grid.values()))
                    if (block_m + c["BLOCK_N"]) * c["BLOCK_K"] * 2 * c["num_stages"] <= 200 * 1024]
    timings = []
    for cfg in configs:
        fns = [lambda w=w, c=cfg: skinny_linear(x, w, None, r, config=c) for w in ws]
        try:
            poisoned = torch.full((M, N), float("nan"), dtype=BF16, device="cuda")
            err = check(skinny_linear(x, ws[0], None, r, config=cfg, out=poisoned), ref, f"{name} {cfg}")
            t = graph_ms(fns, CALLS, ms) * 1e3
        except Exception as e:  # noqa: BLE001 (a config that does not compile or fit: listed)
            timings.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        timings.append({"config": cfg, "us": t, "rel_err": err})
    ok = [t for t in timings if "us" in t]
    row["skinny_us"] = ok[0]["us"] if ok and ok[0]["config"] is default else float("nan")
    row["rel_err"] = ok[0]["rel_err"] if ok else float("nan")
    best = min(ok, key=lambda t: t["us"]) if ok else None
    row["best_us"] = best["us"] if best else float("nan")
    row["best_config"] = best["config"] if best else None
    row["sweep"] = timings if sweep else []
    del ws, x, r
    torch.cuda.empty_cache()
    return row


def fmt(rows, bw) -> str:
    lines = [f"copy bandwidth {bw / 1e9:.0f} GB/s; times in µs per call (12 calls in one CUDA "
             "graph, weights rotated past L2, median); x floor = time / (bytes / copy bandwidth)",
             "",
             "| weights | N x K | rows | floor | cuBLAS | x floor | skinny | x floor | skinny / cuBLAS "
             "| best swept | best config |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        best = r["best_config"]
        cfg = "-" if not best or not r["sweep"] else (
            f"N{best['BLOCK_N']} K{best['BLOCK_K']} w{best['num_warps']} s{best['num_stages']}"
            + (f" split {best['SPLIT_K']}" if best.get("SPLIT_K", 1) > 1 else ""))
        lines.append(
            f"| {r['shape']}{' + residual' if r['residual'] else ''} | {r['N']} x {r['K']} | {r['M']} "
            f"| {r['floor_us']:.1f} | {r['cublas_us']:.1f} | {r['cublas_us'] / r['floor_us']:.2f} "
            f"| {r['skinny_us']:.1f} | {r['skinny_us'] / r['floor_us']:.2f} "
            f"| {r['skinny_us'] / r['cublas_us']:.2f} "
            f"| {r['best_us']:.1f} | {cfg} |")
    fits = fixed_cost_fits(rows)
    if fits:
        lines += ["", "Fixed cost per GEMV (issue #37): a least-squares line t = fixed + slope x floor "
                  "through one preset's shapes at one row count (qkv, o, gate_up, down, lm_head: "
                  "weights of 32 MB to 1 GB); fixed is what a call costs beyond its bytes (launch, "
                  "the first DRAM round trip, the last program's tail), 1 / slope the share of the "
                  "copy bandwidth the bytes then stream at.", "",
                  "| preset | rows | shapes | cuBLAS fixed µs | cuBLAS bandwidth share | skinny fixed µs "
                  "| skinny bandwidth share |", "|---|---:|---:|---:|---:|---:|---:|"]
        for f in fits:
            lines.append(f"| {f['preset']} | {f['M']} | {f['n']} | {f['cublas'][0]:.1f} "
                         f"| {1 / f['cublas'][1]:.2f} | {f['skinny'][0]:.1f} | {1 / f['skinny'][1]:.2f} |")
    added = [r for r in rows if "cublas_mm_add_us" in r]
    if added:
        lines += ["", "With a residual, cuBLAS two ways (µs): addmm (a copy of the residual into "
                  "the output, then the GEMM accumulating into it, as Inductor emits) and mm then "
                  "an in-place add (as eager runs it); the kernel adds it in its epilogue.", "",
                  "| weights | rows | addmm | mm + add | skinny |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['shape']} | {r['M']} | {r['cublas_us']:.1f} | {r['cublas_mm_add_us']:.1f} "
                  f"| {r['skinny_us']:.1f} |" for r in added]
    splits = [r for r in rows if any("SPLIT_K" in t["config"] for t in r["sweep"])]
    if splits:
        lines += ["", "Best per split (--split-sweep), µs:", "",
                  "| weights | rows | " + " | ".join(f"split {k}" for k in SPLIT_SWEEP["SPLIT_K"]) + " |",
                  "|---|---:|" + "---:|" * len(SPLIT_SWEEP["SPLIT_K"])]
        for r in splits:
            cells = []
            for k in SPLIT_SWEEP["SPLIT_K"]:
                ok = [t for t in r["sweep"] if "us" in t and t["config"].get("SPLIT_K", 1) == k]
                best = min(ok, key=lambda t: t["us"]) if ok else None
                cells.append(f"{best['us']:.1f} (N{best['config']['BLOCK_N']} K{best['config']['BLOCK_K']})"
                             if best else "-")
            lines.append(f"| {r['shape']} | {r['M']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys); needs
    two distinct xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise ValueError("line_fit: needs at least two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def fixed_cost_fits(rows: list[dict]) -> list[dict]:
    """Per (preset, row count) with three or more shapes timed: the line
    t = fixed + slope x floor (µs) for cuBLAS and for the kernel (its
    default config); a row's preset is the first word of its shape."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"].split()[0], r["M"]), []).append(r)
    fits = []
    for (preset, M), rs in groups.items():
        rs = [r for r in rs if r["skinny_us"] == r["skinny_us"]]  # NaN: the default did not run
        if len(rs) < 3:
            continue
        floors = [r["floor_us"] for r in rs]
        fits.append({"preset": preset, "M": M, "n": len(rs),
                     "cublas": line_fit(floors, [r["cublas_us"] for r in rs]),
                     "skinny": line_fit(floors, [r["skinny_us"] for r in rs])})
    return fits


def unfused_norm_linear(x, norm_weight, weight, gated: bool):
    """What a model runs without the fusion: RMSNorm, the packed linear, SiLU·mul."""
    y = torch.nn.functional.linear(rms_norm_ref(x, norm_weight, FUSED_EPS), weight)
    if gated:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y


def packed_groups(name, sizes, g, device="cuda"):
    """rotations() copies of the siblings (out features `sizes`, K = FUSED_K),
    each packed into one [sum sizes, K] weight."""
    N, K = sum(sizes), FUSED_K
    groups = []
    for _ in range(rotations(N, K)):
        ws = [(torch.randn(n, K, generator=g, device=device) * K ** -0.5).to(BF16) for n in sizes]
        if pack_siblings(ws) != "packed":
            raise AssertionError(f"{name}: the siblings did not pack")
        groups.append(ws)
    return groups


def bench_fused(name, sizes, gated, M, bw, unfused_mode, g, device="cuda"):
    """One row of the --fused table: unfused (compiled or eager) and
    `mrv2::norm_linear` with the kernel, weights rotated past L2."""
    N, K = sum(sizes), FUSED_K
    groups = packed_groups(name, sizes, g, device)
    x = torch.randn(M, K, generator=g, device=device).to(BF16)
    nw = (1.0 + 0.5 * torch.randn(K, generator=g, device=device)).to(BF16)
    if device == "cuda" and not skinny_pays(x, packed_view(groups[0]), gated, norm=True):
        raise AssertionError(f"{name} M={M}: the op would not run the kernel (MRV2_SKINNY_GEMM=1?)")
    ref = norm_linear_ref(x, nw, FUSED_EPS, groups[0], [], gated)
    torch._dynamo.reset()  # a fresh compile per (shape, rows): no recompile limit to reach
    step = torch.compile(unfused_norm_linear, dynamic=False) if unfused_mode == "compiled" \
        else unfused_norm_linear
    unfused = [lambda w=packed_view(ws): step(x, nw, w, gated) for ws in groups]
    fused = [lambda ws=ws: torch.ops.mrv2.norm_linear(x, nw, FUSED_EPS, ws, [], gated) for ws in groups]
    # bf16: the fused kernel rounds once where the reference rounds four or
    # five times (compile_backend/kernels/norm_linear.py, "Rounding")
    unfused_err = check(unfused[0](), ref, f"{name} M={M} unfused", tol=2e-2)
    fused_err = check(fused[0](), ref, f"{name} M={M} fused", tol=2e-2)
    row = {"shape": name, "N": N, "K": K, "M": M, "gated": gated, "unfused": unfused_mode,
           "floor_us": N * K * 2 / bw * 1e6, "unfused_rel_err": unfused_err, "fused_rel_err": fused_err,
           "unfused_us": time_us(unfused), "fused_us": time_us(fused)}
    del groups, x, nw
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def time_us(fns) -> float:
    return graph_ms(fns, CALLS, ms) * 1e3


def fmt_fused(rows, bw, unfused_mode) -> str:
    how = ("torch.compile (Inductor: the norm and silu * mul as its kernels, the GEMM cuBLAS)"
           if unfused_mode == "compiled" else "plain torch ops (eager: a kernel per op)")
    lines = [f"copy bandwidth {bw / 1e9:.0f} GB/s; times in µs per call ({CALLS} calls in one CUDA "
             "graph, weights rotated past L2, median); unfused = RMSNorm, the packed linear (and "
             f"silu(g) * u for gate_up) run as {how}; fused = mrv2::norm_linear (the skinny kernel, "
             "MRV2_SKINNY_GEMM=1); HBM floor = weight bytes / copy bandwidth",
             "",
             "| weights | N x K | rows | HBM floor | unfused | fused | fused / unfused | fused x floor |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['shape']}{' (gated)' if r['gated'] else ''} | {r['N']} x {r['K']} | {r['M']} "
            f"| {r['floor_us']:.1f} | {r['unfused_us']:.1f} | {r['fused_us']:.1f} "
            f"| {r['fused_us'] / r['unfused_us']:.2f} | {r['fused_us'] / r['floor_us']:.2f} |")
    return "\n".join(lines)


def run_fused(args, argv) -> int:
    os.environ["MRV2_SKINNY_GEMM"] = "1"  # the op runs the kernel at every row count timed
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth().median  # bytes/s: the median of the rounds
    rows = []
    for name, sizes, gated in FUSED:
        if args.only and name not in set(args.only.split(",")):
            continue
        for M in map(int, args.rows.split(",")):
            row = bench_fused(name, sizes, gated, M, bw, args.unfused, g)
            rows.append(row)
            print(f"{name} M={M}: floor {row['floor_us']:.1f} unfused {row['unfused_us']:.1f} "
                  f"fused {row['fused_us']:.1f}", flush=True)
    text = fmt_fused(rows, bw, args.unfused)
    write_results(args.out, "norm_linear",
                  "RMSNorm + linear (+ SiLU·mul): mrv2::norm_linear against the unfused sequence",
                  argv, text, {"copy_bandwidth": bw, "unfused": args.unfused, "rows": rows})
    print(text)
    return 0


def write_results(out, stem, title, argv, text, payload) -> None:
    """<out>/<stem>.md (title, date, GPU, torch, the command, `text`) and
    <out>/<stem>.json (`payload`)."""
    os.makedirs(out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"# {title}\n\n{stamp}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"command: `python bench/skinny_gemm.py "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n")
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(head + text + "\n")
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)


# --fused --sweep: splits of K too (the gated kernel does not split: those are skipped).
FUSED_SWEEP = {"BLOCK_N": [32, 64, 128], "BLOCK_K": [128, 256], "num_warps": [4, 8],
               "num_stages": [3, 4], "SPLIT_K": [1, 2]}


def run_fused_sweep(args) -> int:
    """--fused --sweep: the norm_linear kernel's meta-parameters (BLOCK_N is
    the gate's columns when gated), timed like the table, the best per row
    tile printed and written to norm_linear_sweep.json."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, sizes, gated in FUSED:
        if args.only and name not in set(args.only.split(",")):
            continue
        N, K = sum(sizes), FUSED_K
        groups = packed_groups(name, sizes, g)
        weights = [packed_view(ws) for ws in groups]
        nw = (1.0 + 0.5 * torch.randn(K, generator=g, device="cuda")).to(BF16)
        for M in map(int, args.rows.split(",")):
            x = torch.randn(M, K, generator=g, device="cuda").to(BF16)
            ref = norm_linear_ref(x, nw, FUSED_EPS, groups[0], [], gated)
            base = skinny_config(M, N, K, gated=gated, norm=True)
            timings = []
            for v in itertools.product(*FUSED_SWEEP.values()):
                cfg = dict(zip(FUSED_SWEEP, v), BLOCK_M=base["BLOCK_M"])
                if gated and cfg["SPLIT_K"] > 1:
                    continue
                fns = [lambda w=w, c=cfg: skinny_linear(x, w, None, norm_weight=nw, eps=FUSED_EPS,
                                                        gated=gated, config=c) for w in weights]
                try:
                    check(fns[0](), ref, f"{name} {cfg}", tol=2e-2)
                    t = graph_ms(fns, CALLS, ms) * 1e3
                except Exception as e:  # noqa: BLE001 (does not compile or fit: listed)
                    timings.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:100]}"})
                    continue
                timings.append({"config": cfg, "us": t})
            ok = sorted((t for t in timings if "us" in t), key=lambda t: t["us"])
            mine = [t["us"] for t in ok if all(t["config"].get(k, 1) == base.get(k, 1)
                                               for k in FUSED_SWEEP)]
            print(f"{name} M={M} default {base}: "
                  f"{f'{mine[0]:.1f}' if mine else 'not in the grid'}; best " + "; ".join(
                f"{t['us']:.1f} {t['config']}" for t in ok[:3]), flush=True)
            out.append({"shape": name, "M": M, "gated": gated, "timings": timings})
        del groups, weights
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "norm_linear_sweep.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama8b,bench")
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--sweep", action="store_const", const="tiles", default="",
                    help="also time a grid of meta-parameters")
    ap.add_argument("--split-sweep", dest="sweep", action="store_const", const="split",
                    help="also time split K (1, 2, 4) with 32-128 column tiles")
    ap.add_argument("--only", default="", help="comma-separated weight names (qkv,o,...)")
    ap.add_argument("--fused", action="store_true",
                    help="time mrv2::norm_linear (RMSNorm + qkv, RMSNorm + gate_up + SiLU·mul) "
                         "against the unfused sequence at llama-8B's shapes")
    ap.add_argument("--unfused", choices=["compiled", "eager"], default="compiled",
                    help="--fused: run the unfused sequence through torch.compile or as eager ops")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the kernel's CPU tests: tests/kernels/test_skinny_linear.py"
                 + (" and tests/kernels/test_norm_linear.py)" if args.fused else ")"))
    if args.fused:
        return run_fused_sweep(args) if args.sweep else run_fused(args, argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth().median  # bytes/s: the median of the rounds
    rows = []
    only = set(filter(None, args.only.split(",")))
    for preset in args.shapes.split(","):
        for name, N, K, residual in SHAPES[preset]:
            if only and name not in only:
                continue
            for M in map(int, args.rows.split(",")):
                row = bench_shape(f"{preset} {name}", N, K, residual, M, bw, args.sweep, g)
                rows.append(row)
                print(f"{row['shape']} M={M}: floor {row['floor_us']:.1f} cuBLAS {row['cublas_us']:.1f} "
                      f"skinny {row['skinny_us']:.1f} best {row['best_us']:.1f} {row['best_config']}",
                      flush=True)
    text = fmt(rows, bw)
    write_results(args.out, "skinny_gemm", "Decode linears: skinny kernel against cuBLAS", argv, text,
                  {"copy_bandwidth": bw, "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
