"""The skinny linear kernel and mrv2::linear_add (compile_backend/kernels/skinny_linear.py):
against a fp32 reference computed from the same rounded inputs, on fresh
random inputs, for every row count 1..16, ragged N and K (masked tiles),
strided x, a row slice of a packed weight, bias and residual, 65-512 rows in
row tiles; the op's choice between the kernel and torch; misuse errors that
touch nothing.

Tolerance: relative error ||out - ref|| / ||ref|| per dtype (kernel_cases.REL_TOL:
one final rounding of the output)."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from compile_backend.core import stream_buffers
from kernel_cases import DEVICES, assert_close_rel, gen, randn, stable_seed
from kernel_cases import gpu_dot_limits  # noqa: F401  (autouse: tl.dot's GPU minimum)
from compile_backend.kernels.skinny_linear import (ARRIVALS, CONFIGS, MAX_ROWS, WIDE_ROWS,
                                                   linear_add, linear_add_ref, one_wave_split,
                                                   skinny_allowed, skinny_config, skinny_fills,
                                                   skinny_linear, skinny_pays)

LOW = [torch.float16, torch.bfloat16]
LOW_IDS = ["fp16", "bf16"]


def _ref(x, w, b=None, r=None):
    out = x.double() @ w.double().T
    if b is not None:
        out = out + b.double()
    if r is not None:
        out = out + r.double()
    return out


def _operands(M, N, K, dtype, device, seed, bias=True, residual=True):
    g = gen(seed)
    x = randn((M, K), dtype, device, g)
    w = randn((N, K), dtype, device, g, scale=K ** -0.5)
    b = randn((N,), dtype, device, g) if bias else None
    r = randn((M, N), dtype, device, g) if residual else None
    return x, w, b, r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("M", [1, 3, 16, 17, 40, 64])
@pytest.mark.parametrize("N,K", [(64, 128), (40, 72), (17, 33)])
def test_equals_the_reference(device, dtype, M, N, K):
    for bias in (False, True):
        for residual in (False, True):
            x, w, b, r = _operands(M, N, K, dtype, device,
                                   stable_seed("skinny", M, N, K, bias, residual, str(dtype)),
                                   bias, residual)
            out = skinny_linear(x, w, b, r)
            assert out.shape == (M, N) and out.dtype == dtype and out.is_contiguous()
            assert_close_rel(out, _ref(x, w, b, r), dtype, f"M={M} N={N} K={K} b={bias} r={residual}")


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_packed_weight_slices_and_leading_dims(device):
    """x a column slice of a wider tensor (row stride > K); the weight a row
    slice of a packed [sum N, K] weight (what pack_siblings makes); x and the
    residual [B, T, K] (HF's layout)."""
    dtype = torch.bfloat16
    g = gen(stable_seed("skinny-strided"))
    wide = randn((5, 96), dtype, device, g)
    x = wide[:, 16:80]  # [5, 64], row stride 96
    packed = randn((112, 64), dtype, device, g, scale=0.125)
    w = packed[48:112]  # rows 48..111
    r = randn((5, 64), dtype, device, g)
    assert_close_rel(skinny_linear(x, w, None, r), _ref(x, w, None, r), dtype, "strided")
    x3, r3 = x.contiguous().view(1, 5, 64), r.view(1, 5, 64)
    out = skinny_linear(x3, w, None, r3)
    assert out.shape == (1, 5, 64)
    assert_close_rel(out.view(5, 64), _ref(x, w, None, r), dtype, "3-d")


@pytest.mark.parametrize("device", DEVICES)
def test_out_parameter_and_every_row_count(device):
    dtype = torch.float16
    for M in list(range(1, 17)) + [31, 32, 33, 63, MAX_ROWS]:
        x, w, b, r = _operands(M, 32, 48, dtype, device, stable_seed("rows", M))
        out = torch.full((M, 32), float("nan"), dtype=dtype, device=device)
        assert skinny_linear(x, w, b, r, out=out) is out
        assert_close_rel(out, _ref(x, w, b, r), dtype, f"M={M}")


@pytest.mark.parametrize("device", DEVICES)
def test_misuse_raises_with_the_fix_and_leaves_inputs_alone(device):
    x, w, b, r = _operands(4, 32, 48, torch.float16, device, stable_seed("misuse"))
    before = [t.clone() for t in (x, w, b, r)]
    with pytest.raises(ValueError, match="use F.linear"):
        skinny_linear(torch.zeros(WIDE_ROWS + 1, 48, dtype=x.dtype, device=device), w)
    with pytest.raises(ValueError, match="64 with a norm or gated"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 48, dtype=x.dtype, device=device),
                      torch.zeros(64, 48, dtype=x.dtype, device=device), gated=True)
    with pytest.raises(ValueError, match="use F.linear"):
        skinny_linear(x.float(), w)  # fp32: cuBLAS's
    with pytest.raises(ValueError, match="use F.linear"):
        skinny_linear(x, w.t().contiguous().t())  # weight not unit-stride along K
    with pytest.raises(ValueError, match="residual must be"):
        skinny_linear(x, w, b, r[:, :16])
    with pytest.raises(ValueError, match="bias must be"):
        skinny_linear(x, w, b[:16], r)
    with pytest.raises(ValueError, match="linear_add"):
        linear_add(x, w, b, r[:2])
    with pytest.raises(ValueError, match="one dtype"):
        linear_add(x, w, b, r.float())
    with pytest.raises(ValueError, match="bias must be"):
        linear_add(x, w, b.float(), r)
    for t, t0 in zip((x, w, b, r), before):
        assert torch.equal(t, t0)


