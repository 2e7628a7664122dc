"""The `mrv2` Dynamo backend: `(gm, example_inputs) -> CompiledStep`.

`Mrv2Backend(config)` is the backend as an object: its configuration (and,
from a runner, the graph mode already lowered) is held, never re-parsed.
`mrv2_backend(gm, example_inputs, mode=, options=)` is the entry point torch
finds by name (the `torch_dynamo_backends` entry point, pyproject.toml): it
builds the config from torch.compile's options and calls one. Nothing here
registers the backend at import time: PyTorch registers entry points itself
and rejects a second registration of the same name.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx

from compile_backend.core.config import CompilationConfig
from compile_backend.core.counters import counters
from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.core.op_registry import OpRegistry
from compile_backend.runtime.machine import graph_mode_on_this_machine

logger = logging.getLogger(__name__)


def _run_passes(gm: torch.fx.GraphModule, config: CompilationConfig, roles: OpRegistry):
    if not config.enable_passes:
        return [], None
    from compile_backend.passes import PassManager  # local: passes imports compile_backend

    manager = PassManager.from_config(config, roles)
    manager(gm.graph)
    gm.recompile()
    return manager.log, manager.uuid()


def _pack_fused_weights(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                        pass_log: list[dict[str, Any]]) -> list[list[int]]:
    """Pack the weights (and biases) of each group of sibling linears the
    passes fused (compile_backend/passes/fuse_sibling_linears.py) into one tensor, in place:
    the parameters become row slices of it (compile_backend/core/packed_weights.py,
    `pack_siblings`). Returns the groups as indices of graph inputs, which
    the step keeps: a step loaded in another process packs them at its first
    call. What happened is added to each group's entry in the pass log."""
    from compile_backend.core.packed_weights import pack_siblings
    from compile_backend.passes.fuse_sibling_linears import fused_groups

    index = {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    packed: list[list[int]] = []
    for group in fused_groups(pass_log):
        group["packing"] = {}
        for what in ("weights", "biases"):
            if group[what]:
                idx = [index[name] for name in group[what]]
                packed.append(idx)
                group["packing"][what] = pack_siblings([example_inputs[i] for i in idx])
    return packed


def _names_and_stable(args: Sequence[Any]) -> tuple[list[str], list[int]]:
    """Names of graph inputs, and the indices of those that are parameters or
    buffers (stable addresses: `debug_checks` names them if they move)."""
    names = [a.name if isinstance(a, torch.fx.Node) else repr(a) for a in args]
    return names, [i for i, a in enumerate(args) if _is_parameter_or_buffer(a)]


def _fixed_shapes(args: Sequence[Any]) -> list[int]:
    """Indices of the inputs that are tensors of a fixed shape: no symbolic
    size in their example value. Dynamo guards such a shape, so a call with
    another is another compiled graph; a wrapper's lazy key leaves them out.
    An input without an example value (a piece's input made by the split)
    is not counted fixed."""
    from compile_backend.passes.fx_nodes import example_value  # compile time: sympy is in

    out = []
    for i, a in enumerate(args):
        value = example_value(a)
        if isinstance(value, torch.Tensor) and all(type(d) is int for d in value.shape):
            out.append(i)
    return out


def _is_parameter_or_buffer(node: Any) -> bool:
    grapharg = node.meta.get("grapharg") if isinstance(node, torch.fx.Node) else None
    source = grapharg.source.name if grapharg is not None and grapharg.source else ""
    source = source() if callable(source) else source
    return "_parameters" in source or "_buffers" in source


def _inputs_needing_grad(example_inputs: Sequence[Any]) -> int:
    """How many inputs require grad while grad is on (0 when it is off)."""
    if not torch.is_grad_enabled():
        return 0
    return sum(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


class Mrv2Backend:
    """The backend, configured once. `graph_mode`: the mode the pieces get,
    already lowered by the caller (a ModelRunner lowers for the machine and
    its metadata builders, and says why in `mode_reason`); None: lowered
    here, for this machine (plain torch.compile use)."""

    def __init__(self, config: CompilationConfig, graph_mode: CUDAGraphMode | None = None,
                 mode_reason: str | None = None) -> None:
        assert isinstance(config, CompilationConfig), type(config)
        self.config = config
        self.graph_mode = graph_mode
        self.mode_reason = mode_reason
        self._workers: Any = None  # compile workers started ahead (start_workers)

    def start_workers(self) -> None:
        """Start the compile workers now, for the next compile: a runner calls
        it before Dynamo traces, so that they import torch meanwhile."""
        if self._workers is None:
            self._workers = _start_workers(self.config)

    def close_workers(self) -> None:
        """Stop workers started ahead that no compile took (Dynamo failed)."""
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()

    def __call__(self, gm: torch.fx.GraphModule,
                 example_inputs: Sequence[Any]) -> Callable[..., Any]:
        t0 = time.perf_counter()
        config = self.config
        import compile_backend.kernels  # noqa: F401  (registers the mrv2 ops' facts: their names resolve)

        roles = OpRegistry.from_config(config)  # misspelled op names raise, grad or not
        needs_grad = _inputs_needing_grad(example_inputs)
        if needs_grad:
            counters["grad_fallbacks"] += 1
            warnings.warn(
                f"mrv2 compiles for inference, but grad is enabled and {needs_grad} of this "
                "graph's inputs (parameters included) require grad: this graph runs "
                "uncompiled and without CUDA graphs, so that autograd still works. For "
                "graphs, call the compiled model under torch.no_grad() or "
                "torch.inference_mode().", stacklevel=2)
            self.close_workers()
            return gm.forward
        counters["dynamo_graphs"] += 1
        # Started first: they import torch while the passes and the fake run go on.
        workers = self._workers if self._workers is not None else _start_workers(config)
        self._workers = None
        try:
            return self._compile(gm, example_inputs, roles, workers, t0)
        finally:
            if workers is not None:
                workers.close()

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], roles: OpRegistry,
                 workers: Any, t0: float) -> Callable[..., Any]:
        # Here, not at import: these pull in Dynamo and sympy, which a process
        # that only loads a saved step or runs eagerly does not need
        # (tests/test_imports.py pins what importing the package costs).
        from compile_backend.compile.compiled_step import (FULL_GRAPH, CompiledStep, assemble_step,
                                                           register_with_dynamo)
        from compile_backend.compile.piece_compiler import compile_pieces
        from compile_backend.compile.split import split_graph

        config = self.config
        if self.graph_mode is None:
            graph_mode, mode_reason = graph_mode_on_this_machine(config.cudagraph_mode)
        else:
            graph_mode, mode_reason = self.graph_mode, self.mode_reason
        original_code = gm.code
        input_sources = _input_sources(gm)  # before the passes: Dynamo's placeholders
        pass_log, passes_uuid = _run_passes(gm, config, roles)
        passed_code = gm.code
        packed_inputs = _pack_fused_weights(gm, example_inputs, pass_log)

        split_gm, pieces = split_graph(gm, roles)
        counters["pieces"] += len(pieces)
        counters["eager_pieces"] += sum(not p.captured for p in pieces)
        for p in pieces:
            if p.eager_reasons:
                counters["capture_fallbacks"] += 1
        # Per captured piece (the split graph's call of it) and for the whole
        # graph: input names, which are parameters or buffers (their address
        # must never change between capture and replay), which have fixed shapes.
        calls = {n.target: n for n in split_gm.graph.nodes if n.op == "call_module"}
        captured = [p.name for p in pieces if p.captured]
        piece_inputs = {name: _names_and_stable(calls[name].args) for name in captured}
        placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
        graph_inputs = _names_and_stable(placeholders)
        fixed_shape_inputs = {FULL_GRAPH: _fixed_shapes(placeholders),
                              **{name: _fixed_shapes(calls[name].args) for name in captured}}
        fns, written = compile_pieces(split_gm, pieces, example_inputs, config.piece_compiler,
                                      serializable=config.serializable, workers=workers,
                                      min_fusible=config.inductor_min_fusible_ops)
        as_traced = [p.name for p in pieces if p.captured and p.compiled_with != config.piece_compiler]
        if as_traced:
            logger.info("mrv2: %d of %d captured pieces run as traced, without Inductor: each "
                        "holds fewer than %d ops it could fuse (inductor_min_fusible_ops)",
                        len(as_traced), sum(p.captured for p in pieces),
                        config.inductor_min_fusible_ops)
        register_with_dynamo()
        step = CompiledStep(
            config=config,
            roles=roles,
            graph_mode=graph_mode,
            mode_reason=mode_reason,
            original_code=original_code,
            passed_code=passed_code,
            split_gm=split_gm,
            pieces=pieces,
            pass_log=pass_log,
            passes_uuid=passes_uuid,
            piece_inputs=piece_inputs,
            graph_inputs=graph_inputs,
            fixed_shape_inputs=fixed_shape_inputs,
            written_inputs=written,
            packed_inputs=packed_inputs,
            input_sources=input_sources,
        )
        assemble_step(step, fns)
        step.compile_seconds = time.perf_counter() - t0
        logger.info(
            "mrv2: %d pieces (%d eager), mode %s, compiled in %.2fs",
            len(pieces), sum(not p.captured for p in pieces), graph_mode.value,
            step.compile_seconds,
        )
        if config.debug_dump_path:
            from compile_backend.debug.dump import write_compile_dump

            write_compile_dump(config.debug_dump_path, step)
        return step


