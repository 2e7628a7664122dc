"""A warm start without Dynamo (compile/direct_step.py, compile/graph_codec.py):
a saved step's graphs as plain data; the plan that calls it as Dynamo's code
did, written only where the compile's first call showed it exact; refused
plans and failed direct loads fall back to Dynamo's saved code, said and
counted; every path equal to eager over several engines' generate calls."""

import logging
import operator
import pickle

import pytest
import torch

import compile_backend as cb
from compile_backend.compile import direct_step, graph_codec, step_artifacts, step_cache
from compile_backend.demo.engine import Engine
from compile_backend.demo.models import build_model, preset
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import kv_config, random_prompts


# ---- sources ---------------------------------------------------------------------

@pytest.mark.parametrize("name,want", [
    ("L['input_ids']", ("input_ids", ())),
    ("L['input_ids'].size()[0]", ("input_ids", (("size", 0),))),
    ("L['positions'].storage_offset()", ("positions", (("offset",),))),
    ("L['x'].stride()[1]", ("x", (("stride", 1),))),
    ("L['self']._modules['layers']._modules['0']._parameters['weight']",
     ("self", (("attr", "_modules"), ("item", "layers"), ("attr", "_modules"), ("item", "0"),
               ("attr", "_parameters"), ("item", "weight")))),
    ("L['self'].blocks[3].scale", ("self", (("attr", "blocks"), ("item", 3), ("attr", "scale")))),
])
def test_sources_a_plan_names(name, want):
    assert direct_step.parse_source(name) == want


@pytest.mark.parametrize("name", [
    None, "", "G['torch'].float32", "L['x'].size()", "L['x'].view(2)", "L['x'][0:2]",
    "___as_tensor(L['x'])", "L['x'].size()[0] + 1", "L['x']._modules['a'b']",
])
def test_sources_no_plan_names(name):
    assert direct_step.parse_source(name) is None


# ---- graphs as plain data ---------------------------------------------------------------

def _mixed_graph():
    """A root calling a child, with an aten overload, a torch function with
    keyword dtype/device, getitem, a method, a slice and a size."""
    child_graph = torch.fx.Graph()
    x = child_graph.placeholder("x")
    n = child_graph.placeholder("n")
    y = child_graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    z = child_graph.call_function(torch.narrow, (y, -1, 0, n))
    e = child_graph.call_function(torch.empty, (n, 3), {"dtype": torch.float64,
                                                       "device": torch.device("cpu")})
    child_graph.output((z, e))
    child = torch.fx.GraphModule({}, child_graph)
    g = torch.fx.Graph()
    a = g.placeholder("a")
    size = g.call_function(torch.ops.aten.sym_size.int, (a, 1))
    out = g.call_module("child", (a, size))
    first = g.call_function(operator.getitem, (out, 0))
    second = g.call_method("sum", (first,), {"dim": [0]})
    part = g.call_function(operator.getitem, (first, (slice(None), slice(0, 2))))
    g.output((second, part))
    return torch.fx.GraphModule({"child": child}, g)


def test_graphs_round_trip_as_plain_data():
    gm = _mixed_graph()
    data = pickle.loads(pickle.dumps(graph_codec.encode(gm)))
    back = graph_codec.decode(data)
    back.recompile()
    assert [(n.op, n.name, n.target) for n in back.graph.nodes] == \
        [(n.op, n.name, n.target) for n in gm.graph.nodes]
    assert [(n.op, n.name, n.target) for n in back.child.graph.nodes] == \
        [(n.op, n.name, n.target) for n in gm.child.graph.nodes]
    a = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    want, got = gm(a), back(a)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_target_without_an_importable_name_is_refused_and_the_step_saves_otherwise(caplog):
    """The codec refuses a local function; serialize_step then saves with
    GraphPickler (counted, logged), which load_step reads as before."""
    def local_fn(v):
        return v + 1

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(local_fn, (x,)))
    gm = torch.fx.GraphModule({}, g)
    with pytest.raises(graph_codec.Unencodable, match="no importable name|names another"):
        graph_codec.encode(gm)
    assert graph_codec.resolve("torch.ops.aten.mul.Tensor") is torch.ops.aten.mul.Tensor
    with pytest.raises(graph_codec.Unencodable):
        graph_codec.resolve("nosuchmodule")