def test_the_op_uses_torch_on_a_cpu_and_where_the_kernel_would_not_fill_the_gpu(monkeypatch):
    """On plain CPU tensors and for wide batches the op is what eager runs
    (the GEMM, then the add: bit for bit); `MRV2_SKINNY_GEMM=0` never uses the kernel."""
    g = gen(stable_seed("op-cpu"))
    x, w, r = randn((3, 24), torch.float32, "cpu", g), randn((40, 24), torch.float32, "cpu", g), \
        randn((3, 40), torch.float32, "cpu", g)
    assert not skinny_pays(x, w)  # CPU tensors: never
    torch.testing.assert_close(linear_add(x, w, None, r), r + F.linear(x, w), rtol=1e-6, atol=1e-6)
    b = randn((40,), torch.float32, "cpu", g)
    torch.testing.assert_close(linear_add(x, w, b, r), r + F.linear(x, w, b), rtol=1e-6, atol=1e-6)
    # a non-contiguous residual: the op's output is contiguous, like its fake
    rt = randn((40, 3), torch.float32, "cpu", g).t()
    out = linear_add(x, w, None, rt)
    assert out.is_contiguous()
    torch.testing.assert_close(out, rt + F.linear(x, w), rtol=1e-6, atol=1e-6)
    assert torch.equal(linear_add_ref(x, w, None, r), r + F.linear(x, w))
    assert torch.equal(linear_add_ref(x, w, b, r), r + F.linear(x, w, b))


