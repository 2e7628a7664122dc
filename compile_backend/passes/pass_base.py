"""The base classes of the mrv2 FX passes.

A pass is a class: `__call__(graph)` edits the graph in place and returns a
`PassReport` (did it change anything, and a JSON-friendly account of what);
`uuid()` hashes the pass's source and settings, so that a compile cache keyed
on it notices when a pass or its configuration changed. The node helpers are
in fx_nodes.py, the effect analysis in effects.py.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from .fx_nodes import runs_eagerly


@dataclass
class PassReport:
    changed: bool
    details: dict[str, Any] = field(default_factory=dict)  # JSON-friendly


class Mrv2Pass:
    """Subclasses implement `apply(graph) -> PassReport` and `settings()`."""

    def __call__(self, graph: torch.fx.Graph) -> PassReport:
        report = self.apply(graph)
        assert isinstance(report, PassReport), report
        return report

    def apply(self, graph: torch.fx.Graph) -> PassReport:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return type(self).__name__

    def settings(self) -> dict[str, Any]:
        """Everything besides the source that decides what the pass does."""
        return {}

    def uuid(self) -> str:
        h = hashlib.sha256()
        for module_name in _modules_behind(type(self)):
            h.update(_module_source(module_name).encode())
        h.update(json.dumps(self.settings(), sort_keys=True, default=str).encode())
        return h.hexdigest()


class OptionalPass(Mrv2Pass):
    """A rewrite a config option switches on or off (`enabled`; off: the graph
    stays as it is), with the op registry it consults. Its report lists at
    most MAX_LISTED entries per kind."""

    MAX_LISTED = 200

    def __init__(self, roles: Any, enabled: bool = True) -> None:
        self.roles = roles  # an OpRegistry
        self.enabled = enabled

    def settings(self) -> dict[str, Any]:
        return {"enabled": self.enabled}

    def eager(self, node: torch.fx.Node) -> bool:
        """Does `node` run eagerly (marked by the safety pass, or by role)?"""
        return runs_eagerly(node, self.roles)


_PACKAGE = __name__.rpartition(".")[0]  # compile_backend.passes
_SOURCES: dict[str, str] = {}


def _modules_behind(cls: type) -> list[str]:
    """The modules whose source decides what a pass of class `cls` does: those
    of its classes and, transitively, the modules of passes/ they take
    functions or classes from (fx_nodes.py, effects.py; a module's constants
    come with its functions). Sorted, each once."""
    todo = [c.__module__ for c in cls.__mro__ if c is not object]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            try:
                owner = getattr(value, "__module__", None)
            except Exception:  # noqa: BLE001 (objects whose attributes are computed)
                continue
            if isinstance(owner, str) and owner.startswith(_PACKAGE + ".") and owner not in seen:
                todo.append(owner)
    return sorted(seen)


def _module_source(module_name: str) -> str:
    if module_name not in _SOURCES:
        try:
            _SOURCES[module_name] = inspect.getsource(sys.modules[module_name])
        except (OSError, TypeError, KeyError):
            _SOURCES[module_name] = module_name
    return _SOURCES[module_name]
