"""bench/memory.py: the bisection, the batches it serves, and its CPU dry run."""

import json
import os

import pytest
import torch

from bench_scripts import load_bench_script


@pytest.fixture
def memory(monkeypatch):
    return load_bench_script("memory", monkeypatch)


@pytest.mark.parametrize("guess", [100, 900, 1000, 1003, 1200, 5000])
def test_bisection_finds_the_largest_that_survives(memory, guess):
    result = memory.bisect_blocks(lambda n: n <= 1003, guess, bracket=0.03, steps=20)
    assert result["largest_ok"] == 1003 and result["smallest_failed"] == 1004
    assert all(ok == (n <= 1003) for n, ok in result["probes"])


def test_bisection_stops_after_its_steps(memory):
    result = memory.bisect_blocks(lambda n: n <= 1003, 1000, bracket=0.03, steps=1)
    assert [n for n, _ in result["probes"]] == [1000, 1030, 1015]
    assert (result["largest_ok"], result["smallest_failed"]) == (1000, 1015)


def test_bisection_reports_no_survivor(memory):
    result = memory.bisect_blocks(lambda n: False, 10, bracket=0.5, steps=3)
    assert result["largest_ok"] is None and result["smallest_failed"] == 2


def test_the_batches_fill_the_limits_within_the_cache(memory):
    kv = memory.KVCacheConfig(num_blocks=40, block_size=16, max_model_len=128, max_num_reqs=8,
                              max_num_tokens=300)
    prefill = memory.prefill_batch(kv, 256)
    assert prefill.query_lens == [128, 128, 44] and prefill.num_tokens == 300
    assert all(1 <= b < 40 for row in prefill.block_ids for b in row)  # wraps around the cache
    decode = memory.max_decode_batch(kv, 256)
    assert decode.num_reqs == 8 and set(decode.query_lens) == {1}
    assert max(b for row in decode.block_ids for b in row) < 40  # (40 - 1) // 8 blocks each
    prefill.check_against(kv)
    decode.check_against(kv)


def test_the_estimate_counts_processes(memory):
    cells = [("llama8b", "piecewise"), ("llama", "full")]
    presets = {"llama8b": "llama8b", "llama": "bench"}
    assert memory.estimate_seconds(cells, presets, None, False) == 80 + 45  # no bisection
    assert memory.estimate_seconds(cells, presets, 0, True) == 2 * (40 + 25)  # the bracket alone
    assert memory.estimate_seconds(cells, presets, 3, True) == 5 * (40 + 25)


def test_without_a_gpu_the_benchmark_says_how_to_dry_run(memory):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        memory.main(["--models", "llama"])


@pytest.mark.slow  # full tier: fresh processes
def test_dry_run_writes_a_row_per_cell(memory, tmp_path):
    rc = memory.main(["--dry-run", "--models", "hybrid", "--modes", "piecewise", "--bisect-steps", "1",
                      "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert [(r["model"], r["mode"]) for r in rows] == [("hybrid", "piecewise")]
    row = rows[0]
    assert row["largest_ok"] >= row["budget_at_1"] > row["num_blocks"]  # the rounding is a bound
    assert row["terms_predicted"]["caches (KV, state, rounding)"] > 0
    assert "| hybrid | piecewise | 0.9 |" in (tmp_path / "memory.md").read_text()
