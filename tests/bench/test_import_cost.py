"""bench/import_cost.py: a fresh process per run times each import a warm
start makes, on top of the ones before it."""

import os
import subprocess
import sys

from bench_scripts import BENCH


def test_each_module_gets_a_row_and_the_load_s_imports_are_summed(tmp_path):
    out = tmp_path / "imports.md"
    run = subprocess.run([sys.executable, os.path.join(BENCH, "import_cost.py"), "--runs", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("|")[1].strip(): float(line.split("|")[2])
            for line in out.read_text().splitlines() if line.startswith("| torch")
            or line.startswith("| compile_backend")}
    assert rows["torch"] > 0.05  # a real import, measured in a fresh process
    assert rows["torch._dynamo"] > 0.05  # not imported by torch or mrv2: its own row
    assert rows["compile_backend.runner.model_runner"] < rows["torch._dynamo"]
    assert "what a warm load imports" in out.read_text()
