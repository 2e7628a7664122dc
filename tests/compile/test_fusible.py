"""compile/fusible.py and the per-piece choice it drives: what of a traced
graph Inductor could fuse (aten compute; not views, allocations, no-op casts
or custom ops it calls as they are), and pieces with fewer such ops than
`inductor_min_fusible_ops` running as traced under the Inductor piece
compiler: no Inductor compile, the choice on each piece and in the log, and
outputs equal to eager on fresh random inputs, call after call."""

import logging

import pytest
import torch
import torch.nn.functional as F

import compile_backend as cb
from backend_models import TOY_OPTIONS
from compile_backend.compile.compiled_step import compiled_steps
from compile_backend.compile.fusible import fusible_ops

_LIB = torch.library.Library("mrv2_fusible_test", "DEF")
_LIB.define("opaque(Tensor x, Tensor w) -> Tensor")
_LIB.impl("opaque", lambda x, w: x @ w.t(), "CompositeExplicitAutograd")
_LIB.define("decomposed(Tensor x) -> Tensor")
_LIB.impl("decomposed", lambda x: torch.sigmoid(x) * x, "CompositeImplicitAutograd")
_OPS = torch.ops.mrv2_fusible_test


@torch.library.register_fake("mrv2_fusible_test::opaque")
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _traced(fn, *args) -> torch.fx.GraphModule:
    """Dynamo's graph of fn(*args) (its nodes carry their example values)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def _targets(gm) -> list[str]:
    return [entry.split(" (")[1].rstrip(")") for entry in fusible_ops(gm)]


def test_views_allocations_no_op_casts_and_opaque_custom_ops_are_not_fusible():
    x, w = torch.randn(8, 16), torch.randn(32, 16)

    def fn(x, w):
        y = _OPS.opaque(x.view(8, 16).reshape(8, 16), w)  # views, an opaque custom op
        z = torch.narrow(y, 1, 0, 16)[:, 2:]  # views: narrow, a basic slice
        buf = torch.empty_like(z)  # an allocation
        return z.float().contiguous(), buf  # float: fp32 already; contiguous: z is a slice, a copy
    assert _targets(_traced(fn, x, w)) == ["contiguous"]  # the one copy


def test_compute_casts_gathers_and_decomposed_custom_ops_are_fusible():
    x = torch.randn(8, 16)
    idx = torch.randint(0, 8, (4,))

    def fn(x, idx):
        y = x.to(torch.bfloat16)  # a real cast
        z = x[idx]  # a gather
        return y, z + 1, _OPS.decomposed(x), F.silu(x)
    assert _targets(_traced(fn, x, idx)) == ["to", "getitem", "add", "decomposed", "silu"]


def _split_model(layers: int):
    """Pieces between toy attention breakpoints: the first and the middle
    ones hold only views and an opaque custom op, the last one two adds."""
    import toy_ops  # noqa: F401  (toy::attn, a breakpoint)

    ws = [torch.randn(16, 16) / 4 for _ in range(layers)]

    def fn(x):
        for w in ws:
            x = _OPS.opaque(x.view(-1, 16), w)
            x = torch.ops.toy.attn(x, x, x)
        return (x + 1) * 2
    return fn


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_pieces_with_nothing_to_fuse_run_as_traced_under_inductor(mode, caplog):
    """With piece_compiler="inductor": no Inductor compile at all (the only
    piece with two fusible ops is the last, and the threshold is 3 here), each
    piece says how it ran, the log says how many, and every call equals eager."""
    from compile_backend.runtime.graph_pool import use_graph_backend
    from compile_backend.runtime.graph_standin import StandInGraphs

    fn = _split_model(3)
    cb.reset_counters()
    torch._dynamo.reset()
    backend = cb.backend(cudagraph_mode=mode, piece_compiler="inductor", capture_sizes=[4, 8],
                         inductor_min_fusible_ops=3, compile_workers=0, **TOY_OPTIONS)
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    g = torch.Generator().manual_seed(7)
    with use_graph_backend(StandInGraphs()), caplog.at_level(logging.INFO):
        for n in (4, 8, 3, 8):  # a new tensor at a new address every call
            x = torch.randn(n, 16, generator=g)
            torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
    assert "inductor_compiles" not in cb.counters
    step = compiled_steps()[-1]
    captured = [p for p in step.pieces if p.captured]
    assert captured and {p.compiled_with for p in captured} == {"eager"}
    assert cb.counters["pieces_without_inductor"] == len(captured)
    assert [len(p.fusible_ops) for p in captured][-1] == 2  # add, mul
    assert all(p.summary()["compiled_with"] == "eager" for p in captured)
    assert any(f"{len(captured)} of {len(captured)} captured pieces run as traced" in r.message
               for r in caplog.records)


def test_the_threshold_is_checked():
    with pytest.raises(ValueError, match="inductor_min_fusible_ops must be an int >= 0"):
        cb.CompilationConfig(inductor_min_fusible_ops=-1)
    with pytest.raises(ValueError, match="inductor_min_fusible_ops"):
        cb.CompilationConfig(inductor_min_fusible_ops=True)


@pytest.mark.slow  # full tier: one Inductor compile on 2 cores
def test_a_piece_at_the_threshold_compiles_with_inductor_and_equals_eager():
    """The default threshold (2): the last piece (add, mul) is Inductor's, the
    others run as traced; outputs equal eager on every call."""
    from compile_backend.runtime.graph_pool import use_graph_backend
    from compile_backend.runtime.graph_standin import StandInGraphs

    fn = _split_model(2)
    cb.reset_counters()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=cb.backend(cudagraph_mode="piecewise", capture_sizes=[4, 8],
                                                     compile_workers=0, **TOY_OPTIONS), dynamic=True)
    g = torch.Generator().manual_seed(11)
    with use_graph_backend(StandInGraphs()):
        for n in (8, 4, 5):
            x = torch.randn(n, 16, generator=g)
            torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
    captured = [p for p in compiled_steps()[-1].pieces if p.captured]
    assert [p.compiled_with for p in captured] == ["eager"] * (len(captured) - 1) + ["inductor"]
    assert cb.counters["inductor_compiles"] == 1
