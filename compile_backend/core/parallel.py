"""Tensor parallelism's process group: which rank this process is, among how
many, and the one collective a tensor-parallel model needs (a sum across ranks).

One process per GPU, started by `torchrun`; `init_from_env()` makes the
default group from torchrun's environment (NCCL on CUDA, gloo on the CPU) and
binds the process to its GPU (LOCAL_RANK). A model asks `TensorParallel.current()`
for its rank and size; with no process group, or `size=1`, it is 1 rank and
`all_reduce` is the identity (no collective, nothing in the graph).

The sum is `torch.distributed._functional_collectives.all_reduce`, which Dynamo
traces into the FX graph, inside captured pieces (NCCL work can be captured;
gloo work cannot). Every rank must run the same graph each step or the
collectives deadlock: compile_backend/runner/parallel.py checks (docs/design.md,
section "Tensor parallelism: every rank replays the same graph").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

class RanksDisagree(RuntimeError):
    """Ranks of one tensor-parallel group would run different graphs (or
    different collectives: compile_backend/core/all_reduce.py)."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group. Frozen and hashable:
    Dynamo reads its fields as constants."""

    size: int = 1
    rank: int = 0
    group_name: str | None = None  # None when size == 1: no collective is made

    def __post_init__(self) -> None:
        assert self.size >= 1 and 0 <= self.rank < self.size, (self.rank, self.size)
        assert (self.group_name is None) == (self.size == 1), (self.size, self.group_name)

    @classmethod
    def current(cls, size: int | None = None) -> "TensorParallel":
        """The default process group's rank and size. `size=None`: all of its
        ranks (1 without a process group); `size=1`: this process alone (a
        whole, unsharded model, even inside a larger group). Any other size
        must be the group's, which is what torchrun started."""
        world = _world()
        if size is None:
            size = world.size
        _check_size(size)
        if size == 1:
            return cls()
        if size != world.size:
            started = (f"{world.size} processes were started" if world.size > 1
                       else "no process group is initialised")
            raise ValueError(
                f"tensor-parallel size {size} needs {size} processes, one per GPU, but {started}. "
                f"Start one process per rank: torchrun --nproc-per-node {size} ... (then "
                "compile_backend.core.parallel.init_from_env()), or use size 1")
        return world

    def shard(self, n: int) -> int:
        """This rank's part of a dimension of `n` (n is divisible: checked by the model)."""
        assert n % self.size == 0, (n, self.size)
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks; `x` itself on one rank (no collective)."""
        if self.size == 1:
            return x
        if torch.compiler.is_compiling():  # Dynamo: all_reduce + wait_tensor nodes
            import torch.distributed._functional_collectives as funcol  # loads Dynamo

            return funcol.all_reduce(x, "sum", self.group_name)
        # Eager: the same two ops, waited at once (funcol would hand out a lazy
        # wrapper subclass, which the CPU graph stand-in cannot hold).
        ops = torch.ops._c10d_functional
        return ops.wait_tensor(ops.all_reduce(x, "sum", self.group_name))


def _world() -> TensorParallel:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return TensorParallel()
    group = dist.group.WORLD
    return TensorParallel(size=dist.get_world_size(), rank=dist.get_rank(),
                          group_name=group.group_name)


def _check_size(size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor-parallel size must be a positive int, got {size!r}")


def check_divides(size: int, **dims: int) -> None:
    """Raise, with the sizes that would work, if `size` does not divide every
    one of `dims` (name -> length), e.g. heads and KV heads of a model."""
    _check_size(size)
    bad = {name: n for name, n in dims.items() if n % size}
    if not bad:
        return
    common = math.gcd(*dims.values())
    valid = [d for d in range(1, common + 1) if common % d == 0]
    listed = ", ".join(f"{name}={n}" for name, n in dims.items())
    raise ValueError(
        f"tensor-parallel size {size} does not divide {', '.join(bad)} ({listed}): each rank "
        f"holds an equal share of every one of them. Use a tensor-parallel size among {valid} "
        "(start that many processes: torchrun --nproc-per-node N), or a model whose sizes "
        f"{size} divides")


def group_backend(group_name: str) -> str | None:
    """The backend ("nccl", "gloo", ...) of a process group given by name, or
    None if no such group exists in this process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError):
        return None
    return str(dist.get_backend(group)).lower()


def init_from_env(timeout_s: float = 600.0) -> TensorParallel:
    """Make the default process group from torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): NCCL when CUDA is there, gloo
    otherwise; on CUDA the process is bound to GPU LOCAL_RANK first. Returns
    this process's TensorParallel (1 rank when not started by torchrun). An
    existing group is kept."""
    import datetime

    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return _world()
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK {local} has no GPU: this machine has {torch.cuda.device_count()}; "
                    "start at most that many processes per node (torchrun --nproc-per-node)")
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
            # device_id: the communicator is made now, not at the first
            # collective (which may come inside a graph capture).
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return _world()
