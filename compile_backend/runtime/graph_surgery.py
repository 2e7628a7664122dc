"""A CUDA graph made from another: a clone with some nodes replaced by child graphs.

    derived = derive(decode_graph, [(first, end, side_graph), ...])
        a clone of decode_graph's cudaGraph_t (a torch CUDAGraph captured with
        keep_graph=True) in which nodes [first, end), in the order the capture
        made them, are removed and side_graph's graph is put in their place as
        a child graph node (after their predecessors outside the range, before
        their dependents: plain edges, no programmatic overlap across it),
        then instantiated; derived.replay() launches it on the current stream.

The driver's graph API through ctypes (libcuda.so.1, entry points by
cuGetProcAddress at a fixed ABI version): no binding package needed. A FULL
plan's mixed graphs use it (runtime/mixed_graphs.py; docs/design.md, "A mixed
graph derived from the decode graph").
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

_P = ctypes.c_void_p
_KERNEL_NODE, _CHILD_NODE = 0, 1  # CUgraphNodeType


class GraphSurgeryError(RuntimeError):
    """A driver call failed or a graph is not as expected (the caller falls back)."""


class _EdgeData(ctypes.Structure):
    """CUgraphEdgeData (CUDA 12.3 on)."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class Driver:
    """The driver calls below, each at the ABI of `version` (12000: CUDA
    12.0; 12030: 12.3, whose edge queries return edge data and work on the
    edges programmatic dependent launch makes)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise GraphSurgeryError(f"no CUDA driver library: {e}") from None
        self._fns: dict[tuple[str, int], int] = {}

    def _fn(self, name: str, version: int) -> int:
        key = (name, version)
        if key not in self._fns:
            pfn, status = _P(), ctypes.c_int()
            rc = self.lib.cuGetProcAddress_v2(ctypes.c_char_p(name.encode()), ctypes.byref(pfn),
                                              ctypes.c_int(version), ctypes.c_ulonglong(0),
                                              ctypes.byref(status))
            if rc != 0 or not pfn.value:
                raise GraphSurgeryError(f"cuGetProcAddress({name}, {version}): CUresult {rc}")
            self._fns[key] = pfn.value
        return self._fns[key]

    def call(self, name: str, *args: Any, version: int = 12000) -> None:
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *[type(a) for a in args])
        rc = proto(self._fn(name, version))(*args)
        if rc != 0:
            raise GraphSurgeryError(f"{name} returned CUresult {rc}")

    def nodes(self, graph: int) -> list[int]:
        """The graph's nodes, in the order they were made."""
        count = ctypes.c_size_t(0)
        self.call("cuGraphGetNodes", _P(graph), _P(None), ctypes.pointer(count))
        arr = (_P * max(1, count.value))()
        self.call("cuGraphGetNodes", _P(graph), ctypes.cast(arr, _P), ctypes.pointer(count))
        return [arr[i] for i in range(count.value)]

    def _edges(self, name: str, node: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self.call(name, _P(node), _P(None), _P(None), ctypes.pointer(count), version=12030)
        arr, data = (_P * max(1, count.value))(), (_EdgeData * max(1, count.value))()
        self.call(name, _P(node), ctypes.cast(arr, _P), ctypes.cast(data, _P), ctypes.pointer(count),
                  version=12030)
        return [arr[i] for i in range(count.value)]

    def capturing_nodes(self, stream: int) -> int:
        """How many nodes the graph `stream` captures into has so far."""
        status, cid, graph = ctypes.c_int(), ctypes.c_ulonglong(), _P()
        deps, edges, ndeps = _P(), _P(), ctypes.c_size_t()
        self.call("cuStreamGetCaptureInfo", _P(stream), ctypes.pointer(status), ctypes.pointer(cid),
                  ctypes.pointer(graph), ctypes.pointer(deps), ctypes.pointer(edges),
                  ctypes.pointer(ndeps), version=12030)
        if status.value != 1:  # CU_STREAM_CAPTURE_STATUS_ACTIVE
            raise GraphSurgeryError("the stream is not capturing")
        count = ctypes.c_size_t(0)
        self.call("cuGraphGetNodes", graph, _P(None), ctypes.pointer(count))
        return count.value

    def clone(self, graph: int) -> int:
        out = _P()
        self.call("cuGraphClone", ctypes.pointer(out), _P(graph))
        return out.value

    def in_clone(self, node: int, clone: int) -> int:
        """The node of `clone` that `node` (of the graph cloned) became."""
        out = _P()
        self.call("cuGraphNodeFindInClone", ctypes.pointer(out), _P(node), _P(clone))
        return out.value

    def replace_with_child(self, graph: int, old: Sequence[int], child: int) -> None:
        """Remove `old` (nodes of `graph`) and put a copy of `child` where
        they were: after their predecessors outside `old`, before their
        dependents outside it."""
        inside = set(old)
        preds = sorted({d for n in old for d in self._edges("cuGraphNodeGetDependencies", n)} - inside)
        succs = sorted({d for n in old for d in self._edges("cuGraphNodeGetDependentNodes", n)}
                       - inside)
        for n in old:
            self.call("cuGraphDestroyNode", _P(n))
        node = _P()
        deps = (_P * max(1, len(preds)))(*preds)
        self.call("cuGraphAddChildGraphNode", ctypes.pointer(node), _P(graph), ctypes.cast(deps, _P),
                  ctypes.c_size_t(len(preds)), _P(child))
        for s in succs:
            frm, to = (_P * 1)(node.value), (_P * 1)(s)
            self.call("cuGraphAddDependencies", _P(graph), ctypes.cast(frm, _P), ctypes.cast(to, _P),
                      ctypes.c_size_t(1))

    def instantiate(self, graph: int) -> int:
        out = _P()
        self.call("cuGraphInstantiateWithFlags", ctypes.pointer(out), _P(graph), ctypes.c_ulonglong(0))
        return out.value

    def launch(self, exec_: int, stream: int) -> None:
        self.call("cuGraphLaunch", _P(exec_), _P(stream))

    def destroy(self, graph: int, exec_: int) -> None:
        if exec_:
            self.call("cuGraphExecDestroy", _P(exec_))
        if graph:
            self.call("cuGraphDestroy", _P(graph))


_driver: Driver | None = None


def driver() -> Driver:
    global _driver
    if _driver is None:
        _driver = Driver()
    return _driver


class DerivedGraph:
    """An instantiated clone (the CUDAGraph-like face a wrapper replays).
    Holds the graphs whose memory its nodes address: the source (its pool)
    and the side graphs (theirs)."""

    def __init__(self, graph: int, exec_: int, keep: list[Any]) -> None:
        self.graph, self.exec_, self.keep = graph, exec_, keep

    def replay(self) -> None:
        driver().launch(self.exec_, torch.cuda.current_stream().cuda_stream)

    def reset(self) -> None:
        if self.exec_ or self.graph:
            driver().destroy(self.graph, self.exec_)
        self.graph = self.exec_ = 0
        self.keep = []

    def __del__(self) -> None:  # a graph dropped without reset (an evicted entry)
        try:
            self.reset()
        except Exception:  # noqa: BLE001 - at exit the driver may be gone
            pass


def derive(source: Any, parts: Sequence[tuple[int, int, Any]]) -> DerivedGraph:
    """`source` (a torch CUDAGraph captured with keep_graph=True) with nodes
    [first, end) of each part replaced by the part's side graph (likewise).
    Parts do not overlap; a part with no node raises (no place to put it)."""
    drv = driver()
    raw = source.raw_cuda_graph()
    clone = drv.clone(raw)
    try:
        nodes = drv.nodes(raw)  # the capture's order, which the parts' counts index
        ranges = []
        for first, end, side in parts:
            if not 0 <= first < end <= len(nodes):
                raise GraphSurgeryError(f"nodes [{first}, {end}) of a graph of {len(nodes)}")
            ranges.append(([drv.in_clone(n, clone) for n in nodes[first:end]], side.raw_cuda_graph()))
        for old, child in ranges:
            drv.replace_with_child(clone, old, child)
        exec_ = drv.instantiate(clone)
    except Exception:
        drv.destroy(clone, 0)
        raise
    return DerivedGraph(clone, exec_, [source, *(side for _, _, side in parts)])
