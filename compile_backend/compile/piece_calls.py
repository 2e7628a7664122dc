"""How a split graph calls its pieces' callables: installed where its code
calls `self.<piece>(...)`, bound without nn.Module.__call__, and run as
another layer where a piece shares a compiled layer's artifact
(compile/layer_sharing.py). Light on purpose: a warm start that loads a
saved step imports this, and neither Dynamo nor sympy (tests/test_imports.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx

from compile_backend.core.forward_context import call_as_layers


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


class AsLayer:
    """A piece's compiled artifact, compiled for another layer, run as this
    piece's layer(s)."""

    def __init__(self, fn: Callable[..., Any], alias: dict[str, str]) -> None:
        self.fn = fn
        self.alias = alias

    def __call__(self, *args: Any) -> Any:
        return call_as_layers(self.alias, self.fn, *args)

    def __repr__(self) -> str:
        return f"AsLayer({self.alias})"
