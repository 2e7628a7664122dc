"""The capture plan, its cold order (scouts first) and the dispatch rule
(core/graph_plan.py), as pure functions of a lowered mode, the capture sizes
and max_num_reqs; and the StepGraph they produce (core/graph_mode.py)."""

import pytest

from compile_backend.core.graph_mode import CUDAGraphMode as Mode
from compile_backend.core.graph_mode import StepGraph
from compile_backend.core.graph_plan import (NO_GRAPH_MIXED, NO_GRAPH_TOO_LARGE, GraphPlan,
                                           early_scout_graphs, scout_graphs, scouts_first)

SIZES = (1, 2, 4, 8, 16, 32)


def _plan(mode, max_num_reqs=4):
    return GraphPlan(Mode.parse(mode), SIZES, max_num_reqs)


@pytest.mark.parametrize("mode, expected", [
    ("none", []),
    ("piecewise", [("piecewise", s, min(s, 4), False) for s in (32, 16, 8, 4, 2, 1)]),
    ("full", [("full", 32, 4, False), ("full", 16, 4, False), ("full", 8, 4, False),
              ("full", 4, 4, True), ("full", 4, 4, False), ("full", 2, 2, True),
              ("full", 2, 2, False), ("full", 1, 1, True), ("full", 1, 1, False)]),
    ("full_decode_only", [("full", s, s, True) for s in (4, 2, 1)]),
    ("full_and_piecewise", [("piecewise", s, min(s, 4), False) for s in (32, 16, 8, 4, 2, 1)]
     + [("full", s, s, True) for s in (4, 2, 1)]),
])
def test_capture_plan_is_piecewise_then_full_each_largest_first(mode, expected):
    """FULL: a size's decode graph right before its mixed graph (the source of
    a derived one)."""
    got = [(s.mode.value, s.num_tokens, s.num_reqs, s.uniform_decode)
           for s in _plan(mode).captures()]
    assert got == expected


@pytest.mark.parametrize("mode, num_tokens, num_reqs, decode, expected, reason", [
    ("piecewise", 3, 2, False, StepGraph(Mode.PIECEWISE, 4, 4), None),
    ("piecewise", 3, 3, True, StepGraph(Mode.PIECEWISE, 4, 4), None),
    ("full", 3, 3, True, StepGraph.full_decode(4), None),
    ("full", 3, 2, False, StepGraph(Mode.FULL, 4, 4), None),
    ("full", 12, 4, False, StepGraph(Mode.FULL, 16, 4), None),
    ("full_and_piecewise", 6, 6, True, StepGraph(Mode.PIECEWISE, 8, 4), None),  # 8 > max reqs
    ("full_and_piecewise", 2, 2, True, StepGraph.full_decode(2), None),
    ("full_and_piecewise", 2, 1, False, StepGraph(Mode.PIECEWISE, 2, 2), None),
    ("full_decode_only", 3, 2, False, StepGraph.eager(3, 2), NO_GRAPH_MIXED),
    ("full_decode_only", 1, 1, True, StepGraph.full_decode(1), None),
    ("piecewise", 40, 2, False, StepGraph.eager(40, 2), NO_GRAPH_TOO_LARGE),
    ("none", 3, 2, False, StepGraph.eager(3, 2), None),
])
def test_dispatch_pads_to_the_nearest_graph_and_says_why_there_is_none(
        mode, num_tokens, num_reqs, decode, expected, reason):
    graph, why = _plan(mode).dispatch(num_tokens, num_reqs, decode)
    assert (graph, why) == (expected, reason)


def test_every_dispatched_graph_is_in_the_capture_plan():
    """A step never asks for a graph the plan does not capture (PIECEWISE
    graphs are held by token count alone)."""
    for mode in ("piecewise", "full", "full_decode_only", "full_and_piecewise"):
        plan = _plan(mode)
        keys = {(s.mode, s.key) for s in plan.captures()}
        for T in range(1, 33):
            for B in range(1, min(T, 4) + 1):
                graph, _ = plan.dispatch(T, B, uniform_decode=(T == B))
                if graph.mode is not Mode.NONE:
                    assert (graph.mode, graph.key) in keys, (mode, T, B, graph)


