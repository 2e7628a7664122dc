"""Graph modes in one place: the modes a user asks for (CUDAGraphMode), what
a metadata builder can be captured in (CaptureSupport), how the two meet
(lower_graph_mode), and the graph one step runs in, decided once per step
and once per capture (StepGraph, with its BatchDescriptor key).

Torch-free: the config and the CLI read it without loading torch.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

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


class BatchDescriptor(NamedTuple):
    """The small hashable key that picks a CUDA graph."""

    num_tokens: int  # padded token count (a capture size)
    num_reqs: int | None = None  # FULL graphs only: padded request count
    uniform_decode: bool = False  # every request has exactly one query token

    def relaxed(self) -> "BatchDescriptor":
        """The key a PIECEWISE graph is stored under: token count alone."""
        return BatchDescriptor(self.num_tokens)


RUNTIME_MODES = (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


@dataclass(frozen=True)
class StepGraph:
    """The graph one step runs in (or one capture records), decided once:
    by `ModelRunner.dispatch` for a step, by the capture plan for a capture.
    The batch is padded to it, builders read it (through `InputBatch.graph`),
    the forward context and the draft loop key their graphs by it.

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

    @classmethod
    def eager(cls, num_tokens: int, num_reqs: int) -> "StepGraph":
        """A step without a graph (mode NONE) at these padded sizes."""
        return cls(CUDAGraphMode.NONE, num_tokens, num_reqs)

    @property
    def for_capture(self) -> bool:
        """Metadata must hold for any batch of this size (docs/design_notes.md,
        "Metadata builders"): the attention kernels are inside the graph."""
        return self.mode is CUDAGraphMode.FULL

    @property
    def descriptor(self) -> BatchDescriptor | None:
        """The graph's key: FULL graphs by (tokens, requests, uniform decode),
        PIECEWISE by tokens alone, none without a graph."""
        if self.mode is CUDAGraphMode.FULL:
            return BatchDescriptor(self.num_tokens, self.num_reqs, self.uniform_decode)
        if self.mode is CUDAGraphMode.PIECEWISE:
            return BatchDescriptor(self.num_tokens)
        return None
