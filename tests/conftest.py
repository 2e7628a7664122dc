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

# The repository root off sys.path (`python -m pytest` puts the working folder
# there): compile_backend/kernels/ and compile_backend/passes/ install as compile_backend.kernels and
# compile_backend.passes, and a library that probes for a top-level `kernels`
# package (transformers does, for Hugging Face's, and imports what it finds
# when no metadata names it) would import the folder a second time: every op
# and direct call registered again. Tests import the installed package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

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


# Skip reasons summed up by pytest_terminal_summary, as a short name with the fix.
_SKIP_NAMES = {
    "slow tier: run with --full": "slow tier (--full)",
    "needs a CUDA GPU (GPU tests run with -m gpu on the H200)": "need a CUDA GPU (-m gpu)",
    "no CUDA": "need CUDA (their cuda cases)",
}


def skip_counts(reports) -> dict[str, int]:
    """Skipped tests by reason (short names for the two tiers' reasons), most first."""
    counts: dict[str, int] = {}
    for rep in reports:
        longrepr = getattr(rep, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        name = _SKIP_NAMES.get(reason, reason)
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: after the short summary
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line for every skip, counted by reason (addopts lists failures and
    errors only: the quick tier skips hundreds of slow and GPU tests)."""
    yield
    chars = config.option.reportchars or ""
    if "s" in chars or "a" in chars or "A" in chars:
        return  # -rs / -ra: pytest lists each skip itself
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        counts = skip_counts(skipped)
        terminalreporter.write_line(
            f"skipped {len(skipped)}: " + ", ".join(f"{n} {reason}" for reason, n in counts.items()))


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
