"""`l2_prefetch` (compile_backend/kernels/l2_prefetch.py) changes no value:
on a CPU or under the interpreter it issues nothing; misuse raises before
anything runs. On the GPU (sm_90+) it asks for the bytes it says, from a
16-byte boundary, eagerly and inside a CUDA graph between kernels that
launch with PDL, and a chain with it is bit-equal to the chain without."""

import pytest
import torch

from compile_backend.kernels.l2_prefetch import l2_prefetch, prefetch_supported
from compile_backend.kernels.skinny_linear import skinny_linear
from kernel_cases import gen, stable_seed

HOPPER = (torch.cuda.is_available() and torch.version.hip is None
          and torch.cuda.get_device_capability()[0] >= 9)


def test_on_a_cpu_nothing_is_issued_and_nothing_changes():
    t = torch.randn(64, 32, generator=gen(stable_seed("pf", "cpu"))).to(torch.bfloat16)
    before = t.clone()
    assert not prefetch_supported(t)
    assert l2_prefetch(t) == 0 and l2_prefetch(t, 1024) == 0
    assert torch.equal(t, before)


def test_misuse_raises_and_says_what_to_give():
    t = torch.randn(64, 32)
    with pytest.raises(ValueError, match="contiguous tensor"):
        l2_prefetch(t.t())
    with pytest.raises(ValueError, match="contiguous tensor"):
        l2_prefetch([1, 2, 3])
    with pytest.raises(ValueError, match=r"nbytes must be in \[0, 8192\]"):
        l2_prefetch(t, 8193)
    with pytest.raises(ValueError, match="programs must be >= 1"):
        l2_prefetch(t, programs=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the bulk L2 prefetch needs an NVIDIA GPU of sm_90 or later")
def test_it_asks_for_whole_16_byte_runs_from_an_aligned_start():
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    assert l2_prefetch(w) == w.numel() * 2
    assert l2_prefetch(w, 1000) == 992  # rounded down to 16
    inner = w.view(-1)[3:]  # 6 bytes past a 16-byte boundary: the first 10 skipped
    assert l2_prefetch(inner, 4096) == (4096 - 10) // 16 * 16
    assert l2_prefetch(w, 0) == 0
    torch.cuda.synchronize()
    assert torch.equal(w, before)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the bulk L2 prefetch needs an NVIDIA GPU of sm_90 or later")
@pytest.mark.parametrize("M", [1, 16, 64])
def test_a_graph_with_prefetches_equals_the_chain_without(M):
    """Four o projections with their residuals (the skinny kernel, PDL on),
    each weight prefetched just before its GEMM inside one CUDA graph,
    replayed on new inputs three times: bit-equal to the chain run eagerly
    without prefetches."""
    g = gen(stable_seed("pf-graph", M))
    ws = [(torch.randn(4096, 4096, generator=g) / 64).to("cuda", torch.bfloat16) for _ in range(4)]
    x = torch.randn(M, 4096, generator=g).to("cuda", torch.bfloat16)
    r = torch.randn(M, 4096, generator=g).to("cuda", torch.bfloat16)

    def chain(prefetch: bool) -> torch.Tensor:
        h = r
        for w in ws:
            if prefetch:
                l2_prefetch(w, 8 << 20)
            h = skinny_linear(x, w, None, h)
        return h

    chain(True)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for i in range(3):
        gi = gen(stable_seed("pf-replay", M, i))
        x.copy_(torch.randn(M, 4096, generator=gi).to(torch.bfloat16))
        r.copy_(torch.randn(M, 4096, generator=gi).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain(False)), f"replay {i}"
