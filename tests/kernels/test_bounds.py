"""Index checks (Note [index checks] in compile_backend/kernels/_checks.py): a block id, slot,
state index or query offset out of range raises ValueError naming the op, the
argument, the request (or token), the value and the valid range, before any
launch or write. Without the checks a block id past the cache crashes Triton's
interpreter and is read silently on a GPU; a negative one reads before the
cache (NaN or garbage); slots and state indices past the end write other
memory.

CPU tensors are always checked; CUDA tensors under `debug_checks()` (the gpu
tests here), and never during CUDA-graph capture."""

import os

import pytest
import torch

from compile_backend.runner.attention_metadata import AttentionMetadata
from compile_backend.core.forward_context import ForwardContext, set_forward_context
from kernel_cases import assert_close_rel, gen, paged_batch, randn, state_batch
from compile_backend.kernels import (debug_checks, kv_compress, reshape_and_cache, set_debug_checks, sconv,
                     unified_attention, unified_attention_ref)
from compile_backend.kernels._debug import index_checks_on

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="CPU kernels need TRITON_INTERPRET=1")
H, KVH, D, BS = 4, 2, 16, 16
PAST, NEG = "past", "neg"  # a bad id: == the number of blocks/slots/states, or -2


def _bad(kind: str, limit: int) -> int:
    return limit if kind == PAST else -2


def _attn(device, q_lens, seq_lens=(20, 9)):
    g = gen(1)
    batch = paged_batch(list(q_lens), list(seq_lens), BS, device, g)
    shape = (batch.num_blocks, BS, KVH, D)
    return dict(batch=batch, kc=randn(shape, torch.float32, device, g),
                vc=randn(shape, torch.float32, device, g),
                q=randn((batch.num_tokens, H, D), torch.float32, device, g),
                kv=randn((batch.num_tokens, KVH, D), torch.float32, device, g))


def _attend(a, block_table=None, seq_lens=None, qsl=None):
    b = a["batch"]
    return unified_attention(
        a["q"], a["kc"], a["vc"], b.query_start_loc if qsl is None else qsl,
        b.seq_lens if seq_lens is None else seq_lens,
        b.block_table if block_table is None else block_table, D ** -0.5, b.max_query_len,
        b.max_seq_len)


def _msg(op, arg, at, value, who, lo, hi):
    return (rf"{op}: {arg}\[{at}\] = {value} \({who}\) is out of range: expected .* in "
            rf"\[{lo}, {hi}\)")


# decode: the decode kernel; prefill: the prefill kernel.
PATHS = {"decode": (1, 1), "prefill": (5, 3)}


@needs_interp
@pytest.mark.parametrize("kind", [PAST, NEG])
@pytest.mark.parametrize("path", list(PATHS))
def test_attention_block_id(path, kind):
    a = _attn("cpu", PATHS[path])
    n = a["batch"].num_blocks
    table = a["batch"].block_table.clone()
    table[1, 0] = _bad(kind, n)  # request 1 (seq_len 9) uses entry 0 only
    caches = a["kc"].clone(), a["vc"].clone()
    with pytest.raises(ValueError, match=_msg("unified_attention", "block_table", "1, 0",
                                              table[1, 0].item(), "request 1", 0, n)):
        _attend(a, block_table=table)
    assert torch.equal(a["kc"], caches[0]) and torch.equal(a["vc"], caches[1])


@needs_interp
def test_attention_ignores_entries_it_does_not_read():
    """Padding rows and entries past ceil(seq_len / block_size) may hold
    anything: only what a request reads is checked."""
    a = _attn("cpu", (1, 1, 0), seq_lens=(20, 9, 0))
    b = a["batch"]
    table = b.block_table.clone()
    table[0, 2:] = 10 ** 6  # request 0 reads entries 0 and 1
    table[1, 1:] = -7  # request 1 reads entry 0
    table[2, :] = 10 ** 6  # padding row: no queries
    out = _attend(a, block_table=table)
    ref = unified_attention_ref(a["q"], a["kc"], a["vc"], b.query_start_loc, b.seq_lens,
                                b.block_table, D ** -0.5)
    assert_close_rel(out, ref, torch.float32)