def _input_sources(gm: torch.fx.GraphModule) -> list[str | None]:
    """Where Dynamo took each graph input from, as its source's name
    (`L['input_ids']`, `L['self']._modules['embed']._parameters['weight']`,
    `L['input_ids'].size()[0]`); None where a placeholder has no source.
    compile/direct_step.py calls a saved step with inputs found this way."""
    names: list[str | None] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node, "_dynamo_source", None)
        if source is None and "grapharg" in node.meta:
            source = node.meta["grapharg"].source
        name = getattr(source, "name", None)
        names.append(name() if callable(name) else name)
    return names


# What a compile worker imports before its first piece (while the caller traces).
WORKER_PRELOAD = ("torch._inductor.compile_fx", "torch._inductor.standalone_compile",
                  "torch.fx._graph_pickler", "compile_backend.compile.piece_compiler",
                  "compile_backend.kernels")


def _start_workers(config: CompilationConfig) -> Any:
    """Compile workers for Inductor pieces (compile/compile_workers.py), or
    None: eager pieces, `compile_workers=0`, or none could start (logged)."""
    if config.piece_compiler != "inductor":
        return None
    from compile_backend.compile.compile_workers import CompileWorkers, auto_workers

    n = auto_workers() if config.compile_workers is None else config.compile_workers
    if n == 0:
        return None
    try:
        return CompileWorkers(n, preload=WORKER_PRELOAD)
    except OSError as e:
        counters["compile_worker_fallbacks"] += 1
        logger.warning("mrv2: no compile workers (%s: %s); pieces compile in this process, "
                       "one after another", type(e).__name__, e)
        return None


def mrv2_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """The entry point torch.compile(backend="mrv2", mode=..., options=...) calls."""
    return Mrv2Backend(CompilationConfig.from_options(options, mode))(gm, example_inputs)


def backend(**options: Any) -> Mrv2Backend:
    """The mrv2 backend with `options` bound and checked now, so that misuse
    fails at `torch.compile` time with its own message (not at the first call,
    inside Dynamo's error), and so that a graph mode combines with other
    options (torch refuses `mode=` together with `options=`):

        torch.compile(model, backend=compile_backend.backend(
            cudagraph_mode="full", piece_compiler="eager"))
    """
    config = CompilationConfig.from_options(options)
    import compile_backend.kernels  # noqa: F401  (registers the mrv2 ops' facts: their names resolve)

    OpRegistry.from_config(config)  # op names resolve now
    return Mrv2Backend(config)
