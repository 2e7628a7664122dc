"""Compile each piece of a split graph: Inductor (default) or eager.

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
from compile_backend.compile.layer_sharing import (AsLayer, assume_for, assumed_since,
                                                  layer_alias_for, piece_key, piece_symbols,
                                                  shape_env_mark)
from compile_backend.compile.mutations import versions, written_inputs
from compile_backend.compile.split import Piece

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


class _PieceCompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake inputs; at each piece, compiles it with the
    fake (symbolic) arguments it receives. Version counters read around each
    piece's fake run tell which inputs it writes."""

    def __init__(self, split_gm, pieces, compiler, cache, serializable, bar):
        super().__init__(split_gm)
        self.pieces = {p.name: p for p in pieces}
        self.compiler = compiler
        self.cache = cache
        self.serializable = serializable
        self.bar = bar
        self.compiled: dict[str, Callable[..., Any]] = {}

    def call_module(self, target, args, kwargs):
        assert not kwargs, kwargs
        piece = self.pieces[target]
        submod = getattr(self.module, target)
        before = versions(args)
        out = super().call_module(target, args, kwargs)  # fake outputs, uncompiled
        piece.written_inputs = written_inputs(args, before)
        if piece.captured:
            key, names = piece_key(submod, args)
            hit = self.cache.get(key) if key else None
            # Equal up to renaming size symbols: what the compile assumed of its
            # piece's symbols must hold for this piece's too (then it is guarded).
            if hit is not None and not assume_for(hit.assumed, hit.symbols, args):
                hit = None
            if hit is None:
                mark = shape_env_mark(args)
                fn = compile_piece(submod, args, self.compiler, self.serializable)
                counters["piece_compiles"] += 1
                if key and key not in self.cache:  # the first artifact is the one shared
                    symbols = piece_symbols(args)
                    self.cache[key] = _Shared(fn, names, piece.name,
                                              assumed_since(mark, symbols), symbols)
            else:
                fn, compiled_names, piece.compiled_as = hit.fn, hit.names, hit.piece
                counters["piece_compile_reuses"] += 1
                piece.layer_alias = layer_alias_for(compiled_names, names)
                if piece.layer_alias is not None:
                    fn = AsLayer(fn, piece.layer_alias)
            self.bar.update(note=f"{piece.name} {'shared' if hit else 'compiled'}")
        else:
            fn = submod  # breakpoints (and capture fallbacks) run eagerly
        self.compiled[target] = fn
        return out


def compile_pieces(
    split_gm: torch.fx.GraphModule,
    pieces: list[Piece],
    example_inputs: Sequence[Any],
    compiler: str,
    serializable: bool = False,
) -> tuple[dict[str, Callable[..., Any]], frozenset[int]]:
    """Compile every piece of `split_gm` (each piece's `written_inputs`,
    `compiled_as` and `layer_alias` set on the way); returns the callables by
    piece name and the indices of `split_gm`'s inputs the whole graph writes.
    `serializable`: Inductor pieces as artifacts that can be saved."""
    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
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
        interp = _PieceCompileInterpreter(split_gm, pieces, compiler, cache={},
                                          serializable=serializable, bar=bar)
        before = versions(fake_args)
        # As Dynamo traced: ops' symbolic-shape rules (F.pad's constant_pad_nd,
        # say) are Python registrations that only the Python dispatcher runs.
        with fake_mode, enable_python_dispatcher():
            interp.run(*fake_args)
    return interp.compiled, written_inputs(fake_args, before)


def install_pieces(split_gm: torch.fx.GraphModule, fns: dict[str, Callable[..., Any]]) -> None:
    """Replace each piece submodule of `split_gm` by its callable."""
    for name, fn in fns.items():
        setattr(split_gm, name, _as_module(fn))


def call_pieces_directly(split_gm: torch.fx.GraphModule, names: Sequence[str]) -> None:
    """split_gm's code calls `self.<piece>(...)`. An instance attribute of that
    name shadows the submodule, so the step calls the piece's callable itself,
    without nn.Module.__call__ (microseconds per piece, twice per layer; pieces
    carry no hooks). The submodules stay for tools that walk modules (the
    dump, depyf). Call it last: a GraphModule's forward changes when it is
    recompiled, and this binds the current one."""
    for name in names:
        module = split_gm._modules[name]
        if isinstance(module, _CallableModule):
            fn = module.fn
        else:
            # A lazily recompiled GraphModule's forward recompiles, then goes
            # through __call__: generate its code now and bind the real one.
            if hasattr(module, "real_recompile"):
                module.real_recompile()
            fn = module.forward
        object.__setattr__(split_gm, name, fn)


class _CallableModule(torch.nn.Module):
    """Holds a plain callable where split_gm expects a submodule."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _as_module(fn: Callable[..., Any]) -> torch.nn.Module:
    return fn if isinstance(fn, torch.nn.Module) else _CallableModule(fn)
