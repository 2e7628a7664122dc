"""Identical layers compile once (compile/layer_sharing.py): pieces that differ
only in the layer names of layer-keyed ops share one compiled artifact, and
each still reads its own layer's metadata."""

import pytest
import torch

import compile_backend as cb
from compile_backend import passes
from compile_backend.core.forward_context import ForwardContext, set_forward_context
from compile_backend.core.op_registry import _LAYER_KEYED_OPS, register_layer_keyed_op
from compile_backend.demo.engine import Engine
from compile_backend.demo.models import build_model, preset
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import kv_config, random_prompts


# A user's op that reads a per-layer value from its layer's metadata:
# x [T, D] -> x * scale + shift of that layer.
@torch.library.custom_op("sharing_test::scale_by_layer", mutates_args=())
def scale_by_layer(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    meta = cb.get_forward_context().metadata(layer_name)
    return x * meta["scale"] + meta["shift"]


@scale_by_layer.register_fake
def _(x, layer_name):
    return torch.empty_like(x)


passes.register_capture_safe("sharing_test::scale_by_layer")


class _Layer(torch.nn.Module):
    def __init__(self, d, name):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.name = name

    def forward(self, x):
        return torch.ops.sharing_test.scale_by_layer(torch.relu(self.lin(x)), self.name)


class _Stack(torch.nn.Module):
    """Layers split by a breakpoint (toy::attn) so that each is its own piece."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(d, f"layers.{i}.op") for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            x = torch.ops.toy.attn(x, x, x)
        return x


def _per_layer_metadata(n, seed):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.op": {"scale": torch.rand((), generator=g).item() + 0.5,
                               "shift": torch.randn((), generator=g).item()} for i in range(n)}


@pytest.fixture
def layer_keyed_user_op():
    register_layer_keyed_op("sharing_test::scale_by_layer")
    yield
    _LAYER_KEYED_OPS.discard("sharing_test::scale_by_layer")


def _compile_and_compare(shared):
    import toy_ops  # noqa: F401  (registers toy::attn)

    torch._dynamo.reset()
    cb.reset_counters()
    torch.manual_seed(7)
    model = _Stack().eval()
    compiled = torch.compile(model, backend=cb.backend(
        cudagraph_mode="none", piece_compiler="eager", splitting_ops=["toy::attn"]))
    for call in range(3):  # a fresh batch and fresh per-layer metadata every call
        meta = _per_layer_metadata(4, seed=call)
        x = torch.randn(8 + call, 16, generator=torch.Generator().manual_seed(100 + call))
        with set_forward_context(ForwardContext(attn_metadata=meta)), torch.no_grad():
            want = model(x)
            got = compiled(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    step = cb.compiled_steps()[-1]
    captured = [p for p in step.pieces if p.captured]
    assert len(captured) == 4
    return captured


def test_a_registered_user_op_compiles_once_and_reads_each_layers_metadata(layer_keyed_user_op):
    captured = _compile_and_compare(shared=True)
    # the first layer's piece is compiled; the others run it as their layer
    # (per Dynamo graph: the first call's static one, then a dynamic one)
    graphs = cb.counters["dynamo_graphs"]
    assert cb.counters["piece_compiles"] == graphs
    assert cb.counters["piece_compile_reuses"] == 3 * graphs
    assert [p.compiled_as for p in captured] == [None] + [captured[0].name] * 3


def test_an_unregistered_user_op_keeps_its_names_and_compiles_per_layer():
    captured = _compile_and_compare(shared=False)
    assert cb.counters["piece_compiles"] == 4 * cb.counters["dynamo_graphs"]
    assert [p.compiled_as for p in captured] == [None] * 4


def test_registering_an_op_without_a_layer_name_argument_says_what_to_name_it():
    import toy_ops  # noqa: F401

    with pytest.raises(ValueError, match="no argument named 'layer_name'"):
        register_layer_keyed_op("toy::attn")
    with pytest.raises(ValueError, match="does not resolve"):
        register_layer_keyed_op("toy::no_such_op")


@pytest.mark.parametrize("mode", ["full_and_piecewise", pytest.param("piecewise", marks=pytest.mark.slow)])
def test_llama_layers_share_one_artifact_and_every_layer_runs_at_capture(mode):
    """A 4-layer llama: first piece, 3 identical middle pieces, last piece ->
    3 compiled. Each layer's KV write still runs as that layer at capture (the
    trace names all four), and tokens equal eager."""
    prompts = random_prompts([5, 9])

    def run(m):
        torch._dynamo.reset()
        cb.reset_counters()
        with use_graph_backend(StandInGraphs()), torch.no_grad():
            model = build_model("llama", preset("tiny", num_layers=4))
            cfg = cb.CompilationConfig(cudagraph_mode=m, capture_sizes=[1, 4, 8],
                                       piece_compiler="eager")
            engine = Engine(model, kv_config(), cfg, "cpu", prefill_chunk=8, progress=False)
            trace = []
            engine.runner.capture(trace)
            return engine.generate(prompts, 3), trace, dict(cb.counters)

    ref, _, _ = run("none")
    out, trace, counts = run(mode)
    assert out == ref
    assert counts["piece_compiles"] == 3 and counts["piece_compile_reuses"] == 2, counts
    at_capture = {layer for layer, e in trace if e == "rope_and_cache@capture"}
    assert at_capture == {f"layers.{i}.attn" for i in range(4)}
    step = cb.compiled_steps()[-1]
    shared = [p for p in step.pieces if p.compiled_as]
    assert len(shared) == 2 and len({p.compiled_as for p in shared}) == 1


@pytest.mark.slow
def test_inductor_compiles_identical_llama_layers_once():
    """Through Inductor: 6 layers, 3 compiles (first, middle, last piece)."""
    torch._dynamo.reset()
    cb.reset_counters()
    model = build_model("llama", preset("tiny", num_layers=6))
    # every piece Inductor's (llama's hold nothing it could fuse: compile/fusible.py)
    cfg = cb.CompilationConfig(cudagraph_mode="none", capture_sizes=[8], inductor_min_fusible_ops=0)
    engine = Engine(model, kv_config(), cfg, "cpu", prefill_chunk=8, progress=False)
    ref_model = build_model("llama", preset("tiny", num_layers=6))
    ref_model.load_state_dict(model.state_dict())
    ref = Engine(ref_model, kv_config(), cb.CompilationConfig(
        cudagraph_mode="none", piece_compiler="eager"), "cpu", prefill_chunk=8, progress=False)
    prompts = random_prompts([5, 9])
    with torch.no_grad():
        engine.runner.capture()
        got = engine.generate(prompts, 3)
        assert cb.counters["inductor_compiles"] == 3, dict(cb.counters)
        assert cb.counters["piece_compile_reuses"] == 4
        want = ref.generate(prompts, 3)
    assert got == want


class _CacheStack(torch.nn.Module):
    """Each layer also reads a cache of its own length (an HF DynamicCache's
    per-layer keys), so Dynamo gives every layer's cache a symbol of its own."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x, caches):
        for lin, c in zip(self.lins, caches):
            x = torch.relu(lin(x)) + c.mean(0)  # c [L_i, d]
            x = torch.ops.toy.attn(x, x, x)
        return x


