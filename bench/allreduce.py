"""All-reduce latency between the ranks, the collective TP decode runs twice
per layer: what bench/tp.py's TP=N step time is made of.

    torchrun --nproc-per-node 2 bench/allreduce.py [--tokens 1,64,256] [--hidden 4096]

Per size ([tokens, hidden] bf16): the median over 50 launches of one
all-reduce through the functional collective (the op the models trace),
eager, and replayed from a CUDA graph holding 64 of them (per all-reduce);
CUDA events, ranks lined up by a barrier first. Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compile_backend.core.parallel import init_from_env  # noqa: E402


def timed_ms(fn, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,64,256")
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/allreduce.py times NCCL on GPUs: run it under torchrun on a GPU machine")
    tp = init_from_env()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", tp.rank)))
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        x = torch.randn(t, args.hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            tp.all_reduce(x)
        eager = timed_ms(lambda: tp.all_reduce(x))
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            tp.all_reduce(x)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            y = x
            for _ in range(64):
                y = tp.all_reduce(y)
        graph.replay()
        in_graph = timed_ms(graph.replay, reps=20) / 64
        rows.append((t, x.numel() * 2 / 1024, eager * 1e3, in_graph * 1e3))
        graph.reset()
    if tp.rank == 0:
        print(f"# all-reduce, {tp.size} ranks, bf16, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print("\n| tokens | KiB | eager µs | in a CUDA graph µs |\n|---:|---:|---:|---:|")
        for t, kib, e, g in rows:
            print(f"| {t} | {kib:.0f} | {e:.1f} | {g:.1f} |")
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
