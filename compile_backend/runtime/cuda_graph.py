"""The CUDA-graph wrapper. It knows nothing of compilation: it wraps a callable
and, per batch descriptor, captures it once and replays it after.

Which graph a call uses comes from the forward context the runner sets:
  runtime mode == wrapper's mode and a batch descriptor  -> capture or replay
  anything else (NONE, or FULL around a PIECEWISE piece) -> run the callable
Without a forward context (plain torch.compile use, no runner), a wrapper keys
graphs by its inputs' shapes: the first call of a shape runs eagerly as
warm-up, the second captures, later ones replay. A FULL wrapper runs its
callable under a FULL forward context without a descriptor, so PIECEWISE
wrappers inside it run their callables (one graph, not nested captures).

Capture never hands out what it recorded. Capturing records kernels and runs
none: the capturing call's outputs are uninitialised memory and its writes
(KV cache, conv state) do not happen. So every capture is followed by one
replay, whose outputs the call returns and whose writes happen exactly once.
A caller that must not capture on demand (the draft loop) checks
`is_captured` first and raises.

Addresses. A graph reads and writes the addresses seen at capture. Inputs at a
new address are copied into the capture-time tensor (held by the wrapper, so
it stays valid); with `debug_checks`, inputs named stable (parameters, caches)
and every persistent metadata tensor must not move, and a replay raises naming
the tensor if one did. Outputs are held weakly (a non-owning tensor on the
pool's memory), so a block no later graph reads returns to the shared pool;
so are capture-time inputs that are another graph's outputs (the pool's
memory), while a caller's tensors are held (a replay may copy into them).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.utils._pytree as pytree

from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.core.counters import counters
from compile_backend.core.forward_context import (
    ForwardContext, get_forward_context, has_forward_context, set_forward_context,
)

logger = logging.getLogger(__name__)


class TorchCUDAGraphs:
    """The real thing; tests substitute a stand-in with the same three methods."""

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Any, pool: Any, args: Sequence[Any] = ()) -> contextlib.AbstractContextManager:
        """`args`: the callable's arguments (a stand-in protects them; CUDA needs nothing)."""
        return torch.cuda.graph(graph, pool=pool)

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


_shared_pool: Any = None
_graph_backend: Any = None  # a stand-in set by use_graph_backend (tests)


def current_graph_backend() -> Any:
    return _graph_backend if _graph_backend is not None else TorchCUDAGraphs()


def graph_backend_overridden() -> bool:
    return _graph_backend is not None


@contextlib.contextmanager
def use_graph_backend(graphs: Any):
    """Capture with a stand-in graph object (new_graph/capture/pool/...) instead
    of CUDA: lets CPU tests drive capture, dispatch and address checks. Graph
    modes are not lowered to NONE while it is active."""
    global _graph_backend, _shared_pool
    previous, previous_pool = _graph_backend, _shared_pool
    _graph_backend, _shared_pool = graphs, None
    _pool_outputs.clear()
    try:
        yield graphs
    finally:
        _graph_backend, _shared_pool = previous, previous_pool


_pool_graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()  # graphs captured into it
_wrappers: "weakref.WeakSet[CUDAGraphWrapper]" = weakref.WeakSet()  # every wrapper, for release_graphs
# Storage addresses of the shared pool's graph outputs: a later graph that
# takes one as input holds it weakly (the pool owns that memory), so the
# capture-time inputs of every piece of every size do not keep it allocated.
_pool_outputs: set[int] = set()


def shared_graph_pool(graphs: Any) -> Any:
    """One memory pool for every live graph (captured largest first, so smaller
    graphs reuse the blocks of larger ones). The allocator frees a pool when
    its last graph dies, so a handle is reused only while a graph holds it."""
    global _shared_pool
    if _shared_pool is None or not _pool_graphs:
        _shared_pool = graphs.pool()
        _pool_outputs.clear()  # the old pool's addresses may now be anyone's
    return _shared_pool


