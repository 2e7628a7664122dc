"""One rank of the tensor-parallel checks; tests/runner/test_parallel.py starts N of them
with `python -m torch.distributed.run --nproc-per-node N tests/runner/tp_worker.py ...`.

For each reference model: the same forced-token schedule (fresh random ids,
the same on every rank: a prefill, then decodes with prefills joining) runs
through a ModelRunner over the TP=N model (mrv2, every requested mode, with
debug_checks: the ranks compare each step's graph) and through one over the
whole model (TP=1, uncompiled, mode none), and the logits are compared step
by step (relative error ||a - b|| / ||b||). The TP=N compile is inspected too:
every collective sits inside a piece to capture (never a split point, never
a fallback). Rank 0 writes the results as JSON; any failed check raises, so
torchrun exits non-zero.

    --device cpu   gloo, fp32, mode none, eager pieces (CI)
    --device cpu --standin   the same in graph modes, captured by the CPU stand-in
    --device cuda  NCCL, bf16, the modes given (GPU tests)
    --tp-all-reduce auto   the TP runners' tp_all_reduce (one-shot where it can run)
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import sys
import time
import traceback
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from compile_backend.compile.compiled_step import clear_compiled_steps, compiled_steps  # noqa: E402
from compile_backend.core.config import CompilationConfig  # noqa: E402
from compile_backend.core.counters import counters, reset_counters  # noqa: E402
from compile_backend.core.graph_mode import StepGraph  # noqa: E402
from compile_backend.core.parallel import init_from_env  # noqa: E402
from compile_backend.demo.models import build_model, preset  # noqa: E402
from compile_backend.runner.input_batch import InputBatch  # noqa: E402
from compile_backend.runner.kv_cache_config import KVCacheConfig  # noqa: E402
from compile_backend.runner.model_runner import ModelRunner  # noqa: E402
from compile_backend.runner.parallel import (  # noqa: E402
    RanksDisagree, end_tensor_parallel, exit_process)

# Up to 8 requests: 6 requests decoding pad to 8 tokens, a uniform-decode FULL graph.
KV = dict(num_blocks=1 + 8 * 4, block_size=16, max_model_len=64, max_num_reqs=8, max_num_tokens=64)
NUM_REQS = 6
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]


def schedule(steps: int, seed: int, vocab: int, kv: KVCacheConfig) -> list[InputBatch]:
    """`steps` batches over forced random tokens: request r arrives at step r
    (up to 6) with a prompt of 3..20 tokens, fed in chunks of at most 8; a
    request whose prompt is in decodes one token a step. Request r owns
    slot r, KV blocks from 1 + r * blocks-per-request, compressed blocks likewise."""
    g = torch.Generator().manual_seed(seed)
    bpr, cbpr = kv.max_blocks_per_req, kv.max_compressed_blocks_per_req
    n_reqs = NUM_REQS
    prompt_lens = torch.randint(3, 21, (n_reqs,), generator=g).tolist()
    done = [0] * n_reqs  # tokens cached per request
    batches = []
    for step in range(steps):
        ids, qlens, slens, slots, blocks, cblocks = [], [], [], [], [], []
        for r in range(min(step + 1, n_reqs)):
            n = min(8, prompt_lens[r] - done[r]) if done[r] < prompt_lens[r] else 1
            if done[r] + n > kv.max_model_len:
                continue
            ids += torch.randint(0, vocab, (n,), generator=g).tolist()
            seq = done[r] + n
            qlens.append(n)
            slens.append(seq)
            slots.append(r)
            blocks.append([1 + r * bpr + i for i in range(math.ceil(seq / kv.block_size))])
            groups = math.ceil(seq / kv.compress_ratio)
            cblocks.append([1 + r * cbpr + i for i in range(math.ceil(groups / kv.block_size))])
            done[r] = seq
        batches.append(InputBatch(ids, qlens, slens, slots, block_ids=blocks,
                                  compressed_block_ids=cblocks))
    return batches


_T0 = time.perf_counter()


def log(message: str) -> None:
    """Progress, per rank, as it happens (a hang shows where it stopped)."""
    rank = os.environ.get("RANK", "0")
    print(f"[rank {rank} {time.perf_counter() - _T0:6.1f}s] {message}", flush=True)


def make_runner(name: str, tp_size: int, mode: str, args, reference: bool) -> ModelRunner:
    torch._dynamo.reset()
    reset_counters()
    clear_compiled_steps()
    cfg = preset(args.preset, dtype=getattr(torch, args.dtype), seed=args.seed)
    model = build_model(name, cfg, tp_size).to(args.device)
    kv = KVCacheConfig(**KV)
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, args.device)
    compilation = CompilationConfig(cudagraph_mode="none" if reference else mode,
                                    capture_sizes=CAPTURE_SIZES, piece_compiler=args.compiler,
                                    debug_checks=not reference,
                                    tp_all_reduce="nccl" if reference else args.tp_all_reduce)
    runner = ModelRunner(model, kv, compilation, args.device, progress=False,
                         compile_fn=(lambda m: m) if reference else None)
    log(f"{name} TP={tp_size} {compilation.cudagraph_mode.value}: runner built, capturing")
    runner.capture()
    log(f"{name} TP={tp_size} {compilation.cudagraph_mode.value}: captured "
        f"{counters['cudagraph_captures']} graphs")
    return runner


@torch.no_grad()
def run(runner: ModelRunner, batches: list[InputBatch]) -> list[torch.Tensor]:
    return [runner.execute(b).float().cpu().clone() for b in batches]  # a replay overwrites


def collectives_report(tp_size: int, num_layers: int) -> dict:
    """Where the compiled TP graph put its collectives."""
    pieces = [p for step in compiled_steps() for p in step.pieces]
    holding = [p for p in pieces if p.collectives]
    names = sorted({c for p in pieces for c in p.collectives})
    # all_reduce + wait_tensor, after attention and after the MLP of each layer;
    # one mrv2::all_reduce for each pair where tp_all_reduce put one in (one-shot)
    per_layer = 2 if names == ["mrv2::all_reduce"] else 4
    return {
        "pieces": len(pieces),
        "collective_ops": sum(len(p.collectives) for p in pieces),
        "expected_ops": per_layer * num_layers if tp_size > 1 else 0,
        "all_reduce_ops": names,
        "all_reduce_fallbacks": counters["all_reduce_fallbacks"],
        "in_captured_pieces": all(p.captured and not p.breakpoints for p in holding),
        "collective_fallbacks": counters["collective_fallbacks"],
        "fallback_reasons": [r for p in pieces for r in p.eager_reasons if "collective" in r],
    }


def check_disagreement_raises(runner: ModelRunner, rank: int) -> bool:
    """Ranks that pick different graphs for one step raise (debug_checks)."""
    try:
        runner.parallel.check_step(StepGraph.eager(rank + 1, 1))
    except RanksDisagree as e:
        return "rank 0" in str(e) and "rank 1" in str(e)
    return False


def main(argv=None) -> NoReturn:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="llama,hybrid")
    ap.add_argument("--modes", default="none")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compiler", default="eager")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0, help="weights (the same for TP=1 and TP=N)")
    ap.add_argument("--data-seed", type=int, default=0, help="the forced tokens")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--tp-all-reduce", default="nccl", help="CompilationConfig.tp_all_reduce")
    ap.add_argument("--standin", action="store_true", help="CPU: graphs by the CPU stand-in")
    ap.add_argument("--watchdog", type=float, default=0,
                    help="seconds; past them, print every thread's stack and exit (a hang)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    tp = init_from_env()
    log(f"process group: rank {tp.rank} of {tp.size}")
    try:
        with _graphs(args.standin):
            results = _checks(args, tp)
        # Every runner is gone: release the graphs, then the process group.
        results["graphs_released_at_end"] = end_tensor_parallel()
        log(f"ended: {results['graphs_released_at_end']} graphs released, process group destroyed")
        if tp.rank == 0:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        if results["failures"]:
            raise SystemExit("tensor-parallel checks failed:\n" + "\n".join(results["failures"]))
    except BaseException:
        # A rank that failed between collectives must not wait in NCCL's
        # teardown for the others: exit now, and torchrun stops them.
        traceback.print_exc()
        exit_process(1)
    exit_process(0)  # every check passed, the results written (Note [gloo teardown])


def _graphs(standin: bool) -> contextlib.AbstractContextManager:
    if not standin:
        return contextlib.nullcontext()
    from compile_backend.runtime.graph_pool import use_graph_backend
    from compile_backend.runtime.graph_standin import StandInGraphs

    return use_graph_backend(StandInGraphs())


def _checks(args, tp) -> dict:
    torch.manual_seed(args.seed)
    results = {"world": tp.size, "device": args.device, "dtype": args.dtype, "runs": []}
    failures = []
    for name in args.models.split(","):
        cfg = preset(args.preset)
        batches = schedule(args.steps, args.data_seed, cfg.vocab_size, KVCacheConfig(**KV))
        t0 = time.perf_counter()
        ref = run(make_runner(name, 1, "none", args, reference=True), batches)
        for mode in args.modes.split(","):
            runner = make_runner(name, tp.size, mode, args, reference=False)
            report = collectives_report(tp.size, cfg.num_layers)
            out = run(runner, batches)
            graphs = [runner.dispatch(b) for b in batches]  # what each step ran in
            step_graphs = {}
            for gph in graphs:
                key = gph.mode.value + (" decode" if gph.uniform_decode else "")
                step_graphs[key] = step_graphs.get(key, 0) + 1
            errs = [float((a - b).norm() / b.norm()) for a, b in zip(out, ref)]
            tokens_equal = [bool((a.argmax(-1) == b.argmax(-1)).all()) for a, b in zip(out, ref)]
            row = {"model": name, "mode": mode, "ran_as": runner.mode.value, "steps": len(batches),
                   "tokens_per_step": [b.num_tokens for b in batches], "step_graphs": step_graphs,
                   "max_rel_err": max(errs), "steps_with_equal_argmax": sum(tokens_equal),
                   "graphs_captured": counters["cudagraph_captures"], **report,
                   "disagreement_raises": (check_disagreement_raises(runner, tp.rank)
                                           if runner.parallel is not None else None),
                   "seconds": round(time.perf_counter() - t0, 2)}
            results["runs"].append(row)
            if not max(errs) <= args.tol:
                failures.append(f"{name} {mode}: TP={tp.size} logits differ from TP=1 by "
                                f"{max(errs):.2e} > {args.tol:.0e} (per step: {errs})")
            if report["collective_ops"] != report["expected_ops"] or not report["in_captured_pieces"]:
                failures.append(f"{name} {mode}: collectives misplaced: {report}")
            if report["collective_fallbacks"] or report["fallback_reasons"]:
                failures.append(f"{name} {mode}: collective fallbacks: {report}")
            if row["disagreement_raises"] is False:
                failures.append(f"{name} {mode}: ranks choosing different graphs did not raise")
            log(f"{name} {mode}: max rel err {max(errs):.2e}, graphs {step_graphs}")
            del runner
    results["failures"] = failures
    return results


if __name__ == "__main__":
    main()
