"""Check a model compiled with mrv2 against eager, call by call, in every mode.

    from compile_backend.testing import check_against_eager
    report = check_against_eager(model, [(x1,), (x1b,), (x1c,), (x2,), ...],
                                 modes=("piecewise", "full"))

For each mode a fresh copy of the model, compiled with mrv2, runs beside an
eager copy; after every call every tensor the call can reach is compared
(outputs, parameters and buffers, arguments and the tensors inside them),
and the first difference raises `EagerMismatch`. `sessions=N` repeats the
calls on deep copies; a `ModelRunner` takes `InputBatch`es; `standin=True`
captures on a CPU. Also the pytest fixture `mrv2_check_against_eager`
(entry point `pytest11`). docs/design.md, section "Checking against eager".
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.utils._pytree as pytree

from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.core.counters import counters

ALL_MODES = tuple(m.value for m in CUDAGraphMode)


class EagerMismatch(AssertionError):
    """A compiled call differs from eager (the message says where)."""


class NothingCapturedWarning(UserWarning):
    """A graph mode was checked and no graph was captured: the compiled side
    ran without graphs, so the check says nothing about capture or replay.
    `warnings.simplefilter("error", NothingCapturedWarning)` (or pytest's
    `-W error::compile_backend.testing.NothingCapturedWarning`) makes it an error."""


@dataclass
class ModeReport:
    mode: str
    calls: int = 0
    # Graphs captured for this mode: a runner's capture() and, lazily or for
    # a new address, during the calls.
    captures: int = 0
    replays: int = 0  # during the calls (each compared with eager)
    dynamo_graphs: int = 0  # graphs Dynamo handed to mrv2 during the calls (a runner's: at capture)
    full_graph_fallbacks: int = 0  # no runner: FULL given up (the log says why)
    shapes: dict[str, int] = field(default_factory=dict)  # input shapes -> calls
    graphs: str = ""  # what captured: "graphs: CUDA", STANDIN_NOTE, or why none

    def __str__(self) -> str:
        return (f"{self.mode}: {self.calls} calls, {self.captures} graphs captured, "
                f"{self.replays} replays; {self.graphs}")


@dataclass
class CheckReport:
    modes: list[ModeReport] = field(default_factory=list)

    def __getitem__(self, mode: str) -> ModeReport:
        return next(r for r in self.modes if r.mode == CUDAGraphMode.parse(mode).value)

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.modes)


def _clone(x: Any) -> Any:
    """A detached copy of every tensor in `x` (outputs of a replay alias graph
    memory that the next replay overwrites; inputs may be written in place)."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, x)


def _shapes(args: Any) -> str:
    return str([tuple(t.shape) for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)])


def _leaves_with_names(x: Any, prefix: str) -> list[tuple[str, Any]]:
    leaves, spec = pytree.tree_flatten_with_path(x)
    return [(prefix + pytree.keystr(path), leaf) for path, leaf in leaves]


def _first_difference(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)}/{got.dtype}, eager {tuple(want.shape)}/{want.dtype}"
    if not got.dtype.is_floating_point:
        bad = (got != want).sum().item()
        return None if bad == 0 else f"{bad} of {got.numel()} elements differ"
    g, w = got.double(), want.double()
    if torch.equal(torch.isnan(g), torch.isnan(w)) and torch.allclose(g, w, atol=atol, rtol=rtol, equal_nan=True):
        return None
    err = (g - w).abs().nan_to_num(float("inf"))
    return (f"max abs error {err.max().item():.3g} (atol {atol:g}, rtol {rtol:g}), "
            f"{(err > atol + rtol * w.abs()).sum().item()} of {got.numel()} elements out of tolerance")


