"""A FULL plan's mixed graphs, made from its decode graphs instead of recorded.

A size's decode graph and mixed graph run the same step; they differ only in
what the metadata-reading (layer-keyed) ops launch. So while a decode graph
records, its calls of those ops are noted with the nodes each added
(core/op_recording.py); the noted calls are then made again, under the mixed
step's metadata and on the same tensors, in one side capture, and the mixed
graph is a clone of the decode graph whose nodes of each call take the side
capture's launches, one for one (runtime/graph_surgery.py). The step's Python
runs once per size, not twice. Where that cannot be done the wrapper records
the mixed graph as before; the reason is logged once and counted
(`mixed_graph_refusals`, per reason in `refusals`). docs/design.md, "A mixed
graph derived from the decode graph".
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import torch

from compile_backend.core import op_recording
from compile_backend.core.counters import counters
from compile_backend.core.forward_context import ForwardContext
from compile_backend.core.graph_mode import CUDAGraphMode, StepGraph
from compile_backend.core.op_registry import OpRegistry
from compile_backend.runtime import graph_pool

logger = logging.getLogger(__name__)


class MixedGraphs:
    """One FULL wrapper's decode graphs kept as sources, by size."""

    def __init__(self, graphs: Any) -> None:
        self.graphs = graphs
        self.sources: dict[int, tuple[Any, list[op_recording.OpCall]]] = {}  # tokens -> (entry, calls)
        self.side_pool = graph_pool.ReusedPool(graphs)  # the side captures' memory, apart from the step's
        self.refusals: dict[str, int] = {}
        self._said: set[str] = set()
        self._cannot: str | None = None  # why graphs cannot be derived here ("": they can)

    def forget(self) -> None:
        self.sources.clear()
        self.side_pool = graph_pool.ReusedPool(self.graphs)

    def is_source(self, graph: StepGraph | None) -> bool:
        """Record `graph` as a source (a decode graph, where graphs can be derived here)?"""
        if graph is None or graph.mode is not CUDAGraphMode.FULL or not graph.uniform_decode:
            return False
        if self._cannot is None:
            self._cannot = self.graphs.can_derive() or ""
        # Checked before recording: an op whose dispatcher path is not watched
        # would keep its decode launches in a derived graph.
        why = self._cannot
        missing = op_recording.all_recordable(OpRegistry().layer_keyed_ops())
        if not why and missing:
            why = (f"layer-keyed ops not defined through mrv2's op definitions (their launches "
                   f"cannot be found): {', '.join(missing)}")
        if why:
            self._refuse(why)
            return False
        return True

    @contextlib.contextmanager
    def recording(self) -> Iterator[op_recording.Recorder]:
        """Around a source's capture (inside it: node counts need a capture)."""
        names = OpRegistry().layer_keyed_ops()
        with op_recording.recording(names, self.graphs.node_counter(), graph_pool.weak_ref) as rec:
            yield rec

    def keep(self, graph: StepGraph, entry: Any, calls: list[op_recording.OpCall]) -> None:
        self.sources[graph.num_tokens] = (entry, calls)

    def derive(self, graph: StepGraph | None, args: Sequence[Any], ctx: ForwardContext | None,
               current: Any) -> tuple[Any, Any] | None:
        """(the derived graph, its source's entry) for the mixed graph `graph`,
        or None: record it. `current(tokens)`: the wrapper's entry for that
        size's decode graph now (a source replaced or freed since is stale)."""
        if (graph is None or ctx is None or graph.mode is not CUDAGraphMode.FULL
                or graph.uniform_decode or graph.num_reqs != graph.num_tokens):
            return None
        source = self.sources.pop(graph.num_tokens, None)
        if source is None:
            return None  # no decode graph of this size (more tokens than requests): record
        entry, calls = source
        if current(graph.num_tokens) is not entry:
            return self._refuse("its decode graph was replaced or freed")
        from compile_backend.runtime.cuda_graph import addresses_match

        if not addresses_match(args, entry):
            return self._refuse("the step's inputs are not where its decode graph reads them")
        lost = sorted({c.name for c in calls if not c.repeatable})
        if lost:
            return self._refuse(f"ops returning a tensor without an `into` to write it where the "
                                f"decode graph has it: {', '.join(lost)}")
        side = self.graphs.new_graph(keep_graph=True)
        pairs = []
        outer = ctx.capturing, ctx.capture_plans
        ctx.capturing, ctx.capture_plans = True, {}  # attention plans stay the capture's
        try:
            with self.graphs.capture(side, self.side_pool.for_capture(side), (), instantiate=False):
                pad, count = None, self.graphs.node_counter()
                for call in calls:
                    first = count()
                    call.again()
                    short = (call.end - call.first) - (count() - first)
                    if short > 0:  # fewer launches (decode's split and reduce: one here)
                        pad = self._pad(pad, short)
                    pairs.append((call.first, call.end, first, count()))
            made = self.graphs.derive(entry.cuda_graph, side, pairs)
        except Exception as e:  # noqa: BLE001 - any failure: record the graph instead
            from compile_backend.runtime.jit_guard import CompileInCapture

            if isinstance(e, CompileInCapture):  # the plan compiles it, then asks again
                self.sources[graph.num_tokens] = source
                raise
            return self._refuse(f"{type(e).__name__}: {e}")
        finally:
            ctx.capturing, ctx.capture_plans = outer
        counters["mixed_graphs_derived"] += 1
        return made, entry

    def _pad(self, pad: Any, launches: int) -> Any:
        """`launches` kernels that change nothing of the step's (a fill of a
        scratch element of the side pool's): the nodes a call of the other
        form lacks, so the two forms' launches pair one for one."""
        if pad is None:
            pad = torch.empty(1, device=torch.device("cuda", torch.cuda.current_device())
                              if torch.cuda.is_available() else "cpu")
        for _ in range(launches):
            pad.fill_(1.0)
        return pad

    def _refuse(self, reason: str) -> None:
        counters["mixed_graph_refusals"] += 1
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        if reason not in self._said:
            self._said.add(reason)
            logger.info("mrv2: a mixed FULL graph is recorded, not derived from its decode "
                        "graph: %s (said once per reason)", reason)
        return None
