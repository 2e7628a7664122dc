"""bench/persistent_chain.py's plumbing on the CPU (--dry-run: tiny shapes,
one program, the kernels through Triton's interpreter; numbers mean nothing):
a row per row count and variant, each checked against the float64 chain; the
persistent kernel's grid barrier and preload equal a launch per GEMV."""

import json

import torch

import compile_backend.kernels  # noqa: F401  (imported at collection, under the interpreter the
# conftest sets: a test that turns it off and imports them first would leave them compiled for a GPU)
from bench_scripts import load_bench_script


def test_dry_run_writes_a_row_per_rows_and_variant(monkeypatch, tmp_path):
    bench = load_bench_script("persistent_chain", monkeypatch)
    out = tmp_path / "pc.md"
    assert bench.main(["--dry-run", "--rows", "1,3", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["rows"], r["variant"]) for r in rows] == [
        (m, v) for m in (1, 3) for v in ("launches", "persistent", "persistent+preload")]
    assert all(r["replays_equal"] and r["rel_err"] <= bench.REL_TOL for r in rows)
    assert "| 3 | persistent+preload |" in out.read_text()


def test_the_persistent_chain_equals_a_launch_per_gemv(monkeypatch):
    """Two column tiles in one program would need two programs at once: the
    interpreter runs one, so one tile of 64 columns; three GEMVs whose K
    spans two K tiles of the dry run's 32 (the preloaded one and the rest)."""
    bench = load_bench_script("persistent_chain", monkeypatch)
    g = torch.Generator().manual_seed(7)
    L, M, N = 3, 5, 64
    w = (torch.randn(L, N, N, generator=g) * N ** -0.5).to(torch.bfloat16)
    y0 = torch.randn(M, N, generator=g).to(torch.bfloat16)
    outs = []
    for preload in (None, False, True):
        y = torch.empty(L + 1, M, N, dtype=torch.bfloat16)
        y[0] = y0
        if preload is None:
            outs.append(bench.launches_chain(y, w).clone())
        else:
            count = torch.zeros(1, dtype=torch.int32)
            outs.append(bench.persistent_chain(y, w, count, preload, block_n=64, block_k=32).clone())
            assert int(count) == L  # one arrival per GEMV from the one program
    assert torch.equal(outs[0], outs[1])
    rel = ((outs[2].double() - outs[0].double()).norm() / outs[0].double().norm()).item()
    assert rel <= 1e-2, rel  # the preloaded tile summed last: another order, bf16 roundings
