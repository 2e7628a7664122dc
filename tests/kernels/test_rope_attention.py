"""mrv2::rope_attention's launcher against its torch reference (rope_and_cache
then unified attention): decode batches in the fused launch (one-launch and
split + reduce forms, one split and several, the new token alone in its
split, a first token, a block's last slot) bit-equal to the two kernels it
replaces, prefill batches through the two ops; the caches after each call; misuse raising before anything is written;
on the GPU, replays of one captured graph on fresh inputs equal to eager
launches bit for bit. Note [rotary inside decode attention]."""

import importlib

import pytest
import torch

from kernel_cases import (
    DEVICES, DTYPE_IDS, DTYPES, assert_close_rel, assert_one_rounding, gen, paged_batch, randn,
    stable_seed,
)
from compile_backend.core.counters import counters
from compile_backend.kernels.rope_and_cache import rope_and_cache
from compile_backend.kernels.rope_attention import rope_attention, rope_attention_ref
from compile_backend.kernels.unified_attention import unified_attention
from compile_backend.runtime import graph_pool

ra = importlib.import_module("compile_backend.kernels.rope_attention")

BLOCK = 16
# name -> (q_lens, seq_lens, padding tokens). seq_len 1: a request's first
# token (attends to itself only); 16: the new key in a block's last slot;
# 33: the new key alone past a split boundary at MIN_SPLIT_LEN 16.
DECODE = {
    "mixed_lengths": ([1, 1, 1, 1], [1, 16, 33, 70], 2),
    "one_request": ([1], [129], 0),
}


def _rope_inputs(T, H, KVH, D, dtype, device, g):
    """q/k/v column slices of one fused qkv output, positions, inv_freq."""
    qkv = randn((T, (H + 2 * KVH) * D), dtype, device, g)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    positions = torch.randint(0, 50_000, (T,), generator=g).to(device)
    inv_freq = (1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(device)
    return q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D), positions, inv_freq


class Case:
    """One batch, its inputs and poisoned caches (the new tokens' slots hold
    random values: a launch that read them before writing would differ)."""

    def __init__(self, q_lens, seq_lens, pad, H, KVH, D, dtype, device, seed):
        g = gen(seed)
        self.batch = paged_batch(q_lens, seq_lens, BLOCK, device, g, pad_tokens=pad)
        T = self.batch.num_tokens
        self.inputs = _rope_inputs(T, H, KVH, D, dtype, device, g)
        shape = (self.batch.num_blocks, BLOCK, KVH, D)
        self.caches = (randn(shape, dtype, device, g), randn(shape, dtype, device, g))
        self.dtype, self.scale = dtype, D ** -0.5

    def metadata(self):
        b = self.batch
        return (b.slot_mapping, b.query_start_loc, b.seq_lens, b.block_table)

    def run(self, **kw):
        b = self.batch
        kc, vc = self.caches
        return rope_attention(*self.inputs, kc, vc, *self.metadata(), self.scale, b.max_query_len,
                              b.max_seq_len, **kw)

    def two_ops(self, **kw):
        """(out, key_cache, value_cache) of rope_and_cache then unified_attention
        (the launches the fused op replaces) on copies of the caches."""
        b = self.batch
        kc, vc = (t.clone() for t in self.caches)
        q, k, v, positions, inv_freq = self.inputs
        q_rot = rope_and_cache(q, k, v, positions, inv_freq, kc, vc, b.slot_mapping)
        out = unified_attention(q_rot, kc, vc, b.query_start_loc, b.seq_lens, b.block_table,
                                self.scale, b.max_query_len, b.max_seq_len, **kw)
        return out, kc, vc

    def reference(self):
        """(out, key_cache, value_cache) of the reference on CPU copies."""
        kc, vc = (c.cpu().clone() for c in self.caches)
        out = rope_attention_ref(*(x.cpu() for x in self.inputs), kc, vc,
                                 *(m.cpu() for m in self.metadata()), self.scale)
        return out, kc, vc

    def check(self, out, ref):
        ref_out, ref_kc, ref_vc = ref
        assert out.shape == ref_out.shape and out.dtype == self.dtype
        assert_close_rel(out, ref_out, self.dtype, "out")
        assert torch.equal(out[self.batch.query_start_loc[-1].item():].cpu(),
                           torch.zeros_like(ref_out[self.batch.query_start_loc[-1].item():]))
        kc, vc = (t.cpu() for t in self.caches)
        # Keys rotated in fp32 and rounded once (cos/sin of another library:
        # one rounding apart at most); values copied, every other row untouched.
        # Whole rows (head_dim last), so the fp32 allowance scales with the row's
        # size, not with the one element that differs (a near-zero one cancels).
        assert_one_rounding(kc, ref_kc, ref_kc, self.dtype, "key cache")
        written = kc != ref_kc
        slots = self.batch.slot_mapping.cpu()
        rows = written.flatten(0, 1).any(-1).any(-1).nonzero().flatten()
        assert set(rows.tolist()) <= set(slots[slots >= 0].tolist()), "a key written off its slot"
        assert torch.equal(vc, ref_vc), "value cache"


