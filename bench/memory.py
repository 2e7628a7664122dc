"""Memory budget benchmark: the KV cache `size_kv_cache` chooses against the
largest one that really fits, and the process's measured peak against the
budget's predicted one, per model and graph mode (issue #23).

    python bench/memory.py [--models llama,hybrid,llama8b] [--modes none,piecewise,...]
                           [--utilization 0.9] [--bisect-steps 3 | --no-bisect] [--bracket 0.03]
                           [--max-model-len 8192] [--max-num-reqs 256] [--max-num-tokens 8192]
                           [--reuse-budget] [--append] [--out bench/results] [--dry-run]
    python bench/memory.py --probe budget|blocks ...     (one fresh process: one JSON line)

Every measurement is a fresh process (`--probe`), so that nothing one leaves
behind (the allocator's cache, cuBLAS's workspaces, loaded kernels) is seen
by the next:
  budget  size_kv_cache(model, config, gpu_memory_utilization=--utilization),
          then the caches it chose are bound, the runner built and captured,
          and a max-batch prefill and a max-batch decode run. The allocator is
          read around each phase: every term of the budget measured again in
          the real run, and the process's peak (max_memory_reserved plus the
          memory outside torch's allocator) against the predicted peak and
          the limit.
  blocks  --num-blocks N, no budget: bind, build, capture, prefill, decode;
          it survives or runs out of memory. The largest N that survives is
          found by bisection (--bisect-steps halvings after the bracket; 0:
          the bracket alone; --no-bisect: no probes at all), starting from the
          budget's num_blocks at utilization 1.0 (the budget process's terms
          recomputed by plan_memory), bracketed by +-bracket.
Models (bf16, inductor pieces, capture sizes 1, 2, 4, 8..256 step 8): llama and
hybrid at the bench preset, llama8b (llama at Llama-3-8B's shape).
Max-batch prefill: max_num_tokens tokens in requests of up to max_model_len
tokens each. Max-batch decode: max_num_reqs requests decoding one token after
the longest context the cache holds for all of them (at most max_model_len - 1).

Results go to <out>/memory.md and memory.json after every cell (a run cut
short keeps what it measured); --append keeps the rows of other cells from an
earlier run there (split a GPU run by --models/--modes to fit a time limit).
The time estimate is printed before anything runs.

--dry-run checks the plumbing on the CPU: tiny preset, fp32, eager pieces,
the graph stand-in, small limits and a simulated device of --dry-run-mib MiB
(a probe "runs out of memory" when its weights, caches and state exceed it).
The numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ (decode.py, workload.py)

from decode import Setup, sync  # noqa: E402  (puts the repo on sys.path)
from report import add_dry_run, add_out, heading, names, run_meta, table, write_md_and_json  # noqa: E402
from workload import decode_batch  # noqa: E402
import compile_backend as cb  # noqa: E402
from compile_backend.core.config import default_capture_sizes  # noqa: E402
from compile_backend.demo.models import build_model, preset  # noqa: E402
from compile_backend.runner.input_batch import InputBatch  # noqa: E402
from compile_backend.runner.kv_cache_config import KVCacheConfig  # noqa: E402
from compile_backend.runner.memory_budget import (  # noqa: E402
    MemoryTerms, cache_layout, plan_memory, size_kv_cache)
from compile_backend.runner.model_runner import ModelRunner  # noqa: E402
from compile_backend.runtime.graph_standin import StandInGraphs  # noqa: E402

JSON_PREFIX = "MEMORY_JSON "
MiB = 1 << 20
GiB = 1 << 30
MODELS = {"llama": ("llama", "bench"), "hybrid": ("hybrid", "bench"), "llama8b": ("llama", "llama8b")}
MODES = ["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]
# Seconds per fresh process on the H200 (import, CUDA init, build, compile,
# capture, steps; startup.md's figures with the compile caches warm): a budget
# process compiles and captures twice (the measurement, then the real runner),
# a blocks probe once.
SECONDS = {"bench": (45, 25), "llama8b": (80, 40), "tiny": (20, 12)}
GPU_LIMITS = dict(max_model_len=8192, max_num_reqs=256, max_num_tokens=8192)
DRY_LIMITS = dict(max_model_len=128, max_num_reqs=8, max_num_tokens=64)
DRY_SIZES = [1, 2, 4, 8]
EXPANSIONS = 10  # bracket steps at most (a guess within 3% needs one)


class OutOfMemory(Exception):
    """A probe that did not fit (the allocator's error, cuBLAS's, or the dry run's)."""


# ---- one process: a budget or a blocks probe ------------------------------------------


def child_setup(spec: dict) -> Setup:
    cuda = not spec["dry_run"]
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run")
    return Setup(device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32,
                 preset="tiny" if spec["dry_run"] else MODELS[spec["model"]][1],
                 piece_compiler="eager" if spec["dry_run"] else "inductor", context=0,
                 graphs=None if cuda else StandInGraphs())


def compilation_config(spec: dict, setup: Setup) -> cb.CompilationConfig:
    sizes = DRY_SIZES if spec["dry_run"] else default_capture_sizes()
    return cb.CompilationConfig(cudagraph_mode=spec["mode"], capture_sizes=sizes,
                                piece_compiler=setup.piece_compiler)


class Meter:
    """The allocator read around phases: reserved after each (settled: cached
    free blocks returned) and each phase's peak; the process's peak over all."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.overall = torch.cuda.max_memory_reserved() if self.cuda else 0

    def settle(self) -> int:
        import gc

        gc.collect()
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    def start(self) -> int:
        reserved = self.settle()
        if self.cuda:
            self.overall = max(self.overall, torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        return reserved

    def peak(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        p = torch.cuda.max_memory_reserved()
        self.overall = max(self.overall, p)
        return p

    def outside_torch(self) -> int:
        """Device memory in use that torch's allocator does not hold."""
        if not self.cuda:
            return 0
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()


def prefill_batch(kv: KVCacheConfig, vocab: int) -> InputBatch:
    """max_num_tokens new tokens in requests of up to max_model_len each (at
    most max_num_reqs of them). Block ids wrap around the cache when it holds
    fewer: which blocks are written changes no memory."""
    g = torch.Generator().manual_seed(2)
    lens, left = [], kv.max_num_tokens
    while left and len(lens) < kv.max_num_reqs:
        lens.append(min(left, kv.max_model_len))
        left -= lens[-1]
    usable = kv.num_blocks - 1
    blocks, cblocks, b, c = [], [], 0, 0
    for n in lens:
        nb, nc = math.ceil(n / kv.block_size), math.ceil(math.ceil(n / kv.compress_ratio) / kv.block_size)
        blocks.append([1 + (b + i) % usable for i in range(nb)])
        cblocks.append([1 + (c + i) % usable for i in range(nc)])
        b, c = b + nb, c + nc
    return InputBatch(token_ids=torch.randint(0, vocab, (sum(lens),), generator=g).tolist(),
                      query_lens=lens, seq_lens=list(lens), req_slots=list(range(len(lens))),
                      block_ids=blocks, compressed_block_ids=cblocks)


def max_decode_batch(kv: KVCacheConfig, vocab: int) -> InputBatch:
    """max_num_reqs requests, one token each, after the longest context the
    cache holds for all of them (workload.decode_batch gives each its own blocks)."""
    per_req = (kv.num_blocks - 1) // kv.max_num_reqs
    context = max(0, min(kv.max_model_len - 1, per_req * kv.block_size - 1))
    return decode_batch(kv.max_num_reqs, context, kv, vocab)


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, (torch.cuda.OutOfMemoryError, OutOfMemory)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)


