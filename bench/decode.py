"""Decode-step benchmark: mrv2's graph modes against eager and Inductor's own modes.

    python bench/decode.py [--model llama|hybrid|both] [--batches 1,8,32,64,128,256]
                           [--context 500] [--variants a,b,...] [--out bench/results]
                           [--mixed 512,2048] [--startup | --only-startup] [--dry-run]
    python bench/decode.py --merge a/decode.json b/decode.json ... --out bench/results
    torchrun --nproc-per-node 2 bench/decode.py --tp 2 --model llama --batches 64   (runs bench/tp.py)

Per decode cell: median step time over CUDA events (warm-up excluded; a step is
the runner's whole `execute` of a prepared batch: host-side buffer writes,
metadata, then replay or launches; building the batch is the scheduler's and
is not timed), the back-to-back step time (20 steps queued with no synchronize in
between: the host prepares step i+1 while the device runs step i, as an engine
that schedules ahead does), the FULL graph's replay alone where there is one,
the ratio to the HBM floor (weight bytes + KV bytes read, over the median copy bandwidth
of 5 rounds at the run's start and 5 at its end), and the relative error of the first
step's logits against eager (match: < 5e-2, bf16 over 8 layers).

Variants (all with the project's kernels):
  eager                    the model uncompiled
  inductor                 torch.compile default (no graphs)
  inductor-reduce-overhead torch.compile(mode="reduce-overhead") (CUDA graph trees)
  inductor-ro-partitioned  the same with Inductor's graph partition cut at the
                           mrv2 attention ops (graph_partition, custom_should_partition_ops)
  mrv2-none | mrv2-piecewise | mrv2-full | mrv2-full_and_piecewise

Also: a mixed prefill+decode step (--mixed token counts) for eager, inductor
and mrv2-piecewise; with --startup, cold and warm compile time (two fresh
processes sharing one Inductor cache) and the pool memory of the largest
capture alone (--only-startup: only the compile times). --merge joins the
results of several runs (one per model, say, to fit a time limit) into one
table and plot. --dry-run checks the plumbing on the CPU (tiny model, graph
stand-in, perf_counter timing: the numbers mean nothing). A/B pairs in one
process: `--sets "A;B;A"` runs the variants once per set of CompilationConfig
fields (A, B: FIELD=VALUE,...; empty: the defaults), in that order, each row
labelled with its set, and a table of each set against the first with the
first's spread; `--timing-only` captures the timed batch sizes alone
and skips the largest size's memory build (the pool columns read "-").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compile_backend as cb  # noqa: E402
from compile_backend.runtime.graph_pool import use_graph_backend, warm_capture_stream  # noqa: E402
from compile_backend.runtime.graph_standin import StandInGraphs  # noqa: E402
from compile_backend.runner.kv_cache_config import KVCacheConfig  # noqa: E402
from compile_backend.runner.model_runner import ModelRunner  # noqa: E402
from compile_backend.demo.models import build_model, preset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ (workload.py)
from report import (  # noqa: E402
    add_dry_run, add_out, comma_list, dash, heading, names, run_meta, table, write_md_and_json)
from roofline import Work, floor_seconds, gemm_peak_flops, step_work  # noqa: E402
from timing import Bandwidth, call_ms, copy_bandwidth, spread_text  # noqa: E402
from workload import config_options, decode_batch, fill_caches, mixed_batch  # noqa: E402

# Where mrv2 splits (the KV write runs inside mrv2's pieces, so not here either).
ATTENTION_OPS = ["mrv2::unified_attention"]
MATCH_TOL = 5e-2
TP_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp.py")  # runs --tp


class _Partitioned:
    """reduce-overhead with Inductor's graph partition cut at attention; the
    config patch is active while the first call compiles."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.compiled = torch.compile(model, mode="reduce-overhead")
        self.first = True

    def __call__(self, *args):
        if not self.first:
            return self.compiled(*args)
        self.first = False
        import torch._inductor.config as ic

        with ic.patch(graph_partition=True, custom_should_partition_ops=ATTENTION_OPS):
            return self.compiled(*args)


