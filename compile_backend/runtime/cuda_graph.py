"""The CUDA-graph wrapper. It knows nothing of compilation: it wraps a callable
and, per step graph (core/graph_mode.py: StepGraph), captures it once and
replays it after.

Which graph a call uses comes from the forward context the runner sets:
  the context's graph has the wrapper's mode  -> capture or replay, keyed by graph.key
  anything else (NONE, no graph, FULL around a PIECEWISE piece) -> run the callable
Without a forward context (plain torch.compile use), graphs are keyed by the
inputs' shapes: warm-up, capture, then replay. Every capture is followed by
one replay, whose outputs the call returns. A written input that moved gets
a graph for its new address; a moved read-only input is copied into a
private buffer; outputs are held weakly. docs/design.md, sections "Capture
never hands out what it recorded" and "A replay never writes into a private
copy of a caller's tensor".
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.utils._pytree as pytree

from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph
from compile_backend.core.counters import counters
from compile_backend.runtime import graph_pool
from compile_backend.runtime.mixed_graphs import MixedGraphs
from compile_backend.core.forward_context import (
    ForwardContext, get_forward_context, has_forward_context, set_forward_context,
)

logger = logging.getLogger(__name__)


# Calls in a row whose inputs grew by one before a wrapper stops capturing new
# sizes (CUDAGraphWrapper._grows): five calls (a decode's first tokens). A
# caller sweeping sizes by one (1, 2, 3) stays below it and keeps its graphs.
GROWTH_CALLS = 4
_growth_said: list[bool] = []  # the warning is said once per process


def _grew_by_one(last: tuple[tuple[Any, ...], tuple[Any, ...]],
                 key: tuple[tuple[Any, ...], tuple[Any, ...]]) -> bool:
    """Did `key` come from `last` by one more along some sizes (every changed
    size +1; Dynamo passes a length that changes, such as a cache's, as an
    int input too, so int values count as sizes), all else unchanged?"""
    (old_shapes, old_values), (shapes, values) = last, key
    if len(old_shapes) != len(shapes) or len(old_values) != len(values):
        return False
    grew = False
    for a, b in zip((*old_shapes, old_values), (*shapes, values)):
        if len(a) != len(b):
            return False
        for x, y in zip(a, b):
            if x == y and type(x) is type(y):
                continue
            if type(x) is not int or type(y) is not int or y != x + 1:
                return False
            grew = True
    return grew


@dataclass
class CapturedGraph:
    cuda_graph: Any  # torch.cuda.CUDAGraph, or the graph backend's stand-in
    # Per input: a private buffer (strong) for one copied in at every
    # replay; else None on CUDA (the graph replays only when the caller hands
    # in a tensor at the captured address: tensor_ptrs), or the capture-time
    # argument for a stand-in that replays by running.
    inputs: list[Any]
    # (index, address) of the tensor inputs read and written in place: a
    # replay needs each at its capture-time address (the fast check)
    tensor_ptrs: tuple[tuple[int, int], ...]
    outputs: Any  # pytree of (weakly held) tensors
    copy_ins: tuple[int, ...] = ()  # inputs copied into their private buffer (inputs[i])
    # outputs that alias an input: (leaf, input index, size, stride, offset
    # relative to the input's): rebuilt on the caller's tensor at each replay
    output_aliases: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], int], ...] = ()
    metadata_ptrs: dict[str, int] = field(default_factory=dict)  # "layer.field" -> ptr
    seconds: float = 0.0
    # allocator growth during capture (host-side count); None in a runner's
    # plan, whose record of each graph has it (a read of the allocator's
    # stats costs 50-100 µs of host time, twice for each of up to 1155 pieces)
    pool_bytes: int | None = None
    # tensor_ptrs as the C++ check takes them: an address per input position
    # (None where unchecked) and the positions to check
    ptr_by_index: list[int | None] = field(init=False, repr=False)
    ptr_indices: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ptr_by_index = [None] * len(self.inputs)
        for i, ptr in self.tensor_ptrs:
            self.ptr_by_index[i] = ptr
        self.ptr_indices = [i for i, _ in self.tensor_ptrs]


# torch's C++ loop over tensors' addresses (CUDA builds; cudagraph_trees uses
# it on its hot path): hundreds of inputs (a model's weights, as plain
# torch.compile passes them) in microseconds. None on CPU builds.
_data_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def addresses_match(args: Sequence[Any], entry: CapturedGraph) -> bool:
    """Is every tensor input `entry` reads in place at its capture address?"""
    if _data_ptrs_equal is not None:
        return _data_ptrs_equal(args if type(args) is list else list(args),
                                entry.ptr_by_index, entry.ptr_indices)
    for i, ptr in entry.tensor_ptrs:
        if args[i].data_ptr() != ptr:
            return False
    return True


def _metadata_ptrs(ctx: ForwardContext | None) -> dict[str, int]:
    if ctx is None:
        return {}
    out = {}
    seen: dict[int, dict[str, int]] = {}  # one metadata object serves a group's layers
    for layer, meta in ctx.attn_metadata.items():
        ptrs = seen.get(id(meta))
        if ptrs is None:
            tensors = meta.tensors() if hasattr(meta, "tensors") else {}
            ptrs = seen[id(meta)] = {name: t.data_ptr() for name, t in tensors.items()}
        for name, ptr in ptrs.items():
            out[f"{layer}.{name}"] = ptr
    return out


def _output_aliases(outputs: Any, args: Sequence[Any]):
    """Outputs that are views of an input (a cache `update` returning the
    cache): where in the input each one sits."""
    by_storage = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            by_storage.setdefault(a.untyped_storage().data_ptr(), i)
    out = []
    for leaf, t in enumerate(pytree.tree_leaves(outputs)):
        if not isinstance(t, torch.Tensor):
            continue
        i = by_storage.get(t.untyped_storage().data_ptr())
        if i is not None and args[i].dtype == t.dtype:
            out.append((leaf, i, tuple(t.shape), tuple(t.stride()),
                        t.storage_offset() - args[i].storage_offset()))
    return tuple(out)


class CUDAGraphWrapper:
    """Captures `fn` per key (the step graph's `key`, or input shapes without
    a runner) and replays it.

    Addresses (docs/design.md, "A replay never writes into a private
    copy"): an input the graph writes (`written_inputs`; None: unknown, so
    every input counts as written) must be where it was at capture; when it
    moves, the wrapper captures a graph for the new address (at most
    `graphs_per_shape` per key, least recently used evicted). A read-only
    input that moves is copied, from then on, into a private buffer that the
    graph reads. Outputs that alias an input alias the caller's tensor."""

    def __init__(
        self,
        fn: Callable[..., Any],
        mode: CUDAGraphMode,
        name: str = "graph",
        debug_checks: bool = False,
        stable_inputs: Sequence[int] = (),
        input_names: Sequence[str] | None = None,
        graphs: Any = None,
        written_inputs: Sequence[int] | None = None,
        graphs_per_shape: int = 4,
        fixed_shape_inputs: Sequence[int] = (),
        derive_mixed: bool = False,
    ) -> None:
        assert mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL), mode
        assert graphs_per_shape >= 1, graphs_per_shape
        self.fn = fn
        self.mode = mode
        self.name = name
        self.debug_checks = debug_checks
        self.stable_inputs = set(stable_inputs)
        self.input_names = list(input_names) if input_names else None
        self.graphs = graphs or graph_pool.current_graph_backend()
        self.written_inputs = None if written_inputs is None else frozenset(written_inputs)
        self.graphs_per_shape = graphs_per_shape
        # Tensor inputs whose shape the compiler fixed (no symbolic size: a
        # call with another shape is another compiled graph): left out of the
        # lazy key, which then reads the few inputs that can change.
        self.fixed_shape_inputs = frozenset(fixed_shape_inputs)
        self._key_plan: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.entries: dict[Hashable, CapturedGraph] = {}  # key -> most recently used graph
        self.variants: dict[Hashable, list[CapturedGraph]] = {}  # key -> its graphs, LRU last
        self.moving: set[int] = set()  # read-only inputs seen at a new address
        self._said: set[tuple[int, str]] = set()  # (input, reason) logged once
        self._warmed_shapes: set[Hashable] = set()
        # Without a runner: is an input growing by one along some dimension at
        # every call (a cache that grows per token)? Then a graph of a shape
        # would replay at most once a session: no new graph is captured.
        self._last_miss: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None
        self._growth_calls = 0
        self.growing = False
        # Without a runner, a FULL graph holds every piece: PIECEWISE wrappers
        # inside it see a context without a graph and run their callables.
        self._lazy_ctx = ForwardContext() if mode is CUDAGraphMode.FULL else None
        # A runner's FULL plan: mixed graphs made from decode graphs (runtime/mixed_graphs.py).
        self.mixed = MixedGraphs(self.graphs) if derive_mixed and mode is CUDAGraphMode.FULL else None
        graph_pool.register_wrapper(self)

    def forget_graphs(self) -> None:
        """Drop every graph (release_graphs freed them): calls capture again."""
        self.entries.clear()
        self.variants.clear()
        if self.mixed is not None:
            self.mixed.forget()

    def writes(self, i: int) -> bool:
        return self.written_inputs is None or i in self.written_inputs

    # ---- dispatch ---------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        # The hot path of every piece of every step: few calls, no allocation.
        if not has_forward_context():
            return self.call_lazily(args, self.lazy_key(args))
        ctx = get_forward_context()
        graph = ctx.graph
        if graph is None or graph.mode is not self.mode:
            return self.fn(*args)
        key = graph.key
        entry = self.entries.get(key)
        if entry is None:
            return self._capture(key, args, ctx)
        return self._replay(key, entry, args, ctx)

    def is_captured(self, graph: StepGraph) -> bool:
        """Has `graph` been captured (a graph of another mode: never)?"""
        return graph.mode is self.mode and graph.key in self.entries

    def lazy_key(self, args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Without a runner, what picks a graph: (the shapes of the tensor
        inputs that can change shape, the non-tensor inputs). Which inputs
        those are is fixed for one compiled graph: found at its first call."""
        plan = self._key_plan
        if plan is None:
            plan = self._key_plan = (
                tuple(i for i, a in enumerate(args)
                      if isinstance(a, torch.Tensor) and i not in self.fixed_shape_inputs),
                tuple(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)))
        shaped, valued = plan
        return tuple([args[i].shape for i in shaped]), tuple([args[i] for i in valued])

    def call_lazily(self, args: Sequence[Any], key: tuple[tuple[Any, ...], tuple[Any, ...]]) -> Any:
        """No runner: graphs keyed by `key` (`lazy_key(args)`), captured on
        the second call of a key."""
        ctx = self._lazy_ctx
        with set_forward_context(ctx) if ctx is not None else contextlib.nullcontext():
            entry = self.entries.get(key)
            if entry is not None:
                return self._replay(key, entry, args, ctx)
            if self.growing or self._grows(key):
                counters["captures_skipped"] += 1
                return self.fn(*args)
            if key not in self._warmed_shapes:
                self._warmed_shapes.add(key)
                counters["lazy_warmups"] += 1
                return self.fn(*args)
            counters["lazy_captures"] += 1
            # A caller's read-only tensors (not parameters or buffers, not
            # another graph's outputs) come at new addresses on most calls:
            # read them from private buffers from the start.
            self.moving.update(
                i for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) and not self.writes(i)
                and i not in self.stable_inputs and not graph_pool.is_pool_output(a))
            return self._capture(key, args, ctx, own_pool=True)

    def _grows(self, key: tuple[tuple[Any, ...], tuple[Any, ...]]) -> bool:
        """Capture policy without a runner (docs/design.md, "Capture only what
        will replay"): a key not captured yet, compared with the previous
        such key. When some inputs' sizes grew by exactly one and nothing
        else changed, GROWTH_CALLS times in a row (transformers' DynamicCache
        at every decoded token), the wrapper is `growing` from then on: its
        later new keys run without a graph (graphs already captured still
        replay). Said once per process, with what to do instead."""
        last, self._last_miss = self._last_miss, key
        if last is None or not _grew_by_one(last, key):
            self._growth_calls = 0
            return False
        self._growth_calls += 1
        if self._growth_calls < GROWTH_CALLS:
            return False
        self.growing = True
        self._warmed_shapes.clear()  # no later capture reads them
        counters["growing_inputs"] += 1
        if not _growth_said:
            _growth_said.append(True)
            logger.warning(
                "mrv2: %s: an input grows by one along a dimension at every call (a cache that "
                "grows by a token per step, such as transformers' DynamicCache): a graph per size "
                "would replay at most once, so new sizes run as compiled code without CUDA graphs "
                "(counted as captures_skipped; said once). For graphs, keep the size fixed: "
                "generate(..., cache_implementation=\"static\")", self.name)
        else:
            logger.debug("mrv2: %s: inputs grow at every call; no graphs for new sizes", self.name)
        return True

    # ---- capture and replay -------------------------------------------------

    def _capture(self, key: Hashable, args: Sequence[Any], ctx: ForwardContext | None,
                 own_pool: bool = False) -> Any:
        """Capture, then replay once: the call returns the replay's outputs.

        `own_pool`: capture into a pool of its own. The shared pool is safe
        for graphs captured and replayed in the same order, a size at a time
        (the runner's capture and steps); a graph captured in the middle of
        other graphs' replays (without a runner, or for a new address) could
        be handed blocks that live outputs of those replays still occupy."""
        step = ctx.graph if ctx is not None else None
        if self.mixed is not None and not own_pool:
            made = self.mixed.derive(step, args, ctx, self._decode_entry)
            if made is not None:
                return self._keep_derived(key, *made, args, ctx)
        source = self.mixed is not None and not own_pool and self.mixed.is_source(step)
        # Inputs known to move get a private buffer, allocated outside the pool.
        copy_ins = tuple(i for i, a in enumerate(args)
                         if i in self.moving and isinstance(a, torch.Tensor) and not self.writes(i))
        capture_args = list(args)
        for i in copy_ins:
            capture_args[i] = torch.empty_strided(args[i].shape, args[i].stride(),
                                                  dtype=args[i].dtype, device=args[i].device)
            capture_args[i].copy_(args[i])
        cuda_graph = self.graphs.new_graph(keep_graph=True) if source else self.graphs.new_graph()
        pool = self.graphs.pool() if own_pool else graph_pool.shared_graph_pool(self.graphs,
                                                                               cuda_graph)
        graph_pool.register_graph(cuda_graph)
        # Alone (lazily, late, or for a new address), a capture settles the
        # device and empties the allocator's cache first, as torch.cuda.graph
        # did; in a plan that is done once for all graphs (plan_capture).
        alone = not graph_pool.in_capture_plan()
        if alone:
            self.graphs.synchronize()
            self.graphs.empty_cache()
        before = self.graphs.memory_allocated() if alone else None
        t0 = time.perf_counter()
        if ctx is not None:  # restored after: a capture inside another leaves it as it was
            outer = ctx.capturing, ctx.capture_plans
            ctx.capturing, ctx.capture_plans = True, {}
        try:
            with self.graphs.capture(cuda_graph, pool, capture_args), \
                    self.mixed.recording() if source else contextlib.nullcontext() as recorded:
                outputs = self.fn(*capture_args)
        finally:
            if ctx is not None:
                ctx.capturing, ctx.capture_plans = outer
        if alone:  # `seconds` is the device's time; in a plan, the host's
            self.graphs.synchronize()
        # A CUDA graph holds its inputs' addresses: only the private buffers
        # are kept (weak references to the rest cost 10-20 µs each, and a
        # plan makes 1155 graphs). A stand-in replays by running: it keeps them.
        reruns = hasattr(self.graphs, "after_capture")
        aliases = _output_aliases(outputs, capture_args)
        aliased = {leaf for leaf, *_ in aliases}
        for leaf, t in enumerate(pytree.tree_leaves(outputs)):
            if type(t) is torch.Tensor and leaf not in aliased:
                graph_pool.register_output(t)
        entry = CapturedGraph(
            cuda_graph=cuda_graph,
            inputs=[a if i in copy_ins or reruns else None for i, a in enumerate(capture_args)],
            tensor_ptrs=tuple((i, a.data_ptr()) for i, a in enumerate(args)
                              if isinstance(a, torch.Tensor) and i not in copy_ins),
            outputs=pytree.tree_map(graph_pool.weak_ref, outputs),
            copy_ins=copy_ins,
            output_aliases=aliases,
            # read only by debug_checks' replays (a walk of every layer's
            # metadata: too much host time for every one of a plan's graphs)
            metadata_ptrs=_metadata_ptrs(ctx) if self.debug_checks else {},
            seconds=time.perf_counter() - t0,
            pool_bytes=None if before is None else self.graphs.memory_allocated() - before,
        )
        self._keep(key, entry)
        if source:
            self.mixed.keep(step, entry, recorded.calls)
        if reruns:
            self.graphs.after_capture(cuda_graph, self.fn, entry, ctx)
        counters["cudagraph_captures"] += 1
        logger.debug("captured %s for %s in %.3fs", self.name, key, entry.seconds)
        # The replay writes the outputs' memory (garbage until now). Hand out
        # the strong tensors: the rest of this call (later pieces' captures)
        # must not get their memory from the pool while they are in use.
        self._replay(key, entry, args, ctx)
        return self._alias_outputs(entry, args, outputs)

    def _decode_entry(self, num_tokens: int) -> CapturedGraph | None:
        return self.entries.get(StepGraph.full_decode(num_tokens).key)

    def _keep_derived(self, key: Hashable, cuda_graph: Any, source: CapturedGraph,
                      args: Sequence[Any], ctx: ForwardContext) -> Any:
        """Keep a graph made from `source` (runtime/mixed_graphs.py): the same
        inputs, private buffers and outputs (the same memory), then replay it
        once, as after a capture."""
        entry = CapturedGraph(
            cuda_graph=cuda_graph, inputs=list(source.inputs), tensor_ptrs=source.tensor_ptrs,
            outputs=source.outputs, copy_ins=source.copy_ins, output_aliases=source.output_aliases,
            metadata_ptrs=_metadata_ptrs(ctx) if self.debug_checks else {})
        self._keep(key, entry)
        if hasattr(self.graphs, "after_capture"):
            self.graphs.after_capture(cuda_graph, self.fn, entry, ctx)
        logger.debug("derived %s for %s from its decode graph", self.name, key)
        return self._replay(key, entry, args, ctx)

    def _keep(self, key: Hashable, entry: CapturedGraph) -> None:
        kept = self.variants.setdefault(key, [])
        kept.append(entry)
        self.entries[key] = entry
        while len(kept) > self.graphs_per_shape:
            old = kept.pop(0)
            counters["graph_evictions"] += 1
            reset = getattr(old.cuda_graph, "reset", None)  # torch.cuda.CUDAGraph; stand-ins have none
            if reset is not None:
                self.graphs.synchronize()  # no replay of it in flight
                reset()
            graph_pool.forget_graph(old.cuda_graph)
            self._drop_derived_from(old.cuda_graph)
            self._say(-1, "evict",
                      f"{self.name}: more than graphs_per_shape={self.graphs_per_shape} graphs "
                      f"for one input shape (one per address of the tensors it writes); the "
                      "least recently used is freed. Keep written tensors (caches, state) at "
                      "fixed addresses, or raise graphs_per_shape")

    def _drop_derived_from(self, graph: Any) -> None:
        """Forget the graphs made from `graph` (runtime/mixed_graphs.py): they
        address its memory, which is no longer its own."""
        for key, kept in list(self.variants.items()):
            alive = [e for e in kept if graph not in getattr(e.cuda_graph, "keep", ())]
            if len(alive) == len(kept):
                continue
            for e in kept:
                reset = getattr(e.cuda_graph, "reset", None)
                if e not in alive and reset is not None:
                    reset()
            if alive:
                self.variants[key], self.entries[key] = alive, alive[-1]
            else:
                del self.variants[key]
                self.entries.pop(key, None)

    def _input_name(self, i: int) -> str:
        if self.input_names and i < len(self.input_names):
            return f"input {i} ({self.input_names[i]})"
        return f"input {i}"

    def _say(self, i: int, reason: str, message: str) -> None:
        if (i, reason) not in self._said:
            self._said.add((i, reason))
            logger.warning("mrv2: %s", message)

    def _replay(self, key: Hashable, entry: CapturedGraph, args: Sequence[Any],
                ctx: ForwardContext | None) -> Any:
        assert len(args) == len(entry.inputs), (len(args), len(entry.inputs))
        if not addresses_match(args, entry):
            return self._moved(key, entry, args, ctx)
        for i in entry.copy_ins:
            entry.inputs[i].copy_(args[i])
            counters["replay_input_copies"] += 1
        if self.debug_checks and ctx is not None:
            now = _metadata_ptrs(ctx)
            for name, ptr in entry.metadata_ptrs.items():
                if now.get(name, ptr) != ptr:
                    raise RuntimeError(
                        f"{self.name}: persistent metadata tensor {name} moved since "
                        f"capture (0x{ptr:x} -> 0x{now[name]:x}); metadata builders must "
                        "write into their persistent buffers, not allocate new tensors.")
        entry.cuda_graph.replay()
        counters["cudagraph_replays"] += 1
        if entry.output_aliases:
            return self._alias_outputs(entry, args, entry.outputs)
        return entry.outputs

    def _alias_outputs(self, entry: CapturedGraph, args: Sequence[Any], outputs: Any) -> Any:
        """`outputs` with each one that aliases an input rebuilt on the
        caller's tensor (not on a private buffer, nor a weak reference)."""
        if not entry.output_aliases:
            return outputs
        leaves, spec = pytree.tree_flatten(outputs)
        for leaf, i, size, stride, offset in entry.output_aliases:
            a = args[i]
            leaves[leaf] = a.as_strided(size, stride, a.storage_offset() + offset)
        return pytree.tree_unflatten(leaves, spec)

    def _moved(self, key: Hashable, entry: CapturedGraph, args: Sequence[Any],
               ctx: ForwardContext | None) -> Any:
        """Some input is not where `entry` reads or writes it: use the graph
        of this key captured for these addresses, or capture one."""
        for i, ptr in entry.tensor_ptrs:
            a = args[i]
            if a.data_ptr() == ptr:
                continue
            written = self.writes(i)
            if self.debug_checks:
                logger.warning(
                    "mrv2: %s: %s moved since capture (0x%x -> 0x%x); the graph %s it",
                    self.name, self._input_name(i), ptr, a.data_ptr(),
                    "writes" if written else "only reads")
                if i in self.stable_inputs:
                    raise RuntimeError(
                        f"{self.name}: {self._input_name(i)} moved since capture "
                        f"(0x{ptr:x} -> 0x{a.data_ptr():x}); the graph "
                        f"{'writes' if written else 'reads'} it. Keep parameters, buffers "
                        "and caches at a fixed address.")
            if written:
                self._say(i, "written",
                          f"{self.name}: {self._input_name(i)} is at a new address and the "
                          "graph writes it: capturing a graph for the new address (a copy "
                          "would take the write from the caller's tensor). Keep it at one "
                          "address (reuse the cache or state object) to replay without "
                          "capturing again")
            elif i not in self.moving:
                self.moving.add(i)
                self._say(i, "read",
                          f"{self.name}: {self._input_name(i)} moves between calls: from now "
                          "on it is copied into a private buffer that the graph reads")
        for other in reversed(self.variants.get(key, [])):
            if other is not entry and addresses_match(args, other):
                kept = self.variants[key]
                kept.remove(other)
                kept.append(other)  # most recently used last
                self.entries[key] = other
                return self._replay(key, other, args, ctx)
        counters["address_captures"] += 1
        return self._capture(key, args, ctx, own_pool=True)
