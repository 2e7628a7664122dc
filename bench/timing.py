"""Timing helpers shared by the kernel benchmarks (bench/kernels.py,
bench/skinny_gemm.py), so that neither imports the other.

    median_ms(fn)              do_bench's median, warm-up excluded
    graph_ms(fns, calls)       ms per call of `calls` calls captured in one
                               CUDA graph (cycling through `fns`: separate
                               input sets, so repeats do not hit L2)
    copy_bandwidth()           bytes/s of a 1 GiB device-to-device copy
                               (read + written)
"""

from __future__ import annotations

from typing import Callable

import torch


def median_ms(fn: Callable[[], object], warmup: int = 50, rep: int = 300) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fns: list[Callable[[], object]], calls: int = 12,
             timer: Callable[[Callable[[], object]], float] = median_ms) -> float:
    """Median ms per call, `calls` calls in one graph: how the ops run under
    mrv2, without host launch overhead. Warmed (compiled) eagerly and on a
    side stream before the capture."""
    for f in fns:
        f()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    return timer(graph.replay) / calls


def copy_bandwidth(timer: Callable[[Callable[[], object]], float] = median_ms) -> float:
    n = 1 << 30  # 1 GiB read + 1 GiB written
    src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / (ms * 1e-3)


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
