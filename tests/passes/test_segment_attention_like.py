"""The segment pass on Dynamo-traced graphs: attention-like ops stay captured,
breakpoints cluster, mutations and unknown effects are never crossed.

Numerics: float32 on fresh random inputs, compared with eager at
atol=rtol=1e-5 (the passes only reorder; the ops are the same)."""

import logging
import operator

import pytest
import torch

import compile_backend as cb
import pass_ops  # noqa: F401  (registers passtest::*)
import toy_ops  # noqa: F401  (registers toy::*)

T, D = 6, 8
TOL = dict(atol=1e-5, rtol=1e-5)
ROLES = {
    "splitting_ops": ["toy::attn", "toy::attn_pair", "passtest::cache_write"],
    "attention_like_ops": ["toy::state_mix", "passtest::compress"],
}
attn = torch.ops.toy.attn
state_mix = torch.ops.toy.state_mix


def compile_and_check(fn, inputs, **options):
    """Run fn compiled and eagerly on clones of inputs (mutations included);
    return the compiled step."""
    opts = {**ROLES, "piece_compiler": "eager", **options}
    compiled = torch.compile(fn, backend="mrv2", options=opts)
    mine = [t.clone() for t in inputs]
    ref = [t.clone() for t in inputs]
    with torch.no_grad():  # inference: with grad on the graph would run uncompiled
        out, expected = compiled(*mine), fn(*ref)
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(mine, ref):  # inputs mutated the same way
        torch.testing.assert_close(a, b, **TOL)
    return cb.compiled_steps()[-1]


def layout(step):
    """'C'/'E' per piece, e.g. 'CEC'."""
    return "".join("C" if p.captured else "E" for p in step.pieces)


def segment_log(step):
    (entry,) = [e for e in step.pass_log if e["pass"] == "SegmentAttentionLikePass"]
    return entry


def hybrid_layer(x, wq, state):
    h = x @ wq
    a = attn(h, h, h)  # breakpoint
    s = state_mix(x * 2, state)  # attention-like; depends on x only
    g = torch.nn.functional.silu(x)  # independent branch
    b = attn(a, a, a)  # breakpoint; depends on a only
    return b + s + g


def test_hybrid_layer_attention_state_attention_min_pieces():
    """attn -> state op -> attn with independent branches: the state op and
    the branch move before the first attention; both attentions share one
    eager piece. 5 pieces before the pass, 3 after (the minimum)."""
    inputs = [torch.randn(T, D), torch.randn(D, D), torch.randn(D)]
    step = compile_and_check(hybrid_layer, inputs)
    assert layout(step) == "CEC"
    first, eager, last = step.pieces
    assert first.attention_like == ["toy::state_mix"]
    assert len(first.ops) == 4 and {"_operator.matmul", "_operator.mul"} <= set(first.ops)
    assert eager.ops == eager.breakpoints == ["toy::attn", "toy::attn"]
    assert last.ops == ["_operator.add", "_operator.add"]
    entry = segment_log(step)
    assert entry["changed"] and entry["details"]["segments_before"] == 5
    assert entry["details"]["segments_after"] == 3
    assert cb.counters["pass_segments_saved"] == 2
    assert cb.counters["pass_nodes_moved"] == entry["details"]["num_moved"] > 0


def test_reorder_off_keeps_traced_order():
    inputs = [torch.randn(T, D), torch.randn(D, D), torch.randn(D)]
    step = compile_and_check(hybrid_layer, inputs, reorder_for_fewer_pieces=False)
    assert layout(step) == "CECEC"
    assert step.passed_code == step.original_code
    assert not segment_log(step)["changed"]


