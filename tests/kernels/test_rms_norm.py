"""compile_backend/kernels/rms_norm.py and silu_mul.py: the norm and the gate of
`mrv2::norm_linear`'s three-launch form, against their references (which
round as the eager model rounds)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICES, DTYPE_IDS, DTYPES, gen, randn, stable_seed
from compile_backend.kernels.rms_norm import MAX_BLOCK_K, add_rms_norm, rms_norm, rms_norm_ref
from compile_backend.kernels.silu_mul import BLOCK, silu_mul, silu_mul_ref

# One rounding step of the dtype: the kernels and the references may differ
# by one where an fp32 intermediate sits next to a rounding boundary.
ULP = {torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def _close(out, ref, dtype, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    err = ((out.float() - ref.float()).abs() / ref.float().abs().clamp_min(1.0)).max().item()
    assert err <= 2 * ULP[dtype], f"{what}: max relative error {err:.3g}"
    if dtype != torch.float32:  # after the rounding, nearly every element is the reference's own
        assert (out != ref).float().mean().item() <= 0.01, what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (2, 5, 48), (7, MAX_BLOCK_K + 904)])
def test_rms_norm_equals_the_reference(device, dtype, shape):
    """Rows of one and of several tiles (K past MAX_BLOCK_K loops), leading
    dims, a ragged K; weights around 1 as trained norms have."""
    g = gen(stable_seed("rms", str(dtype), shape))
    x = randn(shape, dtype, device, g, scale=3.0)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype=dtype, device=device)
    for eps in (1e-6, 1e-5):
        _close(rms_norm(x, w, eps), rms_norm_ref(x, w, eps), dtype, f"{shape} eps={eps}")


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_takes_strided_rows_and_no_rows(device):
    dtype = torch.bfloat16
    g = gen(stable_seed("rms-strided"))
    base = randn((6, 160), dtype, device, g)
    x = base[::2, :96]  # rows 320 elements apart
    w = randn((96,), dtype, device, g)
    _close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype, "strided")
    empty = rms_norm(base[:0], randn((160,), dtype, device, g), 1e-6)
    assert empty.shape == (0, 160)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (2, 5, 48), (3, MAX_BLOCK_K + 904)])
def test_add_rms_norm_equals_the_add_then_the_reference(device, dtype, shape):
    """The sum equals torch's add bit for bit (one rounding of the fp32 sum),
    the norm the reference's of that sum; inputs untouched. K past
    MAX_BLOCK_K: the second pass recomputes the sum it stored."""
    g = gen(stable_seed("add-rms", str(dtype), shape))
    x = randn(shape, dtype, device, g, scale=3.0)
    r = randn(shape, dtype, device, g, scale=3.0)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype=dtype, device=device)
    x0, r0 = x.clone(), r.clone()
    s, out = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r), f"{shape}: the sum"
    assert s.data_ptr() not in (x.data_ptr(), r.data_ptr())
    _close(out, rms_norm_ref(x + r, w, 1e-5), dtype, f"{shape}")
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_takes_strided_rows(device):
    dtype = torch.bfloat16
    g = gen(stable_seed("add-rms-strided"))
    base = randn((6, 160), dtype, device, g)
    x, r = base[::2, :96], base[1::2, 40:136]  # rows 320 elements apart
    w = randn((96,), dtype, device, g)
    s, out = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and s.is_contiguous()
    _close(out, rms_norm_ref(x + r, w, 1e-6), dtype, "strided")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 2), (3, 96), (2, 3, 2 * BLOCK + 10)])
def test_silu_mul_equals_the_reference(device, dtype, shape):
    g = gen(stable_seed("silu", str(dtype), shape))
    y = randn(shape, dtype, device, g, scale=4.0)
    _close(silu_mul(y), silu_mul_ref(y), dtype, f"{shape}")


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_takes_strided_rows_and_refuses_an_odd_width(device):
    g = gen(stable_seed("silu-strided"))
    base = randn((4, 300), torch.bfloat16, device, g)
    y = base[:, :200]
    _close(silu_mul(y), silu_mul_ref(y), torch.bfloat16, "strided")
    with pytest.raises(AssertionError, match="even N"):
        silu_mul(base[:, :7])


@pytest.mark.parametrize("device", DEVICES)
def test_a_layout_is_checked_once_then_launched_from_its_plan(device):
    """Note [checked layouts]: the second call of a layout reuses the first
    call's plan (a capture of 35 sizes x 64 norms would otherwise pay
    kernel[grid]'s host time at every call), with new values each time."""
    import compile_backend.kernels.rms_norm as rn
    import compile_backend.kernels.silu_mul as sm
    rn._LAUNCHES.clear()
    sm._LAUNCHES.clear()
    dtype = torch.bfloat16
    w = randn((96,), dtype, device, gen(stable_seed("memo-w")))
    for seed in range(3):
        x = randn((5, 96), dtype, device, gen(stable_seed("memo-x", seed)))
        _close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype, f"norm call {seed}")
        _close(silu_mul(x), silu_mul_ref(x), dtype, f"gate call {seed}")
    assert len(rn._LAUNCHES) == 1 and len(sm._LAUNCHES) == 1
    x = randn((7, 96), dtype, device, gen(stable_seed("memo-x7")))
    _close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype, "another row count")
    _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype, "another eps")
    assert len(rn._LAUNCHES) == 3
