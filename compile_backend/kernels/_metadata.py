"""How a layer-keyed op finds its layer's metadata (README.md, "Op roles"):
by its `layer_name` argument, through the forward context.
"""

from __future__ import annotations

from compile_backend.core.forward_context import get_forward_context


def layer_metadata(layer_name: str, event: str):
    """What every layer-name op does first: record the call in the forward
    context's trace and return that layer's metadata."""
    ctx = get_forward_context()
    ctx.record(layer_name, event)
    return ctx.metadata(layer_name)