# ---- through a runner ---------------------------------------------------------------------

def _engine(cache_dir, mode="full_and_piecewise", debug_checks=False, model_class=None,
            model="llama"):
    m = build_model(model, preset("tiny", num_layers=2))
    if model_class is not None:
        m.__class__ = model_class
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[1, 4, 8], piece_compiler="eager",
                               cache_dir=cache_dir, debug_checks=debug_checks)
    return Engine(m, kv_config(), cfg, "cpu", prefill_chunk=8, progress=False)


def _serve(cache_dir, prompts_list, state, want_states=None, **engine_options):
    """One engine (a new model object with `state`), several generate calls:
    (how, path, tokens per call, counters). With `want_states` (eager's
    after each call), every parameter and buffer (KV caches, convolution
    states) is compared with it after every call."""
    torch._dynamo.reset()
    cb.reset_counters()
    engine = _engine(cache_dir, **engine_options)
    engine.runner.model.load_state_dict(state)
    engine.runner.capture()
    tokens = []
    for i, prompts in enumerate(prompts_list):
        tokens.append(engine.generate(prompts, 3))
        if want_states is None:
            continue
        got, want = engine.runner.model.state_dict(), want_states[i]
        assert got.keys() == want.keys()
        for name, t in got.items():  # fp32 model: the eager op order, tight bounds
            torch.testing.assert_close(t, want[name], rtol=1e-5, atol=1e-5,
                                       msg=f"call {i}: {name}")
    return engine.runner.compiled.how, engine.runner.compiled.path, tokens, dict(cb.counters)


def _eager(prompts_list, model="llama"):
    """Eager tokens per call, the weights it started from, and its state
    (weights, caches) after each call."""
    torch._dynamo.reset()
    ref = _engine(None, mode="none", model=model)
    ref.runner.capture()
    start = {k: v.clone() for k, v in ref.runner.model.state_dict().items()}
    tokens, states = [], []
    for prompts in prompts_list:
        tokens.append(ref.generate(prompts, 3))
        states.append({k: v.clone() for k, v in ref.runner.model.state_dict().items()})
    return tokens, start, states


PROMPTS = [random_prompts([5, 9, 3], seed=11), random_prompts([7, 2], seed=12),
           random_prompts([12], seed=13)]


