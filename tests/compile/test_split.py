"""compile/split.py: where a graph is cut, what each piece records, and that
the split graph computes what the graph did.

Most graphs here are built with torch.fx (split_graph needs no Dynamo and no
fake values); the last tests go through torch.compile with the eager piece
compiler. Numerics: float32, fresh random inputs, atol=rtol=1e-6 (the split
graph runs the same ops in the same order).
"""

import json
import operator

import torch
import torch.fx

import compile_backend as cb
import toy_ops  # noqa: F401  (registers toy::*)
from backend_models import TOY_OPTIONS, BufferMutation, TupleBreakpoint, check_against_eager
from compile_backend.compile.split import Piece, assign_partitions, split_graph
from compile_backend.core.op_registry import EAGER_REASON

SIZES = [5, 2, 16, 9]
TOL = dict(atol=1e-6, rtol=1e-6)
N = 4
ROLES = cb.OpRegistry.from_config(cb.CompilationConfig(**TOY_OPTIONS))
SIN = "torch._VariableFunctionsClass.sin"


def _module(build) -> torch.fx.GraphModule:
    """A GraphModule from `build(graph, x, s) -> outputs`: x [N, N], s [N]."""
    g = torch.fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    g.output(build(g, x, s))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, N, generator=g), torch.randn(N, generator=g)


def _same_results(gm, split_gm, seeds=(0, 1)):
    """Outputs and written inputs agree, on fresh random inputs."""
    for seed in seeds:
        a, b = _inputs(seed), _inputs(seed)
        out_a, out_b = gm(*a), split_gm(*b)
        torch.testing.assert_close(out_b, out_a, **TOL)
        torch.testing.assert_close(b, a, **TOL)


def _table(pieces):
    return [(p.captured, p.breakpoints, p.attention_like) for p in pieces]


def _call_order(split_gm):
    return [n.target for n in split_gm.graph.nodes if n.op == "call_module"]


def _attn(g, a):
    return g.call_function(torch.ops.toy.attn, (a, a, a))


def test_breakpoints_cut_the_graph_into_alternating_pieces():
    def build(g, x, s):
        a = g.call_function(torch.sin, (x,))
        b = _attn(g, a)
        c = g.call_function(torch.cos, (b,))
        d = g.call_function(operator.mul, (c, 2.0))
        e = _attn(g, d)
        return g.call_function(operator.add, (e, a))

    gm = _module(build)
    split_gm, pieces = split_graph(gm, ROLES)
    assert _table(pieces) == [(True, [], []), (False, ["toy::attn"], []), (True, [], []),
                              (False, ["toy::attn"], []), (True, [], [])]
    assert [(p.index, p.name) for p in pieces] == [(i, f"submod_{i}") for i in range(5)]
    assert pieces[2].ops == ["torch._VariableFunctionsClass.cos", "_operator.mul"]  # graph order
    assert all(p.graph_module is getattr(split_gm, p.name) for p in pieces)
    assert _call_order(split_gm) == [p.name for p in pieces]
    _same_results(gm, split_gm)


def test_a_graph_without_breakpoints_is_one_captured_piece_and_a_leading_breakpoint_is_piece_0():
    gm = _module(lambda g, x, s: g.call_function(operator.add, (g.call_function(torch.sin, (x,)), s)))
    _, pieces = split_graph(gm, ROLES)
    assert _table(pieces) == [(True, [], [])] and pieces[0].ops == [SIN, "_operator.add"]

    gm = _module(lambda g, x, s: g.call_function(torch.sin, (_attn(g, x),)))
    split_gm, pieces = split_graph(gm, ROLES)
    assert [(p.index, p.captured) for p in pieces] == [(0, False), (1, True)]
    _same_results(gm, split_gm)


