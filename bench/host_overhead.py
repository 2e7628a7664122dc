"""Host cost of what a PIECEWISE decode step does between graph replays.

    python bench/host_overhead.py [--batch 1] [--context 500] [--calls 2000]
        [--batches 1,64,256] [--prefill 4] [--out bench/results/host_overhead.md]
    python bench/host_overhead.py --prepare [--batches 1,64,256]   (any device)
    python bench/host_overhead.py --dispatch                       (any device)
    python bench/host_overhead.py --layouts [--batches 1,64]       (any device)
    python bench/host_overhead.py --ops [--batches 8,64,128,256]   (CUDA)

Each line: microseconds of host time per call (perf_counter over `--calls`
calls, device work left queued; the device work of each call is a few
microseconds, so the host is what is timed), median of 5 rounds. Shapes are the
bench preset's attention (32 heads, 4 KV heads, head dim 64, bf16). The first
table times single calls at decode batch `--batch`; the second, one layer's
eager region (the attention call alone: the KV write runs inside the graph
piece before it) at decode batches `--batches` and one prefill step.

--dispatch times the dispatch alone (any device): an op whose body does
nothing, defined with `torch.library.custom_op` and with mrv2's `define_op`
(compile_backend/core/op_definition.py), pure and mutating, under no_grad
(HF generate) and inference_mode.

--layouts times the launchers that remember a checked call's layout (Note
[checked layouts] in compile_backend/kernels/_launch.py): rope_and_cache, the
skinny GEMM and norm_linear's norm and gate kernels at llama-8B decode
shapes, a layout seen before against a new one each call (any device; on
the CPU the launch itself is left out: the interpreter's would dwarf the
host work).

--ops times the ops a llama-8B layer's Inductor piece calls (norm_linear,
linear_add, through the dispatcher as the piece's code calls them) and
torch's own calls beside them, eager and inside a CUDA graph capture: the
host work a warm capture repeats for every graph (issue #36).

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

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import report  # noqa: E402



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
    from bench.workload import decode_batch  # the benchmarks' batch builder
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
        batch = decode_batch(B, context, kv, model.cfg.vocab_size)
        step = StepGraph(CUDAGraphMode.FULL, B, B, uniform_decode=True)
        rows.append((f"prepare_step, decode batch {B} ({dev})", per_call_us(
            lambda: runner.prepare_step(batch, step), calls)))
    return rows


def layout_rows(batches: list[int], calls: int) -> list[tuple[str, str, str, str]]:
    """Host us per call of rope_and_cache, of the skinny GEMM with the
    residual (o projection: 4096 x 4096), and of norm_linear's norm and gate
    kernels, at llama-8B decode shapes (32 heads, 8 KV heads, head dim 128,
    bf16): the layout remembered, and a new one each call (the memo emptied
    first: the checks and the derivation run)."""
    import contextlib
    import importlib

    cuda = torch.cuda.is_available()
    if not cuda:  # CPU tensors reach the launchers under Triton's interpreter only
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rc = importlib.import_module("compile_backend.kernels.rope_and_cache")
    sl = importlib.import_module("compile_backend.kernels.skinny_linear")
    rn = importlib.import_module("compile_backend.kernels.rms_norm")
    sm = importlib.import_module("compile_backend.kernels.silu_mul")
    dev, dt = ("cuda" if cuda else "cpu"), torch.bfloat16
    H, KVH, D = 32, 8, 128
    stub = contextlib.ExitStack()
    if not cuda:  # host work only: the interpreter's launch is not what is timed
        for mod in (rc, sl, rn, sm):
            real = mod.launch_here
            stub.callback(setattr, mod, "launch_here", real)
            mod.launch_here = lambda launch, args: None
    rows = []
    with stub:
        for B in batches:
            qkv = torch.randn(B, (H + 2 * KVH) * D, device=dev, dtype=dt)
            q, k, v = (t.view(B, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
            pos = torch.arange(B, device=dev) + 500
            inv = torch.rand(D // 2, device=dev)
            kc = torch.randn(B + 8, 16, KVH, D, device=dev, dtype=dt)
            vc = torch.randn_like(kc)
            slots = torch.arange(B, device=dev) * 16
            x = torch.randn(B, H * D, device=dev, dtype=dt)
            w = torch.randn(4096, H * D, device=dev, dtype=dt) * 0.02
            r = torch.randn(B, 4096, device=dev, dtype=dt)
            cases = [("rope_and_cache", lambda: rc.rope_and_cache(q, k, v, pos, inv, kc, vc, slots),
                      rc._LAUNCHES)]
            if B <= sl.MAX_ROWS:
                cases.append(("skinny GEMM + residual (o proj)", lambda: sl.skinny_linear(x, w, None, r),
                              sl._LAUNCHES))
            nw = torch.rand(H * D, device=dev, dtype=dt) + 0.5
            gu = torch.randn(B, 2 * 14336, device=dev, dtype=dt)
            cases += [("RMSNorm (norm_linear above 16 rows)", lambda: rn.rms_norm(x, nw, 1e-5), rn._LAUNCHES),
                      ("SiLU·mul (norm_linear above 16 rows)", lambda: sm.silu_mul(gu), sm._LAUNCHES)]
            for name, fn, memo in cases:
                for _ in range(20):
                    fn()
                seen = per_call_us(fn, calls)
                new = per_call_us(lambda: (memo.clear(), fn()), calls)
                rows.append((f"decode, batch {B}", name, f"{seen:.1f}", f"{new:.1f}"))
    return rows


def dispatch_rows(calls: int) -> list[tuple[str, str, str, str]]:
    """Host us per call of empty ops defined both ways (pure: x, w -> new
    tensor; mutating: writes nothing into a declared-written state)."""
    from compile_backend.core.op_definition import define_op

    def pure(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def mutating(x: torch.Tensor, state: torch.Tensor) -> None:
        return None

    ops = {}
    for how, define in (("torch.library.custom_op", torch.library.custom_op), ("define_op", define_op)):
        ns = "mrv2_dispatch_" + how.split(".")[-1]
        ops[how] = (define(f"{ns}::pure", mutates_args=())(pure),
                    define(f"{ns}::mutating", mutates_args=("state",))(mutating))
    x, w, state = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    rows = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            for how, (p, m) in ops.items():
                p, m = _default(p), _default(m)
                rows.append((mode.__name__, how, f"{per_call_us(lambda: p(x, w), calls):.1f}",
                             f"{per_call_us(lambda: m(x, state), calls):.1f}"))
    return rows


def _default(op):
    """The op's default overload, what compiled code calls."""
    return op._opoverload if hasattr(op, "_opoverload") else op.default


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--prepare", action="store_true", help="time prepare_step (any device)")
    ap.add_argument("--dispatch", action="store_true", help="time an empty op's dispatch (any device)")
    ap.add_argument("--layouts", action="store_true",
                    help="time the launchers' remembered layouts (any device)")
    ap.add_argument("--ops", action="store_true",
                    help="time the llama-8B layer's ops, eager and under capture (CUDA)")
    ap.add_argument("--batches", default="1,64,256",
                    help="decode batches (eager region, --prepare, --layouts)")
    ap.add_argument("--prefill", type=int, default=4, help="requests of 128 tokens in the prefill row")
    ap.add_argument("--out", help="also write the tables (markdown) here")
    args = ap.parse_args(argv)
    if args.dispatch:
        text = (f"torch {torch.__version__}, {args.calls} calls x 5 rounds, median\n\n"
                + _markdown("Dispatch of an empty op (host us per call)",
                            ["grad mode", "defined with", "pure us", "mutating us"],
                            dispatch_rows(args.calls)))
        report.print_and_write([text], args.out)
        return 0
    if args.layouts:
        where = (torch.cuda.get_device_name() if torch.cuda.is_available()
                 else "CPU: the launch left out, the index checks (CPU tensors only) in")
        text = (f"{where}, torch {torch.__version__}, {args.calls} calls x 5 rounds, median\n\n"
                + _markdown("Launchers by layout (host us per call)",
                            ["batch", "call", "layout remembered us", "layout checked us"],
                            layout_rows([int(b) for b in args.batches.split(",")], args.calls)))
        report.print_and_write([text], args.out)
        return 0
    if args.ops:
        if not torch.cuda.is_available():
            ap.error("--ops needs a CUDA device")
        batches = [int(b) for b in args.batches.split(",")]
        from timing import host_speed

        text = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, llama-8B widths, bf16, "
                f"{OPS_CALLS} calls a round (3 rounds under capture, 5 eager), median; host speed "
                f"(bench/timing.host_speed): {host_speed().text()}\n\n"
                + _markdown("A layer's ops, eager (device work queued) and inside a capture "
                            "(host us per call)", ["rows", "call", "eager us", "under capture us"],
                            op_rows(batches)))
        report.print_and_write([text], args.out)
        return 0
    if args.prepare:
        rows = prepare_rows([int(b) for b in args.batches.split(",")], args.context,
                            max(1, args.calls // 10))
        print("| call | host us |\n|---|---:|")
        for name, us in rows:
            print(f"| {name} | {us:.1f} |")
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (or --prepare)")
    import triton

    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"context {args.context}, `python bench/host_overhead.py {' '.join(argv or sys.argv[1:])}`")
    tables = [("Calls at decode batch %d (host us per call)" % args.batch, ["call", "host us"],
               [(n, f"{us:.1f}") for n, us in call_rows(args.batch, args.context, args.calls)])]
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        rows += eager_region_rows(f"decode, batch {B}", [1] * B, args.context, args.calls)
    rows += eager_region_rows(f"prefill, {args.prefill} requests x 128 tokens", [128] * args.prefill,
                              args.context, args.calls)
    tables.append(("One layer's eager region in PIECEWISE: the attention call (host and device us "
                   "per layer)", ["batch", "call", "host us", "device us"], rows))
    text = f"{head}\n\n" + "\n\n".join(_markdown(*t) for t in tables)
    report.print_and_write([text], args.out)
    return 0


OPS_CALLS = 32


def op_rows(batches: list[int]) -> list[tuple[str, str, str, str]]:
    """--ops: host us per call of each of a llama-8B layer's projection ops
    (packed qkv and gate_up weights, as fuse_norm_linear leaves them) at each
    row count, eager and while a CUDA graph records."""
    import torch.nn.functional as F

    import compile_backend.kernels  # noqa: F401  (registers the ops)
    # the modules (the package exports functions of the same names)
    nl = sys.modules["compile_backend.kernels.norm_linear"]
    sk = sys.modules["compile_backend.kernels.skinny_linear"]
    from compile_backend.kernels.rms_norm import rms_norm
    from compile_backend.kernels.silu_mul import silu_mul

    dev, dt, K, inter = "cuda", torch.bfloat16, 4096, 14336
    gen = torch.Generator(device=dev).manual_seed(36)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen) * 0.02

    w_qkv, w_gu, w_o, w_down = rand(6144, K), rand(2 * inter, K), rand(K, K), rand(K, inter)
    norm_w = rand(K) + 1
    qkv, gate_up = [w_qkv[:4096], w_qkv[4096:5120], w_qkv[5120:]], [w_gu[:inter], w_gu[inter:]]
    ops = torch.ops.mrv2

    stream = torch.cuda.Stream()  # one capture stream, as a runner's (its cuBLAS workspace once)

    def capture_us(fn) -> float:
        rounds = []
        for _ in range(3):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                t0 = time.perf_counter()
                for _ in range(OPS_CALLS):
                    fn()
                rounds.append((time.perf_counter() - t0) / OPS_CALLS * 1e6)
            del graph
        return statistics.median(rounds)

    rows = []
    for M in batches:
        x, x_inter, res, y_gu = rand(M, K), rand(M, inter), rand(M, K), rand(M, 2 * inter)
        calls = {
            "norm_linear qkv": lambda: ops.norm_linear.default(x, norm_w, 1e-5, qkv, [], False),
            "norm_linear gate_up": lambda: ops.norm_linear.default(x, norm_w, 1e-5, gate_up, [], True),
            "linear_add o": lambda: ops.linear_add.default(x, w_o, None, res),
            "linear_add down": lambda: ops.linear_add.default(x_inter, w_down, None, res),
            "F.linear (qkv weight)": lambda: F.linear(x, w_qkv),
            "torch.addmm (o weight)": lambda: torch.addmm(res, x, w_o.t()),
            "torch.empty": lambda: torch.empty(M, K, device=dev, dtype=dt),
            # norm_linear gate_up's parts, each alone (which of them the op's Python is)
            "  its checks (check_norm_linear)": lambda: nl.check_norm_linear(x, norm_w, 1e-5, gate_up, [], True),
            "  its packed view": lambda: nl.packed_weight_and_bias(gate_up, []),
            "  its kernel-or-cuBLAS rule": lambda: nl.skinny_pays(x, w_gu, True, norm=True),
            "  rms_norm": lambda: rms_norm(x, norm_w, 1e-5),
            "  F.linear (gate_up weight)": lambda: F.linear(x, w_gu),
            "  silu_mul": lambda: silu_mul(y_gu),
            # linear_add o's parts
            "  linear_add's checks": lambda: sk.check_linear_add(x, w_o, None, res),
            "  linear_add's rule": lambda: sk.skinny_pays(x, w_o),
            "  linear_add's launch or addmm": (
                (lambda: sk.skinny_linear(x, w_o, None, res)) if sk.skinny_pays(x, w_o)
                else (lambda: sk.linear_add_ref(x, w_o, None, res))),
        }
        for name, fn in calls.items():
            fn()
            fn()  # first calls: compiles, cuBLAS's first call of the problem
            torch.cuda.synchronize()
            rows.append((str(M), name, f"{per_call_us(fn, OPS_CALLS):.1f}", f"{capture_us(fn):.1f}"))
    return rows


