"""bench/host_overhead.py's --layouts table runs on the CPU (host work of the
launchers that remember a checked layout, the launch left out) and prints a
row per launcher and batch, each with both columns measured."""

import re

from bench_scripts import load_bench_script


def test_layouts_table_on_the_cpu(monkeypatch, tmp_path, capsys):
    host = load_bench_script("host_overhead", monkeypatch)
    out = tmp_path / "layouts.md"
    assert host.main(["--layouts", "--batches", "1,64", "--calls", "20", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text().strip() == text.strip()
    rows = re.findall(r"^\| decode, batch (\d+) \| ([^|]+) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    assert [(b, name.strip()) for b, name, *_ in rows] == [
        (b, name) for b in ("1", "64")
        for name in ("rope_and_cache", "skinny GEMM + residual (o proj)",
                     "RMSNorm (norm_linear above 16 rows)", "SiLU·mul (norm_linear above 16 rows)")]
    assert all(float(seen) > 0 and float(new) > 0 for *_, seen, new in rows)
