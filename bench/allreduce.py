"""All-reduce latency between the ranks, the collective TP decode runs twice
per layer: what bench/tp.py's TP=N step time is made of.

    torchrun --nproc-per-node 2 bench/allreduce.py [--tokens 1,64,256] [--hidden 4096]
    torchrun --nproc-per-node 2 bench/allreduce.py --compare [--kib 8,16,...,2048]

Per size ([tokens, hidden] bf16): the median over 50 launches of one
all-reduce through the functional collective (the op the models trace),
eager, and replayed from a CUDA graph holding 64 of them (per all-reduce);
CUDA events, ranks lined up by a barrier first. Rank 0 prints the table.

--compare: per message size (--kib, bf16; default 8 KiB - 2 MiB) the same
two timings for NCCL (the functional collective) and for `mrv2::all_reduce`
with one-shot set up for every size (compile_backend/core/all_reduce.py,
threshold = the largest size), the largest difference between their sums,
and the algorithm the op chose. Multicast stays off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before the buffers are made).
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


def graph_us(fn, x: torch.Tensor, chain: int = 64) -> float:
    """Per all-reduce, µs: one CUDA graph of `chain` all-reduces in a row."""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(chain):
            y = fn(y)  # 2 ranks: x * 2^64 at most, finite in bf16
    graph.replay()
    us = timed_ms(graph.replay, reps=20) / chain * 1e3
    graph.reset()
    return us


def compare(tp, kib: list[int]) -> int:
    """NCCL against mrv2::all_reduce (one-shot), eager and in a CUDA graph."""
    import compile_backend.kernels  # noqa: F401  (mrv2::all_reduce)
    from compile_backend.core.all_reduce import choose_all_reduce, setup_all_reduce
    from compile_backend.runner.parallel import end_tensor_parallel

    threshold = max(kib) * 1024
    state = setup_all_reduce(tp, "one_shot", threshold)
    group = tp.group_name

    def ours(x):
        return torch.ops.mrv2.all_reduce(x, threshold, group)

    rows = []
    for k in kib:
        x = torch.randn(k * 1024 // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            tp.all_reduce(x), ours(x)
        diff = float((tp.all_reduce(x).float() - ours(x).float()).abs().max())
        algo = choose_all_reduce(x.numel() * 2, x.dtype, mode="one_shot", capable=True,
                                 threshold=state.threshold)
        rows.append((k, timed_ms(lambda: tp.all_reduce(x)) * 1e3, timed_ms(lambda: ours(x)) * 1e3,
                     graph_us(tp.all_reduce, x), graph_us(ours, x), diff, algo))
    if tp.rank == 0:
        print(f"# all-reduce, {tp.size} ranks, bf16: NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))} against mrv2::all_reduce "
              f"(torch {torch.__version__})")
        print("\n| KiB | NCCL eager µs | ours eager µs | NCCL in a CUDA graph µs | "
              "ours in a CUDA graph µs | graph speedup | max diff | ours ran |")
        print("|---:|---:|---:|---:|---:|---:|---:|---|")
        for k, ne, oe, ng, og, diff, algo in rows:
            print(f"| {k} | {ne:.1f} | {oe:.1f} | {ng:.1f} | {og:.1f} | {ng / og:.2f}x | "
                  f"{diff:.1e} | {algo} |")
    torch.cuda.synchronize()
    end_tensor_parallel()  # graphs, then the symmetric buffers, then the group
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,64,256")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--compare", action="store_true",
                    help="NCCL against mrv2::all_reduce (one-shot) per message size (--kib)")
    ap.add_argument("--kib", default="8,16,32,64,128,256,512,1024,2048",
                    help="message sizes for --compare, KiB of bf16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/allreduce.py times NCCL on GPUs: run it under torchrun on a GPU machine")
    tp = init_from_env()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", tp.rank)))
    if args.compare:
        return compare(tp, [int(k) for k in args.kib.split(",")])
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