def release_graphs() -> int:
    """Free every captured graph and the shared pool's memory; returns how
    many graphs were freed. Each wrapper forgets its graphs, so a later call
    of a compiled model or runner captures again (on demand) into a new pool.

    Needed because graphs outlive their runner and `torch._dynamo.reset()`:
    Dynamo keeps each compiled step in the traced module's globals
    (`__compiled_fn_*`). Without this, switching models keeps the old
    model's graphs (and pool) alive, and the new model's graphs share that
    pool. Call it when no graph is in flight on another stream."""
    global _shared_pool
    graphs = list(_pool_graphs)
    wrappers = list(_wrappers)
    _shared_pool = None
    if not graphs and not wrappers:
        return 0
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:  # no replay in flight (stand-in graphs need nothing)
        torch.cuda.synchronize()
    for wrapper in wrappers:
        wrapper.entries.clear()
        wrapper._keys.clear()
    for graph in graphs:
        reset = getattr(graph, "reset", None)  # torch.cuda.CUDAGraph; stand-ins have none
        if reset is not None:
            reset()
    _pool_graphs.clear()
    _pool_outputs.clear()
    if cuda:
        torch.cuda.synchronize()
    return len(graphs)


def _held_input(a: Any) -> Any:
    """How a graph keeps a capture-time argument: weakly when it is an output
    of a graph of the pool (the pool owns it; holding it would keep it out of
    later captures), strongly otherwise (a caller's tensor may be freed, and
    a replay copies a moved input into it)."""
    if (isinstance(a, torch.Tensor) and a.device.type == "cuda" and _pool_outputs
            and type(a) is torch.Tensor and a.untyped_storage().data_ptr() in _pool_outputs):
        return weak_ref(a)
    return a