@torch.no_grad()
def serve(model: torch.nn.Module, kv: KVCacheConfig, config: cb.CompilationConfig, setup: Setup,
          meter: Meter, simulated_total: int | None = None) -> dict[str, Any]:
    """Bind, build, capture, prefill, decode, reading the allocator around each
    phase. Raises OutOfMemory when it does not fit."""
    if simulated_total is not None:  # dry run: the layers' bytes against a simulated device
        need = (sum(p.numel() * p.element_size() for p in model.parameters())
                + cache_layout(model, kv.block_size).nbytes(kv.num_blocks, kv.max_num_reqs))
        if need > simulated_total:
            raise OutOfMemory(f"simulated: {need} bytes > {simulated_total}")
    r_start = meter.start()
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, setup.device)
    r_bound = meter.settle()
    runner = ModelRunner(model, kv, config, setup.device, progress=False)
    r_runner = meter.start()
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    capture_peak = meter.peak()
    r_captured = meter.start()
    vocab = model.cfg.vocab_size
    prefill, decode = prefill_batch(kv, vocab), max_decode_batch(kv, vocab)
    ran = []
    for batch in (prefill, decode):
        runner.execute(batch)
        ran.append(runner.dispatch(batch).mode.value)
    sync(setup)
    serve_peak = meter.peak()
    outside = meter.outside_torch()
    return {
        "reserved_start": r_start, "caches": r_bound - r_start, "runner_buffers": r_runner - r_bound,
        "capture": r_captured - r_runner, "capture_peak": max(capture_peak - r_runner, 0),
        "serving": max(serve_peak - r_captured, 0), "outside_torch": outside,
        "peak_reserved": meter.overall, "peak": meter.overall + outside,
        "startup_above_serving": max(meter.overall - serve_peak, 0), "capture_s": capture_s,
        "prefill": {"tokens": prefill.num_tokens, "reqs": prefill.num_reqs, "ran_as": ran[0]},
        "decode": {"reqs": decode.num_reqs, "context": decode.seq_lens[0] - 1, "ran_as": ran[1]},
    }


