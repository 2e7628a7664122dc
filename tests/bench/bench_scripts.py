"""Load a bench/ script as a module (bench/ is a folder of scripts, not a
package), registered in sys.modules for the test only."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench_script(name, monkeypatch):
    """bench/<name>.py as the module `bench_<name>` (monkeypatch undoes it)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}",
                                                  os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, f"bench_{name}", module)
    spec.loader.exec_module(module)
    return module
