"""Correct on every call, as real callers drive a compiled model: several
sessions through one compiled model, new state objects per session, inputs
at new addresses on every call, shapes alternating, and every tensor the
call can reach (outputs, arguments, state inside argument objects,
parameters, buffers) compared with eager after every call.

On the CPU graphs are the strict stand-in; the same tests run on the GPU
under `-m gpu` with real CUDA graphs. Each of these fails when a replay
copies a moved input that the graph writes into the capture-time tensor
(the caller's tensor misses the write)."""

import contextlib
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compile_backend as cb
from compile_backend.runtime.cuda_graph import CUDAGraphWrapper
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from compile_backend.testing import EagerMismatch, check_against_eager

MODES = ["piecewise", "full", "full_and_piecewise"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _graphs(device):
    """CUDA graphs on a GPU; the strict stand-in on the CPU."""
    return use_graph_backend(StandInGraphs()) if device == "cpu" else contextlib.nullcontext()


class KVState:
    """A caller's state object, passed in and written in place (a cache)."""

    def __init__(self, slots: int, width: int, device: str, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.keys = torch.randn(slots, width, generator=g).to(device)  # [S, D]
        self.steps = torch.zeros((), dtype=torch.int64, device=device)


class WritesItsArguments(nn.Module):
    """x [T, D], slots [T] (distinct), state.keys [S, D]: writes the tokens'
    keys into the caller's cache, counts tokens, attends over the whole cache
    (SDPA: a breakpoint, so PIECEWISE has pieces on both sides), and returns
    an output that aliases the caller's cache."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.k = nn.Linear(width, width)
        self.q = nn.Linear(width, width)
        self.o = nn.Linear(width, width)

    def forward(self, x, slots, state):
        state.keys.index_copy_(0, slots, self.k(x))
        state.steps.add_(x.shape[0])
        att = F.scaled_dot_product_attention(self.q(x)[None, None], state.keys[None, None],
                                             state.keys[None, None])[0, 0]  # [T, D]
        return self.o(att) + x, state.keys[:4]


def _session(device, seed, sizes=(4, 6), repeats=3, slots=32, width=16):
    """One session's calls: one state object shared by its calls, sizes
    alternating, fresh random inputs (never zeros) and slots each call."""
    g = torch.Generator().manual_seed(seed)
    state = KVState(slots, width, device, seed)
    calls = []
    for _ in range(repeats):
        for t in sizes:
            x = torch.randn(t, width, generator=g).to(device)
            calls.append((x, torch.randperm(slots, generator=g)[:t].to(device), state))
    return calls


@pytest.mark.parametrize("piece_compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_a_model_writing_its_arguments_equals_eager_in_every_session(mode, device, piece_compiler):
    """Four sessions, each with its own state object; sizes alternate."""
    if piece_compiler == "inductor" and device == "cpu" and mode != "piecewise":
        pytest.skip("Inductor on 2 CPU cores: one mode is enough there")
    torch.manual_seed(0)
    tol = 1e-5 if piece_compiler == "eager" else 1e-4
    with _graphs(device):
        report = check_against_eager(WritesItsArguments().to(device), _session(device, 1), [mode],
                                     options={"piece_compiler": piece_compiler}, sessions=4,
                                     atol=tol, rtol=tol)
    assert report[mode].replays > report[mode].captures > 0
    assert cb.counters["address_captures"] > 0  # each session's state is at new addresses


def test_the_check_reaches_tensors_inside_argument_objects():
    """check_against_eager compares what a call wrote into its arguments,
    state objects included: one differing element of a cache is caught."""
    from compile_backend.testing import _compare_reachable, reachable_tensors

    sub, ref = KVState(8, 4, "cpu", 0), KVState(8, 4, "cpu", 0)
    assert set(reachable_tensors((torch.ones(2), sub), "argument")) == {
        "argument[0]", "argument[1].keys", "argument[1].steps"}
    _compare_reachable("call 0", "argument", (torch.ones(2), sub), (torch.ones(2), ref), 1e-5, 1e-5)
    ref.keys[3, 1] += 1
    with pytest.raises(EagerMismatch, match=r"call 0: argument\[1\]\.keys differs from eager"):
        _compare_reachable("call 0", "argument", (torch.ones(2), sub), (torch.ones(2), ref), 1e-5, 1e-5)


def test_a_moved_written_input_is_captured_again_and_named_under_debug_checks(caplog):
    """The wrapper alone: a written input at a new address gets its own graph
    (never a copy into the capture-time tensor), a read-only one a private
    buffer; debug_checks names each moved input, both addresses, and whether
    the graph writes it; the caller's old tensors are never written."""
    def step(x, cache):  # x [4] read, cache [4] written
        cache.add_(x)
        return cache * 2

    with use_graph_backend(StandInGraphs()), caplog.at_level(logging.WARNING):
        w = CUDAGraphWrapper(step, cb.CUDAGraphMode.PIECEWISE, name="piece", debug_checks=True,
                             input_names=["x", "cache"], written_inputs=[1])
        ctx = cb.ForwardContext(graph=cb.StepGraph(cb.CUDAGraphMode.PIECEWISE, 4, 4))
        with cb.set_forward_context(ctx):
            x, c1 = torch.randn(4), torch.randn(4)
            want1 = c1 + x
            w(x, c1)  # capture (and replay)
            torch.testing.assert_close(c1, want1)
            c2 = torch.randn(4)
            c1_after, want2 = c1.clone(), c2 + x
            out = w(x, c2)  # the cache moved: a graph for its address
            torch.testing.assert_close(c2, want2)
            torch.testing.assert_close(out, want2 * 2)
            assert torch.equal(c1, c1_after)  # the old cache is not written
            assert cb.counters["address_captures"] == 1
            w(x, c1)  # back to the first cache: its graph, no capture
            torch.testing.assert_close(c1, want1 + x)
            assert cb.counters["address_captures"] == 1
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "input 1 (cache) moved since capture (0x" in said and "the graph writes it" in said
    assert "capturing a graph for the new address" in said


def test_graphs_per_shape_bounds_the_graphs_of_one_shape():
    def step(cache):
        cache.mul_(2)
        return cache.sum()

    with use_graph_backend(StandInGraphs()):
        w = CUDAGraphWrapper(step, cb.CUDAGraphMode.PIECEWISE, name="piece", written_inputs=[0],
                             graphs_per_shape=2)
        ctx = cb.ForwardContext(graph=cb.StepGraph(cb.CUDAGraphMode.PIECEWISE, 4, 4))
        with cb.set_forward_context(ctx):
            caches = [torch.randn(4) for _ in range(4)]
            for c in caches:
                want = c * 2
                w(c)
                torch.testing.assert_close(c, want)
    assert len(w.variants[cb.StepGraph(cb.CUDAGraphMode.PIECEWISE, 4, 4).key]) == 2
    assert cb.counters["graph_evictions"] == 2


def test_an_output_aliasing_an_input_is_a_view_of_the_callers_tensor():
    def step(x):  # x [4], read only; returns a view of it and a new tensor
        return x[1:3], x * 3

    with use_graph_backend(StandInGraphs()):
        w = CUDAGraphWrapper(step, cb.CUDAGraphMode.PIECEWISE, name="piece", written_inputs=())
        ctx = cb.ForwardContext(graph=cb.StepGraph(cb.CUDAGraphMode.PIECEWISE, 4, 4))
        with cb.set_forward_context(ctx):
            for _ in range(4):  # capture, then a private buffer for the moving input, then copies
                x = torch.randn(4)
                view, tripled = w(x)
                assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                torch.testing.assert_close(view, x[1:3])
                torch.testing.assert_close(tripled, x * 3)


def test_plain_callers_own_their_outputs():
    """Without a runner, what a call returns is the caller's: a later replay
    of the same graph does not change it."""
    from backend_models import TOY_OPTIONS, ToyHybrid

    model = ToyHybrid()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        f = torch.compile(model, backend="mrv2", options={"piece_compiler": "eager", **TOY_OPTIONS})
        outs = []
        for _ in range(4):
            outs.append(f(torch.randn(6, 16)))
        kept = [o.clone() for o in outs]
        f(torch.randn(6, 16))
    assert cb.counters["cudagraph_replays"] > 0
    for o, k in zip(outs, kept):
        assert torch.equal(o, k)


def test_plain_callers_own_their_outputs_after_a_runner_style_capture():
    """A graph captured into the shared pool (a runner's) in the same process
    neither makes a plain caller's outputs graph memory again nor reuses a
    shared pool handle whose graphs are gone while lazily captured graphs
    (pools of their own) live."""
    import gc

    from backend_models import TOY_OPTIONS, ToyHybrid

    from compile_backend.runtime import graph_pool

    # Graphs of earlier tests in this process (Dynamo keeps their steps in the
    # traced modules' globals) may hold the shared pool: start without them.
    cb.release_graphs()
    model = ToyHybrid()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        f = torch.compile(model, backend="mrv2", options={"piece_compiler": "eager", **TOY_OPTIONS})
        for _ in range(3):  # warm-up, capture (pools of their own), replay
            f(torch.randn(6, 16))

        def shared_capture():
            # a backend of its own: its graph dies with the wrapper on return
            w = CUDAGraphWrapper(lambda x: x + 1, cb.CUDAGraphMode.PIECEWISE, name="runner_piece",
                                 graphs=StandInGraphs())
            ctx = cb.ForwardContext(graph=cb.StepGraph(cb.CUDAGraphMode.PIECEWISE, 4, 4))
            with cb.set_forward_context(ctx):
                w(torch.randn(4))
            return graph_pool._shared.handle

        first = shared_capture()  # its wrapper and graph die on return
        gc.collect()
        assert shared_capture() is not first  # no live graph held the first handle
        out = f(torch.randn(6, 16))
        kept = out.clone()
        f(torch.randn(6, 16))  # replays the same graphs
    assert cb.counters["cudagraph_replays"] > 0
    assert torch.equal(out, kept)


# ---- a cache that grows by a token per call ----------------------------------------------


class GrowingCache:
    """A caller's cache that, like transformers' DynamicCache, is a new longer
    tensor after every call (torch.cat), never written in place."""

    def __init__(self, width: int, device: str, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.keys = torch.randn(1, 3, width, generator=g).to(device)  # [1, L, D], L grows


class AttendsOverAGrowingCache(nn.Module):
    """x [1, 1, D]: one new token's key joins the cache, SDPA over the whole
    cache (a breakpoint), then an MLP on fixed shapes."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.k = nn.Linear(width, width)
        self.q = nn.Linear(width, width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.k(x)], dim=1)
        att = F.scaled_dot_product_attention(self.q(x)[:, None], cache.keys[:, None],
                                             cache.keys[:, None])[:, 0]
        return self.down(F.gelu(self.up(att))) + x


def _growing_session(seed, steps=6, width=16):
    g = torch.Generator().manual_seed(seed)
    cache = GrowingCache(width, "cpu", seed)
    return [(torch.randn(1, 1, width, generator=g), cache) for _ in range(steps)]


@pytest.mark.parametrize("mode", MODES)
def test_a_growing_cache_runs_with_the_attention_and_every_piece_replays(mode):
    """The growing-caches pass (the default): the cat and what reads the
    cache run with the attention, so no piece reads a growing shape: every
    piece captures and replays, none is found growing, and every call of
    three sessions equals eager (outputs and the cache object's new tensor)."""
    cb.reset_counters()
    before = set(map(id, graph_pool_wrappers()))
    with _graphs("cpu"):
        report = check_against_eager(AttendsOverAGrowingCache(), _growing_session(3), [mode],
                                     options={"piece_compiler": "eager"}, sessions=3,
                                     atol=1e-6, rtol=1e-6)
    assert cb.counters["pass_growing_cache_nodes"] > 0 and report[mode].replays > 0
    new = [w for w in graph_pool_wrappers() if id(w) not in before]
    # In a FULL mode the whole graph reads the cache: it alone is found growing
    # and given up for its pieces.
    assert new and not any(w.growing for w in new if w.mode is cb.CUDAGraphMode.PIECEWISE)
    assert cb.counters["growing_inputs"] == (0 if mode == "piecewise" else 1)
    # the graph Dynamo made for the growing length: its two pieces (q/k, the MLP) hold graphs
    assert sum(bool(w.entries) for w in new if w.mode is cb.CUDAGraphMode.PIECEWISE) >= 2


@pytest.mark.parametrize("mode", MODES)
def test_a_growing_cache_runs_its_growing_pieces_without_graphs_and_equals_eager(mode, caplog):
    """With the growing-caches pass off, the runtime policy: every call equal
    to eager (outputs and the cache object's new tensor), three sessions; the
    pieces that read the growing cache stop capturing (said once, counted),
    the fixed-shape MLP piece still replays."""
    from compile_backend.runtime import cuda_graph

    cuda_graph._growth_said.clear()
    cb.reset_counters()
    before = set(map(id, graph_pool_wrappers()))
    with _graphs("cpu"), caplog.at_level(logging.WARNING, logger="compile_backend.runtime.cuda_graph"):
        report = check_against_eager(AttendsOverAGrowingCache(), _growing_session(3), [mode],
                                     options={"piece_compiler": "eager",
                                              "growing_caches_eager": False},
                                     sessions=3, atol=1e-6, rtol=1e-6)
    assert report[mode].replays > 0  # the MLP after attention: one shape every call
    assert cb.counters["growing_inputs"] >= 1 and cb.counters["captures_skipped"] > 0
    said = [r for r in caplog.records if "grows by one along a dimension" in r.getMessage()]
    assert len(said) == 1 and 'cache_implementation=\"static\"' in said[0].getMessage()
    growing = [w for w in graph_pool_wrappers() if w.growing and id(w) not in before]
    assert growing and all(not w.entries for w in growing)  # no graph for a growing piece


def test_a_sweep_of_sizes_by_one_keeps_its_graphs():
    """Sizes 1, 2, 3 again and again grow by one twice in a row, below the
    growth policy's five calls: they are captured and replayed as before."""
    cb.reset_counters()
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    g = torch.Generator().manual_seed(11)
    calls = [(torch.randn(t, 16, generator=g),) for t in (1, 2, 3)]
    with _graphs("cpu"):
        report = check_against_eager(model, calls, ["piecewise"], options={"piece_compiler": "eager"},
                                     sessions=4, atol=1e-6, rtol=1e-6)
    assert report["piecewise"].replays > 0 and cb.counters["growing_inputs"] == 0


def graph_pool_wrappers():
    from compile_backend.runtime import graph_pool

    return list(graph_pool._wrappers)


# ---- Hugging Face generate, called as users call it --------------------------------------


def _hf_model(arch, layers, device, hidden=64):
    transformers = pytest.importorskip("transformers")
    heads = max(4, hidden // 64)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_embd=hidden, n_layer=layers, n_head=heads,
                                      n_positions=128)
        cls = transformers.GPT2LMHeadModel
    else:
        config_cls, cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        }[arch]
        cfg = config_cls(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads // 2,
                         max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg).to(device).eval()


def _generate_calls(cache, device, new_tokens=10):
    """A generate loop, called as users call it: the same prompt again, and a
    prompt of another length. Greedy; HF's own auto-compile off, so eager is
    eager; logits kept, so every step's logits are compared."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (1, n), generator=g).to(device) for n in (7, 7, 11)]
    extra = {"cache_implementation": "static"} if cache == "static" else {}

    def call(ids):
        return lambda m: m.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True,
                                    disable_compile=True, pad_token_id=0, **extra)

    return [call(p) for p in prompts]


def _check_generate(arch, cache, layers, device, modes, piece_compiler="eager", hidden=64):
    model = _hf_model(arch, layers, device, hidden)
    with _graphs(device), torch.no_grad():
        report = check_against_eager(model, _generate_calls(cache, device), modes,
                                     options={"piece_compiler": piece_compiler}, sessions=2,
                                     atol=1e-5, rtol=1e-5)
    for mode in modes:
        assert report[mode].replays > 0, mode
    return report


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_hf_llama_generate_called_again_and_again_equals_eager(mode, cache):
    _check_generate("llama", cache, 2, "cpu", [mode])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_hf_generate_called_again_and_again_equals_eager(arch, cache):
    _check_generate(arch, cache, 2, "cpu", ["piecewise", "full"])


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_hf_llama_8_layers_generate_called_again_and_again_equals_eager(cache):
    _check_generate("llama", cache, 8, "cpu", ["piecewise", "full"])


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [2, 8])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_hf_generate_called_again_and_again_equals_eager_on_the_gpu(arch, cache, layers):
    """Tiny (2 layers, hidden 64) and 8 layers of hidden 2048."""
    _check_generate(arch, cache, layers, "cuda", MODES, hidden=64 if layers == 2 else 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_hf_llama_generate_called_again_and_again_with_inductor_pieces_on_the_gpu(cache):
    _check_generate("llama", cache, 8, "cuda", ["piecewise", "full"], piece_compiler="inductor",
                    hidden=2048)
