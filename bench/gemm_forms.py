"""cuBLAS at 64-256 rows asked five ways, in CUDA graphs (issue #37 item 4).

    python bench/gemm_forms.py [--rows 64,128,256] [--only o,down] [--inductor] [--out DIR]
    python bench/gemm_forms.py --dry-run          (CPU, fp32, small shapes: the plumbing)

cuBLAS picks its kernel from the problem as asked; at b256 the step's GEMMs
ran 1.3-1.6x their floors. Per llama-8B decode weight (a residual where the
step adds one): `torch` = F.linear(x, w) (.add_(r)), what the ops run today;
`lt` = the same with torch's cuBLASLt path preferred; `bias0` = the same
with a zero bias of [N] (torch's addmm with a 1-D bias asks cuBLASLt with a
bias epilogue: the Lt path per call, without the global switch); `wT` = y^T = w @ x^T,
added to r read strided (without a residual: the product alone, and
`wT+copy` with a transposing copy); `split` = two half-row GEMMs;
`inductor` (with --inductor) = Inductor's max-autotune of the same
(its Triton templates, the persistent TMA one on, against cuBLAS; the add
in the template's epilogue), with the kernel it chose named. Timing as
bench/skinny_gemm.py (12 calls in one graph, weights rotated past L2, median
replay / 12); floor = max(bytes / copy bandwidth, FLOPs / bf16 GEMM peak),
both measured in the run. Writes gemm_forms.md and gemm_forms.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import copy_bandwidth, graph_ms, median_ms  # noqa: E402

# (name, N, K, residual): llama-8B's decode linears (packed q/k/v and gate/up).
SHAPES = [("qkv", 6144, 4096, False), ("o", 4096, 4096, True), ("gate_up", 28672, 4096, False),
          ("down", 4096, 14336, True), ("lm_head", 128256, 4096, False)]
DRY_SHAPES = [("qkv", 96, 64, False), ("o", 64, 64, True)]
L2_BYTES = 64 << 20  # more than the H200's 50 MB L2
CALLS = 12


@contextlib.contextmanager
def blas(name: str | None):
    """torch's preferred BLAS path for the block (None: leave it)."""
    if name is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def linear_then_add(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """What the step's ops compute: x @ w^T, plus the residual where one is given."""
    y = F.linear(x, w)
    return y if r is None else y + r


def autotuned(mode: str):
    """linear_then_add under Inductor (`mode`), shapes static."""
    return torch.compile(linear_then_add, mode=mode, dynamic=False)


def inductor_options() -> dict:
    """Inductor settings for the `inductor` form: the persistent TMA matmul
    template among the candidates where this torch has it."""
    from torch._inductor import config

    return {"triton.enable_persistent_tma_matmul": True} \
        if hasattr(config.triton, "enable_persistent_tma_matmul") else {}


def chosen_kernel(code: str) -> str:
    """What Inductor's code for the product calls: `extern <op>` (torch's
    library call: cuBLAS on CUDA) or a Triton template."""
    names = sorted({w.split("(")[0].split(".")[0] for w in code.split() if w.startswith("triton_tem")})
    if names:
        return "Triton template " + ",".join(names) + (" (TMA)" if "tma" in code.lower() else "")
    if "extern_kernels." in code:
        return "extern " + code.split("extern_kernels.", 1)[1].split("(", 1)[0]
    return "other"


def forms(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None, compiled=None) -> dict:
    """name -> (call, preferred BLAS). Each call returns the [M, N] result,
    except `wT` without a residual ([N, M], the product alone). `compiled`:
    linear_then_add under Inductor, the `inductor` form."""
    M = x.shape[0]

    def linear_form(bias: torch.Tensor | None):
        def form():
            y = F.linear(x, w, bias)
            return y.add_(r) if r is not None else y
        return form

    torch_form = linear_form(None)
    # + 0.0 changes no value; the kernel cuBLASLt picks may sum K in another order
    bias0_form = linear_form(torch.zeros(w.shape[0], dtype=x.dtype, device=x.device))

    def wt_form():
        yt = torch.mm(w, x.t())  # [N, M]
        if r is None:
            return yt
        return torch.add(r, yt.t(), out=torch.empty_like(r))

    def wt_copy():
        return torch.mm(w, x.t()).t().contiguous()

    def split_form():
        out = torch.empty((M, w.shape[0]), dtype=x.dtype, device=x.device)
        h = M // 2
        torch.mm(x[:h], w.t(), out=out[:h])
        torch.mm(x[h:], w.t(), out=out[h:])
        return out.add_(r) if r is not None else out

    lt = None if not x.is_cuda else "cublaslt"
    out = {"torch": (torch_form, None), "lt": (torch_form, lt), "bias0": (bias0_form, None),
           "wT": (wt_form, None)}
    if r is None:
        out["wT+copy"] = (wt_copy, None)
    out["split"] = (split_form, None)
    if compiled is not None:
        out["inductor"] = (lambda: compiled(x, w, r), None)
    return out


def check(out: torch.Tensor, ref: torch.Tensor, what: str, tol: float) -> float:
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    if not err < tol:
        raise AssertionError(f"{what}: relative error {err:.3g} (tolerance {tol})")
    return err


def cpu_ms(fns: list, calls: int) -> float:
    """Off CUDA (the dry run): one pass of `calls` calls, ms per call."""
    t0 = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    return (time.perf_counter() - t0) * 1e3 / calls


def bench_shape(name, N, K, residual, M, device, dtype, g, inductor: str | None = None) -> dict:
    copies = max(1, min(4, -(-L2_BYTES // (N * K * 2)))) if device == "cuda" else 1
    ws = [(torch.randn(N, K, generator=g, device=device) * K ** -0.5).to(dtype)
          for _ in range(copies)]
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    r = torch.randn(M, N, generator=g, device=device).to(dtype) if residual else None
    ref = x.double() @ ws[0].double().T + (r.double() if residual else 0)
    tol = 1e-2 if dtype != torch.float32 else 1e-5
    row = {"shape": name, "N": N, "K": K, "M": M, "residual": residual, "us": {}, "rel_err": {}}
    compiled = None
    if inductor is not None:
        from torch._inductor import config
        from torch._inductor.utils import run_and_get_code

        torch._dynamo.reset()
        compiled = autotuned(inductor)
        with config.patch(inductor_options()):
            _, codes = run_and_get_code(compiled, x, ws[0], r)  # compiles and autotunes
        row["inductor_kernel"] = chosen_kernel("\n".join(codes))
    per_weight = [forms(x, w, r, compiled) for w in ws]  # the same forms over each weight copy
    for form, (_, preferred) in per_weight[0].items():
        fns = [f[form][0] for f in per_weight]
        with blas(preferred):
            y = fns[0]()
            y = y.t() if form == "wT" and r is None else y
            row["rel_err"][form] = check(y, ref, f"{name} M={M} {form}", tol)
            if device == "cuda":
                t = graph_ms(fns, CALLS, lambda f: median_ms(f, warmup=25, rep=150))
            else:
                t = cpu_ms(fns, CALLS)
        row["us"][form] = t * 1e3
    row["bytes"] = N * K * 2 + M * K * 2 + M * N * 2 * (3 if residual else 1)
    row["flops"] = 2 * M * N * K
    return row


def fmt(rows: list[dict], bw: float, peak: float | None, header: str) -> str:
    names = list(dict.fromkeys(f for r in rows for f in r["us"]))
    lines = [header, "", "| weight | rows | floor µs | " + " | ".join(names)
             + " | best / torch |", "|---|---:|---:|" + "---:|" * (len(names) + 1)]
    for r in rows:
        floor = max(r["bytes"] / bw, r["flops"] / peak if peak else 0.0) * 1e6
        cells = [f"{r['us'][n]:.1f}" if n in r["us"] else "" for n in names]
        best = min(r["us"], key=r["us"].get)
        lines.append(f"| {r['shape']} | {r['M']} | {floor:.1f} | " + " | ".join(cells)
                     + f" | {best} {r['us'][best] / r['us']['torch']:.2f} |")
    chosen = [f"- {r['shape']} at {r['M']} rows: {r['inductor_kernel']}"
              for r in rows if "inductor_kernel" in r]
    if chosen:
        lines += ["", "Inductor's choice per product:", *chosen]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64,128,256")
    p.add_argument("--only", default="", help="weights by name, comma-separated (default: all)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results"))
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, small shapes")
    p.add_argument("--inductor", nargs="?", const="max-autotune-no-cudagraphs", default=None,
                   metavar="MODE", help="add Inductor's form, compiled in MODE "
                   "(default max-autotune-no-cudagraphs)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("needs a CUDA device; --dry-run runs the plumbing on the CPU")
    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    only = {s for s in args.only.split(",") if s}
    unknown = only - {s[0] for s in shapes}
    if unknown:
        p.error(f"--only: unknown weights {sorted(unknown)}; known: {[s[0] for s in shapes]}")
    g = torch.Generator(device=device).manual_seed(0)
    if args.dry_run:
        bw, peak, gpu = 1e11, None, "cpu (dry run: the times mean nothing)"
    else:
        from roofline import gemm_peak_flops

        bw, peak = copy_bandwidth().median, gemm_peak_flops(device)
        gpu = torch.cuda.get_device_name()
    header = (f"# cuBLAS forms ({gpu}, torch {torch.__version__}, "
              f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')})\n\n"
              f"Command: `python bench/gemm_forms.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
              f"copy bandwidth {bw / 1e9:.0f} GB/s"
              + (f", bf16 GEMM peak {peak / 1e12:.0f} TFLOP/s" if peak else "")
              + "; µs per call, 12 calls in one CUDA graph (median replay / 12).")
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    for n, N, K, res in shapes:
        for M in (int(m) for m in args.rows.split(",")):
            if only and n not in only:
                continue
            rows.append(bench_shape(n, N, K, res, M, device, dtype, g, args.inductor))
            text = fmt(rows, bw, peak, header)  # written after every row: a cut run keeps them
            with open(os.path.join(args.out, "gemm_forms.md"), "w") as f:
                f.write(text)
            with open(os.path.join(args.out, "gemm_forms.json"), "w") as f:
                json.dump({"bandwidth": bw, "peak_flops": peak, "rows": rows}, f, indent=1)
    print(fmt(rows, bw, peak, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
