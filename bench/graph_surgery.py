"""Can a FULL plan derive one graph from another instead of recording the step twice?

    python bench/graph_surgery.py [--reps 20]        (CUDA)

Checks what CompilationConfig.derive_mixed_graphs relies on, on the machine
at hand (runtime/graph_surgery.py; docs/design.md, "A mixed graph derived
from the decode graph"): node counts while a stream captures (which nodes
an op added); an op's other form captured alone on the first capture's
tensors, padded to as many launches; `derive` (a clone whose nodes of the
op take the other form's launches), for an op of one launch and of two; each derived graph against the graph
recorded directly and eager on fresh inputs, replay after replay; and what
a derivation costs against recording the step. The stand-in step runs the
project's Triton kernels (PDL where the GPU has it) around the op.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl


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


def _step(x, w, out, form: str, keep: list | None = None, count=None, marks: list | None = None):
    """The stand-in step: RMSNorm (Triton, PDL), the middle op into the first
    half of y, SiLU·mul (Triton, PDL) of y, plus x into `out`. `keep` gets
    the middle op's tensors, `marks` the node counts around it (`count()`)."""
    from compile_backend.kernels.rms_norm import rms_norm
    from compile_backend.kernels.silu_mul import silu_mul

    h = rms_norm(x, w, 1e-6)
    K = h.shape[1]
    y = torch.empty(h.shape[0], 2 * K, device=h.device, dtype=h.dtype)
    y[:, K:].copy_(h)
    g = torch.empty_like(h)
    if marks is not None:
        marks.append(count())
    _middle(h, g, form)
    if marks is not None:
        marks.append(count())
    if keep is not None:  # as a derivation notes them: aliases that own nothing
        from compile_backend.runtime.graph_pool import weak_ref

        keep += [weak_ref(h), weak_ref(g)]
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
    from compile_backend.runtime import graph_surgery
    from compile_backend.runtime.graph_pool import ReusedPool, TorchCUDAGraphs

    graphs = TorchCUDAGraphs()
    why = graphs.can_derive()
    if why is not None:
        print(f"graph_surgery: cannot derive here: {why}")
        return 1
    drv = graph_surgery.driver()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(37)
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16, generator=gen) + 1
    outs = {f: torch.empty_like(x) for f in ("one", "two", "other")}
    for f, out in outs.items():  # every kernel compiled before any capture
        _step(x, w, out, f)
    torch.cuda.synchronize()
    pool, side_pool = graphs.pool(), ReusedPool(graphs)  # side graphs die here: renewed as the runner's
    rows: list[tuple[str, str]] = []

    def captured(fn, use_pool, instantiate=True):
        g = graphs.new_graph(keep_graph=True)
        t0 = time.perf_counter()
        handle = use_pool.for_capture(g) if isinstance(use_pool, ReusedPool) else use_pool
        with graphs.capture(g, handle, (), instantiate=instantiate):
            fn()
        return g, time.perf_counter() - t0

    recorded, keeps, marks = {}, {}, {}
    for f in ("one", "two", "other"):
        keeps[f], marks[f] = [], []
        recorded[f], secs = captured(
            lambda: _step(x, w, outs[f], f, keeps[f], graphs.node_count, marks[f]), pool)
        rows.append((f"1. record '{f}': nodes before/after the op, in all; s (with instantiate)",
                     f"{marks[f]}, {len(drv.nodes(recorded[f].raw_cuda_graph()))}; {secs:.6f}"))

    def derive(base: str):
        """As runtime/mixed_graphs.py does: the other form captured alone on the
        first capture's tensors, padded to as many launches, then derive."""
        h, g = keeps[base]
        first, end = marks[base]
        pairs = []

        def other_form():
            side_first = graphs.node_count()
            _middle(h, g, "other")
            pad = torch.empty(1, device=dev)
            for _ in range((end - first) - (graphs.node_count() - side_first)):
                pad.fill_(1.0)
            pairs.append((first, end, side_first, graphs.node_count()))

        side, _ = captured(other_form, side_pool, instantiate=False)
        return graphs.derive(recorded[base], side, pairs)

    worst_all = 0.0
    for base in ("one", "two"):
        try:
            t0 = time.perf_counter()
            made = derive(base)
            first = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 (the table says what failed)
            rows.append((f"2. derive '{base}' -> 'other'", f"FAILED: {type(e).__name__}: {e}"))
            worst_all = float("inf")
            continue
        worst = 0.0
        for _ in range(args.reps):  # fresh inputs at the same addresses, every replay
            x.copy_(torch.randn(x.shape, device=dev, dtype=x.dtype, generator=gen))
            recorded["other"].replay()
            made.replay()  # writes outs[base]
            ref = torch.empty_like(x)
            _step(x, w, ref, "other")
            torch.cuda.synchronize()
            worst = max(worst, (outs[base].float() - outs["other"].float()).abs().max().item(),
                        (ref.float() - outs["other"].float()).abs().max().item())
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            again = derive(base)
            times.append(time.perf_counter() - t0)
            again.reset()
        made.reset()
        worst_all = max(worst_all, worst)
        rows.append((f"2. derive '{base}' -> 'other': max abs diff over {args.reps} fresh inputs "
                     "(vs recorded and eager); s first / median of 5",
                     f"{worst:g}; {first:.6f} / {statistics.median(times):.6f}"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| step | result |\n|---|---|")
    print("\n".join(f"| {a} | {b} |" for a, b in rows))
    return 0 if worst_all == 0.0 else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
