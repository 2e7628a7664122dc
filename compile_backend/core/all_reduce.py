"""Tensor parallelism's all-reduce at the latency limit: a one-shot all-reduce
over symmetric memory for small messages, NCCL for the rest
(`CompilationConfig.tp_all_reduce`, README.md "Tensor parallelism").

  choose_all_reduce       the pure choice per message (size, dtype, capability,
                          threshold, mode): the same on every rank
  setup_all_reduce        collective, eager, outside any capture: the ranks agree
                          (RanksDisagree), then one symmetric buffer per dtype
  run_all_reduce          what `mrv2::all_reduce` runs (compile_backend/kernels/all_reduce.py)
  free_symmetric_buffers  after the graphs are released, before the group is destroyed

"auto" keeps NCCL where one-shot cannot run (logged once, `all_reduce_fallbacks`);
"one_shot" raises. "nccl" is the default until the one-shot path is timed on 2
GPUs. docs/design.md, section "Tensor parallelism's all-reduce".
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from compile_backend.core.config import TP_ALL_REDUCE_MODES
from compile_backend.core.counters import counters
from compile_backend.core.parallel import RanksDisagree, TensorParallel, group_backend

logger = logging.getLogger(__name__)

ONE_SHOT = "one_shot"
NCCL = "nccl"
# The symmetric-memory all-reduce kernels dispatch float32 and bfloat16 only.
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)
# Messages and offsets are multiples of 16 bytes: the kernels' widest vector
# width, and their input and buffer must share one alignment.
ALIGN = 16
MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


def check_mode(mode: str) -> str:
    if mode not in TP_ALL_REDUCE_MODES:
        raise ValueError(f"tp_all_reduce must be one of "
                         f"{', '.join(map(repr, TP_ALL_REDUCE_MODES))}, got {mode!r}")
    return mode


def choose_all_reduce(nbytes: int, dtype: torch.dtype, *, mode: str, capable: bool,
                      threshold: int) -> str:
    """The algorithm for one message of `nbytes` bytes of `dtype`: "one_shot"
    or "nccl". `capable`: symmetric buffers are set up for the group (the
    ranks agreed on that). Pure; the same inputs on every rank give the same
    answer on every rank."""
    check_mode(mode)
    if mode == NCCL or not capable or dtype not in ONE_SHOT_DTYPES:
        return NCCL
    if nbytes <= 0 or nbytes % ALIGN or nbytes > threshold:
        return NCCL
    return ONE_SHOT


@dataclass
class SymmetricAllReduce:
    """One group's symmetric buffers, rendezvoused: `threshold` bytes per dtype."""

    group_name: str
    threshold: int
    buffers: dict[torch.dtype, torch.Tensor]
    handles: list[Any] = field(default_factory=list)  # the rendezvous handles, kept alive
    copy_in_kernel: bool = True  # one_shot_all_reduce_copy_out exists (one launch)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, one-shot, on the current stream.
        The caller checked `choose_all_reduce(...) == "one_shot"`."""
        x = x.contiguous()
        view = self.buffers[x.dtype][: x.numel()].view(x.shape)
        out = torch.empty_like(x)
        ops = torch.ops.symm_mem
        if self.copy_in_kernel:
            if (x.storage_offset() * x.element_size()) % ALIGN:
                x = x.clone()  # the input's alignment must be the buffer's
            ops.one_shot_all_reduce_copy_out(view, x, "sum", self.group_name, out)
        else:
            view.copy_(x)
            ops.one_shot_all_reduce_out(view, "sum", self.group_name, out)
        return out


_READY: dict[str, SymmetricAllReduce] = {}
_RETIRED: list[SymmetricAllReduce] = []  # replaced by a larger one; graphs may still hold them
_FALLBACKS: dict[str, str] = {}  # group name -> why one-shot cannot run there
_LOGGED: set[str] = set()


def symmetric_all_reduce(group_name: str) -> SymmetricAllReduce | None:
    """The group's set-up buffers (None: every all-reduce on it runs on NCCL)."""
    return _READY.get(group_name)


