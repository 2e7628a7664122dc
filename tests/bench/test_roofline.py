"""The compute-aware floor (bench/roofline.py): bytes and FLOPs per kernel
class counted from the model's modules, and max(bytes / bandwidth, FLOPs /
peak) per class."""

import torch

from bench_scripts import load_bench_script
from compile_backend.demo.models import build_model, preset


def test_step_work_counts_each_class_from_the_modules(monkeypatch):
    roofline = load_bench_script("roofline", monkeypatch)
    cfg = preset("tiny", num_layers=2)
    model = build_model("llama", cfg)
    model.bind_caches(8, 16, 4, "cpu")
    B, ctx = 3, 20
    work = roofline.step_work(model, B, B * (ctx + 1), ctx + 1)
    elt = torch.finfo(cfg.dtype).bits // 8
    # embedding: the B rows a lookup reads, not the table
    assert work["embedding"].bytes == B * cfg.hidden_size * elt
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert work["gemm"].bytes == sum(p.numel() * elt for m in linears for p in m.parameters())
    assert work["gemm"].flops == sum(2 * B * m.in_features * m.out_features for m in linears)
    hd = cfg.hidden_size // cfg.num_heads
    assert work["attention"].bytes == cfg.num_layers * 2 * B * (ctx + 1) * cfg.num_kv_heads * hd * elt
    assert work["attention"].flops == cfg.num_layers * 4 * B * (ctx + 1) * cfg.num_heads * hd
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embed.weight.numel() * elt
    assert work["other"].bytes == every - table - work["gemm"].bytes  # norms
    assert work["other"].flops == 0


def test_the_floor_takes_the_slower_limit_per_class(monkeypatch):
    roofline = load_bench_script("roofline", monkeypatch)
    W = roofline.Work
    work = {"gemm": W(bytes=1000, flops=10_000), "attention": W(bytes=4000, flops=10)}
    # bandwidth 1000 B/s, peak 1000 FLOP/s: gemm bound by FLOPs (10 s), attention by bytes (4 s)
    assert roofline.floor_seconds(work, 1000.0, 1000.0) == 14.0
    assert roofline.floor_seconds(work, 1000.0, None) == 5.0  # bytes only
    assert roofline.bound_by(work, 1000.0, 1000.0) == {"gemm": "flops", "attention": "bytes"}
    assert roofline.gemm_peak_flops("cpu") is None
