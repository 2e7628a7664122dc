"""Host time of one PIECEWISE replay call in the CUDA-graph wrapper, with
the graph's replay itself a no-op: what the wrapper adds per piece of a
runner step (descriptor lookup, the address check of every tensor input,
copies into private buffers, output aliases). Runs on the CPU.

    python bench/replay_hot_path.py [--calls 20000]

To compare two trees, run it under each (PYTHONPATH=<tree>); the numbers
are the median and minimum of 5 rounds, in microseconds per call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
                or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compile_backend as cb  # noqa: E402
from compile_backend.runtime.cuda_graph import CUDAGraphWrapper  # noqa: E402
from compile_backend.runtime.graph_pool import use_graph_backend  # noqa: E402


class _NoOpGraph:
    def replay(self) -> None:
        pass


class _NoOpGraphs:
    """Graphs whose capture records nothing and whose replay does nothing."""

    def new_graph(self):
        return _NoOpGraph()

    def capture(self, graph, pool, args=()):
        return contextlib.nullcontext()

    def pool(self):
        return object()

    def memory_allocated(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def time_replays(num_inputs: int, calls: int) -> tuple[float, float]:
    args = [torch.randn(8) for _ in range(num_inputs)]  # at fixed addresses, as a runner's
    with use_graph_backend(_NoOpGraphs()):
        w = CUDAGraphWrapper(lambda *a: a[0] * 2, cb.CUDAGraphMode.PIECEWISE, name="piece")
        ctx = cb.ForwardContext(graph=cb.StepGraph(cb.CUDAGraphMode.PIECEWISE, 8, 8))
        with cb.set_forward_context(ctx):
            w(*args)  # capture
            rounds = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls):
                    w(*args)
                rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds), min(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args()
    print("| tensor inputs | median us per replay call | min us |")
    print("|---:|---:|---:|")
    for n in (4, 12, 32):
        med, low = time_replays(n, a.calls)
        print(f"| {n} | {med:.2f} | {low:.2f} |")


if __name__ == "__main__":
    main()
