"""What a compiled step saves, and how a saved one is loaded.

torch's AOT compile (compile/guard_free.py) saves Dynamo's code and guards
and asks the backend's callable for its own bytes (`SerializableCallable`).
A `CompiledStep` saves its split graph and pieces node by node (as plain
data, compile/graph_codec.py; FX's GraphPickler where that cannot), what
their node metadata told (each piece's inputs, which are parameters, which
it writes), the pieces' facts, the config, the op roles, the pass log, the
packed weight groups and each Inductor piece's binary artifact. Loading
rebuilds the pieces' callables and assembles the step as the backend does
after compiling (compile/compiled_step.assemble_step): nothing is traced or
compiled. The ops the graphs call must be registered again first, which
importing the model's modules does. docs/design.md, "Start in seconds".
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import os
import pickle
import tempfile
import time
from typing import Any

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from compile_backend.compile import graph_codec
from compile_backend.core.counters import counters

logger = logging.getLogger(__name__)


# Bumped when what is saved changes: an older entry is then a miss.
FORMAT = 3
# Leads a step saved with its graphs as plain data (compile/graph_codec.py);
# other saved steps are GraphPickler's.
CODEC_MAGIC = b"mrv2-step-codec\n"


def artifact_bytes(artifact: Any) -> bytes:
    """An Inductor artifact (standalone_compile's, or `load_artifact`'s) as bytes."""
    if isinstance(artifact, _Loaded):
        return artifact.data
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "piece.bin")
        artifact.save(path=path, format="binary")
        with open(path, "rb") as f:
            return f.read()


def _load_artifact(data: bytes) -> Any:
    from torch._inductor import CompiledArtifact

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "piece.bin")
        with open(path, "wb") as f:
            f.write(data)
        return CompiledArtifact.load(path=path, format="binary")


def _bare(gm: torch.fx.GraphModule, children: dict | None = None) -> torch.fx.GraphModule:
    """A copy of `gm`'s graph without node metadata (Dynamo's fake values and
    sources: what they told is saved beside it) and with `children` as its
    submodules."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for node in graph.nodes:
        node.meta = {}
    # Lazy: its code is generated once, when GraphPickler asks for it, not
    # here and again there (and again for each child of the root).
    return _LazyGraphModule(children or {}, graph)


class _Loaded:
    """A loaded Inductor artifact, run as the piece `gm` it was compiled from.
    It returns its outputs as a list; a piece whose graph returns one value
    (not a tuple) must return that value, as the artifact compiled in this
    process does. Keeps its bytes: a step compiled by workers
    (compile/compile_workers.py) saves them as they came."""

    def __init__(self, gm: torch.fx.GraphModule, fn: Any, data: bytes) -> None:
        self.fn, self.data = fn, data
        out = gm.graph.output_node().args[0]
        self.one_value = not isinstance(out, (tuple, list))

    def __call__(self, *args: Any) -> Any:
        result = self.fn(*args)
        if self.one_value and isinstance(result, (list, tuple)):
            return result[0]
        return result

    def save(self, *, path: str, format: str = "binary") -> None:
        assert format == "binary", format
        with open(path, "wb") as f:
            f.write(self.data)


def load_artifact(gm: torch.fx.GraphModule, data: bytes) -> _Loaded:
    """`artifact_bytes`'s bytes, loaded to run as the piece `gm`."""
    return _Loaded(gm, _load_artifact(data), data)


def serialize_step(step: Any) -> bytes:
    """Bytes from which `load_step` gives back an equal step's parts. Raises
    (RuntimeError) when a piece's compiled callable cannot be saved."""
    artifacts: dict[str, bytes | None] = {}
    for name, fn in step.artifacts.items():
        if isinstance(fn, torch.fx.GraphModule):  # eager piece compiler: the graph is the code
            artifacts[name] = None
        elif hasattr(fn, "save"):
            artifacts[name] = artifact_bytes(fn)
        else:
            raise RuntimeError(
                f"piece {name} was compiled as {type(fn).__name__}, which cannot be saved "
                "(compile with CompilationConfig.serializable=True)")
    # The split graph with each piece's module as traced (split_gm itself now
    # holds the pieces' callables).
    bare = {p.name: _bare(p.graph_module) for p in step.pieces}
    root = _bare(step.split_gm, bare)
    payload = {
        "format": FORMAT,
        "config": step.config,
        "roles": step.roles,
        "graph_mode": step.graph_mode,
        "mode_reason": step.mode_reason,
        "original_code": step.original_code,
        "passed_code": step.passed_code,
        "pass_log": step.pass_log,
        "passes_uuid": step.passes_uuid,
        "split_graph": root,
        "pieces": [copy.copy(p) for p in step.pieces],  # graph modules: the split graph's
        "piece_inputs": step.piece_inputs,
        "graph_inputs": step.graph_inputs,
        "fixed_shape_inputs": step.fixed_shape_inputs,
        "written_inputs": step.written_inputs,
        "packed_inputs": step.packed_inputs,
        "artifacts": artifacts,
    }
    for p in payload["pieces"]:
        p.graph_module = None  # the split graph's submodule of that name
    try:  # graphs as plain data: a load imports neither Dynamo nor Inductor
        payload["split_graph"] = graph_codec.encode(root)
        return CODEC_MAGIC + pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except (graph_codec.Unencodable, pickle.PicklingError, TypeError, AttributeError) as e:
        counters["step_codec_fallbacks"] += 1
        logger.info("mrv2: saving the step with FX's GraphPickler (its load imports Dynamo): %s",
                    f"{type(e).__name__}: {e}")
        payload["split_graph"] = root
    from torch.fx._graph_pickler import Options

    return _dumps(payload, Options(ops_filter=None))