@pytest.mark.parametrize("model", ["llama", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_a_direct_load_equals_eager_over_several_calls_and_debug_checks_go_through_dynamo(
        tmp_path, model):
    """hybrid: its short convolutions' state buffers are graph inputs too."""
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        want, state, after = _eager(PROMPTS, model)
        runs = [_serve(str(tmp_path), PROMPTS, state, after, model=model) for _ in range(2)]
        checked = _serve(str(tmp_path / "checked"), PROMPTS, state, debug_checks=True, model=model)
        checked_warm = _serve(str(tmp_path / "checked"), PROMPTS, state, debug_checks=True,
                              model=model)
    (how0, path0, got0, c0), (how1, path1, got1, c1) = runs
    assert (how0, path0, how1, path1) == ("compiled", None, "loaded", "direct")
    assert c1["direct_loads"] == 1 and "dynamo_graphs" not in c1 and "direct_plan_refusals" not in c0
    assert got0 == want and got1 == want
    # Guards are what debug_checks asks for: the same entry kind loads through Dynamo.
    assert (checked[0], checked_warm[0], checked_warm[1]) == ("compiled", "loaded", "dynamo")
    assert checked[2] == want and checked_warm[2] == want


class CountingLlama(type(build_model("llama", preset("tiny", num_layers=1)))):
    """Its forward writes model state: Dynamo's code does more than call the graph."""

    def forward(self, input_ids, positions):
        self.calls = self.calls + 1
        return super().forward(input_ids, positions)


def test_a_forward_that_writes_state_gets_no_plan_and_loads_through_dynamo(tmp_path, caplog):
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        want, state, _ = _eager(PROMPTS)
        runs = []
        for _ in range(2):
            torch._dynamo.reset()
            cb.reset_counters()
            engine = _engine(str(tmp_path), model_class=CountingLlama)
            engine.runner.model.calls = 0
            engine.runner.model.load_state_dict(state)
            with caplog.at_level(logging.INFO, logger="compile_backend"):
                engine.runner.capture()
                tokens = [engine.generate(p, 3) for p in PROMPTS]
            runs.append((engine.runner.compiled.how, engine.runner.compiled.path, tokens,
                         dict(cb.counters), engine.runner.model.calls))
    (how0, _, got0, c0, calls0), (how1, path1, got1, c1, calls1) = runs
    assert c0["direct_plan_refusals"] == 1
    # Dynamo writes the attribute through a helper of its own (or STORE_ATTR):
    # either way its code reaches beyond gathering inputs and calling the step.
    assert "load through Dynamo, not without it: Dynamo's code does more than call the step: " \
        in caplog.text
    with open(step_cache.entry_path(str(tmp_path), _header_of(tmp_path)), "rb") as f:
        assert "direct" not in pickle.load(f)
    assert (how0, how1, path1) == ("compiled", "loaded", "dynamo")
    assert got0 == want and got1 == want
    assert calls1 > 0 and calls0 > 0  # the write still happens at every step, through Dynamo's code


def _header_of(folder):
    """The header of the only entry in `folder`."""
    (row,) = step_cache.list_entries(str(folder))
    with open(f"{step_cache.steps_dir(str(folder))}/{row['key']}{step_cache.SUFFIX}", "rb") as f:
        return pickle.load(f)["header"]


def test_a_plan_that_finds_nothing_falls_back_to_dynamo_said_and_counted(tmp_path, caplog):
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        want, state, after = _eager(PROMPTS)
        _serve(str(tmp_path), PROMPTS, state)
        header = _header_of(tmp_path)
        path = step_cache.entry_path(str(tmp_path), header)
        with open(path, "rb") as f:
            entry = pickle.load(f)
        sources = entry["direct"]["plan"]["sources"]
        i = next(i for i, s in enumerate(sources) if s.startswith("L['self']"))
        sources[i] = "L['self']._modules['no_such_layer']._parameters['weight']"
        step_cache.write_entry(path, header, entry["aot"], entry["direct"])
        with caplog.at_level(logging.WARNING, logger="compile_backend"):
            how, path_taken, got, counters = _serve(str(tmp_path), PROMPTS, state, after)
    assert (how, path_taken) == ("loaded", "dynamo")
    assert counters["direct_load_failures"] == 1 and counters["cache_hits"] == 1
    assert counters["steps_loaded"] == 1  # the plan failed before any step was loaded
    assert "not loaded without Dynamo, loading it through Dynamo: ValueError" in caplog.text
    assert "no_such_layer" in caplog.text
    assert got == want


def test_a_saved_step_holds_its_graphs_as_plain_data():
    """A runner's step saves through the codec (its load imports neither
    Dynamo nor Inductor: tests/compile/test_warm_start.py runs it in a fresh
    process); the bytes are made once per step."""
    from compile_backend.compile.compiled_step import CompiledStep, compiled_steps

    with use_graph_backend(StandInGraphs()), torch.no_grad():
        torch._dynamo.reset()
        engine = _engine(None, mode="piecewise")
        engine.runner.capture()
    step = compiled_steps()[-1]
    data = CompiledStep.serialize_compile_artifacts(step)
    assert data.startswith(step_artifacts.CODEC_MAGIC)
    assert CompiledStep.serialize_compile_artifacts(step) is data
    fields, fns = step_artifacts.load_step(data)
    assert [n.op for n in fields["split_gm"].graph.nodes] == [n.op for n in step.split_gm.graph.nodes]
    assert set(fns) == {p.name for p in step.pieces}
