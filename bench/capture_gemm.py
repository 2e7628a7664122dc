"""Host time of cuBLAS GEMMs recorded into CUDA graphs (issue #36: a warm
PIECEWISE capture spent ~0.74 s of its 1.0 s record inside torch.mm, addmm
and linear, 150-250 us a call, against ~10 us for the same call outside a
capture).

    python bench/capture_gemm.py [--out bench/results/capture_gemm.md]

Each variant is a fresh process. It builds llama8b's four projection shapes
(bf16; qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down
14336->4096), runs one eager "first step" at the largest size, then
captures one graph per size (35 sizes, largest first), each recording 32
layers of: mm(x, Wqkv^T), addmm(r, a, Wo^T), linear(x, Wgu), addmm(r, h,
Wd^T). Per call, host microseconds around the call: the first layer's calls
(a size's first use of each shape) apart from the other 31 layers'.
  plain       as above;
  warmed      every size's four GEMMs run once outside any capture first
              (timed apart: the cost moved, not removed);
  background  that warm-up on a side stream in a second thread while the
              main thread spins in Python (as a load would), joined before
              the captures;
  script      that warm-up as a warm start makes it (runtime/gemm_warmup.py):
              the first step's GEMMs recorded, then run at every size in one
              TorchScript call on a thread while the main thread spins in
              Python; "main-thread Python" is the spin rate meanwhile against
              its rate alone (1.00: not slowed);
  threads     that warm-up split over 8 threads (own streams), the main
              thread waiting: do cuBLAS's first calls run in parallel, and
              does the main thread's capture profit from them?
  eager_load  plain, with CUDA_MODULE_LOADING=EAGER (is the first-use cost
              the lazy load of cuBLAS's kernels?).
  layer       a decode layer's launches as the FULL graphs' unfused form has
              them above 16 rows (no attention): mrv2's RMSNorm kernel, qkv
              mm, o addmm onto the residual, RMSNorm, gate_up linear, mrv2's
              SiLU*mul, down addmm onto the residual, each reading the
              last's output; cuBLAS's calls timed as above (does cuBLAS cost
              more between our Triton launches than alone?);
  layer_nopdl the same with MRV2_PDL=0 (is it their programmatic launches?).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

PREFIX = "CAPTURE_GEMM_JSON "
SIZES = [1, 2, 4] + list(range(8, 257, 8))
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(36)
    return {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16, generator=g) / kk ** 0.5
            for k, (n, kk) in SHAPES.items()}


def _inputs(m: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1000 + m)
    return {"x": torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=g),
            "h": torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16, generator=g)}


def _layer(w: dict, t: dict, times: list | None) -> None:
    """One layer's four GEMMs; `times`: host seconds per call appended."""
    x, h = t["x"], t["h"]
    calls = (lambda: torch.mm(x, w["qkv"].t()),
             lambda: torch.addmm(x, x, w["o"].t()),
             lambda: torch.nn.functional.linear(x, w["gate_up"]),
             lambda: torch.addmm(x, h, w["down"].t()))
    for c in calls:
        t0 = time.perf_counter()
        c()
        if times is not None:
            times.append(time.perf_counter() - t0)


def _layer_with_kernels(w: dict, t: dict, times: list | None) -> None:
    """One layer as the unfused FULL graph runs it (variant `layer`): mrv2's
    norm and gate kernels between cuBLAS's GEMMs, each reading the last's
    output; `times`: host seconds of the four GEMM calls."""
    from compile_backend.kernels.rms_norm import rms_norm
    from compile_backend.kernels.silu_mul import silu_mul

    def timed(call):
        t0 = time.perf_counter()
        out = call()
        if times is not None:
            times.append(time.perf_counter() - t0)
        return out

    x, norm = t["x"], w["norm"]
    h = rms_norm(x, norm, 1e-5)
    qkv = timed(lambda: torch.mm(h, w["qkv"].t()))
    r = timed(lambda: torch.addmm(x, qkv[:, :4096], w["o"].t()))
    h = rms_norm(r, norm, 1e-5)
    gu = timed(lambda: torch.nn.functional.linear(h, w["gate_up"]))
    act = silu_mul(gu)
    timed(lambda: torch.addmm(r, act, w["down"].t()))


