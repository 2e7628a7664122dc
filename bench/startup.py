"""Startup as a user feels it: each measurement is a fresh process.

    python bench/startup.py [--models llama] [--preset bench,llama8b] [--modes piecewise,full]
                            [--phases cold,warm] [--out bench/results/startup.md]
    python bench/startup.py --smoke          (CPU check: tiny model, eager pieces, graph stand-in)
    python bench/startup.py --merge a.json b.json --out bench/results/startup.md

For every (model, preset, graph mode) the parent runs this file again with
`--child` (a subprocess that prints one JSON line), twice:
  cold  new, empty cache folders: TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR
        (the project's Triton kernels too) and MRV2_CACHE_DIR (mrv2's
        warm-start cache, used where the backend has one)
  warm  a second process with the same folders
A child reports: interpreter start (the process's age at the script's first
line), import (torch, compile_backend, the bench helpers), CUDA init, build
(model weights, KV caches and the runner: bench/decode.py's `build` less its
compile and capture), compile (the first call: runner.warmup at the largest
capture size), capture (runner.capture(): the whole plan; graphs = CUDA
graphs captured, plan = len(runner.captures)), first step (one decode
runner.execute + synchronize) and the counters (piece_compiles,
piece_compile_reuses, inductor_compiles, dynamo_graphs). Start to first step
is measured by the parent: from just before it spawns the process to the
child's clock at the end of the first step (same machine, time.time()).

Without CUDA it runs on the CPU with the tiny preset, eager pieces and the
graph stand-in (timings mean little); --smoke does that quickly whatever the
machine, and writes into a temporary folder unless --out is given.
"""

import time  # the child's clock starts here, before torch is imported

_T0 = time.perf_counter()
_WALL0 = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

_T_TORCH = time.perf_counter()  # torch's import, apart from mrv2's
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ (decode.py, workload.py)

from decode import Setup, build, sync  # noqa: E402  (puts the repo on sys.path)
from report import (  # noqa: E402
    add_dry_run, add_out, comma_list, command_line, dash, heading, table, utc_now, write_md_and_json)
from timing import host_speed  # noqa: E402
from workload import config_options, decode_batch, mixed_batch  # noqa: E402
from compile_backend.core.counters import counters  # noqa: E402
from compile_backend.runtime.graph_standin import StandInGraphs  # noqa: E402

_T_IMPORTED = time.perf_counter()
from compile_backend.debug.import_watch import ImportWatch  # noqa: E402

# Who imports Dynamo in this process, and what its import costs (a warm
# start that loads its step without Dynamo should not: "never").
_DYNAMO = ImportWatch("torch._dynamo")

JSON_PREFIX = "STARTUP_JSON "
GPU_SIZES = [1, 2, 4] + list(range(8, 257, 8))  # the default capture sizes: 35
CPU_SIZES = [1, 2, 4, 8]
COUNTERS = ("piece_compiles", "piece_compile_reuses", "inductor_compiles", "dynamo_graphs",
            "pieces", "cudagraph_captures", "capture_warmups", "capture_warmups_skipped",
            "triton_compiles", "capture_waits", "kernels_precompiled", "kernels_preloaded",
            "first_step_dry_runs", "prefill_dry_runs", "scout_dry_runs", "captures_deferred",
            "compile_worker_compiles",
            "compile_worker_fallbacks", "mixed_graphs_derived", "mixed_graph_refusals",
            "kernels_compiled_in_workers", "kernel_worker_fallbacks")
# What to compare with (issue #21).
ANCHORS = [  # (figure, vLLM, target, phase, field)
    ("cold compile s", "~19 (Dynamo 4.6 + Inductor 14.8)", "<= 15", "cold", "compile_s"),
    ("warm compile s", "-", "-", "warm", "compile_s"),
    ("warm start to first step s", "~9 (warm start with Inductor's cache)", "<= 5", "warm",
     "start_to_first_step_s"),
    ("mrv2's share of a warm start s", "-", "<= 3 (issue #36)", "warm", "mrv2_share_s"),
    ("capture s (whole plan), warm", "~2", "<= 1 per mode (issue #36)", "warm", "capture_s"),
    ("capture s (whole plan), cold", "-", "<= 3 per mode (issue #36)", "cold", "capture_s"),
]


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere):
    the interpreter's own start-up before the script's first line."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


# ---- the child: one fresh process, one (model, preset, mode) -----------------------------


def capture_profile(captures) -> dict:
    """The plan's host time per phase (ModelRunner's CaptureRecord split):
    seconds summed over the plan, per graph kind (piecewise / full)."""
    out: dict = {}
    for c in captures:
        row = out.setdefault(c.graph.mode.value, {"graphs": 0, "warmups": 0, "total_s": 0.0,
                                                  "warmup_s": 0.0, "record_s": 0.0,
                                                  "instantiate_s": 0.0})
        row["graphs"] += 1
        row["warmups"] += c.warmup_s > 0
        row["total_s"] += c.seconds
        row["warmup_s"] += c.warmup_s
        row["record_s"] += c.record_s
        row["instantiate_s"] += c.instantiate_s
    for row in out.values():
        row["other_s"] = row["total_s"] - row["warmup_s"] - row["record_s"] - row["instantiate_s"]
    return out


