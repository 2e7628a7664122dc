"""RMSNorm prologue and SiLU·mul epilogue of the skinny linear kernel, and
the op mrv2::norm_linear (compile_backend/kernels/norm_linear.py, compile_backend/kernels/skinny_linear.py).

The kernel (through Triton's interpreter on the CPU, and on the GPU) against
two references on fresh random inputs:
  - `norm_linear_ref` (+ residual), eager torch op by op with its roundings
    (the normalized x, the times-weight, each linear, silu, the product):
    rel. error ||out - ref|| / ||ref|| <= REF_TOL, fp16 3e-3 and bf16 2e-2
    (the reference's four or five roundings and the kernel's one);
  - the kernel's own math in float64 (x * nw rounded to x's dtype for the
    dot, as the kernel feeds the tensor cores; rstd, bias, silu and the
    residual exact): kernel_cases.REL_TOL, one rounding of the output.
Row counts 1..64 across the 16/32/64-row tiles; K not a multiple of BLOCK_K
and N_out not a multiple of BLOCK_N (masked tiles); weights packed with
`pack_siblings` (qkv-like: three siblings; gate/up: two). The op on CPU
tensors (the reference), its misuse errors (nothing touched) and its fake.
"""

import importlib
import os

import pytest
import torch

from kernel_cases import assert_close_rel, gen, randn, rel_err, stable_seed
from kernel_cases import gpu_dot_limits  # noqa: F401  (autouse: tl.dot's GPU minimum)
from compile_backend.kernels.norm_linear import norm_linear_ref  # registers mrv2::norm_linear
from compile_backend.kernels.skinny_linear import (CONFIGS, FUSED_CONFIGS, FUSED_ROWS, skinny_config,
                                                   skinny_fills, skinny_linear, skinny_pays)
from compile_backend.core.packed_weights import pack_siblings, packed_view

LOW = [torch.float16, torch.bfloat16]
LOW_IDS = ["fp16", "bf16"]
# Against norm_linear_ref (module docstring): its roundings and the kernel's one.
REF_TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
EPS = 1e-5
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU kernels need TRITON_INTERPRET=1")