def build_model_on(spec: dict, setup: Setup) -> torch.nn.Module:
    name = MODELS[spec["model"]][0]
    with torch.device(setup.device):  # weights drawn on the device (llama8b: 16 GB)
        return build_model(name, preset(setup.preset, dtype=setup.dtype))


def probe(spec: dict) -> dict[str, Any]:
    """One fresh process: spec["kind"] is "budget" or "blocks"."""
    setup = child_setup(spec)
    config = compilation_config(spec, setup)
    limits = {k: spec[k] for k in ("max_model_len", "max_num_reqs", "max_num_tokens")}
    simulated = spec["dry_run_mib"] * MiB if spec["dry_run"] else None
    t0 = time.perf_counter()
    with setup.scope():
        model = build_model_on(spec, setup)
        meter = Meter(setup.device)
        if spec["kind"] == "budget":
            budget = size_kv_cache(model, config, gpu_memory_utilization=spec["utilization"],
                                   block_size=16, device=setup.device, total_bytes=simulated,
                                   progress=False, **limits)
            print(budget.report(), file=sys.stderr, flush=True)
            measured = serve(model, budget.kv_cache_config, config, setup, meter, simulated)
            return {"kind": "budget", "budget": budget.to_dict(), "measured": measured,
                    "seconds": time.perf_counter() - t0}
        kv = KVCacheConfig(num_blocks=spec["num_blocks"], block_size=16, **limits)
        try:
            measured = serve(model, kv, config, setup, meter, simulated)
        except Exception as e:  # noqa: BLE001  (only running out of memory is an answer)
            if not is_out_of_memory(e):
                raise
            return {"kind": "blocks", "num_blocks": kv.num_blocks, "ok": False,
                    "error": f"{type(e).__name__}: {str(e)[:300]}", "seconds": time.perf_counter() - t0}
        return {"kind": "blocks", "num_blocks": kv.num_blocks, "ok": True, "measured": measured,
                "seconds": time.perf_counter() - t0}