def _markdown(title: str, columns: list[str], rows: list[tuple]) -> str:
    lines = [f"{title}:", "", "| " + " | ".join(columns) + " |",
             "|" + "".join("---:|" if c.endswith(" us") else "---|" for c in columns)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _decode_inputs(q_lens: list[int], context: int, num_layers: int = 1):
    """Query, per-layer caches and metadata of one step: requests with
    `q_lens` new tokens each after `context` cached ones (bench preset's
    attention: 32 heads, 4 KV heads, head dim 64, bf16, block size 16)."""
    from compile_backend.runner.attention_metadata import AttentionMetadata

    dev, dt = "cuda", torch.bfloat16
    B, H, KVH, D, bs = len(q_lens), 32, 4, 64, 16
    T = sum(q_lens)
    blocks = math.ceil((context + max(q_lens)) / bs)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    caches = [(torch.randn(B * blocks + 1, bs, KVH, D, device=dev, dtype=dt, generator=g),
               torch.randn(B * blocks + 1, bs, KVH, D, device=dev, dtype=dt, generator=g))
              for _ in range(num_layers)]
    qsl = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(B)], device=dev, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor([context + n for n in q_lens], device=dev, dtype=torch.int32),
        block_table=(1 + torch.arange(B * blocks, device=dev, dtype=torch.int32)).view(B, blocks),
        slot_mapping=torch.arange(T, device=dev, dtype=torch.int64) + bs,
        num_reqs=B, max_query_len=max(q_lens), max_seq_len=context + max(q_lens), for_capture=False)
    return q, caches, meta, D ** -0.5


