"""The decode benchmark's plumbing on the CPU (graph stand-in; timings mean nothing)."""

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