class HybridBlock(torch.nn.Module):
    """One layer of a hybrid model with toy ops in the project's roles:
    a KV-cache write and attention (breakpoints), a KV compressor and a short
    convolution with state (attention-like)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)

    def forward(self, x, kv_cache, comp_cache, conv_state):  # x [T, D]
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [T, D] each
        torch.ops.passtest.cache_write(k, v, kv_cache)  # breakpoint, writes kv_cache
        kc = torch.ops.passtest.compress(k, comp_cache)  # attention-like, needs k only
        a = attn(q, k, v)  # breakpoint
        s = state_mix(self.out(a), conv_state)  # attention-like (sconv), needs a
        return x + s + kc


class HybridModel(torch.nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(HybridBlock() for _ in range(layers))

    def forward(self, x, kv_caches, comp_caches, conv_states):
        for i, layer in enumerate(self.layers):
            x = layer(x, kv_caches[i], comp_caches[i], conv_states[i])
        return x


def test_hybrid_model_compiles_into_minimum_pieces():
    """Per layer as traced: C [cache_write] C(compress) [attn] C -> 2 eager
    pieces per layer. The compressor only needs k, so it moves before the cache
    write and both breakpoints share one eager piece: 2 layers -> CECEC (the
    minimum: layer 2's attention needs layer 1's output)."""
    torch.manual_seed(0)
    model = HybridModel().eval()
    x = torch.randn(T, D)
    kv, comp, conv = torch.randn(2, 2, D), torch.randn(2, D), torch.randn(2, D)

    def step_fn(x, kv, comp, conv):
        with torch.no_grad():
            return model(x, kv, comp, conv)

    step = compile_and_check(step_fn, [x, kv, comp, conv])
    assert layout(step) == "CECEC", [p.ops for p in step.pieces]
    for p in step.pieces:
        if p.captured:
            assert not p.breakpoints
        else:
            assert p.breakpoints == p.ops == ["passtest::cache_write", "toy::attn"]
    captured_attention_like = [n for p in step.pieces if p.captured for n in p.attention_like]
    assert sorted(captured_attention_like) == sorted(
        ["passtest::compress", "toy::state_mix"] * 2
    )
    assert step.pieces[0].attention_like == ["passtest::compress"]
    assert step.pieces[2].attention_like == ["toy::state_mix", "passtest::compress"]
    assert segment_log(step)["details"]["segments_before"] == 9


def test_never_moves_across_a_mutation_of_the_same_tensor():
    """`x.add_(1)` pins: the first attention reads x before the write, the
    second after it, and `y` reads x before it. Ignoring the mutation would
    give 2 pieces (and wrong values); respecting it, 3."""

    def fn(q, x):
        y = x * 2  # reads x (before the write)
        a = attn(q, x, x)  # reads x (before the write)
        x.add_(1)
        b = attn(a, x, x)  # reads x (after the write)
        z = x * 3
        return a, b, y, z

    step = compile_and_check(fn, [torch.randn(T, D), torch.randn(T, D)])
    assert layout(step) == "ECE"
    assert step.pieces[1].ops == ["_operator.mul", "method::add_", "_operator.mul"]
    assert segment_log(step)["details"]["segments_before"] == 5


def test_never_moves_across_a_schema_declared_mutation():
    """passtest::bump declares `x` as mutated: reads of x stay on their side."""
    from compile_backend import passes

    passes.register_capture_safe("passtest::bump")
    try:

        def fn(q, x):
            a = attn(q, x, x)  # before the bump
            y = x * 2  # before the bump
            torch.ops.passtest.bump(x)
            b = attn(a, x, x)  # after the bump
            return a, b, y

        step = compile_and_check(fn, [torch.randn(T, D), torch.randn(T, D)])
    finally:
        passes.unregister_capture_safe("passtest::bump")
    # E(a) C(y bump) E(b): nothing could move (y is ready before `a` only if it
    # moved first: C(y) E(a) C(bump) E(b) is worse).
    assert layout(step) == "ECE"


def test_never_moves_across_an_op_with_unknown_effects():
    """opaque_shift is a python function the passes cannot see into: a barrier
    (and eager, since it cannot be proven capturable). Without the barrier
    the best order is C(y z) E(a o b); with it, z stays after the barrier."""
    from pass_ops import opaque_shift

    def fn(q, x):
        a = attn(q, q, q)
        y = x * 2
        o = opaque_shift(x)
        z = x * 3
        b = attn(a, a, a)
        return a, b, y, o, z

    step = compile_and_check(fn, [torch.randn(T, D), torch.randn(T, D)])
    assert layout(step) == "CEC"
    assert step.pieces[0].ops == ["_operator.mul"]
    assert step.pieces[1].breakpoints == ["toy::attn", "toy::attn"]
    assert any("opaque" in r for r in step.pieces[1].eager_reasons)
    assert step.pieces[2].ops == ["_operator.mul"]
    assert segment_log(step)["details"]["barriers"] == ["o"]


def test_wildcard_splitting_ops_never_split_an_attention_like_op(caplog):
    """`toy::*` in splitting_ops covers toy::state_mix; attention-like wins and
    the pass says so in the log and in its details."""
    inputs = [torch.randn(T, D), torch.randn(D, D), torch.randn(D)]
    with caplog.at_level(logging.INFO, logger="compile_backend.passes"):
        step = compile_and_check(
            hybrid_layer, inputs, splitting_ops=["toy::*"], attention_like_ops=["toy::state_mix"]
        )
    assert layout(step) == "CEC"
    assert [p.attention_like for p in step.pieces if p.captured][0] == ["toy::state_mix"]
    assert segment_log(step)["details"]["attention_like_not_split"] == ["toy::state_mix"]
    assert any("toy::state_mix is attention-like" in r.getMessage() for r in caplog.records)


def test_tuple_breakpoint_accessors_stay_with_it():
    def fn(x, state):
        p, r = torch.ops.toy.attn_pair(x)  # breakpoint returning a tuple
        s = state_mix(x + 1, state)
        b = attn(p, r, r)
        return b + s

    step = compile_and_check(fn, [torch.randn(T, D), torch.randn(D)])
    # As traced: E(pair) C(add s) E(attn) C(add); the second attention only
    # needs the pair's outputs, so it joins the first eager piece.
    assert layout(step) == "EC"
    assert step.pieces[0].ops == ["toy::attn_pair", "toy::attn"]
    assert step.pieces[1].attention_like == ["toy::state_mix"]


@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_symbolic_token_dim_survives_reordering(tokens):
    """Reordering keeps Dynamo's size nodes valid for every token count."""
    wq, state = torch.randn(D, D), torch.randn(D)
    compiled = torch.compile(
        hybrid_layer, backend="mrv2", dynamic=True,
        options={**ROLES, "piece_compiler": "eager"},
    )
    for t in (tokens, tokens + 3):
        x = torch.randn(t, D)
        s1, s2 = state.clone(), state.clone()
        torch.testing.assert_close(compiled(x, wq, s1), hybrid_layer(x, wq, s2), **TOL)
        torch.testing.assert_close(s1, s2, **TOL)
    assert layout(cb.compiled_steps()[-1]) == "CEC"