@contextlib.contextmanager
def triton_requests():
    """The Triton kernels asked for inside (a JIT cache miss: a compile, or
    a load from Triton's disk cache), by name: Triton's jit_cache_hook,
    chained to one already set. Empty where Triton has no hook or
    interprets (it compiles nothing)."""
    asked: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        yield asked
        return
    previous = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        asked.append(str(kwargs.get("repr") or "a kernel").split("[", 1)[0])
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
        yield asked
    finally:
        knobs.runtime.jit_cache_hook = previous


@torch.no_grad()
def child(spec: dict) -> dict:
    interpreter_s = process_age()
    if interpreter_s is not None:  # the age now, less what the script has done so far
        interpreter_s -= time.perf_counter() - _T0
    cuda = spec["device"] == "cuda"
    setup = Setup(device=spec["device"], dtype=torch.bfloat16 if cuda else torch.float32,
                  preset=spec["preset"], piece_compiler=spec["piece_compiler"],
                  context=spec["context"], graphs=None if cuda else StandInGraphs(),
                  options={"capture_warmup": spec.get("capture_warmup", "on_demand"),
                           "compile_workers": spec.get("compile_workers"),
                           **spec.get("config", {}),
                           # warm-nogemms: a warm start that leaves the saved GEMM list unused
                           "warm_gemms": spec.get("phase") != "warm-nogemms"})
    t = time.perf_counter()
    if cuda:  # the context, on its own (otherwise inside the model's build)
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
    cuda_init_s = time.perf_counter() - t
    sizes = spec["sizes"]
    max_reqs = max(sizes)  # every size is a decode size: FULL captures 2 graphs per size
    blocks = max_reqs * (math.ceil((setup.context + 1) / 16) + 2) + 2  # as decode.run_decode
    with setup.scope():
        t = time.perf_counter()
        timer = None
        if spec.get("by_op"):
            from op_timer import OpTimer

            timer = OpTimer()
        runner, model, kv, s = build(spec["model"], f"mrv2-{spec['mode']}", setup, sizes,
                                     max_reqs, max(sizes), blocks, capture_context=timer)
        build_total_s = time.perf_counter() - t
        batch = decode_batch(min(spec["batch"], max_reqs), setup.context, kv, model.cfg.vocab_size)
        t = time.perf_counter()
        with triton_requests() as asked:
            out = runner.execute(batch)
            sync(setup)
        t_end = time.perf_counter()
        wall_end = time.time()
        first_step_s = t_end - t
        finite = bool(torch.isfinite(out.float()).all())
        step_mode = runner.dispatch(batch).mode.value
        # Then the first prefill: one request of a prompt of a token count
        # 16 does not divide (a serving engine's first step is one; a plan's
        # dummy batches never run the prefill kernels).
        prefill = mixed_batch(max(sizes) - 3 if max(sizes) > 4 else max(sizes), 0, setup.context,
                              kv, model.cfg.vocab_size)
        t = time.perf_counter()
        with triton_requests() as asked_prefill:
            runner.execute(prefill)
            sync(setup)
        first_prefill_s = time.perf_counter() - t
        prefill_mode = runner.dispatch(prefill).mode.value
    return {
        **{k: spec[k] for k in ("model", "preset", "mode", "phase")},
        "interpreter_s": interpreter_s, "import_s": _T_IMPORTED - _T0,
        "import_torch_s": _T_TORCH - _T0, "import_mrv2_s": _T_IMPORTED - _T_TORCH,
        "cuda_init_s": cuda_init_s,
        "build_s": build_total_s - s["compile_s"] - s["capture_s"],
        "model_s": s["model_s"], "runner_s": s["runner_s"],
        # What mrv2 costs a start: its import, the runner, the compile (or
        # the load), the capture and the first step; not the interpreter,
        # torch, CUDA's context, the weights or the bench's own settling
        # before the build and between compile and capture (full
        # gc.collects, empty_cache: for its memory readings, and for the
        # variants the decode bench builds one after another; no user pays it).
        "mrv2_share_s": (_T_IMPORTED - _T_TORCH) + (build_total_s - s["model_s"] - s["settle_s"])
        + first_step_s,
        "settle_s": s["settle_s"],
        "capture_profile": capture_profile(runner.captures),
        "capture_by_op": timer.rows() if timer is not None else None,
        "host_speed": dataclasses.asdict(host_speed()),
        "capture_stats": dict(getattr(runner, "capture_stats", {})),
        "first_call_phases": dict(getattr(runner.compiled, "phases", {})),
        "first_call_load_parts": dict(getattr(runner.compiled, "load_parts", {})),
        "first_call_path": getattr(runner.compiled, "path", None),
        "dynamo_importer": _DYNAMO.importer, "dynamo_import_s": _DYNAMO.seconds,
        "compile_s": s["compile_s"], "capture_s": s["capture_s"], "first_step_s": first_step_s,
        "first_step_triton_requests": asked,
        "first_prefill_s": first_prefill_s, "first_prefill_tokens": prefill.num_tokens,
        "first_prefill_ran_as": prefill_mode, "first_prefill_triton_requests": asked_prefill,
        "since_first_line_s": t_end - _T0, "wall_end": wall_end, "wall_first_line": _WALL0,
        # graphs captured, and mixed FULL graphs made from decode graphs
        # (CompilationConfig.derive_mixed_graphs) beside them
        "graphs": counters["cudagraph_captures"] + counters["mixed_graphs_derived"],
        "plan": len(runner.captures),
        "pool_bytes": s["pool_bytes"], "first_step_ran_as": step_mode, "first_step_finite": finite,
        "counters": {k: counters[k] for k in COUNTERS},
        "capture_warmup": spec.get("capture_warmup", "on_demand"),
        "device_name": torch.cuda.get_device_name() if cuda else "CPU (graph stand-in)",
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "mrv2_cache_dir": os.environ.get("MRV2_CACHE_DIR"),
    }


