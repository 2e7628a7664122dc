"""Triton compiles on worker threads or processes, beside a busy main thread.

    python bench/compile_contention.py [--kernels 8] [--workers 2] [--main python|torch] [--out FILE.md]

A cold capture plan hands Triton compiles to worker threads
(compile_backend/runtime/kernel_precompile.py) while its main thread keeps
capturing, which is Python from end to end. This times both sides of that:
N distinct kernels (the skinny GEMM's llama-8B specializations, compiled
offline for sm_90a as bench/kernel_asm.py does: no GPU needed) compiled by a
pool of threads, then of spawned processes, while the main thread runs a
pure-Python loop until they finish. Rows: the compiles alone in line, then
each pool; the main loop's time per round against alone, and the pool's wall
time. Run it with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import report  # noqa: E402


def compile_one(index: int, cache: str) -> float:
    """Compile skinny spec `index` for sm_90a into `cache`; its seconds."""
    os.environ["TRITON_CACHE_DIR"] = cache
    import kernel_asm

    t = time.perf_counter()
    kernel_asm.compile_spec(kernel_asm.skinny_specs()[index])
    return time.perf_counter() - t


def python_round(n: int = 1_000_000) -> float:
    """One round of the main thread's pure-Python work; its seconds."""
    t, s = time.perf_counter(), 0
    for i in range(n):
        s += i % 7
    return time.perf_counter() - t


def torch_round(n: int = 20_000) -> float:
    """One round of small torch calls; its seconds. Each call lets go of
    Python's lock while it runs and takes it back after, as a capture's
    launches and torch calls do: every take-back can wait for a compile
    thread that holds the lock (up to the switch interval, 5 ms)."""
    import torch

    a = torch.ones(4)
    t = time.perf_counter()
    for _ in range(n):
        a = torch.add(a, 1.0)
    return time.perf_counter() - t


ROUNDS = {"python": python_round, "torch": torch_round}


def run_pool(pool: cf.Executor, kernels: int, main_round=python_round) -> tuple[float, float, int]:
    """(main round s, pool wall s, rounds): the main loop beside the pool's compiles."""
    cache = tempfile.mkdtemp(prefix="mrv2-contention-")
    t0 = time.perf_counter()
    futures = [pool.submit(compile_one, i, cache) for i in range(kernels)]
    rounds, busy = 0, 0.0
    while not all(f.done() for f in futures):
        busy += main_round()
        rounds += 1
    for f in futures:
        f.result()  # a failed compile raises here
    return busy / max(rounds, 1), time.perf_counter() - t0, rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--main", choices=sorted(ROUNDS), default="python",
                   help="the main thread's work: a pure-Python loop (never lets go of the lock "
                        "but at the switch interval) or small torch calls (each lets go of it)")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    main_round = ROUNDS[a.main]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("TRITON_INTERPRET is set: the interpreter's kernels cannot be compiled")
    import kernel_asm

    a.kernels = min(a.kernels, len(kernel_asm.skinny_specs()))
    alone = min(main_round() for _ in range(5))
    cache = tempfile.mkdtemp(prefix="mrv2-contention-")
    t0 = time.perf_counter()
    for i in range(a.kernels):
        compile_one(i, cache)
    rows = [["in line, main thread idle", "-", f"{time.perf_counter() - t0:.2f}", "-"]]
    pools = (("threads", lambda: cf.ThreadPoolExecutor(a.workers)),
             ("processes (spawned)", lambda: cf.ProcessPoolExecutor(
                 a.workers, mp_context=multiprocessing.get_context("spawn"))))
    for name, make in pools:
        with make() as pool:
            per_round, wall, rounds = run_pool(pool, a.kernels, main_round)
        rows.append([f"{a.workers} {name}", f"{per_round / alone:.2f}", f"{wall:.2f}", str(rounds)])
    lines = [f"{a.kernels} kernels, {os.cpu_count()} cores; main thread: {a.main} rounds, "
             f"alone {alone * 1e3:.0f} ms each", "",
             *report.table(["compiles", "main round / alone", "compiles done s", "main rounds"],
                           "lrrr", rows)]
    report.print_and_write(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
