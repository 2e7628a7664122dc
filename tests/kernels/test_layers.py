"""The layer modules under a forward context equal a reference computation;
the ops trace through torch.compile (fake tensors via register_fake); plain
CPU without the interpreter falls back to the torch references."""

import pytest
import torch
from torch import nn

from compile_backend.runner.attention_metadata import AttentionMetadata, CompressorMetadata, SConvMetadata
from compile_backend.core.forward_context import ForwardContext, set_forward_context
from kernel_cases import DEVICES, assert_close_rel, gen, paged_batch, randn
from compile_backend.kernels import (KVCompressor, PagedAttention, ShortConv, kv_compress_ref, reshape_and_cache_ref,
                     sconv_ref, unified_attention_ref)
from compile_backend.demo.models.blocks import Rotary

H, KVH, D, C, K, RATIO, BS = 4, 2, 64, 32, 4, 4, 16


class TinyBlock(nn.Module):
    """What a model does: projections around the three layers, no metadata in forward."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, (H + 2 * KVH) * D, bias=False)
        self.attn = PagedAttention(H, KVH, D, "layers.0.attn")
        self.conv = ShortConv(C, K, "layers.0.conv")
        self.comp = KVCompressor(KVH, D, RATIO, "layers.0.comp")
        self.score = nn.Linear(C, KVH, bias=False)

    def forward(self, x):
        h = self.conv(x)
        q, k, v = self.qkv(h).split([H * D, KVH * D, KVH * D], dim=-1)
        a = self.attn(q, k, v)
        c = self.comp(k.reshape(-1, KVH, D), self.score(h))
        return a, c


def _setup(device, dtype, seed=0):
    g = gen(seed)
    torch.manual_seed(seed)
    model = TinyBlock().to(device=device, dtype=dtype)
    q_lens, seq_lens = [1, 6, 0], [9, 22, 0]
    batch = paged_batch(q_lens, seq_lens, BS, device, g, pad_tokens=2, entries_per_pos=1)
    model.attn.bind_kv_cache(batch.num_blocks, BS, dtype, device)
    model.attn.k_cache.copy_(randn(model.attn.k_cache.shape, dtype, device, g))
    model.attn.v_cache.copy_(randn(model.attn.v_cache.shape, dtype, device, g))
    model.conv.bind_state(3, dtype, device)
    model.conv.conv_state.copy_(randn(model.conv.conv_state.shape, dtype, device, g))
    model.comp.bind_cache(batch.num_blocks, BS, 3, dtype, device)
    for s in (model.comp.state_max, model.comp.state_acc):
        s.copy_(randn(s.shape, torch.float32, device, g))
    model.comp.state_sum.copy_(randn(model.comp.state_sum.shape, torch.float32, device, g).abs() + 0.5)
    idx = torch.tensor([2, 0, -1], dtype=torch.int32, device=device)
    metas = {
        "layers.0.attn": AttentionMetadata(
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
            block_table=batch.block_table, slot_mapping=batch.slot_mapping, num_reqs=3,
            max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len),
        "layers.0.conv": SConvMetadata(
            query_start_loc=batch.query_start_loc, state_indices=idx,
            has_initial_state=torch.tensor([True, False, False], device=device), num_reqs=3,
            max_query_len=batch.max_query_len),
        "layers.0.comp": CompressorMetadata(
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, state_indices=idx,
            block_table=batch.block_table, num_reqs=3, max_query_len=batch.max_query_len),
    }
    x = randn((batch.num_tokens, C), dtype, device, g)
    return model, metas, x


def _buffers(model):
    return {n: b.clone() for n, b in model.named_buffers()}


def _reference(model, metas, x, bufs):
    """The same step with the torch references, on copies of the buffers."""
    bufs = {n: b.clone() for n, b in bufs.items()}
    am, sm, cm = metas["layers.0.attn"], metas["layers.0.conv"], metas["layers.0.comp"]
    h = sconv_ref(x, model.conv.weight, model.conv.bias, bufs["conv.conv_state"],
                  sm.query_start_loc, sm.state_indices, sm.has_initial_state)
    q, k, v = model.qkv(h).split([H * D, KVH * D, KVH * D], dim=-1)
    T = x.shape[0]
    reshape_and_cache_ref(k.reshape(T, KVH, D), v.reshape(T, KVH, D), bufs["attn.k_cache"],
                          bufs["attn.v_cache"], am.slot_mapping)
    a = unified_attention_ref(q.reshape(T, H, D), bufs["attn.k_cache"], bufs["attn.v_cache"],
                              am.query_start_loc, am.seq_lens, am.block_table, D ** -0.5)
    c = kv_compress_ref(k.reshape(T, KVH, D), model.score(h), bufs["comp.compressed_cache"],
                        bufs["comp.state_max"], bufs["comp.state_sum"], bufs["comp.state_acc"],
                        cm.query_start_loc, cm.seq_lens, cm.state_indices, cm.block_table, RATIO)
    return a.reshape(T, H * D), c, bufs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layers_match_reference(dtype, device):
    model, metas, x = _setup(device, dtype)
    before = _buffers(model)
    ctx = ForwardContext(attn_metadata=metas, trace=[])
    with torch.no_grad(), set_forward_context(ctx):
        a, c = model(x)
        a_ref, c_ref, bufs_ref = _reference(model, metas, x, before)
    assert_close_rel(a, a_ref, dtype, "attention")
    assert_close_rel(c, c_ref, dtype, "compressor")
    for name, buf in model.named_buffers():
        assert_close_rel(buf, bufs_ref[name], dtype, name)
    assert [e for _, e in ctx.trace] == ["sconv", "reshape_and_cache", "unified_attention", "kv_compress"]
    assert {n for n, _ in ctx.trace} == set(metas)


def test_metadata_kinds():
    assert PagedAttention.metadata_kind == "attention"
    assert ShortConv.metadata_kind == "sconv"
    assert KVCompressor.metadata_kind == "compressor"
    layer = PagedAttention(H, KVH, D, "x")
    assert layer.layer_name == "x" and tuple(layer.k_cache.shape) == (0, 16, KVH, D)
    assert "k_cache" not in layer.state_dict()


@pytest.mark.parametrize("make,match", [
    (lambda: PagedAttention(4, 2, 257, "x"), r"head_dim must be an int in \[1, 256\]"),
    (lambda: PagedAttention(4, 2, 0, "x"), r"head_dim must be an int in \[1, 256\]"),
    (lambda: PagedAttention(4, 0, 8, "x"), "num_kv_heads must be an int >= 1"),
    (lambda: ShortConv(0, 4, "x"), "channels must be an int >= 1"),
    (lambda: ShortConv(8, 1, "x"), "kernel_size must be an int >= 2"),
    (lambda: KVCompressor(2, 0, 4, "x"), "head_dim must be an int >= 1"),
    (lambda: KVCompressor(2, 8, 0, "x"), "ratio must be an int >= 1"),
], ids=["head_dim_257", "head_dim_0", "kv_heads_0", "channels_0", "kernel_1", "comp_head_dim_0",
        "ratio_0"])
def test_layers_reject_sizes(make, match):
    """A layer refuses at construction the sizes its kernels cannot run."""
    with pytest.raises(ValueError, match=match):
        make()


def test_layers_accept_small_sizes():
    assert PagedAttention(2, 1, 1, "x").head_dim == 1
    assert PagedAttention(2, 1, 256, "x").head_dim == 256
    assert ShortConv(1, 2, "x").channels == 1
    assert KVCompressor(1, 1, 1, "x").head_dim == 1


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_eager_backend(device):
    """Dynamo traces the ops with their fake implementations (fullgraph), and
    the compiled step equals the eager one, buffers included."""
    dtype = torch.float32
    model, metas, x = _setup(device, dtype, seed=3)
    start = _buffers(model)
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=metas)):
        a_eager, c_eager = model(x)
        after_eager = _buffers(model)
        for n, b in model.named_buffers():
            b.copy_(start[n])
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        a, c = compiled(x)
    assert torch.equal(a, a_eager) and torch.equal(c, c_eager)
    for n, b in model.named_buffers():
        assert torch.equal(b, after_eager[n]), n


def test_fake_tensor_shapes():
    from compile_backend import kernels  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(5, H, D, dtype=torch.bfloat16)
        cache = torch.empty(3, BS, KVH, D, dtype=torch.bfloat16)
        assert torch.ops.mrv2.unified_attention(q, cache, cache, torch.empty_like(q), "l", 0.1) is None
        assert torch.ops.mrv2.reshape_and_cache(cache[0, :5], cache[0, :5], cache, cache, "l") is None
        qkv = torch.empty(5, (H + 2 * KVH) * D, dtype=torch.bfloat16)
        q, k, v = (t.view(5, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
        q_rot = torch.ops.mrv2.rope_and_cache(q, k, v, torch.empty(5, dtype=torch.int64),
                                              torch.empty(D // 2), cache, cache, "l")
        assert q_rot.shape == (5, H, D) and q_rot.dtype == torch.bfloat16 and q_rot.is_contiguous()
        x = torch.empty(5, C)
        assert torch.ops.mrv2.sconv(x, torch.empty(C, K), None, torch.empty(2, C, K - 1), "l").shape == (5, C)
        key = torch.empty(5, KVH, D)
        out = torch.ops.mrv2.kv_compress(key, torch.empty(5, KVH), torch.empty(3, BS, KVH, D),
                                         torch.empty(2, KVH), torch.empty(2, KVH),
                                         torch.empty(2, KVH, D), "l", 4)
        assert out.shape == (5, KVH, D)


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Plain CPU (no TRITON_INTERPRET): the ops run the torch references."""
    model, metas, x = _setup("cpu", torch.float32, seed=5)
    before = _buffers(model)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=metas)):
        a, c = model(x)
        a_ref, c_ref, _ = _reference(model, metas, x, before)
    assert torch.equal(a, a_ref) and torch.equal(c, c_ref)