def profiled_child(spec: dict) -> dict:
    """`child` under cProfile; the stats go to spec["profile"] (--profile)."""
    import cProfile
    import io
    import pstats

    os.makedirs(spec["profile"], exist_ok=True)
    name = os.path.join(spec["profile"], "-".join(spec[k] for k in ("model", "preset", "mode",
                                                                    "phase")))
    prof = cProfile.Profile()
    row = prof.runcall(child, spec)
    prof.dump_stats(name + ".prof")
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(120)
    with open(name + ".txt", "w") as f:
        f.write(text.getvalue())
    return row


# ---- the parent: spawn, collect, write ---------------------------------------------------


def folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


# What a child imports before and during its first step, compiled to bytecode
# before the cold child runs (prime_bytecode).
PRIME_IMPORTS = ("torch, torch._dynamo, torch._inductor.compile_fx, torch._inductor.standalone_compile, "
                 "torch._inductor.codegen.triton, torch._inductor.codegen.wrapper, "
                 "torch._inductor.runtime.triton_heuristics, torch.fx._graph_pickler, triton, "
                 "triton.compiler, compile_backend.runner.model_runner, compile_backend.kernels, "
                 "compile_backend.compile.compiled_step")


def bytecode_missing() -> bool:
    """Is torch installed without bytecode, and unable to write it (this
    process imported torch: a writable install has its .pyc by now)? Then
    every process compiles torch's sources, seconds of each import; an
    install by pip writes the bytecode at install time."""
    import importlib.util

    return not os.path.exists(importlib.util.cache_from_source(torch.__file__))


# Packages whose every module is compiled ahead (what pip's install does):
# Dynamo and Inductor import much of torch lazily, during the first compile
# or load (torch.distributed, torch.ao, the Inductor templates), so priming
# only what PRIME_IMPORTS names left ~1400 modules compiled from source in
# every warm child (seconds of its "compile" column).
PRIME_PACKAGES = ("torch", "triton", "sympy", "networkx", "jinja2", "mpmath", "depyf")


def prime_bytecode(env: dict[str, str]) -> float:
    """Compile what the children import into env["PYTHONPYCACHEPREFIX"]
    (untimed): every module of PRIME_PACKAGES in parallel, then an import of
    PRIME_IMPORTS for the rest (the project's own modules). The cold and warm
    children then import from bytecode as from a pip install. Returns its
    seconds."""
    import importlib.util

    t0 = time.perf_counter()
    dirs = []
    for name in PRIME_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    if dirs:  # some test files of these packages do not compile: not an error here
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-c", f"import {PRIME_IMPORTS}"], env=env, check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return time.perf_counter() - t0


def run_child(spec: dict, caches: dict[str, str], timeout: float) -> dict:
    env = dict(os.environ, **caches)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    spawn = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {**spec, "error": f"timed out after {timeout:.0f} s",
                "stderr_tail": (e.stderr or b"")[-3000:].decode(errors="replace")
                if isinstance(e.stderr, bytes) else (e.stderr or "")[-3000:]}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(JSON_PREFIX)]
    if proc.returncode != 0 or not lines:
        return {**spec, "error": f"exit code {proc.returncode}",
                "stderr_tail": (proc.stderr or proc.stdout)[-3000:]}
    row = json.loads(lines[-1][len(JSON_PREFIX):])
    row["start_to_first_step_s"] = row["wall_end"] - spawn
    row["spawn_to_first_line_s"] = row["wall_first_line"] - spawn
    row["process_s"] = time.time() - spawn  # teardown included
    row["cache_bytes"] = {k: folder_bytes(v) for k, v in caches.items()}
    return row


