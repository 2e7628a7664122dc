"""Where a decode step's time goes: host work against device work, and the
kernels of one step.

    python bench/profile_step.py [--model llama|hybrid] [--preset bench|llama8b]
                                 [--batches 1,64] [--modes full,piecewise]
                                 [--context 500] [--top 12] [--config FIELD=VALUE ...]

Per (mode, batch): the step time (CUDA events around `execute`, as in
bench/decode.py), the host time of `execute` alone (perf_counter until it
returns, device work still queued), the device time of the FULL graph's
replay alone, and the back-to-back step time (20 steps queued without a
synchronize: host work of step i+1 overlaps device work of step i where it
can). Then a torch.profiler table of the kernels one step launches (FULL:
the graph's kernels, NONE: the same kernels launched one by one), by total
device time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode as bench  # noqa: E402
from timing import copy_bandwidth, kernel_table  # noqa: E402
from workload import config_options, decode_batch  # noqa: E402

import compile_backend as cb  # noqa: E402


def host_ms(fn, reps: int = 30) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_profile(fn, top: int, steps: int = 50) -> str:
    """cProfile of `steps` calls: where the host time of a step goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return f"  host profile over {steps} steps:\n" + buf.getvalue()


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=["llama", "hybrid"])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--modes", default="full,piecewise,none")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--host-profile", action="store_true", help="also cProfile the steps")
    ap.add_argument("--preset", default="bench", help="model size (bench, llama8b, ...)")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a CompilationConfig field for every runner (repeatable)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    setup = bench.Setup(device="cuda", dtype=torch.bfloat16, preset=args.preset,
                        piece_compiler="inductor", context=args.context, graphs=None,
                        options=config_options(ap, args.config))
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth(device=setup.device).median
    peak = bench.gemm_peak_flops(setup.device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 GEMM peak "
          f"{'-' if peak is None else format(peak / 1e12, '.0f')} TFLOP/s")
    for mode in args.modes.split(","):
        variant = f"mrv2-{mode}"
        sizes = [s for s in [1, 2, 4] + list(range(8, 257, 8)) if s <= max(batches)]
        blocks = max(batches) * (-(-(setup.context + 1) // 16) + 2) + 2
        runner, model, kv, _ = bench.build(args.model, variant, setup, sizes, max(batches),
                                           max(sizes), blocks)
        for b in batches:
            batch = decode_batch(b, setup.context, kv, model.cfg.vocab_size)

            def step():
                return runner.execute(batch)
            for _ in range(5):
                step()
            floor, compute = bench.floor_times({"work": bench.step_floor_work(model, b, setup.context)},
                                               bw, peak)
            line = (f"{args.model} {variant} b{b}: step {bench.median_ms(step, setup):.3f} ms, "
                    f"host {host_ms(step):.3f} ms, back-to-back {bench.back_to_back_ms(step, setup):.3f} ms")
            step_graph = runner.dispatch(batch)
            if step_graph.mode is cb.CUDAGraphMode.FULL:
                cuda_graph = runner.full_graph.entries[step_graph.key].cuda_graph
                line += f", replay {bench.median_ms(cuda_graph.replay, setup):.3f} ms"
                target = cuda_graph.replay
            else:
                target = step
            line += f", HBM floor {floor:.3f} ms"
            print(line + ("" if compute is None else f", compute-aware floor {compute:.3f} ms"),
                  flush=True)
            print("\n".join(kernel_table(target, args.top, model.cfg.num_layers)), flush=True)
            if args.host_profile:
                print(host_profile(step, 2 * args.top), flush=True)
        runner = None  # frees its graphs before the next mode builds
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