def call_rows(B: int, context: int, calls: int) -> list[tuple[str, float]]:
    """Host us of the attention op's entry points and of a few torch calls at
    one decode batch."""
    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from compile_backend.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_impl
    from compile_backend.kernels.unified_attention import (unified_attention, unified_attention_direct,
                                           unified_attention_impl)

    q, [(kc, vc)], meta, scale = _decode_inputs([1] * B, context)
    k = v = kc[0, :B].clone()
    out = torch.empty_like(q)
    H, D = q.shape[1:]
    graph, x = torch.cuda.CUDAGraph(), torch.randn(B, 2048, device="cuda", dtype=q.dtype)
    with torch.cuda.graph(graph):
        x.mul_(1.0)
    rows = []
    with set_forward_context(ForwardContext(attn_metadata={"layer": meta})):
        cases = {
            "graph.replay (one kernel)": graph.replay,
            "torch.ops.mrv2.unified_attention (dispatcher, checked)":
                lambda: torch.ops.mrv2.unified_attention(q, kc, vc, out, "layer", scale),
            "unified_attention_impl (checked, no dispatcher)":
                lambda: unified_attention_impl(q, kc, vc, out, "layer", scale),
            "unified_attention_direct (step plan, bound launches)":
                lambda: unified_attention_direct(q, kc, vc, out, "layer", scale),
            "unified_attention launcher (checks + 2 launches)": lambda: unified_attention(
                q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_table, scale, 1,
                meta.max_seq_len, out=out),
            "torch.ops.mrv2.reshape_and_cache (dispatcher)":
                lambda: torch.ops.mrv2.reshape_and_cache(k, v, kc, vc, "layer"),
            "reshape_and_cache_impl (direct)": lambda: reshape_and_cache_impl(k, v, kc, vc, "layer"),
            "reshape_and_cache launcher (checks + 1 launch)":
                lambda: reshape_and_cache(k, v, kc, vc, meta.slot_mapping),
            "torch.empty_like(q)": lambda: torch.empty_like(q),
            "torch.empty(scratch)": lambda: torch.empty(B * H * 8 * (D + 2), device="cuda"),
            "dst.copy_(src) (device to device)": lambda: x.copy_(x),
        }
        for name, fn in cases.items():
            for _ in range(50):
                fn()
            rows.append((name, per_call_us(fn, calls)))
    return rows


