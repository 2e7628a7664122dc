"""Timing helpers shared by the benchmarks (bench/kernel_speed.py,
bench/skinny_gemm.py, bench/decode.py), so that none imports another.

    median_ms(fn)              do_bench's median, warm-up excluded
    graph_ms(fns, calls)       ms per call of `calls` calls captured in one
                               CUDA graph (cycling through `fns`: separate
                               input sets, so repeats do not hit L2)
    call_ms(fn, device, reps)  ms of each of `reps` calls, one at a time
    copy_bandwidth()           device-to-device copy bandwidth, bytes/s (read
                               + written), in rounds: a Bandwidth, its median
                               and its spread (min-max) over the rounds
    kernel_profile, kernel_table   the kernels of one call (torch.profiler)
    host_speed()               the host's speed at Python and at torch's
                               dispatch (fixed work, µs): hosts of one kind
                               differ by up to 2x, and host-bound figures
                               (capture, load) move with them
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], warmup: int = 50, rep: int = 300) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fns: list[Callable[[], object]], calls: int = 12,
             timer: Callable[[Callable[[], object]], float] = median_ms) -> float:
    """Median ms per call, `calls` calls in one graph: how the ops run under
    mrv2, without host launch overhead. Warmed (compiled) eagerly, and on the
    side stream the capture then runs on: what a kernel keeps per stream
    (the split-K GEMM's arrival counters, compile_backend/core/stream_buffers.py)
    is made there outside the capture, as the runtime's capture stream gets
    it; a capture on a stream without them would time the one-split fallback."""
    for f in fns:
        f()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    from compile_backend.core.counters import counters

    fallbacks = counters["skinny_split_k_fallbacks"]
    with torch.cuda.graph(graph, stream=side):
        for i in range(calls):
            fns[i % len(fns)]()
    if counters["skinny_split_k_fallbacks"] != fallbacks:
        raise AssertionError("graph_ms: a split-K launch took one split inside the capture "
                             "(no arrival counters on its stream): the timing would not be the "
                             "kernel's")
    return timer(graph.replay) / calls


def graph_us_per(fn: Callable[[], object], device: str, per: int) -> float:
    """Median µs of one call of `fn` captured alone in a CUDA graph (`graph_ms`),
    divided by `per` (the layers or GEMVs one call runs); off CUDA, one
    timed call (a dry run's stand-in: the number means nothing)."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6 / per
    return graph_ms([fn], calls=1) * 1e3 / per


def call_ms(fn: Callable[[], object], device: str = "cuda", reps: int = 30) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn`, one at a time: CUDA
    events around each, the device idle before it (synchronized); perf_counter
    off CUDA."""
    times = []
    if device == "cuda":  # the first call too starts on an idle device
        torch.cuda.synchronize()
    for _ in range(reps):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter(); fn(); times.append((time.perf_counter() - t0) * 1e3)
    return times


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """Copy bandwidth samples, bytes/s, one a round. The median is the figure
    floors divide by; min-max is its spread, what a difference between two
    rows of a table is to be judged against."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def __add__(self, other: "Bandwidth") -> "Bandwidth":
        return Bandwidth(self.samples + other.samples)

    def gbps(self) -> list[float]:
        return [s / 1e9 for s in self.samples]


def spread_text(samples_gbps: list[float]) -> str:
    """`median (min-max) GB/s` of samples in GB/s."""
    return (f"{statistics.median(samples_gbps):.0f} ({min(samples_gbps):.0f}-"
            f"{max(samples_gbps):.0f}) GB/s")


def copy_bandwidth(rounds: int = 5, copies: int = 20, device: str = "cuda") -> Bandwidth:
    """`rounds` samples of the device-to-device copy bandwidth, each the
    median of `copies` copies timed one by one (call_ms), of 1 GiB read + 1
    GiB written (16 MiB each off CUDA: a dry run's stand-in, which means nothing)."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):  # warm-up, not timed
        dst.copy_(src)
    samples = tuple(2 * n / (statistics.median(call_ms(lambda: dst.copy_(src), device, copies)) * 1e-3)
                    for _ in range(rounds))
    del src, dst
    return Bandwidth(samples)


@dataclasses.dataclass
class HostSpeed:
    python_us: float  # µs of a fixed pure-Python loop (median of rounds)
    dispatch_us: float  # µs a call of torch.empty_like on a small CPU tensor (median of rounds)

    def text(self) -> str:
        return f"Python {self.python_us:.0f} µs, torch dispatch {self.dispatch_us:.2f} µs a call"


def host_speed(rounds: int = 15) -> HostSpeed:
    """How fast this host runs the kind of work a capture or a load is
    made of: a fixed pure-Python loop (dicts, tuples, attribute reads, calls)
    and torch's dispatch of a small CPU op. Figures from hosts with other
    speeds compare only through these."""

    class Box:
        def __init__(self, v):
            self.v = v

    def python_work() -> int:
        total, seen = 0, {}
        for i in range(2000):
            key = (i & 63, i % 7)
            seen[key] = Box(i)
            total += seen[key].v + len(key)
        return total

    small = torch.empty(4)
    python, dispatch = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        python_work()
        python.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        for _ in range(200):
            torch.empty_like(small)
        dispatch.append((time.perf_counter() - t0) / 200 * 1e6)
    return HostSpeed(statistics.median(python), statistics.median(dispatch))


def kernel_profile(fn: Callable[[], object]) -> list[tuple[str, int, float]]:
    """(kernel name, launches, device µs) of one call of `fn` (after one
    call to warm up), by device time, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not rows:
        return []
    attr = "device_time_total" if hasattr(rows[0], "device_time_total") else "cuda_time_total"
    out = [(e.key, e.count, float(getattr(e, attr))) for e in rows]
    return sorted(out, key=lambda r: r[2], reverse=True)


def kernel_table(fn: Callable[[], object], top: int, num_layers: int) -> list[str]:
    """Markdown lines: the kernels of one call of `fn`, launches per layer."""
    rows = kernel_profile(fn)
    total = sum(r[2] for r in rows)
    launches = sum(r[1] for r in rows)
    lines = [f"  kernels: {launches} launches ({launches / num_layers:.1f} per layer), "
             f"{total / 1e3:.3f} ms device time in all",
             "  | kernel | calls | total us | % |", "  |---|---:|---:|---:|"]
    for name, count, t in rows[:top]:
        lines.append(f"  | {name[:70]} | {count} | {t:.1f} | {100 * t / max(total, 1e-9):.1f} |")
    return lines
