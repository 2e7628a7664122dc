"""The runner's compiled model: compiled (or loaded) once, then called with no
Dynamo frame evaluation and no guard checks.

    step = GuardFreeModel(model, config, backend)
    out = step(input_ids, positions)     # first call: load or compile; then direct

The first call loads the step saved under `cache_dir` (compile/step_cache.py),
without Dynamo where its entry says how (compile/direct_step.py), or
AOT-compiles the model (torch's `aot_compile`). The runner promises that the
model's code, parameters and buffers stay the same objects and its inputs
keep their dtypes and ranks; `debug_checks` runs the guards at every call.
Where `aot_compile` is missing or fails, the model runs under `torch.compile`
(logged, `guarded_fallbacks`). docs/design.md, "Start in seconds" and "A warm
start without Dynamo".
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from compile_backend.core.counters import counters
from compile_backend.core.frozen_gc import frozen_gc
from compile_backend.core.progress import progress

logger = logging.getLogger(__name__)


class GuardFreeModel:
    def __init__(self, model: torch.nn.Module, config: Any,
                 backend: Callable[..., Any],
                 prepare: Callable[[tuple], None] | None = None) -> None:
        self.model = model
        self.config = config
        self.backend = backend  # (gm, example_inputs) -> CompiledStep
        # Called with the inputs before Dynamo sees them, and only then (the
        # runner marks the token dimension dynamic, which imports Dynamo).
        self.prepare = prepare
        self._fn: Callable[..., Any] | None = None
        self._aot: Any = None  # the AOT-compiled function (guard checks under debug_checks)
        # How the first call got its step: "compiled", "loaded" or "guarded"
        # (plain torch.compile), and the cache entry involved (None: no cache);
        # a load's path: "direct" (no Dynamo) or "dynamo" (its saved code).
        self.how: str | None = None
        self.path: str | None = None
        self.cache_path: str | None = None
        self.seconds = 0.0
        # Host seconds of the first call by phase, in order: "key" (the
        # entry's header), "read", "resolve" (a direct load: the graph inputs
        # found), "deserialize" (mrv2's step and its pieces' artifacts, and
        # through Dynamo its code and guards), "guard_check" (through Dynamo); where
        # nothing was loaded, "wrap" (torch.compile and the imports it makes)
        # and "compile" (a cold start's trace and pieces); "first_run" (the
        # first step through the new code); last a compile's "save".
        self.phases: dict[str, float] = {}
        # A load's "deserialize" by part (host seconds): "step_graph" and
        # "step_pieces" (mrv2's step: compile/step_artifacts.py,
        # last_load_seconds), "dynamo" (the rest: Dynamo's code and guards;
        # none on a direct load).
        self.load_parts: dict[str, float] = {}
        self._header: tuple[Any, dict | None, str | None] | None = None  # entry_for's, by inputs

    def entry_for(self, args: tuple) -> str | None:
        """The warm-start entry the first call with `args` will save or load
        (None: no cache, or the model cannot be cached), known before that
        call; the header is kept for it."""
        if self.config.cache_dir is None:
            return None
        from compile_backend.compile import step_cache

        header, _ = self._entry_header(args)
        return None if header is None else step_cache.entry_path(self.config.cache_dir, header)

    def _entry_header(self, args: tuple) -> tuple[dict | None, str | None]:
        from compile_backend.compile import step_cache

        inputs = step_cache.inputs_key(args)
        if self._header is None or self._header[0] != inputs:
            header, why_not = step_cache.entry_header(self.model, self.config, args)
            self._header = (inputs, None if why_not else header, why_not)
        return self._header[1], self._header[2]

    @property
    def ready(self) -> bool:
        """True once steps call the compiled code directly: the caller then
        skips what only Dynamo reads (size-oblivious tracing). False on the
        guarded fallback, which goes through Dynamo."""
        return self._aot is not None or self.path == "direct"

    def __call__(self, *args: Any) -> Any:
        if self._fn is None:
            # Inductor's cache load collects garbage once per artifact (0.17
            # s each on the H200 with llama8b's weights alive): frozen, those
            # collections walk only what the compile or load makes.
            with frozen_gc():
                save = self._first(args)
            t0 = time.perf_counter()
            if save is None:
                out = self._fn(*args)
                self._phase("first_run", t0)
                return out
            # A compile: its first call shows how to call the step without Dynamo.
            from compile_backend.compile import direct_step

            with direct_step.recording(self._aot) as first:
                out = self._fn(*args)
            first.returned = out
            t = self._phase("first_run", t0)
            self._save(self._aot, save, first, args)
            self._phase("save", t)
            return out
        if self.ready:
            if self._aot is not None and self.config.debug_checks:
                self._check_guards(args)
        elif self.prepare is not None:  # the guarded fallback: Dynamo at every call
            self.prepare(args)
        return self._fn(*args)

    def _phase(self, name: str, t0: float) -> float:
        """Adds the seconds since `t0` to phase `name`; returns now."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - t0
        return now

    # ---- first call ------------------------------------------------------------

    def _first(self, args: tuple) -> dict | None:
        """Load or compile the step; returns the entry's header where the
        compiled step is to be saved after its first run (else None)."""
        t0 = t = time.perf_counter()
        header = None
        if self.config.cache_dir is not None:
            from compile_backend.compile import step_cache

            header, why_not = self._entry_header(args)
            t = self._phase("key", t)
            if why_not:
                logger.warning("mrv2: no warm-start cache for this model: %s", why_not)
                header = None
            else:
                self.cache_path = step_cache.entry_path(self.config.cache_dir, header)
                entry = self._read(header)
                if entry is not None and self._load(entry, args, t0):
                    return None
        if self.prepare is not None:
            self.prepare(args)
        # Only a compile wraps: a load needs none of what torch.compile imports
        # (functorch's compile stack, networkx: 0.2 s on the CPU machine).
        t = time.perf_counter()
        aot_compile = self._aot_compile()
        t = self._phase("wrap", t)
        if aot_compile is None:
            self._guarded("this torch has no aot_compile")
            return None
        # Compile workers start before Dynamo traces: they import torch meanwhile.
        start_workers = getattr(self.backend, "start_workers", None)
        if start_workers is not None:
            start_workers()
        t = time.perf_counter()
        try:
            with progress(f"compiling {type(self.model).__name__} (Dynamo trace, pieces)"):
                aot = aot_compile((args, {}))
        except Exception as e:  # noqa: BLE001 - any failure: the guarded path still serves
            self._guarded(f"aot_compile failed ({type(e).__name__}: {e})")
            return
        finally:
            if start_workers is not None:
                self.backend.close_workers()  # unless the compile took them
        counters["aot_compiles"] += 1
        self._phase("compile", t)
        self._bind(aot, "compiled", t0)
        return header

    def _aot_compile(self) -> Callable[..., Any] | None:
        """torch.compile's AOT compile of the model's forward (None: this
        torch has none). The forward is traced as the function
        `type(model).forward` (its first argument the model): torch 2.11 has
        aot_compile on compiled functions, not on a compiled module's
        forward. Module hooks do not run, as in any CUDA-graph replay of the
        model. torch 2.11 attaches aot_compile only under enable_aot_compile
        (on by default from 2.12); the flag is read when torch.compile wraps."""
        flag = ({"enable_aot_compile": True}
                if hasattr(torch._dynamo.config, "enable_aot_compile") else {})
        with torch._dynamo.config.patch(**flag):
            keep = guard_filter(self.config.debug_checks)
            return getattr(torch.compile(
                self.model.forward, fullgraph=True, backend=self.backend,
                options={"guard_filter_fn": keep} if keep is not None else None),
                "aot_compile", None)

    def _bind(self, aot: Any, how: str, t0: float) -> None:
        if how == "loaded":
            self._adopt(aot._artifacts.compiled_fn)
            self.path = "dynamo"
        self._aot = aot
        model, fn = self.model, aot.fn  # Dynamo's code, bound to the compiled step
        self._fn = lambda *args: fn(model, *args)
        self.how = how
        self.seconds = time.perf_counter() - t0
        if self.config.debug_dump_path:  # depyf's decompiled code, which its hook misses here
            from compile_backend.debug.dump import write_aot_code

            write_aot_code(self.config.debug_dump_path, fn, aot._artifacts.compiled_fn)

    def _adopt(self, step: Any) -> None:
        """A loaded step runs under this runner's config where the key leaves
        it out (step_cache.NOT_IN_KEY: where the dump and the cache go, the
        capture sizes...), and writes its compile dump as a compiled one does."""
        import dataclasses

        from compile_backend.compile.compiled_step import CompiledStep
        from compile_backend.compile.step_cache import NOT_IN_KEY

        if not isinstance(step, CompiledStep):
            return
        step.config = dataclasses.replace(
            step.config, **{name: getattr(self.config, name) for name in NOT_IN_KEY})
        if step.config.debug_dump_path:
            from compile_backend.debug.dump import write_compile_dump

            write_compile_dump(step.config.debug_dump_path, step)

    def summary(self) -> dict[str, Any]:
        """For the debug dump's runtime section."""
        return {"how": self.how, "path": self.path, "cache_entry": self.cache_path,
                "seconds": round(self.seconds, 3),
                "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "load_parts": {k: round(v, 3) for k, v in self.load_parts.items()}}

    def _guarded(self, reason: str) -> None:
        """The fallback: Dynamo with guards, graph breaks allowed (as before
        runner steps skipped Dynamo)."""
        counters["guarded_fallbacks"] += 1
        logger.warning("mrv2: the runner's steps go through Dynamo's guards: %s", reason)
        self._fn = torch.compile(self.model, backend=self.backend)
        self.how = "guarded"

    # ---- cache -------------------------------------------------------------------

    def _read(self, header: dict) -> dict | None:
        """This runner's entry (None: none, or a bad one: counted, logged)."""
        import os

        from compile_backend.compile import step_cache

        path = self.cache_path
        if not os.path.exists(path):
            counters["cache_misses"] += 1
            return None
        t = time.perf_counter()
        try:
            entry = step_cache.read_entry(path, header)
        except Exception as e:  # noqa: BLE001 - a bad entry is compiled again, never used
            self._refuse(e)
            return None
        self._phase("read", t)
        return entry

    def _refuse(self, e: Exception) -> None:
        counters["cache_misses"] += 1
        counters["cache_bad_entries"] += 1
        logger.warning("mrv2: warm-start entry %s not used, compiling again: %s", self.cache_path,
                       f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else e)

    def _load(self, entry: dict, args: tuple, t0: float) -> bool:
        """Bind the entry's step: without Dynamo where the entry says how and
        guards are not asked for (`debug_checks`), else through Dynamo's
        saved code. False: nothing loaded (compile)."""
        direct = entry.get("direct")
        if direct is not None and not self.config.debug_checks and self._load_direct(direct, t0):
            return True
        if self.prepare is not None:
            self.prepare(args)
        aot = self._load_dynamo(entry["aot"], args)
        if aot is None:
            return False
        self._bind(aot, "loaded", t0)
        return True

    def _load_direct(self, direct: dict, t0: float) -> bool:
        """The step alone, called as its plan says (compile/direct_step.py):
        no Dynamo imported, no guard built. False where it cannot be
        (logged, `direct_load_failures`): the entry then loads through Dynamo."""
        from compile_backend.compile import direct_step, step_artifacts
        from compile_backend.compile.compiled_step import CompiledStep

        try:  # the plan first: a model it does not fit loads no step
            t = time.perf_counter()
            inputs = direct_step.resolve(direct["plan"], self.model)
            t = self._phase("resolve", t)
            step_artifacts.last_load_seconds.clear()
            step = CompiledStep.deserialize_compile_artifacts(direct["step"])
            self._phase("deserialize", t)
        except Exception as e:  # noqa: BLE001 - Dynamo's saved code still serves
            counters["direct_load_failures"] += 1
            logger.warning("mrv2: warm-start entry %s not loaded without Dynamo, loading it "
                           "through Dynamo: %s: %s", self.cache_path, type(e).__name__, e)
            for phase in ("deserialize", "resolve"):
                self.phases.pop(phase, None)
            return False
        self._note_load_parts()
        counters["cache_hits"] += 1
        counters["direct_loads"] += 1
        logger.info("mrv2: loaded the compiled step from %s (without Dynamo)", self.cache_path)
        self._adopt(step)
        self._fn = direct_step.bind(step, inputs, self.model)
        self.how, self.path = "loaded", "direct"
        self.seconds = time.perf_counter() - t0
        return True

    def _note_load_parts(self, dynamo: bool = False) -> None:
        """`load_parts` from the step's own load (step_artifacts.last_load_seconds)
        and, where Dynamo loaded it, the rest of `deserialize` as Dynamo's."""
        from compile_backend.compile import step_artifacts

        parts = step_artifacts.last_load_seconds
        if not parts:  # Dynamo's load never reached the step's
            return
        self.load_parts = {"step_graph": parts["graph"], "step_pieces": parts["pieces"]}
        if dynamo:
            self.load_parts["dynamo"] = max(0.0, self.phases["deserialize"] - sum(parts.values()))

    def _load_dynamo(self, data: bytes, args: tuple) -> Any:
        """Dynamo's saved function around the step, its guards checked once
        against this model and these inputs (None: refused, counted, logged)."""
        try:
            t = time.perf_counter()
            from torch._dynamo.aot_compile import AOTCompiledFunction

            from compile_backend.compile import step_artifacts
            from compile_backend.compile.compiled_step import register_with_dynamo

            register_with_dynamo()
            step_artifacts.last_load_seconds.clear()
            aot = AOTCompiledFunction.deserialize(data)
            t = self._phase("deserialize", t)
            self._note_load_parts(dynamo=True)
            # Once, at load: the saved guards accept this model and these inputs.
            failed = _failed_guards(aot, self.model, args)
            self._phase("guard_check", t)
            if failed:
                raise RuntimeError(f"its guards refuse this model and inputs: {failed}")
        except Exception as e:  # noqa: BLE001 - a bad entry is compiled again, never used
            self._refuse(e)
            return None
        counters["cache_hits"] += 1
        logger.info("mrv2: loaded the compiled step from %s", self.cache_path)
        return aot

    def _save(self, aot: Any, header: dict, first: Any, args: tuple) -> None:
        """The entry: Dynamo's function around the step and, where the first
        call showed how (direct_step.plan_for), the step alone with its plan."""
        from compile_backend.compile import direct_step, step_cache

        try:
            data = type(aot).serialize(aot).serialized_data
            step = aot._artifacts.compiled_fn
            plan, why_not = direct_step.plan_for(aot, step, self.model, args, first)
            direct = None
            if plan is not None:
                direct = {"step": type(step).serialize_compile_artifacts(step), "plan": plan}
            else:
                counters["direct_plan_refusals"] += 1
                logger.info("mrv2: the saved step will load through Dynamo, not without it: %s",
                            why_not)
            step_cache.write_entry(self.cache_path, header, data, direct)
        except Exception as e:  # noqa: BLE001 - the step runs; only the next start is cold
            counters["cache_save_failures"] += 1
            logger.warning("mrv2: could not save the compiled step to %s (%s: %s); the next "
                           "process compiles again", self.cache_path, type(e).__name__, e)

    # ---- debug_checks ------------------------------------------------------------

    def _check_guards(self, args: tuple) -> None:
        reason = _failed_guards(self._aot, self.model, args)
        if not reason:
            return
        raise RuntimeError(
            "mrv2 debug_checks: the runner's compiled step no longer fits this call "
            f"(failed guards: {reason}). Runner steps skip Dynamo's guards: the model's code, "
            "parameters and buffers must stay the same objects and the inputs keep their "
            "dtypes and ranks. Build a new ModelRunner after changing the model.")


def guard_filter(debug_checks: bool) -> Callable[[Any], list[bool]] | None:
    """The guards a runner's step keeps (torch's `guard_filter_fn`): what
    torch's AOT compile keeps by default (no guard on a global, none of a
    type it cannot save), less those on the model's parameters and buffers
    unless `debug_checks`. A runner never evaluates guards per step; a
    saved step's entry is keyed by every parameter's and buffer's name,
    shape, strides, dtype, device and requires_grad (step_cache.entry_header),
    so the guards on them (a third of the load's guard build on a 32-layer
    model) only re-checked that. Under `debug_checks` they stay, so a
    parameter changed after the compile is named at the next step. None
    where this torch does not say which guard types it cannot save (then
    its own default applies)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", None)
    if unsaved is None:
        return None

    def keep(entries: Any) -> list[bool]:
        return [not (g.is_global or g.guard_type in unsaved
                     or (not debug_checks and _on_model_state(g.name)))
                for g in entries]
    return keep


def _on_model_state(source: str) -> bool:
    """Does a guard's source name a module's parameter or buffer
    (`L['self']._modules['layers']._modules['0']._parameters['weight']`)?"""
    return "._parameters[" in source or "._buffers[" in source


def _failed_guards(aot: Any, model: torch.nn.Module, args: tuple) -> list[str]:
    """The guards of `aot` that this call fails (empty: it passes). The
    inputs are checked without the dynamic-dimension marks the runner puts on
    its first call's tensors (a guard compares marks, not what they mean)."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    if aot.guard_check(model, *args):
        return []
    f_locals = aot.prepare_f_locals(model, *args)
    return list(aot._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)