@needs_interp
def test_attention_seq_len_and_offsets():
    a = _attn("cpu", PATHS["prefill"])
    b = a["batch"]
    width = b.block_table.shape[1]
    lens = b.seq_lens.clone()
    lens[1] = width * BS + 1  # needs one entry more than the row has
    with pytest.raises(ValueError, match=_msg("unified_attention", "seq_lens", 1, width * BS + 1,
                                              "request 1", 3, width * BS + 1)):
        _attend(a, seq_lens=lens)
    lens[1] = 2  # fewer than its 3 new tokens
    with pytest.raises(ValueError, match=_msg("unified_attention", "seq_lens", 1, 2, "request 1",
                                              3, width * BS + 1)):
        _attend(a, seq_lens=lens)
    qsl = b.query_start_loc.clone()
    qsl[2] = b.num_tokens + 1
    with pytest.raises(ValueError, match=_msg("unified_attention", "query_start_loc", 2,
                                              b.num_tokens + 1, "end of the last request", 5,
                                              b.num_tokens + 1)):
        _attend(a, qsl=qsl)


@needs_interp
@pytest.mark.parametrize("kind", [PAST, NEG])
def test_reshape_and_cache_slot(kind):
    a = _attn("cpu", PATHS["prefill"])
    n_slots = a["batch"].num_blocks * BS
    slots = a["batch"].slot_mapping.clone()
    slots[6] = _bad(kind, n_slots)  # token 6: request 1's second token
    caches = a["kc"].clone(), a["vc"].clone()
    with pytest.raises(ValueError, match=_msg("reshape_and_cache", "slot_mapping", 6,
                                              slots[6].item(), "token 6", -1, n_slots)):
        reshape_and_cache(a["kv"], a["kv"], a["kc"], a["vc"], slots)
    assert torch.equal(a["kc"], caches[0]) and torch.equal(a["vc"], caches[1])


NUM_STATES = 3


def _sconv_args(device, idx):
    g = gen(2)
    qsl, state_indices, T = state_batch([3, 1], idx, device)
    C, K = 8, 4
    return dict(x=randn((T, C), torch.float32, device, g), weight=randn((C, K), torch.float32, device, g),
                bias=None, conv_state=randn((NUM_STATES, C, K - 1), torch.float32, device, g),
                query_start_loc=qsl, state_indices=state_indices,
                has_initial_state=torch.tensor([True, True], device=device), max_query_len=3)


@needs_interp
@pytest.mark.parametrize("kind", [PAST, NEG])
def test_sconv_state_index(kind):
    bad = _bad(kind, NUM_STATES)
    a = _sconv_args("cpu", [0, bad])
    before = a["conv_state"].clone()
    with pytest.raises(ValueError, match=_msg("sconv", "state_indices", 1, bad, "request 1", -1,
                                              NUM_STATES)):
        sconv(**a)
    assert torch.equal(a["conv_state"], before)


def _compress_args(device):
    g = gen(3)
    ratio, bs = 2, 4
    # Request 0 (positions 6..9) has 5 complete groups: entries 0 and 1 of its
    # row are in use; request 1 (positions 1..2) one: entry 0.
    batch = paged_batch([4, 2], [10, 3], bs, device, g, entries_per_pos=ratio)
    T = batch.num_tokens
    return dict(key=randn((T, KVH, D), torch.float32, device, g),
                score=randn((T, KVH), torch.float32, device, g),
                compressed_cache=randn((batch.num_blocks, bs, KVH, D), torch.float32, device, g),
                state_max=randn((NUM_STATES, KVH), torch.float32, device, g),
                state_sum=randn((NUM_STATES, KVH), torch.float32, device, g).abs() + 0.5,
                state_acc=randn((NUM_STATES, KVH, D), torch.float32, device, g),
                query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                state_indices=torch.tensor([2, 0], dtype=torch.int32, device=device),
                block_table=batch.block_table, ratio=ratio, max_query_len=4)


def _compress_raises(a, match):
    watched = {n: a[n] for n in ("compressed_cache", "state_max", "state_sum", "state_acc")}
    before = {n: t.clone() for n, t in watched.items()}
    with pytest.raises(ValueError, match=match):
        kv_compress(**a)
    for n, t in watched.items():
        assert torch.equal(t, before[n]), n


@needs_interp
@pytest.mark.parametrize("kind", [PAST, NEG])
def test_kv_compress_block_id(kind):
    a = _compress_args("cpu")
    n = a["compressed_cache"].shape[0]
    a["block_table"] = a["block_table"].clone()
    a["block_table"][0, 1] = _bad(kind, n)  # group 4 of request 0 lands in entry 1
    _compress_raises(a, _msg("kv_compress", "block_table", "0, 1", a["block_table"][0, 1].item(),
                             "request 0", 0, n))


