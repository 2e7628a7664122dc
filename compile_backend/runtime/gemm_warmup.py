"""cuBLAS's first call of each GEMM problem, made beside a warm start's load.

cuBLAS spends about 2 ms of host time on a process's first call of each GEMM
problem (op, shape, strides, dtype), in a capture or out; a warm llama8b
capture makes hundreds. A runner records one eager step's GEMMs (token rows
marked) beside its warm-start entry; a later start runs them at every
capture size on a thread while its first step loads, in one TorchScript
call, which holds no interpreter lock (docs/design.md, "cuBLAS's first
calls, beside the load").

    problems = record(lambda: step(T), num_tokens=T)     # [GemmProblem]
    run = start(problems, sizes, donors, device)         # a thread
    ...                                                  # the first step loads
    run.join()                                           # before any capture
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import warnings
from typing import Any, Callable, Iterable

import torch

logger = logging.getLogger(__name__)

DEVICES = ("cuda",)  # where a runner warms GEMMs (cuBLAS's first-call cost; tests add "cpu")
TOKENS = "T"  # a dimension that is the step's token count, in a saved problem
OPS = ("mm", "addmm", "bmm")  # the cuBLAS-bound aten ops recorded (their index: the script's op code)
# The dtypes recorded (cuBLAS GEMMs), by their saved names.
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
           torch.float64: "float64"}


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """One GEMM call: `op` in OPS, its tensor operands' shapes (TOKENS where
    a size was the step's token count) and strides (None: contiguous, taken
    again for each size), dtype name, and addmm's beta and alpha."""

    op: str
    dtype: str
    shapes: tuple[tuple[int | str, ...], ...]
    strides: tuple[tuple[int, ...] | None, ...]
    beta: float = 1.0
    alpha: float = 1.0

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "dtype": self.dtype, "shapes": [list(s) for s in self.shapes],
                "strides": [None if s is None else list(s) for s in self.strides],
                "beta": self.beta, "alpha": self.alpha}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "GemmProblem":
        shapes = tuple(tuple(x if x == TOKENS else int(x) for x in s) for s in d["shapes"])
        strides = tuple(None if s is None else tuple(int(x) for x in s) for s in d["strides"])
        ranks = {"mm": (2, 2), "addmm": ((1, 2), 2, 2), "bmm": (3, 3)}.get(d["op"])
        if (ranks is None or _dtype(d["dtype"]) is None or len(shapes) != len(ranks)
                or len(strides) != len(ranks)
                or not all(len(s) in (r if isinstance(r, tuple) else (r,)) for s, r in zip(shapes, ranks))
                or any(st is not None and len(st) != len(s) for s, st in zip(shapes, strides))
                or any(x != TOKENS and x < 1 for s in shapes for x in s)
                or any(x < 0 for st in strides if st is not None for x in st)):
            raise ValueError(f"not a GEMM problem: {d!r}")
        return cls(d["op"], d["dtype"], shapes, strides, float(d["beta"]), float(d["alpha"]))

    def sizes_at(self, num_tokens: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(shape, strides) of each operand at `num_tokens` tokens."""
        out = []
        for shape, stride in zip(self.shapes, self.strides):
            s = tuple(num_tokens if x == TOKENS else x for x in shape)
            out.append((s, stride if stride is not None else _contiguous(s)))
        return out


def _dtype(name: str) -> torch.dtype | None:
    return next((d for d, n in _DTYPES.items() if n == name), None)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def _elements(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Storage elements a view of `shape` and `stride` reaches."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


# ---- recording ---------------------------------------------------------------


def can_record() -> bool:
    """False while another profiler runs (they do not nest)."""
    return not torch.autograd.profiler._is_profiler_enabled


def record(step: Callable[[], Any], num_tokens: int) -> list[GemmProblem]:
    """The GEMM problems `step` asks cuBLAS for (also those inside custom
    ops), each once, in order; a size equal to `num_tokens` in a row
    operand (mm/addmm's input and addmm's added matrix, bmm's middle
    dimension) is marked TOKENS. Runs `step` under torch's profiler (host
    events with their inputs' sizes, strides and dtypes: the profiler's
    event tree, which torch 2.11 and 2.13 both have)."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
    out: dict[GemmProblem, int] = {}  # problem: the start of its first call
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.name.startswith("aten::") and e.name[6:] in OPS:
            p = _problem(e.name[6:], list(e.extra_fields.inputs), num_tokens)
            if p is not None:
                out[p] = min(out.get(p, e.start_time_ns), e.start_time_ns)
    return sorted(out, key=out.__getitem__)  # in the step's order