def _cache_stack_compiles(lengths, ranges=None, then=None, piece_compiler="eager"):
    """Compile _CacheStack with each cache's length dynamic (`ranges`: a
    (min, max) per cache, or None); (piece compiles, reuses) of the one
    Dynamo graph, after checking two calls against eager. `then`: cache
    lengths of one more call, checked against eager after the counts."""
    import toy_ops  # noqa: F401  (registers toy::attn)

    torch._dynamo.reset()
    cb.reset_counters()
    torch.manual_seed(3)
    model = _CacheStack(n=len(lengths)).eval()
    compiled = torch.compile(model, backend=cb.backend(
        cudagraph_mode="none", piece_compiler=piece_compiler, splitting_ops=["toy::attn"],
        inductor_min_fusible_ops=0))
    g = torch.Generator().manual_seed(11)

    def call(lens):
        caches = [torch.randn(n, 16, generator=g) for n in lens]
        for i, c in enumerate(caches):
            lo, hi = ranges[i] if ranges else (None, None)
            torch._dynamo.mark_dynamic(c, 0, min=lo, max=hi)
        x = torch.randn(6, 16, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, caches), model(x, caches), rtol=1e-5, atol=1e-5)

    for step in range(2):
        call([n + step for n in lengths])
    assert cb.counters["dynamo_graphs"] == 1, dict(cb.counters)
    counts = cb.counters["piece_compiles"], cb.counters["piece_compile_reuses"]
    if then is not None:
        call(then)
    return counts


def test_layers_whose_caches_have_symbols_of_their_own_share_one_artifact():
    """Four layers, four cache symbols (s0..s3): one layer's piece is
    compiled, the others equal it up to renaming the symbols and share it."""
    compiles, reuses = _cache_stack_compiles([5, 6, 7, 9])
    assert (compiles, reuses) == (1, 3)


def test_a_symbol_with_another_range_keeps_its_layer_apart():
    """The same, but the third layer's cache length is bounded differently:
    its piece is not the same piece (compiled code may rely on a range)."""
    compiles, reuses = _cache_stack_compiles([5, 6, 7, 9],
                                            ranges=[(2, 4096), (2, 4096), (2, 64), (2, 4096)])
    assert (compiles, reuses) == (2, 2)


