"""The graph memory's lifecycle: which graph implementation captures (CUDA,
or a stand-in for CPU tests), the shared pool the runner's graphs are
captured into, a capture plan's scope (one collection, freeze, synchronize
and cache emptying for a whole plan), the outputs that live in graph memory,
and `release_graphs`, which frees all of it. The wrapper that captures and
replays (runtime/cuda_graph.py) asks this module for pools and registers its
graphs and outputs here."""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from compile_backend.core.frozen_gc import frozen_gc
from compile_backend.core.stream_buffers import declared_count, warm_stream_buffers

# Host seconds spent inside graph captures, by phase, summed over the process:
# "record" (the callable run under capture: kernels recorded, none run) and
# "instantiate" (capture_end: the graph made executable). A runner's
# CaptureRecord takes each graph's share (the capture profile in bench/startup.py).
capture_seconds: dict[str, float] = {"record": 0.0, "instantiate": 0.0}


# One side stream per device for every capture (as torch.cuda.graph keeps one).
_capture_streams: dict[int, Any] = {}
# device index -> how many per-stream buffers were declared when its capture
# stream was warmed (its cuBLAS workspaces are made once, at the first warm)
_warmed_streams: dict[int, int] = {}


def capture_stream(device: Any = None) -> Any:
    """The side stream every capture on `device` (default: the current one) runs on."""
    index = torch.device("cuda", torch.cuda.current_device()).index if device is None \
        else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(torch.device("cuda", index))
    return stream


def warm_capture_stream(device: Any = None) -> None:
    """Give the capture stream its cuBLAS and cuBLASLt workspaces now, outside
    any capture. torch allocates one workspace per (cuBLAS handle, stream)
    from the caching allocator, on the first GEMM it sees on that stream (32
    MiB by default on Hopper, plus cuBLASLt's). Left to the first capture,
    that allocation lands in the first graph's private pool and stays there
    for the process: 34 MiB that read as graph memory in the first mode
    captured and in no later one (docs/design.md, "Memory budget"). Once per
    device and process; a no-op where CUDA is not initialised. The kernels'
    per-stream buffers (compile_backend/core/stream_buffers.py) are made here
    too, and checked at every call (a module declaring one may be imported
    after the first capture)."""
    stream = capture_stream(device)
    warmed = _warmed_streams.get(stream.device_index)
    if warmed is not None:
        # Called before every capture of a plan (1155 in PIECEWISE for
        # llama8b): nothing to do unless a kernel module declared a buffer
        # since (imported late).
        if warmed != declared_count():
            with torch.cuda.stream(stream):
                warm_stream_buffers(stream.device)
            _warmed_streams[stream.device_index] = declared_count()
        return
    outer = torch.cuda.current_stream(stream.device)
    stream.wait_stream(outer)
    with torch.cuda.stream(stream):
        for dtype in (torch.float32, torch.bfloat16):  # cuBLAS (mm), cuBLASLt (linear with bias)
            a = torch.ones(16, 16, dtype=dtype, device=stream.device)
            torch.mm(a, a)
            torch.nn.functional.linear(a, a, a[0])
        warm_stream_buffers(stream.device)  # the kernels' per-stream buffers, outside every pool
    outer.wait_stream(stream)
    torch.cuda.synchronize(stream.device)
    _warmed_streams[stream.device_index] = declared_count()


