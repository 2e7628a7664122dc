"""Tensor-parallel decode benchmark: TP=1 against TP=N step times, per graph mode.

    torchrun --nproc-per-node 2 bench/tp.py [--model llama] [--preset bench] [--batches 64]
                                            [--context 500] [--modes full,piecewise] [--out DIR]
    torchrun --nproc-per-node 2 bench/decode.py --tp 2 ...   (the same: bench/decode.py execs this)
    torchrun --nproc-per-node 2 bench/tp.py --dry-run        (CPU, gloo: the plumbing only)
    ... --config tp_all_reduce=auto   (CompilationConfig fields of every cell, as bench/decode.py's)

One process per GPU (NCCL). Every rank runs every cell: first the whole
model on each GPU (TP=1, no collective), then the TP=N model; rank 0 writes
the table. A cell is one ModelRunner (mrv2, Inductor pieces) capturing only
the benchmarked batch sizes. Per cell, after 5 warm-up steps:
  step ms          median over `--reps` steps of the runner's whole `execute`
                   of a prepared decode batch (host buffer writes, metadata,
                   replay), CUDA events; the ranks line up (barrier) before each
  back-to-back ms  20 steps queued with no synchronize between them, per step
  replay ms        the FULL graph's replay alone (FULL cells)
  rel err          ||logits - TP=1 logits|| / ||TP=1 logits|| of the first step
                   (bf16; the caches hold the same random values at every TP
                   size: each rank keeps its heads' / channels' slice)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compile_backend as cb  # noqa: E402
from compile_backend.core.parallel import TensorParallel, init_from_env  # noqa: E402
from compile_backend.demo.models import build_model, preset  # noqa: E402
from compile_backend.runner.kv_cache_config import KVCacheConfig  # noqa: E402
from compile_backend.runner.model_runner import ModelRunner  # noqa: E402
from compile_backend.runner.parallel import end_tensor_parallel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ (workload.py)
from workload import config_options, decode_batch, fill_caches  # noqa: E402

TARGET = 0.6  # TP=2 step time over TP=1's, at batch 64, FULL and PIECEWISE alike


def _sync_ranks(tp: TensorParallel, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def step_ms(fn: Callable[[], Any], tp: TensorParallel, cuda: bool, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync_ranks(tp, cuda)
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); torch.cuda.synchronize()  # noqa: E702
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter(); fn(); times.append((time.perf_counter() - t0) * 1e3)  # noqa: E702
    return statistics.median(times)


def back_to_back_ms(fn: Callable[[], Any], tp: TensorParallel, cuda: bool, steps: int = 20,
                    reps: int = 5) -> float:
    def many():
        for _ in range(steps):
            fn()
    return step_ms(many, tp, cuda, reps) / steps


@torch.no_grad()
def run_cell(args, model_name: str, tp_size: int, mode: str, cuda: bool) -> list[dict]:
    torch._dynamo.reset()
    cb.reset_counters()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    device = "cuda" if cuda else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    cfg = preset(args.preset, dtype=torch.bfloat16 if cuda else torch.float32)
    with torch.device(device):  # weights drawn on the device: no host round trip
        model = build_model(model_name, cfg, tp_size)
    tp = model.tp
    kv = KVCacheConfig(num_blocks=max(batches) * (math.ceil((args.context + 1) / 16) + 2) + 2,
                       block_size=16, max_model_len=args.context + 64, max_num_reqs=max(batches),
                       max_num_tokens=max(batches))
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, device)
    fill_caches(model, device)
    config = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=batches,
                                  piece_compiler="inductor" if cuda else "eager",
                                  **args.options)
    t0 = time.perf_counter()
    runner = ModelRunner(model, kv, config, device, progress=False)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"TP={tp.size} {mode}: built in {time.perf_counter() - t0:.1f} s, capturing", flush=True)
    runner.capture()
    startup_s = time.perf_counter() - t0
    rows = []
    for b in batches:
        batch = decode_batch(b, args.context, kv, cfg.vocab_size)
        first = runner.execute(batch).float().cpu().clone()  # a replay overwrites its output
        for _ in range(5):
            runner.execute(batch)
        ms = step_ms(lambda: runner.execute(batch), tp, cuda, args.reps)
        b2b = back_to_back_ms(lambda: runner.execute(batch), tp, cuda)
        step = runner.dispatch(batch)
        replay_ms = None
        entry = getattr(runner.full_graph, "entries", {}).get(step.key)
        if cuda and step.mode is cb.CUDAGraphMode.FULL and entry is not None:
            replay_ms = step_ms(entry.cuda_graph.replay, tp, cuda, args.reps)
        rows.append({"model": model_name, "tp": tp.size, "mode": mode, "batch": b, "ms": ms,
                     "b2b_ms": b2b, "replay_ms": replay_ms, "ran_as": step.mode.value,
                     "graphs": cb.counters["cudagraph_captures"],
                     "collective_fallbacks": cb.counters["collective_fallbacks"],
                     "all_reduce_fallbacks": cb.counters["all_reduce_fallbacks"],
                     "startup_s": startup_s, "first": first})
    del runner, model
    return rows


def write_table(args, meta: dict, rows: list[dict]) -> str:
    os.makedirs(args.out, exist_ok=True)
    clean = [{k: v for k, v in r.items() if k != "first"} for r in rows]
    with open(os.path.join(args.out, "decode_tp.json"), "w") as f:
        json.dump({"meta": meta, "rows": clean}, f, indent=1)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    L = [f"# Tensor-parallel decode ({meta['devices']}, torch {meta['torch']}, NCCL {meta['nccl']}, "
         f"{meta['date']})", "",
         f"Command: `{meta['command']}`; {meta['model']} ({meta['preset']}), {meta['dtype']}, "
         f"{meta['context']} cached tokens per request; median of {meta['reps']} steps after "
         "5 warm-ups, CUDA events; rel err: first step's logits against TP=1.", "",
         "| model | TP | mode | batch | step ms | back-to-back ms | replay ms | rel err | ran as | "
         "graphs | collective fallbacks | startup s |",
         "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        L.append(f"| {r['model']} | {r['tp']} | {r['mode']} | {r['batch']} | {r['ms']:.3f} | "
                 f"{r['b2b_ms']:.3f} | {fmt(r['replay_ms'])} | {r['rel_err']:.1e} | {r['ran_as']} | "
                 f"{r['graphs']} | {r['collective_fallbacks']} | {r['startup_s']:.1f} |")
    L += ["", f"TP={meta['tp']} over TP=1 (target: step <= {TARGET}x at batch 64):", "",
          "| mode | batch | step | back-to-back | replay |", "|---|---:|---:|---:|---:|"]
    one = {(r["mode"], r["batch"]): r for r in rows if r["tp"] == 1}
    for r in rows:
        base = one.get((r["mode"], r["batch"]))
        if r["tp"] == 1 or base is None:
            continue
        replay = (f"{r['replay_ms'] / base['replay_ms']:.2f}x"
                  if r["replay_ms"] and base["replay_ms"] else "-")
        L.append(f"| {r['mode']} | {r['batch']} | {r['ms'] / base['ms']:.2f}x | "
                 f"{r['b2b_ms'] / base['b2b_ms']:.2f}x | {replay} |")
    text = "\n".join(L) + "\n"
    with open(os.path.join(args.out, "decode_tp.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    try:
        return _main(argv)
    except SystemExit:
        raise
    except BaseException:
        # A rank that failed between collectives must not wait in NCCL's
        # teardown for the others: exit now, and torchrun stops them.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=None, help="TP size (default: the processes started)")
    ap.add_argument("--model", choices=["llama", "hybrid"], default="llama")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--modes", default="full,piecewise")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing check (numbers mean nothing)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a CompilationConfig field for every cell, e.g. tp_all_reduce=auto")
    args, _ = ap.parse_known_args(argv)  # bench/decode.py's other flags pass through
    args.options = config_options(ap, args.config)
    tp = init_from_env()
    if args.tp is not None and args.tp != tp.size:
        ap.error(f"--tp {args.tp} needs {args.tp} processes, {tp.size} started: "
                 f"torchrun --nproc-per-node {args.tp} bench/tp.py --tp {args.tp}")
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        ap.error("no CUDA device: run on GPUs, or pass --dry-run to check the plumbing on the CPU")
    if args.dry_run:
        args.preset, args.context, args.modes = "tiny", min(args.context, 40), "none"
    rows = []
    for size in dict.fromkeys([1, tp.size]):
        for mode in args.modes.split(","):
            rows += run_cell(args, args.model, size, mode, cuda)
            if tp.rank == 0:
                print(f"done TP={size} {mode}: {[round(r['ms'], 3) for r in rows[-1:]]} ms", flush=True)
    ref = {(r["mode"], r["batch"]): r["first"] for r in rows if r["tp"] == 1}
    for r in rows:
        base = ref[(r["mode"], r["batch"])]
        r["rel_err"] = float((r["first"] - base).norm() / base.norm())
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "devices": (f"{tp.size}x {torch.cuda.get_device_name()}" if cuda else "CPU dry run"),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
            "python": platform.python_version(), "tp": tp.size, "model": args.model,
            "preset": args.preset, "dtype": "bf16" if cuda else "fp32", "context": args.context,
            "reps": args.reps, "config": args.options,
            "command": " ".join(["torchrun", f"--nproc-per-node {tp.size}", sys.argv[0]]
                                + list(argv if argv is not None else sys.argv[1:]))}
    if tp.rank == 0:
        print(write_table(args, meta, rows))
    del rows  # holds no graph; every runner died with its cell
    end_tensor_parallel()  # graphs first, then the process group (runner/parallel.py)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
