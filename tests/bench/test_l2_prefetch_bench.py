"""bench/l2_prefetch.py's plumbing on the CPU (--dry-run: tiny shapes, the
torch references, no graph; numbers mean nothing): a row per batch and
prefetch size, outputs compared with the chain without prefetches; its
prefetch issues nothing off Hopper and raises on misuse."""

import json

import pytest
import torch

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


def test_the_prefetch_is_a_no_op_on_a_cpu_and_misuse_raises(monkeypatch):
    bench = load_bench_script("l2_prefetch", monkeypatch)
    t = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    before = t.clone()
    assert not bench.l2_prefetch_supported(t.device)
    assert bench.l2_prefetch(t) == 0 and bench.l2_prefetch(t, 1024) == 0
    assert torch.equal(t, before)
    with pytest.raises(ValueError, match="contiguous tensor"):
        bench.l2_prefetch(t.t())
    with pytest.raises(ValueError, match=r"nbytes must be in \[0, 8192\]"):
        bench.l2_prefetch(t, 8193)
    with pytest.raises(ValueError, match="programs must be >= 1"):
        bench.l2_prefetch(t, programs=0)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        bench.l2_prefetch(t, chunk=24)
