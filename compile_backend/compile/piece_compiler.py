"""Compile each piece of a split graph: Inductor (default) or eager.

With Inductor, a piece holding fewer ops it could fuse than
`inductor_min_fusible_ops` runs as traced instead (compile/fusible.py).

The token dimension is symbolic, so one compile per distinct piece serves all
batch sizes. Identical pieces (same code, same symbolic input specs: the
transformer layers of a model) share one compiled artifact: with Dynamo's
default `inline_inbuilt_nn_modules`, parameters are graph inputs, so the
layers' pieces differ only in which tensors are passed in, and in the layer
names of their attention-like ops (compile/layer_sharing.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from compile_backend.core.counters import counters
from compile_backend.core.progress import progress
from compile_backend.compile.layer_sharing import (assume_for, assumed_since,
                                                  layer_alias_for, piece_key, piece_symbols,
                                                  shape_env_mark)
from compile_backend.compile.fusible import fusible_ops
from compile_backend.passes.fx_nodes import example_value
from compile_backend.compile.piece_calls import AsLayer
from compile_backend.compile.mutations import versions, written_inputs
from compile_backend.compile.split import Piece
from compile_backend.compile.worker_compile import loaded_from_worker, send_to_worker

logger = logging.getLogger(__name__)


def compile_piece(
    gm: torch.fx.GraphModule, fake_args: Sequence[Any], compiler: str, serializable: bool = False
) -> Callable[..., Any]:
    if compiler == "eager":
        return gm
    assert compiler == "inductor", compiler
    counters["inductor_compiles"] += 1
    # Inference only: with grad off, AOTAutograd builds no backward graph.
    with torch.no_grad():
        if serializable:
            # An artifact that can be saved (compile/step_artifacts.py); the
            # symbolic shapes come from Dynamo's tracing context, as compile_fx's do.
            from torch._inductor import standalone_compile

            return standalone_compile(gm, list(fake_args), dynamic_shapes="from_tracing_context")
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(fake_args))


class _Shared(NamedTuple):
    """A compiled piece that later identical pieces may run (layer_sharing.py)."""

    fn: Callable[..., Any]
    names: list[str]  # its layer names, op order
    piece: str  # the piece it was compiled for
    assumed: list[Any]  # what compiling it assumed of its size symbols
    symbols: list[Any]  # those symbols, in the order piece_key renames them


class _Met(NamedTuple):
    """A captured piece as the fake run met it: what deciding its callable needs."""

    piece: Piece
    submod: torch.fx.GraphModule
    args: tuple  # its fake (symbolic) arguments
    key: str | None  # piece_key: equal keys may share one compile
    names: list[str]  # its layer names, op order


class _PieceCompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake inputs, noting each captured piece with
    the fake (symbolic) arguments it receives; version counters read around
    each piece's fake run tell which inputs it writes. With compile workers,
    the first piece of each key goes to them as soon as it is met
    (compile/compile_workers.py); `decide` then picks every piece's callable
    in order."""

    def __init__(self, split_gm, pieces, compiler, serializable, workers, bar, min_fusible):
        super().__init__(split_gm)
        self.pieces = {p.name: p for p in pieces}
        self.compiler = compiler
        self.min_fusible = min_fusible
        self.serializable = serializable
        self.workers = workers
        self.bar = bar
        self.met: list[_Met] = []
        self.sent: dict[str, Any] = {}  # key -> the future of its compile in a worker
        self.compiled: dict[str, Callable[..., Any]] = {}

    def call_module(self, target, args, kwargs):
        assert not kwargs, kwargs
        piece = self.pieces[target]
        submod = getattr(self.module, target)
        before = versions(args)
        out = super().call_module(target, args, kwargs)  # fake outputs, uncompiled
        piece.written_inputs = written_inputs(args, before)
        if not piece.captured:
            self.compiled[target] = submod  # breakpoints (and capture fallbacks) run eagerly
            return out
        piece.fusible_ops = fusible_ops(submod)
        piece.compiled_with = self.compiler
        if self.compiler == "inductor" and len(piece.fusible_ops) < self.min_fusible:
            piece.compiled_with = "eager"  # the same launches without Inductor (fusible.py)
            counters["pieces_without_inductor"] += 1
        key, names = piece_key(submod, args)
        self.met.append(_Met(piece, submod, tuple(args), key, names))
        sent_as = key or piece.name
        # A collective compiles here: a worker has no process group to resolve its group by.
        if (self.workers is not None and piece.compiled_with == "inductor" and not piece.collectives
                and sent_as not in self.sent):
            # None: it could not be sent, compiled here (the others of its key are not tried)
            self.sent[sent_as] = send_to_worker(self.workers, submod, args,
                                                self._here(piece, submod, args))
        return out

    def _here(self, piece, submod, args):
        """This process's compile of a piece, and what it assumed of its symbols."""
        def compile_here():
            mark = shape_env_mark(args)
            fn = compile_piece(submod, args, piece.compiled_with, self.serializable)
            return fn, assumed_since(mark, piece_symbols(args))
        return compile_here

    def decide(self) -> None:
        """Each captured piece's callable, in order: the artifact of an equal
        piece whose assumptions hold for it, or its own compile (a worker's,
        or this process's)."""
        cache: dict[str, _Shared] = {}
        for met in self.met:
            piece = met.piece
            hit = cache.get(met.key) if met.key else None
            # Equal up to renaming size symbols: what the compile assumed of its
            # piece's symbols must hold for this piece's too (then it is guarded).
            if hit is not None and not assume_for(hit.assumed, hit.symbols, met.args):
                hit = None
            if hit is None:
                future = self.sent.pop(met.key or piece.name, None)
                fn, assumed = self._compiled(met, future)
                counters["piece_compiles"] += 1
                if met.key and met.key not in cache:  # the first artifact is the one shared
                    cache[met.key] = _Shared(fn, met.names, piece.name, assumed,
                                             piece_symbols(met.args))
            else:
                fn, piece.compiled_as = hit.fn, hit.piece
                counters["piece_compile_reuses"] += 1
                piece.layer_alias = layer_alias_for(hit.names, met.names)
                if piece.layer_alias is not None:
                    fn = AsLayer(fn, piece.layer_alias)
            self.compiled[piece.name] = fn
            self.bar.update(note=f"{piece.name} {'shared' if hit else 'compiled'}")

    def _compiled(self, met: _Met, future: Any) -> tuple[Callable[..., Any], list[Any]]:
        """`met`'s own compile: the worker's where it sent one and it holds here,
        else this process's."""
        if future is not None:
            try:
                where, value = future.result()
                if where == "here":
                    return value
                fn, assumed = loaded_from_worker(met.submod, value)
            except Exception as e:  # noqa: BLE001 - compiled here instead, the reason logged
                counters["compile_worker_fallbacks"] += 1
                logger.warning("mrv2: piece %s was not compiled by a compile worker, compiling "
                               "it here: %s", met.piece.name, e)
            else:
                # What the worker's compile assumed, guarded here as a sharer's is.
                if assume_for(assumed, piece_symbols(met.args), met.args):
                    counters["compile_worker_compiles"] += 1
                    counters["inductor_compiles"] += 1  # the worker counted it in its own process
                    return fn, assumed
                counters["compile_worker_fallbacks"] += 1
                logger.warning("mrv2: piece %s compiled in a worker assumed %s of its sizes, "
                               "which does not hold here; compiling it here", met.piece.name,
                               assumed)
        return self._here(met.piece, met.submod, met.args)()