def eager_region_rows(name: str, q_lens: list[int], context: int, calls: int) -> list[tuple]:
    """Per layer: the direct call with the step's plan (two layers of the same
    shapes alternate, as in a model), the first call of a step (a new
    metadata object: checks and plan), and the op through the dispatcher.
    Host us: perf_counter around `calls` calls, device work queued (few
    enough calls that the launch queue never fills); device us: CUDA events
    around the same loop (what the GPU took, idle gaps included)."""
    import dataclasses

    from compile_backend.core.forward_context import ForwardContext, set_forward_context
    from compile_backend.kernels.unified_attention import unified_attention_direct as direct

    q, caches, meta, scale = _decode_inputs(q_lens, context, num_layers=2)
    (k0, v0), (k1, v1) = caches
    out = torch.empty_like(q)
    ctx = ForwardContext(attn_metadata={"l0": meta, "l1": meta})
    calls = min(calls, 100)  # 4 launches each: stays within the launch queue

    def two_layers():
        direct(q, k0, v0, out, "l0", scale)
        direct(q, k1, v1, out, "l1", scale)

    def new_step():  # a step's first layer: new metadata, checks, plan
        ctx.attn_metadata["l0"] = dataclasses.replace(meta)
        direct(q, k0, v0, out, "l0", scale)

    def dispatcher():
        torch.ops.mrv2.unified_attention(q, k0, v0, out, "l0", scale)
        torch.ops.mrv2.unified_attention(q, k1, v1, out, "l1", scale)

    rows = []
    with set_forward_context(ctx):
        for label, fn, per in [("direct, step plan (per layer)", two_layers, 2),
                               ("direct, first call of a step (checks + plan)", new_step, 1),
                               ("op through the dispatcher (checked)", dispatcher, 2)]:
            for _ in range(20):
                fn()
            host = per_call_us(fn, calls) / per
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            rows.append((name, label, f"{host:.1f}", f"{start.elapsed_time(end) * 1e3 / calls / per:.1f}"))
        ctx.attn_metadata["l0"] = meta
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
