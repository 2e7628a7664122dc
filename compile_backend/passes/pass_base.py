"""The base classes of the mrv2 FX passes.

A pass is a class: `__call__(graph)` edits the graph in place and returns a
`PassReport` (did it change anything, and a JSON-friendly account of what);
`uuid()` hashes the pass's source and settings, so that a compile cache keyed
on it notices when a pass or its configuration changed. `FusionPass` is the
skeleton of the passes that replace a pattern by one `mrv2::` op: a subclass
says how to find a match and how to rewrite it. The node helpers are in
fx_nodes.py, the effect analysis in effects.py; docs/design.md, "The FX
passes", lists the files and the rules they share.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from compile_backend.core.counters import counters

from .fx_nodes import registered_op, runs_eagerly


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


class FusionPass(Mrv2Pass):
    """A rewrite of matched nodes into one call of `torch.ops.mrv2.<OP>`
    (registered by compile_backend/kernels/, which the backend imports before
    the passes run), switched by a config option (`enabled`; off: the graph
    stays as it is). `apply` finds every match first (`find`, in graph order,
    on the unchanged graph), rewrites each (`fuse`), counts, logs and
    reports; without the op it rewrites nothing and reports every match as
    not fused (`unfused`). The report lists at most MAX_LISTED entries per
    kind unless `listed` says otherwise."""

    MAX_LISTED = 200
    OP: str  # the fused op's name in the mrv2 namespace
    COUNTER: str  # counters[COUNTER] += count(fused)
    LOG: str  # an INFO line with log_args(fused), when something was fused
    FUSED_KEY = "fused"  # the report's list of what was fused

    def __init__(self, roles: Any, enabled: bool = True) -> None:
        self.roles = roles  # an OpRegistry
        self.enabled = enabled

    def settings(self) -> dict[str, Any]:
        return {"enabled": self.enabled}

    def eager(self, node: torch.fx.Node) -> bool:
        """Does `node` run eagerly (marked by the safety pass, or by role)?"""
        return runs_eagerly(node, self.roles)

    # ---- what a subclass fills in ------------------------------------------------

    def find(self, graph: torch.fx.Graph, not_fused: list[dict[str, Any]]) -> list[Any]:
        """The matches to rewrite, in graph order; each pattern seen and not
        taken goes to `not_fused` with its reason. Must not edit the graph."""
        raise NotImplementedError

    def fuse(self, graph: torch.fx.Graph, match: Any, op: Any) -> dict[str, Any]:
        """Rewrite one match into a call of `op`, erase what it replaced, and
        return the report's JSON-friendly entry for it."""
        raise NotImplementedError

    def unfused(self, match: Any, reason: str) -> dict[str, Any]:
        """The report's `not_fused` entry of a match left as it is."""
        raise NotImplementedError

    def count(self, fused: list[dict[str, Any]]) -> int:
        return len(fused)

    def log_args(self, fused: list[dict[str, Any]]) -> tuple[Any, ...]:
        return (len(fused),)

    def listed(self, fused: list[dict[str, Any]]) -> dict[str, Any]:
        """The report's entries for what was fused."""
        return {self.FUSED_KEY: fused[: self.MAX_LISTED], "num_fused": len(fused)}

    # ---- the skeleton ------------------------------------------------------------------

    def fused_op(self) -> Any:
        """`torch.ops.mrv2.<OP>.default`, or None when it is not registered."""
        return registered_op("mrv2", self.OP)

    def apply(self, graph: torch.fx.Graph) -> PassReport:
        details: dict[str, Any] = {"enabled": self.enabled, self.FUSED_KEY: [], "not_fused": []}
        if not self.enabled:
            return PassReport(changed=False, details=details)
        not_fused: list[dict[str, Any]] = []
        matches = self.find(graph, not_fused)
        op = self.fused_op()
        if matches and op is None:
            why = (f"mrv2::{self.OP} is not registered: import compile_backend.kernels "
                   "(the backend does, before the passes)")
            not_fused += [self.unfused(m, why) for m in matches]
            matches = []
        fused = [self.fuse(graph, m, op) for m in matches]
        counters[self.COUNTER] += self.count(fused)
        if fused:
            logging.getLogger(type(self).__module__).info(self.LOG, *self.log_args(fused))
        details.update(self.listed(fused))
        details["not_fused"] = not_fused[: self.MAX_LISTED]
        return PassReport(changed=bool(fused), details=details)

    @classmethod
    def fused_in(cls, pass_log: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What this pass fused (its report's FUSED_KEY list), from a PassManager log."""
        return [f for entry in pass_log if entry.get("pass") == cls.__name__
                for f in entry.get("details", {}).get(cls.FUSED_KEY, [])]


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