def _compare(tag: str, got: Any, want: Any, atol: float, rtol: float) -> set[int]:
    """Raise EagerMismatch for the first tensor of `got` that differs from
    `want`; returns the ids of `got`'s tensors it compared."""
    got_leaves, want_leaves = _leaves_with_names(got, "output"), _leaves_with_names(want, "output")
    if len(got_leaves) != len(want_leaves):
        raise EagerMismatch(f"{tag}: {len(got_leaves)} outputs, eager gave {len(want_leaves)}")
    for (name, g), (_, w) in zip(got_leaves, want_leaves):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor):
            why = _first_difference(g, w, atol, rtol)
        elif isinstance(g, (int, float, str, bool, type(None))):
            why = None if g == w else f"{g!r}, eager {w!r}"
        else:  # an object (a cache): its tensors are compared by reachable_tensors
            why = None if type(g) is type(w) else f"{type(g).__name__}, eager {type(w).__name__}"
        if why is not None:
            raise EagerMismatch(f"{tag}: {name} differs from eager: {why}")
    return {id(g) for _, g in got_leaves if isinstance(g, torch.Tensor)}


def reachable_tensors(x: Any, name: str, max_depth: int = 8) -> dict[str, torch.Tensor]:
    """Every tensor reachable from `x` by name: through lists, tuples, dicts
    and the attributes of plain objects (a cache's layers, a model output),
    each tensor once. Modules are left out (their parameters and buffers are
    compared by name)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(v: Any, path: str, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen.add(id(v))
                out[path] = v
            return
        if (depth > max_depth or id(v) in seen or v is None or isinstance(v, torch.nn.Module)
                or isinstance(v, (str, bytes, int, float, bool, type, torch.dtype, torch.device))
                or callable(v) and not hasattr(v, "__dict__")):
            return
        seen.add(id(v))
        if isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]", depth + 1)
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(item, f"{path}[{k!r}]", depth + 1)
        elif hasattr(v, "__dict__") and not callable(v):
            for k, item in vars(v).items():
                walk(item, f"{path}.{k}", depth + 1)

    walk(x, name, 0)
    return out


def _compare_reachable(tag: str, what: str, got: Any, want: Any, atol: float, rtol: float,
                       compared: set[int] = frozenset()) -> None:
    """Compare every tensor reachable from `got` with the one of the same name
    in `want`, but those whose ids are in `compared` (done already)."""
    g, w = reachable_tensors(got, what), reachable_tensors(want, what)
    if set(g) != set(w):
        missing = sorted(set(g) ^ set(w))[:5]
        raise EagerMismatch(f"{tag}: {what} holds other tensors than eager's: {missing}")
    for name, t in g.items():
        if id(t) in compared:
            continue
        why = _first_difference(t.detach(), w[name].detach(), atol, rtol)
        if why is not None:
            raise EagerMismatch(f"{tag}: {name} differs from eager: {why}")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    return state


def _compare_state(tag: str, got: torch.nn.Module, want: torch.nn.Module, atol: float, rtol: float) -> None:
    want_state = _state(want)
    for name, g in _state(got).items():
        why = _first_difference(g.detach(), want_state[name].detach(), atol, rtol)
        if why is not None:
            raise EagerMismatch(f"{tag}: model tensor {name!r} differs from eager: {why}")


def _count_shapes(calls: Sequence[Any], min_calls_per_shape: int) -> None:
    seen: dict[str, int] = {}
    for c in calls:
        if not callable(c):
            seen[_shapes(c)] = seen.get(_shapes(c), 0) + 1
    few = {s: n for s, n in seen.items() if n < min_calls_per_shape}
    if few:
        raise ValueError(
            f"input shapes {few} come fewer than {min_calls_per_shape} times; a graph is "
            "compared only when each shape is warmed up, captured and replayed: repeat "
            "each shape's call at least that often (fresh inputs each time)")


def _drive(subject: Callable[[Any], Any], reference: Callable[[Any], Any], subject_state,
           reference_state, calls: Sequence[tuple[Any, Any]], mode: str, atol: float,
           rtol: float, report: ModeReport, describe: Callable[[Any], str],
           session: int = 0, bar: Any = None) -> None:
    """`calls`: (the subject's call, the reference's call) pairs, each side's
    own objects, so that what a call writes into its arguments is compared."""
    captures, replays = counters["cudagraph_captures"], counters["cudagraph_replays"]
    fallbacks, graphs = counters["full_graph_fallbacks"], counters["dynamo_graphs"]
    for i, (sub_call, ref_call) in enumerate(calls):
        shape = describe(sub_call)
        tag = f"call {i} of session {session} (inputs {shape}), mode {mode}"
        want = _clone(reference(ref_call))
        got = _clone(subject(sub_call))
        compared = _compare(tag, got, want, atol, rtol)
        _compare_reachable(tag, "output", got, want, atol, rtol, compared)
        _compare_state(tag, subject_state, reference_state, atol, rtol)
        if not callable(sub_call):
            _compare_reachable(tag, "argument", sub_call, ref_call, atol, rtol)
        report.calls += 1
        report.shapes[shape] = report.shapes.get(shape, 0) + 1
        if bar is not None:
            bar.update()
    report.captures += counters["cudagraph_captures"] - captures
    report.replays += counters["cudagraph_replays"] - replays
    report.full_graph_fallbacks += counters["full_graph_fallbacks"] - fallbacks
    report.dynamo_graphs += counters["dynamo_graphs"] - graphs


def _session_calls(calls: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Each side's own copy of a session's calls: new state objects, every
    tensor at a new address, objects shared between calls still shared."""
    sub, ref = copy.deepcopy(list(calls)), copy.deepcopy(list(calls))
    return list(zip(sub, ref))