@dataclasses.dataclass(frozen=True)
class Variant:
    mode: str  # the mrv2 graph mode (runner dispatch); "none" for the others
    compile_fn: Callable[[torch.nn.Module], Any] | None  # None: mrv2
    needs_cuda: bool = False


VARIANTS = {
    "eager": Variant("none", lambda m: m),
    "inductor": Variant("none", lambda m: torch.compile(m)),
    "inductor-reduce-overhead": Variant(
        "none", lambda m: torch.compile(m, mode="reduce-overhead"), needs_cuda=True),
    "inductor-ro-partitioned": Variant("none", _Partitioned, needs_cuda=True),
    "mrv2-none": Variant("none", None),
    "mrv2-piecewise": Variant("piecewise", None),
    "mrv2-full": Variant("full", None),
    "mrv2-full_and_piecewise": Variant("full_and_piecewise", None),
}


@dataclasses.dataclass
class Setup:
    device: str
    dtype: torch.dtype
    preset: str
    piece_compiler: str
    context: int
    graphs: Any  # None: real CUDA graphs; a stand-in on dry runs
    options: dict = dataclasses.field(default_factory=dict)  # more CompilationConfig fields (--config)

    def scope(self):
        return use_graph_backend(self.graphs) if self.graphs is not None else contextlib.nullcontext()


def median_ms(fn: Callable[[], Any], setup: Setup, reps: int = 30) -> float:
    return statistics.median(call_ms(fn, setup.device, reps))


def back_to_back_ms(fn: Callable[[], Any], setup: Setup, steps: int = 20, reps: int = 5) -> float:
    """Per-step time of `steps` calls queued without a synchronize between them."""
    def queued():
        for _ in range(steps):
            fn()
    return statistics.median(call_ms(queued, setup.device, reps)) / steps


def sync(setup: Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()


def allocated(setup: Setup) -> int:
    return torch.cuda.memory_allocated() if setup.device == "cuda" else 0


def reserved(setup: Setup) -> int:
    """Device memory the allocator holds, graph pools' free blocks included."""
    return torch.cuda.memory_reserved() if setup.device == "cuda" else 0


def step_floor_work(model: torch.nn.Module, batch: int, context: int) -> dict[str, list[int]]:
    """Bytes and FLOPs of one decode step of `batch` requests by kernel class
    (bench/roofline.py), JSON-friendly: class -> [bytes, flops]."""
    work = step_work(model, batch, batch * (context + 1), context + 1)
    return {c: [w.bytes, w.flops] for c, w in work.items()}


def floor_times(row: dict, bw: float, peak: float | None) -> tuple[float, float | None]:
    """(HBM floor ms, compute-aware floor ms) of a row: bytes over bandwidth,
    and the sum over kernel classes of max(bytes / bandwidth, FLOPs / peak)."""
    work = {c: Work(*bf) for c, bf in row["work"].items()}
    compute = floor_seconds(work, bw, peak) * 1e3 if peak else None
    return floor_seconds(work, bw, None) * 1e3, compute


@torch.no_grad()
def build(model_name: str, variant: str, setup: Setup, capture_sizes: list[int],
          max_reqs: int, max_tokens: int, num_blocks: int, max_model_len: int | None = None,
          capture_context: Any = None):
    """The variant's runner, compiled and captured; `capture_context` (a
    context manager, e.g. bench/op_timer.OpTimer) is entered around the capture."""
    spec = VARIANTS[variant]
    t0 = time.perf_counter()  # the bench's own settling (below), apart from what it times
    if "torch._dynamo" in sys.modules:  # not imported yet: nothing to reset (startup times its import)
        torch._dynamo.reset()
    cb.reset_counters()
    # The previous variant's graphs outlive its runner (Dynamo holds compiled
    # steps): free them, or this variant captures into their pool and its
    # growth reads about 0 (seen: 2026-11-30, FULL after PIECEWISE). Its
    # runner may sit in a reference cycle: collect it now, or its memory is
    # freed during this capture and the pool reads negative (seen: hybrid
    # mrv2-piecewise, -2164 MiB, 2026-11-30).
    cb.release_graphs()  # stand-in graphs too (a dry run), which hold their runner
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    settle_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.device(setup.device):  # weights drawn on the device (llama8b: 16 GB)
        model = build_model(model_name, preset(setup.preset, dtype=setup.dtype))
    sync(setup)
    model_s = time.perf_counter() - t0
    kv = KVCacheConfig(num_blocks=num_blocks, block_size=16,
                       max_model_len=max_model_len or setup.context + 64,
                       max_num_reqs=max_reqs, max_num_tokens=max_tokens)
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, setup.device)
    fill_caches(model, setup.device)  # random caches and state: never time zeros
    cfg = cb.CompilationConfig(cudagraph_mode=spec.mode, capture_sizes=capture_sizes,
                               piece_compiler=setup.piece_compiler, **setup.options)
    t0 = time.perf_counter()
    runner = ModelRunner(model, kv, cfg, setup.device, progress=False, compile_fn=spec.compile_fn)
    runner_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner.warmup(max(capture_sizes), None)  # first call: compiles
    sync(setup)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()  # the bench's own settling, for its memory readings
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()  # what the warm-up freed is not the pool's
        # The capture stream's cuBLAS workspaces (34 MiB, once per process) are
        # not graph memory: made here, before the pool is read (docs/design.md,
        # "Memory budget"). Before this, the first variant's pool read 34 MiB high.
        warm_capture_stream()
    mem0, res0 = allocated(setup), reserved(setup)
    settle_s += time.perf_counter() - t0
    # The context's own set-up (bench/op_timer.py's swaps and the imports
    # they make: 0.8 s in a warm process) is the bench's, not the capture's.
    t_enter = time.perf_counter()
    with capture_context if capture_context is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        settle_s += t0 - t_enter
        runner.capture()
        sync(setup)
        capture_s = time.perf_counter() - t0
    startup = {"model_s": model_s, "runner_s": runner_s,
               "compile_s": compile_s, "capture_s": capture_s, "settle_s": settle_s,
               "pool_bytes": allocated(setup) - mem0, "pool_reserved_bytes": reserved(setup) - res0}
    return runner, model, kv, startup


