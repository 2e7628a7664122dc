"""mrv2::sconv against its torch reference (rel. error: kernel_cases.REL_TOL;
the reference sums in a different order), and one step == several steps with
the state carried (bit-exact in fp32, REL_TOL otherwise)."""

import pytest
import torch

from kernel_cases import (stable_seed, DEVICES, DTYPE_IDS, DTYPES, assert_close_rel, gen, randn,
                          search_in_steps, state_batch)
from compile_backend.kernels.sconv import sconv, sconv_ref

# name: (q_lens, state_indices, has_initial_state, padding tokens)
CASES = {
    "decode": ([1, 1, 1], [2, 0, 4], [True, True, False], 0),
    "prefill": ([9, 40], [1, 3], [False, False], 0),
    "mixed": ([1, 17, 2, 1], [4, 0, 2, 1], [True, False, True, True], 0),
    "padding_rows": ([5, 1, 0, 0], [3, 1, -1, -1], [True, True, False, False], 3),
    # one token per request (the decode shortcut) with a stateless request and
    # padding tokens: their rows are written as zeros
    "decode_padding": ([1, 1, 1, 0], [2, -1, 0, -1], [True, False, False, False], 2),
}
NUM_SLOTS = 6


def _inputs(C, K, dtype, device, g, bias=True):
    weight = randn((C, K), dtype, device, g, scale=0.5)
    b = randn((C,), dtype, device, g) if bias else None
    state = randn((NUM_SLOTS, C, K - 1), dtype, device, g)
    return weight, b, state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("C,K", [(80, 4), pytest.param(64, 3, marks=pytest.mark.slow_on_cpu)])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, C, K, dtype, device, max_query_len=None):
    q_lens, idx, init, pad = CASES[case]
    g = gen(stable_seed(case, C, K))
    qsl, state_indices, T = state_batch(q_lens, idx, device, pad)
    has_init = torch.tensor(init, device=device)
    x = randn((T, C), dtype, device, g)
    weight, bias, state = _inputs(C, K, dtype, device, g, bias=(K == 4))
    state_ref = state.clone().cpu()
    poisoned = torch.full_like(x, float("nan"))  # every row must be written
    out = sconv(x, weight, bias, state, qsl, state_indices, has_init,
                max(q_lens) if max_query_len is None else max_query_len, out=poisoned)
    assert out is poisoned
    ref = sconv_ref(x.cpu(), weight.cpu(), None if bias is None else bias.cpu(), state_ref,
                    qsl.cpu(), state_indices.cpu(), has_init.cpu())
    assert_close_rel(out, ref, dtype, "out")
    assert torch.equal(state.cpu(), state_ref), "state must hold exactly the last K-1 inputs"
    assert (out[int(qsl[-1]):] == 0).all()
    for b, i in enumerate(idx):  # padding rows leave their (nonexistent) slots alone
        if i < 0:
            assert (out[int(qsl[b]):int(qsl[b + 1])] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("C,K", [(1, 2), (3, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_few_channels(C, K, dtype, device):
    """Any channel count works (channels are tiled and masked): one channel,
    and fewer channels than the kernel is wide."""
    test_matches_reference("mixed", C, K, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["mixed", "padding_rows", "decode_padding"])
def test_padded_bound_and_search(case, device, monkeypatch):
    """max_query_len = the padded token count (what PIECEWISE passes): the
    grid scales with T (Note [request tiles]); a search chunk of 2 requests
    makes each program scan query_start_loc in several steps."""
    search_in_steps(monkeypatch, "compile_backend.kernels.sconv")
    q_lens, _, _, pad = CASES[case]
    test_matches_reference(case, 80, 4, torch.float32, device, max_query_len=sum(q_lens) + pad)


def _run_steps(x_seqs, steps, weight, bias, num_slots, dtype, device):
    """Run each request's sequence through `steps` (token counts per step,
    one list per request), all requests batched in every step."""
    C, K = weight.shape
    state = torch.full((num_slots, C, K - 1), float("nan"), dtype=dtype, device=device)
    outs = [[] for _ in x_seqs]
    done = [0] * len(x_seqs)
    for s in range(max(len(st) for st in steps)):
        q_lens = [st[s] if s < len(st) else 0 for st in steps]
        idx = [b if q else -1 for b, q in enumerate(q_lens)]
        init = [done[b] > 0 for b in range(len(x_seqs))]
        qsl, state_indices, _ = state_batch(q_lens, idx, device)
        x = torch.cat([xs[done[b]: done[b] + q_lens[b]] for b, xs in enumerate(x_seqs)])
        out = sconv(x, weight, bias, state, qsl, state_indices, torch.tensor(init, device=device),
                    max(q_lens))
        for b in range(len(x_seqs)):
            outs[b].append(out[int(qsl[b]):int(qsl[b + 1])])
            done[b] += q_lens[b]
    return [torch.cat(o) for o in outs], state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_step_equals_many_steps(dtype, device):
    g = gen(31)
    C, K = 48, 4
    lens = [23, 7, 2]
    x_seqs = [randn((n, C), dtype, device, g) for n in lens]
    weight, bias, _ = _inputs(C, K, dtype, device, g)
    one, state_one = _run_steps(x_seqs, [[n] for n in lens], weight, bias, 3, dtype, device)
    # Steps shorter than K-1 exercise the shifted state update.
    many, state_many = _run_steps(x_seqs, [[1, 2, 1, 10, 1, 8], [3, 1, 1, 1, 1], [1, 1]],
                                  weight, bias, 3, dtype, device)
    for a, b in zip(one, many):
        if dtype == torch.float32:
            assert torch.equal(a, b)
        else:
            assert_close_rel(b, a, dtype)
    assert torch.equal(state_one, state_many)  # the state holds inputs: always exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("bound", ["exact", "padded"])
def test_large_gpu(bound):
    """Several token tiles per request and > SEARCH requests; `padded` passes
    max_query_len = T, as PIECEWISE does."""
    g = gen(8)
    C, K = 4096, 4
    q_lens = [2048, 1, 1, 700] + [1] * 300
    qsl, idx, T = state_batch(q_lens, list(range(len(q_lens))), "cuda", pad_tokens=5)
    has_init = torch.rand(len(q_lens), generator=g) > 0.3
    x = randn((T, C), torch.bfloat16, "cuda", g)
    weight, bias, _ = _inputs(C, K, torch.bfloat16, "cuda", g)
    state = randn((len(q_lens), C, K - 1), torch.bfloat16, "cuda", g)
    sr = state.clone()
    out = sconv(x, weight, bias, state, qsl, idx, has_init.cuda(), max(q_lens) if bound == "exact" else T,
                out=torch.full_like(x, float("nan")))
    ref = sconv_ref(x, weight, bias, sr, qsl, idx, has_init.cuda())
    assert_close_rel(out, ref, torch.bfloat16)
    assert torch.equal(state, sr)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_decode_gpu():
    """The one-token shortcut at a decode batch of 256 with 8 padding tokens."""
    g = gen(18)
    C, K = 4096, 4
    qsl, idx, T = state_batch([1] * 250 + [0] * 6, list(range(250)) + [-1] * 6, "cuda", pad_tokens=8)
    x = randn((T, C), torch.bfloat16, "cuda", g)
    weight, bias, _ = _inputs(C, K, torch.bfloat16, "cuda", g)
    state = randn((256, C, K - 1), torch.bfloat16, "cuda", g)
    has_init = torch.rand(256, generator=g).cuda() > 0.3
    sr = state.clone()
    out = sconv(x, weight, bias, state, qsl, idx, has_init, 1, out=torch.full_like(x, float("nan")))
    ref = sconv_ref(x, weight, bias, sr, qsl, idx, has_init)
    assert_close_rel(out, ref, torch.bfloat16)
    assert torch.equal(state, sr) and (out[250:] == 0).all()