def test_consecutive_breakpoints_and_a_tuple_accessor_between_them_make_one_eager_piece():
    def build(g, x, s):
        pair = g.call_function(torch.ops.toy.attn_pair, (g.call_function(torch.sin, (x,)),))
        first = g.call_function(operator.getitem, (pair, 0))
        second = g.call_function(operator.getitem, (pair, 1))
        h = g.call_function(torch.ops.toy.attn, (first, second, first))
        h = _attn(g, h)
        return g.call_function(operator.add, (h, second))

    gm = _module(build)
    split_gm, pieces = split_graph(gm, ROLES)
    assert _table(pieces) == [(True, [], []),
                              (False, ["toy::attn_pair", "toy::attn", "toy::attn"], []),
                              (True, [], [])]
    assert "python::getitem" not in pieces[1].ops  # bookkeeping, not listed
    _same_results(gm, split_gm)


def test_a_getitem_of_a_captured_value_does_not_join_the_eager_piece_after_it():
    """Only accessors of an eager producer stay with it: one of a captured
    tuple that is read after a breakpoint runs where the graph has it."""

    def build(g, x, s):
        halves = g.call_function(torch.chunk, (g.call_function(torch.sin, (x,)), 2))
        h = _attn(g, x)
        top = g.call_function(operator.getitem, (halves, 0))  # after the breakpoint
        return g.call_function(operator.mul, (h, 2.0)), top

    gm = _module(build)
    split_gm, pieces = split_graph(gm, ROLES)
    part = assign_partitions(gm, ROLES)
    getitem = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    assert part[getitem] == 2 and pieces[2].captured  # not in the eager piece 1
    assert _table(pieces) == [(True, [], []), (False, ["toy::attn"], []), (True, [], [])]
    _same_results(gm, split_gm)


def test_attention_like_ops_stay_inside_captured_pieces():
    def build(g, x, s):
        a = g.call_function(torch.ops.toy.state_mix, (g.call_function(torch.sin, (x,)), s))
        b = _attn(g, a)
        c = g.call_function(torch.ops.toy.state_mix, (b, s))  # right after a breakpoint
        return g.call_function(torch.ops.toy.state_mix, (c, s))

    gm = _module(build)
    split_gm, pieces = split_graph(gm, ROLES)
    assert _table(pieces) == [(True, [], ["toy::state_mix"]), (False, ["toy::attn"], []),
                              (True, [], ["toy::state_mix", "toy::state_mix"])]
    _same_results(gm, split_gm)  # state_mix writes s: the writes land in order


def test_a_node_marked_eager_by_a_pass_is_eager_and_carries_its_reason():
    """`EAGER_REASON` (set by compile_backend/passes/capture_safety.py) makes a node eager; it
    merges with a neighbouring breakpoint, and the piece lists the reason."""
    reason = "host sync: aten::item at model.py:12"

    def build(g, x, s):
        a = g.call_function(torch.sin, (x,))
        flagged = g.call_function(torch.cos, (a,))
        flagged.meta[EAGER_REASON] = reason
        b = _attn(g, flagged)
        c = g.call_function(torch.tanh, (b,))
        alone = g.call_function(torch.exp, (c,))
        alone.meta[EAGER_REASON] = "opaque op"
        return g.call_function(operator.add, (alone, a))

    gm = _module(build)
    split_gm, pieces = split_graph(gm, ROLES)
    assert [(p.captured, p.eager_reasons, p.breakpoints) for p in pieces] == [
        (True, [], []), (False, [reason], ["toy::attn"]), (True, [], []),
        (False, ["opaque op"], []), (True, [], [])]
    assert pieces[1].ops == ["torch._VariableFunctionsClass.cos", "toy::attn"]
    _same_results(gm, split_gm)


def test_collectives_are_listed_and_stay_in_captured_pieces():
    def build(g, x, s):
        r = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
        w = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (r,))
        return _attn(g, w)

    _, pieces = split_graph(_module(build), ROLES)
    assert [(p.captured, p.collectives) for p in pieces] == [
        (True, ["_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"]), (False, [])]


