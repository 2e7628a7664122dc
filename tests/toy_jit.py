"""A stand-in for a Triton JIT kernel on the CPU: what the precompiler
(compile_backend/runtime/kernel_precompile.py) uses of a JITFunction, and the
way Triton's `run` asks `triton.knobs.runtime.jit_cache_hook` before it
compiles a specialisation it has not seen (a True answer skips the compile
and the launch). `toy::jit_ahead` runs it, with the configuration taken from
the token count (T == 1, T % 4 == 0), so a plan of sizes needs new kernels
at some sizes and not at others. With DISK_ENV set, compiles leave a file
there that any process's later compile loads instead (a compile worker's)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from types import SimpleNamespace

import torch
from torch import nn

import compile_backend as cb
from compile_backend.runtime import jit_guard


class ToyCompiled:
    def __init__(self, owner: "ToyJit", cfg: tuple) -> None:
        self.owner, self.cfg = owner, cfg

    def _init_handles(self) -> None:  # Triton loads the module here
        self.owner.handles.append((self.cfg, threading.current_thread().name))


class ToyJit:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.cache: dict[tuple, ToyCompiled] = {}
        self.log: list[tuple[tuple, str, bool]] = []  # (cfg, thread, capturing) per compile
        self.handles: list[tuple[tuple, str]] = []
        self.loads: list[tuple] = []  # cfgs loaded from DISK_ENV's folder
        self.delay_s = 0.0
        self.delays: dict[tuple, float] = {}  # a compile's seconds by cfg, where not delay_s
        self.gates: dict[tuple, threading.Event] = {}  # a compile of cfg waits until its gate is set

    def reset(self) -> None:
        """A new process: nothing compiled, nothing logged."""
        self.cache.clear()
        self.log.clear()
        self.handles.clear()
        self.loads.clear()
        self.delays.clear()
        self.gates.clear()

    def preload(self, spec: str) -> ToyCompiled:
        """Compile (log it), or with DISK_ENV set, load what a process wrote
        there before (Triton's disk cache: a compile worker's binary)."""
        cfg = tuple(json.loads(spec))
        disk = os.environ.get(DISK_ENV)
        path = os.path.join(disk, hashlib.sha256(spec.encode()).hexdigest()) if disk else None
        if path is not None and os.path.exists(path):
            self.loads.append(cfg)
        else:
            if cfg in self.gates:
                assert self.gates[cfg].wait(60), f"the gate of {cfg} was never opened"
            time.sleep(self.delays.get(cfg, self.delay_s))
            self.log.append((cfg, threading.current_thread().name, jit_guard.capturing()))
            if path is not None:
                with open(path, "w") as f:
                    json.dump({"cfg": cfg, "pid": os.getpid()}, f)
        kernel = self.cache[cfg] = ToyCompiled(self, cfg)
        return kernel

    def run(self, cfg: tuple) -> bool:
        """True: launched; False: a hook deferred the compile (nothing ran)."""
        if cfg in self.cache:
            return True
        spec = json.dumps(cfg)
        hook = _triton_hook()
        if hook is not None and hook(key=cfg, repr=f"toy_kernel[{cfg}]",
                                     fn=SimpleNamespace(jit_function=self),
                                     compile={"key": cfg, "specialization_data": spec, "device": None},
                                     is_manual_warmup=False, already_compiled=False):
            return False
        self.preload(spec)
        return True


# A folder shared by processes, where a compile leaves its binary: Triton's
# disk cache as the toy has it ({"cfg", "pid"} of the compiling process).
DISK_ENV = "TOY_JIT_DISK"


def compiled_on_disk(folder: str) -> dict[tuple, int]:
    """cfg -> pid of the process that compiled it into `folder`."""
    out = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            entry = json.load(f)
        out[tuple(entry["cfg"])] = entry["pid"]
    return out


def _triton_hook():
    try:
        import triton
    except ImportError:
        return None
    return triton.knobs.runtime.jit_cache_hook


def toy_kernel():  # the kernel's Python function: its name is how a saved list finds it
    pass


toy_kernel = ToyJit(toy_kernel)


def config_of(t: int) -> tuple:
    return (t == 1, t % 4 == 0)


def eager_config_of(t: int) -> tuple:
    """The breakpoint op's: new at a size (4 of 1..16) where the piece's is not."""
    return ("eager", t >= 8)


@torch.library.custom_op("toy::jit_ahead", mutates_args=())
def jit_ahead(x: torch.Tensor) -> torch.Tensor:
    if not toy_kernel.run(config_of(x.shape[0])):
        return torch.full_like(x, float("nan"))  # skipped: the values are never read
    return x * 2 + 1


@jit_ahead.register_fake
def _(x):
    return torch.empty_like(x)


cb.register_capture_safe("toy::jit_ahead")


@torch.library.custom_op("toy::jit_eager", mutates_args=())
def jit_eager(x: torch.Tensor) -> torch.Tensor:
    """The toy kernel as a breakpoint (PIECEWISE runs it eagerly between its
    pieces, as attention), with configurations of its own (eager_config_of)."""
    if not toy_kernel.run(eager_config_of(x.shape[0])):
        return torch.full_like(x, float("nan"))  # skipped: the values are never read
    return x * 3 - 1


@jit_eager.register_fake
def _(x):
    return torch.empty_like(x)


cb.register_op("toy::jit_eager", role="breakpoint", capture_safe=True)


@torch.library.custom_op("toy::jit_prefill", mutates_args=())
def jit_prefill(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A breakpoint op with a configuration of its own for long prefills (a
    token at position 8 or later): what a plan's dummy batches, a few tokens
    a request, never meet."""
    if not toy_kernel.run(("prefill", bool(positions.max() >= 8))):
        return torch.full_like(x, float("nan"))  # skipped: the values are never read
    return x * 0.5 + 2


