"""bench/l2_prefetch.py's plumbing on the CPU (--dry-run: tiny shapes, the
torch references, no graph; numbers mean nothing): a row per batch and
prefetch size, outputs compared with the chain without prefetches."""

import json

from bench_scripts import load_bench_script


def test_dry_run_writes_a_row_per_batch_and_size(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch references: fast
    bench = load_bench_script("l2_prefetch", monkeypatch)
    out = tmp_path / "pf.md"
    assert bench.main(["--dry-run", "--batches", "1,3", "--prefetch-mib", "8", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    # 0 MiB (the baseline, added) and 8 MiB, capped at the tiny weight's 128 KiB
    assert [(r["batch"], r["prefetch_mib"]) for r in rows] == [(1, 0), (1, 0.125), (3, 0), (3, 0.125)]
    assert all(r["equal"] and r["layer_us"] > 0 for r in rows)
    assert "| 3 | 0.125 |" in out.read_text()