def test_pieces_take_what_they_read_and_the_outputs_keep_the_graphs_order():
    """A value made in piece 0 and read in piece 2 is piece 0's output and
    piece 2's input; the graph's outputs, in order, come from the pieces that make them."""

    def build(g, x, s):
        a = g.call_function(torch.sin, (x,))
        b = _attn(g, a)
        c = g.call_function(operator.add, (b, a))
        d = g.call_function(operator.mul, (c, s))
        return (d, a, b)

    gm = _module(build)
    split_gm, pieces = split_graph(gm, ROLES)
    calls = {n.target: n for n in split_gm.graph.nodes if n.op == "call_module"}
    names = {n: n.name for n in split_gm.graph.nodes}
    assert [names[a] for a in calls["submod_0"].args] == ["x"]
    assert [names[a] for a in calls["submod_1"].args] == ["submod_0"]
    assert sorted(names[a] for a in calls["submod_2"].args) == ["s", "submod_0", "submod_1"]
    for p in pieces:
        wanted = [names[a] for a in calls[p.name].args]
        got = [n.name for n in p.graph_module.graph.nodes if n.op == "placeholder"]
        assert len(got) == len(wanted), (p.name, got, wanted)
    output = next(n for n in split_gm.graph.nodes if n.op == "output")
    assert [names[o] for o in output.args[0]] == ["submod_2", "submod_0", "submod_1"]
    _same_results(gm, split_gm)


def test_an_in_place_write_is_not_moved_past_a_reader():
    """keep_original_order: s is read, then written (add_), then read again.
    No data edge orders the reading piece 0 before the writing piece 2, so
    only the traced order keeps the read ahead of the write (split_module's
    dependency order runs piece 0 last, and this test then fails)."""

    def build(g, x, s):
        before = g.call_function(operator.mul, (x, s))  # reads s before the write
        h = _attn(g, x)
        g.call_method("add_", (s, 1.0))
        after = g.call_function(operator.mul, (h, s))  # reads s after it
        return before, after

    gm = _module(build)
    split_gm, pieces = split_graph(gm, ROLES)
    assert "method::add_" in pieces[2].ops
    assert _call_order(split_gm) == ["submod_0", "submod_1", "submod_2"]
    _same_results(gm, split_gm)


def test_partitions_count_up_from_zero_and_skip_placeholders_outputs_and_attributes():
    root = torch.nn.Module()
    root.register_buffer("w", torch.randn(N))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    a = g.call_function(operator.mul, (x, w))
    b = _attn(g, a)
    g.output(g.call_function(torch.sin, (b,)))
    gm = torch.fx.GraphModule(root, g)
    part = assign_partitions(gm, ROLES)
    assert [(n.name, p) for n, p in part.items()] == [("mul", 0), ("attn", 1), ("sin", 2)]
    split_gm, pieces = split_graph(gm, ROLES)
    x_val = torch.randn(N, N)
    torch.testing.assert_close(split_gm(x_val), gm(x_val), **TOL)


def test_a_piece_summary_is_plain_data():
    _, pieces = split_graph(_module(lambda g, x, s: _attn(g, g.call_function(torch.sin, (x,)))), ROLES)
    pieces[0].written_inputs = frozenset({2, 0})
    pieces[0].compiled_as = "submod_9"
    summary = pieces[0].summary()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["written_inputs"] == [0, 2] and summary["compiled_as"] == "submod_9"
    assert set(summary) == {f for f in Piece.__dataclass_fields__
                            if f not in ("graph_module", "layer_alias")}


# ---- through torch.compile (eager pieces) -------------------------------------


def test_tuple_breakpoint_merges_with_next_breakpoint():
    step = check_against_eager(TupleBreakpoint(), TOY_OPTIONS, SIZES)
    assert _table(step.pieces) == [
        (True, [], []), (False, ["toy::attn_pair", "toy::attn"], []), (True, [], []),
    ]


def test_in_place_buffer_mutation_keeps_order():
    step = check_against_eager(BufferMutation(), TOY_OPTIONS, SIZES)
    assert len(step.pieces) == 3 and not step.pieces[1].captured
    assert "method::add_" in step.pieces[0].ops
