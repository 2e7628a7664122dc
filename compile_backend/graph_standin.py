"""A CPU stand-in for CUDA graphs with the same observable contract, for
tests and benchmark dry runs (`with use_graph_backend(StandInGraphs()):`).

"Capture" runs the callable once (as the capture step does on a GPU, where
kernels are recorded, not run; our dummy batches write no real state, so the
difference does not show). "Replay" re-runs the callable on the tensors held
from capture and under the forward context seen at capture: the Python ints
baked into a graph and the metadata tensor objects are the capture-time ones,
and only what was copied into the held input/persistent buffers is new, as on
a GPU. Results are copied into the capture-time output tensors.
"""

import contextlib

import torch
import torch.utils._pytree as pytree

from .forward_context import ForwardContext, set_forward_context


class StandInGraph:
    def __init__(self):
        self.fn = None
        self.entry = None
        self.ctx = None
        self.replays = 0

    def replay(self):
        self.replays += 1
        scope = set_forward_context(self.ctx) if self.ctx is not None else contextlib.nullcontext()
        with scope, torch.no_grad():
            out = self.fn(*self.entry.inputs)
        for held, new in zip(pytree.tree_leaves(self.entry.outputs), pytree.tree_leaves(out)):
            if isinstance(held, torch.Tensor):
                held.copy_(new)


class StandInGraphs:
    def __init__(self):
        self.graphs = []

    def new_graph(self):
        g = StandInGraph()
        self.graphs.append(g)
        return g

    def capture(self, graph, pool):
        return contextlib.nullcontext()

    def pool(self):
        return object()

    def memory_allocated(self):
        return 0

    def synchronize(self):
        pass

    def after_capture(self, graph, fn, entry, ctx):
        graph.fn, graph.entry = fn, entry
        if ctx is not None:  # frozen copy: same metadata objects, capture-time ints
            graph.ctx = ForwardContext(
                attn_metadata=dict(ctx.attn_metadata), batch_descriptor=ctx.batch_descriptor,
                cudagraph_runtime_mode=ctx.cudagraph_runtime_mode, trace=ctx.trace)