def _guarding_compiler(monkeypatch, guard, compiler=None):
    """Piece compiles that first guard `guard(first symbolic size)` of their
    piece (as Inductor does when it picks a kernel for a size range);
    `compiler`: the one they run instead of the piece's."""
    from compile_backend.compile import piece_compiler

    real = piece_compiler.compile_piece

    def guarding(gm, fake_args, piece_compiler_name, serializable=False):
        sizes = [d for a in fake_args if isinstance(a, torch.Tensor) for d in a.shape
                 if isinstance(d, torch.SymInt)]
        bool(guard(sizes[0]))  # a guard on this piece's first symbol
        return real(gm, fake_args, compiler or piece_compiler_name, serializable)

    monkeypatch.setattr(piece_compiler, "compile_piece", guarding)


def test_what_a_compile_assumed_of_its_sizes_is_guarded_for_the_pieces_sharing_it(monkeypatch):
    """The first layer's compile guards `s0 >= 4`; the other layers (6, 7 and
    9 long) share its artifact, and Dynamo now guards each of their symbols
    >= 4 as well: a call whose second cache is 3 long compiles a new graph
    rather than run the artifact outside what it assumed."""
    _guarding_compiler(monkeypatch, lambda s: s >= 4)
    assert _cache_stack_compiles([5, 6, 7, 9], then=[5, 3, 7, 9]) == (1, 3)
    assert cb.counters["dynamo_graphs"] == 2, dict(cb.counters)


def test_a_piece_whose_sizes_break_what_a_compile_assumed_compiles_its_own(monkeypatch):
    """The first layer's compile guards `s0 <= 7`: the 6-long layer shares
    it, the 8- and 9-long ones compile their own (their compiles guard
    `s > 7` on themselves)."""
    _guarding_compiler(monkeypatch, lambda s: s <= 7)
    assert _cache_stack_compiles([5, 6, 8, 9]) == (3, 1)


class _InProcessWorkers:
    """Compile workers that run the worker's own function (unpickle into a
    ShapeEnv of its own, compile, say what it assumed) in this process: what a
    worker's compile assumed reaches the caller only through its answer."""

    def __init__(self):
        self.sent = 0

    def submit(self, remote, payload, local=None):
        from concurrent.futures import Future

        from compile_backend.core.qualified_names import resolve

        self.sent += 1
        future = Future()
        future.set_result(("worker", resolve(remote)(payload)))
        return future

    def run_queued_here(self):
        return 0

    def close(self):
        pass


def _through_workers(monkeypatch, guard):
    """Pieces "compiled by Inductor" in _InProcessWorkers: each compile guards
    `guard(its first symbol)` in its own ShapeEnv and runs the piece eagerly."""
    from compile_backend.compile import backend, piece_compiler, step_artifacts

    _guarding_compiler(monkeypatch, guard, compiler="eager")
    workers = _InProcessWorkers()
    monkeypatch.setattr(backend, "_start_workers", lambda config: workers)
    monkeypatch.setattr(step_artifacts, "artifact_bytes", lambda fn: b"the piece")
    # The loaded artifact: the caller's own piece module (eager), with what the worker assumed.
    monkeypatch.setattr(piece_compiler, "loaded_from_worker",
                        lambda submod, answer: (submod, answer[1]))
    return workers


def test_what_a_workers_compile_assumed_is_guarded_here_for_it_and_its_sharers(monkeypatch):
    """The first layer's piece compiles in a worker, whose compile guards
    `s0 >= 4` in the worker's ShapeEnv only: the caller guards it on receipt
    (for that piece, as for the layers sharing its artifact), so a call whose
    first cache is 3 long compiles a new graph."""
    workers = _through_workers(monkeypatch, lambda s: s >= 4)
    assert _cache_stack_compiles([5, 6, 7, 9], then=[3, 6, 7, 9], piece_compiler="inductor") \
        == (1, 3)
    assert cb.counters["dynamo_graphs"] == 2, dict(cb.counters)
    assert workers.sent == cb.counters["compile_worker_compiles"] == 2  # one per Dynamo graph


def test_a_workers_artifact_is_shared_only_where_what_it_assumed_holds(monkeypatch):
    """The worker's compile guards `s0 <= 7`: the 6-long layer shares its
    artifact, the 8- and 9-long ones compile their own here."""
    _through_workers(monkeypatch, lambda s: s <= 7)
    assert _cache_stack_compiles([5, 6, 8, 9], piece_compiler="inductor") == (3, 1)
    assert cb.counters["compile_worker_compiles"] == 1