class TorchCUDAGraphs:
    """The real thing; tests substitute a stand-in with the same methods
    (new_graph, capture, pool, memory_allocated, synchronize, empty_cache)."""

    def new_graph(self, keep_graph: bool = False) -> Any:
        """keep_graph: the captured cudaGraph_t stays (a source or a part of a
        derived graph: runtime/graph_surgery.py)."""
        if not keep_graph:
            return torch.cuda.CUDAGraph()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        graph._mrv2_keep = True
        return graph

    def can_derive(self) -> str | None:
        """Why this torch and driver cannot derive graphs (None: they can)."""
        try:
            torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:
            return f"torch {torch.__version__} has no CUDAGraph(keep_graph=True)"
        from compile_backend.runtime import graph_surgery

        try:
            graph_surgery.driver()
        except graph_surgery.GraphSurgeryError as e:
            return str(e)
        return None

    def node_count(self) -> int:
        """Nodes of the graph the current stream captures into, so far."""
        return self.node_counter()()

    def node_counter(self) -> Callable[[], int]:
        """`node_count` for the capture in progress, its stream looked up once
        (a recording counts twice per recorded op: at llama8b's 35 sizes,
        5600 counts, where `torch.cuda.current_stream()` alone cost about as
        much as the driver's count under a profiler)."""
        from compile_backend.runtime import graph_surgery

        stream, drv = torch.cuda.current_stream().cuda_stream, graph_surgery.driver()
        return lambda: drv.capturing_nodes(stream)

    def derive(self, source: Any, side: Any, pairs: Sequence[tuple[int, int, int, int]]) -> Any:
        """A graph made from `source` (runtime/graph_surgery.py); its clone,
        patch and instantiate count as the capture profile's "instantiate"."""
        from compile_backend.runtime import graph_surgery

        t0 = time.perf_counter()
        try:
            return graph_surgery.derive(source, side, pairs)
        finally:
            capture_seconds["instantiate"] += time.perf_counter() - t0

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, args: Sequence[Any] = (), instantiate: bool = True):
        """`args`: the callable's arguments (a stand-in protects them; CUDA needs nothing).
        `instantiate`: make a keep_graph graph executable now (capture_end
        leaves it to the first replay); a part of a derived graph never is.

        torch.cuda.graph without what it does before every capture: a device
        synchronize, torch.cuda.empty_cache, the pinned host cache's emptying
        and, with TORCH_CUDAGRAPH_GC set (always in old torch), gc.collect.
        A runner's plan captures hundreds of graphs (1155 in PIECEWISE for
        llama8b at 35 sizes), each paying for those; the wrapper does them
        itself where they are wanted (once per plan, or per graph outside
        one: `plan_capture`).
        The rest is as torch.cuda.graph: a side stream (capture cannot run on
        the default stream) that waits for the caller's stream before, and
        the caller's stream waits for it after, so the capture is ordered
        after the work queued before it without a host synchronize; same
        capture_error_mode ("global") and pool."""
        outer = torch.cuda.current_stream()
        warm_capture_stream(outer.device)  # once: its workspaces outside every pool
        stream = capture_stream(outer.device)
        stream.wait_stream(outer)
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="global")
            t0 = time.perf_counter()
            try:
                yield
            finally:
                t1 = time.perf_counter()
                graph.capture_end()  # instantiates the graph (not one with keep_graph)
                if instantiate and getattr(graph, "_mrv2_keep", False):
                    graph.instantiate()
                capture_seconds["record"] += t1 - t0
                capture_seconds["instantiate"] += time.perf_counter() - t1
        outer.wait_stream(stream)

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def memory_allocated(self) -> int:
        """Bytes the caching allocator has handed out on the current device.
        Read from the allocator's nested stats: torch.cuda.memory_allocated
        flattens every statistic into a dict first, ~0.4 ms a call, and a
        plan reads this twice per graph (1155 graphs in PIECEWISE)."""
        nested = getattr(torch._C, "_cuda_memoryStats", None)
        if nested is None:  # pragma: no cover - a torch without it
            return torch.cuda.memory_allocated()
        return nested(torch.cuda.current_device())["allocated_bytes"]["all"]["current"]

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        """Return the allocator's cached free blocks to the device, so a
        graph's pool can take that memory (what torch.cuda.graph did before
        every capture: an allocation that fails during a capture cannot
        free cached blocks then)."""
        torch.cuda.empty_cache()


