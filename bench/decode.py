"""Decode-step benchmark on one GPU: mrv2's graph modes against eager and Inductor.

    python bench/decode.py [--model llama|hybrid|both] [--batches 1,8,32,64,128,256]
                           [--context 500] [--out bench/results]

Per cell: median step time over CUDA events (warm-up excluded; a step is the
runner's whole `execute`: host-side buffer writes, metadata, replay or
launches), its ratio to the HBM floor (weight bytes + KV bytes read, over the
device-to-device copy bandwidth measured in this run), and whether the logits
match eager (relative error < 2e-2, bf16). Startup: compile time and capture
time per variant, pool memory after all captures.

Variants: eager (no compile), inductor (torch.compile default, no graphs),
mrv2 none / piecewise / full / full_and_piecewise (Inductor pieces). Inductor's
reduce-overhead modes are not measured here (see the results' notes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compile_backend as cb  # noqa: E402
from compile_backend.input_batch import InputBatch  # noqa: E402
from compile_backend.kv_cache_config import KVCacheConfig  # noqa: E402
from compile_backend.model_runner import ModelRunner  # noqa: E402
from compile_backend.models import build_model, preset  # noqa: E402

VARIANTS = {
    "eager": dict(backend=False, mode="none"),
    "inductor": dict(backend="inductor", mode="none"),
    "mrv2-none": dict(backend=None, mode="none"),
    "mrv2-piecewise": dict(backend=None, mode="piecewise"),
    "mrv2-full": dict(backend=None, mode="full"),
    "mrv2-full_and_piecewise": dict(backend=None, mode="full_and_piecewise"),
}


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n / statistics.median(times)


def decode_batch(batch: int, context: int, kv: KVCacheConfig, seed: int = 0) -> InputBatch:
    """`batch` requests each decoding one token after `context` cached tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = math.ceil((context + 1) / kv.block_size)
    cblocks = math.ceil(math.ceil((context + 1) / kv.compress_ratio) / kv.block_size)
    return InputBatch(
        token_ids=torch.randint(0, 32000, (batch,), generator=g).tolist(),
        query_lens=[1] * batch, seq_lens=[context + 1] * batch, req_slots=list(range(batch)),
        block_ids=[[1 + r * blocks_per_req + i for i in range(blocks_per_req)] for r in range(batch)],
        compressed_block_ids=[[1 + r * cblocks + i for i in range(cblocks)] for r in range(batch)],
    )


def floor_bytes(model: torch.nn.Module, batch: int, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.cfg
    kv = 2 * cfg.num_layers * batch * (context + 1) * cfg.num_kv_heads * cfg.head_dim * 2
    return weights + kv


@torch.no_grad()
def run_variant(name, model_name, batches, context, capture_sizes):
    spec = VARIANTS[name]
    torch._dynamo.reset()
    cb.reset_counters()
    torch.manual_seed(0)
    model = build_model(model_name, preset("bench", dtype=torch.bfloat16)).cuda()
    max_b = max(batches)
    blocks = max_b * (math.ceil((context + 1) / 16) + 2) + 2
    kv = KVCacheConfig(num_blocks=blocks, block_size=16, max_model_len=context + 64,
                       max_num_reqs=max_b, max_num_tokens=max(capture_sizes))
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    for buf in model.buffers():  # random cache contents: never time zeros
        if buf.dtype.is_floating_point and buf.dim() >= 2:
            buf.normal_(generator=g)
    cfg = cb.CompilationConfig(cudagraph_mode=spec["mode"], capture_sizes=capture_sizes)
    runner = ModelRunner(model, kv, cfg, "cuda", progress=False, backend=spec["backend"])
    t0 = time.perf_counter()
    runner._warmup(max(capture_sizes), None)  # compiles
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    runner.capture()
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    pool = torch.cuda.memory_allocated() - mem0
    results = {}
    for b in batches:
        batch = decode_batch(b, context, kv)
        # First step: the output compared with eager (fresh state in every variant).
        out = runner.execute(decode_batch(b, context, kv)).float()
        for _ in range(5):
            runner.execute(decode_batch(b, context, kv))
        times = []
        for _ in range(30):
            batch = decode_batch(b, context, kv)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); runner.execute(batch); e.record(); torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        results[b] = {"ms": statistics.median(times), "out": out.cpu(),
                      "floor_bytes": floor_bytes(model, b, context),
                      "mode": runner.dispatch(decode_batch(b, context, kv))[0].value}
    info = {"compile_s": compile_s, "capture_s": capture_s, "pool_bytes": pool,
            "graphs": cb.counters["cudagraph_captures"], "pieces": cb.counters["pieces"],
            "replay_input_copies": cb.counters["replay_input_copies"]}
    del runner, model
    torch.cuda.empty_cache()
    return results, info


def write_results(args, argv, bw, rows, startup) -> str:
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "python": platform.python_version(),
            "command": " ".join(["python", "bench/decode.py"] + (argv or sys.argv[1:])),
            "copy_bandwidth_GBps": bw / 1e9, "context": args.context}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "startup": startup}, f, indent=1)
    lines = [f"# Decode benchmark ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']})", "", f"Command: `{meta['command']}`; copy bandwidth "
             f"{bw / 1e9:.0f} GB/s; {args.context} cached tokens per request; bf16.", "",
             "| model | variant | batch | step ms | floor ms | x floor | rel err vs eager | ran as |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        err = "-" if r["rel_err_vs_eager"] is None else f"{r['rel_err_vs_eager']:.1e}"
        lines.append(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['x_floor']:.2f} | {err} | {r['dispatched']} |")
    lines += ["", "| model | variant | compile s | capture s (all sizes) | graphs | pieces | "
              "pool MiB | input copies |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in startup:
        lines.append(f"| {s['model']} | {s['variant']} | {s['compile_s']:.1f} | {s['capture_s']:.2f} | "
                     f"{s['graphs']} | {s['pieces']} | {s['pool_bytes'] / 2**20:.0f} | "
                     f"{s['replay_input_copies']} |")
    with open(os.path.join(args.out, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama", "hybrid", "both"], default="both")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    capture_sizes = [s for s in [1, 2, 4] + list(range(8, 257, 8)) if s <= max(batches)]
    bw = copy_bandwidth()
    models = ["llama", "hybrid"] if args.model == "both" else [args.model]
    rows, startup = [], []
    for model_name in models:
        ref = None
        for name in args.variants.split(","):
            res, info = run_variant(name, model_name, batches, args.context, capture_sizes)
            if name == "eager":
                ref = res
            startup.append({"model": model_name, "variant": name, **info})
            for b, r in res.items():
                err = None
                if ref is not None:
                    err = float((r["out"] - ref[b]["out"]).norm() / ref[b]["out"].norm())
                floor_ms = r["floor_bytes"] / bw * 1e3
                rows.append({"model": model_name, "variant": name, "batch": b,
                             "ms": r["ms"], "floor_ms": floor_ms, "x_floor": r["ms"] / floor_ms,
                             "rel_err_vs_eager": err, "match": err is not None and err < 2e-2,
                             "dispatched": r["mode"]})
            print(f"done {model_name} {name}: {info}", flush=True)
            write_results(args, argv, bw, rows, startup)  # partial results survive a timeout
    print(write_results(args, argv, bw, rows, startup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
