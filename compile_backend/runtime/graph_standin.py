"""A CPU stand-in for CUDA graphs, exactly as strict as the real thing, for
tests and benchmark dry runs (`with use_graph_backend(StandInGraphs()):`).

Capture runs the callable (its Python-level effects happen, as on a GPU) but
leaves no tensor written: every tensor an op writes, and the callable's
tensor arguments, are restored when capture ends, and every new output is
poisoned (NaN; integers: the dtype's minimum; bools: True). Replay re-runs
the callable on the capture-time tensors under the capture-time forward
context and copies the results into the capture-time outputs. So a caller
that uses what a capture returned, or relies on its writes, fails here as on
a GPU. `compile_backend.standin_graphs()` is the public switch (`mrv2 demo
--standin`, `check_against_eager(..., standin=True)`). docs/design.md,
section "The CPU stand-in is as strict as a GPU".
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from compile_backend.core.forward_context import ForwardContext, set_forward_context


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written_tensors(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors `func` writes, read from its schema (`Tensor(a!)`)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


class _UndoWrites(TorchDispatchMode):
    """Saves each tensor an op writes (on its first write through that view)
    and which storages existed before capture; `undo()` restores them."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo runs compiled code inside a capture, as under
        torch.cuda.graph (the mode sees that code's ops, not the compiler's).
        Without this, Dynamo skips a frame it meets under the mode, and went
        on skipping it after: one FULL capture (the model's frame entered
        under the mode) left every later step of that model uncompiled, so
        its PIECEWISE graphs were never replayed nor captured again."""
        return True

    def __init__(self, args: Sequence[Any]) -> None:
        super().__init__()
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
        self.produced: set[int] = set()  # storages created during capture
        self.ops = 0  # ops run so far (what a CUDA graph's node count is to a derivation)
        self.preexisting: set[int] = set()  # storages read or written that predate it
        for t in pytree.tree_leaves(list(args)):
            if isinstance(t, torch.Tensor):
                self._save(t)
                self.preexisting.add(_storage_ptr(t))

    def _save(self, t: torch.Tensor) -> None:
        key = (_storage_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in self.seen:
            return
        self.seen.add(key)
        self.saved.append((t, t.detach().clone()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and _storage_ptr(t) not in self.produced:
                self.preexisting.add(_storage_ptr(t))
        for t in _written_tensors(func, args, kwargs):
            if _storage_ptr(t) not in self.produced:
                self._save(t)
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_ptr(t) not in self.preexisting:
                self.produced.add(_storage_ptr(t))
        return out

    def undo(self) -> None:
        with torch.no_grad():
            for t, before in reversed(self.saved):
                t.copy_(before)
        self.saved.clear()


def poison_(t: torch.Tensor) -> None:
    """What an output of a capture holds on a GPU: nothing meaningful."""
    with torch.no_grad():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).min)


class StandInGraph:
    def __init__(self):
        self.fn = None
        self.entry = None
        self.ctx = None
        self.replays = 0
        self.preexisting: set[int] = set()

    def replay(self):
        self.replays += 1
        scope = set_forward_context(self.ctx) if self.ctx is not None else contextlib.nullcontext()
        with scope, torch.no_grad():
            out = self.fn(*self.entry.inputs)
        for held, new in zip(pytree.tree_leaves(self.entry.outputs), pytree.tree_leaves(out)):
            if isinstance(held, torch.Tensor) and held is not new:
                held.copy_(new)


class _StandInPool:
    """A memory pool handle with the CUDA caching allocator's rule: the pool
    is freed with the last graph captured into it, and a capture into its
    handle after that fails (torch asserts `use_count > 0`)."""

    def __init__(self) -> None:
        self.graphs: "weakref.WeakSet[StandInGraph]" = weakref.WeakSet()
        self.used = False

    def take(self, graph: StandInGraph) -> None:
        if self.used and not self.graphs:
            raise RuntimeError("capture into a memory pool whose graphs have all died: the CUDA "
                               "caching allocator has freed it; capture into a new pool handle")
        self.used = True
        self.graphs.add(graph)


class StandInGraphs:
    def __init__(self):
        self.graphs: list[weakref.ref[StandInGraph]] = []  # every graph made (dead ones too)
        self._mode: _UndoWrites | None = None  # the capture in progress

    def new_graph(self, keep_graph: bool = False):
        g = StandInGraph()
        self.graphs.append(weakref.ref(g))  # a graph dies when its holders drop it, as on a GPU
        return g

    @contextlib.contextmanager
    def capture(self, graph: StandInGraph, pool: Any, args: Sequence[Any] = (), instantiate: bool = True):
        if isinstance(pool, _StandInPool):
            pool.take(graph)
        mode = self._mode = _UndoWrites(args)
        try:
            with mode:
                yield
        finally:
            self._mode = None
            mode.undo()
            graph.preexisting = mode.preexisting

    def can_derive(self) -> str | None:
        return None

    def node_count(self) -> int:
        """The ops the capture in progress ran so far (a CUDA graph counts nodes)."""
        return self._mode.ops

    def node_counter(self) -> Callable[[], int]:
        """`node_count` for the capture in progress."""
        mode = self._mode
        assert mode is not None, "node_counter outside a capture"
        return lambda: mode.ops

    def derive(self, source: StandInGraph, side: StandInGraph,
               pairs: Sequence[tuple[int, int, int, int]]) -> StandInGraph:
        """A graph that replays, as the derived CUDA graph does, the source's
        step with the other form of each recorded op: here by running the step
        under the context `after_capture` gives it (the derived graph's)."""
        assert all(first <= end and side_first <= side_end
                   for first, end, side_first, side_end in pairs), pairs
        derived = self.new_graph()
        derived.keep = [source, side]  # as a derived CUDA graph holds them
        return derived

    def pool(self):
        return _StandInPool()

    def memory_allocated(self):
        return 0

    def synchronize(self):
        pass

    def empty_cache(self):  # no allocator cache on the CPU
        pass

    def after_capture(self, cuda_graph, fn, entry, ctx):
        cuda_graph.fn, cuda_graph.entry = fn, entry
        for t in pytree.tree_leaves(entry.outputs):
            if isinstance(t, torch.Tensor) and _storage_ptr(t) not in cuda_graph.preexisting:
                poison_(t)
        cuda_graph.preexisting = set()
        if ctx is not None:  # frozen copy: same metadata objects, capture-time ints
            cuda_graph.ctx = ForwardContext(
                attn_metadata=dict(ctx.attn_metadata), graph=ctx.graph, trace=ctx.trace)


# What a run that captures with the stand-in says (the demo, check_against_eager).
STANDIN_NOTE = "graphs: CPU stand-in (replays with capture-time state; not a CUDA graph)"


@contextlib.contextmanager
def standin_graphs() -> Iterator[StandInGraphs]:
    """Capture and replay with the CPU stand-in while active, CUDA or not:
    graph modes are not lowered to `none`, and every capture and replay runs
    through `StandInGraphs` (the module docstring says how strict it is).
    Shows on a CPU what a graph mode does; it is no speed-up (a replay runs
    the captured code again).

        with compile_backend.standin_graphs():
            runner.capture()
            logits = runner.execute(batch)
    """
    from compile_backend.runtime.graph_pool import use_graph_backend

    with use_graph_backend(StandInGraphs()) as graphs:
        yield graphs
