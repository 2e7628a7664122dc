"""The main job: generate with a reference model in every graph mode this
machine supports and check each mode's tokens against an eager reference.

    python -m compile_backend demo --model hybrid --preset tiny --batch 4 --steps 8
    python -m compile_backend demo --standin   # on a CPU: capture with the stand-in
    torchrun --nproc-per-node 2 -m compile_backend demo --tp 2   # tensor parallel

The reference runs mode NONE with eager pieces and no passes; every measured
mode gets a fresh model with the same seeded weights and a fresh Dynamo. With
`--tp N` every rank runs every mode on its shard, and the reference is the
whole model (TP=1) on each rank. Without CUDA only mode none runs (it says so,
and how to see capture) and a graph mode asked for by name is refused
(ValueError naming the fix), unless `standin=True` (`--standin`): then every
mode captures and replays with the CPU stand-in, and the run says so.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from compile_backend.compile.compiled_step import clear_compiled_steps, compiled_steps
from compile_backend.core.config import CompilationConfig
from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.core.counters import counters, reset_counters
from compile_backend.core.parallel import TensorParallel, init_from_env
from compile_backend.demo.engine import Engine
from compile_backend.demo.names import DTYPE_NAMES
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.demo.models import build_model, preset
from compile_backend.core.progress import progress as progress_bar
from compile_backend.runtime.graph_standin import STANDIN_NOTE, standin_graphs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert sorted(DTYPES) == list(DTYPE_NAMES)
ALL_MODES = [m.value for m in CUDAGraphMode]
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
NO_CUDA = ("no CUDA device: the demo runs mode none only (eager pieces, no graph captured); "
           "to see capture on this CPU: mrv2 demo --standin (a CPU stand-in for CUDA graphs)")


@dataclass
class DemoOptions:
    model: str = "hybrid"
    preset: str = "tiny"
    modes: list[str] = field(default_factory=lambda: ["all"])
    batch: int = 4
    steps: int = 8  # new tokens per prompt
    prompt_len: int = 16
    dump: str | None = None
    dtype: str | None = None  # None: fp32 on CPU, bf16 on CUDA
    piece_compiler: str = "inductor"
    seed: int = 0
    progress: bool = True
    tp: int = 1  # tensor-parallel ranks: processes started by torchrun
    standin: bool = False  # capture with the CPU stand-in for CUDA graphs (STANDIN_NOTE)

    def __post_init__(self) -> None:
        if not isinstance(self.standin, bool):
            raise ValueError(f"standin must be True or False, got {self.standin!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"--tp must be a positive int, got {self.tp!r}")
        for name in ("batch", "steps", "prompt_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        preset(self.preset)  # raises with the valid names
        for m in self.modes:
            if m != "all":
                CUDAGraphMode.parse(m)


@dataclass
class ModeResult:
    mode: str  # the mode that ran
    pieces: int
    graphs_captured: int
    capture_seconds: float
    median_step_ms: float
    tokens_per_s: float
    tokens: list[list[int]]
    equal: bool | None = None  # to the eager reference
    dump: str | None = None


def modes_to_run(requested: list[str], graphs: bool) -> tuple[list[str], str | None]:
    """The modes to run, in order, and a line to print about those left out.
    `graphs`: this machine captures graphs (CUDA, or the stand-in). Without
    graphs, `all` runs mode none and says so; a graph mode asked for by name
    raises ValueError naming the fix (never a silent mode none)."""
    named = [CUDAGraphMode.parse(m).value for m in requested if m != "all"]
    wanted = list(dict.fromkeys(ALL_MODES if "all" in requested else named))
    if graphs:
        return wanted, None
    refused = [m for m in dict.fromkeys(named) if m != "none"]
    if refused:
        raise ValueError(
            f"mode {', '.join(refused)} needs CUDA graphs and this machine has no CUDA device: "
            "run on a GPU, or pass --standin to capture with the CPU stand-in")
    return ["none"], (NO_CUDA if "all" in requested else None)


def plan_modes(opts: DemoOptions) -> tuple[list[str], str | None]:
    """`modes_to_run` for this machine and `opts` (ValueError: see there)."""
    return modes_to_run(opts.modes, graphs=torch.cuda.is_available() or opts.standin)


def _kv_config(opts: DemoOptions) -> KVCacheConfig:
    block = 16
    max_len = -(-(opts.prompt_len + opts.steps) // block) * block
    blocks_per_req = max_len // block
    return KVCacheConfig(num_blocks=opts.batch * blocks_per_req + 2, block_size=block,
                         max_model_len=max_len, max_num_reqs=opts.batch,
                         # a capture's dummy batch spreads its tokens over the requests
                         max_num_tokens=min(CAPTURE_SIZES[-1], opts.batch * max_len))


def _prompts(opts: DemoOptions, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(opts.seed)
    return [torch.randint(0, vocab, (opts.prompt_len,), generator=g).tolist()
            for _ in range(opts.batch)]


def start_tensor_parallel(opts: DemoOptions) -> TensorParallel:
    """This process's rank among `opts.tp` (the process group made from
    torchrun's environment: NCCL on CUDA, gloo on the CPU). Raises ValueError
    with the command to run when the processes started are not `opts.tp`."""
    if opts.tp == 1:
        return TensorParallel()
    started = int(os.environ.get("WORLD_SIZE", "1"))
    if started != opts.tp:
        raise ValueError(
            f"--tp {opts.tp} needs {opts.tp} processes, one per GPU, and {started} "
            f"{'was' if started == 1 else 'were'} started: torchrun --nproc-per-node {opts.tp} "
            f"-m compile_backend demo --tp {opts.tp} ...")
    init_from_env()
    return TensorParallel.current(opts.tp)


class Phases:
    """The demo's progress bar (core/progress.py: shown after 3 s), a step per
    phase, its note naming the phase running. A bar redraws at most every
    0.5 s, at an update: so the step that ends a phase and the next phase's
    name go in one update, and nothing else updates it (a redraw just before
    a long compile would leave the previous phase's name on screen)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.running = False  # a phase started and not yet counted

    def start(self, note: str) -> None:
        if self.bar is not None:
            self.bar.update(1 if self.running else 0, note=note)
        self.running = True

    def __enter__(self) -> "Phases":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            if self.running:
                self.bar.update(1)
            self.bar.close()


def run_mode(opts: DemoOptions, mode: str, device: torch.device, dtype: torch.dtype,
             reference: bool = False, dump: str | None = None,
             tp: int | None = None, bar: Any = None) -> ModeResult:
    """Generate once in `mode` with a fresh model and a fresh Dynamo, split
    over `tp` ranks (default `opts.tp`). `bar`: the demo's Phases, told of
    each phase (compile and capture, generate)."""
    from compile_backend.debug import dump as debug_dump

    name = "eager reference" if reference else mode
    phases = bar if bar is not None else Phases(None)
    phases.start(f"{name}: building, compiling" + ("" if mode == "none" else " + capturing"))
    torch._dynamo.reset()
    reset_counters()
    clear_compiled_steps()
    cfg = preset(opts.preset, dtype=dtype, seed=opts.seed)
    model = build_model(opts.model, cfg, opts.tp if tp is None else tp).to(device)
    kv = _kv_config(opts)
    compilation = CompilationConfig(
        cudagraph_mode=mode,
        capture_sizes=[s for s in CAPTURE_SIZES if s <= kv.max_num_tokens],
        piece_compiler="eager" if reference else opts.piece_compiler,
        enable_passes=not reference,
        debug_dump_path=dump,
    )
    if dump:
        debug_dump.reset_dump(dump)
    depyf = debug_dump.depyf_dump(dump) if dump else contextlib.nullcontext()
    with torch.no_grad(), depyf:
        engine = Engine(model, kv, compilation, device,
                        progress=opts.progress and not reference)
        t0 = time.perf_counter()
        engine.runner.capture()
        capture_seconds = time.perf_counter() - t0
        if dump:
            debug_dump.update_manifest_runtime(dump, engine.runner)
        phases.start(f"{name}: generating {opts.steps} tokens per prompt")
        tokens = engine.generate(_prompts(opts, cfg.vocab_size), opts.steps)
        if dump:
            debug_dump.update_manifest_runtime(dump, engine.runner)
    secs = engine.stats.step_seconds
    return ModeResult(
        mode=engine.runner.mode.value,
        pieces=sum(len(s.pieces) for s in compiled_steps()),
        graphs_captured=counters["cudagraph_captures"],
        capture_seconds=capture_seconds,
        median_step_ms=1e3 * statistics.median(secs) if secs else 0.0,
        tokens_per_s=engine.stats.tokens_generated / sum(secs) if sum(secs) else 0.0,
        tokens=tokens,
        dump=dump,
    )


def run_demo(opts: DemoOptions, say: Callable[[str], Any] = print) -> list[ModeResult]:
    """Raises ValueError for a graph mode this machine cannot run (plan_modes)."""
    modes, why = plan_modes(opts)
    tp = start_tensor_parallel(opts)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")  # with TP: this rank's GPU (LOCAL_RANK)
    dtype = DTYPES[opts.dtype] if opts.dtype else (torch.bfloat16 if cuda else torch.float32)
    if why:
        say(why)
    say(f"model {opts.model} ({opts.preset}), {opts.batch} prompts of {opts.prompt_len} tokens, "
        f"{opts.steps} new tokens, {str(dtype).replace('torch.', '')} on {device.type}, "
        f"pieces compiled with {opts.piece_compiler}")
    if opts.standin:
        say(STANDIN_NOTE)
    if tp.size > 1:
        say(f"tensor parallel: {tp.size} ranks; the reference is the whole model (TP=1) on each rank")
    graphs = standin_graphs() if opts.standin else contextlib.nullcontext()
    # Phases: compile (+ capture) and generate, for the reference and each mode.
    bar = Phases(progress_bar("demo", total=2 * (1 + len(modes)), unit="phase",
                              enabled=None if opts.progress else False))  # None: MRV2_PROGRESS decides
    with graphs, bar:
        reference = run_mode(opts, "none", device, dtype, reference=True, tp=1, bar=bar)
        results = []
        for mode in modes:
            dump = None
            if opts.dump:
                dump = opts.dump if len(modes) == 1 else str(Path(opts.dump) / mode)
                if tp.size > 1:  # one dump per rank: each compiles and captures its own
                    dump = str(Path(dump) / f"rank{tp.rank}")
            r = run_mode(opts, mode, device, dtype, dump=dump, bar=bar)
            r.equal = r.tokens == reference.tokens
            results.append(r)
    torch._dynamo.reset()
    return results


# What each column measures: pieces of the split graph; CUDA graphs (or
# stand-in graphs, with --standin) captured;
# runner.capture() wall time, which includes compiling (the first call
# compiles) and, where graphs are on, capturing; median generation step;
# generated tokens per second of step time; tokens equal to eager's.
HEADER = ("mode", "pieces", "graphs captured", "compile + capture (s)", "median step (ms)",
          "tokens/s", "equal to eager")


def format_table(results: list[ModeResult]) -> str:
    rows = [HEADER] + [
        (r.mode, str(r.pieces), str(r.graphs_captured), f"{r.capture_seconds:.2f}",
         f"{r.median_step_ms:.2f}", f"{r.tokens_per_s:.1f}", "yes" if r.equal else "no")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
