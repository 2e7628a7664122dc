"""bench/ scripts run with bench/ first on sys.path, so a script's file name
shadows any top-level module of that name for everything the script imports.
transformers imports `kernels` when it finds one (bench/kernels.py was found
and broke LlamaConfig), so no bench/ name may be a standard-library module,
an installed top-level module, or an optional package transformers probes."""

import importlib.util
import inspect
import os
import re
import sys

from bench_scripts import BENCH


def _stems() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(BENCH) if f.endswith(".py"))


def _probed_by_transformers() -> set[str]:
    try:
        import transformers.utils.import_utils as import_utils
    except ImportError:
        return set()
    return set(re.findall(r'_is_package_available\(\s*"([\w.]+)"', inspect.getsource(import_utils)))


def test_no_bench_script_shadows_a_module():
    stems = _stems()
    assert "decode" in stems and "timing" in stems  # the folder was read
    probed = _probed_by_transformers()
    path = [p for p in sys.path if os.path.abspath(p or ".") != BENCH]
    clashes = {}
    for stem in stems:
        if stem in sys.stdlib_module_names:
            clashes[stem] = "standard library"
        elif stem in probed:
            clashes[stem] = "an optional package transformers imports when found"
        elif importlib.machinery.PathFinder.find_spec(stem, path) is not None:
            clashes[stem] = "installed"
    assert not clashes, f"rename these bench/ scripts: {clashes}"
