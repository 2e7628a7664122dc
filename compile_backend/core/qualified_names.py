"""Functions named as `module:qualname`, a name that another process (or a
later one) can turn back into the function by importing its module.

    qualified_name(fn)                  # "pkg.mod:Outer.fn"
    resolve("pkg.mod:Outer.fn")         # imports pkg.mod, returns the function

Used for a saved list of Triton kernels (runtime/kernel_precompile.py) and
for the jobs of compile workers (compile/compile_workers.py).
"""

from __future__ import annotations

import importlib
from typing import Any


def qualified_name(fn: Any) -> str:
    """`module:qualname` of a function (or class); `?` for a part it lacks."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', '?')}"


def resolve(name: str) -> Any:
    """What `module:qualname` names (imports the module; AttributeError or
    ImportError where it does not resolve)."""
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