@functools.lru_cache(maxsize=1)
def _step_pickler() -> type:
    """GraphPickler's reductions on Python's C pickler. Where dill is
    installed (depyf brings it), GraphPickler subclasses dill's pickler,
    which is pickle's pure-Python implementation (docs/design.md, "Start in
    seconds": a saved step). Takes whatever state this torch's GraphPickler
    keeps, so its reductions find it. Made at the first save that needs it:
    importing FX's GraphPickler imports Dynamo."""
    from torch.fx._graph_pickler import GraphPickler, Options

    class _StepPickler(pickle.Pickler):
        def __init__(self, file: io.BytesIO, options: Options | None = None) -> None:
            super().__init__(file, pickle.HIGHEST_PROTOCOL)
            model = GraphPickler(io.BytesIO(), options)
            base = vars(type(model).__mro__[1](io.BytesIO()))  # the pickler it extends
            for name, value in vars(model).items():
                if name not in base:
                    setattr(self, name, value)

    # GraphPickler's own methods and class attributes (reducer_override,
    # persistent_id, the types it passes through...), not its constructors.
    for name, value in vars(GraphPickler).items():
        if not name.startswith("__") and name not in ("dumps", "loads", "debug_dumps"):
            setattr(_StepPickler, name, value)
    return _StepPickler


def _dumps(payload: dict[str, Any], options: Any) -> bytes:
    """GraphPickler.dumps on the C pickler; GraphPickler's own where that
    fails (an object only dill pickles), counted and logged."""
    from torch.fx._graph_pickler import GraphPickler

    try:
        return GraphPickler.dumps.__func__(_step_pickler(), payload, options)
    except Exception as e:  # noqa: BLE001 - the slower pickler still saves it
        counters["step_pickle_fallbacks"] += 1
        logger.info("mrv2: saving the step with GraphPickler's own pickler (%s: %s)",
                    type(e).__name__, e)
        return GraphPickler.dumps(payload, options)


# Host seconds of this process's last `load_step` by part: "graph" (the
# split graph unpickled and its code generated), "pieces" (the pieces'
# Inductor artifacts loaded). compile/guard_free.py reports them beside its
# "deserialize" phase, which holds them and Dynamo's own load.
last_load_seconds: dict[str, float] = {}


def load_step(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the CompiledStep's fields, each piece's callable) from `serialize_step`'s
    bytes; CompiledStep.deserialize_compile_artifacts builds and assembles
    the step from them (so this module needs no CompiledStep)."""
    from compile_backend.compile.piece_calls import AsLayer

    import compile_backend.kernels  # noqa: F401  (the mrv2 ops the graphs call, sibling_linear too)

    t0 = time.perf_counter()
    if data.startswith(CODEC_MAGIC):
        payload = pickle.loads(data[len(CODEC_MAGIC):])
        if payload.get("format") == FORMAT:
            payload["split_graph"] = graph_codec.decode(payload["split_graph"])
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        payload = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    if payload.get("format") != FORMAT:
        raise RuntimeError(f"saved step format {payload.get('format')} is not {FORMAT}")
    split_gm = payload["split_graph"]
    # The pickler restores graphs, not their generated code; the root's
    # recompile generates its children's too (each piece's once).
    split_gm.recompile()
    pieces = payload["pieces"]
    fns: dict[str, Any] = {}
    for p in pieces:
        p.graph_module = getattr(split_gm, p.name)
        if "forward" not in vars(type(p.graph_module)):  # a torch whose recompile left it
            p.graph_module.recompile()
    t1 = time.perf_counter()
    for p in pieces:
        if not p.captured:
            fns[p.name] = p.graph_module
        elif p.compiled_as is None:
            data = payload["artifacts"][p.name]
            fns[p.name] = p.graph_module if data is None else load_artifact(p.graph_module, data)
    last_load_seconds.clear()
    last_load_seconds.update(graph=t1 - t0, pieces=time.perf_counter() - t1)
    for p in pieces:
        if p.captured and p.compiled_as is not None:
            base = fns[p.compiled_as]
            fns[p.name] = base if p.layer_alias is None else AsLayer(base, p.layer_alias)
    fields = dict(
        config=payload["config"],
        roles=payload["roles"],
        graph_mode=payload["graph_mode"],
        mode_reason=payload["mode_reason"],
        original_code=payload["original_code"],
        passed_code=payload["passed_code"],
        split_gm=split_gm,
        pieces=pieces,
        pass_log=payload["pass_log"],
        passes_uuid=payload["passes_uuid"],
        piece_inputs=payload["piece_inputs"],
        graph_inputs=payload["graph_inputs"],
        fixed_shape_inputs=payload.get("fixed_shape_inputs", {}),  # none known: all keyed
        written_inputs=payload["written_inputs"],
        packed_inputs=payload["packed_inputs"],
        # Packed in the process that compiled it, not in this one: at the
        # first call, which hands in the parameters.
        pack_on_call=bool(payload["packed_inputs"]),
    )
    return fields, fns