def process_cells(r: dict) -> list:
    """One fresh process's row of the first table."""
    c, mib = r["counters"], {k: v / 2**20 for k, v in r.get("cache_bytes", {}).items()}
    caches = " / ".join(dash(mib.get(k), ".1f") for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                                                          "MRV2_CACHE_DIR"))
    return [r["model"], r["preset"], r["mode"], r["phase"], dash(r["compile_s"], ".1f"),
            dash(r["capture_s"], ".2f"), r["graphs"], dash(r["start_to_first_step_s"], ".1f"),
            dash(r.get("mrv2_share_s"), ".1f"), c["piece_compiles"], c["piece_compile_reuses"],
            c["inductor_compiles"], c.get("compile_worker_compiles", "-"), c["dynamo_graphs"],
            dash(r.get("import_torch_s"), ".1f"),
            dash(r.get("import_mrv2_s"), ".2f"), dash(r.get("model_s"), ".1f"),
            dash(r.get("runner_s"), ".2f"), dash(r["first_step_s"], ".3f"), r["plan"], caches]


def tables(meta: dict, rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    first = ok[0] if ok else {}
    L = [heading("Startup", {"gpu": first.get("device_name", meta.get("device", "?")),
                             "torch": first.get("torch", torch.__version__),
                             "triton": first.get("triton", "?"), "date": meta["date"]}),
         "",
         f"Command: `{meta['command']}`. Each row is one fresh process (`bench/startup.py --child`); "
         "cold: new TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and MRV2_CACHE_DIR folders; warm: a "
         "second process with the same folders. "
         f"Capture sizes: {meta['sizes_text']} (max_num_reqs = the largest); first step: a decode "
         f"batch of {meta['batch']} requests with {meta['context']} cached tokens. compile: the "
         "first call (runner.warmup at the largest size); capture: runner.capture(), the whole "
         "plan (graphs: CUDA graphs captured or derived (derive_mixed_graphs); plan: sizes x "
         "graph kinds); start to first step: "
         "from the parent's spawn of the process to the end of the first step (interpreter "
         "start, imports, CUDA init, model build included); build: model weights (random), KV "
         "caches, runner; mrv2's share: mrv2's import, the runner, the compile or load, the "
         "capture and the first step (not the interpreter, torch, CUDA's context, the weights or "
         "the bench's own gc.collect and empty_cache between compile and capture); in workers: "
         "distinct Inductor pieces compiled by compile worker processes (CompilationConfig.compile_workers)." + (f" Bytecode: {meta['bytecode']}." if meta.get("bytecode") else ""),
         ""]
    L += table(["model", "preset", "mode", "phase", "compile s", "capture s", "graphs",
                "start-to-first-step s", "mrv2's share s", "piece_compiles", "reuses",
                "inductor_compiles", "in workers", "dynamo_graphs", "import torch s", "import mrv2 s",
                "weights s", "runner s", "first step s", "plan",
                "caches MiB after (inductor / triton / mrv2)"],
               "llll" + "r" * 16 + "l",
               [[r["model"], r["preset"], r["mode"], r["phase"], f"failed: {r['error']}"] + [None] * 16
                if "error" in r else process_cells(r) for r in rows])
    L += ["", "Capture profile: host seconds of runner.capture() by phase, summed over the "
          "plan's graphs (warm-up: the eager step before a capture; record: the step run under "
          "capture; instantiate: capture_end; other: the capture call's Python outside those, "
          "eager attention between pieces, the replay after each capture). Kernels compiled "
          "ahead (runtime/kernel_precompile.py), per row: waited: graphs whose capture needed a "
          "new Triton kernel and waited for the workers after a dry warm-up; ahead: Triton kernels "
          "the first step and the plan asked for (compiled in line, on workers, or loaded from "
          "the saved list); preloaded: of those, loaded from the warm-start entry's list before "
          "the first capture; in processes: of those, compiled by a worker process "
          "(precompile_workers, a cold start; '+N here': N its workers could not compile); "
          "wait s: host seconds the plan blocked on the workers. A graph "
          "that waited has its refused attempt (other) and its dry warm-up (warm-up) in its "
          "record. Plan outside graphs s: capture s less every graph's total and the wait "
          "(the plan's collection, synchronizes and the saved kernels' submission).", ""]
    L += table(["model", "preset", "mode", "phase", "capture_warmup", "graph kind", "steps", "warm-ups",
                "total s", "warm-up s", "record s", "instantiate s", "other s", "per step ms",
                "waited", "ahead", "preloaded", "in processes", "wait s", "plan outside graphs s"],
               "l" * 6 + "r" * 14,
               [[r["model"], r["preset"], r["mode"], r["phase"], r.get("capture_warmup", "every_size"),
                 kind, p["graphs"], p.get("warmups", "-"), f"{p['total_s']:.2f}", f"{p['warmup_s']:.2f}",
                 f"{p['record_s']:.2f}", f"{p['instantiate_s']:.2f}", f"{p['other_s']:.2f}",
                 f"{1e3 * p['total_s'] / max(p['graphs'], 1):.1f}",
                 *precompile_cells(r), outside_graphs(r) if i == 0 else ""]
                for r in ok for i, (kind, p) in enumerate(r.get("capture_profile", {}).items())])
    with_phases = [r for r in ok if r.get("first_call_phases")]
    if with_phases:
        names = [n for n in FIRST_CALL_PHASES if any(n in r["first_call_phases"] for r in with_phases)]
        L += run_table(with_phases, "The first call (compile s above) by phase, host seconds "
                       "(GuardFreeModel.phases: key: the entry's header; read; resolve: the direct "
                       "path's graph inputs found; deserialize: mrv2's step and its pieces' "
                       "artifacts, and on the dynamo path Dynamo's code and guards; guard_check; wrap: "
                       "torch.compile and the imports it makes; compile: a cold start's trace and "
                       "pieces; first_run: the first step through the new code; save, after it). "
                       "Dynamo's import, where one comes, is inside them; it and the runner's own "
                       "first-step work (its dry run, the inputs) are the rest of compile s.", names,
                       lambda r: [dash(r["first_call_phases"].get(n), ".2f") for n in names])
    parts = ("dynamo", "step_graph", "step_pieces")
    L += run_table([r for r in ok if r.get("first_call_load_parts")],
                   "A load's deserialize by part, host seconds (GuardFreeModel.load_parts: dynamo: "
                   "Dynamo's code and guards, and the imports they make; step graph: mrv2's split "
                   "graph unpickled and its code generated; step pieces: the pieces' Inductor "
                   "artifacts, and the imports they make).",
                   ["deserialize", "dynamo", "step graph", "step pieces"],
                   lambda r: [dash(r["first_call_phases"].get("deserialize"), ".2f"),
                              *[dash(r["first_call_load_parts"].get(k), ".2f") for k in parts]])
    L += run_table([r for r in ok if "dynamo_importer" in r],
                   "The load's path and Dynamo's import (compile_backend/debug/import_watch.py): "
                   "direct: the step loaded alone and called without Dynamo (docs/design.md, \"A "
                   "warm start without Dynamo\"); dynamo: through Dynamo's saved code; imported by: "
                   "the first importer of torch._dynamo (never: not imported; "
                   "_UndoWrites.__torch_dispatch__: the CPU graph stand-in's dispatch mode, which "
                   "torch wraps in Dynamo's disable); import s: that import's wall seconds, inside "
                   "whichever phase made it.",
                   ["path", "Dynamo imported by", "Dynamo import s"],
                   lambda r: [r.get("first_call_path") or "-", r["dynamo_importer"] or "never",
                              f"{r['dynamo_import_s']:.2f}" if r["dynamo_importer"] else "-"])
    gemms = (("gemms_recorded", "d"), ("gemm_record_s", ".2f"), ("gemm_warmup_calls", "d"),
             ("gemm_warmup_s", ".2f"), ("gemm_warmup_wait_s", ".2f"))
    L += run_table([r for r in ok if any(k.startswith("gemm") for k in (r.get("capture_stats") or {}))],
                   "cuBLAS's first calls (runtime/gemm_warmup.py), inside compile s: a start without "
                   "a saved GEMM list records one more eager step's GEMMs (recorded, record s); one "
                   "with it runs each at every capture size on a thread while its first step loads, "
                   "and a cold one where kernels compile ahead while the workers compile its first "
                   "step's (calls, thread s, and the first step's wait for it at the join).",
                   ["recorded", "record s", "calls", "thread s", "join wait s"],
                   lambda r: [dash(r["capture_stats"].get(k), f) for k, f in gemms])
    L += run_table([r for r in ok if r.get("host_speed")],
                   "The host's speed in each process, after its first step (bench/timing.host_speed: "
                   "a fixed pure-Python loop, and torch's dispatch of a small CPU op). Hosts of one "
                   "kind differ by up to 2x; the host-bound figures above (load, capture) move with "
                   "them.", ["Python µs", "dispatch µs"],
                   lambda r: [f"{r['host_speed']['python_us']:.0f}",
                              f"{r['host_speed']['dispatch_us']:.2f}"])
    L += run_table([r for r in ok if "first_step_triton_requests" in r],
                   "The first step's Triton kernel requests (a JIT cache miss: a compile, or a "
                   "load from Triton's disk cache, on the step's own time; 0 where nothing of the "
                   "step was left to the first real batch).", ["requests", "kernels"],
                   lambda r: request_cells(r["first_step_triton_requests"]))
    L += run_table([r for r in ok if "first_prefill_triton_requests" in r],
                   "The first prefill, after the first step: one request of a prompt (max size "
                   "- 3 tokens), as a serving engine's first step; its seconds, how it ran, and "
                   "its Triton kernel requests (a cold plan runs prefill shapes dry: "
                   "runner/capture.py, PREFILL_DRY_SHAPES).",
                   ["tokens", "ran as", "seconds", "requests", "kernels"],
                   lambda r: [r["first_prefill_tokens"], r["first_prefill_ran_as"],
                              f"{r['first_prefill_s']:.3f}",
                              *request_cells(r["first_prefill_triton_requests"])])
    L += run_table([r for r in ok if (r.get("capture_stats") or {}).get("kernels_by_name")],
                   "The Triton kernels the first step and the plan asked for, by kernel: how many "
                   "specialisations of each (compiled or loaded; the 'ahead' column's parts).",
                   ["kernels"],
                   lambda r: [", ".join(f"{k} {n}" for k, n in
                                        r["capture_stats"]["kernels_by_name"].items())])
    L += run_table([r for r in ok if (r.get("capture_stats") or {}).get("kernel_timeline")],
                   "When the kernels were asked for and ready (runtime/kernel_precompile.py's "
                   "timeline), seconds from the plan's first capture (negative: the first step's "
                   "dry run), with the graph or dry step that asked in brackets; a plan's wait is "
                   "for its last-asked kernels (the capture order: "
                   "CompilationConfig.scout_sizes_first). took: the longest from asked to ready.",
                   ["first step's", "plan's", "last asked s", "last ready s", "took s (max)",
                    "kernel asked -> ready s"], timeline_cells)
    L += by_op_tables(ok)
    L += ["", "Anchor figures: vLLM's for Llama-3-8B and the targets of issue #21 (\"start in "
          "seconds\"), against this run:", ""] + anchor_table(ok)
    odd = [r for r in ok if not r["first_step_finite"] or r["first_step_ran_as"] != r["mode"]]
    if odd:
        L += ["", "First step not as expected (non-finite logits, or not run in the row's mode): "
              + "; ".join(f"{r['model']} {r['preset']} {r['mode']} {r['phase']}: ran as "
                          f"{r['first_step_ran_as']}, finite {r['first_step_finite']}" for r in odd)]
    failed = [r for r in rows if "error" in r]
    for r in failed:
        L += ["", f"{r['model']} {r['preset']} {r['mode']} {r['phase']} failed ({r['error']}):",
              "", "```", r.get("stderr_tail", "").rstrip(), "```"]
    return "\n".join(L) + "\n"


def by_op_tables(ok: list[dict]) -> list[str]:
    """--by-op: one table per row, runner.capture()'s host seconds by callee."""
    L = []
    for r in ok:
        if not r.get("capture_by_op"):
            continue
        L += ["", f"runner.capture() by callee, {r['model']} {r['preset']} {r['mode']} "
              f"{r['phase']} ({r['capture_s']:.2f} s, unprofiled, bench/op_timer.py): self host "
              "seconds of each mrv2 op (the default overload, as the pieces call it, and its "
              "direct calls from eager pieces, as PIECEWISE's attention), of the "
              "loaded Inductor pieces' own code (piece: their wrappers, Inductor's launches, the "
              "allocations they make), of the compiled step's own code (step: its split graph, the "
              "eager pieces between graphs), of the replay after each capture "
              "(replay), of each graph's inputs and metadata (capture inputs), of what a cold "
              "start adds (Triton's compiles in line, the precompiler's waits, Inductor's "
              "autotune), of synchronize and gc.collect, and of the rest "
              "(outside: the runner's capture loop, capture_begin and capture_end, the "
              "wrappers' own Python).", ""]
        L += table(["callee", "calls", "self s", "µs a call"], "lrrr",
                   [[n, c or "-", f"{s:.3f}", f"{1e6 * s / c:.1f}" if c else "-"]
                    for n, c, s in r["capture_by_op"]])
    return L


def timeline_cells(r: dict) -> list:
    """A row's kernel timeline (capture_stats["kernel_timeline"]: [name, asked,
    ready, what asked]; runs before the thirteenth session's last have no asker)."""
    rows = [(*row[:3], row[3] if len(row) > 3 else "") for row in r["capture_stats"]["kernel_timeline"]]
    ready = [done for _, _, done, _ in rows if done is not None]
    took = [done - at for _, at, done, _ in rows if done is not None]
    return [sum(at < 0 for _, at, _, _ in rows), sum(at >= 0 for _, at, _, _ in rows),
            f"{max(at for _, at, _, _ in rows):.2f}", f"{max(ready):.2f}" if ready else "-",
            f"{max(took):.2f}" if took else "-",
            "; ".join(f"{name}{f' ({by})' if by else ''} {at:.2f} -> "
                      f"{'-' if done is None else f'{done:.2f}'}" for name, at, done, by in rows)]


def request_cells(asked: list[str]) -> list:
    """How many Triton kernel requests, and the kernels' names ('-': none)."""
    return [len(asked), ", ".join(sorted(set(asked))) or "-"]


def run_table(rows: list[dict], intro: str, columns: list[str], cells) -> list[str]:
    """A paragraph and a table of one row per run (model, preset, mode,
    phase, then `cells(row)`); nothing without rows."""
    if not rows:
        return []
    return ["", intro, "", *table(["model", "preset", "mode", "phase", *columns],
                                  "llll" + "r" * len(columns),
                                  [[r["model"], r["preset"], r["mode"], r["phase"], *cells(r)]
                                   for r in rows])]


FIRST_CALL_PHASES = ("key", "read", "resolve", "deserialize", "guard_check", "wrap", "compile",
                     "first_run", "save")


def outside_graphs(r: dict) -> str:
    """Host seconds of runner.capture() in no graph's record and not waiting
    for kernels: the plan's own start and end (its collection, synchronizes,
    the saved kernels' submission), on the row's first graph kind."""
    total = sum(p["total_s"] for p in r.get("capture_profile", {}).values())
    wait = (r.get("capture_stats") or {}).get("compile_wait_s", 0.0)
    return dash(r["capture_s"] - total - wait, ".2f") if r.get("capture_s") is not None else "-"


def precompile_cells(r: dict) -> list:
    """waited, ahead, preloaded, in processes, wait s of one row ('-' where
    the run had no precompiler)."""
    st, c = r.get("capture_stats") or {}, r.get("counters", {})
    if not st:
        return ["-"] * 5
    here = c.get("kernel_worker_fallbacks", 0)
    # kernels_recorded: "kernels_precompiled" in earlier runs (the counter's name)
    return [st.get("graphs_waited", 0), st.get("kernels_recorded", st.get("kernels_precompiled", 0)),
            c.get("kernels_preloaded", 0),
            f"{c.get('kernels_compiled_in_workers', 0)}" + (f" +{here} here" if here else ""),
            f"{st.get('compile_wait_s', 0.0):.2f}"]


def anchor_table(ok: list[dict]) -> list[str]:
    """ANCHORS against one column per measured (model, preset, mode, capture_warmup)."""
    def column_of(r):
        return r["model"], r["preset"], r["mode"], r.get("capture_warmup", "every_size")

    keys = list(dict.fromkeys(column_of(r) for r in ok))
    rows = []
    for name, vllm, target, phase, field in ANCHORS:
        vals = []
        for key in keys:
            match = [r for r in ok if column_of(r) == key and r["phase"] == phase]
            vals.append(dash(match[0].get(field), ".2f" if field == "capture_s" else ".1f")
                        if match else "-")
        rows.append([name, vllm, target, *vals])
    return table(["figure", "vLLM, Llama-3-8B", "target", *(f"{m} {p} {mode} ({w})" for m, p, mode, w in keys)],
                 "lll" + "r" * len(keys), rows)


def write(out: str, meta: dict, rows: list[dict]) -> str:
    text = tables(meta, rows)
    write_md_and_json(out, text, {"meta": meta, "rows": rows})
    return text


def merge(paths: list[str], out: str) -> str:
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    meta = dict(runs[0]["meta"])
    meta["command"] = " ; ".join(r["meta"]["command"] for r in runs)
    meta["runs"] = [r["meta"] for r in runs]
    return write(out, meta, [row for r in runs for row in r["rows"]])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama", help="comma-separated: llama, hybrid")
    ap.add_argument("--preset", default=None,
                    help="comma-separated presets (default: bench,llama8b on a GPU; tiny on the CPU)")
    ap.add_argument("--modes", default="piecewise,full", help="comma-separated graph modes")
    ap.add_argument("--phases", default="cold,warm")
    ap.add_argument("--sizes", default=None, help="capture sizes (default: 1,2,4,8..256 step 8 "
                    "on a GPU; 1,2,4,8 on the CPU)")
    ap.add_argument("--batch", type=int, default=8, help="requests in the first decode step")
    ap.add_argument("--context", type=int, default=None, help="cached tokens per request "
                    "(default 500; 40 on the CPU)")
    ap.add_argument("--piece-compiler", default=None, help="inductor on a GPU, eager on the CPU")
    ap.add_argument("--capture-warmup", default="on_demand", choices=["every_size", "on_demand"],
                    help="CompilationConfig.capture_warmup (on_demand: a warm-up only where a "
                    "capture would compile a kernel)")
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="CompilationConfig.compile_workers (default: its own, one per two cores "
                    "beside the process's, at most 3; 0: Inductor's pieces one after another)")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="more CompilationConfig fields for every child, as bench/decode.py's")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="cProfile each child into DIR (<model>-<preset>-<mode>-<phase>.prof and "
                         "a .txt of the top functions by cumulative time)")
    ap.add_argument("--by-op", action="store_true",
                    help="time runner.capture() by callee, unprofiled (bench/op_timer.py): each "
                    "mrv2 op and the loaded Inductor pieces' own code, as self seconds")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    add_dry_run(ap, flag="--smoke", help="quick CPU check (tiny, eager pieces, "
                "graph stand-in; numbers mean nothing)")
    ap.add_argument("--keep-caches", action="store_true", help="keep the cache folders (printed)")
    add_out(ap, None, help="markdown file; raw JSON next to it "
            "(default bench/results/startup.md; with --smoke a temporary folder)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join earlier runs' JSON")
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    return ap


