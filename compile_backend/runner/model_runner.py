"""The capture runner: what an engine drives to get graphs captured ahead of
serving, and to run every step through them.

    runner = ModelRunner(model, KVCacheConfig(...), CompilationConfig(...), device="cuda")
    runner.capture()                       # all sizes, every mode the graph mode needs
    out = runner.execute(batch)            # pad, pick a graph, copy in, replay

The model's forward is `forward(input_ids [T], positions [T]) -> [T, ...]`; its
attention and attention-like layers (compile_backend/kernels/layers.py) read their metadata
from the forward context this runner sets. Token ids are checked against the
model's vocabulary size (`model.vocab_size`, `get_input_embeddings()` or
`config.vocab_size`; model_state.vocab_size_of).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from compile_backend.compile.backend import Mrv2Backend
from compile_backend.runtime.machine import check_device, graph_mode_on_this_machine
from compile_backend.compile.guard_free import GuardFreeModel
from compile_backend.runner.capture import dry_prefill_graphs, prepare_inputs_to_capture
from compile_backend.core.config import CompilationConfig
from compile_backend.core.counters import counters
from compile_backend.core.frozen_gc import frozen_gc
from compile_backend.core.progress import progress
from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph, lower_graph_mode
from compile_backend.core.graph_plan import (NO_GRAPH_TOO_LARGE, GraphPlan, early_scout_graphs,
                                           scouts_first)
from compile_backend.runtime.cuda_graph import CUDAGraphWrapper
from compile_backend.runtime import gemm_warmup, graph_pool, jit_guard, kernel_precompile, kernel_workers
from compile_backend.runtime.graph_pool import current_graph_backend, plan_capture
from compile_backend.core.forward_context import ForwardContext, set_forward_context
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.kv_cache_config import KVCacheConfig
from compile_backend.runner.model_state import ModelState
from compile_backend.runner.parallel import RankAgreement
from compile_backend.core.symbolic import mark_token_dim, symbolic_tokens

logger = logging.getLogger(__name__)


@dataclass
class CaptureRecord:
    graph: StepGraph  # the graph captured
    seconds: float
    pool_bytes: int
    for_capture: dict[str, bool] = field(default_factory=dict)  # builder kind -> flag
    # `seconds` split (host time): the eager warm-up before the capture (0
    # when none ran), recording the kernels and instantiating the graph(s)
    # (a PIECEWISE step captures one graph per piece); the rest of `seconds`
    # is the capture call's own Python, eager attention between pieces and
    # the replay that follows every capture.
    warmup_s: float = 0.0
    record_s: float = 0.0
    instantiate_s: float = 0.0
    # made from the decode graph of its size, not recorded (derive_mixed_graphs;
    # its record_s is then the side capture of the other form's launches, its
    # instantiate_s the clone, its launches replaced and its instantiation)
    derived: bool = False

    def summary(self) -> dict[str, Any]:
        return {"graph": self.graph.summary(), "seconds": round(self.seconds, 6),
                "warmup_s": round(self.warmup_s, 6), "record_s": round(self.record_s, 6),
                "instantiate_s": round(self.instantiate_s, 6),
                "pool_bytes": self.pool_bytes, "for_capture": self.for_capture,
                "derived": self.derived}


class _Waiting(NamedTuple):
    """A graph of the plan waiting for kernels compiled ahead: what it spent
    so far, and the kernels its attempts and dry warm-up met."""

    graph: StepGraph
    earlier: "_Waited"
    keys: frozenset


class _Waited(NamedTuple):
    """What a graph that waited for kernels compiled ahead spent before its
    capture: the refused attempt and the dry warm-up (host seconds), the dry
    warm-up alone, and the pool bytes the refused attempt took."""

    seconds: float = 0.0
    dry_s: float = 0.0
    pool_bytes: int = 0


def _mark_tokens(args: tuple) -> None:
    """The step's inputs (input_ids, positions): their token dimension
    dynamic, so one trace serves every size (imports Dynamo)."""
    for t in args:
        mark_token_dim(t)


def fit_capture_sizes(sizes: list[int], kv: KVCacheConfig) -> list[int]:
    """The capture sizes a batch can reach (sorted), logging the others once:
    no batch holds more than KVCacheConfig.max_batch_tokens tokens."""
    limit = kv.max_batch_tokens
    dropped = [s for s in sizes if s > limit]
    if dropped:
        logger.info(
            "capture sizes %s dropped: no batch has more than %d tokens (max_num_tokens=%d, "
            "max_num_reqs=%d x max_model_len=%d)", dropped, limit, kv.max_num_tokens,
            kv.max_num_reqs, kv.max_model_len)
    return sorted(s for s in sizes if s <= limit)


def _empty_plan_message(mode: CUDAGraphMode, sizes: list[int], kv: KVCacheConfig) -> str:
    if mode is CUDAGraphMode.FULL_DECODE_ONLY:
        bound = (f"max_num_reqs={kv.max_num_reqs} (its graphs hold one token per request; "
                 f"max_num_tokens={kv.max_num_tokens}, max_model_len={kv.max_model_len})")
    else:
        bound = (f"{kv.max_batch_tokens}, the most tokens a batch holds (min(max_num_tokens="
                 f"{kv.max_num_tokens}, max_num_reqs={kv.max_num_reqs} x max_model_len="
                 f"{kv.max_model_len}))")
    return (f"cudagraph_mode {mode.value} has no graph to capture: no size in capture_sizes="
            f"{sizes} is at most {bound}. Add such a size to capture_sizes, or use "
            "cudagraph_mode='none'")


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache_config: KVCacheConfig,
        config: CompilationConfig | None = None,
        device: torch.device | str = "cuda",
        progress: bool = True,
        compile_fn: Callable[[torch.nn.Module], Callable[..., Any]] | None = None,
    ) -> None:
        """`compile_fn(model) -> callable` replaces the mrv2 compile (benchmarks
        compare Inductor's own modes, or the model uncompiled, this way)."""
        self.config = config or CompilationConfig()
        self.kv_cache_config = kv_cache_config
        self.device = check_device(device)  # a missing GPU: a clear error, not torch's
        self.progress = progress
        self.model = model
        self.model_state = ModelState.for_model(model, kv_cache_config, self.device)
        # The state's parts, for engines and tests that read the buffers.
        self.vocab_size = self.model_state.vocab_size  # token ids are below it (None: unchecked)
        self.input_buffers = self.model_state.input_buffers
        self.block_tables = self.model_state.block_tables
        self.attn_groups = self.model_state.attn_groups
        builders = [g.builder for g in self.attn_groups]
        here, self.mode_reason = graph_mode_on_this_machine(self.config.cudagraph_mode)
        self.mode, lowered_reason = lower_graph_mode(here, builders)
        self.mode_reason = lowered_reason or self.mode_reason
        # Which graphs to capture and which one a batch runs in (pure rules).
        self.plan = GraphPlan(self.mode, tuple(fit_capture_sizes(self.config.capture_sizes,
                                                                 kv_cache_config)),
                              kv_cache_config.max_num_reqs)
        if self.mode is not CUDAGraphMode.NONE and not self.plan.captures():
            raise ValueError(_empty_plan_message(self.mode, self.config.capture_sizes,
                                                 kv_cache_config))
        if compile_fn is None:
            # The backend gets this config and the lowered mode as objects:
            # nothing is parsed or lowered again. Its pieces are ones an entry
            # of the warm-start cache can hold when there is a cache.
            step_config = dataclasses.replace(self.config, cudagraph_mode=self.mode,
                                              serializable=self.config.cache_dir is not None)
            # Compiled (or loaded) at the first step, then called without
            # Dynamo's guards (compile/guard_free.py says what that promises).
            self.compiled = GuardFreeModel(
                model, step_config,
                Mrv2Backend(step_config, graph_mode=self.mode, mode_reason=self.mode_reason),
                prepare=_mark_tokens)
        else:
            self.compiled = compile_fn(model)
        # Outputs held weakly, as every piece's are: a step's logits live in the
        # shared pool until the next step replays over them (execute's contract),
        # so N sizes do not keep N logits tensors alive.
        self.full_graph = CUDAGraphWrapper(
            self._run_compiled, CUDAGraphMode.FULL, name="full_step",
            debug_checks=self.config.debug_checks, graphs=current_graph_backend(),
            # only where mixed batches replay FULL graphs: elsewhere the decode
            # graphs' recordings would be kept for nothing
            derive_mixed=self.config.derive_mixed_graphs and self.mode is CUDAGraphMode.FULL)
        self.captures: list[CaptureRecord] = []
        # What capture() compiled ahead: kernels_recorded (the Triton kernels
        # the first step and the plan asked for), graphs_waited, compile_wait_s
        # (host seconds the plan waited for them), kernels_unsaved; and the
        # GEMMs: gemms_recorded and gemm_record_s (a start without a saved
        # list), gemm_warmup_calls, _s, _wait_s, _error (one with it).
        self.capture_stats: dict[str, Any] = {}
        # Records the Triton kernels the first step and the plan compile (the
        # list saved beside the warm-start entry) and compiles ahead for
        # capture() (runtime/kernel_precompile.py); None where Triton cannot.
        # A start without a saved kernel list compiles them in worker
        # processes (runtime/kernel_workers.py), started with its first step.
        workers = self.config.precompile_workers
        self._precompiler = (kernel_precompile.KernelPrecompiler(
            self.config.precompile_threads, kernel_workers.auto_workers() if workers is None else workers)
            if self.config.capture_warmup == "on_demand" and kernel_precompile.available() else None)
        self.captured = False
        self._stepped = False  # has a step run (the model compiled or loaded)?
        self._prefills_dried = False  # the first prefills run dry in the first step's wait?
        # Tensor parallel: ranks agree on the plan now, and per step under debug_checks.
        self.parallel = RankAgreement.for_runner(self)

    @property
    def capture_sizes(self) -> list[int]:
        """Token counts with graphs (those a batch can reach), ascending."""
        return list(self.plan.capture_sizes)

    @property
    def decode_sizes(self) -> list[int]:
        """Sizes of the uniform-decode FULL graphs (one token per request)."""
        return list(self.plan.decode_sizes)

    # ---- one forward ---------------------------------------------------------

    def _run_compiled(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        if getattr(self.compiled, "ready", False):  # compiled: no Dynamo from here on
            with torch.no_grad():
                return self.compiled(input_ids, positions)
        # The first step compiles or loads, importing Dynamo unless the saved
        # step loads without it: the collector stays frozen for all of it
        # (core/frozen_gc.py), or Dynamo's import alone sets off full
        # collections over every object of the process (two, 0.23 s, in a
        # warm start of the tiny model on the CPU machine). Its Triton kernels
        # are recorded (not every step of the guarded fallback, which comes
        # here at every call). The token dimension is marked dynamic before
        # Dynamo sees the inputs: by GuardFreeModel where it compiles, here
        # for a compile_fn's model.
        first = not self._stepped
        with frozen_gc() if first else contextlib.nullcontext():
            if not isinstance(self.compiled, GuardFreeModel):
                _mark_tokens((input_ids, positions))
            recording = (self._precompiler.active() if self._precompiler is not None and first
                         else contextlib.nullcontext())
            with symbolic_tokens(), torch.no_grad(), recording:  # a runner serves inference only
                out = self.compiled(input_ids, positions)
        self._stepped = True  # compiled or loaded
        return out

    def _forward(self, graph: StepGraph, metadata: dict[str, Any],
                 trace: list | None = None) -> Any:
        """Run the first graph.num_tokens (padded) tokens of the persistent
        buffers in `graph`."""
        T = graph.num_tokens
        ids, pos = self.input_buffers.input_ids[:T], self.input_buffers.positions[:T]
        with set_forward_context(ForwardContext(metadata, graph, trace=trace)), \
                self._kernel_checks():
            if graph.mode is CUDAGraphMode.FULL:
                return self.full_graph(ids, pos)
            return self._run_compiled(ids, pos)

    def _kernel_checks(self) -> contextlib.AbstractContextManager:
        """With `debug_checks`, the kernels check their index values on CUDA
        too (a sync per launch; never during a capture)."""
        if not self.config.debug_checks:
            return contextlib.nullcontext()
        from compile_backend.kernels import debug_checks

        return debug_checks()

    # ---- capture ---------------------------------------------------------------

    def capture_plan(self) -> list[StepGraph]:
        """The graphs to capture: piecewise before full, each largest first."""
        return self.plan.captures()

    def capture(self, trace: list | None = None) -> list[CaptureRecord]:
        """Capture every graph the mode needs. With mode NONE this only warms
        up (compiles) once, at the largest capture size (without one: the
        largest batch, KVCacheConfig.max_batch_tokens). The plan's kernel
        compile workers, if any started, go after it."""
        try:
            return self._capture_plan(trace)
        finally:
            if self._precompiler is not None:
                self._precompiler.close_workers()

    def _capture_plan(self, trace: list | None) -> list[CaptureRecord]:
        plan = self.capture_plan()
        if not plan:  # mode NONE (a mode with graphs and no plan is refused in __init__)
            sizes = self.capture_sizes
            self.warmup(sizes[-1] if sizes else self.kv_cache_config.max_batch_tokens, trace)
            self.captured = True
            return []
        # One plan: garbage collected once and then frozen, the allocator's
        # cache emptied and the device synchronized once at the start and
        # the end, not per graph (plan_capture says why: a plan has hundreds
        # of graphs, 1155 in PIECEWISE for llama8b at 35 sizes).
        # capture_warmup="on_demand": capture first, under the guard that
        # refuses a compile inside a capture (runtime/jit_guard.py); else a
        # warm-up before every capture and no guard.
        on_demand = self.config.capture_warmup == "on_demand" and jit_guard.guard_available()
        if on_demand and not self._stepped:
            # The first step compiles (or loads) the model, which imports
            # Inductor's runtime: the guard patches it on entry, so that
            # import comes before the guard (seen on the H200: a compile
            # inside the plan left Inductor's first-launch autotune unguarded).
            counters["capture_warmups"] += 1
            self.warmup(plan[0].num_tokens, trace)
        # on_demand with a Triton that can compile a recorded request: a graph
        # whose capture would compile waits, after a dry warm-up that hands
        # its kernels to worker threads, until the plan's other graphs are
        # captured and its kernels have come (runtime/kernel_precompile.py);
        # a warm start loads the kernels its cold start saved, all at once,
        # before the first capture.
        pre = self._precompiler if on_demand else None
        waited_before = pre.wait_s if pre is not None else 0.0  # the first step's waits are not the plan's
        waiting: list[_Waiting] = []
        with progress(f"capturing {self.mode.value} graphs", total=len(plan), unit="graph",
                      enabled=None if self.progress else False) as bar, \
                plan_capture(current_graph_backend()), \
                jit_guard.no_compile_in_capture() if on_demand else contextlib.nullcontext(), \
                pre.active() if pre else contextlib.nullcontext():  # its hook first, then the guard's
            saved = self._saved_kernels() if pre is not None else []
            if saved:
                with pre.asking("saved list"):
                    if pre.preload(saved):
                        pre.wait()
            # Where kernels compile ahead, the sizes where they change come
            # first (graph_plan.scouts_first), cold or warm: every rank of a
            # tensor-parallel group captures in the same order, whatever its
            # saved list.
            ahead = pre is not None and kernel_precompile.compiles_here()
            if ahead and self.config.scout_sizes_first:
                plan = scouts_first(plan)
            t_plan = time.perf_counter()
            # A cold plan: the first prefills' kernels too, asked for before
            # the first capture so that they compile while the plan captures
            # (run after its last capture, on an H100, they asked for the
            # prefill kernel 2.0 s into a PIECEWISE plan, which then waited
            # 1.4 s). Their eager steps run collectives under tensor
            # parallelism, so there every rank runs them, whatever its own
            # saved list says.
            if ahead and not self._prefills_dried and (not saved or self._tp_size() > 1):
                self._dry_prefills(pre)
            for graph in plan:
                if pre is not None:
                    # the kernels compiled since, loaded here between captures:
                    # else their first launch loads them inside one
                    pre.settle()
                keys_of_size = self._size_waits(pre, graph, waiting) if pre is not None else None
                if keys_of_size is not None:
                    # A graph of its size waits for kernels still compiling:
                    # this one meets them too (the same GEMM rows and
                    # batch), so it waits without a refused attempt.
                    counters["captures_deferred"] += 1
                    waiting.append(_Waiting(graph, _Waited(), keys_of_size))
                    continue
                with pre.asking(_label(graph)) if pre else contextlib.nullcontext(), \
                        pre.collecting() if pre else contextlib.nullcontext() as keys:
                    earlier = self._capture_one(graph, trace, on_demand, pre)
                if earlier is None:
                    bar.update(note=f"{graph.mode.value} {graph.num_tokens} tokens")
                else:
                    waiting.append(_Waiting(graph, earlier, frozenset(keys)))
            waited = len(waiting)
            if waiting and self._tp_size() == 1:
                # Each waiting graph captured as soon as the kernels it met
                # are loaded, while the rest compile (under tensor
                # parallelism the ranks' orders would then differ: all wait).
                waiting = self._capture_when_ready(pre, waiting, trace, on_demand, bar)
            if waiting:
                pre.wait()
            for graph, earlier, _ in waiting:  # their kernels compiled: plain on_demand captures
                with pre.asking(_label(graph)):
                    self._capture_one(graph, trace, on_demand, earlier=earlier)
                bar.update(note=f"{graph.mode.value} {graph.num_tokens} tokens")
        if pre is not None:
            # specialisations of each kernel, by its function's name
            by_name = collections.Counter(name.rsplit(":", 1)[-1] for name, _ in pre.specs)
            self.capture_stats.update({"kernels_recorded": len(pre.specs), "graphs_waited": waited,
                                       "compile_wait_s": pre.wait_s - waited_before,
                                       "kernels_unsaved": _unsaved(pre.specs, saved),
                                       "kernels_by_name": dict(sorted(by_name.items())),
                                       "kernel_timeline": _timeline(pre.timeline, t_plan)})
            self._save_kernels(pre.saved_list())
        self.captured = True
        return self.captures

    @staticmethod
    def _size_waits(pre: kernel_precompile.KernelPrecompiler, graph: StepGraph,
                    waiting: list[_Waiting]) -> frozenset | None:
        """The kernels the last waiting graph of `graph`'s size met, where one
        of them is still compiling; else None."""
        same = [w for w in waiting if w.graph.num_tokens == graph.num_tokens]
        return same[-1].keys if same and not pre.ready(same[-1].keys) else None

    def _capture_when_ready(self, pre: kernel_precompile.KernelPrecompiler, waiting: list[_Waiting],
                            trace: list | None, on_demand: bool, bar: Any) -> list[_Waiting]:
        """Capture each waiting graph once the kernels it met are loaded, in
        the plan's order among those ready, blocking only while none is (a
        cold plan's last kernels come up to a second after its other graphs
        are captured: the graphs that waited for earlier ones fill that
        time). A graph refused again waits for what it met then. Returns
        the graphs left: those refused again by no new kernel (a compile
        that failed ahead: the caller's plain captures compile it in line)."""
        pending, stuck = list(waiting), []
        while pending:
            pre.settle()
            ready = [w for w in pending if pre.ready(w.keys)]
            if not ready:
                if not pre.wait_any():
                    break
                continue
            for item in ready:
                pending.remove(item)
                with pre.asking(_label(item.graph)), pre.collecting() as keys:
                    again = self._capture_one(item.graph, trace, on_demand, pre, earlier=item.earlier)
                if again is None:
                    bar.update(note=f"{item.graph.mode.value} {item.graph.num_tokens} tokens")
                    continue
                counters["capture_rewaits"] += 1
                (stuck if keys <= item.keys else pending).append(
                    _Waiting(item.graph, again, item.keys | keys))
        return stuck + pending

    def _dry_prefills(self, pre: kernel_precompile.KernelPrecompiler) -> None:
        """Eager prefill steps on dummy batches (runner/capture.py's
        PREFILL_DRY_SHAPES), run dry: the kernels they need that no capture
        asked for go to the workers, beside the plan's, and into the saved
        list, instead of compiling in line at the first real prefill."""
        for graph in dry_prefill_graphs(self.kv_cache_config):
            self._dry_step(pre, graph, f"prefill {graph.num_reqs}x{graph.num_tokens}")
            counters["prefill_dry_runs"] += 1

    def _dry_step(self, pre: kernel_precompile.KernelPrecompiler, graph: StepGraph,
                  label: str) -> None:
        """`graph`'s dummy batch and metadata, the step run eagerly on them
        with its Triton launches deferred: what it would compile goes to
        `pre`'s workers, asked for as `label`."""
        meta = prepare_inputs_to_capture(graph, self.model_state)
        with pre.deferring(), pre.asking(label):
            self._forward(StepGraph.eager(graph.num_tokens, graph.num_reqs), meta, None)

    def _saved_kernels(self) -> list[tuple[str, str]]:
        """The kernel list saved beside this runner's warm-start entry ([] without one)."""
        path = getattr(self.compiled, "cache_path", None)
        if path is None:
            return []
        from compile_backend.compile import step_cache

        return step_cache.read_kernels(path)

    def _save_kernels(self, kernels: list[tuple[str, str]]) -> None:
        path = getattr(self.compiled, "cache_path", None)
        if path is None or not kernels:
            return
        from compile_backend.compile import step_cache

        try:
            step_cache.write_kernels(path, kernels)
        except OSError as e:  # the next start compiles its kernels at launch, as before
            logger.warning("mrv2: could not save the kernel list beside %s (%s)", path, e)

    # ---- cuBLAS's first calls, beside the first step (runtime/gemm_warmup.py) ----

    def _entry(self, num_tokens: int) -> str | None:
        """The warm-start entry the first step (at `num_tokens`) saves or
        loads; None without a cache."""
        entry_for = getattr(self.compiled, "entry_for", None)
        if entry_for is None:
            return None
        ids = self.input_buffers.input_ids[:num_tokens]
        return entry_for((ids, self.input_buffers.positions[:num_tokens]))

    def _gemm_entry(self, num_tokens: int) -> str | None:
        """`_entry`, where a GEMM list beside it applies: warm_gemms on, a
        device gemm_warmup.DEVICES names; else None."""
        if not self.config.warm_gemms or self.device.type not in gemm_warmup.DEVICES:
            return None
        return self._entry(num_tokens)

    def _kernels_saved(self, num_tokens: int) -> bool:
        """Is a kernel list saved beside the entry the first step (at
        `num_tokens`) saves or loads? (False: a cold start, or no cache.)"""
        entry = self._entry(num_tokens)
        if entry is None:
            return False
        from compile_backend.compile import step_cache

        return bool(step_cache.read_kernels(entry))

    def _scouts_early(self) -> bool:
        """Run a cold start's scouts dry in its first step's wait? Where its
        plan will capture on demand, `early_scouts` is on, and there is one
        rank (under tensor parallelism every rank must run the same eager
        steps, whatever its saved list)."""
        return (self.config.early_scouts and self.config.capture_warmup == "on_demand"
                and jit_guard.guard_available() and self._tp_size() == 1
                and bool(self.capture_plan()))

    def _tp_size(self) -> int:
        """The model's tensor-parallel group size (1 without one)."""
        return getattr(getattr(self.model, "tp", None), "size", 1)

    def _dry_scouts(self, pre: kernel_precompile.KernelPrecompiler) -> None:
        """The plan's scout graphs (graph_plan.early_scout_graphs: the sizes
        where kernels change) and its first prefills, run dry as the plan's dry
        warm-ups run them: their kernels go to the workers now, while the
        first step waits for its own, not at each scout's refused capture in
        the plan, which then finds them compiled or compiling (no dry warm-up
        of its own: the request was sent)."""
        for graph in early_scout_graphs(self.capture_plan()):
            self._dry_step(pre, graph, f"early {_label(graph)}")
            counters["scout_dry_runs"] += 1
        self._dry_prefills(pre)
        self._prefills_dried = True

    def _start_gemms(self, entry: str | None, sizes: set[int]) -> gemm_warmup.Warmup | None:
        """The GEMMs saved beside `entry`, run on a thread at every size in
        `sizes`; None without a list."""
        if entry is None:
            return None
        from compile_backend.compile import step_cache

        return self._start_problems(gemm_warmup.loads(step_cache.read_gemms(entry)), sizes)

    def _start_problems(self, problems: list, sizes: set[int]) -> gemm_warmup.Warmup | None:
        """`problems` run at every size in `sizes` on a thread (None: none)."""
        if not problems:
            return None
        donors = [*self.model.parameters(), *self.model.buffers()]
        return gemm_warmup.start(problems, sizes, donors, self.device)

    def _record_gemms(self, num_tokens: int,
                      pre: kernel_precompile.KernelPrecompiler | None = None) -> list:
        """One more eager step at `num_tokens`, its GEMMs recorded and saved
        beside the entry the first step saved (or loaded); returns them.
        With `pre`, the step runs dry (its Triton kernels' requests go to the
        pool, their launches skipped: the first step's are still compiling)."""
        path = getattr(self.compiled, "cache_path", None)
        if path is None or not gemm_warmup.can_record():
            return []
        from compile_backend.compile import step_cache

        graph, meta = self._eager_inputs(num_tokens)
        dry = pre.deferring() if pre is not None else contextlib.nullcontext()
        t0 = time.perf_counter()
        try:
            with dry:
                problems = gemm_warmup.record(lambda: self._forward(graph, meta, None), num_tokens)
        except Exception as e:  # noqa: BLE001 - a profiler this torch lacks: no list, as before
            logger.warning("mrv2: could not record the first step's GEMMs (%s: %s); the next "
                           "start makes cuBLAS's first calls in its captures", type(e).__name__, e)
            counters["gemm_record_failures"] += 1
            return []
        self.capture_stats["gemms_recorded"] = len(problems)
        self.capture_stats["gemm_record_s"] = round(time.perf_counter() - t0, 4)
        if not problems:
            return []
        try:
            step_cache.write_gemms(path, gemm_warmup.dumps(problems))
        except OSError as e:  # the next start makes cuBLAS's first calls in its captures
            logger.warning("mrv2: could not save the GEMM list beside %s (%s)", path, e)
        return problems

    def _eager_inputs(self, num_tokens: int) -> tuple[StepGraph, dict[str, Any]]:
        """An eager step's graph and metadata on a dummy batch of `num_tokens`."""
        graph = StepGraph.eager(num_tokens, min(num_tokens, self.kv_cache_config.max_num_reqs))
        return graph, prepare_inputs_to_capture(graph, self.model_state)

    def warmup(self, num_tokens: int, trace: list | None = None) -> None:
        """One eager step on a dummy batch of `num_tokens` (the first call
        compiles or loads the step). The first one runs the step dry once
        first: its Triton kernels compile on worker threads, not one after
        another in line (runtime/kernel_precompile.py; a dummy batch, so
        nothing of the dry run's is kept). Beside the first one, a warm
        start's saved GEMMs run at the plan's sizes on a thread; a start
        without that list records one more step's (runtime/gemm_warmup.py),
        where kernels compile ahead right after the dry run, and runs them
        on the thread while the workers compile the first step's kernels
        (this thread only waits for those: 1.7-1.8 s of a cold llama8b start
        on an H100, against 0.4-0.65 s for the plan's GEMMs' first calls,
        which its captures made otherwise). A cold start then also runs the
        plan's scout graphs and first prefills dry (`early_scouts`), so their
        kernels compile from then on; the first step waits for its own only
        and the plan loads the rest as they come (waiting for all of them
        here cost a cold llama8b start ~3 s on an H100)."""
        graph, meta = self._eager_inputs(num_tokens)
        first = not self._stepped
        sizes = {g.num_tokens for g in self.capture_plan()} if first else set()
        pre = self._precompiler
        ahead = first and pre is not None and kernel_precompile.compiles_here()
        # A cold start: no kernel list beside the entry the first step saves or loads.
        cold = ahead and not self._kernels_saved(num_tokens)
        early = cold and self._scouts_early()
        entry = self._gemm_entry(num_tokens) if sizes else None
        # A warm start's saved GEMMs run on a thread while the step loads.
        gemms = self._start_gemms(entry, sizes)
        if cold and pre.workers:
            # The precompiler's worker processes import while the step
            # compiles, then compile its kernels and the plan's (a warm start
            # loads its list from Triton's cache instead).
            from compile_backend.compile.compile_workers import CompileWorkers

            pre.start_workers(CompileWorkers)
        recorded = False
        try:
            if ahead:
                # early: the scouts' kernels compile on past the first step,
                # which waits for its own only; the plan loads the rest.
                with pre.active(keep=early):
                    with pre.deferring(), pre.asking(f"first step {num_tokens}"), \
                            pre.collecting() as own:
                        self._forward(graph, meta, None)
                    counters["first_step_dry_runs"] += 1
                    if gemms is None and entry is not None:
                        recorded = True
                        problems = self._record_gemms(num_tokens, pre)
                        gemms = self._start_problems(problems, sizes) if problems else None
                    if early:
                        self._dry_scouts(pre)
                        # their dummy batches took the persistent buffers: the first step's again
                        graph, meta = self._eager_inputs(num_tokens)
                        pre.wait_for(own)
            self._forward(graph, meta, trace)
        finally:
            if gemms is not None:
                gemms.join()  # done before any capture
                self.capture_stats.update(gemms.stats())
        if gemms is None and entry is not None and not recorded:
            self._record_gemms(num_tokens)

    def _capture_one(self, graph: StepGraph, trace: list | None, on_demand: bool,
                     pre: kernel_precompile.KernelPrecompiler | None = None,
                     earlier: _Waited | None = None) -> _Waited | None:
        """Warm up and capture one graph of the plan. No synchronize around it
        (the plan has one at each end): its CaptureRecord's `seconds` is the
        host's time for the warm-up and the capture (the device may still be
        running the warm-up); `pool_bytes` is exact (the allocator counts on
        the host). With `pre`, a graph whose capture would compile a kernel
        is not captured now: a dry warm-up hands its kernels to `pre`, and
        what it spent is returned (None: captured). `earlier`: what an earlier
        call for this graph spent, added to this capture's record."""
        graphs = current_graph_backend()
        before = graphs.memory_allocated()
        t0 = time.perf_counter()
        builds_before = len(self.model_state.build_log)
        derived_before = counters["mixed_graphs_derived"]
        meta = prepare_inputs_to_capture(graph, self.model_state)
        phases = dict(graph_pool.capture_seconds)
        warmup_s = 0.0
        if not on_demand:
            warmup_s = self._warmup_for_capture(graph, meta, trace)
            self._forward(graph, meta, trace)  # capture
        else:
            # PIECEWISE: the kernels its eager ops (attention between the
            # pieces) meet go to the workers, not compiled in line one by one.
            eager = (pre.deferring_eager() if pre is not None and graph.mode is CUDAGraphMode.PIECEWISE
                     else contextlib.nullcontext())
            try:  # capture first: a warm-up only where a kernel would compile or tune
                with eager:
                    self._forward(graph, meta, trace)
                if earlier is None:
                    counters["capture_warmups_skipped"] += 1
            except jit_guard.CompileInCapture as e:
                if pre is not None:
                    logger.debug("capture of %s: %s; its kernels compile ahead, it waits",
                                 graph.key, e)
                    counters["capture_waits"] += 1
                    dry_s = 0.0
                    if not pre.last_request_sent():  # else an earlier dry warm-up asked for it
                        with pre.deferring():
                            dry_s = self._warmup_for_capture(graph, meta, trace)
                    spent = earlier or _Waited()
                    return _Waited(time.perf_counter() - t0 + spent.seconds, dry_s + spent.dry_s,
                                   graphs.memory_allocated() - before + spent.pool_bytes)
                logger.debug("capture of %s: %s; warming up and capturing again", graph.key, e)
                warmup_s = self._warmup_for_capture(graph, meta, trace)
                self._forward(graph, meta, trace)
        builds = self.model_state.build_log[builds_before:]
        earlier = earlier or _Waited()
        self.captures.append(CaptureRecord(
            graph=graph, seconds=time.perf_counter() - t0 + earlier.seconds,
            pool_bytes=graphs.memory_allocated() - before + earlier.pool_bytes,
            for_capture={b["kind"]: b["for_capture"] for b in builds},
            warmup_s=warmup_s + earlier.dry_s,
            record_s=graph_pool.capture_seconds["record"] - phases["record"],
            instantiate_s=graph_pool.capture_seconds["instantiate"] - phases["instantiate"],
            derived=counters["mixed_graphs_derived"] > derived_before))
        return None

    def _warmup_for_capture(self, graph: StepGraph, meta: dict[str, Any],
                            trace: list | None) -> float:
        """The eager step before a capture (it compiles what the capture would
        need compiled); returns its host seconds."""
        t0 = time.perf_counter()
        counters["capture_warmups"] += 1
        self._forward(StepGraph.eager(graph.num_tokens, graph.num_reqs), meta, trace)
        return time.perf_counter() - t0

    # ---- serving ---------------------------------------------------------------

    def dispatch(self, batch: InputBatch) -> StepGraph:
        """The graph a batch runs in, with its padded sizes (GraphPlan.dispatch;
        eager until capture() ran)."""
        if not self.captured:
            return StepGraph.eager(batch.num_tokens, batch.num_reqs)
        graph, no_graph = self.plan.dispatch(batch.num_tokens, batch.num_reqs,
                                             batch.uniform_decode)
        if no_graph is not None:
            counters[no_graph] += 1
            if no_graph == NO_GRAPH_TOO_LARGE:
                logger.info("batch of %d tokens is larger than every capture size (%d): eager",
                            batch.num_tokens, self.capture_sizes[-1])
        return graph

    def execute(self, batch: InputBatch, trace: list | None = None) -> torch.Tensor:
        """Run one step; returns the rows of the real tokens ([T, ...]), valid
        until the next step: a graph's output lives in the graphs' shared pool,
        which the next replay writes (clone what must outlive it). A batch the
        cache layout or the model's vocabulary cannot take raises ValueError,
        before anything is written (ModelState.check, then BlockTables.write)."""
        self.model_state.check(batch)  # before dispatch counts a fallback
        graph = self.dispatch(batch)
        if self.parallel is not None:
            self.parallel.check_step(graph)
        out = self._forward(graph, self._write_step(batch, graph), trace)
        return out[: batch.num_tokens]

    def prepare_step(self, batch: InputBatch, graph: StepGraph) -> dict[str, Any]:
        """Check the batch against the cache layout and the vocabulary, pad it
        to `graph`, write it into the persistent buffers and build its metadata
        (`for_capture` when it replays in a FULL graph)."""
        self.model_state.check(batch)
        return self._write_step(batch, graph)

    def _write_step(self, batch: InputBatch, graph: StepGraph) -> dict[str, Any]:
        self.model_state.write(batch.pad_to(graph))
        return self.model_state.prepare_attn(batch)


def _unsaved(specs: set[tuple[str, str]], saved: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The kernel requests of a warm start (one with a saved list) that its
    cold start did not save: each compiled while the plan ran (a wait).
    Named with its specialization, beside how many of that kernel the list
    had, so a log or a bench row says what the cold start missed."""
    if not saved:
        return []
    have = set(saved)
    out = []
    for name, spec in sorted(specs - have):
        same = sum(1 for n, _ in saved if n == name)
        logger.info("mrv2: kernel %s compiled in a warm start's plan; its cold start saved "
                    "%d specialisations of it, not this one: %s", name, same, spec)
        out.append({"kernel": name, "saved_of_it": same, "specialization": spec})
    return out


def _timeline(stamps: dict[tuple[str, str], list[Any]], t0: float) -> list[list[Any]]:
    """[kernel function's name, asked s, ready s, what asked] for each
    request this runner's precompiler submitted, seconds from `t0` (the
    plan's first capture; the first step's requests come before it,
    negative), in the order they were asked for; ready None where its
    compile had not ended; what asked: the graph or dry step (`_label`)."""
    rows = sorted(((name.rsplit(":", 1)[-1], at, done, by)
                   for (name, _), (at, done, by) in stamps.items()), key=lambda r: r[1])
    return [[name, round(at - t0, 3), None if done is None else round(done - t0, 3), by]
            for name, at, done, by in rows]


def _label(graph: StepGraph) -> str:
    """A graph as the kernel timeline names what asked: "full decode 16", "piecewise 24"."""
    return f"{graph.mode.value}{' decode' if graph.uniform_decode else ''} {graph.num_tokens}"