def time_decode_step(runner, model, kv, b, setup) -> dict:
    """One batch size's timings: the step, back to back, and (FULL) the
    graph's replay alone. A function of its own so that nothing it holds
    (the captured graph keeps its runner and model) outlives it."""
    batch = decode_batch(b, setup.context, kv, model.cfg.vocab_size)  # built once: not timed
    first = runner.execute(batch).float().cpu().clone()  # a replay overwrites its output
    for _ in range(5):
        runner.execute(batch)
    ms = median_ms(lambda: runner.execute(batch), setup)
    b2b_ms = back_to_back_ms(lambda: runner.execute(batch), setup)
    step = runner.dispatch(batch)
    replay_ms = None
    if step.mode is cb.CUDAGraphMode.FULL and step.key in runner.full_graph.entries:
        replay_ms = median_ms(runner.full_graph.entries[step.key].cuda_graph.replay, setup)
    return {"ms": ms, "b2b_ms": b2b_ms, "replay_ms": replay_ms,
            "work": step_floor_work(model, b, setup.context), "dispatched": step.mode.value,
            "first": first}


@torch.no_grad()
def run_decode(model_name, variant, setup, batches, timing_only: bool = False):
    sizes = sorted(set(batches)) if timing_only else \
        [s for s in [1, 2, 4] + list(range(8, 257, 8)) if s <= max(batches)]
    blocks = max(batches) * (math.ceil((setup.context + 1) / 16) + 2) + 2
    runner, model, kv, startup = build(model_name, variant, setup, sizes, max(batches),
                                       max(sizes), blocks)
    rows = [dict(model=model_name, variant=variant, batch=b,
                 **time_decode_step(runner, model, kv, b, setup)) for b in batches]
    startup.update(graphs=cb.counters["cudagraph_captures"], pieces=cb.counters["pieces"],
                   replay_input_copies=cb.counters["replay_input_copies"],
                   rope_fused=cb.counters["rope_attention_fused_launches"],
                   rope_fused_captured=cb.counters["rope_attention_fused_captured"])
    if VARIANTS[variant].compile_fn is None and VARIANTS[variant].mode != "none" \
            and not timing_only:
        # One model at a time: this variant's (llama8b: 16 GB of weights and,
        # at b256, 18 GB of KV cache) goes before the largest size is built
        # alone, or an 80 GB card runs out of memory there (H100, 2026-12-07).
        del runner, model
        largest, largest_model, _, only = build(model_name, variant, setup, [max(sizes)],
                                                max(batches), max(sizes), blocks)
        startup["pool_largest_alone_bytes"] = only["pool_bytes"]
        startup["pool_largest_alone_reserved_bytes"] = only["pool_reserved_bytes"]
        del largest, largest_model
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    return rows, startup


