"""A CUDA graph made from another: a clone with some kernel nodes' launches replaced.

    derived = derive(decode_graph, side_graph, [(first, end, side_first, side_end), ...])
        a clone of decode_graph's cudaGraph_t (torch CUDAGraphs captured with
        keep_graph=True) in which kernel nodes [first, end), numbered in the
        order the capture made them, take the launches (function, grid,
        arguments) of side_graph's nodes [side_first, side_end), one for one;
        a replaced node's incoming programmatic edges become plain ones (the
        new kernel may not wait for its predecessor); then instantiated.
    derived.replay()     launches it on the current stream

The driver's graph API through ctypes (libcuda.so.1, entry points by
cuGetProcAddress at a fixed ABI version): no binding package needed. Used by
a FULL plan's mixed graphs (runtime/mixed_graphs.py; docs/design.md).
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

_P = ctypes.c_void_p
_KERNEL_NODE = 0  # CUgraphNodeType


class GraphSurgeryError(RuntimeError):
    """A driver call failed or a graph is not as expected (the caller falls back)."""


class _KernelParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (CUDA 12.0 on)."""

    _fields_ = [("func", _P),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("kernelParams", _P), ("extra", _P), ("kern", _P),
                ("ctx", _P)]


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
        self._calls: dict[tuple[str, int, tuple], Any] = {}

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
        types = tuple(type(a) for a in args)
        fn = self._calls.get((name, version, types))
        if fn is None:  # a prototype per signature, once (making one costs microseconds)
            fn = self._calls[(name, version, types)] = ctypes.CFUNCTYPE(ctypes.c_int, *types)(
                self._fn(name, version))
        rc = fn(*args)
        if rc != 0:
            raise GraphSurgeryError(f"{name} returned CUresult {rc}")

    def count(self, graph: int) -> int:
        """How many nodes the graph has."""
        count = ctypes.c_size_t(0)
        self.call("cuGraphGetNodes", _P(graph), _P(None), ctypes.pointer(count))
        return count.value

    def nodes(self, graph: int) -> list[int]:
        """The graph's nodes, in the order they were made."""
        count = ctypes.c_size_t(self.count(graph))
        arr = (_P * max(1, count.value))()
        self.call("cuGraphGetNodes", _P(graph), ctypes.cast(arr, _P), ctypes.pointer(count))
        return [arr[i] for i in range(count.value)]

    def node_type(self, node: int) -> int:
        t = ctypes.c_int(-1)
        self.call("cuGraphNodeGetType", _P(node), ctypes.pointer(t))
        return t.value

    def dependencies(self, node: int) -> list[tuple[int, _EdgeData]]:
        """(predecessor, the edge's data) for each edge into `node`."""
        count = ctypes.c_size_t(0)
        name = "cuGraphNodeGetDependencies"
        self.call(name, _P(node), _P(None), _P(None), ctypes.pointer(count), version=12030)
        arr, data = (_P * max(1, count.value))(), (_EdgeData * max(1, count.value))()
        self.call(name, _P(node), ctypes.cast(arr, _P), ctypes.cast(data, _P), ctypes.pointer(count),
                  version=12030)
        return [(arr[i], data[i]) for i in range(count.value)]

    def take_launch(self, graph: int, node: int, other: int) -> None:
        """Kernel node `node` of `graph` launches what kernel node `other`
        does; its incoming edges become plain ones."""
        p = _KernelParams()
        self.call("cuGraphKernelNodeGetParams", _P(other), ctypes.pointer(p))
        self.call("cuGraphKernelNodeSetParams", _P(node), ctypes.pointer(p))
        for dep, edge in self.dependencies(node):
            if edge.type == 0:  # CU_GRAPH_DEPENDENCY_TYPE_DEFAULT
                continue
            frm, to = (_P * 1)(dep), (_P * 1)(node)
            self.call("cuGraphRemoveDependencies", _P(graph), ctypes.cast(frm, _P), ctypes.cast(to, _P),
                      ctypes.pointer(edge), ctypes.c_size_t(1), version=12030)
            self.call("cuGraphAddDependencies", _P(graph), ctypes.cast(frm, _P), ctypes.cast(to, _P),
                      ctypes.c_size_t(1))

    def capturing_nodes(self, stream: int) -> int:
        """How many nodes the graph `stream` captures into has so far."""
        status, cid, graph = ctypes.c_int(), ctypes.c_ulonglong(), _P()
        deps, edges, ndeps = _P(), _P(), ctypes.c_size_t()
        self.call("cuStreamGetCaptureInfo", _P(stream), ctypes.pointer(status), ctypes.pointer(cid),
                  ctypes.pointer(graph), ctypes.pointer(deps), ctypes.pointer(edges),
                  ctypes.pointer(ndeps), version=12030)
        if status.value != 1:  # CU_STREAM_CAPTURE_STATUS_ACTIVE
            raise GraphSurgeryError("the stream is not capturing")
        return self.count(graph.value)

    def clone(self, graph: int) -> int:
        out = _P()
        self.call("cuGraphClone", ctypes.pointer(out), _P(graph))
        return out.value

    def in_clone(self, node: int, clone: int) -> int:
        """The node of `clone` that `node` (of the graph cloned) became."""
        out = _P()
        self.call("cuGraphNodeFindInClone", ctypes.pointer(out), _P(node), _P(clone))
        return out.value

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
    and the side graph (its own)."""

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


def derive(source: Any, side: Any, pairs: Sequence[tuple[int, int, int, int]]) -> DerivedGraph:
    """`source` with kernel nodes [first, end) of each pair taking the
    launches of `side`'s nodes [side_first, side_end) (module docstring).
    Raises GraphSurgeryError where a pair's ranges differ in length or hold
    a node that is not a kernel launch."""
    drv = driver()
    raw, side_raw = source.raw_cuda_graph(), side.raw_cuda_graph()
    nodes, theirs = drv.nodes(raw), drv.nodes(side_raw)  # the captures' order
    clone = drv.clone(raw)
    try:
        for first, end, side_first, side_end in pairs:
            if not (0 <= first < end <= len(nodes) and 0 <= side_first <= side_end <= len(theirs)
                    and end - first == side_end - side_first):
                raise GraphSurgeryError(
                    f"nodes [{first}, {end}) of {len(nodes)} against [{side_first}, {side_end}) "
                    f"of {len(theirs)}: not one for one")
            for mine, other in zip(nodes[first:end], theirs[side_first:side_end]):
                if drv.node_type(mine) != _KERNEL_NODE or drv.node_type(other) != _KERNEL_NODE:
                    raise GraphSurgeryError("a node that is not a kernel launch")
                drv.take_launch(clone, drv.in_clone(mine, clone), other)
        exec_ = drv.instantiate(clone)
    except Exception:
        drv.destroy(clone, 0)
        raise
    return DerivedGraph(clone, exec_, [source, side])
