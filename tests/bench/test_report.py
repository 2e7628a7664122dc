"""bench/report.py (the scripts' tables, results files and flags) and the copy
bandwidth in rounds (bench/timing.py) as decode.py reports it."""

import argparse
import json

import pytest
import torch

from bench_scripts import load_bench_script


@pytest.fixture
def report(monkeypatch):
    return load_bench_script("report", monkeypatch)


def test_a_table_has_its_header_alignment_and_rows(report):
    lines = report.table(["name", "ms", "note"], "lrl", [["a", "1.0", ""], ["b", "2.0", None]])
    assert lines == ["| name | ms | note |", "|---|---:|---|", "| a | 1.0 |  |", "| b | 2.0 | |"]
    with pytest.raises(AssertionError):
        report.table(["name", "ms"], "l", [])
    assert report.dash(None, ".2f") == "-" and report.dash(1.234, ".2f") == "1.23"


def test_comma_lists_and_known_names(report):
    assert report.comma_list("1,8,32", int) == [1, 8, 32] and report.comma_list("") == []
    ap = argparse.ArgumentParser()
    assert report.names(ap, "--modes", "full,none", ["none", "full"]) == ["full", "none"]
    with pytest.raises(SystemExit):
        report.names(ap, "--modes", "full,fast", ["none", "full"])


def test_results_are_written_side_by_side_with_the_command(report, tmp_path):
    path = report.write_md_and_json(str(tmp_path / "sub" / "x.md"), "text\n", {"rows": [1]})
    assert open(path).read() == "text\n"
    assert json.loads((tmp_path / "sub" / "x.json").read_text()) == {"rows": [1]}
    meta = report.run_meta("decode", ["--dry-run"], "CPU dry run", triton=False)
    assert list(meta) == ["date", "gpu", "torch", "python", "command"]
    assert meta["command"] == "python bench/decode.py --dry-run"
    assert report.heading("T", meta) == f"# T (CPU dry run, torch {torch.__version__}, {meta['date']})"


def test_copy_bandwidth_is_measured_in_rounds_with_its_spread(monkeypatch):
    timing = load_bench_script("timing", monkeypatch)
    bw = timing.copy_bandwidth(rounds=3, copies=2, device="cpu")
    assert len(bw.samples) == 3 and all(s > 0 for s in bw.samples)
    both = bw + timing.Bandwidth((1e9, 5e9))
    assert len(both.samples) == 5 and min(both.samples) <= both.median <= max(both.samples)
    assert timing.spread_text([4.0, 2.0, 3.0]) == "3 (2-4) GB/s"


def test_decode_floors_divide_by_the_median_its_header_prints_the_spread(monkeypatch, tmp_path):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    decode = load_bench_script("decode", monkeypatch)
    timing = load_bench_script("timing", monkeypatch)
    meta = {"date": "d", "gpu": "GPU", "torch": "t", "triton": "3", "command": "c", "dtype": "bfloat16",
            "copy_bandwidth_GBps": None, "copy_bandwidth_samples_GBps": None, "context": 500,
            "gemm_peak_TFLOPs": None}
    results = decode.Results(meta, timing.Bandwidth((2e9, 4e9, 3e9)), None, [])
    results.decode = [{"model": "llama", "variant": "eager", "batch": 1, "ms": 2.0, "b2b_ms": 1.5,
                       "replay_ms": None, "work": {"gemm": [3_000_000, 0]}, "dispatched": "none",
                       "rel_err": 0.0, "match": True}]
    results.set_floors()
    assert meta["copy_bandwidth_GBps"] == 3.0 and meta["copy_bandwidth_samples_GBps"] == [2.0, 4.0, 3.0]
    assert results.decode[0]["floor_ms"] == pytest.approx(1.0)  # 3 MB at the median, 3 GB/s
    text = results.write(str(tmp_path))
    assert "copy bandwidth 3 (2-4) GB/s over 3 rounds of 20 copies (the floors divide by the median)" in text
    written = json.loads((tmp_path / "decode.json").read_text())["meta"]
    assert written["copy_bandwidth_GBps"] == 3.0 and written["copy_bandwidth_samples_GBps"] == [2.0, 4.0, 3.0]
    # a merged table keeps every run's rounds beside the range of the runs' medians
    assert decode.merge_results([str(tmp_path / "decode.json")] * 2, str(tmp_path / "m"))
    merged = json.loads((tmp_path / "m" / "decode.json").read_text())["meta"]
    assert merged["copy_bandwidth_samples_GBps"] == [2.0, 4.0, 3.0] * 2
    assert "copy bandwidth 3-3 GB/s;" in (tmp_path / "m" / "decode.md").read_text()
