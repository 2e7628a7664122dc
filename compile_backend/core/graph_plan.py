"""Which graphs a runner captures and which one a batch runs in: pure rules
over a lowered graph mode and the capture sizes (no torch, no state), so
the runner, the draft loop and tests read one definition (docs/design.md,
"Graph modes, and the one value of which graph").

    plan = GraphPlan(CUDAGraphMode.FULL_AND_PIECEWISE, capture_sizes=(1, 2, 4, 8),
                     max_num_reqs=4)
    plan.captures()                 # PIECEWISE 8, 4, 2, 1; FULL decode 4, 2, 1
    GraphPlan(CUDAGraphMode.FULL, (1, 2, 4, 8), 4).captures()
                                    # FULL 8, decode 4, FULL 4, decode 2, FULL 2, ...
    plan.dispatch(3, 3, uniform_decode=True)   # (StepGraph FULL 4x4 decode, None)
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph

# Why dispatch gave a batch no graph (the runner counts these).
NO_GRAPH_TOO_LARGE = "eager_no_graph"  # more tokens than every capture size
NO_GRAPH_MIXED = "eager_mixed_batch"  # FULL_DECODE_ONLY and a batch that is not decode


@dataclass(frozen=True)
class GraphPlan:
    """mode: the lowered mode (what the machine and the builders allow).
    capture_sizes: token counts a batch can reach, sorted ascending.
    max_num_reqs: the most requests a batch holds."""

    mode: CUDAGraphMode
    capture_sizes: tuple[int, ...]
    max_num_reqs: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "capture_sizes", tuple(sorted(self.capture_sizes)))

    @property
    def decode_sizes(self) -> tuple[int, ...]:
        """Sizes of the uniform-decode FULL graphs: one token per request."""
        return tuple(s for s in self.capture_sizes if s <= self.max_num_reqs)

    def captures(self) -> list[StepGraph]:
        """The graphs to capture: PIECEWISE before FULL, each largest first
        (smaller graphs then reuse the larger ones' pool blocks). In FULL a
        size's decode graph comes right before its mixed graph, which may be
        made from it (CompilationConfig.derive_mixed_graphs)."""
        plan: list[StepGraph] = []
        sizes = sorted(self.capture_sizes, reverse=True)
        if self.mode.has_piecewise:
            plan += [StepGraph(CUDAGraphMode.PIECEWISE, s, min(s, self.max_num_reqs))
                     for s in sizes]
        decode = set(self.decode_sizes) if self.mode.has_full else set()
        for s in sizes:
            if s in decode:
                plan.append(StepGraph.full_decode(s))
            if self.mode is CUDAGraphMode.FULL:
                plan.append(StepGraph(CUDAGraphMode.FULL, s, min(s, self.max_num_reqs)))
        return plan

    def dispatch(self, num_tokens: int, num_reqs: int,
                 uniform_decode: bool) -> tuple[StepGraph, str | None]:
        """The graph a batch of these sizes runs in (padded), and why it got
        none (NO_GRAPH_*) where a graph mode gave it none."""
        if self.mode is CUDAGraphMode.NONE:
            return StepGraph.eager(num_tokens, num_reqs), None
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        if i == len(self.capture_sizes):
            return StepGraph.eager(num_tokens, num_reqs), NO_GRAPH_TOO_LARGE
        padded = self.capture_sizes[i]
        if self.mode.has_full and uniform_decode and padded <= self.max_num_reqs:
            return StepGraph.full_decode(padded), None
        if self.mode is CUDAGraphMode.FULL:
            return StepGraph(CUDAGraphMode.FULL, padded, min(padded, self.max_num_reqs)), None
        if self.mode.has_piecewise:
            return StepGraph(CUDAGraphMode.PIECEWISE, padded, min(padded, self.max_num_reqs)), None
        return StepGraph.eager(num_tokens, num_reqs), NO_GRAPH_MIXED


def scouts_first(graphs: list[StepGraph]) -> list[StepGraph]:
    """A plan (`GraphPlan.captures()`) in the order a runner whose kernels
    compile ahead captures it, cold or warm: in each mode, the largest
    size's graphs first (the pool's blocks are sized by them), then those of
    every power-of-two size and of the smallest, then the rest, each part
    largest first. A size's graphs stay together and in order (FULL's decode
    graph before its mixed one).
    Why: the kernels only smaller batches use (row tiles, split counts:
    they change at powers of two) are then asked for within the plan's
    first graphs and compile while the larger sizes capture, instead of
    after the last of them (docs/design.md, "Scouts first")."""
    return [g for scouts, rest in _mode_parts(graphs) for g in scouts + rest]


def scout_graphs(graphs: list[StepGraph]) -> list[StepGraph]:
    """The graphs `scouts_first` puts before the rest: each mode's largest
    size's, every power-of-two size's and the smallest size's, in that order."""
    return [g for scouts, _ in _mode_parts(graphs) for g in scouts]


def early_scout_graphs(graphs: list[StepGraph]) -> list[StepGraph]:
    """`scout_graphs` less each FULL mixed graph whose size has a
    uniform-decode graph too: its GEMMs run at that graph's rows, and its
    attention takes the prefill kernel that a cold start's dry prefills ask
    for. What a cold start's first step runs dry (`early_scouts`): on an
    H100 each dry llama8b step cost it ~0.1 s, and FULL's 9 mixed scouts
    asked for nothing the others did not."""
    decode = {g.num_tokens for g in graphs if g.uniform_decode}
    return [g for g in scout_graphs(graphs)
            if g.uniform_decode or g.mode is not CUDAGraphMode.FULL or g.num_tokens not in decode]


def _mode_parts(graphs: list[StepGraph]) -> list[tuple[list[StepGraph], list[StepGraph]]]:
    """Per mode (in plan order): (its scouts' graphs, the rest's), each in
    scouts_first's order."""
    parts = []
    for _, run in itertools.groupby(graphs, key=lambda g: g.mode):  # one mode's graphs
        # a size's graphs of this mode, in plan order
        first, *rest = [list(u) for _, u in itertools.groupby(run, key=lambda g: g.num_tokens)]
        smallest = min((u[0].num_tokens for u in rest), default=0)
        scouts = [u for u in rest if _power_of_two(u[0].num_tokens) or u[0].num_tokens == smallest]
        parts.append(([g for u in [first, *scouts] for g in u],
                      [g for u in rest if u not in scouts for g in u]))
    return parts


def _power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0