def _problem(op: str, inputs: list, num_tokens: int) -> GemmProblem | None:
    """The problem of one recorded call; None where an operand is
    not a tensor of a dtype cuBLAS takes, or its layout changes with the
    token count."""
    n = 3 if op == "addmm" else 2
    tensors = inputs[:n]
    if len(tensors) < n or not all(hasattr(t, "sizes") and hasattr(t, "strides") for t in tensors):
        return None
    dtype = tensors[0].dtype
    if dtype not in _DTYPES or any(t.dtype is not dtype for t in tensors):
        return None
    # The operands whose leading size is the token count: mm's and addmm's
    # mat1 [M, K] and addmm's [M, N] input; bmm's [B, M, K] rows are dim 1.
    rows = {"mm": {0: 0}, "addmm": {0: 0, 1: 0}, "bmm": {0: 1}}[op]
    marked_shapes, kept_strides = [], []
    for i, t in enumerate(tensors):
        shape, stride = list(t.sizes), tuple(t.strides)
        if not shape or len(stride) != len(shape):
            return None
        dim = rows.get(i)
        if op == "addmm" and i == 0 and len(shape) != 2:
            dim = None  # a bias [N]
        if dim is not None and shape[dim] == num_tokens:
            contiguous = stride == _contiguous(tuple(shape))
            # Else only rows of a wider buffer ([M, K], row stride >= K): no
            # stride of theirs changes with M.
            if not contiguous and not (len(shape) == 2 and stride[1] == 1 and stride[0] >= shape[1]):
                return None
            shape[dim] = TOKENS
            kept_strides.append(None if contiguous else stride)
        else:
            kept_strides.append(stride)
        marked_shapes.append(tuple(shape))
    beta = alpha = 1.0
    if op == "addmm":
        beta, alpha = (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 1.0
                       for v in (list(inputs[3:5]) + [None, None])[:2])
    return GemmProblem(op, _DTYPES[dtype], tuple(marked_shapes), tuple(kept_strides), beta, alpha)


# ---- running -----------------------------------------------------------------


def _run_problems(ops: list[int], a: list[torch.Tensor], b: list[torch.Tensor],
                  c: list[torch.Tensor], beta: list[float], alpha: list[float]) -> int:
    n = 0
    for i in range(len(ops)):
        if ops[i] == 0:
            y = torch.mm(a[i], b[i])
        elif ops[i] == 1:
            y = torch.addmm(c[i], a[i], b[i], beta=beta[i], alpha=alpha[i])
        else:
            y = torch.bmm(a[i], b[i])
        n += y.size(0)  # used: the script keeps the call
    return n


_scripted: Any = None
_script_lock = threading.Lock()


def _script() -> Any:
    """_run_problems in TorchScript (made once a process): its call runs
    without the interpreter lock."""
    global _scripted
    with _script_lock:
        if _scripted is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.jit.script's deprecation
                _scripted = torch.jit.script(_run_problems)
        return _scripted


