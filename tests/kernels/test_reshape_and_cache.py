"""mrv2::reshape_and_cache against its torch reference: exact copies (no
arithmetic), every slot checked, padding slots (-1) write nothing."""

import pytest
import torch

from kernel_cases import stable_seed, DEVICES, DTYPE_IDS, DTYPES, gen, paged_batch, randn
from compile_backend.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

CASES = {
    "decode": ([1, 1, 1], [5, 16, 33], 0),
    "prefill_crossing_blocks": ([20, 37], [20, 40], 0),
    "padding": ([3, 1, 0], [19, 9, 0], 4),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, block_size, dtype, head_dim, device):
    q_lens, seq_lens, pad = CASES[case]
    g = gen(stable_seed(case, block_size, head_dim))
    batch = paged_batch(q_lens, seq_lens, block_size, device, g, pad_tokens=pad)
    KVH = 2
    key = randn((batch.num_tokens, KVH, head_dim), dtype, device, g)
    value = randn((batch.num_tokens, KVH, head_dim), dtype, device, g)
    shape = (batch.num_blocks, block_size, KVH, head_dim)
    kc, vc = randn(shape, dtype, device, g), randn(shape, dtype, device, g)  # poisoned
    kc_ref, vc_ref = kc.clone().cpu(), vc.clone().cpu()
    reshape_and_cache(key, value, kc, vc, batch.slot_mapping)
    reshape_and_cache_ref(key.cpu(), value.cpu(), kc_ref, vc_ref, batch.slot_mapping.cpu())
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)
    # Every real token landed where its slot says.
    for t, slot in enumerate(batch.slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(kc.view(-1, KVH, head_dim)[slot].cpu(), key[t].cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [4, 12])
def test_small_head_sizes(head_dim, device):
    test_matches_reference("padding", 8, torch.bfloat16, head_dim, device)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_key_value(device):
    """key/value as views of a fused qkv projection (token stride != KVH*D)."""
    g = gen(21)
    batch = paged_batch([5, 1], [5, 30], 16, device, g)
    T, KVH, D = batch.num_tokens, 2, 64
    qkv = randn((T, 3, KVH, D), torch.float16, device, g)
    key, value = qkv[:, 1], qkv[:, 2]
    kc = torch.zeros(batch.num_blocks, 16, KVH, D, dtype=torch.float16, device=device)
    vc = torch.zeros_like(kc)
    reshape_and_cache(key, value, kc, vc, batch.slot_mapping)
    kr, vr = torch.zeros_like(kc).cpu(), torch.zeros_like(vc).cpu()
    reshape_and_cache_ref(key.cpu(), value.cpu(), kr, vr, batch.slot_mapping.cpu())
    assert torch.equal(kc.cpu(), kr) and torch.equal(vc.cpu(), vr)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_large_gpu():
    g = gen(4)
    batch = paged_batch([512] * 8 + [1] * 64, [1024] * 8 + [3000] * 64, 16, "cuda", g, pad_tokens=13)
    key = randn((batch.num_tokens, 8, 128), torch.bfloat16, "cuda", g)
    value = randn((batch.num_tokens, 8, 128), torch.bfloat16, "cuda", g)
    kc = torch.zeros(batch.num_blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, batch.slot_mapping)
    reshape_and_cache_ref(key, value, kr, vr, batch.slot_mapping)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