def compile_pieces(
    split_gm: torch.fx.GraphModule,
    pieces: list[Piece],
    example_inputs: Sequence[Any],
    compiler: str,
    serializable: bool = False,
    workers: Any = None,
    min_fusible: int = 0,
) -> tuple[dict[str, Callable[..., Any]], frozenset[int]]:
    """Compile every piece of `split_gm` (each piece's `written_inputs`,
    `compiled_as` and `layer_alias` set on the way); returns the callables by
    piece name and the indices of `split_gm`'s inputs the whole graph writes.
    `serializable`: Inductor pieces as artifacts that can be saved.
    `workers`: CompileWorkers that compile distinct Inductor pieces in
    parallel with each other and with this process (None: one by one here).
    `min_fusible`: with Inductor, a piece with fewer ops it could fuse runs
    as traced (each piece's `compiled_with` says which)."""
    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    vals = [example_value(n) for n in placeholders]
    # The fake mode Dynamo traced with (its symbolic shapes live in it).
    fake_mode = next(
        (v.fake_mode for v in vals if isinstance(v, FakeTensor)), None
    ) or detect_fake_mode(example_inputs)
    fake_args = []
    for val, real in zip(vals, example_inputs):
        if val is None:
            val = fake_mode.from_tensor(real) if isinstance(real, torch.Tensor) else real
        fake_args.append(val)
    with progress(f"compiling pieces ({compiler})", total=sum(p.captured for p in pieces),
                  unit="piece") as bar:
        interp = _PieceCompileInterpreter(split_gm, pieces, compiler, serializable, workers, bar,
                                          min_fusible)
        before = versions(fake_args)
        # As Dynamo traced: ops' symbolic-shape rules (F.pad's constant_pad_nd,
        # say) are Python registrations that only the Python dispatcher runs.
        with fake_mode, enable_python_dispatcher():
            interp.run(*fake_args)
            if workers is not None:
                workers.run_queued_here()  # what no worker took yet: compiled here meanwhile
            interp.decide()
    return interp.compiled, written_inputs(fake_args, before)
