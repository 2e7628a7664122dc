"""After every bench test: sys.path as it was, and no module loaded from
bench/ left in sys.modules. bench/ names are plain words (decode, timing,
report), and a later `import` of a same-named package (transformers probes
optional ones such as `kernels`) must not find a bench script instead."""

import sys

import pytest

from bench_scripts import bench_modules


@pytest.fixture(autouse=True)
def _bench_leaves_no_names():
    path = list(sys.path)
    yield
    sys.path[:] = path
    for name in bench_modules():
        del sys.modules[name]
