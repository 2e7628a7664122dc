"""Test setup. Triton's interpreter must be chosen before triton is imported:
without a GPU, kernels run on CPU tensors through it."""

import os
import sys

_HAS_GPU_DEVICE = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
if not _HAS_GPU_DEVICE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The warm-start cache stays off unless a test names a folder: tests count
# compiles, and one test's saved step would be another's load.
os.environ.setdefault("MRV2_CACHE_DIR", "off")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the slow tier (tests marked slow); CI runs both tiers")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(config, items):
    # A case marked slow_on_cpu is in the slow tier where the interpreter runs it.
    for item in items:
        callspec = getattr(item, "callspec", None)
        if ("slow_on_cpu" in item.keywords and callspec is not None
                and callspec.params.get("device") == "cpu"):
            item.add_marker(pytest.mark.slow)
    # The quick tier by default; `-m slow` or `--full` selects the slow tier too.
    if not config.getoption("--full") and "slow" not in (config.getoption("-m") or ""):
        slow = pytest.mark.skip(reason="slow tier: run with --full")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tests run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with no cached Dynamo graphs and zeroed counters."""
    import torch._dynamo

    from compile_backend import clear_compiled_steps, reset_counters

    torch._dynamo.reset()
    reset_counters()
    clear_compiled_steps()
    yield
    torch._dynamo.reset()