def test_the_choice_follows_the_programs_and_the_override(monkeypatch):
    """The kernel takes a weight whose grid is wide enough (a quarter of the
    SMs up to 16 rows, nine tenths beyond), and only
    operands it can read (<= MAX_ROWS rows, bf16/fp16, unit stride along K);
    MRV2_SKINNY_GEMM forces the choice either way."""
    cfg16, cfg64 = skinny_config(1, 4096, 4096), skinny_config(64, 4096, 4096)
    split = cfg16.get("SPLIT_K", 1)  # a split launch counts (tile, split) pairs
    monkeypatch.delenv("MRV2_SKINNY_GEMM", raising=False)
    assert skinny_fills(1, 33 * 2 // split * cfg16["BLOCK_N"], 4096, 132)  # 33 x 2 / split tiles
    assert not skinny_fills(16, 32 // split * cfg16["BLOCK_N"], 4096, 132)
    assert skinny_fills(17, 119 * cfg64["BLOCK_N"], 4096, 132)
    assert not skinny_fills(64, 118 * cfg64["BLOCK_N"], 4096, 132)
    monkeypatch.setenv("MRV2_SKINNY_GEMM", "1")
    assert skinny_fills(1, 64, 64, 132)
    monkeypatch.setenv("MRV2_SKINNY_GEMM", "0")
    assert not skinny_fills(1, 132 * cfg16["BLOCK_N"], 4096, 132)
    # Note [wide rows]: 65-512 rows only where MRV2_WIDE_GEMM=1 asks (off until timed)
    for skinny_env, wide_env, want in (("", "", False), ("1", "", False), ("", "1", True),
                                       ("1", "1", True), ("0", "1", False)):
        monkeypatch.setenv("MRV2_SKINNY_GEMM", skinny_env)
        monkeypatch.setenv("MRV2_WIDE_GEMM", wide_env)
        assert skinny_fills(256, 4096, 14336, 132) is want, (skinny_env, wide_env)
    assert [skinny_config(M, 4096, 4096)["BLOCK_M"] for M in (1, 16, 17, 32, 33, 64, 65, 512)] == \
        [16, 16, 32, 32, 64, 64, 128, 128]
    x, w = torch.empty(MAX_ROWS, 64, dtype=torch.bfloat16), torch.empty(32, 64, dtype=torch.bfloat16)
    assert skinny_allowed(x, w) and skinny_allowed(x, w, fused=True)
    assert skinny_allowed(torch.empty(WIDE_ROWS, 64, dtype=torch.bfloat16), w)
    assert not skinny_allowed(torch.empty(MAX_ROWS + 1, 64, dtype=torch.bfloat16), w, fused=True)
    assert not skinny_allowed(torch.empty(WIDE_ROWS + 1, 64, dtype=torch.bfloat16), w)
    assert not skinny_allowed(x.float(), w.float())
    x = x[:16]
    assert not skinny_allowed(x, torch.empty(64, 32, dtype=torch.bfloat16).t())
    assert not skinny_allowed(torch.empty(64, 16, dtype=torch.bfloat16).t(), w)


def test_the_split_is_kept_only_where_it_fits_one_wave(monkeypatch):
    """Note [split K]: the 16-row tile splits K only where its programs still
    fit one wave of the SMs (llama-8B's o and down on 132 SMs: 64 column
    tiles, 128 programs), not where the column tiles fill the SMs already
    (qkv 96 tiles, gate_up 448, lm_head 2004); a config's SPLIT_K still
    wins, and without `num_sms` the table's split stands."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's tiles, not the interpreter's
    split, block_n = CONFIGS[16]["SPLIT_K"], CONFIGS[16]["BLOCK_N"]
    assert split == 2 and block_n == 64
    assert one_wave_split(2, 64, 132) == 2 and one_wave_split(2, 66, 132) == 2
    assert one_wave_split(2, 67, 132) == 1 and one_wave_split(4, 33, 132) == 4
    for N, K, want in ((4096, 4096, 2), (4096, 14336, 2), (6144, 4096, 1), (28672, 4096, 1),
                       (128256, 4096, 1)):
        for M in (1, 16):
            assert skinny_config(M, N, K, num_sms=132)["SPLIT_K"] == want, (M, N, K)
            assert skinny_config(M, N, K)["SPLIT_K"] == split  # no SM count: the table's
            assert skinny_config(M, N, K, {"SPLIT_K": 2}, num_sms=132)["SPLIT_K"] == 2
    # 256 rows of o in the 128-row tile: 2 row tiles x 32 column tiles, split in two
    assert skinny_config(256, 4096, 4096, num_sms=132)["SPLIT_K"] == CONFIGS[128]["SPLIT_K"] == 2
    assert skinny_config(512, 4096, 4096, num_sms=132)["SPLIT_K"] == 1  # 128 tiles fill them
    # the grid rule counts the programs that would run: qkv at one row fills a quarter unsplit
    assert skinny_fills(1, 6144, 4096, 132) and not skinny_fills(16, 1024, 4096, 132)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M", [65, 100, 128, 129, 256, 300, WIDE_ROWS])
def test_wide_rows_in_row_tiles(device, M):
    """Note [wide rows]: 65-512 rows run in 128-row tiles, each column tile's
    row tiles side by side, split K's parts and arrival counters per (row,
    column) tile: every row equals the reference, with bias and residual,
    and the stream's counters are re-armed (zero) after each launch."""
    dtype = torch.bfloat16
    x, w, b, r = _operands(M, 40, 96, dtype, device, stable_seed("wide", M))
    assert skinny_config(M, 40, 96)["BLOCK_M"] == 128
    assert_close_rel(skinny_linear(x, w, None, r), _ref(x, w, None, r), dtype, f"M={M}")
    assert_close_rel(skinny_linear(x, w, b, r), _ref(x, w, b, r), dtype, f"M={M} bias")
    assert_close_rel(skinny_linear(x, w), _ref(x, w), dtype, f"M={M} plain")
    arrivals = stream_buffers.buffer(ARRIVALS, torch.device(device))
    assert arrivals is not None and int(arrivals.abs().sum()) == 0


def test_wide_rows_through_the_op_only_where_asked(monkeypatch):
    """linear_add at 65-512 rows stays torch's GEMM and add unless MRV2_WIDE_GEMM=1
    (interpreter stand-in for a GPU: skinny_pays sees CUDA-like tensors)."""
    skinny = importlib.import_module("compile_backend.kernels.skinny_linear")
    calls = []
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **k: calls.append(a[0].shape) or
                        linear_add_ref(*a[:4]))
    monkeypatch.setattr(skinny, "skinny_pays",
                        lambda x, w, gated=False, norm=False: skinny.skinny_fills(
                            x.numel() // x.shape[-1], w.shape[0], w.shape[1], 132, gated, norm))
    x, w, b, r = _operands(256, 4096, 64, torch.bfloat16, "cpu", stable_seed("wide-op"))
    monkeypatch.delenv("MRV2_WIDE_GEMM", raising=False)
    linear_add(x, w, None, r)
    assert calls == []
    monkeypatch.setenv("MRV2_WIDE_GEMM", "1")
    linear_add(x, w, None, r)
    assert calls == [(256, 64)]


def _replays_equal_the_reference(x, w, r, seed_parts) -> None:
    """skinny_linear(x, w, None, r) captured in a CUDA graph, replayed three
    times with new values in x and r, each against the reference."""
    graph = torch.cuda.CUDAGraph()
    skinny_linear(x, w, None, r)  # compiled before the capture
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, None, r)
    for i in range(3):
        g = gen(stable_seed(*seed_parts, i))
        x.copy_(randn(x.shape, x.dtype, x.device, g))
        r.copy_(randn(r.shape, r.dtype, r.device, g))
        graph.replay()
        assert_close_rel(out, _ref(x, w, None, r), x.dtype, f"replay {i} {seed_parts}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096),
                                 (128256, 4096), (2000, 1000)])