class Warmup:
    """A background run of GEMM problems (start()); join() before a capture."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.seconds = 0.0  # the thread's wall time
        self.wait_s = 0.0  # the caller's wait in join()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def join(self) -> "Warmup":
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self.wait_s = time.perf_counter() - t0
            self._thread = None
            if self.error is not None:
                logger.warning("mrv2: the GEMM warm-up stopped (%s: %s); the capture "
                               "makes cuBLAS's first calls itself", type(self.error).__name__,
                               self.error)
        return self

    def stats(self) -> dict[str, Any]:
        return {"gemm_warmup_calls": self.calls, "gemm_warmup_s": round(self.seconds, 4),
                "gemm_warmup_wait_s": round(self.wait_s, 4),
                "gemm_warmup_error": None if self.error is None else repr(self.error)}


def start(problems: list[GemmProblem], sizes: Iterable[int], donors: Iterable[torch.Tensor],
          device: torch.device | str) -> Warmup:
    """Runs every problem at every size in `sizes` (problems without TOKENS
    once) on `device`, on the caller's current stream, from a new thread.
    Operands are views of a
    donor tensor of their dtype with enough elements (a weight: read only)
    or of one scratch buffer per dtype; outputs are new and dropped."""
    device = torch.device(device)
    try:
        calls = _calls(problems, sizes, donors, device)
    except (RuntimeError, ValueError) as e:  # a saved list this machine cannot hold (memory)
        run = Warmup(0)
        run.error = e
        logger.warning("mrv2: no GEMM warm-up (%s: %s); the capture makes cuBLAS's first calls",
                       type(e).__name__, e)
        return run
    run = Warmup(len(calls[0]))
    if not calls[0]:
        return run
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else -1
    stream = torch.cuda.current_stream(index) if cuda else None
    fn = _script()

    def body() -> None:
        t0 = time.perf_counter()
        try:
            if cuda:  # a new thread has no current device (cuBLAS would warn and pick one)
                torch.cuda.set_device(index)
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                fn(*calls)
        except BaseException as e:  # noqa: BLE001 - reported at join; the capture pays instead
            run.error = e
        finally:
            run.seconds = time.perf_counter() - t0

    run._thread = threading.Thread(target=body, name="mrv2-gemm-warmup", daemon=True)
    run._thread.start()
    return run


def _calls(problems: list[GemmProblem], sizes: Iterable[int], donors: Iterable[torch.Tensor],
           device: torch.device) -> tuple[list, ...]:
    """The script's arguments: op codes, a, b, c operands (views), beta, alpha."""
    views: list[tuple[int, list[tuple[tuple[int, ...], tuple[int, ...]]], torch.dtype, float, float]] = []
    need: dict[torch.dtype, int] = {}
    sizes = sorted(set(sizes), reverse=True)
    for p in problems:
        dtype = _dtype(p.dtype)
        generic = any(TOKENS in s for s in p.shapes)
        for t in (sizes if generic else sizes[:1]):
            ops = p.sizes_at(t)
            views.append((OPS.index(p.op), ops, dtype, p.beta, p.alpha))
            need[dtype] = max([need.get(dtype, 0)] + [_elements(s, st) for s, st in ops])
    bases = _bases(need, donors, device)
    ops_, a, b, c, beta, alpha = [], [], [], [], [], []
    for code, operands, dtype, be, al in views:
        base = bases[dtype]
        ts = [base.as_strided(s, st) for s, st in operands]
        if code == 1:
            c.append(ts[0]); a.append(ts[1]); b.append(ts[2])  # noqa: E702
        else:
            a.append(ts[0]); b.append(ts[1]); c.append(ts[0])  # noqa: E702
        ops_.append(code); beta.append(be); alpha.append(al)  # noqa: E702
    return ops_, a, b, c, beta, alpha


def _bases(need: dict[torch.dtype, int], donors: Iterable[torch.Tensor],
           device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    """A flat tensor per dtype with at least need[dtype] elements: a donor's
    storage (contiguous, on `device`) where one is large enough, else new."""
    out: dict[torch.dtype, torch.Tensor] = {}
    for t in donors:
        if (t.dtype in need and t.dtype not in out and t.device == device
                and t.is_contiguous() and t.numel() >= need[t.dtype]):
            out[t.dtype] = t.detach().reshape(-1)
    for dtype, n in need.items():
        if dtype not in out:
            out[dtype] = torch.empty(max(n, 1), dtype=dtype, device=device)
    return out


def dumps(problems: list[GemmProblem]) -> list[dict[str, Any]]:
    return [p.to_json() for p in problems]


def loads(data: Any) -> list[GemmProblem]:
    """Problems from their saved form; [] (logged) when it does not parse."""
    try:
        return [GemmProblem.from_json(d) for d in data]
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("mrv2: the saved GEMM list does not parse (%s); none warmed", e)
        return []