@torch.no_grad()
def run_mixed(model_name, variant, setup, sizes):
    blocks = 64 * (math.ceil((setup.context + 1) / 16) + 2) + max(sizes) // 16 + 4
    runner, model, kv, _ = build(model_name, variant, setup, sizes, 64, max(sizes), blocks,
                                 max_model_len=max(sizes) + setup.context + 64)
    rows = []
    for n in sizes:
        batch = mixed_batch(n, 32, setup.context, kv, model.cfg.vocab_size)

        def step():
            return runner.execute(batch)
        first = step().float().cpu().clone()  # a replay overwrites its output
        for _ in range(3):
            step()
        rows.append({"model": model_name, "variant": variant, "tokens": n,
                     "ms": median_ms(step, setup, reps=10), "first": first,
                     "dispatched": runner.dispatch(batch).mode.value})
    return rows


def compile_seconds_in_fresh_process(model_name: str, variant: str, cache_dir: str) -> float:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, __file__, "--compile-only", "--model", model_name,
                          "--variants", variant], capture_output=True, text=True, env=env,
                         timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("compile_s="):
            return float(line.split("=")[1])
    raise RuntimeError(f"compile-only run printed no time:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _peak_note(meta) -> str:
    peak = meta.get("gemm_peak_TFLOPs")
    return f", measured {peak:.0f} TFLOP/s" if peak else ", not measured here"


def _bandwidth_note(meta) -> str:
    """A merged table's range of its runs' figures; one run's median (min-max)
    over its rounds; an older run's one figure."""
    if meta.get("copy_bandwidth_range"):
        return f"copy bandwidth {meta['copy_bandwidth_range']} GB/s"
    samples = meta.get("copy_bandwidth_samples_GBps")
    if not samples:
        return f"copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s"
    return (f"copy bandwidth {spread_text(samples)} over {len(samples)} rounds of 20 copies "
            "(the floors divide by the median)")


def _mib(s, key) -> str:
    return "-" if s.get(key) is None else f"{s[key] / 2**20:.0f}"


def decode_table(decode) -> list[str]:
    return table(
        ["model", "variant", "batch", "step ms", "back-to-back ms", "replay ms", "HBM floor ms",
         "compute-aware floor ms", "x floor (step / b2b)", "x compute-aware (b2b)", "rel err",
         "match", "ran as"], "ll" + "r" * 9 + "ll",
        [[r["model"], r["variant"], r["batch"], f"{r['ms']:.3f}", f"{r['b2b_ms']:.3f}",
          dash(r["replay_ms"], ".3f"), f"{r['floor_ms']:.3f}", dash(r.get("compute_floor_ms"), ".3f"),
          f"{r['x_floor']:.2f} / {r['b2b_ms'] / r['floor_ms']:.2f}",
          "-" if r.get("compute_floor_ms") is None else f"{r['b2b_ms'] / r['compute_floor_ms']:.2f}",
          f"{r['rel_err']:.1e}", "yes" if r["match"] else "NO", r["dispatched"]] for r in decode])


def set_runs(decode) -> dict[tuple[str, str, int], list[tuple[str, float]]]:
    """Rows of a --sets run grouped by (model, variant, batch): each set's
    (label, back-to-back ms) in the order the sets ran; {} without sets."""
    runs: dict[tuple[str, str, int], list[tuple[str, float]]] = {}
    for r in decode:
        if r.get("set"):
            base = r["variant"].removesuffix(f" [{r['set']}]")
            runs.setdefault((r["model"], base, r["batch"]), []).append((r["set"], r["b2b_ms"]))
    return runs


def sets_table(decode) -> list[str]:
    """Back-to-back ms of each set in order, then each later label's mean
    against the first label's mean, beside the first label's spread (its
    runs' max - min over their mean): a change inside that spread is noise."""
    runs = set_runs(decode)
    if not runs:
        return []
    labels = [label for label, _ in next(iter(runs.values()))]
    others = list(dict.fromkeys(lb for lb in labels if lb != labels[0]))
    out = []
    for (model, variant, batch), got in runs.items():
        by = {}
        for label, ms in got:
            by.setdefault(label, []).append(ms)
        first = statistics.mean(by[labels[0]])
        spread = (max(by[labels[0]]) - min(by[labels[0]])) / first
        changes = [f"{(statistics.mean(by[lb]) / first - 1) * 100:+.1f}%" if lb in by else "-"
                   for lb in others]
        out.append([model, variant, batch, *[f"{ms:.3f}" for _, ms in got], *changes,
                    f"{spread * 100:.1f}%"])
    header = ["model", "variant", "batch", *[f"b2b ms: {lb}" for lb in labels],
              *[f"{lb} vs {labels[0]}" for lb in others], f"spread of {labels[0]}"]
    return ["", "Config sets in the order they ran (back-to-back ms; a change smaller than "
            "the first set's spread is noise):", "",
            *table(header, "llr" + "r" * (len(header) - 3), out)]


def decode_markdown(meta, decode, mixed, startup, compile_times, skipped) -> str:
    L = [heading("Decode benchmark", meta), "",
         f"Command: `{meta['command']}`; {_bandwidth_note(meta)}; "
         f"{meta['context']} cached tokens per request; {meta['dtype']}; match = relative error "
         f"of the first step's logits against eager < {MATCH_TOL}.", "",
         "Floors (bench/roofline.py): HBM = bytes read / copy bandwidth (the embedding "
         "counted as the rows a lookup reads); compute-aware = the sum over kernel classes "
         "(gemm, attention, embedding, other) of max(bytes / bandwidth, FLOPs / bf16 GEMM "
         f"peak{_peak_note(meta)}).", "", *decode_table(decode), *sets_table(decode)]
    if mixed:
        L += ["", "Mixed prefill+decode step (32 decodes + one prefill):", ""]
        L += table(["model", "variant", "tokens", "step ms", "rel err", "ran as"], "llrrrl",
                   [[r["model"], r["variant"], r["tokens"], f"{r['ms']:.3f}", f"{r['rel_err']:.1e}",
                     r["dispatched"]] for r in mixed])
    L += ["", "Pool: device memory that capture added, all sizes vs the largest size "
          "captured alone; allocated (tensors the graphs keep alive: held outputs, "
          "capture-time inputs) and reserved (the pools' whole footprint).", ""]
    L += table(["model", "variant", "compile s", "capture s (all sizes)", "graphs", "pieces",
                "allocated MiB (all / largest alone)", "reserved MiB (all / largest alone)",
                "input copies"], "ll" + "r" * 7,
               [[s["model"], s["variant"], f"{s['compile_s']:.1f}", f"{s['capture_s']:.2f}", s["graphs"],
                 s["pieces"], f"{_mib(s, 'pool_bytes')} / {_mib(s, 'pool_largest_alone_bytes')}",
                 f"{_mib(s, 'pool_reserved_bytes')} / {_mib(s, 'pool_largest_alone_reserved_bytes')}",
                 s["replay_input_copies"]] for s in startup])
    fused = [f"{s['model']} {s['variant']} {s['rope_fused']} ({s['rope_fused_captured']} captured)"
             for s in startup if s.get("rope_fused")]
    if fused:
        L += ["", "Decode attention launches with rotary and the KV write inside "
              "(fuse_rope_attention): " + "; ".join(fused)]
    if compile_times:
        L += [""] + table(["model", "variant", "cold compile s", "warm compile s"], "llrr",
                          [[c["model"], c["variant"], f"{c['cold_s']:.1f}", f"{c['warm_s']:.1f}"]
                           for c in compile_times])
    if skipped:
        L += ["", "Not measured: " + "; ".join(skipped)]
    return "\n".join(L) + "\n"


def write_results(out_dir, meta, decode, mixed, startup, compile_times, skipped) -> str:
    """decode.md and decode.json (the rows less their first logits); returns the markdown."""
    strip = lambda rows: [{k: v for k, v in r.items() if k != "first"} for r in rows]  # noqa: E731
    text = decode_markdown(meta, decode, mixed, startup, compile_times, skipped)
    write_md_and_json(os.path.join(out_dir, "decode.md"), text,
                      {"meta": meta, "decode": strip(decode), "mixed": strip(mixed),
                       "startup": startup, "compile": compile_times, "skipped": skipped})
    return text


def merge_results(paths: list[str], out_dir: str) -> str:
    """One table and plot from several runs' decode.json (rows kept as measured:
    each row's floor uses its own run's copy bandwidth)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    meta = dict(runs[0]["meta"])
    meta["runs"] = [r["meta"] for r in runs]
    meta["command"] = " ; ".join(r["meta"]["command"] for r in runs)
    bws = [r["meta"]["copy_bandwidth_GBps"] for r in runs]
    meta["copy_bandwidth_GBps"] = min(bws)
    meta["copy_bandwidth_range"] = f"{min(bws):.0f}-{max(bws):.0f}"
    samples = [x for r in runs for x in r["meta"].get("copy_bandwidth_samples_GBps", [])]
    if samples:  # every run's rounds (older runs have none)
        meta["copy_bandwidth_samples_GBps"] = samples
    joined = {k: [row for r in runs for row in r[k]] for k in ("decode", "mixed", "startup",
                                                                "compile", "skipped")}
    text = write_results(out_dir, meta, joined["decode"], joined["mixed"], joined["startup"],
                         joined["compile"], list(dict.fromkeys(joined["skipped"])))
    png = plot(joined["decode"], out_dir)
    return text + (f"\nplot: {png}" if png else "\n(no matplotlib: no plot)")


def plot(decode, out_dir) -> str | None:
    if not decode:  # --only-startup: nothing to plot
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = sorted({r["model"] for r in decode})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    # One colour per variant in every panel (runs may list variants in any order).
    colours = {v: f"C{i}" for i, v in enumerate(dict.fromkeys([*VARIANTS, *(r["variant"] for r in decode)]))}
    for ax, m in zip(axes[0], models):
        for v in [v for v in colours if any(r["model"] == m and r["variant"] == v for r in decode)]:
            rows = [r for r in decode if r["model"] == m and r["variant"] == v]
            ax.plot([r["batch"] for r in rows], [r["ms"] for r in rows], marker="o", label=v,
                    color=colours[v])
        rows = [r for r in decode if r["model"] == m and r["variant"] == "eager"] or \
            [r for r in decode if r["model"] == m]
        ax.plot([r["batch"] for r in rows], [r["floor_ms"] for r in rows], "k--", label="HBM floor")
        ax.set(xscale="log", yscale="log", xlabel="batch (decode requests)", ylabel="step ms", title=m)
        ax.legend(fontsize=7)
    path = os.path.join(out_dir, "decode.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama", "hybrid", "both"], default="both")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--preset", default=None, help="model size (default: bench on a GPU, tiny "
                    "on a dry run; llama8b: Llama-3-8B's shape)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--mixed", default="512,2048", help="token counts of the mixed step ('' to skip)")
    ap.add_argument("--startup", action="store_true", help="also cold/warm compile in fresh processes")
    ap.add_argument("--only-startup", action="store_true", help="only cold/warm compile")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join earlier runs' decode.json")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    add_dry_run(ap)
    add_out(ap)
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a CompilationConfig field for the mrv2 variants, e.g. "
                         "fuse_sibling_linears=false (repeatable)")
    ap.add_argument("--sets", default=None, metavar="A;B;...",
                    help="run the variants once per set of config fields, in order (a set: "
                         "FIELD=VALUE,...; empty: the defaults), e.g. "
                         "'fuse_residual_norm=false;fuse_residual_norm=true;fuse_residual_norm=false'")
    ap.add_argument("--timing-only", action="store_true",
                    help="capture only the timed batch sizes; no memory build of the largest")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default=None,
                    help="torch's preferred BLAS library for the whole run (what a user sets "
                         "with torch.backends.cuda.preferred_blas_library; default: torch's)")
    return ap


def make_setup(args, ap) -> Setup:
    """A GPU run's, or a dry run's on the CPU: tiny preset, fp32, eager
    pieces, a context of 40 at most, the graph stand-in."""
    cuda = torch.cuda.is_available() and not args.dry_run
    return Setup(device="cuda" if cuda else "cpu",
                 dtype=torch.bfloat16 if cuda else torch.float32,
                 preset=args.preset or ("bench" if cuda else "tiny"),
                 piece_compiler="inductor" if cuda else "eager",
                 context=args.context if cuda else min(args.context, 40),
                 graphs=None if cuda else StandInGraphs(), options=config_options(ap, args.config))


@dataclasses.dataclass
class Results:
    """One run's tables so far, written after every variant (a run cut short
    keeps what it measured)."""

    meta: dict
    bandwidth: Bandwidth  # the rounds so far; the floors divide by their median
    peak: float | None  # bf16 GEMM FLOP/s; None (off CUDA): no compute-aware floor
    skipped: list[str]
    decode: list[dict] = dataclasses.field(default_factory=list)
    mixed: list[dict] = dataclasses.field(default_factory=list)
    startup: list[dict] = dataclasses.field(default_factory=list)
    compile: list[dict] = dataclasses.field(default_factory=list)

    def set_floors(self) -> None:
        """The meta's copy bandwidth and every decode row's floors from the rounds so far."""
        bw = self.bandwidth.median
        self.meta["copy_bandwidth_GBps"] = bw / 1e9
        self.meta["copy_bandwidth_samples_GBps"] = self.bandwidth.gbps()
        for r in self.decode:
            r["floor_ms"], r["compute_floor_ms"] = floor_times(r, bw, self.peak)
            r["x_floor"] = r["ms"] / r["floor_ms"]

    def write(self, out_dir: str) -> str:
        return write_results(out_dir, self.meta, self.decode, self.mixed, self.startup, self.compile,
                             self.skipped)


def start_results(setup: Setup, variants: list[str], argv) -> Results:
    """The meta, the first rounds of the copy bandwidth and the GEMM peak;
    variants that need CUDA are listed as skipped off it."""
    cuda = setup.device == "cuda"
    bw = copy_bandwidth(device=setup.device)
    peak = gemm_peak_flops(setup.device)
    meta = {**run_meta("decode", argv, torch.cuda.get_device_name() if cuda else "CPU dry run",
                       env_prefix="MRV2_DECODE"),
            "dtype": str(setup.dtype).replace("torch.", ""),
            "copy_bandwidth_GBps": None, "copy_bandwidth_samples_GBps": None,  # set_floors's
            "context": setup.context,
            "gemm_peak_TFLOPs": peak / 1e12 if peak else None,
            "blas": str(torch.backends.cuda.preferred_blas_library()).split(".")[-1].lower() if cuda else None}
    results = Results(meta, bw, peak, [f"{v} (needs CUDA)" for v in variants
                                       if VARIANTS[v].needs_cuda and not cuda])
    results.set_floors()
    return results


def against_first(rows: list[dict], ref: dict, key: str) -> None:
    """Each row's rel err against the first logits seen at its `key` (eager's:
    eager runs first where it runs)."""
    for r in rows:
        ref.setdefault(r[key], r["first"])
        r["rel_err"] = rel_err(r["first"], ref[r[key]])


def config_sets(ap: argparse.ArgumentParser, text: str | None) -> list[tuple[str, dict]]:
    """--sets "A;B;..." -> [(label, config fields)]; None: one set, no label."""
    if text is None:
        return [("", {})]
    return [(label.strip() or "defaults",
             config_options(ap, [p.strip() for p in label.split(",") if p.strip()]))
            for label in text.split(";")]


def run_model(m: str, variants: list[str], setup: Setup, batches: list[int], mixed_sizes: list[int],
              results: Results, out_dir: str, sets: list[tuple[str, dict]] = (("", {}),),
              timing_only: bool = False) -> None:
    """One model: every variant's decode rows (once per config set, in
    order), then the mixed step's."""
    ref: dict[int, torch.Tensor] = {}
    name = m if setup.preset in ("bench", "tiny") else f"{m} ({setup.preset})"
    for label, fields in sets:
        run_setup = dataclasses.replace(setup, options={**setup.options, **fields})
        for v in variants:
            rows, s = run_decode(m, v, run_setup, batches, timing_only)
            shown = f"{v} [{label}]" if label else v
            for r in rows:
                r["model"], r["variant"], r["set"] = name, shown, label
            against_first(rows, ref, "batch")
            for r in rows:
                r["match"] = r["rel_err"] < MATCH_TOL
            results.decode += rows
            results.set_floors()
            results.startup.append({"model": name, "variant": shown, **s})
            print(f"done {m} {shown}: {s}", flush=True)
            results.write(out_dir)
    if mixed_sizes:
        mref: dict[int, torch.Tensor] = {}
        for v in [v for v in ("eager", "inductor", "mrv2-piecewise") if v in variants]:
            rows = run_mixed(m, v, setup, mixed_sizes)
            for r in rows:
                r["model"] = name
            against_first(rows, mref, "tokens")
            results.mixed += rows
        results.write(out_dir)