def _warm_all(w: dict, inputs: dict, stream: torch.cuda.Stream | None = None) -> float:
    t0 = time.perf_counter()
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        for m in sorted(SIZES, reverse=True):
            _layer(w, inputs[m], None)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _spin_rate(seconds: float = 0.2) -> float:
    """The main thread's Python work per second, alone (the spin loop below)."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sum(i * i for i in range(2000))
        n += 1
    return n / (time.perf_counter() - t0)


def child(variant: str) -> dict:
    torch.cuda.init()
    w = _weights()
    w["norm"] = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    layer = _layer_with_kernels if variant == "layer" else _layer
    if variant == "layer":
        layer(w, _inputs(1), None)  # the Triton kernels compiled (specialised alike at every size)
        layer(w, _inputs(64), None)
    inputs = {m: _inputs(m) for m in SIZES}
    layer(w, inputs[SIZES[-1]], None)  # the first step, at the largest size
    torch.cuda.synchronize()
    warm_s = 0.0
    spun = 0
    extra: dict = {}
    if variant == "warmed":
        warm_s = _warm_all(w, inputs)
    elif variant == "background":
        side = torch.cuda.Stream()
        done = threading.Event()

        def run():
            _warm_all(w, inputs, side)
            done.set()

        solo_rate = _spin_rate()
        t0 = time.perf_counter()
        th = threading.Thread(target=run)
        th.start()
        while not done.is_set():  # Python work on the main thread meanwhile
            sum(i * i for i in range(2000))
            spun += 1
        th.join()
        warm_s = time.perf_counter() - t0
        extra = {"main_python": spun / max(warm_s, 1e-9) / solo_rate}
    elif variant == "script":
        from compile_backend.runtime import gemm_warmup

        problems = gemm_warmup.record(lambda: _layer(w, inputs[SIZES[-1]], None), SIZES[-1])
        gemm_warmup._script()  # made once a process, as a runner's first warm start does
        solo_rate = _spin_rate()
        t0 = time.perf_counter()
        run = gemm_warmup.start(problems, SIZES, list(w.values()), "cuda")
        while run._thread is not None and run._thread.is_alive():
            sum(i * i for i in range(2000))
            spun += 1
        run.join()
        warm_s = time.perf_counter() - t0
        extra = {"problems": len(problems), "calls": run.calls, "thread_s": run.seconds,
                 "error": run.stats()["gemm_warmup_error"],
                 "main_python": spun / max(warm_s, 1e-9) / solo_rate}
    elif variant == "threads":
        # Eight threads, each its own stream and sizes; the main thread waits.
        sizes = sorted(SIZES, reverse=True)
        t0 = time.perf_counter()

        def part(k):
            with torch.cuda.stream(torch.cuda.Stream()):
                for m in sizes[k::8]:
                    _layer(w, inputs[m], None)
            torch.cuda.current_stream().synchronize()

        ths = [threading.Thread(target=part, args=(k,)) for k in range(8)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    graphs, first, rest = [], [], []
    t0 = time.perf_counter()
    for m in sorted(SIZES, reverse=True):
        g = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            g.capture_begin(pool=pool)
            for i in range(LAYERS):
                layer(w, inputs[m], first if i == 0 else rest)
            g.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        graphs.append(g)
    capture_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    us = lambda v: [round(1e6 * s, 1) for s in v]  # noqa: E731
    return {"variant": variant, "warm_s": warm_s, "capture_s": capture_s, "spins": spun,
            "first_us": us(first), "rest_us": us(rest), **extra,
            "module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)"),
            "torch": torch.__version__, "device": torch.cuda.get_device_name()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None)
    ap.add_argument("--variants", default="plain,warmed,background,script,threads,eager_load")
    ap.add_argument("--out", default="bench/results/capture_gemm.md")
    args = ap.parse_args()
    if args.child:
        print(PREFIX + json.dumps(child(args.child)), flush=True)
        return
    rows = []
    for v in args.variants.split(","):
        env = dict(os.environ)
        if v == "eager_load":
            env["CUDA_MODULE_LOADING"] = "EAGER"
        if v == "layer_nopdl":
            env["MRV2_PDL"] = "0"
        kid = {"eager_load": "plain", "layer_nopdl": "layer"}.get(v, v)
        p = subprocess.run([sys.executable, __file__, "--child", kid], env=env,
                           capture_output=True, text=True, timeout=600)
        line = next((x for x in p.stdout.splitlines() if x.startswith(PREFIX)), None)
        if line is None:
            print(f"{v}: failed\n{p.stderr[-3000:]}", file=sys.stderr)
            continue
        row = json.loads(line[len(PREFIX):])
        row["variant"] = v
        rows.append(row)
    head = ("| variant | warm-up s | capture s (35 graphs x 32 layers x 4 GEMMs) | first-layer call us: "
            "median / max / sum ms | other layers' call us: median / p99 / sum ms | main-thread Python |")
    lines = [f"# cuBLAS GEMMs recorded into CUDA graphs ({rows[0]['device'] if rows else '?'}, "
             f"torch {rows[0]['torch'] if rows else '?'})", "",
             "Command: `python bench/capture_gemm.py`; one fresh process per variant "
             "(the module docstring says what each does).", "", head,
             "|---|---:|---:|---|---|---:|"]
    for r in rows:
        f, o = r["first_us"], r["rest_us"]
        p99 = sorted(o)[int(0.99 * (len(o) - 1))] if o else 0
        main = f"{r['main_python']:.2f}" if "main_python" in r else "-"
        lines.append(f"| {r['variant']} | {r['warm_s']:.2f} | {r['capture_s']:.2f} | "
                     f"{statistics.median(f):.0f} / {max(f):.0f} / {sum(f) / 1e3:.0f} | "
                     f"{statistics.median(o):.0f} / {p99:.0f} / {sum(o) / 1e3:.0f} | {main} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