# ---- rotary inside the cache write (mrv2::rope_and_cache) -------------------------


class RotaryBlock(nn.Module):
    """What SelfAttention does: un-rotated q and k, column slices of one fused
    projection, with positions and the Rotary module's inv_freq to the layer."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, (H + 2 * KVH) * D, bias=False)
        self.rotary = Rotary(D, 10000.0)
        self.attn = PagedAttention(H, KVH, D, "layers.0.attn")

    def split(self, x):
        return self.qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)

    def forward(self, x, positions):
        q, k, v = self.split(x)
        return self.attn(q, k, v, positions, self.rotary.inv_freq)

    def old_path(self, x, positions):
        """Before mrv2::rope_and_cache: Rotary outside, then reshape_and_cache."""
        q, k, v = self.split(x)
        T = x.shape[0]
        q = self.rotary(q.reshape(T, H, D), positions)
        return self.attn(q, self.rotary(k.reshape(T, KVH, D), positions), v)


def _rotary_setup(device, dtype, seed):
    model, metas, x = _setup(device, dtype, seed)
    block = RotaryBlock().to(device=device, dtype=dtype)
    block.qkv.load_state_dict(model.qkv.state_dict())
    block.attn = model.attn  # its bound, poisoned caches
    g = gen(seed + 100)
    positions = torch.randint(0, 100_000, (x.shape[0],), generator=g).to(device)
    return block, metas, x, positions


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_with_rotary_equals_the_old_path(dtype, device):
    """PagedAttention(q, k, v, positions, inv_freq) under a forward context
    equals Rotary applied outside + reshape_and_cache + attention, caches
    included; the trace shows the one op in place of reshape_and_cache."""
    block, metas, x, positions = _rotary_setup(device, dtype, seed=7)
    before = _buffers(block)
    ctx = ForwardContext(attn_metadata=metas, trace=[])
    with torch.no_grad(), set_forward_context(ctx):
        a = block(x, positions)
        after = _buffers(block)
        for n, b in block.named_buffers():
            if n.startswith("attn."):
                b.copy_(before[n])
        a_old = block.old_path(x, positions)
    assert [e for _, e in ctx.trace] == ["rope_and_cache", "unified_attention",
                                         "reshape_and_cache", "unified_attention"]
    assert_close_rel(a, a_old, dtype, "attention")
    for n, b in block.named_buffers():
        assert_close_rel(after[n], b, dtype, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_with_rotary_cpu_fallback_is_exact(monkeypatch, dtype):
    """Plain CPU (the torch references): the same numbers as the old path, bit for bit."""
    block, metas, x, positions = _rotary_setup("cpu", dtype, seed=8)
    before = _buffers(block)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=metas)):
        a = block(x, positions)
        after = _buffers(block)
        for n, b in block.named_buffers():
            if n.startswith("attn."):
                b.copy_(before[n])
        a_old = block.old_path(x, positions)
    assert torch.equal(a, a_old)
    for n, b in block.named_buffers():
        assert torch.equal(after[n], b), n


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_with_rotary_under_torch_compile(device):
    """Dynamo traces mrv2::rope_and_cache (fake: a new [T, H, D]); the compiled
    step equals the eager one, caches included."""
    block, metas, x, positions = _rotary_setup(device, torch.float32, seed=9)
    start = _buffers(block)
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=metas)):
        a_eager = block(x, positions)
        after_eager = _buffers(block)
        for n, b in block.named_buffers():
            b.copy_(start[n])
        a = torch.compile(block, backend="eager", fullgraph=True)(x, positions)
    assert torch.equal(a, a_eager)
    for n, b in block.named_buffers():
        assert torch.equal(b, after_eager[n]), n


def test_paged_attention_needs_positions_and_inv_freq_together():
    layer = PagedAttention(H, KVH, D, "x")
    q = torch.zeros(1, H * D)
    with pytest.raises(ValueError, match="positions and inv_freq together"):
        layer(q, q[:, :KVH * D], q[:, :KVH * D], positions=torch.zeros(1, dtype=torch.int64))