_shared: "ReusedPool | None" = None  # the runners' graphs' one pool (shared_graph_pool)
_graph_backend: Any = None  # a stand-in set by use_graph_backend (tests)


def current_graph_backend() -> Any:
    return _graph_backend if _graph_backend is not None else TorchCUDAGraphs()


def graph_backend_overridden() -> bool:
    return _graph_backend is not None


@contextlib.contextmanager
def use_graph_backend(graphs: Any):
    """Capture with a stand-in graph object (new_graph/capture/pool/...) instead
    of CUDA: lets CPU tests drive capture, dispatch and address checks. Graph
    modes are not lowered to NONE while it is active. The shared pool, with
    the graphs that keep it alive, is the backend's own: a graph of another
    backend's pool must not keep this one's handle in use."""
    global _graph_backend, _shared
    previous = _graph_backend, _shared
    _graph_backend, _shared = graphs, None
    _pool_outputs.clear()
    try:
        yield graphs
    finally:
        _graph_backend, _shared = previous


_pool_graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every live graph, for release_graphs
_wrappers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every wrapper, for release_graphs
# Storage addresses of graph outputs (any pool's): what `own_outputs` clones
# for plain callers, and what a lazy capture does not take for a caller's
# tensor. Cleared only when every graph is freed: a stale address costs a
# clone or a capture at most, a missing one would hand out graph memory.
_pool_outputs: set[int] = set()


_plan_depth = 0  # > 0 while plan_capture is active


@contextlib.contextmanager
def plan_capture(graphs: Any):
    """Scope of many captures in a row (a runner's capture plan).

    Per graph, a capture outside a plan synchronizes the device before and
    after (its `seconds` is then the device's time) and empties the
    allocator's cache (as torch.cuda.graph did). Inside a plan these happen
    once for the whole plan: the graphs are captured largest first into one
    pool, so the cache emptied before the first (largest) one is what the
    later ones need, and the host queues the next size's warm-up while the
    device runs the previous one. Per-graph `seconds` are then host time
    (the plan's end synchronizes); `pool_bytes` stay per graph (the
    allocator counts on the host, without a synchronize).

    The garbage collector is frozen meanwhile (vLLM does the same): one
    full collection first, then gc.freeze(), so the collections that
    capture's allocations trigger no longer walk every object the compile
    left behind (Dynamo's and Inductor's); gc.unfreeze() after, also on
    error. The collection is full although it walks every object of the
    process (0.18-0.28 s on the H200 host): a dead cycle holding device
    memory would otherwise keep it out of the pool, and one made before the
    first step's compile or load (a model dropped for this one) sits in the
    oldest generation, which that step's frozen collector
    (core/frozen_gc.py) returned it to; only collecting the young
    generations left such memory held until Python's next full collection
    (late, with millions of long-lived objects). Plans may nest; the
    outermost one does all this."""
    global _plan_depth
    outermost = _plan_depth == 0
    if outermost:
        gc.collect()
        graphs.synchronize()
        graphs.empty_cache()
    _plan_depth += 1
    try:
        with frozen_gc() if outermost else contextlib.nullcontext():
            yield
    finally:
        _plan_depth -= 1
    if outermost:  # not after an error: a failed capture's error stays the one raised
        graphs.synchronize()
        # What the warm-ups cached is not the graphs': return it, as the
        # per-graph empty_cache used to by the end of a plan.
        graphs.empty_cache()


class ReusedPool:
    """One memory pool handle for graphs captured one after another (the
    runners' shared pool below; a FULL plan's side captures:
    runtime/mixed_graphs.py), renewed once every graph captured into it has
    died. The CUDA caching allocator frees a pool with
    its last graph, and until empty_cache runs a capture into that handle
    fails its internal assert (`use_count > 0`); the stand-in fails alike."""

    def __init__(self, graphs: Any) -> None:
        self.graphs = graphs
        self.handle: Any = None
        self.live: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def for_capture(self, graph: Any) -> Any:
        """The handle `graph` captures into (it now keeps the pool alive)."""
        if self.handle is None or not self.live:
            self.handle = self.graphs.pool()
        self.live.add(graph)
        return self.handle

    def forget(self, graph: Any) -> None:
        """`graph` was freed before it died (an evicted graph's reset)."""
        self.live.discard(graph)


