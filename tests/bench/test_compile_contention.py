"""bench/compile_contention.py: Triton compiles (offline, for sm_90a) on a
pool of threads and of processes beside a busy main thread; each row's
compiles finish and the main loop's rounds are counted."""

import os
import subprocess
import sys

import pytest

from bench_scripts import BENCH


@pytest.mark.parametrize("main", ["python", "torch"])
def test_each_pool_compiles_its_kernels_beside_the_main_loop(tmp_path, main):
    out = tmp_path / "contention.md"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    run = subprocess.run([sys.executable, os.path.join(BENCH, "compile_contention.py"),
                          "--kernels", "2", "--workers", "1", "--main", main, "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()
            if line.startswith("| ") and "compiles" not in line]
    assert [r[0].strip() for r in rows] == ["in line, main thread idle", "1 threads",
                                            "1 processes (spawned)"]
    for r in rows:
        assert float(r[2]) > 0  # the compiles took time and finished
    assert all(int(r[3]) >= 1 for r in rows[1:])  # the main loop ran beside them
    assert f"main thread: {main} rounds" in out.read_text()


def test_refuses_to_run_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(BENCH, "compile_contention.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "TRITON_INTERPRET is set" in run.stderr
