"""Who imports a module, and how long its import takes: for startup
measurements (bench/startup.py) and the warm-start tests, which check that a
warm start that loads its step without Dynamo never imports it.

    watch = ImportWatch("torch._dynamo")      # before anything imports it
    ...                                       # the work
    watch.importer, watch.seconds             # None / who, its import's seconds

Installed first on `sys.meta_path`; it finds nothing itself (the usual
finders do), it only notes the first import and times the module's load.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from typing import Any, Callable


def importer(frame: Any) -> str:
    """Who is importing, from the importing frame outwards: the function
    torch's lazy `_disable_dynamo` wrapper was about to run (torch wraps a
    dispatch mode's handler so: the CPU graph stand-in's is one), else the
    innermost frame of mrv2 (`file.py:function`), else "?"."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(os.path.join("torch", "_compile.py")) and "fn" in frame.f_locals:
            return getattr(frame.f_locals["fn"], "__qualname__", "?")
        if f"{os.sep}compile_backend{os.sep}" in code.co_filename:
            return f"{os.path.basename(code.co_filename)}:{code.co_name}"
        frame = frame.f_back
    return "?"


class ImportWatch(importlib.abc.MetaPathFinder):
    """Notes the first import of `name` (who, `importer`), times its load
    (`seconds`, the module with everything it imports) and calls
    `on_import(module)` after it."""

    def __init__(self, name: str, on_import: Callable[[Any], None] | None = None) -> None:
        self.name = name
        self.on_import = on_import
        self.importer: str | None = None if name not in sys.modules else "before the watch"
        self.seconds = 0.0
        sys.meta_path.insert(0, self)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name or self.importer is not None:
            return None
        self.importer = importer(sys._getframe(1))
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            t = time.perf_counter()
            try:
                run(module)
            finally:
                self.seconds = time.perf_counter() - t
            if self.on_import is not None:
                self.on_import(module)
        spec.loader.exec_module = exec_module
        return spec
