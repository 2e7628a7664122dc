"""Tensor parallelism's all-reduce as one op: `mrv2::all_reduce`.

    all_reduce(x, threshold, group_name) == sum of x over the group's ranks

The pass compile_backend/passes/symmetric_all_reduce.py writes it in place of the functional
collective (`_c10d_functional.all_reduce` + `wait_tensor`) when
`CompilationConfig.tp_all_reduce` asks for it and the group has symmetric
buffers (compile_backend/core/all_reduce.py, `setup_all_reduce`). At each
call it picks, per message (`choose_all_reduce`: size against `threshold`
and the buffer, dtype): a one-shot all-reduce over the symmetric buffers on
the current stream, or the functional collective (in a CUDA graph: at
capture, and the replay repeats it). Declared a collective (never a split
point; the capture-safety pass checks its group, its last string argument,
like the functional collective's) and capture-safe.
"""

from __future__ import annotations

import torch

from compile_backend.core.all_reduce import run_all_reduce
from compile_backend.core.op_definition import define_op
from compile_backend.core.op_registry import register_op


@define_op("mrv2::all_reduce")
def all_reduce(x: torch.Tensor, threshold: int, group_name: str) -> torch.Tensor:
    """The sum of `x` over the ranks of `group_name` (a new tensor)."""
    return run_all_reduce(x, threshold, group_name)


register_op("mrv2::all_reduce", role="collective", capture_safe=True)


@torch.library.register_fake("mrv2::all_reduce")
def _(x, threshold, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
