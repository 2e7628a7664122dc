"""Programmatic dependent launch (Note [programmatic dependent launch] in
compile_backend/kernels/_device.py): where it is on, and, on the GPU, that a chain of
dependent kernels launched with it (a decode layer: cuBLAS q/k/v, then
rope_and_cache, the decode attention and the skinny o projection with its
residual, six layers deep) replayed in a CUDA graph on fresh inputs gives
bit for bit what the same kernels give without it, eagerly. A kernel that
read its input before the previous kernel finished writing it would differ."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernel_cases import gen, paged_batch, randn, stable_seed
from compile_backend.core.counters import counters
from compile_backend.kernels import _device
from compile_backend.kernels._device import pdl_meta
from compile_backend.kernels.rope_and_cache import rope_and_cache
from compile_backend.kernels.skinny_linear import skinny_linear
from compile_backend.kernels.unified_attention import unified_attention
from compile_backend.runtime.graph_pool import capture_stream, warm_capture_stream


ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}


def test_pdl_is_off_on_the_cpu_and_when_asked(monkeypatch):
    monkeypatch.delenv("MRV2_PDL", raising=False)
    assert pdl_meta(torch.device("cpu")) == OFF
    monkeypatch.setenv("MRV2_PDL", "0")  # off before any CUDA query
    assert pdl_meta(torch.device("cuda", 0)) == OFF


@pytest.mark.parametrize("major, interpret, has_gdc, env, hip, want", [
    (9, "0", True, "", None, ON),         # Hopper
    (10, "0", True, "1", None, ON),       # later GPUs; any value but 0 leaves it on
    (8, "0", True, "", None, OFF),        # Ampere has no griddepcontrol
    (9, "1", True, "", None, OFF),        # Triton's interpreter
    (9, "0", False, "", None, OFF),       # a Triton without gdc_wait
    (9, "0", True, "0", None, OFF),       # asked off
    (9, "0", True, "", "6.4", OFF),       # ROCm (an MI300 reports 9.4)
])
def test_pdl_is_on_only_where_the_gpu_and_triton_have_it(major, interpret, has_gdc, env, hip, want,
                                                          monkeypatch):
    """The rule of pdl_meta with the device's capability stood in for (no GPU
    needed): sm_90 or later, compiled (not interpreted), Triton with grid
    dependency control, not ROCm, and not MRV2_PDL=0."""
    monkeypatch.setattr(_device, "_cuda_major", lambda index: major)
    monkeypatch.setattr(_device, "_HAS_GDC", has_gdc)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setenv("MRV2_PDL", env)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert pdl_meta(torch.device("cuda", 0)) == want


class _DecodeChain:
    """LAYERS decode layers of llama-8B's widths (hidden 4096, 32 heads, 8 kv
    heads, head dim 128) on B requests with random contexts."""

    LAYERS, H, KVH, D = 6, 32, 8, 128

    def __init__(self, B: int, two_launch: bool, seed: int):
        g = gen(seed)
        H, KVH, D = self.H, self.KVH, self.D
        hidden = H * D
        dev, dt = "cuda", torch.bfloat16
        self.B, self.two_launch, self.g = B, two_launch, g
        self.wqkv = [randn(((H + 2 * KVH) * D, hidden), dt, dev, g, hidden ** -0.5)
                     for _ in range(self.LAYERS)]
        self.wo = [randn((hidden, hidden), dt, dev, g, hidden ** -0.5) for _ in range(self.LAYERS)]
        lens = torch.randint(40, 700, (B,), generator=g).tolist()
        self.batch = paged_batch([1] * B, lens, 16, dev, g)
        self.positions = (self.batch.seq_lens - 1).long()
        self.inv_freq = (1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(dev)
        shape = (self.LAYERS, self.batch.num_blocks, 16, KVH, D)
        self.kc = torch.empty(shape, dtype=dt, device=dev)
        self.vc = torch.empty(shape, dtype=dt, device=dev)
        self.x = torch.empty((B, hidden), dtype=dt, device=dev)

    def fresh_inputs(self) -> None:
        """New hidden states and caches, written in place (the graph's inputs)."""
        self.x.copy_(randn(self.x.shape, self.x.dtype, "cpu", self.g))
        self.kc.copy_(randn(self.kc.shape, self.kc.dtype, "cpu", self.g))
        self.vc.copy_(randn(self.vc.shape, self.vc.dtype, "cpu", self.g))

    def forward(self) -> torch.Tensor:
        b, (H, KVH, D) = self.batch, (self.H, self.KVH, self.D)
        x = self.x
        for i in range(self.LAYERS):
            q, k, v = F.linear(x, self.wqkv[i]).split([H * D, KVH * D, KVH * D], dim=-1)
            q = rope_and_cache(q.view(-1, H, D), k.view(-1, KVH, D), v.view(-1, KVH, D),
                               self.positions, self.inv_freq, self.kc[i], self.vc[i],
                               b.slot_mapping)
            attn = unified_attention(q, self.kc[i], self.vc[i], b.query_start_loc, b.seq_lens,
                                     b.block_table, 1.0 / math.sqrt(D), 1, b.max_seq_len,
                                     config={"TWO_LAUNCH": self.two_launch})
            x = skinny_linear(attn.view(-1, H * D), self.wo[i], residual=x)
        return x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None
                    or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs an NVIDIA GPU of sm_90 or later")
@pytest.mark.parametrize("two_launch", [True, False], ids=["split_reduce", "one_launch"])
@pytest.mark.parametrize("B", [1, 5, 20])
def test_a_graph_of_pdl_kernels_equals_the_same_kernels_without_pdl(B, two_launch, monkeypatch):
    monkeypatch.delenv("MRV2_PDL", raising=False)
    assert pdl_meta(torch.device("cuda")) == ON
    chain = _DecodeChain(B, two_launch, stable_seed("pdl", B, two_launch))
    chain.fresh_inputs()
    chain.forward()  # compiles the PDL variants outside the capture
    # mrv2's capture stream with its per-stream buffers (the decode's tickets,
    # split K's arrival counters), as every mrv2 capture runs: on torch's own
    # capture stream the one-launch decode and split K would fall back to
    # their one-buffer-free forms, which sum in another order than eager.
    warm_capture_stream()
    before = (counters["decode_two_launch_fallbacks"], counters["skinny_split_k_fallbacks"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream()):
        out = chain.forward()
    assert (counters["decode_two_launch_fallbacks"], counters["skinny_split_k_fallbacks"]) == before
    for call in range(3):
        chain.fresh_inputs()
        x0, kc0, vc0 = chain.x.clone(), chain.kc.clone(), chain.vc.clone()
        graph.replay()
        got, got_kc, got_vc = out.clone(), chain.kc.clone(), chain.vc.clone()
        # the same kernels without PDL, eagerly, on the same inputs
        chain.x.copy_(x0)
        chain.kc.copy_(kc0)
        chain.vc.copy_(vc0)
        monkeypatch.setenv("MRV2_PDL", "0")
        want = chain.forward()
        monkeypatch.delenv("MRV2_PDL")
        torch.cuda.synchronize()
        assert torch.isfinite(want).all()
        assert torch.equal(got, want), f"call {call}: outputs differ"
        assert torch.equal(got_kc, chain.kc) and torch.equal(got_vc, chain.vc), \
            f"call {call}: caches differ"