def child_base(args, cuda: bool) -> dict:
    """What every child's spec shares (the model, preset, mode and phase are each one's)."""
    sizes = comma_list(args.sizes, int) if args.sizes else GPU_SIZES if cuda else CPU_SIZES
    return {"device": "cuda" if cuda else "cpu",
            "piece_compiler": args.piece_compiler or ("inductor" if cuda else "eager"),
            "sizes": sizes, "batch": min(args.batch, max(sizes)),
            "capture_warmup": args.capture_warmup, "compile_workers": args.compile_workers,
            "config": args.config_options,
            "profile": os.path.abspath(args.profile) if args.profile else None,
            "by_op": args.by_op,
            "context": args.context if args.context is not None else (500 if cuda else 40)}


def startup_meta(argv, base: dict) -> dict:
    sizes = base["sizes"]
    sizes_text = (f"{len(sizes)} ([1, 2, 4] + 8..256 step 8)" if sizes == GPU_SIZES
                  else f"{len(sizes)} ({sizes})")
    return {"date": utc_now(), "device": base["device"], "python": platform.python_version(),
            "command": command_line("startup", argv), "sizes_text": sizes_text, "batch": base["batch"],
            "context": base["context"], "piece_compiler": base["piece_compiler"]}


def measure_cell(spec: dict, phases: list[str], args, out: str, meta: dict, rows: list[dict],
                 pycache: str | None = None) -> bool:
    """Each phase of one (model, preset, mode) in a fresh process, all with the
    same new cache folders, cold first (it fills what warm reads); the results
    written after each. True where one failed (the phases after it do not run).
    `pycache`: the primed bytecode folder (PYTHONPYCACHEPREFIX), shared by all."""
    name = f"{spec['model']} {spec['preset']} {spec['mode']}"
    root = tempfile.mkdtemp(prefix=f"mrv2-startup-{name.replace(' ', '-')}-")
    caches = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
              "TRITON_CACHE_DIR": os.path.join(root, "triton"),
              "MRV2_CACHE_DIR": os.path.join(root, "mrv2")}
    for folder in caches.values():
        os.makedirs(folder)
    if pycache:  # the bytecode a pip install would have written (not this cell's cache)
        caches["PYTHONPYCACHEPREFIX"] = pycache
    failed = False
    for phase in phases:
        row = run_child({**spec, "phase": phase}, caches, args.timeout)
        rows.append(row)
        if "error" in row:
            failed = True
            print(f"{name} {phase}: FAILED ({row['error']})\n{row.get('stderr_tail', '')}", flush=True)
            break
        print(f"{name} {phase}: compile {row['compile_s']:.1f} s, capture "
              f"{row['capture_s']:.2f} s ({row['graphs']} graphs), start to first "
              f"step {row['start_to_first_step_s']:.1f} s", flush=True)
        write(out, meta, rows)
    if args.keep_caches:
        print(f"caches kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return failed


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        row = profiled_child(spec) if spec.get("profile") else child(spec)
        print(JSON_PREFIX + json.dumps(row), flush=True)
        return 0
    if args.merge:
        print(merge(args.merge, args.out or "bench/results/startup.md"))
        return 0
    cuda = torch.cuda.is_available() and not args.smoke
    out = args.out or (os.path.join(tempfile.mkdtemp(prefix="mrv2-startup-smoke-"), "startup.md")
                       if args.smoke else "bench/results/startup.md")
    models = comma_list(args.models)
    presets = comma_list(args.preset or ("bench,llama8b" if cuda else "tiny"))
    phases = comma_list(args.phases)
    if not set(phases) <= {"cold", "warm", "warm-nogemms"} or phases[:1] != ["cold"]:
        ap.error(f"--phases: cold, then warm and/or warm-nogemms (a warm start with "
                 f"warm_gemms=False), each any number of times; not {args.phases}")
    if args.smoke and not args.preset:
        models, presets = ["llama"], ["tiny"]
    args.config_options = config_options(ap, args.config)
    base = child_base(args, cuda)
    meta = startup_meta(argv, base)
    rows: list[dict] = []
    failed = False
    # A read-only torch (the GPU machine's) has no bytecode: each child would
    # compile torch's sources (5.8 s of a warm start, seen in a profile).
    pycache = None
    if cuda and bytecode_missing():
        pycache = tempfile.mkdtemp(prefix="mrv2-startup-pycache-")
        primed_s = prime_bytecode(dict(os.environ, PYTHONPYCACHEPREFIX=pycache))
        meta["bytecode"] = ("torch's install has no bytecode; the children read it from "
                            f"PYTHONPYCACHEPREFIX, primed in {primed_s:.0f} s before the first child")
    for model in models:
        for p in presets:
            for mode in comma_list(args.modes):
                spec = {**base, "model": model, "preset": p, "mode": mode}
                failed |= measure_cell(spec, phases, args, out, meta, rows, pycache)
    if pycache:
        shutil.rmtree(pycache, ignore_errors=True)
    print(write(out, meta, rows))
    print(f"written: {out} and {os.path.splitext(out)[0]}.json")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
