"""A compiled step: what the backend returns for one Dynamo graph, and how
it serves calls. `assemble_step` makes it callable from its pieces'
callables (compiled now, or loaded from the warm-start cache), so a loaded
step runs as the one compiled; `CompiledStep.__call__` serves a runner's
steps (its forward context picks the graphs) and plain calls (the whole
graph captured lazily where it can be, else the pieces): docs/design.md,
"The capture contract"."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx

from compile_backend.compile.piece_calls import call_pieces_directly, install_pieces
from compile_backend.compile.split import Piece
from compile_backend.core.config import CompilationConfig
from compile_backend.core.counters import counters
from compile_backend.core.direct_calls import rewrite_direct_calls
from compile_backend.core.forward_context import has_forward_context
from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.core.op_registry import OpRegistry, OpRole
from compile_backend.runtime.cuda_graph import CUDAGraphWrapper
from compile_backend.runtime.graph_pool import own_outputs

logger = logging.getLogger(__name__)

# The key of the whole graph's entry in CompiledStep.fixed_shape_inputs
# (pieces are keyed by their names, submod_N).
FULL_GRAPH = "full_graph"

@dataclass
class CompiledStep:
    """What the backend returns for one Dynamo graph. It can be saved with
    the Dynamo output around it (torch's AOT compile; `register_with_dynamo`)
    or alone (compile/direct_step.py): see compile/step_artifacts.py for what
    it saves and how it is loaded."""

    config: CompilationConfig
    roles: OpRegistry
    graph_mode: CUDAGraphMode  # after lowering to what this machine supports
    mode_reason: str | None
    original_code: str  # the Dynamo graph before passes
    passed_code: str  # after passes
    split_gm: torch.fx.GraphModule
    pieces: list[Piece]
    pass_log: list[dict[str, Any]] = field(default_factory=list)
    passes_uuid: str | None = None
    compile_seconds: float = 0.0
    # Saved with the step (compile/step_artifacts.py): each captured piece's
    # input names and stable (parameter, buffer) inputs, the whole graph's,
    # the graph inputs it writes, and the compiled callables of pieces that
    # compiled on their own.
    piece_inputs: dict[str, tuple[list[str], list[int]]] = field(default_factory=dict)
    graph_inputs: tuple[list[str], list[int]] = ((), ())
    # Per wrapper (a piece's name, or FULL_GRAPH), the inputs of a fixed
    # shape (backend.py: _fixed_shapes): left out of the lazy key
    fixed_shape_inputs: dict[str, list[int]] = field(default_factory=dict)
    written_inputs: frozenset[int] = frozenset()
    # Groups of graph inputs (weights, biases of fused sibling linears) packed
    # into one tensor each (compile/backend.py: _pack_fused_weights). A loaded
    # step packs them at its first call (`pack_on_call`).
    packed_inputs: list[list[int]] = field(default_factory=list)
    pack_on_call: bool = field(default=False, repr=False)
    # Where Dynamo took each graph input from (backend.py: _input_sources), in
    # the graph's input order: a warm start without Dynamo finds them so
    # (compile/direct_step.py). Not saved with the step: its entry holds them.
    input_sources: list[str | None] = field(default_factory=list, repr=False)
    _saved: bytes | None = field(default=None, repr=False)  # serialize_compile_artifacts's
    artifacts: dict[str, Any] = field(default_factory=dict, repr=False)  # set by assemble_step
    wrappers: list[Any] = field(default_factory=list)  # CUDA-graph wrappers, if any
    # Plain torch.compile use (no runner) in a mode with FULL graphs: the whole
    # graph captured lazily, or why it cannot be (then pieces run PIECEWISE).
    full_graph: Any = None
    full_blocker: str | None = None
    _blocker_logged: bool = field(default=False, repr=False)
    _values_by_shapes: dict = field(default_factory=dict, repr=False)

    def __call__(self, *args: Any) -> Any:
        if self.pack_on_call:
            self._pack(args)
        if has_forward_context():  # a runner's step: outputs valid until its next step
            return self.split_gm.forward(*args)  # no module hooks on it: skip Module.__call__
        if self.graph_mode is CUDAGraphMode.NONE:
            return self.split_gm.forward(*args)
        # Plain use: the caller owns what it gets (a replay rewrites graph memory).
        if self.graph_mode.has_full:
            if self.full_graph is not None:
                key = self.full_graph.lazy_key(args)
                if self._fits_one_graph(key):
                    out = self.full_graph.call_lazily(args, key)
                    if self.full_graph.growing:  # new sizes: pieces' graphs, not a whole one
                        self._give_up_full_graph(
                            "no FULL graph: the inputs grow by one at every call (a cache "
                            "that grows per token); the pieces between attention ops keep "
                            "their graphs (PIECEWISE)")
                    return own_outputs(out)
            if not self._blocker_logged:
                self._blocker_logged = True
                counters["full_graph_fallbacks"] += 1
                logger.warning("mrv2: %s", self.full_blocker)
        return own_outputs(self.split_gm.forward(*args))

    def _pack(self, args: Sequence[Any]) -> None:
        """Pack the fused groups' weights once, before anything reads them
        (compile_backend/core/packed_weights.py: pack_siblings refuses under a capture; the
        op then runs the unpacked path, slower, never wrong)."""
        from compile_backend.core.packed_weights import pack_siblings

        self.pack_on_call = False
        for idx in self.packed_inputs:
            outcome = pack_siblings([args[i] for i in idx])
            if outcome.startswith("not packed"):
                logger.info("mrv2: sibling weights %s of the loaded step: %s", idx, outcome)

    def _fits_one_graph(self, key: tuple[tuple[Any, ...], tuple[Any, ...]]) -> bool:
        """A graph bakes in the Python values it is called with (Dynamo passes
        an int that changed, such as a decode position, as an input). Values
        that change between calls of one input shape would need a graph per
        call: then the whole graph is given up for PIECEWISE pieces."""
        shapes, values = key  # the full graph's lazy_key of the call's arguments
        first = self._values_by_shapes.setdefault(shapes, values)
        if first == values:
            return True
        self._give_up_full_graph(
            "no FULL graph without a runner: the graph takes Python values that change "
            f"between calls of one input shape ({list(first)}, then {list(values)}), which "
            f"a graph would bake in; {_instead(self.graph_mode)}")
        return False

    def _give_up_full_graph(self, reason: str) -> None:
        """Plain use: from now on the pieces run in their PIECEWISE wrappers
        (said once at the next call, counted in full_graph_fallbacks)."""
        self.full_graph = None  # its graphs go with it
        self.full_blocker = reason

    @classmethod
    def serialize_compile_artifacts(cls, fn: "CompiledStep") -> bytes:
        """Once per step: Dynamo's saved function holds these bytes, and the
        warm-start entry holds them again for a load without Dynamo."""
        if fn._saved is None:
            from compile_backend.compile.step_artifacts import serialize_step

            fn._saved = serialize_step(fn)
        return fn._saved

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "CompiledStep":
        """A saved step, assembled as a compiled one is (compile/step_artifacts.py)."""
        from compile_backend.compile.step_artifacts import load_step

        fields, fns = load_step(data)
        step = cls(**fields)
        assemble_step(step, fns)
        counters["steps_loaded"] += 1
        return step

    @property
    def __code__(self):
        """The code of `__call__`: tools that decompile what a backend returned
        (depyf, on leaving `prepare_debug`) read the callable's `__code__`."""
        return type(self).__call__.__code__


def register_with_dynamo() -> None:
    """torch's AOT compile saves a backend's callable only if it is a
    `SerializableCallable` (torch >= 2.10): CompiledStep registers as one (a
    virtual subclass) where Dynamo is imported anyway, at a compile or a load
    through Dynamo, so that importing this module (a warm start that loads
    the step alone) imports no Dynamo."""
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except ImportError:  # pragma: no cover - older torch: no warm start
        return
    SerializableCallable.register(CompiledStep)


_compiled: list[CompiledStep] = []


def compiled_steps() -> list[CompiledStep]:
    """Every graph this process compiled with mrv2, oldest first."""
    return list(_compiled)


def clear_compiled_steps() -> None:
    _compiled.clear()


def _uses_no_runner_metadata(op: str, roles: OpRegistry) -> bool:
    """Can `op` run without the runner's forward context? Attention-like ops
    index their state by metadata; breakpoints outside aten and higher_order
    (paged attention, users' own) are assumed to read it too."""
    role = roles.role_of_name(op)
    if role is OpRole.ATTENTION_LIKE:
        return False
    return role is not OpRole.BREAKPOINT or op.split("::")[0] in ("aten", "higher_order")


def _instead(mode: CUDAGraphMode) -> str:
    return ("its pieces run as PIECEWISE graphs" if mode is not CUDAGraphMode.FULL_DECODE_ONLY
            else "it runs eagerly")


def full_capture_blocker(pieces: Sequence[Piece], roles: OpRegistry, mode: CUDAGraphMode) -> str | None:
    """Why the whole graph cannot be one lazily captured FULL graph without a
    runner (None: it can), and what runs instead."""
    instead = _instead(mode)
    for p in pieces:
        if p.eager_reasons:
            return (f"no FULL graph without a runner: piece {p.name} cannot be captured "
                    f"({p.eager_reasons[0]}); {instead}")
        for op in p.breakpoints + p.attention_like:
            if not _uses_no_runner_metadata(op, roles):
                return (f"no FULL graph without a runner: {op} reads attention metadata "
                        f"that only a runner (compile_backend.ModelRunner) builds; {instead}")
    return None


def assemble_step(step: CompiledStep, fns: dict[str, Callable[..., Any]]) -> None:
    """Make `step` callable from its pieces' callables (compiled now, or
    loaded): CUDA-graph wrappers, direct op calls in eager pieces, the lazily
    captured whole graph of plain use. Everything here comes from `step`'s
    saved fields, so a loaded step runs as the one compiled."""
    config, graph_mode, split_gm = step.config, step.graph_mode, step.split_gm
    step.artifacts = {p.name: fns[p.name] for p in step.pieces
                      if p.captured and p.compiled_as is None}
    # Pieces get PIECEWISE wrappers in modes with piecewise graphs, and in FULL
    # for plain use when the whole graph cannot be one graph (known now, or at
    # a call). Under a FULL graph or a runner's FULL step they run their callables.
    piecewise = graph_mode.has_piecewise or graph_mode is CUDAGraphMode.FULL
    installed = {}
    for piece in step.pieces:
        fn = fns[piece.name]
        if piece.captured and piecewise:
            names, stable = step.piece_inputs[piece.name]
            fn = CUDAGraphWrapper(fn, CUDAGraphMode.PIECEWISE, name=piece.name,
                                  debug_checks=config.debug_checks, stable_inputs=stable,
                                  input_names=names, written_inputs=piece.written_inputs,
                                  graphs_per_shape=config.graphs_per_shape,
                                  fixed_shape_inputs=step.fixed_shape_inputs.get(piece.name, ()))
            step.wrappers.append(fn)
        elif not piece.captured and config.direct_op_calls:
            # On a copy: the piece's own module stays as traced (it is what a
            # saved step holds). After compiling: the fake run needs the real ops.
            fn = copy.deepcopy(fn)
            counters["direct_calls"] += rewrite_direct_calls(fn)
        installed[piece.name] = fn
    install_pieces(split_gm, installed)
    call_pieces_directly(split_gm, [p.name for p in step.pieces])
    step.full_blocker = (full_capture_blocker(step.pieces, step.roles, graph_mode)
                         if graph_mode.has_full else None)
    if graph_mode.has_full and step.full_blocker is None:
        names, stable = step.graph_inputs
        step.full_graph = CUDAGraphWrapper(
            split_gm, CUDAGraphMode.FULL, name="full_graph", debug_checks=config.debug_checks,
            stable_inputs=stable, input_names=names, written_inputs=step.written_inputs,
            graphs_per_shape=config.graphs_per_shape,
            fixed_shape_inputs=step.fixed_shape_inputs.get(FULL_GRAPH, ()))
    _compiled.append(step)
