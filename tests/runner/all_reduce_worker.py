"""One rank of the tp_all_reduce checks; tests/runner/test_all_reduce.py starts 2 of them
with `python -m torch.distributed.run --nproc-per-node 2 tests/runner/all_reduce_worker.py ...`.

    --device cpu   gloo: "auto" falls back to NCCL's place (the functional
                   collective), counted, the reason logged once, sums equal;
                   "one_shot" raises; ranks that disagree on mode, threshold
                   or capability raise RanksDisagree; the buffers are freed
                   and the group destroyed without a hang
    --device cuda  NCCL on 2 GPUs: the one-shot all-reduce equals NCCL's sum,
                   eager and replayed from a CUDA graph, bf16, 8 KiB - 2 MiB

Each rank writes its results to OUT/rank<R>.json; a failed check raises, so
torchrun exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import compile_backend.core.all_reduce as ar  # noqa: E402
import compile_backend.kernels  # noqa: E402,F401  (mrv2::all_reduce)
from compile_backend.core.config import CompilationConfig  # noqa: E402
from compile_backend.core.counters import counters, reset_counters  # noqa: E402
from compile_backend.core.parallel import RanksDisagree, init_from_env  # noqa: E402
from compile_backend.runner.parallel import (  # noqa: E402
    RankAgreement, end_tensor_parallel, exit_process)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _raises(fn, exc) -> str | None:
    try:
        fn()
    except exc as e:
        return str(e)
    return None


def _inputs(tp, numel: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input, and the sum over the ranks computed without a collective."""
    parts = [torch.randn(numel, generator=torch.Generator().manual_seed(r), dtype=torch.float32)
             for r in range(tp.size)]
    x = parts[tp.rank].to(dtype).to(device)
    return x, sum(p.to(dtype).float() for p in parts).to(device)


def cpu_checks(tp) -> dict:
    out: dict = {}
    group = tp.group_name
    handler = _Records()
    logging.getLogger("compile_backend.core.all_reduce").addHandler(handler)
    # "auto" on gloo: every all-reduce stays on the functional collective.
    states = [ar.setup_all_reduce(tp, "auto", 4096) for _ in range(2)]
    out["auto_states"] = [s is None for s in states]
    out["fallback_reason"] = ar.fallback_reason(group)
    sums_equal = []
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (8, 1000, 4096):
            x, want = _inputs(tp, numel, dtype, "cpu")
            got = torch.ops.mrv2.all_reduce(x, 4096, group)
            sums_equal.append(bool(torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)))
    reset_counters()
    torch._dynamo.reset()

    def step(x, w):
        return tp.all_reduce(x @ w).sin()

    compiled = torch.compile(step, backend="mrv2", options={
        "piece_compiler": "eager", "tp_all_reduce": "auto", "tp_all_reduce_threshold": 4096})
    x = torch.randn(4, 8)  # this rank's
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))  # every rank's
    with torch.no_grad():
        got = compiled(x, w)
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x)
    want = (sum(p @ w for p in parts)).sin()
    sums_equal.append(bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5)))
    out["sums_equal"] = sums_equal
    out["compiled_fallbacks"] = counters["all_reduce_fallbacks"]
    out["fallback_warnings"] = [m for m in handler.messages if "NCCL all-reduce" in m]
    # "one_shot" without the capability: an error on every rank, not a fallback.
    out["one_shot_raises"] = _raises(lambda: ar.setup_all_reduce(tp, "one_shot", 4096), RuntimeError)
    # Ranks that disagree: on the threshold, the mode, the capability.
    out["threshold_disagree"] = _raises(
        lambda: ar.setup_all_reduce(tp, "auto", 4096 * (tp.rank + 1)), RanksDisagree)
    out["mode_disagree"] = _raises(
        lambda: ar.setup_all_reduce(tp, "auto" if tp.rank else "nccl", 4096), RanksDisagree)
    saved = ar.local_capability, ar._peer_reason
    if tp.rank == 1:  # rank 1 believes it could run one-shot
        ar.local_capability = lambda group_name: None
        ar._peer_reason = lambda me, everyone: None
    try:
        out["capability_disagree"] = _raises(lambda: ar.setup_all_reduce(tp, "auto", 4096),
                                             RanksDisagree)
    finally:
        ar.local_capability, ar._peer_reason = saved

    # The runner's plan check compares the all-reduce config too.
    class Runner:
        mode = type("M", (), {"value": "none"})()
        capture_sizes, decode_sizes = [1], []
        config = CompilationConfig(tp_all_reduce="auto" if tp.rank else "nccl")

        @staticmethod
        def capture_plan():
            return []

    out["plan_disagree"] = _raises(lambda: RankAgreement(tp, False).check_plan(Runner()),
                                   RanksDisagree)
    return out


def cuda_checks(tp) -> dict:
    group = tp.group_name
    state = ar.setup_all_reduce(tp, "one_shot", 2 << 20)
    rows = []
    for kib in (8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        numel = kib * 1024 // 2
        x, want = _inputs(tp, numel, torch.bfloat16, "cuda")
        algo = ar.choose_all_reduce(numel * 2, torch.bfloat16, mode="one_shot", capable=True,
                                    threshold=state.threshold)
        nccl = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x, "sum", group))
        eager = torch.ops.mrv2.all_reduce(x, 2 << 20, group)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.ops.mrv2.all_reduce(x, 2 << 20, group)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.mrv2.all_reduce(x, 2 << 20, group)
        x.mul_(2)  # a replay reads the new input
        graph.replay()
        torch.cuda.synchronize()
        rows.append({"kib": kib, "algorithm": algo,
                     "eager_vs_nccl": float((eager.float() - nccl.float()).abs().max()),
                     "nccl_vs_sum": float((nccl.float() - want).abs().max()),
                     "graph_vs_2x_nccl": float((captured.float() - 2 * nccl.float()).abs().max())})
        graph.reset()
    return {"rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    tp = init_from_env()
    try:
        result = cpu_checks(tp) if args.device == "cpu" else cuda_checks(tp)
        end_tensor_parallel()  # graphs, then the symmetric buffers, then the group
        result["ready_after_end"] = ar.ready_groups()
        with open(os.path.join(args.out, f"rank{tp.rank}.json"), "w") as f:
            json.dump(result, f, indent=1)
    except BaseException:
        traceback.print_exc()
        exit_process(1)
    exit_process(0)  # results written, the group destroyed (Note [gloo teardown])


if __name__ == "__main__":
    main()
