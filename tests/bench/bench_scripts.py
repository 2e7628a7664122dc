"""Load a bench/ script as a module (bench/ is a folder of scripts, not a
package), registered in sys.modules for the test only. The scripts also put
bench/ and the repository on sys.path and import their siblings as top-level
modules (decode, workload, timing, report); tests/bench/conftest.py undoes
that after every test, so no later import resolves a name to a bench/ file."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")


def load_bench_script(name, monkeypatch):
    """bench/<name>.py as the module `bench_<name>` (monkeypatch undoes it)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, f"bench_{name}", module)
    spec.loader.exec_module(module)
    return module


def bench_modules() -> list[str]:
    """Names in sys.modules whose file lies in bench/."""
    def in_bench(module):
        path = getattr(module, "__file__", None)
        return bool(path) and os.path.dirname(os.path.abspath(path)) == BENCH
    return [name for name, module in list(sys.modules.items()) if in_bench(module)]