def test_llama_8b_shapes_on_the_gpu_in_a_cuda_graph(dtype, N, K):
    """The decode shapes of llama-8B (qkv, o, down, gate_up, lm_head) and a
    ragged one, eager and replayed from a CUDA graph with new values in the
    captured inputs every time."""
    dev = "cuda"
    for M in (1, 7, 16, 32, 64):
        x, w, b, r = _operands(M, N, K, dtype, dev, stable_seed("gpu", M, N, K, str(dtype)))
        assert_close_rel(skinny_linear(x, w, None, r), _ref(x, w, None, r), dtype, f"M={M}")
        assert_close_rel(skinny_linear(x, w, b), _ref(x, w, b), dtype, f"M={M} bias")
        _replays_equal_the_reference(x, w, r, ("replay", M, N, K))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 14336), (2000, 1000)])
def test_wide_rows_on_the_gpu_in_a_cuda_graph(N, K):
    """Note [wide rows] at llama-8B's o and down shapes and a ragged one,
    65-512 rows in bf16: eager, and replayed from a CUDA graph on new values
    three times, against the reference; the op with MRV2_WIDE_GEMM=1 too."""
    dtype, dev = torch.bfloat16, "cuda"
    for M in (65, 128, 200, 256, 512):
        x, w, b, r = _operands(M, N, K, dtype, dev, stable_seed("gpu-wide", M, N, K))
        assert_close_rel(skinny_linear(x, w, None, r), _ref(x, w, None, r), dtype, f"M={M}")
        assert_close_rel(skinny_linear(x, w, b), _ref(x, w, b), dtype, f"M={M} bias")
        _replays_equal_the_reference(x, w, r, ("wide-replay", M, N, K))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_the_op_on_the_gpu_picks_the_kernel_for_decode_and_torch_beyond(monkeypatch):
    monkeypatch.delenv("MRV2_SKINNY_GEMM", raising=False)
    x, w, _, r = _operands(1, 4096, 4096, torch.bfloat16, "cuda", stable_seed("op-gpu"), bias=False)
    assert skinny_pays(x, w)
    assert_close_rel(linear_add(x, w, None, r), _ref(x, w, None, r), torch.bfloat16, "decode")
    x2, _, _, r2 = _operands(128, 4096, 4096, torch.bfloat16, "cuda", stable_seed("op-gpu-128"), bias=False)
    monkeypatch.delenv("MRV2_WIDE_GEMM", raising=False)
    assert not skinny_pays(x2, w)
    assert_close_rel(linear_add(x2, w, None, r2), _ref(x2, w, None, r2), torch.bfloat16, "prefill")
    monkeypatch.setenv("MRV2_WIDE_GEMM", "1")  # Note [wide rows]: the kernel where asked
    assert skinny_pays(x2, w)
    assert_close_rel(linear_add(x2, w, None, r2), _ref(x2, w, None, r2), torch.bfloat16, "wide")
    x3 = torch.zeros(WIDE_ROWS + 1, 4096, dtype=torch.bfloat16, device="cuda")
    assert not skinny_pays(x3, w)  # past the wide rows: torch
    narrow = w[:512]  # 16 programs: an eighth of the SMs
    assert not skinny_pays(x, narrow)


