"""Host cost of what a PIECEWISE decode step does between graph replays.

    python bench/host_overhead.py [--batch 1] [--context 500] [--calls 2000]
    python bench/host_overhead.py --prepare [--batches 1,64,256]   (any device)

Each line: microseconds of host time per call (perf_counter over `--calls`
calls, device work left queued; the device work of each call is a few
microseconds, so the host is what is timed), median of 5 rounds. Shapes are the
bench preset's attention (32 heads, 4 KV heads, head dim 64, bf16).

--prepare times `ModelRunner.prepare_step` instead (pad a decode batch, write
the persistent buffers and block tables, build metadata): the host work in
front of every FULL replay. It runs on the CPU too (what it times is Python).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def per_call_us(fn, calls: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rounds = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(rounds)


def prepare_rows(batches: list[int], context: int, calls: int) -> list[tuple[str, float]]:
    """Host us of ModelRunner.prepare_step for decode batches (hybrid model's
    three metadata groups, block size 16, max_model_len = context + 64)."""
    import bench.decode as decode  # the benchmark's batch builder
    from compile_backend.core.config import CompilationConfig
    from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph
    from compile_backend.runner.kv_cache_config import KVCacheConfig
    from compile_backend.runner.model_runner import ModelRunner
    from compile_backend.demo.models import build_model, preset

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for B in batches:
        blocks = B * (math.ceil((context + 1) / 16) + 2) + 2
        kv = KVCacheConfig(num_blocks=blocks, block_size=16, max_model_len=context + 64,
                           max_num_reqs=max(batches), max_num_tokens=max(batches))
        model = build_model("hybrid", preset("tiny", num_layers=1))
        runner = ModelRunner(model, kv, CompilationConfig(cudagraph_mode="none"), dev,
                             progress=False, compile_fn=lambda m: m)
        batch = decode.decode_batch(B, context, kv, model.cfg.vocab_size)
        step = StepGraph(CUDAGraphMode.FULL, B, B, uniform_decode=True)
        rows.append((f"prepare_step, decode batch {B} ({dev})", per_call_us(
            lambda: runner.prepare_step(batch, step), calls)))
    return rows


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--prepare", action="store_true", help="time prepare_step (any device)")
    ap.add_argument("--batches", default="1,64,256", help="decode batches for --prepare")
    args = ap.parse_args(argv)
    if args.prepare:
        rows = prepare_rows([int(b) for b in args.batches.split(",")], args.context,
                            max(1, args.calls // 10))
        print("| call | host us |\n|---|---:|")
        for name, us in rows:
            print(f"| {name} | {us:.1f} |")
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (or --prepare)")
    from compile_backend.runner.attention_metadata import AttentionMetadata
    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_impl
    from kernels.unified_attention import unified_attention, unified_attention_impl

    dev, dt = "cuda", torch.bfloat16
    B, H, KVH, D, bs = args.batch, 32, 4, 64, 16
    blocks = math.ceil((args.context + 1) / bs)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(B, KVH, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(B, KVH, D, device=dev, dtype=dt, generator=g)
    kc = torch.randn(B * blocks + 1, bs, KVH, D, device=dev, dtype=dt, generator=g)
    vc = torch.randn_like(kc)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, device=dev, dtype=torch.int32),
        seq_lens=torch.full((B,), args.context + 1, device=dev, dtype=torch.int32),
        block_table=(1 + torch.arange(B * blocks, device=dev, dtype=torch.int32)).view(B, blocks),
        slot_mapping=torch.arange(B, device=dev, dtype=torch.int64) * bs + bs,
        num_reqs=B, max_query_len=1, max_seq_len=args.context + 1, for_capture=False)
    ctx = ForwardContext(attn_metadata={"layer": meta})
    scale = D ** -0.5
    graph, x = torch.cuda.CUDAGraph(), torch.randn(B, 2048, device=dev, dtype=dt)
    with torch.cuda.graph(graph):
        x.mul_(1.0)
    rows = []
    with set_forward_context(ctx):
        cases = {
            "graph.replay (one kernel)": graph.replay,
            "torch.ops.mrv2.unified_attention (dispatcher)":
                lambda: torch.ops.mrv2.unified_attention(q, kc, vc, "layer", scale),
            "unified_attention_impl (direct)": lambda: unified_attention_impl(q, kc, vc, "layer", scale),
            "unified_attention launcher (checks + 2 launches)": lambda: unified_attention(
                q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table, scale, 1,
                args.context + 1),
            "torch.ops.mrv2.reshape_and_cache (dispatcher)":
                lambda: torch.ops.mrv2.reshape_and_cache(k, v, kc, vc, "layer"),
            "reshape_and_cache_impl (direct)": lambda: reshape_and_cache_impl(k, v, kc, vc, "layer"),
            "reshape_and_cache launcher (checks + 1 launch)":
                lambda: reshape_and_cache(k, v, kc, vc, meta.slot_mapping),
            "torch.zeros_like(q)": lambda: torch.zeros_like(q),
            "torch.empty(scratch)": lambda: torch.empty(B * H * 8 * (D + 2), device=dev),
            "dst.copy_(src) (device to device)": lambda: x.copy_(x),
        }
        for name, fn in cases.items():
            for _ in range(50):
                fn()
            rows.append((name, per_call_us(fn, args.calls)))
    print(f"host us per call (batch {B}, context {args.context}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__})")
    print("| call | host us |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