def shared_graph_pool(graphs: Any, graph: Any) -> Any:
    """The handle `graph` captures into: one memory pool for the runners'
    graphs (captured largest first, so smaller graphs reuse the blocks of
    larger ones), renewed once every graph captured into it has died
    (graphs in pools of their own do not count)."""
    global _shared
    if _shared is None:
        _shared = ReusedPool(graphs)
    return _shared.for_capture(graph)


def release_graphs() -> int:
    """Free every captured graph and the shared pool's memory; returns how
    many graphs were freed. Each wrapper forgets its graphs, so a later call
    of a compiled model or runner captures again (on demand) into a new pool.

    Needed because graphs outlive their runner and `torch._dynamo.reset()`:
    Dynamo keeps each compiled step in the traced module's globals
    (`__compiled_fn_*`). Without this, switching models keeps the old
    model's graphs (and pool) alive, and the new model's graphs share that
    pool. Call it when no graph is in flight on another stream."""
    global _shared
    graphs = list(_pool_graphs)
    wrappers = list(_wrappers)
    _shared = None
    if not graphs and not wrappers:
        return 0
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:  # no replay in flight (stand-in graphs need nothing)
        torch.cuda.synchronize()
    for wrapper in wrappers:
        wrapper.forget_graphs()
    for graph in graphs:
        reset = getattr(graph, "reset", None)  # torch.cuda.CUDAGraph; stand-ins have none
        if reset is not None:
            reset()
    _pool_graphs.clear()
    _pool_outputs.clear()
    if cuda:
        torch.cuda.synchronize()
    return len(graphs)


def is_pool_output(t: torch.Tensor) -> bool:
    """Is `t` memory a graph wrote as an output (the pool's, not a caller's)?"""
    return bool(_pool_outputs) and t.untyped_storage().data_ptr() in _pool_outputs


def own_outputs(out: Any) -> Any:
    """`out` with every tensor that lives in graph memory cloned: for callers
    outside a runner, whose outputs must not change when a graph replays."""
    if not _pool_outputs:
        return out
    # Every call of plain use comes here: the flat tuple a Dynamo graph
    # returns takes no pytree walk.
    if type(out) is tuple or type(out) is list:
        return type(out)([own_outputs(x) for x in out])
    if isinstance(out, torch.Tensor):
        return out.clone() if is_pool_output(out) else out
    if out is None or type(out) in (int, float, bool):
        return out
    return pytree.tree_map_only(torch.Tensor, own_outputs, out)


def weak_ref(t: Any) -> Any:
    """A tensor aliasing `t`'s memory without owning it."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        return t
    s = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(s.data_ptr(), t.device, s.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.shape, t.stride()
    )


def register_wrapper(wrapper: Any) -> None:
    """`release_graphs` makes every registered wrapper forget its graphs."""
    _wrappers.add(wrapper)


def register_graph(graph: Any) -> None:
    """A captured graph (release_graphs frees it)."""
    _pool_graphs.add(graph)


def forget_graph(graph: Any) -> None:
    """A graph its wrapper evicted (its pool frees with its last graph)."""
    _pool_graphs.discard(graph)
    if _shared is not None:
        _shared.forget(graph)


def register_output(t: torch.Tensor) -> None:
    """`t` lives in graph memory: own_outputs clones it for plain callers."""
    _pool_outputs.add(t.untyped_storage().data_ptr())


def in_capture_plan() -> bool:
    """Inside plan_capture (a runner's plan): no per-graph synchronize."""
    return _plan_depth > 0