def _arrivals(device):
    from compile_backend.core import stream_buffers
    from compile_backend.kernels.skinny_linear import ARRIVALS
    return stream_buffers.buffer(ARRIVALS, torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("M,N,K,split", [(1, 64, 128, 2), (3, 40, 200, 4), (17, 33, 100, 3),
                                         (40, 48, 72, 2), (2, 48, 40, 4)])
def test_split_k_equals_the_reference_the_same_every_time_and_rearms(device, dtype, M, N, K, split):
    """Note [split K]: the parts summed by the last program to arrive, in
    split order: equal to the reference, bit-equal on a second call, and the
    arrival counters back at zero. (2, 48, 40, 4): fewer K tiles than splits
    asked (the launcher takes as many as there are tiles)."""
    for bias in (False, True):
        x, w, b, r = _operands(M, N, K, dtype, device, stable_seed("split", M, N, K, split, bias),
                               bias, True)
        cfg = {"SPLIT_K": split, "BLOCK_N": 16, "BLOCK_K": 32}
        out = skinny_linear(x, w, b, r, config=cfg)
        assert_close_rel(out, _ref(x, w, b, r), dtype, f"split {split} M={M} N={N} K={K} b={bias}")
        assert torch.equal(skinny_linear(x, w, b, r, config=cfg), out)
        assert int(_arrivals(device).abs().sum()) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_is_refused_for_the_gated_kernel_and_falls_back_without_counters(device, monkeypatch):
    from compile_backend.core import stream_buffers
    from compile_backend.core.counters import counters
    x, w, _, r = _operands(4, 32, 96, torch.bfloat16, device, stable_seed("split-misuse"), False)
    with pytest.raises(ValueError, match="SPLIT_K > 1 is not for the gated kernel"):
        skinny_linear(x, w, gated=True, config={"SPLIT_K": 2})
    # inside a capture on a stream that has no counters: one split, counted
    monkeypatch.setattr(stream_buffers, "buffer", lambda name, dev: None)
    before = counters["skinny_split_k_fallbacks"]
    out = skinny_linear(x, w, None, r, config={"SPLIT_K": 2, "BLOCK_N": 16, "BLOCK_K": 32})
    assert counters["skinny_split_k_fallbacks"] == before + 1
    assert_close_rel(out, _ref(x, w, None, r), torch.bfloat16, "fallback")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_wide_rows_on_the_gpu_equal_eager_bit_for_bit(monkeypatch):
    """linear_add above MAX_ROWS on the GPU (not forced to the kernel) is
    eager's GEMM then add: equal to `residual + F.linear` bit for bit, with
    and without bias, its inputs untouched; replayed in a CUDA graph on new
    values, within bf16's bound (cuBLAS may pick another algorithm inside a
    capture)."""
    monkeypatch.delenv("MRV2_SKINNY_GEMM", raising=False)
    monkeypatch.delenv("MRV2_WIDE_GEMM", raising=False)
    for M, N, K in ((65, 4096, 4096), (256, 4096, 14336), (512, 2000, 1000)):
        x, w, b, r = _operands(M, N, K, torch.bfloat16, "cuda", stable_seed("wide-eager", M, N, K))
        assert not skinny_pays(x, w)
        for bias in (None, b):
            before = [t.clone() for t in (x, w, r)]
            assert torch.equal(linear_add(x, w, bias, r), r + F.linear(x, w, bias)), (M, bias is None)
            assert all(torch.equal(t, t0) for t, t0 in zip((x, w, r), before))
        graph = torch.cuda.CUDAGraph()
        linear_add(x, w, b, r)  # cuBLAS's first call of this problem, outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = linear_add(x, w, b, r)
        for seed in range(2):
            g = gen(stable_seed("wide-eager-replay", M, seed))
            x.copy_(randn((M, K), torch.bfloat16, "cuda", g))
            r.copy_(randn((M, N), torch.bfloat16, "cuda", g))
            graph.replay()
            assert_close_rel(out, _ref(x, w, b, r), torch.bfloat16, f"wide replay M={M} {seed}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (4096, 14336), (2000, 1000)])
@pytest.mark.parametrize("split,block_n", [(2, 32), (4, 64), (4, 128), (3, 64)])
def test_split_k_on_the_gpu_chained_in_a_cuda_graph(N, K, split, block_n):
    """Split K on the GPU, eager and in a CUDA graph whose second launch
    reads the first's output (the same arrival counters, one launch after the
    other, with PDL where it is on), replayed on fresh inputs: equal to the
    reference, bit-equal to the eager launches, counters re-armed."""
    from compile_backend.core.counters import counters
    from compile_backend.runtime.graph_pool import capture_stream, warm_capture_stream
    dev, dtype = "cuda", torch.bfloat16
    for M in (1, 16, 64):
        x, w, b, r = _operands(M, N, K, dtype, dev, stable_seed("gpu-split", M, N, K, split))
        w2 = randn((K, N), dtype, dev, gen(stable_seed("w2", N, K)), scale=N ** -0.5)
        cfg = {"SPLIT_K": split, "BLOCK_N": block_n, "BLOCK_K": 128, "num_stages": 3}

        def chain():
            y = skinny_linear(x, w, b, r, config=cfg)
            return y, skinny_linear(y, w2, None, x, config=cfg)

        y, z = chain()
        assert_close_rel(y, _ref(x, w, b, r), dtype, f"M={M}")
        assert_close_rel(z, _ref(y, w2, None, x), dtype, f"M={M} second")
        warm_capture_stream()  # the capture stream's arrival counters, outside the capture
        graph = torch.cuda.CUDAGraph()
        fallbacks = counters["skinny_split_k_fallbacks"]
        with torch.cuda.graph(graph, stream=capture_stream()):
            gy, gz = chain()
        assert counters["skinny_split_k_fallbacks"] == fallbacks  # captured split, not one split
        for i in range(3):
            g = gen(stable_seed("split-replay", i, M, N, K))
            x.copy_(randn(x.shape, dtype, dev, g))
            r.copy_(randn(r.shape, dtype, dev, g))
            graph.replay()
            ey, ez = chain()
            assert torch.equal(gy, ey) and torch.equal(gz, ez), f"replay {i} M={M}"
            assert_close_rel(gz, _ref(ey, w2, None, x), dtype, f"replay {i} M={M}")
        torch.cuda.synchronize()
        assert int(_arrivals(dev).abs().sum()) == 0
        with torch.cuda.stream(capture_stream()):
            assert int(_arrivals(dev).abs().sum()) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_checked_layout_is_remembered(device, monkeypatch):
    """Note [checked layouts] (compile_backend/kernels/_launch.py): a call of a
    layout checked before skips the checks and the derivation and, with fresh
    values in new tensors, equals the reference; another layout is checked
    (misuse raises as before); the split of K is still decided per call (a
    capture on a stream without counters takes one split, counted, and the
    next call splits again)."""
    import importlib

    from compile_backend.core import stream_buffers
    from compile_backend.core.counters import counters
    from compile_backend.kernels._launch import LayoutMemo

    sl = importlib.import_module("compile_backend.kernels.skinny_linear")
    monkeypatch.setattr(sl, "_LAUNCHES", LayoutMemo())
    made = []
    real_init = sl._SkinnyPlan.__init__

    def counting(self, *args):
        made.append(args[0].dtype)
        real_init(self, *args)

    monkeypatch.setattr(sl._SkinnyPlan, "__init__", counting)
    dtype = torch.bfloat16
    for seed in range(3):  # one layout (M <= 16: K split in two by default)
        x, w, b, r = _operands(5, 40, 600, dtype, device, stable_seed("memo", seed))
        assert_close_rel(skinny_linear(x, w, b, r), _ref(x, w, b, r), dtype, f"call {seed}")
    assert made == [dtype] and len(sl._LAUNCHES) == 1
    plan = next(iter(sl._LAUNCHES._entries.values()))
    assert list(plan.launches) == [2]
    x, w, b, r = _operands(5, 40, 600, torch.float16, device, stable_seed("memo16"))
    assert_close_rel(skinny_linear(x, w, b, r), _ref(x, w, b, r), torch.float16, "fp16")
    assert made == [dtype, torch.float16]
    with pytest.raises(ValueError, match="bias must be"):
        skinny_linear(x, w, b[:-1], r)
    assert len(made) == 3 and len(sl._LAUNCHES) == 2  # checked, refused, not remembered
    x, w, b, r = _operands(5, 40, 600, dtype, device, stable_seed("memo-split"))
    real_buffer = stream_buffers.buffer
    monkeypatch.setattr(stream_buffers, "buffer", lambda name, dev: None)
    before = counters["skinny_split_k_fallbacks"]
    assert_close_rel(skinny_linear(x, w, b, r), _ref(x, w, b, r), dtype, "one split")
    assert counters["skinny_split_k_fallbacks"] == before + 1 and sorted(plan.launches) == [1, 2]
    monkeypatch.setattr(stream_buffers, "buffer", real_buffer)
    assert_close_rel(skinny_linear(x, w, b, r), _ref(x, w, b, r), dtype, "split again")
    assert counters["skinny_split_k_fallbacks"] == before + 1 and len(made) == 3