@needs_interp
@pytest.mark.parametrize("kind", [PAST, NEG])
def test_kv_compress_state_index(kind):
    a = _compress_args("cpu")
    bad = _bad(kind, NUM_STATES)
    a["state_indices"] = torch.tensor([2, bad], dtype=torch.int32)
    _compress_raises(a, _msg("kv_compress", "state_indices", 1, bad, "request 1", -1, NUM_STATES))


@needs_interp
@pytest.mark.parametrize("interpret", ["1", "0"], ids=["launcher", "torch_reference"])
def test_op_by_layer_name(interpret, monkeypatch):
    """The ops read metadata by layer name; both the Triton launcher and the
    plain-CPU reference check it."""
    a = _attn("cpu", PATHS["decode"])
    b = a["batch"]
    table = b.block_table.clone()
    table[0, 1] = b.num_blocks
    meta = AttentionMetadata(query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                             block_table=table, slot_mapping=b.slot_mapping, num_reqs=2,
                             max_query_len=1, max_seq_len=b.max_seq_len)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with set_forward_context(ForwardContext(attn_metadata={"l": meta})):
        with pytest.raises(ValueError, match=r"unified_attention: block_table\[0, 1\]"):
            torch.ops.mrv2.unified_attention(a["q"], a["kc"], a["vc"], torch.empty_like(a["q"]),
                                             "l", 0.25)


def test_debug_switch(monkeypatch):
    """CUDA checks: off by default, on inside debug_checks(), off again while
    a CUDA graph is captured; the context manager restores the setting."""
    cuda = torch.device("cuda")
    assert index_checks_on(torch.device("cpu"))
    assert not index_checks_on(cuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with debug_checks():
        assert index_checks_on(cuda)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert not index_checks_on(cuda)
    assert not index_checks_on(cuda)
    assert set_debug_checks(True) is False
    assert set_debug_checks(False) is True
    with pytest.raises(ValueError, match="set_debug_checks: expected True or False"):
        set_debug_checks(1)


# CUDA tensors: checked only under debug_checks() (one sync per launch).
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("kind", [PAST, NEG])
@pytest.mark.parametrize("path", list(PATHS))
def test_attention_block_id_cuda(path, kind):
    a = _attn("cuda", PATHS[path])
    n = a["batch"].num_blocks
    table = a["batch"].block_table.clone()
    table[1, 0] = _bad(kind, n)
    with debug_checks(), pytest.raises(ValueError, match=_msg(
            "unified_attention", "block_table", "1, 0", table[1, 0].item(), "request 1", 0, n)):
        _attend(a, block_table=table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_other_launchers_cuda():
    a = _attn("cuda", PATHS["prefill"])
    slots = a["batch"].slot_mapping.clone()
    slots[0] = a["batch"].num_blocks * BS
    before = a["kc"].clone()
    with debug_checks(), pytest.raises(ValueError, match=r"reshape_and_cache: slot_mapping\[0\]"):
        reshape_and_cache(a["kv"], a["kv"], a["kc"], a["vc"], slots)
    assert torch.equal(a["kc"], before)
    s = _sconv_args("cuda", [0, NUM_STATES])
    before = s["conv_state"].clone()
    with debug_checks(), pytest.raises(ValueError, match=r"sconv: state_indices\[1\] = 3"):
        sconv(**s)
    assert torch.equal(s["conv_state"], before)
    c = _compress_args("cuda")
    c["block_table"] = c["block_table"].clone()
    c["block_table"][0, 0] = c["compressed_cache"].shape[0]
    with debug_checks():
        _compress_raises(c, r"kv_compress: block_table\[0, 0\]")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_debug_checks_skip_capture():
    """With debug checks on, eager calls check (and sync) but a CUDA-graph
    capture of the same call neither syncs nor fails; the replay is correct."""
    a = _attn("cuda", PATHS["decode"])
    b = a["batch"]
    with debug_checks():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _attend(a)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _attend(a)
    a["q"].copy_(randn(a["q"].shape, torch.float32, "cuda", gen(9)))
    graph.replay()
    ref = unified_attention_ref(a["q"].cpu(), a["kc"].cpu(), a["vc"].cpu(), b.query_start_loc.cpu(),
                                b.seq_lens.cpu(), b.block_table.cpu(), D ** -0.5)
    assert_close_rel(out, ref, torch.float32)
