"""compile/piece_compiler.py: compiling a split graph's pieces, the inputs
each piece (and the whole graph) writes, and installing the callables.

Graphs come from Dynamo (a backend that only keeps what torch.compile hands
it), split with split_graph, then compiled here with the eager piece compiler;
one slow case compiles with Inductor. Numerics: float32, fresh random inputs
(never zeros); the eager compiler runs the very same code: atol=rtol=1e-6;
Inductor: atol=rtol=1e-4.
"""

import copy

import pytest
import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

import compile_backend as cb
import toy_ops  # noqa: F401  (registers toy::*)
from backend_models import D, TOY_OPTIONS, Layers, ToyHybrid, check_against_eager
from compile_backend.compile.piece_calls import call_pieces_directly, install_pieces
from compile_backend.compile.piece_compiler import compile_piece, compile_pieces
from compile_backend.compile.split import split_graph

TOL = dict(atol=1e-6, rtol=1e-6)
ROLES = cb.OpRegistry.from_config(cb.CompilationConfig(**TOY_OPTIONS))
SIZES = [5, 2, 16, 9]


def _dynamo_graph(fn, *args):
    """The graph and example inputs that torch.compile hands a backend for
    fn(*args) (tensors marked with cb.mark_token_dim stay symbolic)."""
    got = []

    def keep(gm, example_inputs):
        got.append((gm, list(example_inputs)))
        return gm.forward

    with torch.no_grad(), cb.symbolic_tokens():
        torch.compile(fn, backend=keep, fullgraph=True)(*args)
    assert len(got) == 1
    return got[0]


def _split_and_compile(fn, *args):
    gm, example_inputs = _dynamo_graph(fn, *args)
    split_gm, pieces = split_graph(gm, ROLES)
    fns, written = compile_pieces(split_gm, pieces, example_inputs, "eager")
    return gm, example_inputs, split_gm, pieces, fns, written


def _fresh(example_inputs, seed):
    """Random float tensors shaped like the example inputs (SymInt inputs:
    the token count they stand for)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(e.shape, generator=g, dtype=e.dtype) if isinstance(e, torch.Tensor)
            else int(e) for e in example_inputs]


class _PieceArgs(torch.fx.Interpreter):
    """Runs a split graph and keeps a copy of each piece's arguments."""

    def __init__(self, split_gm):
        super().__init__(split_gm)
        self.args = {}

    def call_module(self, target, args, kwargs):
        self.args[target] = _clone(args)
        return super().call_module(target, args, kwargs)


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _call_node(split_gm, name):
    return next(n for n in split_gm.graph.nodes if n.op == "call_module" and n.target == name)


# ---- compile_piece --------------------------------------------------------------


def test_the_eager_compiler_returns_the_piece_itself_and_others_are_refused():
    gm = torch.fx.symbolic_trace(lambda x: x.sin())
    assert compile_piece(gm, [torch.randn(3)], "eager") is gm
    with pytest.raises(AssertionError, match="tvm"):
        compile_piece(gm, [torch.randn(3)], "tvm")
    assert cb.counters["inductor_compiles"] == 0


# ---- compile_pieces --------------------------------------------------------------


def _hybrid(x, w, state):
    h = torch.ops.toy.attn(x @ w, x, x)
    return torch.ops.toy.state_mix(h, state).relu()


def test_every_piece_gets_a_callable_that_runs_as_the_graph_did_at_every_token_count():
    x, w, state = cb.mark_token_dim(torch.randn(5, D)), torch.randn(D, D), torch.randn(D)
    gm, example_inputs, split_gm, pieces, fns, written = _split_and_compile(_hybrid, x, w, state)
    assert [p.captured for p in pieces] == [True, False, True]
    assert set(fns) == {p.name for p in pieces}
    # eager compiler: the pieces' own modules; only captured pieces count as compiles
    assert all(fns[p.name] is p.graph_module for p in pieces)
    assert cb.counters["piece_compiles"] == 2 and cb.counters["piece_compile_reuses"] == 0
    assert all(p.compiled_as is None and p.layer_alias is None for p in pieces)
    install_pieces(split_gm, fns)
    call_pieces_directly(split_gm, [p.name for p in pieces])
    position = {id(x): 0, id(w): 1, id(state): 2}
    for tokens in [7, 1, 16]:
        ours = [torch.randn(tokens, D), torch.randn(D, D), torch.randn(D)]
        theirs = _clone(ours)
        args = [ours[position[id(e)]] if isinstance(e, torch.Tensor) else tokens
                for e in example_inputs]  # the token count's SymInt: the count
        torch.testing.assert_close(split_gm(*args)[0], _hybrid(*theirs), **TOL)
        torch.testing.assert_close(ours, theirs, **TOL)  # state written alike