def weak_ref(t: Any) -> Any:
    """A tensor aliasing `t`'s memory without owning it."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        return t
    s = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(s.data_ptr(), t.device, s.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.shape, t.stride()
    )


@dataclass
class CapturedGraph:
    graph: Any
    inputs: list[Any]  # capture-time args (tensors held: replay copies into them)
    # (index, address) of the tensor inputs: what a replay compares, no more
    tensor_ptrs: tuple[tuple[int, int], ...]
    outputs: Any  # pytree of (weakly held) tensors
    metadata_ptrs: dict[str, int] = field(default_factory=dict)  # "layer.field" -> ptr
    seconds: float = 0.0
    pool_bytes: int = 0  # allocator growth during capture


def _metadata_ptrs(ctx: ForwardContext | None) -> dict[str, int]:
    if ctx is None:
        return {}
    out = {}
    for layer, meta in ctx.attn_metadata.items():
        tensors = meta.tensors() if hasattr(meta, "tensors") else {}
        for name, t in tensors.items():
            out[f"{layer}.{name}"] = t.data_ptr()
    return out


class CUDAGraphWrapper:
    def __init__(
        self,
        fn: Callable[..., Any],
        mode: CUDAGraphMode,
        name: str = "graph",
        debug_checks: bool = False,
        stable_inputs: Sequence[int] = (),
        input_names: Sequence[str] | None = None,
        graphs: Any = None,
    ) -> None:
        assert mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL), mode
        self.fn = fn
        self.mode = mode
        self.name = name
        self.debug_checks = debug_checks
        self.stable_inputs = set(stable_inputs)
        self.input_names = list(input_names) if input_names else None
        self.graphs = graphs or current_graph_backend()
        self.entries: dict[Hashable, CapturedGraph] = {}
        self._keys: dict[Hashable, Hashable] = {}  # descriptor -> key_of(descriptor), memoized
        self._warmed_shapes: set[Hashable] = set()
        # Without a runner, a FULL graph holds every piece: PIECEWISE wrappers
        # inside it see a FULL context without a descriptor and run their callables.
        self._lazy_ctx = ForwardContext(cudagraph_runtime_mode=mode) if mode is CUDAGraphMode.FULL else None
        _wrappers.add(self)

    # ---- dispatch ---------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        # The hot path of every piece of every step: few calls, no allocation.
        if not has_forward_context():
            return self._lazy(args)
        ctx = get_forward_context()
        desc = ctx.batch_descriptor
        if ctx.cudagraph_runtime_mode is not self.mode or desc is None:
            return self.fn(*args)
        key = self._keys.get(desc)
        if key is None:
            key = self._keys[desc] = self.key_of(desc)
        entry = self.entries.get(key)
        if entry is None:
            return self._capture(key, args, ctx)
        return self._replay(entry, args, ctx)

    def key_of(self, desc: Hashable) -> Hashable:
        """The key a descriptor's graph is held under."""
        return desc.relaxed() if self.mode is CUDAGraphMode.PIECEWISE else desc

    def is_captured(self, desc: Hashable) -> bool:
        return self.key_of(desc) in self.entries

    def _lazy(self, args: Sequence[Any]) -> Any:
        """No runner: graphs keyed by input shapes, captured on the second call."""
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        ctx = self._lazy_ctx
        with set_forward_context(ctx) if ctx is not None else contextlib.nullcontext():
            entry = self.entries.get(key)
            if entry is not None:
                return self._replay(entry, args, ctx)
            if key not in self._warmed_shapes:
                self._warmed_shapes.add(key)
                counters["lazy_warmups"] += 1
                return self.fn(*args)
            counters["lazy_captures"] += 1
            return self._capture(key, args, ctx)

    # ---- capture and replay -------------------------------------------------

    def _capture(self, key: Hashable, args: Sequence[Any], ctx: ForwardContext | None) -> Any:
        """Capture, then replay once: the call returns the replay's outputs."""
        graph = self.graphs.new_graph()
        pool = shared_graph_pool(self.graphs)
        _pool_graphs.add(graph)
        self.graphs.synchronize()
        before = self.graphs.memory_allocated()
        t0 = time.perf_counter()
        if ctx is not None:
            ctx.capturing = True
        try:
            with self.graphs.capture(graph, pool, args):
                outputs = self.fn(*args)
        finally:
            if ctx is not None:
                ctx.capturing = False
        self.graphs.synchronize()
        for t in pytree.tree_leaves(outputs):
            if type(t) is torch.Tensor and t.device.type == "cuda":
                _pool_outputs.add(t.untyped_storage().data_ptr())
        entry = CapturedGraph(
            graph=graph,
            inputs=[_held_input(a) for a in args],
            tensor_ptrs=tuple((i, a.data_ptr()) for i, a in enumerate(args)
                              if isinstance(a, torch.Tensor)),
            outputs=pytree.tree_map(weak_ref, outputs),
            metadata_ptrs=_metadata_ptrs(ctx),
            seconds=time.perf_counter() - t0,
            pool_bytes=self.graphs.memory_allocated() - before,
        )
        self.entries[key] = entry
        if hasattr(self.graphs, "after_capture"):  # stand-ins replay by re-running
            self.graphs.after_capture(graph, self.fn, entry, ctx)
        counters["cudagraph_captures"] += 1
        logger.debug("captured %s for %s in %.3fs", self.name, key, entry.seconds)
        # The replay writes the outputs' memory (garbage until now). Hand out
        # the strong tensors: the rest of this call (later pieces' captures)
        # must not get their memory from the pool while they are in use.
        self._replay(entry, args, ctx)
        return outputs

    def _input_name(self, i: int) -> str:
        if self.input_names and i < len(self.input_names):
            return f"input {i} ({self.input_names[i]})"
        return f"input {i}"

    def _replay(self, entry: CapturedGraph, args: Sequence[Any], ctx: ForwardContext | None) -> Any:
        assert len(args) == len(entry.inputs), (len(args), len(entry.inputs))
        for i, ptr in entry.tensor_ptrs:
            a = args[i]
            if a.data_ptr() == ptr:
                continue
            if self.debug_checks and i in self.stable_inputs:
                raise RuntimeError(
                    f"{self.name}: {self._input_name(i)} moved since capture "
                    f"(0x{ptr:x} -> 0x{a.data_ptr():x}); the graph would read stale "
                    "memory. Keep parameters, buffers and caches at a fixed address."
                )
            entry.inputs[i].copy_(a)
            counters["replay_input_copies"] += 1
        if self.debug_checks and ctx is not None:
            now = _metadata_ptrs(ctx)
            for name, ptr in entry.metadata_ptrs.items():
                if now.get(name, ptr) != ptr:
                    raise RuntimeError(
                        f"{self.name}: persistent metadata tensor {name} moved since "
                        f"capture (0x{ptr:x} -> 0x{now[name]:x}); metadata builders must "
                        "write into their persistent buffers, not allocate new tensors."
                    )
        entry.graph.replay()
        counters["cudagraph_replays"] += 1
        return entry.outputs
