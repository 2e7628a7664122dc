"""Can a FULL plan derive one graph from another instead of recording the step twice?

    python bench/graph_surgery.py [--reps 20]        (CUDA)

A FULL plan records, per size, a decode graph and a mixed graph that differ
only in the attention-like ops' launches (docs/design.md, "What a warm
capture repeats"). This checks the pieces a derivation needs on the machine
at hand, with torch's CUDAGraph(keep_graph=True) and the driver's graph API
through ctypes (libcuda.so.1, entry points by cuGetProcAddress):
  1. while a stream captures, the node count so far: which nodes an op added;
  2. the op's other form captured alone, on the decode capture's tensors;
  3. a clone of the decode graph with the op's nodes replaced: (A) node for
     node, each kernel node's parameters set from the other form's (same
     launch count), (B) the op's nodes removed and the other form's graph
     put in as a child graph node, edges rewired (any launch count);
  4. each derived graph, instantiated and launched, equals the graph
     recorded directly and eager, on fresh inputs, replay after replay;
  5. what a derivation costs against recording the step.
The stand-in step runs the project's Triton kernels before and after the op
(launched with programmatic dependent launch where the GPU has it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

_VOIDP = ctypes.c_void_p


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA 12.0 on)."""

    _fields_ = [("func", _VOIDP),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", _VOIDP), ("extra", _VOIDP), ("kern", _VOIDP), ("ctx", _VOIDP)]


class EdgeData(ctypes.Structure):
    """CUgraphEdgeData (CUDA 12.3 on): programmatic dependent launch's edges carry a type."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class Driver:
    """The driver calls a derivation needs, each at a fixed ABI version; a
    failing call raises with its name and CUresult."""

    KERNEL, CHILD = 0, 1  # CUgraphNodeType

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._fns: dict[tuple[str, int], int] = {}

    def fn(self, name: str, version: int = 12000) -> int:
        """The entry point of `name` as the driver gives it to a program built
        against CUDA `version` (12000: 12.0; 12030: 12.3, edges with data)."""
        key = (name, version)
        if key not in self._fns:
            pfn, status = _VOIDP(), ctypes.c_int()
            rc = self.lib.cuGetProcAddress_v2(ctypes.c_char_p(name.encode()), ctypes.byref(pfn),
                                              ctypes.c_int(version), ctypes.c_ulonglong(0),
                                              ctypes.byref(status))
            if rc != 0 or not pfn.value:
                raise RuntimeError(f"cuGetProcAddress({name}, {version}): CUresult {rc}, "
                                   f"status {status.value}")
            self._fns[key] = pfn.value
        return self._fns[key]

    def call(self, name: str, *args, version: int = 12000) -> None:
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *[type(a) for a in args])
        rc = proto(self.fn(name, version))(*args)
        if rc != 0:
            raise RuntimeError(f"{name} returned CUresult {rc}")

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self.call("cuGraphGetNodes", _VOIDP(graph), _VOIDP(None), ctypes.pointer(count))
        arr = (_VOIDP * max(1, count.value))()
        self.call("cuGraphGetNodes", _VOIDP(graph), ctypes.cast(arr, _VOIDP), ctypes.pointer(count))
        return [arr[i] for i in range(count.value)]

    def node_type(self, node: int) -> int:
        t = ctypes.c_int(-1)
        self.call("cuGraphNodeGetType", _VOIDP(node), ctypes.pointer(t))
        return t.value

    def kernel_nodes(self, graph: int) -> list[int]:
        return [n for n in self.nodes(graph) if self.node_type(n) == self.KERNEL]

    def get_params(self, node: int) -> KernelNodeParams:
        p = KernelNodeParams()
        self.call("cuGraphKernelNodeGetParams", _VOIDP(node), ctypes.pointer(p))
        return p

    def set_params(self, node: int, p: KernelNodeParams) -> None:
        self.call("cuGraphKernelNodeSetParams", _VOIDP(node), ctypes.pointer(p))

    def _edges(self, name: str, node: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self.call(name, _VOIDP(node), _VOIDP(None), _VOIDP(None), ctypes.pointer(count), version=12030)
        arr, data = (_VOIDP * max(1, count.value))(), (EdgeData * max(1, count.value))()
        self.call(name, _VOIDP(node), ctypes.cast(arr, _VOIDP), ctypes.cast(data, _VOIDP),
                  ctypes.pointer(count), version=12030)
        return [arr[i] for i in range(count.value)]

    def dependencies(self, node: int) -> list[int]:
        return self._edges("cuGraphNodeGetDependencies", node)

    def dependents(self, node: int) -> list[int]:
        return self._edges("cuGraphNodeGetDependentNodes", node)

    def clone(self, graph: int) -> int:
        out = _VOIDP()
        self.call("cuGraphClone", ctypes.pointer(out), _VOIDP(graph))
        return out.value

    def replace_with_child(self, graph: int, old: list[int], child: int) -> None:
        """Remove `old` (nodes of `graph`) and put `child` (a graph, copied in)
        where they were: after their outside predecessors, before their
        outside dependents (plain edges: no programmatic overlap across it)."""
        inside = set(old)
        preds = sorted({d for n in old for d in self.dependencies(n)} - inside)
        succs = sorted({d for n in old for d in self.dependents(n)} - inside)
        for n in old:
            self.call("cuGraphDestroyNode", _VOIDP(n))
        node = _VOIDP()
        deps = (_VOIDP * max(1, len(preds)))(*preds)
        self.call("cuGraphAddChildGraphNode", ctypes.pointer(node), _VOIDP(graph),
                  ctypes.cast(deps, _VOIDP), ctypes.c_size_t(len(preds)), _VOIDP(child))
        for s in succs:
            frm, to = (_VOIDP * 1)(node.value), (_VOIDP * 1)(s)
            self.call("cuGraphAddDependencies", _VOIDP(graph), ctypes.cast(frm, _VOIDP),
                      ctypes.cast(to, _VOIDP), ctypes.c_size_t(1))

    def instantiate(self, graph: int) -> int:
        out = _VOIDP()
        self.call("cuGraphInstantiateWithFlags", ctypes.pointer(out), _VOIDP(graph), ctypes.c_ulonglong(0))
        return out.value

    def launch(self, exec_: int, stream: int) -> None:
        self.call("cuGraphLaunch", _VOIDP(exec_), _VOIDP(stream))

    def destroy(self, graph: int = 0, exec_: int = 0) -> None:
        if exec_:
            self.call("cuGraphExecDestroy", _VOIDP(exec_))
        if graph:
            self.call("cuGraphDestroy", _VOIDP(graph))

    def capturing_nodes(self, stream: int) -> int:
        """Nodes in the graph `stream` is capturing into, so far."""
        status, cid, graph = ctypes.c_int(), ctypes.c_ulonglong(), _VOIDP()
        deps, edges, ndeps = _VOIDP(), _VOIDP(), ctypes.c_size_t()
        self.call("cuStreamGetCaptureInfo", _VOIDP(stream), ctypes.pointer(status), ctypes.pointer(cid),
                  ctypes.pointer(graph), ctypes.pointer(deps), ctypes.pointer(edges),
                  ctypes.pointer(ndeps), version=12030)
        return len(self.nodes(graph.value))


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    # out = x * scale over n elements, BLOCK a program
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    tl.store(out_ptr + offs, (v * scale).to(out_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _shift_kernel(x_ptr, out_ptr, n, shift, BLOCK: tl.constexpr):
    # out = x + shift: another kernel, another grid
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    tl.store(out_ptr + offs, (v + shift).to(out_ptr.dtype.element_ty), mask=offs < n)


def _middle(h: torch.Tensor, y: torch.Tensor, form: str) -> None:
    """The op that differs by form (as attention between a decode and a mixed
    step), writing its out-parameter y [M, K] from h [M, K] (contiguous rows).
    one:   one launch, y = h * 2
    two:   two launches, y = (h * 2) * 0.75 (as decode's split, then reduce)
    other: one launch of another kernel, y = h + 0.5"""
    n, grid = h.numel(), (triton.cdiv(h.numel(), 1024),)
    if form == "other":
        _shift_kernel[(triton.cdiv(n, 256),)](h, y, n, 0.5, BLOCK=256)
        return
    _scale_kernel[grid](h, y, n, 2.0, BLOCK=1024)
    if form == "two":
        _scale_kernel[grid](y, y, n, 0.75, BLOCK=1024)


def _step(x, w, out, form: str, keep: list | None = None, drv=None, marks: list | None = None):
    """The stand-in step: RMSNorm (Triton, PDL), the middle op into the first
    half of y, SiLU·mul (Triton, PDL) of y, plus x into `out`. `keep` gets
    the middle op's tensors, `marks` the node counts around it."""
    from compile_backend.kernels.rms_norm import rms_norm
    from compile_backend.kernels.silu_mul import silu_mul

    h = rms_norm(x, w, 1e-6)
    K = h.shape[1]
    y = torch.empty(h.shape[0], 2 * K, device=h.device, dtype=h.dtype)
    y[:, K:].copy_(h)
    g = torch.empty_like(h)
    if marks is not None:
        marks.append(drv.capturing_nodes(torch.cuda.current_stream().cuda_stream))
    _middle(h, g, form)
    if marks is not None:
        marks.append(drv.capturing_nodes(torch.cuda.current_stream().cuda_stream))
    if keep is not None:
        keep += [h, g]
    y[:, :K].copy_(g)
    out.copy_(silu_mul(y) + x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_surgery: needs a CUDA device")
        return 2
    import compile_backend.kernels  # noqa: F401
    from compile_backend.runtime.graph_pool import capture_stream, warm_capture_stream

    drv = Driver()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(37)
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16, generator=gen) + 1
    outs = {f: torch.empty_like(x) for f in ("one", "two", "other")}
    for f, out in outs.items():  # every kernel compiled before any capture
        _step(x, w, out, f)
    torch.cuda.synchronize()
    warm_capture_stream(dev)
    stream = capture_stream(dev)
    pool, side_pool = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
    rows: list[tuple[str, str]] = []

    def captured(fn, use_pool) -> tuple[torch.cuda.CUDAGraph, float]:
        g = torch.cuda.CUDAGraph(keep_graph=True)
        stream.wait_stream(torch.cuda.current_stream())
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            g.capture_begin(pool=use_pool)
            fn()
            g.capture_end()
        dt = time.perf_counter() - t0
        torch.cuda.current_stream().wait_stream(stream)
        return g, dt

    recorded, keeps, marks = {}, {}, {}
    for f in ("one", "two", "other"):
        keeps[f], marks[f] = [], []
        recorded[f], secs = captured(lambda: _step(x, w, outs[f], f, keeps[f], drv, marks[f]), pool)
        rows.append((f"1. record '{f}': nodes before/after the op, in all; record s",
                     f"{marks[f]}, {len(drv.nodes(recorded[f].raw_cuda_graph()))}; {secs:.6f}"))

    def derive(base: str, how: str) -> tuple[int, int, object]:
        """A clone of `base`'s graph with its op's nodes made the 'other' form's."""
        h, g = keeps[base]
        side, _ = captured(lambda: _middle(h, g, "other"), side_pool)
        side_raw = side.raw_cuda_graph()
        clone = drv.clone(recorded[base].raw_cuda_graph())
        lo, hi = marks[base]
        mine = drv.nodes(clone)[lo:hi]
        if how == "A":
            theirs = drv.kernel_nodes(side_raw)
            assert len(theirs) == len(mine), (len(theirs), len(mine))
            for n, t in zip(mine, theirs):
                drv.set_params(n, drv.get_params(t))
        else:
            drv.replace_with_child(clone, mine, side_raw)
        return clone, drv.instantiate(clone), side

    worst_all = 0.0
    for base, how in (("one", "A"), ("one", "B"), ("two", "B")):
        try:
            t0 = time.perf_counter()
            clone, exec_, side = derive(base, how)
            first = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 (the table says what failed)
            rows.append((f"2. derive '{base}' -> 'other' by {how}", f"FAILED: {e}"))
            worst_all = float("inf")
            continue
        worst = 0.0
        for _ in range(args.reps):  # fresh inputs at the same addresses, every replay
            x.copy_(torch.randn(x.shape, device=dev, dtype=x.dtype, generator=gen))
            recorded["other"].replay()
            drv.launch(exec_, torch.cuda.current_stream().cuda_stream)  # writes outs[base]
            ref = torch.empty_like(x)
            _step(x, w, ref, "other")
            torch.cuda.synchronize()
            worst = max(worst, (outs[base].float() - outs["other"].float()).abs().max().item(),
                        (ref.float() - outs["other"].float()).abs().max().item())
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            c, e, s = derive(base, how)
            times.append(time.perf_counter() - t0)
            drv.destroy(c, e)
            del s
        drv.destroy(clone, exec_)
        del side
        worst_all = max(worst_all, worst)
        rows.append((f"2. derive '{base}' -> 'other' by {how}: max abs diff over {args.reps} fresh "
                     "inputs (vs recorded and eager); s first / median of 5",
                     f"{worst:g}; {first:.6f} / {statistics.median(times):.6f}"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| step | result |\n|---|---|")
    print("\n".join(f"| {a} | {b} |" for a, b in rows))
    return 0 if worst_all == 0.0 else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
