"""mrv2::residual_norm_linear (compile_backend/kernels/residual_norm_linear.py):
linear_add then norm_linear as one op.

Where the two ops run the skinny kernel (or torch on the CPU) it IS the two
ops: equal bit for bit. Above 64 rows on a GPU it runs the GEMM, one launch
for the add and the norm, then the packed GEMM and the gate: bit for bit the
two ops' launches (the add's one rounding, the norm kernel's arithmetic), on
the GPU eager and replayed from a CUDA graph on new values; forced here on
interpreted CPU tensors, the sum equals torch's add bit for bit and y the
reference within one rounding. Misuse: a clear error, nothing touched.
"""

import importlib
import os

import pytest
import torch

from kernel_cases import gen, randn, rel_err, stable_seed
from compile_backend.core.packed_weights import pack_siblings, packed_view
from compile_backend.kernels.norm_linear import norm_linear_ref
from compile_backend.kernels.residual_norm_linear import residual_norm_linear, wide_here
from compile_backend.kernels.skinny_linear import linear_add_ref

EPS = 1e-5
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU kernels need TRITON_INTERPRET=1")
ONE_ROUNDING = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # rel. error, y against the reference


def _operands(M, N, K, NEXT, dtype, device, seed, gated, bias):
    """x [M, K] into the residual's linear w [N, K]; the residual [M, N]; the
    norm weight [N] (around 1) and the next linear's siblings, packed:
    gate and up (NEXT/2 each) when gated, else q, k, v."""
    g = gen(seed)
    x = randn((M, K), dtype, device, g)
    w = randn((N, K), dtype, device, g, scale=K ** -0.5)
    b = randn((N,), dtype, device, g) if bias else None
    r = randn((M, N), dtype, device, g)
    nw = (1.0 + 0.5 * torch.randn(N, generator=g)).to(dtype=dtype, device=device)
    sizes = [NEXT // 2, NEXT // 2] if gated else [NEXT // 2, NEXT // 4, NEXT - NEXT // 2 - NEXT // 4]
    ws = [randn((n, N), dtype, device, g, scale=N ** -0.5) for n in sizes]
    assert pack_siblings(ws) == "packed"
    return x, w, b, r, nw, ws


def _pair(x, w, b, r, nw, ws, gated):
    """The two ops, each as it runs alone."""
    h = torch.ops.mrv2.linear_add(x, w, b, r)
    return h, torch.ops.mrv2.norm_linear(h, nw, EPS, ws, [], gated)


@pytest.mark.parametrize("gated", [False, True])
def test_on_the_cpu_it_is_the_two_ops(gated):
    x, w, b, r, nw, ws = _operands(5, 48, 40, 64, torch.bfloat16, "cpu",
                                   stable_seed("rnl-cpu", gated), gated, True)
    x0, r0 = x.clone(), r.clone()
    h, y = residual_norm_linear(x, w, b, r, nw, EPS, ws, [], gated)
    eh, ey = _pair(x, w, b, r, nw, ws, gated)
    assert torch.equal(h, eh) and torch.equal(y, ey)
    assert torch.equal(x, x0) and torch.equal(r, r0)


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_wide_form_adds_inside_the_norm(monkeypatch, dtype):
    """The wide form forced on interpreted CPU tensors: one add_rms_norm
    launch between the two GEMMs; h equals linear_add's torch form bit for
    bit, y norm_linear's reference within one rounding; inputs untouched."""
    rnl = importlib.import_module("compile_backend.kernels.residual_norm_linear")
    launches = []
    real = rnl.add_rms_norm
    monkeypatch.setattr(rnl, "wide_here", lambda *a: True)
    monkeypatch.setattr(rnl, "add_rms_norm", lambda *a: launches.append(a[0].shape) or real(*a))
    for gated in (False, True):
        for bias in (False, True):
            x, w, b, r, nw, ws = _operands(6, 72, 56, 96, dtype, "cpu",
                                           stable_seed("rnl-wide", str(dtype), gated, bias), gated, bias)
            x0, r0 = x.clone(), r.clone()
            h, y = torch.ops.mrv2.residual_norm_linear(x, w, b, r, nw, EPS, ws, [], gated)
            assert torch.equal(h, linear_add_ref(x, w, b, r)), f"gated={gated} bias={bias}: h"
            ref = norm_linear_ref(h, nw, EPS, ws, [], gated)
            assert y.shape == ref.shape and y.is_contiguous()
            err = rel_err(y, ref)
            assert err <= ONE_ROUNDING[dtype], f"gated={gated} bias={bias}: y {err:.3g}"
            assert torch.equal(x, x0) and torch.equal(r, r0)
    assert launches == [(6, 72)] * 4


def test_the_wide_form_is_chosen_above_the_skinny_rows_on_a_gpu_only(monkeypatch):
    """wide_here: never on the CPU; with the norm kernel's device, only where
    linear_add would not run the skinny kernel (it decides by rows)."""
    rnl = importlib.import_module("compile_backend.kernels.residual_norm_linear")
    x, w, b, r, nw, ws = _operands(3, 32, 16, 48, torch.bfloat16, "cpu", stable_seed("rnl-rule"),
                                   True, False)
    packed = packed_view(ws)
    assert not wide_here(x, w, r, packed, True)  # the CPU: the norm kernel's launch is not here
    monkeypatch.setattr(rnl, "unfused_here", lambda t: True)
    pays = {}
    monkeypatch.setattr(rnl, "skinny_pays", lambda t, wt, gated=False, norm=False:
                        pays.setdefault((tuple(t.shape), norm), t.shape[0] <= 4))
    assert not wide_here(x, w, r, packed, True)  # 3 rows: the skinny kernel's
    x5, r5 = torch.cat([x, x]), torch.cat([r, r])
    assert wide_here(x5, w, r5, packed, True)
    assert not wide_here(x5[:0], w, r5[:0], packed, True)  # no rows: the two ops (empty)


def test_misuse_is_refused_with_what_to_give():
    x, w, b, r, nw, ws = _operands(4, 32, 16, 48, torch.bfloat16, "cpu", stable_seed("rnl-misuse"),
                                   True, False)
    with pytest.raises(ValueError, match=r"residual \[\.\.\., N\]"):
        residual_norm_linear(x, w, b, r[:, :8], nw, EPS, ws, [], True)
    with pytest.raises(ValueError, match="norm_weight must be"):
        residual_norm_linear(x, w, b, r, nw[:8], EPS, ws, [], True)
    with pytest.raises(ValueError, match="each weight must be"):
        residual_norm_linear(x, w, b, r, nw, EPS, [t[:, :8] for t in ws], [], True)


def test_the_fake_gives_both_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, b, r, nw, ws = _operands(4, 32, 16, 48, torch.bfloat16, "cpu", stable_seed("rnl-fake"),
                                   True, True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        h, y = torch.ops.mrv2.residual_norm_linear(x, w, b, r, nw, EPS, ws, [], True)
    assert tuple(h.shape) == (4, 32) and tuple(y.shape) == (4, 24) and h.dtype == y.dtype == x.dtype


# ---- on the GPU -----------------------------------------------------------------------

LLAMA_8B = {"o+gate_up": (4096, 4096, 28672, True), "down+qkv": (4096, 14336, 6144, False)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("pair", list(LLAMA_8B))
@pytest.mark.parametrize("M", [16, 64, 65, 256])
def test_llama_8b_on_the_gpu_equals_the_two_ops_bit_for_bit(pair, M):
    """llama-8B's residual stream in bf16: o then the norm and gate/up, down
    then the next layer's norm and qkv. At every row count the op equals the
    two ops run alone bit for bit (above 64 rows: the wide form, one launch
    fewer), eager and replayed from a CUDA graph on new x and residual three
    times; inputs untouched."""
    from compile_backend.runtime.graph_pool import capture_stream, warm_capture_stream

    N, K, NEXT, gated = LLAMA_8B[pair]
    x, w, b, r, nw, ws = _operands(M, N, K, NEXT, torch.bfloat16, "cuda",
                                   stable_seed("rnl-gpu", pair, M), gated, False)
    assert wide_here(x, w, r, packed_view(ws), gated) == (M > 64)
    op = torch.ops.mrv2.residual_norm_linear
    x0, r0 = x.clone(), r.clone()
    h, y = op(x, w, b, r, nw, EPS, ws, [], gated)
    eh, ey = _pair(x, w, b, r, nw, ws, gated)
    assert torch.equal(h, eh) and torch.equal(y, ey), f"{pair} M={M} eager"
    assert torch.equal(x, x0) and torch.equal(r, r0)
    assert rel_err(y, norm_linear_ref(linear_add_ref(x, w, b, r), nw, EPS, ws, [], gated)) < 2e-2
    op(x, w, b, r, nw, EPS, ws, [], gated)
    warm_capture_stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream()):
        gh, gy = op(x, w, b, r, nw, EPS, ws, [], gated)
    for i in range(3):
        g = gen(stable_seed("rnl-gpu-replay", pair, M, i))
        x.copy_(randn(x.shape, x.dtype, "cuda", g))
        r.copy_(randn(r.shape, r.dtype, "cuda", g))
        graph.replay()
        eh, ey = _pair(x, w, b, r, nw, ws, gated)
        assert torch.equal(gh, eh) and torch.equal(gy, ey), f"{pair} M={M} replay {i}"