# ---- the parent: spawn probes, bisect, write ----------------------------------------


def run_probe(spec: dict, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    if spec["dry_run"]:  # CPU: the kernels' torch references (the interpreter is slow); no saved steps
        env.update(TRITON_INTERPRET="0", MRV2_CACHE_DIR="off")
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith(JSON_PREFIX):
            return json.loads(line[len(JSON_PREFIX):])
    # A process that died without an answer (a CUDA error that kills it, say):
    # for a blocks probe that is a failure to fit; for a budget an error.
    return {"kind": spec["kind"], "ok": False, "num_blocks": spec.get("num_blocks"),
            "error": f"rc {out.returncode}: {(out.stderr or out.stdout)[-1500:]}", "died": True}


def bisect_blocks(survives: Callable[[int], bool], guess: int, bracket: float, steps: int,
                  lowest: int = 2) -> dict[str, Any]:
    """The largest num_blocks for which `survives` holds, between a survivor
    and a failure found from `guess` by steps of +-bracket (doubled each time,
    down by half at most; EXPANSIONS of them at most), then `steps` halvings. Returns the largest survivor, the
    smallest failure (None where not found) and every probe in order."""
    probes: list[tuple[int, bool]] = []

    def test(n: int) -> bool:
        ok = survives(n)
        probes.append((n, ok))
        return ok

    lo = hi = None
    n, width = max(guess, lowest), bracket
    if test(n):
        lo = n
        for _ in range(EXPANSIONS):
            up = max(lo + 1, math.ceil(lo * (1 + width)))
            if not test(up):
                hi = up
                break
            lo, width = up, width * 2
    else:
        hi = n
        for _ in range(EXPANSIONS):
            if hi <= lowest:
                break
            down = max(lowest, min(hi - 1, math.floor(hi * (1 - min(width, 0.5)))))
            if test(down):
                lo = down
                break
            hi, width = down, width * 2
    for _ in range(steps):
        if lo is None or hi is None or hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return {"largest_ok": lo, "smallest_failed": hi, "probes": probes}


def estimate_seconds(cells: list[tuple[str, str]], presets: dict[str, str], steps: int | None,
                     reuse_budget: bool) -> float:
    """steps None: no bisection."""
    total = 0.0
    for model, _ in cells:
        budget_s, probe_s = SECONDS[presets[model]]
        total += (0 if reuse_budget else budget_s) + (probe_s * (2 + steps) if steps is not None else 0)
    return total


def cell_row(model: str, preset_name: str, mode: str, budget_probe: dict, bisect: dict | None,
             utilization: float) -> dict[str, Any]:
    b = budget_probe["budget"]
    m = budget_probe["measured"]
    terms = MemoryTerms.from_dict(b["terms"])
    full = plan_memory(terms, gpu_memory_utilization=1.0, block_size=b["block_size"],
                       max_model_len=b["max_model_len"], max_num_reqs=b["max_num_reqs"],
                       max_num_tokens=b["max_num_tokens"], compress_ratio=b["compress_ratio"])
    rows = {r["term"]: r["bytes"] for r in b["rows"]}
    # Predicted against measured, grouped as the real run's phases read them.
    predicted = {
        "weights, held, workspaces": rows["weights"] + rows["held at start"] + rows["workspaces"],
        "caches (KV, state, rounding)": rows["KV cache"] + rows["per-request state"] + rows["cache rounding"],
        "runner buffers": rows["runner buffers"],
        "graph pool": rows["graph pool"],
        "activations": rows["activations"],
        "outside torch": rows["outside torch at start"] + rows["outside torch, compile+capture"],
        "startup above serving": rows["startup above serving"],
    }
    measured = {
        "weights, held, workspaces": m["reserved_start"], "caches (KV, state, rounding)": m["caches"],
        "runner buffers": m["runner_buffers"], "graph pool": m["capture"], "activations": m["serving"],
        "outside torch": m["outside_torch"], "startup above serving": m["startup_above_serving"],
    }
    largest = bisect["largest_ok"] if bisect else None
    peak = m["peak"] if terms.measured else None  # a dry run reads no allocator
    return {
        "model": model, "preset": preset_name, "mode": mode, "utilization": utilization,
        "num_blocks": b["num_blocks"], "num_tokens": b["num_tokens"],
        "kv_cache_bytes": rows["KV cache"], "limit": b["limit"], "total": terms.total,
        "predicted_peak": b["predicted_peak"], "measured_peak": peak,
        "peak_error": None if peak is None else (peak - b["predicted_peak"]) / b["predicted_peak"],
        "within_limit": None if peak is None else peak <= b["limit"], "terms_predicted": predicted,
        "terms_measured": measured, "budget_at_1": full.num_blocks, "largest_ok": largest,
        "smallest_failed": bisect["smallest_failed"] if bisect else None,
        "budget_at_1_over_largest": (full.num_blocks / largest) if largest else None,
        "probes": bisect["probes"] if bisect else [], "prefill": m["prefill"], "decode": m["decode"],
        "capture_s": m["capture_s"], "budget": b, "measured": m,
    }


def write_results(out_dir: str, meta: dict, rows: list[dict], errors: list[str]) -> str:
    """memory.md and memory.json; returns the markdown."""
    def gib(x):
        return "-" if x is None else f"{x / GiB:.2f}"

    def pct(x):
        return "-" if x is None else f"{x * 100:+.2f}%"

    def cells(r):
        return [r["model"], r["mode"], f"{r['utilization']:g}", r["num_blocks"], gib(r["kv_cache_bytes"]),
                r["num_tokens"], gib(r["predicted_peak"]), gib(r["measured_peak"]), pct(r["peak_error"]),
                gib(r["limit"]), "-" if r["within_limit"] is None else "yes" if r["within_limit"] else "NO",
                r["budget_at_1"], "-" if r["largest_ok"] is None else str(r["largest_ok"]),
                "-" if r["budget_at_1_over_largest"] is None else f"{r['budget_at_1_over_largest']:.4f}",
                len(r["probes"])]

    L = [heading("Memory budget", meta), "",
         f"Command: `{meta['command']}`. Limits: max_model_len {meta['limits']['max_model_len']}, "
         f"max_num_reqs {meta['limits']['max_num_reqs']}, max_num_tokens "
         f"{meta['limits']['max_num_tokens']}, block_size 16; capture sizes {meta['capture_sizes']}; "
         f"PYTORCH_CUDA_ALLOC_CONF={meta['alloc_conf'] or '(unset)'}. Peak = the process's "
         "max_memory_reserved + memory outside torch's allocator at the end. Largest that survives: "
         "bind, capture, a max-batch prefill and a max-batch decode in a fresh process, by bisection "
         "from the budget at utilization 1.0.", ""]
    L += table(["model", "mode", "util", "num_blocks", "KV GiB", "tokens", "predicted peak GiB",
                "measured peak GiB", "error", "limit GiB", "within", "budget@1.0",
                "largest that survives", "budget@1.0 / largest", "probes"],
               "ll" + "r" * 8 + "l" + "r" * 4, [cells(r) for r in rows])
    L += ["", "Terms, predicted / measured in the real run (MiB); each column adds up to its peak:", ""]
    if rows:
        terms = list(rows[0]["terms_predicted"])
        L += table(["model", "mode", *terms, "peak"], "ll" + "r" * (len(terms) + 1),
                   [[r["model"], r["mode"],
                     *(f"{r['terms_predicted'][n] / MiB:.0f} / {r['terms_measured'][n] / MiB:.0f}"
                       for n in terms),
                     f"{r['predicted_peak'] / MiB:.0f} / "
                     + ("-" if r["measured_peak"] is None else f"{r['measured_peak'] / MiB:.0f}")]
                    for r in rows])
    if errors:
        L += ["", "Errors:", ""] + [f"- {e}" for e in errors]
    text = "\n".join(L) + "\n"
    write_md_and_json(os.path.join(out_dir, "memory.md"), text, {"meta": meta, "rows": rows, "errors": errors})
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help=f"comma-separated, of {list(MODELS)} "
                    "(default: all; llama,hybrid on a dry run)")
    ap.add_argument("--modes", default=None, help=f"comma-separated, of {MODES} (default: all; "
                    "full_and_piecewise on a dry run)")
    ap.add_argument("--utilization", type=float, default=0.9, help="gpu_memory_utilization")
    ap.add_argument("--bisect-steps", type=int, default=None,
                    help="halvings after the bracket (0: the bracket alone; default 3, 1 on a dry run)")
    ap.add_argument("--no-bisect", action="store_true", help="budgets only, no blocks probes")
    ap.add_argument("--bracket", type=float, default=0.03, help="first step from the guess, as a fraction")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-reqs", type=int, default=None)
    ap.add_argument("--max-num-tokens", type=int, default=None)
    ap.add_argument("--reuse-budget", action="store_true", help="take each cell's budget from "
                    "<out>/memory.json instead of measuring it again (bisection only)")
    ap.add_argument("--append", action="store_true", help="keep other cells' rows of <out>/memory.json")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per process")
    add_out(ap)
    add_dry_run(ap)
    ap.add_argument("--dry-run-mib", type=int, default=256, help="the dry run's simulated device")
    ap.add_argument("--probe", metavar="SPEC", help=argparse.SUPPRESS)
    return ap


