"""The decode benchmark's plumbing on the CPU (graph stand-in; timings mean nothing)."""

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # torch references: fast
    spec = importlib.util.spec_from_file_location("bench_decode", os.path.join(ROOT, "bench", "decode.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_decode", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_dry_run_compares_every_variant_with_eager(bench, tmp_path):
    """Regression: the first step's logits were kept as a view of the graph's
    output and read after later replays had overwritten it; with per-request
    state (the hybrid model's sconv) every graph mode then looked wrong."""
    rc = bench.main(["--dry-run", "--model", "hybrid", "--batches", "1,2", "--mixed", "40",
                     "--variants", "eager,mrv2-none,mrv2-piecewise,mrv2-full_and_piecewise",
                     "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "decode.json").read_text())
    decode = results["decode"]
    assert {r["variant"] for r in decode} == {"eager", "mrv2-none", "mrv2-piecewise",
                                              "mrv2-full_and_piecewise"}
    assert all(r["match"] and r["rel_err"] < 1e-5 for r in decode), decode  # fp32, same kernels
    ran = {(r["variant"], r["batch"]): r["dispatched"] for r in decode}
    assert ran[("mrv2-piecewise", 2)] == "piecewise"
    assert ran[("mrv2-full_and_piecewise", 2)] == "full"
    assert all(r["rel_err"] < 1e-5 for r in results["mixed"])
    assert "| hybrid | mrv2-piecewise | 2 |" in (tmp_path / "decode.md").read_text()


def test_without_a_gpu_the_benchmark_says_how_to_dry_run(bench):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        bench.main(["--batches", "1"])


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_runs_of_one_model_each_merge_into_one_table(bench, tmp_path):
    for m in ("llama", "hybrid"):
        assert bench.main(["--dry-run", "--model", m, "--batches", "1,2", "--mixed", "",
                           "--variants", "eager,mrv2-full", "--out", str(tmp_path / m)]) == 0
    assert bench.main(["--merge", str(tmp_path / "llama" / "decode.json"),
                       str(tmp_path / "hybrid" / "decode.json"), "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "decode.json").read_text())
    assert {(r["model"], r["variant"], r["batch"]) for r in merged["decode"]} == {
        (m, v, b) for m in ("llama", "hybrid") for v in ("eager", "mrv2-full") for b in (1, 2)}
    assert all(r["b2b_ms"] > 0 and r["match"] for r in merged["decode"])
    assert len(merged["meta"]["runs"]) == 2
    text = (tmp_path / "decode.md").read_text()
    assert "| llama | mrv2-full | 2 |" in text and "| hybrid | mrv2-full | 2 |" in text
    assert "--model llama" in text and "--model hybrid" in text  # both commands recorded


@pytest.fixture
def startup(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_startup", os.path.join(ROOT, "bench", "startup.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_startup", module)
    spec.loader.exec_module(module)
    return module


def _startup_row(phase, mode="piecewise", **changes):
    row = {"model": "llama", "preset": "llama8b", "mode": mode, "phase": phase,
           "compile_s": 30.0 if phase == "cold" else 6.0, "capture_s": 1.5, "graphs": 1155,
           "start_to_first_step_s": 40.0 if phase == "cold" else 12.0, "import_s": 4.0,
           "build_s": 3.0, "first_step_s": 0.01, "plan": 35, "first_step_finite": True,
           "first_step_ran_as": mode, "device_name": "GPU", "torch": "t", "triton": "3",
           "counters": {"piece_compiles": 3, "piece_compile_reuses": 62, "inductor_compiles": 3,
                        "dynamo_graphs": 1},
           "cache_bytes": {"TORCHINDUCTOR_CACHE_DIR": 2**21, "TRITON_CACHE_DIR": 0,
                           "MRV2_CACHE_DIR": 0}}
    return {**row, **changes}


def test_startup_tables_show_each_process_the_anchors_and_failures(startup):
    meta = {"date": "d", "command": "python bench/startup.py", "sizes_text": "35", "batch": 8,
            "context": 500}
    rows = [_startup_row("cold"), _startup_row("warm"),
            {"model": "llama", "preset": "llama8b", "mode": "full", "phase": "cold",
             "error": "exit code 1", "stderr_tail": "Traceback: boom"}]
    text = startup.tables(meta, rows)
    assert "| llama | llama8b | piecewise | warm | 6.0 | 1.50 | 1155 | 12.0 | 3 | 62 | 3 | 1 |" in text
    assert "| llama | llama8b | full | cold | failed: exit code 1 |" in text and "Traceback: boom" in text
    assert "| cold compile s | ~19 (Dynamo 4.6 + Inductor 14.8) | <= 15 | 30.0 |" in text
    assert "| warm start to first step s | ~9 (warm start with Inductor's cache) | <= 5 | 12.0 |" in text
    assert "| capture s (whole plan) | ~2 | <= 2 per mode | 1.50 |" in text
    assert "| 2.0 / 0.0 / 0.0 |" in text  # cache folders, MiB
    assert "not as expected" not in text
    odd = startup.tables(meta, [_startup_row("cold", first_step_ran_as="none")])
    assert "First step not as expected" in odd and "ran as none" in odd


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_startup_smoke_measures_a_fresh_process_per_phase(startup, tmp_path):
    out = tmp_path / "startup.md"
    assert startup.main(["--smoke", "--modes", "piecewise", "--out", str(out)]) == 0
    rows = json.loads((tmp_path / "startup.json").read_text())["rows"]
    assert [(r["mode"], r["phase"]) for r in rows] == [("piecewise", "cold"), ("piecewise", "warm")]
    for r in rows:
        assert r["first_step_finite"] and r["first_step_ran_as"] == "piecewise"
        assert r["graphs"] > r["plan"] == 4  # a graph per piece and size
        assert r["start_to_first_step_s"] > r["import_s"] + r["compile_s"] + r["capture_s"]
    assert rows[0]["mrv2_cache_dir"] == rows[1]["mrv2_cache_dir"]  # warm shares cold's folders
    cold, warm = (r["counters"] for r in rows)
    assert cold["dynamo_graphs"] == 1 and cold["piece_compiles"] >= 1
    # the warm process loads cold's saved step: nothing traced, nothing compiled
    assert warm.get("dynamo_graphs", 0) == 0 and warm.get("piece_compiles", 0) == 0
    assert "| llama | tiny | piecewise | warm |" in out.read_text()
