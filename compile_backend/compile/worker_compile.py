"""A piece's Inductor compile, done in a compile worker.

    future = send_to_worker(workers, submod, fake_args, local=compile_here)
    where, value = future.result()
    fn, assumed = loaded_from_worker(submod, value)     # where == "worker"

The job: the modules that register the piece's custom ops, then the piece,
its fake (symbolic) arguments and Inductor's config, pickled by FX's
GraphPickler, which carries the ShapeEnv (symbols keep names, hints and
ranges). The answer: the artifact's bytes (compile/step_artifacts.py, as a
warm start loads them) and what compiling assumed of the piece's size
symbols, which the caller guards as for a piece sharing an artifact
(compile/layer_sharing.py). docs/design.md, section "Cold compile in parallel"."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.fx._graph_pickler import GraphPickler, Options

from compile_backend.core.counters import counters

logger = logging.getLogger(__name__)

# What a worker runs (compile/compile_workers.py) on send_to_worker's payload.
WORKER_COMPILE = "compile_backend.compile.worker_compile:compile_in_worker"


class _PiecePickler(GraphPickler):
    """GraphPickler, and a view's base described without its fake mode: the
    pickler clears a tensor's own mode but not its base's, so a piece that
    takes a view (a slice of a persistent buffer) fails to pickle; the
    unpickler sets both again."""

    def reducer_override(self, obj: object) -> Any:
        out = super().reducer_override(obj)
        data = out[1][0] if isinstance(out, tuple) and len(out) > 1 and out[1] else None
        meta = getattr(data, "metadata", None)
        base = getattr(meta, "base", None)
        if dataclasses.is_dataclass(base) and getattr(base, "fake_mode", None) is not None:
            data.metadata = dataclasses.replace(meta, base=dataclasses.replace(
                base, fake_mode=None))
        return out


# Node metadata a worker's compile does without: Dynamo's GraphArg holds the
# real input (a parameter's data), and the stacks hold modules and functions.
_LEFT_OUT_META = frozenset({"grapharg", "source_fn_stack", "nn_module_stack",
                            "fwd_source_fn_stack"})


def _sendable(submod: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the piece whose nodes keep only what its compile reads."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(submod.graph, {}))
    for node in graph.nodes:
        node.meta = {k: v for k, v in node.meta.items() if k not in _LEFT_OUT_META}
    return torch.fx.GraphModule(submod, graph)


# Namespaces whose ops every worker has: torch's own, and mrv2's (it preloads them).
_KNOWN_NAMESPACES = frozenset({"aten", "prims", "mrv2", "_c10d_functional", "c10d",
                               "_c10d_functional_autograd", "inductor", "higher_order"})


def _defining_module(op: Any) -> str | None:
    """The loaded module that registered `op`'s fake implementation (what
    tracing it needed), by its source file; None where unknown or where it is
    the caller's script (a worker must not run that again)."""
    try:
        from torch._library import simple_registry

        source = simple_registry.singleton.find(op._name).fake_impl.kernel.source
    except Exception:  # noqa: BLE001 - unknown: the worker reports a missing op, if any
        return None
    path = str(source).rpartition(":")[0]
    for name, module in list(sys.modules.items()):
        if name != "__main__" and getattr(module, "__file__", None) == path:
            return name
    return None


def op_modules(gm: torch.fx.GraphModule) -> list[str]:
    """Modules a worker imports so that `gm`'s custom ops (a user's, a test's)
    are registered there before it unpickles the piece."""
    found = set()
    for node in gm.graph.nodes:
        op = node.target
        if isinstance(op, torch._ops.OpOverloadPacket):  # as FX's own tracer records it
            op = getattr(op, "default", None)
        if (node.op == "call_function" and isinstance(op, torch._ops.OpOverload)
                and op.namespace not in _KNOWN_NAMESPACES):
            name = _defining_module(op)
            if name is not None:
                found.add(name)
    return sorted(found)


def send_to_worker(workers: Any, submod: torch.fx.GraphModule, args: Sequence[Any],
                   local: Callable[[], Any]) -> Any:
    """Queue an Inductor compile of `submod` for the workers (a future), or
    None where the piece cannot be pickled (it is then compiled here)."""
    from torch._inductor import config as inductor_config

    try:
        payload = _PiecePickler.dumps(
            (_sendable(submod), tuple(args), inductor_config.save_config_portable()),
            Options(ops_filter=None))
    except Exception as e:  # noqa: BLE001 - compiled here: logged and counted
        counters["compile_worker_fallbacks"] += 1
        logger.warning("mrv2: a piece could not be sent to a compile worker (%s: %s); it "
                       "compiles in this process", type(e).__name__, e)
        return None
    return workers.submit(WORKER_COMPILE, (op_modules(submod), payload), local=local)


def compile_in_worker(job: tuple[list[str], bytes]) -> tuple[bytes, list[Any]]:
    """In a worker: the piece's artifact (bytes) and what compiling it
    assumed of its size symbols (`job`: the modules that register its ops,
    and send_to_worker's payload)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import compile_backend.kernels  # noqa: F401  (the mrv2 ops the piece calls)
    from compile_backend.compile.layer_sharing import assumed_since, piece_symbols, shape_env_mark
    from compile_backend.compile.piece_compiler import compile_piece
    from compile_backend.compile.step_artifacts import artifact_bytes

    modules, payload = job
    for name in modules:
        importlib.import_module(name)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    gm, args, config = GraphPickler.loads(payload, fake_mode)
    mark = shape_env_mark(args)
    # As in the caller: inside the tracing context's fake mode, with the
    # Python dispatcher (ops' symbolic-shape rules).
    with inductor_config.patch(config), tracing(TracingContext(fake_mode)), fake_mode, \
            enable_python_dispatcher():
        fn = compile_piece(gm, args, "inductor", serializable=True)
    return artifact_bytes(fn), assumed_since(mark, piece_symbols(args))


def loaded_from_worker(submod: torch.fx.GraphModule,
                       answer: tuple[bytes, list[Any]]) -> tuple[Callable[..., Any], list[Any]]:
    """The worker's answer as (the piece's callable, what it assumed)."""
    from compile_backend.compile.step_artifacts import load_artifact

    data, assumed = answer
    return load_artifact(submod, data), assumed