def run_compile_times(models: list[str], results: Results, out_dir: str) -> None:
    """--startup: cold and warm compile, two fresh processes sharing one Inductor cache."""
    for m in models:
        for v in ("mrv2-piecewise", "inductor"):
            with tempfile.TemporaryDirectory() as cache:
                cold = compile_seconds_in_fresh_process(m, v, cache)
                warm = compile_seconds_in_fresh_process(m, v, cache)
            results.compile.append({"model": m, "variant": v, "cold_s": cold, "warm_s": warm})
            print(f"compile {m} {v}: cold {cold:.1f} s, warm {warm:.1f} s", flush=True)
            results.write(out_dir)


def compile_only(model_name: str, variant: str, setup: Setup) -> int:
    """--compile-only: the fresh process compile_seconds_in_fresh_process runs."""
    with setup.scope():
        _, _, _, s = build(model_name, variant, setup, [1, 2, 4, 8], 8, 8, 64)
    print(f"compile_s={s['compile_s']:.3f}")
    return 0


def main(argv=None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if "--tp" in given:  # tensor parallel, under torchrun: this process becomes bench/tp.py
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, os.path.relpath(TP_SCRIPT), *given])
    ap = parser()
    args = ap.parse_args(argv)
    if args.merge:
        print(merge_results(args.merge, args.out))
        return 0
    variants = names(ap, "--variants", args.variants, VARIANTS)
    setup = make_setup(args, ap)
    sets = config_sets(ap, args.sets)
    models = ["llama", "hybrid"] if args.model == "both" else [args.model]
    if args.compile_only:
        return compile_only(models[0], variants[0], setup)
    if setup.device != "cuda" and not args.dry_run:
        ap.error("no CUDA device: run on a GPU, or pass --dry-run to check the plumbing on the CPU")
    if args.blas and setup.device == "cuda":
        # before any GEMM runs: the captured graphs keep the kernels cuBLAS picks at capture
        torch.backends.cuda.preferred_blas_library(args.blas)
    results = start_results(setup, variants, argv)
    runnable = [v for v in variants if setup.device == "cuda" or not VARIANTS[v].needs_cuda]
    with setup.scope():
        for m in (models if not args.only_startup else []):
            run_model(m, runnable, setup, comma_list(args.batches, int), comma_list(args.mixed, int),
                      results, args.out, sets, args.timing_only)
    if args.startup or args.only_startup:
        run_compile_times(models, results, args.out)
    results.bandwidth += copy_bandwidth(device=setup.device)  # rounds at the end too: the spread over the run
    results.set_floors()
    text = results.write(args.out)
    png = plot(results.decode, args.out)
    print(text + (f"\nplot: {png}" if png else "\n(no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
