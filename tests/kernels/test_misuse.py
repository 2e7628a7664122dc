"""Misuse of the launchers: wrong dtype, device, rank, shape or layout raises
ValueError naming the argument, before any cache or state is touched."""

import os

import pytest
import torch

from kernel_cases import gen, paged_batch, randn, state_batch
from compile_backend.kernels import kv_compress, reshape_and_cache, sconv, unified_attention

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs the interpreter or CUDA")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
KVH, D = 2, 64


def _attn():
    g = gen(1)
    batch = paged_batch([2, 1], [10, 20], 16, DEV, g)
    kc = randn((batch.num_blocks, 16, KVH, D), torch.float16, DEV, g)
    return dict(
        query=randn((batch.num_tokens, 4, D), torch.float16, DEV, g),
        key=randn((batch.num_tokens, KVH, D), torch.float16, DEV, g),
        value=randn((batch.num_tokens, KVH, D), torch.float16, DEV, g),
        key_cache=kc, value_cache=kc.clone(), batch=batch,
    )


def _call_cache(a):
    reshape_and_cache(a["key"], a["value"], a["key_cache"], a["value_cache"], a["batch"].slot_mapping)


def _call_attn(a):
    b = a["batch"]
    return unified_attention(a["query"], a["key_cache"], a["value_cache"], b.query_start_loc,
                             b.seq_lens, b.block_table, 0.1, b.max_query_len, b.max_seq_len,
                             out=a.get("output"))


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


CACHE_MISUSE = {
    "key_cache": [("dtype", lambda t: t.float()), ("device", _meta), ("rank", lambda t: t.flatten(0, 1)),
                  ("layout", lambda t: t.transpose(1, 2))],
    "key": [("dtype", lambda t: t.double()), ("rank", lambda t: t[0]), ("layout", lambda t: t.transpose(1, 2)),
            ("device", _meta)],
    "value": [("shape", lambda t: t[:, :1])],
}


@pytest.mark.parametrize("arg,how,mutate", [(a, h, m) for a, ms in CACHE_MISUSE.items() for h, m in ms])
def test_reshape_and_cache_misuse(arg, how, mutate):
    a = _attn()
    a[arg] = mutate(a[arg])
    caches = [a["key_cache"].clone(), a["value_cache"].clone()] if a["key_cache"].device.type != "meta" else None
    with pytest.raises(ValueError, match=arg):
        _call_cache(a)
    if caches is not None:
        assert torch.equal(a["key_cache"], caches[0]) and torch.equal(a["value_cache"], caches[1])


def test_cache_dtype_mismatch_names_both():
    a = _attn()
    a["key"], a["value"] = a["key"].float(), a["value"].float()
    with pytest.raises(ValueError, match=r"key_cache: expected dtype float32 \(the dtype of key\)"):
        _call_cache(a)


def test_slot_mapping_dtype():
    a = _attn()
    a["batch"].slot_mapping = a["batch"].slot_mapping.int()
    before = a["key_cache"].clone()
    with pytest.raises(ValueError, match="slot_mapping: expected dtype int64"):
        _call_cache(a)
    assert torch.equal(a["key_cache"], before)


