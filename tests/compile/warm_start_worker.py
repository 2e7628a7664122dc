"""One process of the warm-start checks (tests/compile/test_warm_start.py starts it
twice or more with one cache folder).

It builds a seeded 4-layer llama, serves a fixed schedule through a
ModelRunner whose cache_dir is `--cache`, and counts what Dynamo traced
(calls of `convert_frame.fullgraph_capture`, which torch's AOT compile uses,
and of `convert_frame._compile`, the frame callback's). Then it serves the
same schedule through an uncompiled runner and compares every step's logits
and, at the end, every KV cache. One JSON line on stdout.

    python tests/compile/warm_start_worker.py --cache DIR [--mode piecewise] [--device cpu|cuda]
        [--compiler eager|inductor] [--capture-sizes 1,4,8] [--capture-warmup on_demand]
        [--compile-workers N] [--workers-fail]

--workers-fail: every compile worker's job fails (the pieces compile in this
process, as after a worker's error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--cache", required=True)
ap.add_argument("--mode", default="piecewise")
ap.add_argument("--device", default="cpu")
ap.add_argument("--compiler", default="eager")
ap.add_argument("--capture-sizes", default="1,4,8")
ap.add_argument("--debug-checks", action="store_true")
ap.add_argument("--capture-warmup", default="every_size")
ap.add_argument("--compile-workers", type=int, default=None)
ap.add_argument("--workers-fail", action="store_true")
ap.add_argument("--min-fusible", type=int, default=None,
                help="CompilationConfig.inductor_min_fusible_ops (default: its own)")
args = ap.parse_args()
if args.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import contextlib  # noqa: E402

from compile_backend.debug.import_watch import ImportWatch  # noqa: E402  (imports no Dynamo)

traced = {"fullgraph_capture": 0, "frames": 0}


def _counting(name, fn):
    def wrapper(*a, **k):
        traced[name] += 1
        return fn(*a, **k)
    return wrapper


def _count_traces(convert_frame):
    convert_frame.fullgraph_capture = _counting("fullgraph_capture", convert_frame.fullgraph_capture)
    convert_frame._compile = _counting("frames", convert_frame._compile)


# Dynamo's traces are counted once it is imported: importing it here would
# hide whether a warm start needs it.
dynamo = ImportWatch("torch._dynamo")
ImportWatch("torch._dynamo.convert_frame", on_import=_count_traces)

import torch  # noqa: E402

import compile_backend as cb  # noqa: E402
from compile_backend.demo.models import build_model, preset  # noqa: E402
from compile_backend.runner.input_batch import InputBatch  # noqa: E402
from compile_backend.runner.kv_cache_config import KVCacheConfig  # noqa: E402
from compile_backend.runner.model_runner import ModelRunner  # noqa: E402
from compile_backend.compile.compiled_step import compiled_steps  # noqa: E402

INDUCTOR_RUNTIME = ("torch._inductor.select_algorithm", "torch._inductor.output_code",
                    "torch._inductor.compile_fx", "functorch.compile", "networkx")

if args.workers_fail:
    import compile_backend.compile.worker_compile as worker_compile
    from compile_backend.compile.compile_workers import CompileWorkers

    worker_compile.WORKER_COMPILE = "zlib:decompress"  # the payload is no zlib stream: an error

    def _workers_take_every_job(self):
        """Every job to a worker, so that each fails there: this process does
        not drain the queue first (on a loaded machine it would, while the
        workers still import torch, and then nothing would fail)."""
        self.wait_ready()
        return 0

    CompileWorkers.run_queued_here = _workers_take_every_job


device = torch.device(args.device)
dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
kv = KVCacheConfig(num_blocks=64, block_size=16, max_model_len=64, max_num_reqs=4,
                   max_num_tokens=64)


def model():
    torch.manual_seed(1234)
    m = build_model("llama", preset("tiny", num_layers=4, dtype=dtype)).to(device)
    m.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, device)
    return m


def schedule():
    """A prefill of 3 requests (5, 9, 3 tokens), then 3 decode steps: fresh
    random token ids (seeded), each request in its own blocks and slot."""
    g = torch.Generator().manual_seed(99)
    lens = [5, 9, 3]
    for step in range(4):
        qlens = lens if step == 0 else [1, 1, 1]
        seq = [n + step for n in lens]
        ids = torch.randint(0, 200, (sum(qlens),), generator=g).tolist()
        blocks = [[3 * r, 3 * r + 1, 3 * r + 2] for r in range(3)]
        yield InputBatch(ids, list(qlens), seq, [0, 1, 2], block_ids=blocks)


def serve(runner):
    return [runner.execute(batch).float().clone() for batch in schedule()]


graphs = contextlib.nullcontext()
if args.device == "cpu" and args.mode != "none":
    from compile_backend.runtime.graph_pool import use_graph_backend
    from compile_backend.runtime.graph_standin import StandInGraphs

    graphs = use_graph_backend(StandInGraphs())
with graphs, torch.no_grad():
    cb.reset_counters()
    m = model()
    cfg = cb.CompilationConfig(cudagraph_mode=args.mode, piece_compiler=args.compiler,
                               capture_sizes=[int(s) for s in args.capture_sizes.split(",")],
                               cache_dir=args.cache, debug_checks=args.debug_checks,
                               capture_warmup=args.capture_warmup,
                               compile_workers=args.compile_workers,
                               **({} if args.min_fusible is None
                                  else {"inductor_min_fusible_ops": args.min_fusible}))
    runner = ModelRunner(m, kv, cfg, device, progress=False)
    runner.capture()
    got = serve(runner)
    counts = {k: v for k, v in cb.counters.items() if v}
    result = {"how": runner.compiled.how, "path": runner.compiled.path,
              # Before the eager reference below, whose token marks import it.
              "dynamo_imported": dynamo.importer is not None,
              "dynamo_importer": dynamo.importer,
              "load_seconds": runner.compiled.seconds,
              "traced": dict(traced), "counters": counts,
              "capture_stats": {k: v for k, v in runner.capture_stats.items() if k.startswith("gemm")},
              "compiled_with": [p.compiled_with for p in compiled_steps()[-1].pieces if p.captured],
              # Inductor's runtime (an Inductor piece loads it) and torch.compile's
              # compile stack (its wrap imports it): neither comes with Dynamo's import
              "inductor_runtime_loaded": sorted(m for m in INDUCTOR_RUNTIME if m in sys.modules)}
    ref_model = model()
    ref = ModelRunner(ref_model, kv, cb.CompilationConfig(cudagraph_mode="none", cache_dir=None),
                      device, progress=False, compile_fn=lambda mod: mod)
    want = serve(ref)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    result["max_logit_error"] = max((a - b).abs().max().item() for a, b in zip(got, want))
    result["logits_equal"] = all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(got, want))
    caches = [(n, t) for n, t in m.named_buffers()]
    ref_caches = dict(ref_model.named_buffers())
    result["caches_equal"] = all(
        torch.allclose(t.float(), ref_caches[n].float(), rtol=tol, atol=tol) for n, t in caches)
print(json.dumps(result))
