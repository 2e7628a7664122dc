"""The capture-safety pass: ops a CUDA graph cannot capture get their own
eager piece, with a reason naming the op and the source line, logged once and
counted; strict_capture turns that into an error.

Numerics: float32 on fresh random inputs against eager, atol=rtol=1e-5."""

import logging

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

import compile_backend as cb
import pass_ops  # noqa: F401  (registers passtest::*)
from compile_backend import passes
import toy_ops  # noqa: F401
from compile_backend.compile.split import EAGER_REASON
from compile_backend.passes import CaptureSafetyError, CaptureSafetyPass

T, D = 6, 8
TOL = dict(atol=1e-5, rtol=1e-5)
BASE = {"splitting_ops": ["toy::attn"], "attention_like_ops": ["toy::state_mix"],
        "piece_compiler": "eager"}
DATA_DEPENDENT = dict(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


def run(fn, inputs, **options):
    compiled = torch.compile(fn, backend="mrv2", options={**BASE, **options})
    with torch._dynamo.config.patch(**DATA_DEPENDENT):
        out = compiled(*[t.clone() for t in inputs])
    expected = fn(*[t.clone() for t in inputs])
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, **TOL)
    return cb.compiled_steps()[-1]


def captured_ops(step):
    return [op for p in step.pieces if p.captured for op in p.ops]


def fallbacks(step):
    (entry,) = [e for e in step.pass_log if e["pass"] == "CaptureSafetyPass"]
    return entry["details"]["fallbacks"]


def test_item_is_a_host_sync_and_its_consumer_follows_it():
    def fn(x, w):
        h = x @ w
        s = h.sum().item()  # host sync
        return h * s  # uses the synced value

    step = run(fn, [torch.randn(T, D), torch.randn(D, D)])
    assert [p.captured for p in step.pieces] == [True, False]
    assert step.pieces[1].ops == ["method::item", "_operator.mul"]
    item_reason, mul_reason = step.pieces[1].eager_reasons
    assert item_reason.startswith("`Tensor.item` at test_capture_safety.py:")
    assert "s = h.sum().item()" in item_reason and "host sync" in item_reason
    assert "from `Tensor.item`" in mul_reason and "h * s" in mul_reason
    assert cb.counters["pass_capture_unsafe_ops"] == 2
    assert cb.counters["capture_fallbacks"] == 1  # one eager piece


@pytest.mark.parametrize("fn, labels", [
    (lambda x: torch.nonzero(x > 0).float().sum() + x, {"torch.nonzero"}),
    (lambda x: x[x > 0].sum() + x, {"operator.getitem"}),
    (lambda x: torch.unique(x).sum() + x, {"torch.functional.unique", "torch._unique2"}),
    (lambda x: torch.masked_select(x, x > 0).sum() + x, {"torch.masked_select"}),
], ids=["nonzero", "bool-mask", "unique", "masked_select"])
def test_data_dependent_shapes_are_eager(fn, labels):
    def step_fn(x):
        return attn(fn(x), x, x)

    step = run(step_fn, [torch.randn(T, D)])
    (first,) = [f for f in fallbacks(step) if "output shape depends on the data" in f["reason"]]
    assert first["op"] in labels
    # The node itself, and everything that uses its data-dependent size, is in
    # an eager piece.
    where = {n.name: p.captured for p in step.pieces for n in p.graph_module.graph.nodes
             if n.op in ("call_function", "call_method")}
    assert where[first["node"]] is False
    assert all(where[f["node"]] is False for f in fallbacks(step))


def attn(q, k, v):
    return torch.ops.toy.attn(q, k, v)


def test_unknown_custom_op_is_eager_until_registered_safe():
    def fn(x):
        y = torch.ops.passtest.host_read(x + 1)
        return y * 2

    step = run(fn, [torch.randn(T, D)])
    assert "passtest::host_read" not in captured_ops(step)
    assert [p.captured for p in step.pieces] == [True, False, True]
    (f,) = fallbacks(step)
    assert "custom op not known to be capture-safe" in f["reason"]
    assert "register_capture_safe('passtest::host_read')" in f["reason"]
    assert "splitting_ops" in f["reason"]

    torch._dynamo.reset()
    passes.register_capture_safe("passtest::host_read")
    try:
        step = run(fn, [torch.randn(T, D)])
    finally:
        passes.unregister_capture_safe("passtest::host_read")
    assert [p.captured for p in step.pieces] == [True]
    assert fallbacks(step) == []


def test_cudagraph_unsafe_tag_wins_over_registration():
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no torch.Tag.cudagraph_unsafe")
    passes.register_capture_safe("passtest::graph_unsafe")
    try:
        step = run(lambda x: torch.ops.passtest.graph_unsafe(x * 2) - 1, [torch.randn(T, D)])
    finally:
        passes.unregister_capture_safe("passtest::graph_unsafe")
    assert [p.captured for p in step.pieces] == [True, False, True]
    assert "torch.Tag.cudagraph_unsafe" in step.pieces[1].eager_reasons[0]