def _siblings(N: int, gated: bool) -> list[int]:
    """Output features of the siblings packed into [N, K]: gate and up (N/2
    each) when gated; else q, k, v (N/2, N/4, N - 3N/4) like llama's qkv."""
    return [N // 2, N // 2] if gated else [N // 2, N // 4, N - N // 2 - N // 4]


def _operands(M, N, K, dtype, device, seed, gated, bias, residual):
    """x [M, K], norm weight [K] (around 1, never 1 exactly), sibling
    weights packed into one [N, K] (and biases into [N]), residual [M, N_out]."""
    g = gen(seed)
    x = randn((M, K), dtype, device, g)
    nw = (1.0 + 0.5 * torch.randn(K, generator=g)).to(dtype=dtype, device=device)
    ws = [randn((n, K), dtype, device, g, scale=K ** -0.5) for n in _siblings(N, gated)]
    bs = [randn((n,), dtype, device, g) for n in _siblings(N, gated)] if bias else []
    assert pack_siblings(ws) == "packed"
    if bs:
        assert pack_siblings(bs) == "packed"
    r = randn((M, N // 2 if gated else N), dtype, device, g) if residual else None
    return x, nw, ws, bs, r


def _kernel_math(x, nw, eps, weight, bias, residual, gated):
    """float64: rstd[m] * (round(x * nw) @ w.T) + b, then silu(g) * u, then + residual."""
    xd = x.double()
    if nw is not None:
        rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
        h = (x.float() * nw.float()).to(x.dtype).double()  # the dot's operand
    else:
        rstd, h = 1.0, xd
    y = (h @ weight.double().T) * rstd
    if bias is not None:
        y = y + bias.double()
    if gated:
        g, u = y.chunk(2, dim=-1)
        y = g * torch.sigmoid(g) * u
    if residual is not None:
        y = y + residual.double()
    return y


def _check(out, x, nw, ws, bs, r, gated, what):
    dtype = x.dtype
    weight, bias = packed_view(ws), packed_view(bs) if bs else None
    ref = norm_linear_ref(x, nw, EPS, ws, bs, gated)
    if r is not None:
        ref = ref + r
    err = rel_err(out, ref)
    assert err <= REF_TOL[dtype], f"{what}: rel. error {err:.3g} against norm_linear_ref > {REF_TOL[dtype]}"
    assert_close_rel(out, _kernel_math(x, nw, EPS, weight, bias, r, gated), dtype, f"{what} (float64)")


@INTERPRETED
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("M,N,K", [(M, 104, 72) for M in (1, 5, 16, 17, 33, 64)]
                         + [(16, 160, 96), (64, 160, 96)])
def test_norm_and_gate_in_the_kernel_equal_the_reference(dtype, M, N, K):
    """(104, 72): K and N_out (104 or 52) off the interpreter's 32/16 tiles,
    so the last K tile and the last column block are masked, at every row
    tile; (160, 96): whole tiles."""
    for norm, gated in ((True, False), (False, True), (True, True)):
        for bias, residual in ((False, False), (True, False), (True, True)):
            x, nw, ws, bs, r = _operands(
                M, N, K, dtype, "cpu", stable_seed("norm-linear", M, N, K, norm, gated, bias,
                                                   residual, str(dtype)), gated, bias, residual)
            nw = nw if norm else None
            weight, b = packed_view(ws), packed_view(bs) if bs else None
            out = skinny_linear(x, weight, b, r, norm_weight=nw, eps=EPS, gated=gated)
            n_out = N // 2 if gated else N
            assert out.shape == (M, n_out) and out.dtype == dtype and out.is_contiguous()
            _check(out, x, nw, ws, bs, r, gated,
                   f"M={M} N={N} K={K} norm={norm} gated={gated} bias={bias} residual={residual}")


@INTERPRETED
@pytest.mark.parametrize("M,K,split", [(1, 200, 2), (5, 200, 4), (17, 100, 3), (64, 72, 2)])
def test_the_norm_splits_k_like_the_plain_kernel(M, K, split):
    """Note [split K] with the norm: each split's row sums of x^2 beside its
    part, summed in split order by the last program to arrive: equal to the
    reference, bit-equal on a second call, the stream's counters re-armed.
    (No default tile splits with the norm: FUSED_CONFIGS says why; a
    config can ask.)"""
    from compile_backend.core import stream_buffers
    from compile_backend.kernels.skinny_linear import ARRIVALS

    dtype = torch.bfloat16
    for bias, residual in ((False, False), (True, True)):
        x, nw, ws, bs, r = _operands(M, 104, K, dtype, "cpu",
                                     stable_seed("norm-split", M, K, split, bias), False, bias, residual)
        weight, b = packed_view(ws), packed_view(bs) if bs else None
        cfg = {"SPLIT_K": split, "BLOCK_N": 16, "BLOCK_K": 32}
        out = skinny_linear(x, weight, b, r, norm_weight=nw, eps=EPS, config=cfg)
        _check(out, x, nw, ws, bs, r, False, f"M={M} K={K} split={split} bias={bias}")
        again = skinny_linear(x, weight, b, r, norm_weight=nw, eps=EPS, config=cfg)
        assert torch.equal(again, out)
        assert int(stream_buffers.buffer(ARRIVALS, x.device).abs().sum()) == 0
    assert skinny_config(1, 6144, 4096, norm=True).get("SPLIT_K", 1) == 1


@INTERPRETED
def test_leading_dims_strided_x_and_the_out_parameter():
    """x [B, T, K] and a column slice of a wider tensor (row stride > K);
    a non-contiguous norm weight; `out` filled with NaN beforehand."""
    dtype = torch.bfloat16
    g = gen(stable_seed("norm-linear-strided"))
    wide = randn((6, 100), dtype, "cpu", g)
    x = wide[:, 10:82]  # [6, 72], row stride 100
    nw_wide = (1.0 + 0.5 * torch.randn(144, generator=g)).to(dtype)
    nw = nw_wide[::2]  # [72], stride 2
    ws = [randn((52, 72), dtype, "cpu", g, scale=72 ** -0.5) for _ in range(2)]
    pack_siblings(ws)
    out = torch.full((6, 52), float("nan"), dtype=dtype)
    assert skinny_linear(x, packed_view(ws), norm_weight=nw, eps=EPS, gated=True, out=out) is out
    _check(out, x, nw, ws, [], None, True, "strided")
    x3 = x.contiguous().view(2, 3, 72)
    out3 = skinny_linear(x3, packed_view(ws), norm_weight=nw, eps=EPS, gated=True)
    assert out3.shape == (2, 3, 52)
    assert torch.equal(out3.view(6, 52), out)


@INTERPRETED
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_without_the_new_arguments_the_kernel_is_the_plain_linear(dtype):
    """The defaults give exactly what the plain call gives, and that is
    exact where the arithmetic is: small integers, whose products and sums
    fp32 holds exactly and whose results x's dtype holds exactly."""
    g = gen(stable_seed("norm-linear-defaults", str(dtype)))
    for M in (1, 17, 40):
        x = torch.randint(-3, 4, (M, 72), generator=g).to(dtype)
        w = torch.randint(-2, 3, (104, 72), generator=g).to(dtype)
        b = torch.randint(-8, 9, (104,), generator=g).to(dtype)
        r = torch.randint(-8, 9, (M, 104), generator=g).to(dtype)
        out = skinny_linear(x, w, b, r)
        assert torch.equal(out, skinny_linear(x, w, b, r, norm_weight=None, eps=1e-6, gated=False))
        exact = x.double() @ w.double().T + b.double() + r.double()
        assert exact.abs().max() <= 256  # exact in bf16 too
        assert torch.equal(out, exact.to(dtype)), f"M={M}"


@INTERPRETED
def test_kernel_misuse_raises_with_the_fix_and_leaves_inputs_alone():
    x, nw, ws, bs, r = _operands(4, 104, 72, torch.float16, "cpu", stable_seed("nl-misuse"),
                                 True, True, True)
    w, b = packed_view(ws), packed_view(bs)
    before = [t.clone() for t in (x, nw, w, b, r)]
    with pytest.raises(ValueError, match=r"norm_weight must be \[72\]"):
        skinny_linear(x, w, norm_weight=nw[:64])
    with pytest.raises(ValueError, match="norm_weight must be"):
        skinny_linear(x, w, norm_weight=nw.float())
    with pytest.raises(ValueError, match="eps must be"):
        skinny_linear(x, w, norm_weight=nw, eps=-1.0)
    with pytest.raises(ValueError, match="gated needs an even N"):
        skinny_linear(x, w[:103], gated=True)
    with pytest.raises(ValueError, match=r"residual must be \(4, 52\)"):
        skinny_linear(x, w, b, torch.zeros(4, 104, dtype=x.dtype), gated=True)
    with pytest.raises(ValueError, match="bias must be"):
        skinny_linear(x, w, b[:52], r, gated=True)  # the packed bias has N entries
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear(x, w, gated=True, out=torch.empty(4, 104, dtype=x.dtype))
    for t, t0 in zip((x, nw, w, b, r), before):
        assert torch.equal(t, t0)


def test_gated_programs_count_the_output_columns(monkeypatch):
    """With a norm or gated, the kernel takes FUSED_CONFIGS (a gated program
    reads BLOCK_N gate rows and BLOCK_N up rows), and the choice counts
    N_out / BLOCK_N programs (the GPU's tiles: not the interpreter's small ones)."""
    skinny = importlib.import_module("compile_backend.kernels.skinny_linear")  # the module
    monkeypatch.delenv("MRV2_SKINNY_GEMM", raising=False)
    monkeypatch.setattr(skinny, "interpreting", lambda: False)
    for M in (1, 16, 33, 64):
        bm = skinny_config(M, 4096, 4096)["BLOCK_M"]
        for gated, norm in ((True, False), (True, True), (False, True)):
            assert skinny_config(M, 28672, 4096, gated=gated, norm=norm) == \
                dict(FUSED_CONFIGS[(bm, gated)], BLOCK_M=bm)
        assert skinny_config(M, 28672, 4096) == dict(CONFIGS[bm], BLOCK_M=bm)
    bn = skinny_config(1, 4096, 4096, gated=True)["BLOCK_N"]
    assert skinny_fills(1, 2 * 33 * bn, 4096, 132, gated=True)  # 33 programs: a quarter of 132
    assert not skinny_fills(1, 2 * 32 * bn, 4096, 132, gated=True)
    # above FUSED_ROWS the three-launch form, however wide the grid
    for M in (FUSED_ROWS + 1, 33, 64):
        for gated, norm in ((True, False), (True, True), (False, True)):
            assert not skinny_fills(M, 2 * 28672, 4096, 132, gated=gated, norm=norm)
        assert skinny_fills(M, 28672, 4096, 132)  # the plain kernel still takes them
    monkeypatch.setenv("MRV2_SKINNY_GEMM", "1")
    assert skinny_fills(33, 2 * 28672, 4096, 132, gated=True, norm=True)
    assert skinny_fills(1, 64, 64, 132, gated=True)
    x, w = torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.bfloat16)
    assert not skinny_pays(x, w, gated=True)  # CPU tensors: never


# --- the op on the CPU ---------------------------------------------------------------------------

def _fp32_formula(x, nw, eps, weights, biases, gated):
    """RMSNorm -> linear(s) -> silu(g) * u, written out in fp32."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * nw if nw is not None else x
    y = h @ torch.cat(weights).T
    if biases:
        y = y + torch.cat(biases)
    if gated:
        g, u = y.chunk(2, -1)
        y = g * torch.sigmoid(g) * u
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_the_op_on_cpu_tensors_is_the_reference(dtype, packed):
    """Plain CPU tensors run `norm_linear_ref` (packed or not, the same
    values); in fp32 that is the formula written out."""
    for norm in (False, True):
        for gated in (False, True):
            for bias in (False, True):
                g = gen(stable_seed("nl-op", str(dtype), packed, norm, gated, bias))
                x = randn((2, 3, 48), dtype, "cpu", g)
                nw = (1.0 + 0.5 * torch.randn(48, generator=g)).to(dtype) if norm else None
                ws = [randn((n, 48), dtype, "cpu", g, scale=48 ** -0.5) for n in _siblings(40, gated)]
                bs = [randn((n,), dtype, "cpu", g) for n in _siblings(40, gated)] if bias else []
                if packed:
                    pack_siblings(ws)
                    if bs:
                        pack_siblings(bs)
                assert (packed_view(ws) is not None) == packed
                out = torch.ops.mrv2.norm_linear(x, nw, EPS, ws, bs, gated)
                ref = norm_linear_ref(x, nw, EPS, ws, bs, gated)
                assert out.shape == (2, 3, 20 if gated else 40) and out.is_contiguous()
                assert torch.equal(out, ref)
                if dtype == torch.float32:
                    torch.testing.assert_close(out, _fp32_formula(x, nw, EPS, ws, bs, gated),
                                               rtol=1e-5, atol=1e-5)


@INTERPRETED
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_the_three_launch_form_equals_the_reference(monkeypatch, dtype):
    """Above FUSED_ROWS on a GPU the op runs the norm, the packed linear and
    the gate as three launches (rms_norm.py, F.linear, silu_mul.py); here
    forced on interpreted CPU tensors, where the linear is F.linear."""
    nl = importlib.import_module("compile_backend.kernels.norm_linear")
    calls = []
    monkeypatch.setattr(nl, "unfused_here", lambda x: calls.append(x.shape) or True)
    for norm in (False, True):
        for gated in (False, True):
            for bias in (False, True):
                g = gen(stable_seed("nl-3", str(dtype), norm, gated, bias))
                x = randn((2, 17, 72), dtype, "cpu", g)
                nw = (1.0 + 0.5 * torch.randn(72, generator=g)).to(dtype) if norm else None
                ws = [randn((n, 72), dtype, "cpu", g, scale=72 ** -0.5) for n in _siblings(104, gated)]
                bs = [randn((n,), dtype, "cpu", g) for n in _siblings(104, gated)] if bias else []
                pack_siblings(ws)
                if bs:
                    pack_siblings(bs)
                out = torch.ops.mrv2.norm_linear(x, nw, EPS, ws, bs, gated)
                ref = norm_linear_ref(x, nw, EPS, ws, bs, gated)
                assert out.shape == ref.shape and out.is_contiguous()
                err = rel_err(out, ref)
                assert err <= REF_TOL[dtype] / 4, f"norm={norm} gated={gated} bias={bias}: {err:.3g}"
    assert len(calls) == 8
    # unpacked siblings: the reference, never the three launches
    ws = [randn((n, 72), dtype, "cpu", gen(stable_seed("nl-3-unpacked", n))) for n in (8, 8)]
    x = randn((3, 72), dtype, "cpu", gen(stable_seed("nl-3-x")))
    assert torch.equal(torch.ops.mrv2.norm_linear(x, None, EPS, ws, [], True),
                       norm_linear_ref(x, None, EPS, ws, [], True))
    assert len(calls) == 8


def test_the_op_misuse_raises_and_touches_nothing():
    g = gen(stable_seed("nl-op-misuse"))
    dtype = torch.bfloat16
    x = randn((3, 48), dtype, "cpu", g)
    nw = (1.0 + 0.5 * torch.randn(48, generator=g)).to(dtype)
    ws = [randn((20, 48), dtype, "cpu", g) for _ in range(2)]
    bs = [randn((20,), dtype, "cpu", g) for _ in range(2)]
    pack_siblings(ws)
    before = [t.clone() for t in (x, nw, *ws, *bs)]
    op = torch.ops.mrv2.norm_linear
    with pytest.raises(ValueError, match=r"norm_weight must be \[48\]"):
        op(x, nw[:40], EPS, ws, bs, True)
    with pytest.raises(ValueError, match="norm_weight must be"):
        op(x, nw.float(), EPS, ws, bs, True)
    with pytest.raises(ValueError, match="gated needs an even number"):
        op(x, nw, EPS, [ws[0], ws[1][:7]], [], True)
    with pytest.raises(ValueError, match=r"each weight must be \[N, 48\]"):
        op(x, nw, EPS, [randn((20, 40), dtype, "cpu", g)], [], False)
    with pytest.raises(ValueError, match="one bias"):
        op(x, nw, EPS, ws, bs[:1], False)
    with pytest.raises(ValueError, match="eps must be"):
        op(x, nw, -1.0, ws, bs, False)
    with pytest.raises(ValueError, match="no weights"):
        op(x, nw, EPS, [], [], False)
    for t, t0 in zip((x, nw, *ws, *bs), before):
        assert torch.equal(t, t0)
    assert packed_view(ws) is not None  # still packed


def test_the_fake_has_the_output_shape_and_checks_too():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16)
        nw = torch.empty(64, dtype=torch.bfloat16)
        qkv = [torch.empty(n, 64, dtype=torch.bfloat16) for n in (64, 16, 16)]
        gate_up = [torch.empty(96, 64, dtype=torch.bfloat16) for _ in range(2)]
        out = torch.ops.mrv2.norm_linear(x, nw, EPS, qkv, [], False)
        assert out.shape == (2, 5, 96) and out.dtype == torch.bfloat16
        out = torch.ops.mrv2.norm_linear(x, nw, EPS, gate_up, [], True)
        assert out.shape == (2, 5, 96)  # 192 features, halved by the gate
        out = torch.ops.mrv2.norm_linear(x, None, EPS, gate_up, [], True)
        assert out.shape == (2, 5, 96)
        with pytest.raises(ValueError, match="norm_weight must be"):
            torch.ops.mrv2.norm_linear(x, nw[:8], EPS, qkv, [], False)


# --- llama-8B shapes on the GPU ------------------------------------------------------------------

LLAMA_8B = {"qkv": ([4096, 1024, 1024], False), "gate_up": ([14336, 14336], True)}


def _llama_8b_operands(shape, M, seed):
    """bf16 on the GPU: x [M, 4096], a norm weight around 1, and `shape`'s
    sibling weights packed (LLAMA_8B); and whether it is gated."""
    dtype, dev, K = torch.bfloat16, "cuda", 4096
    sizes, gated = LLAMA_8B[shape]
    g = gen(stable_seed(seed, shape, M))
    x = randn((M, K), dtype, dev, g)
    nw = (1.0 + 0.5 * torch.randn(K, generator=g)).to(dtype=dtype, device=dev)
    ws = [randn((n, K), dtype, dev, g, scale=K ** -0.5) for n in sizes]
    assert pack_siblings(ws) == "packed"
    return x, nw, ws, gated


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("M", [1, 7, 16, 33, 64])
def test_llama_8b_on_the_gpu_eager_and_in_a_cuda_graph(monkeypatch, shape, M):
    """RMSNorm + qkv and RMSNorm + gate/up + SiLU·mul at llama-8B's shapes
    in bf16 through the op, with the kernel forced (MRV2_SKINNY_GEMM=1):
    eager, then captured once on mrv2's capture stream (as a step is: its
    split-K arrival counters serve any tile that splits, where torch's own
    capture stream would make it fall back to one split) and replayed with
    new inputs three times."""
    from compile_backend.core.counters import counters
    from compile_backend.runtime.graph_pool import capture_stream, warm_capture_stream

    monkeypatch.setenv("MRV2_SKINNY_GEMM", "1")
    x, nw, ws, gated = _llama_8b_operands(shape, M, "nl-gpu")
    dtype, dev = x.dtype, x.device
    assert skinny_pays(x, packed_view(ws), gated)
    op = torch.ops.mrv2.norm_linear
    _check(op(x, nw, EPS, ws, [], gated), x, nw, ws, [], None, gated, f"{shape} M={M} eager")
    graph = torch.cuda.CUDAGraph()
    op(x, nw, EPS, ws, [], gated)  # compiled before the capture
    warm_capture_stream()
    before = counters["skinny_split_k_fallbacks"]
    with torch.cuda.graph(graph, stream=capture_stream()):
        out = op(x, nw, EPS, ws, [], gated)
    assert counters["skinny_split_k_fallbacks"] == before
    for i in range(3):
        x.copy_(randn(x.shape, dtype, dev, gen(stable_seed("nl-replay", shape, M, i))))
        graph.replay()
        _check(out, x, nw, ws, [], None, gated, f"{shape} M={M} replay {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("M", [FUSED_ROWS + 1, 32, 64, 200])
def test_above_the_fused_rows_three_launches_on_the_gpu(monkeypatch, shape, M):
    """Above FUSED_ROWS (skinny_fills) the op runs the norm, the packed linear
    and the gate as three launches: eager and replayed from a CUDA graph on
    new inputs three times, against the reference and bit-equal to the same
    launches run eagerly (17-200 rows)."""
    from compile_backend.runtime.graph_pool import capture_stream, warm_capture_stream

    monkeypatch.delenv("MRV2_SKINNY_GEMM", raising=False)
    x, nw, ws, gated = _llama_8b_operands(shape, M, "nl-3-gpu")
    dtype, dev = x.dtype, x.device
    assert not skinny_pays(x, packed_view(ws), gated, norm=True)
    op = torch.ops.mrv2.norm_linear
    _check(op(x, nw, EPS, ws, [], gated), x, nw, ws, [], None, gated, f"{shape} M={M} eager")
    warm_capture_stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream()):
        out = op(x, nw, EPS, ws, [], gated)
    for i in range(3):
        x.copy_(randn(x.shape, dtype, dev, gen(stable_seed("nl-3-replay", shape, M, i))))
        graph.replay()
        _check(out, x, nw, ws, [], None, gated, f"{shape} M={M} replay {i}")
        assert torch.equal(out, op(x, nw, EPS, ws, [], gated)), f"{shape} M={M} replay {i}: not eager's bits"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_ragged_shapes_with_bias_and_residual_on_the_gpu():
    """K and N_out off every GPU tile (K 1000, N_out 1000), bias and
    residual, at the three row tiles; fp16 and bf16."""
    for dtype in LOW:
        for M in (1, 17, 64):
            x, nw, ws, bs, r = _operands(M, 2000, 1000, dtype, "cuda",
                                         stable_seed("nl-gpu-ragged", M, str(dtype)), True, True, True)
            out = skinny_linear(x, packed_view(ws), packed_view(bs), r, norm_weight=nw, eps=EPS,
                                gated=True)
            _check(out, x, nw, ws, bs, r, True, f"ragged M={M} {dtype}")