@dataclasses.dataclass
class Plan:
    """What a run measures."""

    cells: list[tuple[str, str]]  # (model, mode)
    presets: dict[str, str]  # model -> preset
    steps: int | None  # bisection halvings after the bracket; None: no blocks probes
    limits: dict[str, int]  # max_model_len, max_num_reqs, max_num_tokens


def plan_run(args, ap) -> Plan:
    dry = args.dry_run
    models = names(ap, "--models", args.models or ("llama,hybrid" if dry else ",".join(MODELS)), MODELS)
    modes = names(ap, "--modes", args.modes or ("full_and_piecewise" if dry else ",".join(MODES)), MODES)
    steps = None if args.no_bisect else (
        args.bisect_steps if args.bisect_steps is not None else (1 if dry else 3))
    limits = dict(DRY_LIMITS if dry else GPU_LIMITS)
    for k in limits:
        if getattr(args, k) is not None:
            limits[k] = getattr(args, k)
    return Plan([(m, mode) for m in models for mode in modes],
                {m: "tiny" if dry else MODELS[m][1] for m in models}, steps, limits)


def announce(plan: Plan, args) -> float:
    """Prints the cells and the time they take (estimate_seconds); returns it."""
    est = estimate_seconds(plan.cells, plan.presets, plan.steps, args.reuse_budget)
    print(f"{len(plan.cells)} cells ({', '.join(f'{m}/{mode}' for m, mode in plan.cells)}): about "
          f"{est / 60:.1f} min ({'budget process' if not args.reuse_budget else 'no budget process'}"
          f"{f' + {2 + plan.steps} probes at most' if plan.steps is not None else ''} per cell)", flush=True)
    if est > 540 and not args.dry_run:
        print("note: over 9 minutes; a GPU machine that limits one command to 10 minutes needs "
              "this split by --models/--modes, with --append", flush=True)
    return est


