"""Tensor parallelism in the runner: N processes (torchrun, one per GPU), each
with its own ModelRunner, model shard, KV cache (its KV heads only) and graph
pool.

A graph that holds a collective must be replayed by every rank, or the ranks
that did replay wait forever. Every rank builds the same capture plan from
the same configs (checked once, when the runner is built: one all_gather of
the plans) and dispatches on the batch alone, which every rank's engine
schedules identically; under `debug_checks` each step's choice is compared
before it runs, and a mismatch raises naming each rank's choice. Runners
whose model has a `tp` of more than one rank take part, and set up the
symmetric all-reduce's buffers (compile_backend/core/all_reduce.py).
docs/design.md, section "Tensor parallelism: every rank replays the same
graph".
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

import torch

from compile_backend.core.all_reduce import free_symmetric_buffers, setup_all_reduce
from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph
from compile_backend.core.parallel import RanksDisagree, TensorParallel

logger = logging.getLogger(__name__)

_MODES = list(CUDAGraphMode)


def _group(tp: TensorParallel) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(tp.group_name)


class RankAgreement:
    """Checks that the ranks of a tensor-parallel runner capture and replay
    the same graphs (module docstring)."""

    def __init__(self, tp: TensorParallel, debug_checks: bool) -> None:
        import torch.distributed as dist

        assert tp.size > 1, tp
        self.tp = tp
        self.group = _group(tp)
        self.debug_checks = debug_checks
        # The all_gather of a step's choice runs where the group's backend does.
        nccl = str(dist.get_backend(self.group)).lower() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @classmethod
    def for_runner(cls, runner: Any) -> "RankAgreement | None":
        """Check the plan now (every rank builds its runner); returns the
        per-step checker under debug_checks, else None (no per-step cost)."""
        tp = getattr(runner.model, "tp", None)
        if not isinstance(tp, TensorParallel) or tp.size == 1:
            return None
        agreement = cls(tp, runner.config.debug_checks)
        agreement.check_plan(runner)
        # Collective, eager, before the first compile: the pass then finds the buffers.
        setup_all_reduce(tp, runner.config.tp_all_reduce, runner.config.tp_all_reduce_threshold)
        return agreement if agreement.debug_checks else None

    def check_plan(self, runner: Any) -> None:
        import torch.distributed as dist

        mine = {
            "mode": runner.mode.value,
            "capture_sizes": list(runner.capture_sizes),
            "decode_sizes": list(runner.decode_sizes),
            "plan": [(s.mode.value, s.num_tokens, s.num_reqs, s.uniform_decode)
                     for s in runner.capture_plan()],
            "all_reduce": [runner.config.tp_all_reduce, runner.config.tp_all_reduce_threshold],
        }
        everyone: list[Any] = [None] * self.tp.size
        dist.all_gather_object(everyone, mine, group=self.group)
        if any(other != mine for other in everyone):
            lines = "\n".join(f"  rank {r}: mode {o['mode']}, capture sizes {o['capture_sizes']}, "
                              f"decode sizes {o['decode_sizes']}, tp_all_reduce "
                              f"{o['all_reduce'][0]!r} up to {o['all_reduce'][1]} bytes"
                              for r, o in enumerate(everyone))
            raise RanksDisagree(
                f"the {self.tp.size} tensor-parallel ranks would capture different graphs, and "
                f"the first collective in a graph would wait forever:\n{lines}\nGive every rank "
                "the same CompilationConfig and KVCacheConfig (and the same machine type)")
        logger.info("tensor parallel: %d ranks agree on %d graphs to capture (mode %s)",
                    self.tp.size, len(mine["plan"]), mine["mode"])

    def check_step(self, graph: StepGraph) -> None:
        """Raise if another rank chose another graph for this step."""
        import torch.distributed as dist

        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # an outer capture (a draft loop) records no host check
        mine = torch.tensor([_MODES.index(graph.mode), graph.num_tokens, graph.num_reqs,
                             int(graph.uniform_decode)], dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.tp.size)]
        dist.all_gather(gathered, mine, group=self.group)
        rows = torch.stack(gathered).tolist()  # [rank, (mode, tokens, reqs, uniform)]
        if all(row == rows[self.tp.rank] for row in rows):
            return
        lines = "\n".join(f"  rank {r}: mode {_MODES[m].value}, {t} tokens, {b} requests, "
                          f"uniform decode {bool(u)}" for r, (m, t, b, u) in enumerate(rows))
        raise RanksDisagree(
            f"tensor-parallel ranks chose different graphs for one step, which would "
            f"deadlock at its first collective:\n{lines}\nEvery rank must execute the same "
            "batch each step (same requests, token counts and order): schedule on every rank "
            "from the same inputs, or schedule on rank 0 and broadcast the batch")


def exit_process(code: int) -> NoReturn:
    """Leave a tensor-parallel process now: flush, then `os._exit(code)`,
    without the interpreter's teardown. Note [gloo teardown]: on gloo,
    torch's C++ teardown at exit sometimes aborts after destroy_process_group
    has returned ("terminate called without an active exception", SIGABRT;
    2 in about 90 runs of a two-rank test on the CPU machine, and in CI),
    turning a passing run into a failure. Call it once the group is
    destroyed and the output written; a rank that failed between collectives
    calls it too (code 1), so as not to wait in teardown for the others."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_tensor_parallel(timeout_s: float = 120.0) -> int:
    """End a tensor-parallel run: release every captured graph, free the
    all-reduce's symmetric buffers (the graphs hold their addresses), then
    destroy the default process group. Returns how many graphs were
    released. No collective can run afterwards: call it last.

    Note [graphs before the communicator]: a CUDA graph that captured NCCL
    work keeps its communicator in use, and destroying the process group while
    such a graph is alive waits forever (pytorch/pytorch#115388; seen here on
    2 H200s: every rank hung in destroy_process_group after its last step).
    Dropping the runners is not enough: graphs outlive them (see
    `release_graphs`), so every graph is freed first. Should the destroy
    still not return within `timeout_s`, every thread's stack is printed and
    the process exits (1) rather than hang."""
    import faulthandler

    import torch.distributed as dist

    from compile_backend.runtime.graph_pool import release_graphs

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    released = release_graphs()
    freed = free_symmetric_buffers()
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()
    logger.info("tensor parallel: %d graphs released, %d groups' symmetric buffers freed, "
                "process group destroyed", released, freed)
    return released
