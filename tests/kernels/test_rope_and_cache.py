"""mrv2::rope_and_cache against its torch reference: rotary (the reference
models' `Rotary`, half-split layout) on q and k, the rotated k and v written
where each slot says, padding slots (-1) writing nothing; misuse raises
ValueError before anything is written."""

import os

import pytest
import torch

from kernel_cases import (
    DEVICES, DTYPE_IDS, DTYPES, assert_close_rel, assert_one_rounding, gen, paged_batch, randn,
    stable_seed,
)
from compile_backend.kernels import debug_checks
from compile_backend.kernels.rope_and_cache import rope_and_cache, rope_and_cache_ref, rotary_ref

# name -> (q_lens, seq_lens, padding tokens): T = 1, 5 and 33
CASES = {
    "decode_1": ([1], [40], 0),
    "decode_pad": ([1, 1, 1, 1], [5, 16, 33, 70], 1),
    "prefill_pad": ([20, 1, 9], [20, 99, 30], 3),
}
HEADS = [(4, 1), (8, 2), (32, 8)]


def _inv_freq(D, theta=10000.0, dtype=torch.float32, device="cpu"):
    """As `Rotary` builds it (compile_backend/demo/models/blocks.py)."""
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    return inv.to(dtype=dtype, device=device)


def _positions(T, g, device, high=100_000):
    """Random positions up to `high` (large angles), the first one `high - 1`."""
    pos = torch.randint(0, high, (T,), generator=g)
    pos[0] = high - 1
    return pos.to(device)


def _qkv(T, H, KVH, D, dtype, device, g):
    """q/k/v as column slices of one fused [T, (H + 2 KVH) * D] output (its row
    stride larger than each slice's width), viewed [T, heads, D]."""
    qkv = randn((T, (H + 2 * KVH) * D), dtype, device, g)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    return q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)


def _check_case(q_lens, seq_lens, pad, H, KVH, D, dtype, device, seed, block_size=16,
                theta=10000.0):
    g = gen(seed)
    batch = paged_batch(q_lens, seq_lens, block_size, device, g, pad_tokens=pad)
    T = batch.num_tokens
    q, k, v = _qkv(T, H, KVH, D, dtype, device, g)
    positions = _positions(T, g, device)
    inv_freq = _inv_freq(D, theta, device=device)
    shape = (batch.num_blocks, block_size, KVH, D)
    kc, vc = randn(shape, dtype, device, g), randn(shape, dtype, device, g)  # poisoned
    kc_ref, vc_ref = kc.clone().cpu(), vc.clone().cpu()
    out = rope_and_cache(q, k, v, positions, inv_freq, kc, vc, batch.slot_mapping)
    ref = rope_and_cache_ref(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), inv_freq.cpu(), kc_ref,
                             vc_ref, batch.slot_mapping.cpu())
    assert out.shape == (T, H, D) and out.dtype == dtype and out.is_contiguous()
    assert_one_rounding(out, ref, q, dtype, "q_rot")
    assert_close_rel(out, ref, dtype, "q_rot")
    # The whole caches: rows of real tokens as the reference wrote them,
    # every other row (padding tokens' included) untouched.
    kc, vc = kc.cpu(), vc.cpu()
    written = torch.zeros(batch.num_blocks * block_size, dtype=torch.bool)
    slots = batch.slot_mapping.cpu()
    real = slots >= 0
    written[slots[real]] = True
    written = written.view(batch.num_blocks, block_size)
    assert torch.equal(kc[~written], kc_ref[~written])
    assert torch.equal(vc, vc_ref)  # v is copied, not rotated: exact
    assert_one_rounding(kc[written], kc_ref[written], kc_ref[written], dtype, "key_cache")
    # Each real token's rotated key and its value are where its slot says.
    k_rot = rotary_ref(k.cpu(), positions.cpu(), inv_freq.cpu())
    assert_one_rounding(kc.view(-1, KVH, D)[slots[real]], k_rot[real], k.cpu()[real], dtype,
                         "keys at their slots")
    assert torch.equal(vc.view(-1, KVH, D)[slots[real]], v.cpu()[real])


