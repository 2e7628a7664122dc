"""Small models for backend tests, and a helper that checks a compiled model
against eager over several token counts in one process."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import compile_backend as cb
import toy_ops  # noqa: F401  (registers toy::*)

D = 16
TOY_OPTIONS = {
    "splitting_ops": ["toy::attn", "toy::attn_pair"],
    "attention_like_ops": ["toy::state_mix"],
}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(D, 4 * D)
        self.down = torch.nn.Linear(4 * D, D)

    def forward(self, x):  # [T, D]
        return self.down(F.silu(self.up(x))) + x


class MultiSDPA(torch.nn.Module):
    """Three SDPA calls with projections between: 3 breakpoints -> 7 pieces."""

    def __init__(self, layers=3):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(D, 3 * D) for _ in range(layers))

    def forward(self, x):  # [T, D]
        for p in self.proj:
            q, k, v = p(x).view(1, 1, -1, 3 * D).chunk(3, dim=-1)  # [1, 1, T, D] each
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).view(-1, D)
        return x


class ToyHybrid(torch.nn.Module):
    """linear -> toy::attn (breakpoint) -> state_mix (attention-like) -> linear."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)
        self.register_buffer("state", torch.randn(D))

    def forward(self, x):
        h = self.a(x)
        h = torch.ops.toy.attn(h, h, h)
        h = torch.ops.toy.state_mix(h, self.state)
        return self.b(h)


class TupleBreakpoint(torch.nn.Module):
    """A breakpoint returning a tuple, whose outputs feed the next breakpoint."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)

    def forward(self, x):
        x1, x2 = torch.ops.toy.attn_pair(self.a(x))
        h = torch.ops.toy.attn(x1, x2, x1)
        return self.b(h) + x2


class BufferMutation(torch.nn.Module):
    """An in-place update of a buffer in a captured piece, read after a breakpoint."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.register_buffer("total", torch.randn(D))

    def forward(self, x):
        h = self.a(x)
        self.total.add_(h.sum(0))
        h = torch.ops.toy.attn(h, h, h)
        return h * self.total


class Layers(torch.nn.Module):
    """Identical layers split by SDPA: the pieces between are identical."""

    def __init__(self, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(MLP() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            q = x.view(1, 1, -1, D)
            x = F.scaled_dot_product_attention(q, q, q).view(-1, D)
        return x


def check_against_eager(model, options, sizes, atol=1e-5, rtol=1e-5, mode=None):
    """Compile `model`, run each token count, compare outputs and buffers with an
    eager copy that saw the same inputs. Returns the CompiledStep."""
    torch.manual_seed(0)
    eager = copy.deepcopy(model)
    kwargs = {"mode": mode} if mode else {"options": {"piece_compiler": "eager", **options}}
    compiled = torch.compile(model, backend="mrv2", **kwargs)
    with torch.no_grad():
        for t in sizes:
            x = cb.mark_token_dim(torch.randn(t, D))
            with cb.symbolic_tokens():
                out = compiled(x)
            ref = eager(x)
            torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
            for (name, b), (_, rb) in zip(model.named_buffers(), eager.named_buffers()):
                torch.testing.assert_close(b, rb, atol=atol, rtol=rtol, msg=name)
    return cb.compiled_steps()[-1]


class StatefulSDPA(torch.nn.Module):
    """Causal SDPA over a running state: nothing here needs runner metadata, so
    a FULL mode captures the whole graph lazily without a runner."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)
        self.register_buffer("state", torch.randn(D))

    def forward(self, x):  # [T, D]
        q, k, v = self.qkv(x).view(1, 1, -1, 3 * D).chunk(3, dim=-1)  # [1, 1, T, D] each
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).view(-1, D)
        self.state.mul_(0.5).add_(h.mean(0))  # the call's write: lost if capture is returned
        return self.out(h) + self.state


def plain_calls(shapes, repeats, device="cpu", seed=0):
    """`repeats` calls per token count, fresh random inputs each (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, D, generator=g).to(device),) for t in shapes for _ in range(repeats)]


def small_hf_llama(layers: int = 2, hidden: int = 256, heads: int = 8, kv_heads: int = 2,
                   vocab: int = 256, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """An unmodified transformers LlamaForCausalLM (SDPA attention), seeded
    weights, eval mode; skips the test when transformers is missing."""
    import pytest

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device, dtype).eval()