def _effects_of(build):
    from compile_backend.passes.effects import node_effects

    g = torch.fx.Graph()
    x = g.placeholder("x")
    node = build(g, x)
    return node_effects(node, {x: {"X"}})


@pytest.mark.parametrize("build, writes, barrier", [
    (lambda g, x: g.call_function(torch.nn.functional.relu, (x, True)), {"X"}, False),
    (lambda g, x: g.call_function(torch.nn.functional.relu, (x,), {"inplace": True}), {"X"}, False),
    (lambda g, x: g.call_function(torch.nn.functional.relu, (x,)), set(), False),
    (lambda g, x: g.call_method("__iadd__", (x, 1)), {"X"}, False),
    (lambda g, x: g.call_function(operator.setitem, (x, 0, 1.0)), {"X"}, False),
    (lambda g, x: g.call_function(torch.relu_, (x,)), {"X"}, False),
    (lambda g, x: g.call_function(torch.ops.aten.add_.Tensor, (x, x)), {"X"}, False),
    (lambda g, x: g.call_function(torch.ops.toy.state_mix, (x, x)), {"X"}, False),
    (lambda g, x: g.call_function(torch.add, (x, x), {"out": x}), {"X"}, False),
    (lambda g, x: g.call_function(torch.randn, (3,)), {"rng-state"}, False),
    (lambda g, x: g.call_function(torch._C._set_grad_enabled, (False,)), set(), True),
    (lambda g, x: g.call_function(print, (x,)), set(), True),
    (lambda g, x: g.call_method("record_stream", (x, None)), set(), True),
], ids=["relu-inplace-pos", "relu-inplace-kw", "relu", "iadd-method", "setitem", "relu_",
        "aten-add_", "schema-mutation", "out=", "rng", "grad-mode", "print", "record_stream"])
def test_effect_classification(build, writes, barrier):
    eff = _effects_of(build)
    assert eff.writes == writes and eff.barrier is barrier