def test_decode_sizes_hold_one_token_per_request_and_the_plan_is_sorted():
    plan = GraphPlan(Mode.FULL, [8, 1, 4, 2], 2)
    assert plan.capture_sizes == (1, 2, 4, 8)
    assert plan.decode_sizes == (1, 2)


def test_a_step_graph_key_is_what_its_graph_is_held_under():
    assert StepGraph(Mode.PIECEWISE, 8, 3).key == StepGraph(Mode.PIECEWISE, 8, 8).key == 8
    assert StepGraph(Mode.FULL, 8, 3).key == (8, 3, False)
    assert StepGraph.full_decode(4).key == (4, 4, True)
    assert StepGraph.eager(5, 2).key is None
    assert StepGraph.full_decode(4).for_capture and not StepGraph(Mode.PIECEWISE, 4, 4).for_capture
    assert StepGraph(Mode.FULL, 8, 3).summary() == {
        "mode": "full", "num_tokens": 8, "num_reqs": 3, "uniform_decode": False}


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_decode_only", "full_and_piecewise"])
def test_scouts_first_keeps_the_largest_first_then_powers_of_two_and_the_smallest(mode):
    """Each mode's run of graphs: its largest size, then every power of two
    and the smallest size, then the rest, each part largest first; a size's
    graphs together and in plan order; every graph once."""
    sizes = (3, 5, 6, 8, 12, 16, 24, 40)
    plan = GraphPlan(Mode.parse(mode), sizes, 24).captures()
    ordered = scouts_first(plan)
    assert sorted(map(repr, ordered)) == sorted(map(repr, plan))
    for kind in {g.mode for g in plan}:
        run = [g for g in ordered if g.mode is kind]
        assert run == ordered[ordered.index(run[0]):][:len(run)]  # one contiguous run a mode
        tokens = list(dict.fromkeys(g.num_tokens for g in run))  # sizes in capture order
        largest, smallest = max(tokens), min(tokens)
        scouts = sorted({t for t in tokens[1:] if t & (t - 1) == 0 or t == smallest}, reverse=True)
        rest = sorted(set(tokens[1:]) - set(scouts), reverse=True)
        assert tokens == [largest, *scouts, *rest]
        for t in tokens:  # a size's graphs as the plan has them (FULL: decode, then mixed)
            assert [g for g in run if g.num_tokens == t] == [g for g in plan
                                                             if g.mode is kind and g.num_tokens == t]
    if mode == "full":
        assert [g.num_tokens for g in ordered[:7]] == [40, 16, 16, 8, 8, 3, 3]


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_decode_only", "full_and_piecewise"])
def test_early_scouts_leave_out_the_full_mixed_graphs_of_sizes_with_a_decode_graph(mode):
    """early_scout_graphs: the scouts, less each FULL mixed graph whose size
    has a uniform-decode graph (its GEMMs' rows are that graph's); a FULL
    mixed size above max_num_reqs (no decode graph) stays, as does every
    PIECEWISE and decode scout, in scout order."""
    plan = GraphPlan(Mode.parse(mode), (3, 5, 6, 8, 12, 16, 24, 40), 24).captures()
    scouts, early = scout_graphs(plan), early_scout_graphs(plan)
    decode = {g.num_tokens for g in plan if g.uniform_decode}
    assert early == [g for g in scouts if g in early]  # a subsequence, in order
    for g in scouts:
        dropped = g.mode is Mode.FULL and not g.uniform_decode and g.num_tokens in decode
        assert (g not in early) == dropped
    if mode == "full":  # 40 > max_num_reqs: mixed only, kept; 16, 8, 3: decode graphs only
        assert [(g.num_tokens, g.uniform_decode) for g in early] == [
            (40, False), (16, True), (8, True), (3, True)]