def largest_that_survives(base: dict, budget_probe: dict, plan: Plan, args) -> dict[str, Any]:
    """bisect_blocks over blocks probes, from the budget's num_blocks at utilization 1.0."""
    terms = MemoryTerms.from_dict(budget_probe["budget"]["terms"])
    guess = plan_memory(terms, gpu_memory_utilization=1.0, block_size=16, **plan.limits).num_blocks
    cell = f"{base['model']}/{base['mode']}"

    def survives(n: int) -> bool:
        r = run_probe({**base, "kind": "blocks", "num_blocks": n}, args.timeout)
        print(f"  {cell}: {n} blocks: {'ok' if r['ok'] else 'failed'}"
              f"{'' if r['ok'] else ' (' + r['error'].splitlines()[-1][:120] + ')'}", flush=True)
        return r["ok"]
    return bisect_blocks(survives, guess, args.bracket, plan.steps)


def measure_cell(model: str, mode: str, plan: Plan, args, earlier: dict, errors: list[str]) -> dict | None:
    """One cell's row: its budget (a budget process, or --reuse-budget's from
    `earlier`), then the bisection; None, its error listed, without a budget."""
    base = {"model": model, "mode": mode, "dry_run": args.dry_run, "dry_run_mib": args.dry_run_mib,
            "utilization": args.utilization, **plan.limits}
    if args.reuse_budget:
        old = next((r for r in earlier["rows"] if (r["model"], r["mode"]) == (model, mode)), None)
        if old is None:
            errors.append(f"{model}/{mode}: --reuse-budget, but "
                          f"{os.path.join(args.out, 'memory.json')} has no budget for it")
            return None
        budget_probe = {"budget": old["budget"], "measured": old["measured"]}
    else:
        budget_probe = run_probe({**base, "kind": "budget"}, args.timeout)
        if "budget" not in budget_probe:
            errors.append(f"{model}/{mode} budget: {budget_probe.get('error')}")
            print(f"{model}/{mode}: budget failed: {budget_probe.get('error')}", flush=True)
            return None
    bisect = None if plan.steps is None else largest_that_survives(base, budget_probe, plan, args)
    return cell_row(model, plan.presets[model], mode, budget_probe, bisect, args.utilization)