def _progress(mode: str, calls: int) -> Any:
    from compile_backend.core.progress import progress

    return progress(f"check_against_eager ({mode})", total=calls, unit="call")


def _check_model(model: torch.nn.Module, calls: Sequence[Any], mode: str,
                 options: dict[str, Any], atol: float, rtol: float,
                 sessions: int = 1) -> ModeReport:
    import torch._dynamo

    from compile_backend.compile.backend import mrv2_backend

    torch._dynamo.reset()  # each mode compiles its own copy from scratch
    reference, subject = copy.deepcopy(model), copy.deepcopy(model)
    options = {**options, "cudagraph_mode": mode}
    if type(subject).__module__.startswith("torch.nn."):
        # Dynamo skips torch.nn's own frames: compiled in place, a built-in
        # module (nn.Sequential) would run uncompiled. It has no generate loop.
        compiled: Any = torch.compile(subject, backend=mrv2_backend, options=options)
    else:
        # In place (Module.compile), so that methods calling the module's own
        # __call__ (a generate loop) run compiled too.
        subject.compile(backend=mrv2_backend, options=options)
        compiled = subject

    def run(m: Any, call: Any) -> Any:
        return call(m) if callable(call) else m(*call)

    report = ModeReport(mode)
    with _progress(mode, len(calls) * sessions) as bar:
        for session in range(sessions):
            _drive(lambda c: run(compiled, c), lambda c: run(reference, c), subject, reference,
                   _session_calls(calls), mode, atol, rtol, report,
                   lambda c: "a function of the model" if callable(c) else _shapes(c), session,
                   bar)
    return report


def _runner_copy(runner: Any, mode: str, eager: bool) -> Any:
    from compile_backend.runner.model_runner import ModelRunner

    kv = dataclasses.replace(runner.kv_cache_config, groups=[])
    config = dataclasses.replace(runner.config, cudagraph_mode=CUDAGraphMode.parse(mode))
    return ModelRunner(copy.deepcopy(runner.model), kv, config, runner.device, progress=False,
                       compile_fn=(lambda m: m) if eager else None)


