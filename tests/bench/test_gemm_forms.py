"""bench/gemm_forms.py's plumbing on the CPU: every form computes the same
product (checked against float64 inside the script) and lands in the table."""

import json

from bench_scripts import load_bench_script


def test_dry_run_times_every_form_and_checks_it(monkeypatch, tmp_path):
    bench = load_bench_script("gemm_forms", monkeypatch)
    assert bench.main(["--dry-run", "--rows", "4,8", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gemm_forms.json").read_text())["rows"]
    assert [(r["shape"], r["M"]) for r in rows] == [("qkv", 4), ("qkv", 8), ("o", 4), ("o", 8)]
    for r in rows:
        want = {"torch", "lt", "bias0", "wT", "split"} | (set() if r["residual"] else {"wT+copy"})
        assert set(r["us"]) == want and set(r["rel_err"]) == want
        assert all(e < 1e-5 for e in r["rel_err"].values()), r["rel_err"]
        assert all(t > 0 for t in r["us"].values())
    table = (tmp_path / "gemm_forms.md").read_text()
    assert "| o | 8 |" in table and "best / torch" in table


def test_the_inductor_form_is_checked_and_names_its_kernel(monkeypatch, tmp_path):
    """--inductor (here Inductor's default mode: the CPU has no templates to
    tune): the compiled product is checked like the others and the kernel
    Inductor called is named in the row and the table."""
    bench = load_bench_script("gemm_forms", monkeypatch)
    assert bench.main(["--dry-run", "--only", "o", "--rows", "4", "--inductor", "default",
                       "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "gemm_forms.json").read_text())["rows"]
    assert row["rel_err"]["inductor"] < 1e-5 and row["us"]["inductor"] > 0
    assert row["inductor_kernel"].startswith(("extern ", "Triton template"))
    assert f"- o at 4 rows: {row['inductor_kernel']}" in (tmp_path / "gemm_forms.md").read_text()


def test_an_unknown_weight_is_refused_by_name(monkeypatch, tmp_path, capsys):
    import pytest

    bench = load_bench_script("gemm_forms", monkeypatch)
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--only", "mlp", "--out", str(tmp_path)])
    assert "unknown weights ['mlp']" in capsys.readouterr().err
