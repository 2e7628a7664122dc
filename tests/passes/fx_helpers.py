"""FX graph helpers the pass tests share."""

import torch
import torch._dynamo


def dynamo_graph(model, *args):
    """The graph Dynamo hands a backend for model(*args) (one graph, no
    breaks), and its example inputs (the model's own parameters and buffers
    among them)."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=grab, fullgraph=True)(*args)
    ((gm, inputs),) = graphs
    return gm, inputs


def calls(gm, target):
    """The call_function nodes of `gm` that call `target`, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
