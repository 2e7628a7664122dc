"""The forward context: what the runner sets around one model step and what
ops read, so that a model never passes metadata through `forward`.

Ops look up their metadata by layer name:
    meta = get_forward_context().metadata(layer_name)
(an op that reads `attn_metadata` itself resolves the name first with
`resolve_layer(layer_name)`: a piece compiled for one layer may run as another's).
The runner (or a test) sets it with `set_forward_context(...)`, a context
manager that restores the previous value on exit (nesting is allowed).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from compile_backend.core.graph_mode import StepGraph


@dataclass
class ForwardContext:
    # layer name -> that layer's metadata (AttentionMetadata, SConvMetadata, ...)
    attn_metadata: dict[str, Any] = field(default_factory=dict)
    # The graph this step runs in (its mode and padded sizes), as the runner
    # decided it. None: no runner decided (plain torch.compile use, or inside
    # a whole graph captured without one): wrappers run their callables.
    graph: StepGraph | None = None
    # True while a CUDA graph is being captured (warm-up runs are False).
    capturing: bool = False
    # While mrv2 captures a graph: the attention plans built inside that
    # capture, dropped when it ends (Note [attention plans] in
    # compile_backend/kernels/attention_plan.py); None otherwise.
    capture_plans: dict | None = None
    # Ops append here what they saw at run time (debug and tests: proves an
    # attention-like op ran during capture with real metadata).
    trace: list[tuple[str, str]] | None = None

    def metadata(self, layer_name: str) -> Any:
        if _layer_alias is not None:  # resolve_layer, inlined: every op call reads it
            layer_name = _layer_alias.get(layer_name, layer_name)
        try:
            return self.attn_metadata[layer_name]
        except KeyError:
            raise RuntimeError(
                f"no attention metadata for layer {layer_name!r} in the forward context "
                f"(layers with metadata: {sorted(self.attn_metadata)}). The runner must "
                "build metadata for every layer (an attention group must list it)."
            ) from None

    def record(self, layer_name: str, event: str) -> None:
        """Ops call this on entry; during capture the event reads "<event>@capture"."""
        if self.trace is not None:
            self.trace.append((resolve_layer(layer_name), f"{event}@capture" if self.capturing else event))


_current: ForwardContext | None = None
# Layer name an op was compiled with -> the layer it serves now. Set while a
# piece compiled for one layer runs as another's (identical layers share one
# compiled artifact: compile_backend/compile/layer_sharing.py).
_layer_alias: dict[str, str] | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "no forward context is set: mrv2 ops read their metadata from it. Run the "
            "model inside `with compile_backend.set_forward_context(ForwardContext(...)):` "
            "(the capture runner does this for you)."
        )
    return _current


def has_forward_context() -> bool:
    return _current is not None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous = _current
    _current = ctx
    try:
        yield ctx
    finally:
        _current = previous


def resolve_layer(layer_name: str) -> str:
    """The layer an op called with `layer_name` serves now (see _layer_alias)."""
    if _layer_alias is None:
        return layer_name
    return _layer_alias.get(layer_name, layer_name)


def call_as_layers(alias: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), with ops called with a key of `alias` serving the layer it
    maps to. A plain function, not a context manager: every call of a shared
    piece's callable pays for it (no generator per call)."""
    global _layer_alias
    previous = _layer_alias
    _layer_alias = alias
    try:
        return fn(*args)
    finally:
        _layer_alias = previous
