"""Graph modes in one place: the modes a user asks for (CUDAGraphMode), what
a metadata builder can be captured in (CaptureSupport), how the two meet
(lower_graph_mode), and the graph one step runs in, decided once per step
and once per capture (StepGraph: the one value of "which graph" that the
forward context carries, builders read, wrappers and the draft loop key
their graphs by, and capture records keep).

Torch-free: the config and the CLI read it without loading torch.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

logger = logging.getLogger(__name__)


class CUDAGraphMode(enum.Enum):
    """Graph modes (README.md, "Options": `cudagraph_mode`)."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @classmethod
    def parse(cls, value: "str | CUDAGraphMode") -> "CUDAGraphMode":
        """Case-insensitive; accepts `-` for `_` ("full-and-piecewise")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            for mode in cls:
                if mode.value == key:
                    return mode
        raise ValueError(
            f"unknown cudagraph mode {value!r}; valid modes: "
            f"{', '.join(m.value for m in cls)} (case-insensitive)"
        )

    # What each top-level mode needs captured.
    @property
    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_full(self) -> bool:
        return self in (
            CUDAGraphMode.FULL,
            CUDAGraphMode.FULL_DECODE_ONLY,
            CUDAGraphMode.FULL_AND_PIECEWISE,
        )


class CaptureSupport(enum.IntEnum):
    """What graphs a metadata builder's output can be captured in."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


def lower_graph_mode(
    requested: CUDAGraphMode, builders: Sequence[Any]
) -> tuple[CUDAGraphMode, str | None]:
    """The most the builders allow of `requested`, and why it was lowered.
    A builder is anything with `kind`, `capture_support` and `attention_like`
    (an instance or the class)."""
    for b in builders:
        if b.attention_like and b.capture_support is not CaptureSupport.ALWAYS:
            raise ValueError(
                f"the {b.kind!r} metadata builder serves attention-like ops, which run "
                f"inside captured graphs in every mode, but declares capture support "
                f"{b.capture_support.name}; it must build capturable metadata always "
                "(CaptureSupport.ALWAYS) or its op must be registered as a breakpoint"
            )
    attention = [b for b in builders if not b.attention_like]
    if not attention or not requested.has_full:
        return requested, None
    weakest = min(attention, key=lambda b: b.capture_support)
    support = weakest.capture_support
    lowered = requested
    if support is CaptureSupport.NEVER:
        lowered = (CUDAGraphMode.NONE if requested is CUDAGraphMode.FULL_DECODE_ONLY
                   else CUDAGraphMode.PIECEWISE)
    elif support < CaptureSupport.ALWAYS and requested is CUDAGraphMode.FULL:
        lowered = CUDAGraphMode.FULL_AND_PIECEWISE
    if lowered is requested:
        return requested, None
    reason = (
        f"graph mode lowered from {requested.value} to {lowered.value}: the "
        f"{weakest.kind!r} metadata builder supports capture {support.name}"
    )
    logger.warning("%s", reason)
    return lowered, reason


RUNTIME_MODES = (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


@dataclass(frozen=True)
class StepGraph:
    """The graph one step runs in (or one capture records), decided once:
    by the dispatch rule for a step, by the capture plan for a capture
    (core/graph_plan.py). The batch is padded to it, builders read it
    (through `InputBatch.graph`: `for_capture` is its `for_capture`), the
    forward context carries it, CUDA-graph wrappers and the draft loop hold
    their graphs under its `key`, and capture records keep it.

    mode: NONE (eager pieces), PIECEWISE or FULL.
    uniform_decode: a FULL graph that serves one-token-per-request batches
        only, so its metadata may bake in max_query_len = 1. A dummy batch of
        T tokens over T requests looks like decode either way: only this
        flag says which graph it is captured for.
    """

    mode: CUDAGraphMode
    num_tokens: int  # padded tokens
    num_reqs: int  # padded requests
    uniform_decode: bool = False

    def __post_init__(self) -> None:
        assert self.mode in RUNTIME_MODES, f"{self.mode} is not a runtime mode"
        assert self.num_tokens >= 0 and self.num_reqs >= 0, self
        if self.uniform_decode and self.mode is not CUDAGraphMode.FULL:
            raise ValueError(
                f"uniform_decode marks a FULL graph that serves decode batches only; a "
                f"{self.mode.value} step serves any batch of its size. Pass "
                "uniform_decode=False, or capture a FULL graph")
        if self.uniform_decode and self.num_tokens != self.num_reqs:
            raise ValueError(
                f"a uniform-decode graph holds one token per request, got "
                f"{self.num_tokens} tokens over {self.num_reqs} requests")
        # The key a wrapper holds this step's graph under, computed once (a
        # wrapper reads it on every call of every piece): PIECEWISE graphs by
        # token count alone (pieces see tokens, not requests), FULL graphs by
        # (tokens, requests, uniform decode), no graph: None.
        key: Hashable = None
        if self.mode is CUDAGraphMode.FULL:
            key = (self.num_tokens, self.num_reqs, self.uniform_decode)
        elif self.mode is CUDAGraphMode.PIECEWISE:
            key = self.num_tokens
        object.__setattr__(self, "key", key)

    @classmethod
    def eager(cls, num_tokens: int, num_reqs: int) -> "StepGraph":
        """A step without a graph (mode NONE) at these padded sizes."""
        return cls(CUDAGraphMode.NONE, num_tokens, num_reqs)

    @classmethod
    def full_decode(cls, num_reqs: int) -> "StepGraph":
        """The FULL graph of `num_reqs` one-token requests."""
        return cls(CUDAGraphMode.FULL, num_reqs, num_reqs, uniform_decode=True)

    @property
    def for_capture(self) -> bool:
        """Metadata must hold for any batch of this size (docs/design.md,
        "The metadata contract"): the attention kernels are inside the graph."""
        return self.mode is CUDAGraphMode.FULL

    def summary(self) -> dict[str, Any]:
        """JSON-friendly view (capture records, the debug manifest)."""
        return {"mode": self.mode.value, "num_tokens": self.num_tokens,
                "num_reqs": self.num_reqs, "uniform_decode": self.uniform_decode}
