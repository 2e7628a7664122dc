"""Keep the token dimension symbolic so that one trace serves every size.

Dynamo specialises a dimension that is 0 or 1 when it first sees it; a decode
step of one token would then trace a second graph. `symbolic_tokens()` turns
on size-oblivious reasoning for the duration of a call (restoring the global
after), and `mark_token_dim` marks an input's token dimension dynamic.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.fx.experimental._config as fx_config


def mark_token_dim(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    import torch._dynamo  # at the first trace, not at import (tests/test_imports.py)

    torch._dynamo.mark_dynamic(t, dim)
    return t


@contextlib.contextmanager
def symbolic_tokens() -> Iterator[None]:
    """Trace with size-oblivious guards: size 1 does not cause a recompile.

    Entered on every PIECEWISE step, so it sets and restores the flag itself:
    `fx_config.patch(...)` builds a class per call (about 3x the cost, tens of
    microseconds of host time a step on the CPU)."""
    old = fx_config.backed_size_oblivious
    fx_config.backed_size_oblivious = True
    try:
        yield
    finally:
        fx_config.backed_size_oblivious = old
