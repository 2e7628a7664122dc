"""Which calls of the metadata-reading ops a capture recorded, and where.

A FULL plan derives a size's mixed graph from its decode graph (docs/design.md,
"A mixed graph derived from the decode graph"): the two differ only in the
launches of the ops that read the step's metadata (the layer-keyed ops:
attention, the KV write, short convolutions, KV compressors). While the decode
graph records, `recording(count)` notes each such call: the op, its arguments
(tensors as non-owning aliases: the capture's memory stays the graph's to
reuse) and `count()` before and after it (the nodes the capturing graph has).
Ops take part by being defined through `recordable(name, impl)`
(core/op_definition.py and core/direct_calls.py do it for every op they
define), saying whether their launches ever differ between forms and how
to write a returned tensor into a given one.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from compile_backend.core import forward_context

_RECORDABLE: set[str] = set()  # ops whose every call goes through `recordable`
# Ops whose launches are the same in every form of a step of one size (they
# read only the metadata's tensors, no Python int): a recorder skips them.
_SAME_LAUNCHES: set[str] = set()
# op -> into(out, *args, **kwargs): the op made again writing its result into
# `out` (for an op that returns a tensor: the step reads it at that address).
_INTO: dict[str, Callable[..., Any]] = {}


@dataclass
class OpCall:
    name: str  # "ns::op"
    impl: Callable[..., Any]
    args: tuple  # tensors as non-owning aliases
    kwargs: dict
    first: int  # nodes the capturing graph had before the call
    end: int  # and after it: the call added nodes [first, end)
    layer_alias: dict | None = None  # the layer names it served (a shared piece's call)
    out: Any = None  # what it returned (a non-owning alias), if a tensor

    def again(self) -> Any:
        """The call made again, serving the same layers, writing its result
        where the first call's was (`into`; an op returning a tensor without
        one raises: `repeatable` says so first)."""
        if self.out is not None:
            into = _INTO[self.name]
            fn = (lambda *a: into(self.out, *a, **self.kwargs))
        else:
            fn = (lambda *a: self.impl(*a, **self.kwargs))
        if self.layer_alias is None:
            return fn(*self.args)
        return forward_context.call_as_layers(self.layer_alias, fn, *self.args)

    @property
    def repeatable(self) -> bool:
        return self.out is None or self.name in _INTO


class Recorder:
    """The calls one capture made of the ops named in `names`."""

    def __init__(self, names: set[str], count: Callable[[], int],
                 alias: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.names, self.count, self.alias = names, count, alias
        self.calls: list[OpCall] = []
        self._inside = False  # a recorded op calling another: one call, the outer one

    def call(self, name: str, impl: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if name not in self.names or self._inside or name in _SAME_LAUNCHES:
            return impl(*args, **kwargs)
        first = self.count()
        self._inside = True
        try:
            out = impl(*args, **kwargs)
        finally:
            self._inside = False
        self.calls.append(OpCall(name, impl, self._aliased(args), self._aliased(kwargs),
                                 first, self.count(), forward_context._layer_alias,
                                 self.alias(out) if isinstance(out, torch.Tensor) else None))
        return out

    def _aliased(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.alias(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self._aliased(v) for v in value)
        if isinstance(value, dict):
            return {k: self._aliased(v) for k, v in value.items()}
        return value


_active: Recorder | None = None


def recordable(name: str, impl: Callable[..., Any], *, every_call: bool = True,
               same_launches: bool = False, into: Callable[..., Any] | None = None
               ) -> Callable[..., Any]:
    """`impl` (op `name`'s body), noted by an active recorder. `every_call`:
    this is the body every call of the op runs (the one the dispatcher
    calls), so the op counts as recordable; a second path (a direct call
    beside the dispatcher's) passes False. `same_launches`: its launches
    never depend on the step's form (not recorded). `into(out, *args)`: for
    an op returning a tensor, the op writing it into `out`."""
    if every_call:
        _RECORDABLE.add(name)
    if same_launches:
        _SAME_LAUNCHES.add(name)
    if into is not None:
        _INTO[name] = into

    @functools.wraps(impl)
    def call(*args: Any, **kwargs: Any) -> Any:
        rec = _active
        if rec is None:
            return impl(*args, **kwargs)
        return rec.call(name, impl, args, kwargs)

    return call


def all_recordable(names: Iterable[str]) -> list[str]:
    """The ops of `names` not defined through `recordable` ([]: all were)."""
    return sorted(n for n in names if n not in _RECORDABLE)


@contextlib.contextmanager
def recording(names: Iterable[str], count: Callable[[], int],
              alias: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[Recorder]:
    """Note the calls of the ops `names` made inside (not nested)."""
    global _active
    assert _active is None, "op recordings do not nest"
    rec = _active = Recorder(set(names), count, alias)
    try:
        yield rec
    finally:
        _active = None
