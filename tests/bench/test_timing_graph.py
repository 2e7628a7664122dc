"""bench/timing.py's CUDA-graph timing: `graph_ms` captures on the stream it
warmed, so a split-K skinny launch keeps its splits inside the graph (the
stream's arrival counters were made by the warm-up), and a launch that still
took the one-split fallback fails the timing instead of timing another
kernel; `graph_us_per` off CUDA times one call."""

import pytest
import torch

from bench_scripts import load_bench_script


def test_graph_us_per_off_cuda_times_one_call(monkeypatch):
    timing = load_bench_script("timing", monkeypatch)
    calls = []
    us = timing.graph_us_per(lambda: calls.append(1), "cpu", 4)
    assert calls == [1] and us >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_graph_ms_keeps_the_splits_and_refuses_a_fallback(monkeypatch):
    from compile_backend.core import stream_buffers
    from compile_backend.core.counters import counters
    from compile_backend.kernels.skinny_linear import skinny_linear

    timing = load_bench_script("timing", monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(37)
    x = torch.randn(1, 4096, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(4096, 4096, generator=g, device="cuda") * 4096 ** -0.5).to(torch.bfloat16)
    r = torch.randn(1, 4096, generator=g, device="cuda").to(torch.bfloat16)
    cfg = {"SPLIT_K": 2, "BLOCK_N": 64, "BLOCK_K": 256}
    before = counters["skinny_split_k_fallbacks"]
    assert timing.graph_ms([lambda: skinny_linear(x, w, None, r, config=cfg)], calls=2) > 0
    assert counters["skinny_split_k_fallbacks"] == before
    # a capture on a stream without counters (as before the fix): refused, not timed
    real = stream_buffers.buffer
    monkeypatch.setattr(stream_buffers, "buffer", lambda name, dev: (
        None if torch.cuda.is_current_stream_capturing() else real(name, dev)))
    with pytest.raises(AssertionError, match="took one split inside the capture"):
        timing.graph_ms([lambda: skinny_linear(x, w, None, r, config=cfg)], calls=2)