def _heads(device):
    return [(4, 2, 32), (8, 8, 16)] if device == "cpu" else [(32, 8, 128), (8, 2, 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("form", ["one_launch", "two_launch"])
@pytest.mark.parametrize("case", list(DECODE))
def test_decode_matches_reference(case, form, dtype, device):
    q_lens, seq_lens, pad = DECODE[case]
    for H, KVH, D in _heads(device):
        for splits in (1, 3):
            c = Case(q_lens, seq_lens, pad, H, KVH, D, dtype, device,
                     stable_seed(case, form, str(dtype), H, KVH, D, splits))
            ref = c.reference()
            cfg = dict(TWO_LAUNCH=form == "two_launch", MIN_SPLIT_LEN=16)
            two_ops = c.two_ops(num_splits=splits, config=cfg)
            before = counters["rope_attention_fused_launches"]
            out = c.run(num_splits=splits, config=cfg)
            assert counters["rope_attention_fused_launches"] == before + 1
            c.check(out, ref)
            # The same bits as the two kernels it replaces (the same rotation,
            # the same key loop over the same cache bytes).
            assert torch.equal(out, two_ops[0])
            assert all(torch.equal(a, b) for a, b in zip(c.caches, two_ops[1:]))


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_runs_the_two_ops(device, monkeypatch):
    """max_query_len > 1: rope_and_cache, then unified attention (the fused
    decode kernels never launch)."""
    launched = []
    real = ra._Plan

    def spy(*a, **kw):
        launched.append(kw.get("rope"))
        return real(*a, **kw)

    monkeypatch.setattr(ra, "_Plan", spy)
    c = Case([5, 1, 9], [20, 40, 9], 1, 4, 2, 32, torch.bfloat16, device, stable_seed("prefill"))
    ref = c.reference()
    before = counters["rope_attention_fused_launches"]
    c.check(c.run(), ref)
    assert launched == [] and counters["rope_attention_fused_launches"] == before


def test_misuse_raises_before_writing():
    c = Case([1, 1], [5, 40], 0, 4, 2, 32, torch.float32, "cpu", stable_seed("misuse"))
    before = [t.clone() for t in c.caches]
    q, k, v, positions, inv_freq = c.inputs
    bad = dict(inv_freq=inv_freq[:-1], positions=positions.float(), k=k.half())
    for name, value in bad.items():
        args = dict(q=q, k=k, v=v, positions=positions, inv_freq=inv_freq)
        args[name] = value
        with pytest.raises(ValueError, match=name):
            rope_attention(args["q"], args["k"], args["v"], args["positions"], args["inv_freq"],
                           *c.caches, *c.metadata(), c.scale, 1, 40)
    with pytest.raises(ValueError, match="output"):
        c.run(out=torch.empty(3, 4, 32))
    for t, b in zip(c.caches, before):
        assert torch.equal(t, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("form", ["one_launch", "two_launch"])
def test_graph_replays_gpu(form):
    """One captured launch replayed on fresh inputs, caches and block tables
    copied into its buffers: every replay equals an eager launch and the two
    kernels it replaces on the same values bit for bit (output and caches),
    and the reference within bf16 bounds."""
    H, KVH, D = 32, 8, 128
    lens = [1, 16, 17, 300, 1000, 2047, 4096, 65]
    cfg = dict(TWO_LAUNCH=form == "two_launch", MIN_SPLIT_LEN=64)

    def case(i):
        return Case([1] * len(lens), lens, 2, H, KVH, D, torch.bfloat16, "cuda",
                    stable_seed("replay", form, i))

    live = case("live")
    out = torch.empty(live.batch.num_tokens, H, D, dtype=torch.bfloat16, device="cuda")

    def launch(c, into):
        rope_attention(*c.inputs, *c.caches, *c.metadata(), c.scale, 1, max(lens),
                       num_splits=16, config=cfg, out=into)

    launch(live, out)  # compiles
    torch.cuda.synchronize()
    # mrv2's capture stream, warmed as its graph pool warms it: it has the
    # one-launch decode's ticket counters (torch.cuda.graph's own stream has
    # none, and a capture there takes the two-launch form).
    graph_pool.warm_capture_stream()
    graph = torch.cuda.CUDAGraph()
    captured = counters["rope_attention_fused_captured"]
    with torch.cuda.graph(graph, stream=graph_pool.capture_stream()):
        launch(live, out)
    assert counters["rope_attention_fused_captured"] == captured + 1
    for i in range(3):
        fresh = case(i)
        ref = fresh.reference()
        two_ops = fresh.two_ops(num_splits=16, config=cfg)
        for dst, src in zip((*live.inputs, *live.caches, *live.metadata()),
                            (*fresh.inputs, *fresh.caches, *fresh.metadata())):
            dst.copy_(src)
        eager = torch.empty_like(out)
        launch(fresh, eager)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {i}: output differs from an eager launch"
        assert all(torch.equal(a, e) for a, e in zip(live.caches, fresh.caches)), f"replay {i}"
        assert torch.equal(out, two_ops[0]), f"replay {i}: output differs from the two kernels"
        assert all(torch.equal(a, e) for a, e in zip(live.caches, two_ops[1:])), f"replay {i}"
        fresh.check(out, ref)