@jit_prefill.register_fake
def _(x, positions):
    return torch.empty_like(x)


cb.register_op("toy::jit_prefill", role="breakpoint", capture_safe=True)


class ToyStepModel(nn.Module):
    """A runner's model (forward(input_ids, positions) -> logits) whose one
    kernel is the toy op named `op` (torch.ops.toy.<op>)."""

    vocab_size = 64

    def __init__(self, op: str = "jit_ahead", eager_op: bool = False, prefill_op: bool = False):
        super().__init__()
        self.op, self.eager_op, self.prefill_op = op, eager_op, prefill_op
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, input_ids, positions):
        h = self.embed(input_ids) + positions[:, None].float()
        h = getattr(torch.ops.toy, self.op)(self.proj(h))
        if self.eager_op:  # between two pieces in PIECEWISE
            h = self.proj(torch.ops.toy.jit_eager(h))
        if self.prefill_op:
            h = self.proj(torch.ops.toy.jit_prefill(h, positions))
        return self.head(h)


def toy_runner(mode, sizes, cache_dir=None, state=None, eager_op=False, prefill_op=False,
               **options):
    """A new ModelRunner over a new ToyStepModel (CPU, eager pieces), as a
    new process builds it: Dynamo and the counters reset, seed 0, `state`
    loaded when given, `eager_op` / `prefill_op`: the model's toy breakpoint
    ops too. Returns (runner, model)."""
    from compile_backend.runner.model_runner import ModelRunner
    from runtime_helpers import kv_config

    torch._dynamo.reset()
    cb.reset_counters()
    torch.manual_seed(0)
    model = ToyStepModel("jit_ahead", eager_op, prefill_op)
    if state is not None:
        model.load_state_dict(state)
    config = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=sizes, piece_compiler="eager",
                                  cache_dir=cache_dir, **options)
    return ModelRunner(model, kv_config(), config, "cpu", progress=False), model