def ready_groups() -> list[str]:
    return sorted(_READY)


def fallback_reason(group_name: str) -> str | None:
    """Why setup_all_reduce left the group on NCCL (None: it was not asked)."""
    return _FALLBACKS.get(group_name)


def log_fallback_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning("mrv2 tp_all_reduce: NCCL all-reduce: %s", reason)


def run_all_reduce(x: torch.Tensor, threshold: int, group_name: str) -> torch.Tensor:
    """What `mrv2::all_reduce` does (compile_backend/kernels/all_reduce.py): the sum of `x`
    over the group, one-shot where `choose_all_reduce` says so, else the
    functional collective (NCCL, or gloo on the CPU)."""
    state = _READY.get(group_name)
    if state is not None and x.is_cuda:
        nbytes = x.numel() * x.element_size()
        if choose_all_reduce(nbytes, x.dtype, mode="auto", capable=True,
                             threshold=min(threshold, state.threshold)) == ONE_SHOT:
            return state.one_shot(x)
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x.contiguous(), "sum", group_name))


# ---- setup and teardown ------------------------------------------------------------


def local_capability(group_name: str) -> str | None:
    """Why this process cannot run a one-shot all-reduce on the group (None:
    it can, as far as one process can tell; peer access is checked across
    ranks by setup_all_reduce). Feature-detected, never assumed."""
    backend = group_backend(group_name)
    if backend is None or "nccl" not in backend:
        return (f"process group {group_name!r} has backend {backend!r}; the one-shot "
                "all-reduce needs CUDA tensors on an NCCL group")
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch.distributed._symmetric_memory cannot be imported ({e})"
    missing = [name for name in ("empty", "rendezvous") if not hasattr(symm_mem, name)]
    if not _has_op("one_shot_all_reduce_out"):
        missing.append("torch.ops.symm_mem.one_shot_all_reduce_out")
    if missing:
        return f"this torch ({torch.__version__}) lacks {', '.join(missing)}"
    if torch.cuda.is_current_stream_capturing():
        return "set up inside a CUDA graph capture (the rendezvous must run eagerly)"
    return None


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.symm_mem, name).default
    except (AttributeError, RuntimeError):
        return False
    return True


def _gather(tp: TensorParallel, mine: Any) -> list[Any]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    everyone: list[Any] = [None] * tp.size
    dist.all_gather_object(everyone, mine, group=_resolve_process_group(tp.group_name))
    return everyone


def _peer_reason(me: dict, everyone: list[dict]) -> str | None:
    if me["device"] < 0:
        return "no CUDA device"
    if len({o["host"] for o in everyone}) > 1:
        return "the ranks are on more than one host (one-shot reads peers' memory)"
    devices = [o["device"] for o in everyone]
    if len(set(devices)) < len(devices):
        return (f"the ranks name their GPUs {devices} (one process per visible GPU set?): "
                "peer access cannot be checked")
    for peer in devices:
        if peer != me["device"] and not torch.cuda.can_device_access_peer(me["device"], peer):
            return f"GPU {me['device']} has no peer access to GPU {peer}"
    return None