def _check_runner(runner: Any, calls: Sequence[Any], mode: str, atol: float, rtol: float) -> ModeReport:
    import torch._dynamo

    torch._dynamo.reset()
    reference = _runner_copy(runner, "none", eager=True)
    subject = _runner_copy(runner, mode, eager=False)
    report = ModeReport(mode)
    # The runner captures its graphs before the first call: count them here
    # (the calls only replay them).
    captures, graphs = counters["cudagraph_captures"], counters["dynamo_graphs"]
    subject.capture()
    report.captures += counters["cudagraph_captures"] - captures
    report.dynamo_graphs += counters["dynamo_graphs"] - graphs
    # execute pads the batch it is given: each runner gets its own copy
    with _progress(mode, len(calls)) as bar:
        _drive(lambda b: subject.execute(b), lambda b: reference.execute(b), subject.model,
               reference.model, _session_calls(calls), mode, atol, rtol, report,
               lambda b: f"{b.num_tokens} tokens over {b.num_reqs} requests", bar=bar)
    return report


def _warn_if_nothing_captured(report: ModeReport) -> None:
    from compile_backend.runtime.machine import graph_mode_on_this_machine

    if report.mode == CUDAGraphMode.NONE.value or report.captures:
        return
    if not report.dynamo_graphs:
        why = ("Dynamo handed mrv2 no graph of the model (torch._dynamo.explain(model)(*inputs) "
               "says why), so it ran uncompiled")
    elif graph_mode_on_this_machine(CUDAGraphMode.parse(report.mode))[0] is CUDAGraphMode.NONE:
        why = ("this machine has no CUDA device, so graph modes run as none: run on a GPU, "
               "or pass standin=True to capture with the CPU stand-in")
    else:
        why = ("nothing in the compiled graphs was captured (every piece eager, the mode "
               "lowered by a metadata builder, or no shape called twice); the log says why")
    warnings.warn(f"check_against_eager: mode {report.mode} captured no graph, so its "
                  f"{report.calls} calls compared eager code with eager code: {why}",
                  NothingCapturedWarning, stacklevel=3)


def check_against_eager(
    model_or_runner: Any,
    calls: Iterable[Any],
    modes: Sequence[str] = ("piecewise", "full"),
    *,
    options: dict[str, Any] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    min_calls_per_shape: int = 3,
    sessions: int = 1,
    standin: bool = False,
) -> CheckReport:
    """Compare compiled and eager call by call in each of `modes`; raise
    `EagerMismatch` at the first difference, else return what ran (calls,
    graphs captured and replayed per mode, and what captured them: `str(report)`
    says it in a line per mode). `options`: more backend options
    (`piece_compiler`, ...) for a model; a runner brings its own config.
    `sessions`: how many times the calls are driven through the same compiled
    model, each time on new copies of the inputs and of the state objects
    they hold. The model is not changed: every mode runs on copies.

    `standin=True`: capture and replay with the CPU stand-in
    (`compile_backend.standin_graphs()`), CUDA or not; the report says so.

    A graph mode that ends with no graph captured does not raise: it warns
    (`NothingCapturedWarning`), naming why (on a CPU: no CUDA, so pass
    `standin=True`), since a check that replayed nothing proves little. Turn
    the warning into an error with the warnings filter if you want one."""
    calls = list(calls)
    if not isinstance(sessions, int) or sessions < 1:
        raise ValueError(f"sessions must be a positive int, got {sessions!r}")
    if not calls:
        raise ValueError("no calls to check: give the inputs of at least three calls per shape")
    for m in modes:
        CUDAGraphMode.parse(m)  # bad names fail before anything compiles
    from compile_backend.runner.model_runner import ModelRunner

    from compile_backend.runtime.graph_standin import standin_graphs
    from compile_backend.runtime.machine import graphs_here

    report = CheckReport()
    with torch.no_grad(), standin_graphs() if standin else contextlib.nullcontext():
        for m in modes:
            mode = CUDAGraphMode.parse(m).value
            if isinstance(model_or_runner, ModelRunner):
                r = _check_runner(model_or_runner, calls, mode, atol, rtol)
            else:
                _count_shapes(calls * sessions, min_calls_per_shape)
                r = _check_model(model_or_runner, calls, mode, dict(options or {}), atol, rtol,
                                 sessions)
            r.graphs = graphs_here(mode)
            report.modes.append(r)
            _warn_if_nothing_captured(r)
    return report