ATTN_MISUSE = {
    "query": [("dtype", lambda t: t.double()), ("rank", lambda t: t.flatten(1)), ("device", _meta),
              ("heads", lambda t: t[:, :3])],
    "value_cache": [("dtype", lambda t: t.half().float()), ("layout", lambda t: t.transpose(1, 2))],
    "output": [("dtype", lambda t: t.float()), ("shape", lambda t: t[:, :3]), ("device", _meta),
               ("layout", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
               ("type", lambda t: t.tolist())],
}


@pytest.mark.parametrize("arg,how,mutate", [(a, h, m) for a, ms in ATTN_MISUSE.items() for h, m in ms])
def test_unified_attention_misuse(arg, how, mutate):
    a = _attn()
    a["output"] = torch.empty_like(a["query"])
    a[arg] = mutate(a[arg])
    with pytest.raises(ValueError, match=arg if how != "heads" else "query"):
        _call_attn(a)


@pytest.mark.parametrize("head_dim", [257, 0])
def test_unified_attention_head_size(head_dim):
    a = _attn()
    b = a["batch"]
    q = torch.zeros(b.num_tokens, 4, head_dim, dtype=torch.float16, device=DEV)
    kc = torch.zeros(b.num_blocks, 16, KVH, head_dim, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match=rf"query: expected a head size in \[1, 256\], got {head_dim}"):
        unified_attention(q, kc, kc, b.query_start_loc, b.seq_lens, b.block_table, 0.1,
                          b.max_query_len, b.max_seq_len)


def test_attention_metadata_misuse():
    a = _attn()
    a["batch"].block_table = a["batch"].block_table.long()
    with pytest.raises(ValueError, match="block_table: expected dtype int32"):
        _call_attn(a)
    a = _attn()
    a["batch"].seq_lens = a["batch"].seq_lens[:1]
    with pytest.raises(ValueError, match="seq_lens: expected shape"):
        _call_attn(a)


def _sconv_args():
    g = gen(2)
    qsl, idx, T = state_batch([3, 1], [0, 1], DEV)
    C, K = 16, 4
    return dict(x=randn((T, C), torch.float32, DEV, g), weight=randn((C, K), torch.float32, DEV, g),
                bias=None, conv_state=randn((2, C, K - 1), torch.float32, DEV, g),
                query_start_loc=qsl, state_indices=idx,
                has_initial_state=torch.tensor([True, False], device=DEV), max_query_len=3)


SCONV_MISUSE = [
    ("x", lambda t: t.half()), ("x", lambda t: t[None]), ("x", lambda t: t.t().contiguous().t()),
    ("x", _meta), ("conv_state", lambda t: t.half()), ("conv_state", lambda t: t[:, :, :2]),
    ("conv_state", _meta), ("weight", lambda t: t[:, :1]), ("state_indices", lambda t: t.long()),
    ("has_initial_state", lambda t: t.int()), ("max_query_len", lambda t: 3.0),
]


@pytest.mark.parametrize("arg,mutate", SCONV_MISUSE)
def test_sconv_misuse(arg, mutate):
    a = _sconv_args()
    state = a["conv_state"]
    before = state.clone()
    a[arg] = mutate(a[arg])
    with pytest.raises(ValueError, match=arg):
        sconv(**a)
    assert torch.equal(state, before)


def _compress_args():
    g = gen(3)
    batch = paged_batch([5, 1], [5, 9], 4, DEV, g, entries_per_pos=4)
    T = batch.num_tokens
    return dict(key=randn((T, KVH, D), torch.bfloat16, DEV, g), score=randn((T, KVH), torch.bfloat16, DEV, g),
                compressed_cache=randn((batch.num_blocks, 4, KVH, D), torch.bfloat16, DEV, g),
                state_max=randn((2, KVH), torch.float32, DEV, g), state_sum=randn((2, KVH), torch.float32, DEV, g),
                state_acc=randn((2, KVH, D), torch.float32, DEV, g), query_start_loc=batch.query_start_loc,
                seq_lens=batch.seq_lens, state_indices=torch.tensor([0, 1], dtype=torch.int32, device=DEV),
                block_table=batch.block_table, ratio=4, max_query_len=5)


COMPRESS_MISUSE = [
    ("key", lambda t: t.double()), ("key", lambda t: t.flatten(1)), ("key", _meta),
    ("score", lambda t: t[:, :1]), ("compressed_cache", lambda t: t.float()),
    ("compressed_cache", lambda t: t.transpose(1, 2)), ("state_max", lambda t: t.bfloat16()),
    ("state_acc", lambda t: t[:, :, :8]), ("state_acc", _meta), ("state_sum", lambda t: t.t()),
    ("block_table", lambda t: t.long()), ("ratio", lambda t: 0),
]


@pytest.mark.parametrize("arg,mutate", COMPRESS_MISUSE)
def test_kv_compress_misuse(arg, mutate):
    a = _compress_args()
    watched = {n: a[n] for n in ("compressed_cache", "state_max", "state_sum", "state_acc")}
    before = {n: t.clone() for n, t in watched.items()}
    a[arg] = mutate(a[arg])
    with pytest.raises(ValueError, match=arg):
        kv_compress(**a)
    for n, t in watched.items():
        assert torch.equal(t, before[n]), n


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_cpu_launcher_without_interpreter(monkeypatch):
    """The launchers refuse plain CPU tensors with the way out in the message."""
    a = _attn()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _call_attn(a)