def _head_dims(device, H):
    if device == "cpu":  # the interpreter: one program per token and KV head
        return [16] if H > 8 else [16, 64]
    return [16, 64, 128, 256]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}x{kv}" for h, kv in HEADS])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, heads, dtype, device):
    q_lens, seq_lens, pad = CASES[case]
    H, KVH = heads
    for D in _head_dims(device, H):
        _check_case(q_lens, seq_lens, pad, H, KVH, D, dtype, device,
                    stable_seed(case, H, KVH, D, str(dtype)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_head_dim_128(dtype, device):
    _check_case([1, 3], [17, 50], 2, 8, 2, 128, dtype, device, stable_seed("d128", str(dtype)),
                theta=500000.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [2, 6, 24, 40])
@pytest.mark.parametrize("heads", [(6, 2), (3, 3)], ids=["6x2", "3x3"])
def test_odd_sizes(heads, head_dim, device):
    """Head sizes whose half is not a power of two, head groups of 3 and 1,
    block size 8."""
    H, KVH = heads
    _check_case([2, 1], [9, 20], 1, H, KVH, head_dim, torch.bfloat16, device,
                stable_seed("odd", H, KVH, head_dim), block_size=8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_inv_freq_in_the_model_dtype(inv_dtype, device):
    """A bf16 model's Rotary holds a bf16 inv_freq: upcast exactly, as torch's
    promotion in `positions.float() * inv_freq` does."""
    g = gen(stable_seed("inv", str(inv_dtype)))
    batch = paged_batch([3], [10], 16, device, g, pad_tokens=1)
    T, H, KVH, D = batch.num_tokens, 4, 2, 32
    q, k, v = _qkv(T, H, KVH, D, torch.float32, device, g)
    positions = _positions(T, g, device, high=5000)
    inv_freq = _inv_freq(D, dtype=inv_dtype, device=device)
    kc = torch.zeros(batch.num_blocks, 16, KVH, D, device=device)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone().cpu(), vc.clone().cpu()
    out = rope_and_cache(q, k, v, positions, inv_freq, kc, vc, batch.slot_mapping)
    ref = rope_and_cache_ref(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), inv_freq.cpu(), kr, vr,
                             batch.slot_mapping.cpu())
    assert_one_rounding(out, ref, q, torch.float32, "q_rot")
    assert_one_rounding(kc, kr, kr, torch.float32, "key_cache")
    assert torch.equal(vc.cpu(), vr)


@pytest.mark.parametrize("device", DEVICES)
def test_out_parameter_and_int32_positions(device):
    g = gen(8)
    batch = paged_batch([2, 1], [6, 30], 16, device, g)
    T, H, KVH, D = batch.num_tokens, 4, 2, 16
    q, k, v = _qkv(T, H, KVH, D, torch.float16, device, g)
    positions = _positions(T, g, device).int()
    inv_freq = _inv_freq(D, device=device)
    kc = randn((batch.num_blocks, 16, KVH, D), torch.float16, device, g)
    vc, kr = kc.clone(), kc.clone().cpu()
    vr = kr.clone()
    out = torch.empty(T, H, 2 * D, dtype=torch.float16, device=device)[:, :, :D]  # strided
    got = rope_and_cache(q, k, v, positions, inv_freq, kc, vc, batch.slot_mapping, out=out)
    assert got is out
    ref = rope_and_cache_ref(q.cpu(), k.cpu(), v.cpu(), positions.long().cpu(), inv_freq.cpu(),
                             kr, vr, batch.slot_mapping.cpu())
    assert_one_rounding(out, ref, q, torch.float16, "q_rot")
    assert_one_rounding(kc, kr, kr, torch.float16, "key_cache")


@pytest.mark.parametrize("device", DEVICES)
def test_no_cache_blocks(device):
    """Before caches are bound (0 blocks, every slot -1) q is still rotated."""
    g = gen(9)
    T, H, KVH, D = 3, 4, 2, 16
    q, k, v = _qkv(T, H, KVH, D, torch.float32, device, g)
    positions, inv_freq = _positions(T, g, device), _inv_freq(D, device=device)
    kc = torch.empty(0, 16, KVH, D, device=device)
    slots = torch.full((T,), -1, dtype=torch.int64, device=device)
    out = rope_and_cache(q, k, v, positions, inv_freq, kc, kc.clone(), slots)
    assert_one_rounding(out, rotary_ref(q.cpu(), positions.cpu(), inv_freq.cpu()), q,
                         torch.float32, "q_rot")
    empty = q[:0]
    assert rope_and_cache(empty, k[:0], v[:0], positions[:0], inv_freq, kc, kc.clone(),
                          slots[:0]).shape == (0, H, D)


def test_reference_is_the_models_rotary():
    """The CPU fallback computes exactly what blocks.py's Rotary does."""
    from compile_backend.demo.models.blocks import Rotary

    g = gen(10)
    for dtype in DTYPES:
        rot = Rotary(64, 500000.0).to(dtype)  # a model's .to(dtype) casts inv_freq too
        x = randn((7, 4, 64), dtype, "cpu", g)
        pos = _positions(7, g, "cpu")
        assert torch.equal(rotary_ref(x, pos, rot.inv_freq), rot(x, pos))
    # ... and that function turns each pair (x_j, x_{j+D/2}) by the angle
    # pos * inv_freq_j (taken as fp32 computes it): float64 complex arithmetic.
    rot = Rotary(64, 500000.0)
    x = randn((7, 4, 64), torch.float32, "cpu", g)
    pos = _positions(7, g, "cpu")
    z = torch.complex(x[..., :32].double(), x[..., 32:].double())
    ang = (pos.float()[:, None] * rot.inv_freq).double()[:, None, :]
    turned = z * torch.polar(torch.ones_like(ang), ang)
    want = torch.cat([turned.real, turned.imag], dim=-1)
    torch.testing.assert_close(rotary_ref(x, pos, rot.inv_freq).double(), want, rtol=1e-5, atol=1e-5)


# ---- misuse ----------------------------------------------------------------

MISUSE_DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
T_, H_, KVH_, D_ = 3, 4, 2, 16


def _args():
    g = gen(11)
    batch = paged_batch([2, 1], [5, 20], 16, MISUSE_DEV, g)
    q, k, v = _qkv(batch.num_tokens, H_, KVH_, D_, torch.float16, MISUSE_DEV, g)
    kc = randn((batch.num_blocks, 16, KVH_, D_), torch.float16, MISUSE_DEV, g)
    return dict(q=q, k=k, v=v, positions=_positions(batch.num_tokens, g, MISUSE_DEV),
                inv_freq=_inv_freq(D_, device=MISUSE_DEV), key_cache=kc, value_cache=kc.clone(),
                slot_mapping=batch.slot_mapping, out=None)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _bad_slot(t):
    t = t.clone()
    t[1] = 10_000
    return t


MISUSE = {
    "q": [("dtype", lambda t: t.double(), "q: expected dtype"),
          ("rank", lambda t: t.flatten(1), "q: expected a 3-d tensor"),
          ("layout", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "q: expected the last dimension"),
          ("odd_head", lambda t: t[:, :, :15], "q: expected an even head size"),
          ("device", _meta, "q: ")],
    "k": [("dtype", lambda t: t.float(), r"k: expected dtype float16 \(the dtype of q\)"),
          ("heads", lambda t: torch.cat([t, t[:, :1]], 1), "k: expected a number of KV heads that divides"),
          ("tokens", lambda t: t[:2], r"k: expected shape \(3, '\*', 16\)")],
    "v": [("shape", lambda t: t[:, :1], r"v: expected shape \(3, 2, 16\)"),
          ("layout", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "v: expected the last dimension")],
    "positions": [("dtype", lambda t: t.float(), "positions: expected dtype int32 or int64"),
                  ("shape", lambda t: t[:2], r"positions: expected shape \(3,\)")],
    "inv_freq": [("shape", lambda t: torch.cat([t, t]), r"inv_freq: expected shape \(8,\)"),
                 ("dtype", lambda t: t.long(), "inv_freq: expected dtype")],
    "key_cache": [("dtype", lambda t: t.float(), r"key_cache: expected dtype float16 \(the dtype of q\)"),
                  ("layout", lambda t: t.transpose(1, 2), "key_cache: expected a contiguous tensor")],
    "value_cache": [("shape", lambda t: t[:1].clone(), "value_cache: expected the shape of key_cache")],
    "slot_mapping": [("dtype", lambda t: t.int(), "slot_mapping: expected dtype int64"),
                     ("range", _bad_slot, r"rope_and_cache: slot_mapping\[1\] = 10000")],
    "out": [("shape", lambda _: torch.zeros(T_, H_, D_ + 2, dtype=torch.float16, device=MISUSE_DEV),
             r"out: expected shape \(3, 4, 16\)")],
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the interpreter or CUDA")
@pytest.mark.parametrize("arg,how,mutate,match",
                         [(a, h, m, x) for a, ms in MISUSE.items() for h, m, x in ms],
                         ids=[f"{a}-{h}" for a, ms in MISUSE.items() for h, _, _ in ms])
def test_misuse(arg, how, mutate, match):
    a = _args()
    a[arg] = mutate(a[arg])
    kept = {n: a[n].clone() for n in ("key_cache", "value_cache", "out")
            if a[n] is not None and a[n].device.type != "meta"}
    with debug_checks(), pytest.raises(ValueError, match=match):  # index checks on CUDA too
        rope_and_cache(**a)
    for n, before in kept.items():
        assert torch.equal(a[n], before), f"{n} was written"


def test_reference_checks_too():
    """The CPU fallback rejects what the launcher rejects (device aside)."""
    a = _args()
    a = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in a.items()}
    a["v"] = a["v"][:, :1]
    before = a["key_cache"].clone()
    with pytest.raises(ValueError, match=r"v: expected shape"):
        rope_and_cache_ref(**a)
    assert torch.equal(a["key_cache"], before)


# ---- GPU: model shapes ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("q_lens,pad", [([1], 0), ([1] * 60, 4)], ids=["T1", "T64"])
def test_llama8b_shapes_gpu(q_lens, pad):
    """Llama-3-8B's attention shapes (32 heads, 8 KV heads, head size 128,
    rope theta 500000), bf16, decode with 1 and 64 tokens."""
    g = gen(stable_seed("llama8b", len(q_lens)))
    seq_lens = torch.randint(1, 4096, (len(q_lens),), generator=g).tolist()
    _check_case(q_lens, seq_lens, pad, 32, 8, 128, torch.bfloat16, "cuda",
                stable_seed("llama8b", len(q_lens)), theta=500000.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_large_prefill_gpu():
    _check_case([512] * 4 + [1] * 32, [1024] * 4 + [3000] * 32, 13, 32, 8, 128, torch.bfloat16,
                "cuda", stable_seed("prefill", 2048), theta=500000.0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checked_layout_is_remembered(device, monkeypatch):
    """Note [checked layouts] (compile_backend/kernels/_launch.py): a call of a
    layout checked before skips the argument checks and the derivation, and
    with fresh values in new tensors still equals the reference; another
    layout is checked again; misuse raises as before (a non-tensor is never
    remembered; on CPU a remembered layout still checks its slots)."""
    import importlib

    from compile_backend.kernels._launch import LayoutMemo

    rc = importlib.import_module("compile_backend.kernels.rope_and_cache")
    monkeypatch.setattr(rc, "_LAUNCHES", LayoutMemo())
    checked = []
    real = rc._check_args

    def counting(*args, device_check):
        checked.append(device_check)  # the reference's own checks pass device_check=False
        return real(*args, device_check=device_check)

    monkeypatch.setattr(rc, "_check_args", counting)
    for seed in range(3):  # the same layout, new random values and tensors
        _check_case([1, 1, 1], [5, 40, 17], 1, 8, 2, 16, torch.bfloat16, device,
                    stable_seed("memo", seed))
    assert checked.count(True) == 1 and len(rc._LAUNCHES) == 1
    _check_case([1, 1, 1], [5, 40, 17], 1, 8, 2, 16, torch.float16, device, stable_seed("memo16"))
    assert checked.count(True) == 2 and len(rc._LAUNCHES) == 2
    g = gen(stable_seed("memo-misuse"))
    batch = paged_batch([1, 1, 1], [5, 40, 17], 16, device, g, pad_tokens=1)
    q, k, v = _qkv(batch.num_tokens, 8, 2, 16, torch.bfloat16, device, g)
    kc = randn((batch.num_blocks, 16, 2, 16), torch.bfloat16, device, g)
    args = (q, k, v, _positions(batch.num_tokens, g, device), _inv_freq(16, device=device), kc,
            kc.clone())
    with pytest.raises(ValueError, match="positions: expected a torch.Tensor"):
        rope_and_cache(*args[:3], args[3].tolist(), *args[4:], batch.slot_mapping)
    if device == "cpu":  # index checks run on CPU tensors, remembered layout or not
        bad = batch.slot_mapping.clone()
        bad[0] = batch.num_blocks * 16
        before = kc.clone()
        with pytest.raises(ValueError, match="slot_mapping"):
            rope_and_cache(*args, bad)
        assert torch.equal(kc, before)