def test_identical_pieces_share_the_first_ones_callable_and_match_their_own_code():
    """Layers(3): the MLP pieces between SDPAs are one piece with different
    parameters; the later ones run the first one's callable (no layer alias:
    SDPA is not a layer-keyed op). Each piece's callable, run on that piece's
    own arguments (from fresh random graph inputs), equals the piece's module."""
    model = Layers(3)
    gm, example_inputs, split_gm, pieces, fns, _ = _split_and_compile(
        model, cb.mark_token_dim(torch.randn(6, D)))  # SDPA: a default breakpoint
    captured = [p for p in pieces if p.captured]
    shared = [p for p in captured if p.compiled_as is not None]
    assert len(captured) == 4 and len(shared) >= 1
    for p in shared:
        assert fns[p.name] is fns[p.compiled_as] and p.layer_alias is None
        assert p.compiled_as in [q.name for q in captured if q.index < p.index]
    assert cb.counters["piece_compiles"] + cb.counters["piece_compile_reuses"] == 4
    assert cb.counters["piece_compile_reuses"] == len(shared)
    for seed in range(2):
        recorder = _PieceArgs(split_gm)
        recorder.run(*_fresh(example_inputs, seed))
        for p in pieces:
            args = recorder.args[p.name]
            torch.testing.assert_close(fns[p.name](*_clone(args)), p.graph_module(*_clone(args)),
                                       **TOL)


def _writes(cache, idx, x, state, acc, buf, ro):
    cache.index_copy_(0, idx, x)  # piece 0: index_copy_ into an input
    tail = buf[2:]  # piece 0: a view of an input, written in piece 2
    h = torch.ops.toy.attn(x, x, x)  # piece 1 (eager)
    state[:, 1:3].mul_(h.mean())  # piece 2: an in-place write through a view
    mixed = torch.ops.toy.state_mix(h, acc)  # piece 2: a custom op's declared write
    tail.add_(1.0)
    return mixed * ro


def _writes_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return {"cache": torch.randn(8, D, generator=g), "idx": torch.randperm(8, generator=g)[:3],
            "x": torch.randn(3, D, generator=g), "state": torch.randn(2, D, generator=g),
            "acc": torch.randn(D, generator=g), "buf": torch.randn(6, generator=g),
            "ro": torch.randn(D, generator=g)}


def test_written_inputs_per_piece_and_for_the_whole_graph():
    """Writes are read off the fake run's version counters: index_copy_, an
    in-place op on a view, a custom op's mutates_args, and a view made in one
    piece and written in another (the graph input behind it is written).
    Inputs only read are never listed."""
    named = _writes_inputs(0)
    gm, example_inputs, split_gm, pieces, fns, written = _split_and_compile(
        _writes, *named.values())
    name_of = {id(t): n for n, t in named.items()}
    inputs = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    input_name = {node: name_of[id(e)] for node, e in zip(inputs, example_inputs)}

    def names(piece):
        args = _call_node(split_gm, piece.name).args
        return {input_name.get(args[i], "(made by a piece)") for i in piece.written_inputs}

    assert [p.captured for p in pieces] == [True, False, True]
    assert [names(p) for p in pieces] == [{"cache"}, set(), {"state", "acc", "(made by a piece)"}]
    assert {name_of[id(example_inputs[i])] for i in written} == {"cache", "state", "acc", "buf"}
    assert pieces[0].summary()["written_inputs"] == sorted(pieces[0].written_inputs)

    # and the installed pieces write what the function writes
    install_pieces(split_gm, fns)
    call_pieces_directly(split_gm, [p.name for p in pieces])
    fresh = _writes_inputs(1)
    ours = [fresh[name_of[id(e)]] for e in example_inputs]
    theirs = copy.deepcopy(fresh)
    torch.testing.assert_close(split_gm(*ours)[0], _writes(*theirs.values()), **TOL)
    torch.testing.assert_close(fresh, theirs, **TOL)


def test_a_graph_that_only_reads_writes_nothing():
    _, _, _, pieces, _, written = _split_and_compile(_hybrid_reader, torch.randn(4, D),
                                                     torch.randn(D, D))
    assert written == frozenset() and all(p.written_inputs == frozenset() for p in pieces)


