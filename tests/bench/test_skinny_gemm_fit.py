"""The skinny GEMM bench's fixed cost per GEMV (bench/skinny_gemm.py,
issue #37): a least-squares line through one preset's shapes at one row
count, time against the bytes' floor; its intercept is the fixed cost."""

import math
import random

import pytest

from bench_scripts import load_bench_script


def _row(shape, M, floor, cublas, skinny):
    return {"shape": shape, "N": 1, "K": 1, "M": M, "residual": False, "floor_us": floor,
            "cublas_us": cublas, "skinny_us": skinny, "best_us": skinny, "best_config": None,
            "sweep": []}


def test_line_fit_recovers_a_line_through_noisy_points(monkeypatch):
    sg = load_bench_script("skinny_gemm", monkeypatch)
    rng = random.Random(37)
    xs = [rng.uniform(5.0, 300.0) for _ in range(40)]
    ys = [4.2 + 1.08 * x + rng.gauss(0.0, 0.05) for x in xs]
    fixed, slope = sg.line_fit(xs, ys)
    assert fixed == pytest.approx(4.2, abs=0.05) and slope == pytest.approx(1.08, abs=1e-3)
    with pytest.raises(ValueError, match="two distinct"):
        sg.line_fit([3.0, 3.0], [1.0, 2.0])


def test_fixed_cost_fits_group_by_preset_and_rows_and_print_a_table(monkeypatch):
    sg = load_bench_script("skinny_gemm", monkeypatch)
    rng = random.Random(7)
    floors = {"qkv": 11.7, "o": 7.8, "gate_up": 54.7, "down": 27.4, "lm_head": 244.9}
    rows = []
    for M, (cub_fixed, sk_fixed) in {1: (6.0, 4.0), 64: (5.0, 3.0)}.items():
        for name, floor in floors.items():
            f = floor * rng.uniform(0.95, 1.05)  # the floor moves with M's x and output bytes
            rows.append(_row(f"llama8b {name}", M, f, cub_fixed + 1.1 * f, sk_fixed + 0.95 * f))
    rows.append(_row("bench o", 1, 2.0, 8.0, 6.0))  # two shapes of a preset: no line
    rows.append(_row("bench down", 1, 5.0, 11.0, 9.0))
    rows.append(_row("llama8b qkv", 16, 11.7, 18.0, math.nan))  # a default that did not run
    fits = sg.fixed_cost_fits(rows)
    by = {(f["preset"], f["M"]): f for f in fits}
    assert set(by) == {("llama8b", 1), ("llama8b", 64)}
    assert by["llama8b", 1]["n"] == 5
    assert by["llama8b", 1]["cublas"] == pytest.approx((6.0, 1.1))
    assert by["llama8b", 64]["skinny"] == pytest.approx((3.0, 0.95))
    text = sg.fmt(rows, 3.0e12)
    assert "Fixed cost per GEMV" in text
    assert "| llama8b | 1 | 5 | 6.0 | 0.91 | 4.0 | 1.05 |" in text
