"""Host time of one PIECEWISE replay call in the CUDA-graph wrapper, with
the graph's replay itself a no-op: what the wrapper adds per piece of a
runner step (descriptor lookup, the address check of every tensor input,
copies into private buffers, output aliases). A second table times a whole
call of a model under plain torch.compile in FULL mode, whose graph takes
every weight as an input (Dynamo's guards included). Runs on the CPU.

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


def rounds_us(fn, calls: int) -> tuple[float, float]:
    """Median and minimum over 5 rounds of the microseconds per call of `fn`."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds), min(rounds)


def time_replays(num_inputs: int, calls: int) -> tuple[float, float]:
    args = [torch.randn(8) for _ in range(num_inputs)]  # at fixed addresses, as a runner's
    with use_graph_backend(_NoOpGraphs()):
        w = CUDAGraphWrapper(lambda *a: a[0] * 2, cb.CUDAGraphMode.PIECEWISE, name="piece")
        ctx = cb.ForwardContext(graph=cb.StepGraph(cb.CUDAGraphMode.PIECEWISE, 8, 8))
        with cb.set_forward_context(ctx):
            w(*args)  # capture
            return rounds_us(lambda: w(*args), calls)


def time_plain_calls(layers: int, calls: int) -> tuple[float, float]:
    """A model of `layers` Linear(8, 8) under torch.compile(backend="mrv2"),
    FULL, called at one input shape: Dynamo's guards, the step's checks, the
    wrapper's key and address checks over 2 * layers weights, the output's
    copy. The graph's replay does nothing."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    x = torch.randn(2, 8)
    with use_graph_backend(_NoOpGraphs()), torch.no_grad():
        f = torch.compile(model, backend="mrv2",
                          options={"piece_compiler": "eager", "cudagraph_mode": "full"})
        for _ in range(3):  # warm up, capture, replay
            f(x)
        assert cb.counters["cudagraph_replays"] >= 2, dict(cb.counters)
        return rounds_us(lambda: f(x), calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args()
    print("| tensor inputs | median us per replay call | min us |")
    print("|---:|---:|---:|")
    for n in (4, 12, 32):
        med, low = time_replays(n, a.calls)
        print(f"| {n} | {med:.2f} | {low:.2f} |")
    print()
    print("Plain torch.compile, FULL, one shape (each weight is a graph input):")
    print()
    print("| layers | weight inputs | median us per call | min us |")
    print("|---:|---:|---:|---:|")
    for layers in (4, 50, 200):
        med, low = time_plain_calls(layers, max(a.calls // 20, 50))
        print(f"| {layers} | {2 * layers} | {med:.2f} | {low:.2f} |")


if __name__ == "__main__":
    main()