def _hybrid_reader(x, w):
    return torch.ops.toy.attn(x @ w, x, x).sin()


# ---- install_pieces, call_pieces_directly ----------------------------------------


def test_installed_pieces_are_called_directly_without_module_calls():
    """install_pieces puts a plain callable behind a module (the split graph
    holds modules); call_pieces_directly then binds each piece's callable
    itself, so a step never goes through nn.Module.__call__ (hooks on the
    submodules never fire), while tools still find the submodules."""
    x, w, state = torch.randn(5, D), torch.randn(D, D), torch.randn(D)
    _, _, split_gm, pieces, fns, _ = _split_and_compile(_hybrid, x, w, state)
    calls = []

    def first_piece(*args):
        calls.append(len(args))
        return fns["submod_0"](*args)

    install_pieces(split_gm, {**fns, "submod_0": first_piece})
    holder = split_gm._modules["submod_0"]
    assert isinstance(holder, torch.nn.Module) and holder.fn is first_piece
    assert split_gm._modules["submod_1"] is fns["submod_1"]  # a module is installed as it is
    hooked = []
    for name in ("submod_0", "submod_1", "submod_2"):
        split_gm._modules[name].register_forward_hook(lambda *a, name=name: hooked.append(name))
    call_pieces_directly(split_gm, [p.name for p in pieces])
    assert getattr(split_gm, "submod_0") is first_piece
    for p in pieces[1:]:
        fn = getattr(split_gm, p.name)
        assert not isinstance(fn, torch.nn.Module), p.name
        assert getattr(fn, "__func__", None) is not _LazyGraphModule._lazy_forward, p.name
    ours = [torch.randn(5, D), torch.randn(D, D), torch.randn(D)]
    theirs = _clone(ours)
    torch.testing.assert_close(split_gm(*ours)[0], _hybrid(*theirs), **TOL)
    assert len(calls) == 1 and hooked == []  # called once, as itself


def test_a_step_calls_its_pieces_without_module_calls():
    """The split graph's piece attributes are the callables themselves: an
    eager piece's generated forward (not the lazy one that recompiles and
    goes through Module.__call__ every time), a captured piece's wrapper."""
    step = check_against_eager(ToyHybrid(), TOY_OPTIONS, SIZES)
    for p in step.pieces:
        fn = getattr(step.split_gm, p.name)
        assert not isinstance(fn, torch.nn.Module), p.name
        assert getattr(fn, "__func__", None) is not _LazyGraphModule._lazy_forward, p.name
        assert isinstance(step.split_gm._modules[p.name], torch.nn.Module)  # tools walk modules


# ---- through torch.compile --------------------------------------------------------


def test_identical_layers_share_one_compiled_piece():
    step = check_against_eager(Layers(3), {}, [6, 3])
    assert cb.counters["dynamo_graphs"] == 1
    captured = [p for p in step.pieces if p.captured]
    assert len(captured) == 4  # first MLP, two MLPs between SDPAs, trailing piece
    assert cb.counters["piece_compile_reuses"] >= 1
    assert cb.counters["piece_compiles"] + cb.counters["piece_compile_reuses"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_inductor_pieces_compile_once_and_match_eager(workers):
    """Inductor: one compile per distinct piece, reused across layers and
    sizes; in this process, or in compile worker processes."""
    model = Layers(3)
    torch.manual_seed(0)
    eager = copy.deepcopy(model)
    # piece_compiler defaults to inductor; every piece compiles with it (the
    # last one holds one op Inductor could fuse: compile/fusible.py)
    backend = cb.backend(compile_workers=workers, inductor_min_fusible_ops=0)
    if workers:  # ready before the compile, so that they take its pieces
        backend.start_workers()
        assert backend._workers.wait_ready(timeout=120)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for t in [6, 3, 11]:
            x = cb.mark_token_dim(torch.randn(t, 16))
            with cb.symbolic_tokens():
                out = compiled(x)
            torch.testing.assert_close(out, eager(x), atol=1e-4, rtol=1e-4)
    assert cb.counters["dynamo_graphs"] == 1
    distinct = cb.counters["piece_compiles"]
    assert cb.counters["inductor_compiles"] == distinct
    assert distinct < 4 and cb.counters["piece_compile_reuses"] >= 1
    assert cb.counters["compile_worker_fallbacks"] == 0
    assert (cb.counters["compile_worker_compiles"] >= 1) == (workers > 0)