def test_attention_like_and_trusted_ops_are_captured():
    def fn(x, state):
        return state_mix_twice(x, state).softmax(-1)

    step = run(fn, [torch.randn(T, D), torch.randn(D)])
    assert [p.captured for p in step.pieces] == [True]
    assert step.pieces[0].attention_like == ["toy::state_mix", "toy::state_mix"]
    assert cb.counters["pass_capture_unsafe_ops"] == 0


def state_mix_twice(x, state):
    return torch.ops.toy.state_mix(torch.ops.toy.state_mix(x, state), state)


def test_each_reason_is_logged_once(caplog):
    """The same op on the same source line in a loop: three findings, one log."""

    def fn(x):
        for _ in range(3):
            x = torch.ops.passtest.host_read(x) + 1
        return x

    with caplog.at_level(logging.WARNING, logger="compile_backend.passes"):
        step = run(fn, [torch.randn(T, D) * 0.1])
    assert len(fallbacks(step)) == 3
    logged = [r for r in caplog.records if "capture fallback" in r.getMessage()]
    assert len(logged) == 1 and "passtest::host_read" in logged[0].getMessage()
    assert cb.counters["pass_capture_unsafe_ops"] == 3


def test_strict_capture_raises_naming_op_line_and_fix():
    def fn(x):
        y = x * 2
        return y * y.sum().item()

    compiled = torch.compile(fn, backend="mrv2", options={**BASE, "strict_capture": True})
    with torch._dynamo.config.patch(**DATA_DEPENDENT):
        with pytest.raises(Exception) as info:
            compiled(torch.randn(T, D))
    msg = str(info.value)
    assert "strict_capture" in msg and "`Tensor.item`" in msg
    assert "return y * y.sum().item()" in msg
    assert "register it as a breakpoint" in msg and "strict_capture=False" in msg


def test_strict_capture_passes_a_safe_graph():
    step = run(lambda x, s: torch.ops.toy.state_mix(x * 2, s), [torch.randn(T, D), torch.randn(D)],
               strict_capture=True)
    assert [p.captured for p in step.pieces] == [True]


# --- hand-built graphs: device checks and host syncs Dynamo would not trace --


def _graph_with(values, build):
    """An fx graph over placeholders carrying fake `example_value`s."""
    g = torch.fx.Graph()
    phs = []
    for i, v in enumerate(values):
        ph = g.placeholder(f"x{i}")
        ph.meta["example_value"] = v
        phs.append(ph)
    out = build(g, phs)
    g.output(out)
    return g


def _fake(mode, shape, device):
    with mode:
        return torch.empty(shape, device=device)


@pytest.mark.parametrize("method", ["tolist", "numpy", "__bool__", "cpu"])
def test_host_sync_methods(method):
    mode = FakeTensorMode()
    g = _graph_with([_fake(mode, (4,), "cpu")], lambda g, p: g.call_method(method, (p[0],)))
    report = CaptureSafetyPass(cb.OpRegistry())(g)
    (node,) = [n for n in g.nodes if n.op == "call_method"]
    assert "host sync" in node.meta[EAGER_REASON]
    assert report.changed and report.details["fallbacks"][0]["op"] == f"Tensor.{method}"


def test_cpu_tensor_in_a_cuda_graph_is_eager():
    mode = FakeTensorMode()
    cuda_x, cpu_y = _fake(mode, (4,), "cuda"), _fake(mode, (4,), "cpu")

    def build(g, p):
        a = g.call_function(torch.sin, (p[0],))
        a.meta["example_value"] = cuda_x
        b = g.call_function(torch.cos, (p[1],))
        b.meta["example_value"] = cpu_y
        return (a, b)

    g = _graph_with([cuda_x, cpu_y], build)
    report = CaptureSafetyPass(cb.OpRegistry())(g)
    assert report.details["graph_has_cuda"]
    sin, cos = [n for n in g.nodes if n.op == "call_function"]
    assert EAGER_REASON not in sin.meta
    assert "CPU tensor in a graph whose other tensors are on CUDA" in cos.meta[EAGER_REASON]


def test_cpu_only_graph_is_not_flagged():
    mode = FakeTensorMode()
    x = _fake(mode, (4,), "cpu")

    def build(g, p):
        a = g.call_function(torch.sin, (p[0],))
        a.meta["example_value"] = x
        return a

    g = _graph_with([x], build)
    report = CaptureSafetyPass(cb.OpRegistry())(g)
    assert not report.changed and not report.details["graph_has_cuda"]


def test_register_capture_safe_rejects_unresolvable_names():
    with pytest.raises(ValueError, match="does not resolve"):
        passes.register_capture_safe("passtest::no_such_op")
    with pytest.raises(ValueError, match="namespace::name"):
        passes.register_capture_safe("host_read")
