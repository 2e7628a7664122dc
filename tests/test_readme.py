"""README.md's Python examples run as written, on this machine (a CPU
included): each ```python block is run in a fresh interpreter, outside the
repository, as a newcomer would paste it. A block that is not meant to run
alone (a fragment naming an op of yours) is marked by an HTML comment
`<!-- not run -->` on the line before it; keep that list short."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
NOT_RUN = "<!-- not run -->"
MAX_NOT_RUN = 2  # fragments are the exception: an example a reader copies should run


def python_blocks(text: str) -> list[tuple[str, int, str, bool]]:
    """(section heading, first line number, code, runs) for each ```python block."""
    blocks, heading, previous = [], "(top)", ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
            blocks.append((heading, start + 1, "\n".join(lines[start:end]) + "\n",
                           previous.strip() != NOT_RUN))
            i = end
        if line.strip():
            previous = line
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text())
RUN = [b for b in BLOCKS if b[3]]


def test_the_readme_has_examples_and_few_are_not_run():
    assert len(RUN) >= 4, [b[:2] for b in BLOCKS]
    assert len(BLOCKS) - len(RUN) <= MAX_NOT_RUN, [b[:2] for b in BLOCKS if not b[3]]


def test_block_extraction_honours_the_marker():
    text = "# A\n```python\nx = 1\n```\n\n<!-- not run -->\n```python\ny = ...\n```\n"
    assert [(h, n, runs) for h, n, _, runs in python_blocks(text)] == [("A", 3, True), ("A", 8, False)]


@pytest.mark.slow  # each block in a fresh interpreter; the runner's compiles take a while on 2 cores
@pytest.mark.parametrize("heading, line, code", [b[:3] for b in RUN],
                         ids=[f"line{b[1]}" for b in RUN])
def test_readme_example_runs(heading, line, code, tmp_path):
    env = dict(os.environ, MRV2_CACHE_DIR=str(tmp_path / "cache"), MRV2_PROGRESS="0")
    # As in a newcomer's shell: no Triton interpreter switch (ops take their
    # torch references on a CPU; tests/conftest.py sets it for the kernel tests).
    env.pop("TRITON_INTERPRET", None)
    script = tmp_path / "example.py"
    script.write_text(code)
    # An example that checks against eager must capture something (no NothingCapturedWarning).
    strict = ["-W", "error::compile_backend.testing.NothingCapturedWarning"]
    proc = subprocess.run([sys.executable, *strict, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"README.md line {line} ({heading}) failed:\n{proc.stderr[-3000:]}")


def test_the_runner_examples_pick_their_device_at_run_time():
    """A runner example must not hard-code "cuda" (it would fail on a CPU)
    nor leave arguments out."""
    runner_blocks = [(n, c) for _, n, c, runs in BLOCKS if runs and "ModelRunner(" in c]
    assert runner_blocks
    for line, code in runner_blocks:
        assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in code, line
        assert '"cuda")' not in code and "..." not in re.sub(r"#.*", "", code), line