def print_cell(row: dict, seconds: float) -> None:
    measured = "-" if row["measured_peak"] is None else f"{row['measured_peak'] / GiB:.2f}"
    error = "-" if row["peak_error"] is None else f"{row['peak_error'] * 100:+.2f}%"
    print(f"{row['model']}/{row['mode']}: {row['num_blocks']} blocks, peak {measured} GiB measured vs "
          f"{row['predicted_peak'] / GiB:.2f} predicted ({error}), "
          f"limit {row['limit'] / GiB:.2f}; largest that survives {row['largest_ok']} "
          f"(budget at 1.0: {row['budget_at_1']}) [{seconds:.0f} s]", flush=True)


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.probe:
        print(JSON_PREFIX + json.dumps(probe(json.loads(args.probe))), flush=True)
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU, or pass --dry-run to check the plumbing on the CPU")
    plan = plan_run(args, ap)
    path = os.path.join(args.out, "memory.json")
    earlier = {"rows": [], "errors": []}
    if (args.append or args.reuse_budget) and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
    est = announce(plan, args)
    meta = {**run_meta("memory", argv, "CPU dry run" if args.dry_run else torch.cuda.get_device_name(),
                       triton=False),
            "limits": plan.limits, "capture_sizes": "1,2,4,8" if args.dry_run else "1,2,4,8..256 step 8",
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "estimate_s": est}
    # --append: every earlier row stays until its cell is measured again (a
    # run cut short loses no row it did not replace).
    rows = list(earlier["rows"]) if args.append else []
    errors = list(earlier["errors"]) if args.append else []
    t_start = time.perf_counter()
    for model, mode in plan.cells:
        t0 = time.perf_counter()
        row = measure_cell(model, mode, plan, args, earlier, errors)
        if row is not None:
            rows = [r for r in rows if (r["model"], r["mode"]) != (model, mode)] + [row]
            print_cell(row, time.perf_counter() - t0)
        write_results(args.out, meta, rows, errors)
    meta["seconds"] = time.perf_counter() - t_start
    print(write_results(args.out, meta, rows, errors))
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