def setup_all_reduce(tp: TensorParallel, mode: str, threshold: int) -> SymmetricAllReduce | None:
    """Collective over `tp`'s group (every rank calls it, eagerly, outside any
    capture): agree on mode, threshold and capability, then allocate and
    rendezvous the symmetric buffers. Returns them, or None when every
    all-reduce stays on NCCL ("nccl", 1 rank, or "auto" without the
    capability: the reason is logged once). Raises RanksDisagree when the
    ranks differ in mode, threshold or capability, and RuntimeError for
    "one_shot" without the capability."""
    check_mode(mode)
    if tp.size == 1:
        return None
    group = tp.group_name
    reason = None if mode == NCCL else local_capability(group)
    me = {"mode": mode, "threshold": threshold, "host": socket.gethostname(),
          "device": torch.cuda.current_device() if torch.cuda.is_available() else -1}
    everyone = _gather(tp, me)
    if any((o["mode"], o["threshold"]) != (mode, threshold) for o in everyone):
        raise RanksDisagree(
            "tensor-parallel ranks disagree on the all-reduce, and a graph whose ranks "
            "run different collectives waits forever:\n"
            + "\n".join(f"  rank {r}: tp_all_reduce={o['mode']!r}, "
                        f"tp_all_reduce_threshold={o['threshold']}" for r, o in enumerate(everyone))
            + "\nGive every rank the same CompilationConfig")
    if mode == NCCL:
        return None
    if reason is None:
        reason = _peer_reason(me, everyone)
    verdicts = _gather(tp, reason)
    if len({v is None for v in verdicts}) > 1:
        raise RanksDisagree(
            "tensor-parallel ranks disagree on whether the one-shot all-reduce can run "
            "(each would pick a different algorithm for the same message):\n"
            + "\n".join(f"  rank {r}: {'capable' if v is None else v}" for r, v in enumerate(verdicts))
            + "\nRun every rank on the same kind of machine and torch, or use tp_all_reduce='nccl'")
    if reason is not None:
        if mode == ONE_SHOT:
            raise RuntimeError(f"tp_all_reduce='one_shot' cannot run: {reason}. Use "
                               "tp_all_reduce='auto' to fall back to NCCL there, or 'nccl'")
        _FALLBACKS[group] = reason
        log_fallback_once(reason)
        return None
    existing = _READY.get(group)
    if existing is not None and existing.threshold >= threshold:
        return existing
    state = _allocate(tp, threshold)
    if existing is not None:
        _RETIRED.append(existing)
    _READY[group] = state
    _FALLBACKS.pop(group, None)
    logger.info("mrv2 tp_all_reduce=%r: one-shot all-reduce for messages up to %d bytes on "
                "group %r (%d ranks), NCCL above", mode, threshold, group, tp.size)
    return state


def _allocate(tp: TensorParallel, threshold: int) -> SymmetricAllReduce:
    import torch.distributed._symmetric_memory as symm_mem

    # The one-shot path reads peers' buffers; it never uses NVLink multicast.
    os.environ.setdefault(MULTICAST_ENV, "1")
    nbytes = -(-threshold // ALIGN) * ALIGN
    device = torch.device("cuda", torch.cuda.current_device())
    buffers: dict[torch.dtype, torch.Tensor] = {}
    error = None
    try:  # local: every rank learns of a failure before any rendezvous
        for dtype in ONE_SHOT_DTYPES:
            buffers[dtype] = symm_mem.empty(nbytes // dtype.itemsize, dtype=dtype, device=device)
    except Exception as e:  # noqa: BLE001 (reported on every rank below)
        error = f"{type(e).__name__}: {e}"
    errors = _gather(tp, error)
    if any(errors):
        raise RuntimeError("symmetric-memory allocation failed:\n" + "\n".join(
            f"  rank {r}: {e or 'ok'}" for r, e in enumerate(errors))
            + "\nUse tp_all_reduce='nccl'")
    handles = [symm_mem.rendezvous(buffers[dtype], tp.group_name) for dtype in ONE_SHOT_DTYPES]
    torch.cuda.synchronize()
    return SymmetricAllReduce(tp.group_name, nbytes, buffers, handles,
                              copy_in_kernel=_has_op("one_shot_all_reduce_copy_out"))


def free_symmetric_buffers() -> int:
    """Drop every group's symmetric buffers (after the graphs that read them,
    before the process group: `end_tensor_parallel`). Returns how many
    groups' buffers were dropped."""
    states = list(_READY.values()) + _RETIRED
    if states and torch.cuda.is_available():
        torch.cuda.synchronize()  # no kernel still reads them
    _READY.clear()
    _RETIRED.clear()
    _FALLBACKS.clear()
    n = len(states)
    del states
    return n
