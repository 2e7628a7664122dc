"""The debug dump (files and manifest schema) and `mrv2 inspect` (summary,
piece code, SVG picture)."""

import os
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn.functional as F

import compile_backend as cb
from compile_backend.demo.cli import main
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.debug.dump import (
    DumpPathError,
    depyf_dump,
    read_manifest,
    update_manifest_runtime,
    write_compile_dump,
)
from compile_backend.demo.engine import Engine
from compile_backend.demo.models import build_model, preset
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import CAPTURE_SIZES, kv_config, random_prompts

TOP_LEVEL = {
    "schema_version": int, "created": str, "versions": dict, "kernel_switches": dict,
    "config": dict, "op_roles": dict,
    "graphs": list, "runtime": (dict, type(None)), "captures": list, "metadata_builds": list,
    "fallbacks": list, "counters": dict, "depyf": dict,
}
GRAPH = {"index": int, "dir": str, "graph_mode": str, "mode_reason": (str, type(None)),
         "full_graph_without_runner": (bool, type(None)), "full_blocker": (str, type(None)),
         "compile_seconds": float, "passes_uuid": (str, type(None)), "passes": list,
         "pieces": list}
PIECE = {"index": int, "name": str, "captured": bool, "ops": list, "breakpoints": list,
         "attention_like": list, "eager_reasons": list, "inputs": list, "file": str}
PASS = {"name": str, "uuid": str, "changed": bool, "details": dict}
CAPTURE = {"graph": dict, "seconds": float, "pool_bytes": int,
           "for_capture": dict}
BUILD = {"kind": str, "for_capture": bool, "mode": str, "dummy": bool, "num_tokens": int,
         "num_reqs": int}


def _check(record, schema):
    for key, kind in schema.items():
        assert key in record, f"missing {key!r} in {sorted(record)}"
        assert isinstance(record[key], kind), (key, record[key])


def check_schema(dump):
    m = read_manifest(dump)
    _check(m, TOP_LEVEL)
    assert set(m["versions"]) == {"torch", "triton", "python"}
    assert set(m["kernel_switches"]) == {"MRV2_PDL", "MRV2_SKINNY_GEMM", "MRV2_WIDE_GEMM",
                                        "MRV2_DECODE_TWO_LAUNCH"}
    for g in m["graphs"]:
        _check(g, GRAPH)
        for name in ("graph_before_passes.py", "graph_after_passes.py", "split_graph.py"):
            assert (dump / g["dir"] / name).read_text().strip()
        for ps in g["passes"]:
            _check(ps, PASS)
        for p in g["pieces"]:
            _check(p, PIECE)
            assert "def forward" in (dump / p["file"]).read_text()
            for inp in p["inputs"]:
                assert "name" in inp and ({"shape", "symint", "value", "type"} & set(inp))
    for c in m["captures"]:
        _check(c, CAPTURE)
        assert all(isinstance(v, bool) for v in c["for_capture"].values())
    for b in m["metadata_builds"]:
        _check(b, BUILD)
    for f in m["fallbacks"]:
        assert isinstance(f["kind"], str) and isinstance(f["reason"], str)
    return m


class TwoGraphs(torch.nn.Module):
    """Linear, attention, a graph break, linear, attention: two Dynamo graphs."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def _attn(self, x):  # x [T, D] -> [1, 1, T, D]
        q = x[None, None]
        return F.scaled_dot_product_attention(q, q, q)[0, 0]

    def forward(self, x):
        x = self._attn(self.a(x))
        torch._dynamo.graph_break()
        return self._attn(self.b(x)).relu()


OPTIONS = {"piece_compiler": "eager", "cudagraph_mode": "none"}


def _compile_two_graphs(dump):
    torch.manual_seed(0)
    model = TwoGraphs()
    compiled = torch.compile(model, backend="mrv2", options={**OPTIONS, "debug_dump_path": str(dump)})
    x = torch.randn(8, 32)
    with torch.no_grad():  # inference: with grad on the graph would run uncompiled
        torch.testing.assert_close(compiled(x), model(x))


def test_backend_option_dumps_each_dynamo_graph(tmp_path):
    dump = tmp_path / "dump"
    _compile_two_graphs(dump)
    m = check_schema(dump)
    assert [g["dir"] for g in m["graphs"]] == ["graph_0", "graph_1"]
    # graph 0 ends with its attention; graph 1 has a relu after it
    assert [[p["captured"] for p in g["pieces"]] for g in m["graphs"]] == [
        [True, False], [True, False, True]]
    for g in m["graphs"]:
        assert g["pieces"][1]["breakpoints"] == ["aten::scaled_dot_product_attention"]
    assert (dump / "graph_1" / "pieces" / "piece_2.py").exists()
    assert m["config"]["debug_dump_path"] == str(dump)
    assert m["counters"]["dynamo_graphs"] == 2
    assert m["depyf"]["written"] is False and "depyf_dump" in m["depyf"]["note"]
    assert not [p for p in dump.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_symbolic_input_shapes_recorded(tmp_path):
    dump = tmp_path / "dump"
    model = TwoGraphs()
    compiled = torch.compile(model, backend="mrv2", dynamic=True,
                             options={**OPTIONS, "debug_dump_path": str(dump)})
    with torch.no_grad():
        compiled(torch.randn(8, 32))
    inputs = read_manifest(dump)["graphs"][0]["pieces"][0]["inputs"]
    shapes = [i["shape"] for i in inputs if "shape" in i]
    assert ["32", "32"] in shapes  # a weight
    assert any(s[0].startswith("s") and s[1] == "32" for s in shapes)  # [T, 32], T symbolic


def test_depyf_dump_context_writes_depyf_output(tmp_path):
    dump = tmp_path / "dump"
    with depyf_dump(dump):
        _compile_two_graphs(dump)
    m = check_schema(dump)
    assert m["depyf"] == {"dir": "depyf", "written": True, "note": None}
    assert any(p.suffix == ".py" for p in (dump / "depyf").iterdir())


def test_second_run_starts_a_new_manifest(tmp_path):
    from compile_backend.debug.dump import reset_dump

    dump = tmp_path / "dump"
    with depyf_dump(dump):
        _compile_two_graphs(dump)
    (dump / "step.svg").write_text("<svg/>")  # what `mrv2 inspect` draws there
    (dump / "notes.txt").write_text("mine")  # not the dump's: left alone
    torch._dynamo.reset()
    reset_dump(dump)
    _compile_two_graphs(dump)  # a new run, without depyf
    assert len(read_manifest(dump)["graphs"]) == 2
    assert read_manifest(dump)["depyf"]["written"] is False
    assert not (dump / "depyf").exists() and not (dump / "step.svg").exists()
    assert (dump / "notes.txt").read_text() == "mine"


def test_dump_path_that_is_a_file_raises_and_writes_nothing(tmp_path):
    f = tmp_path / "file"
    f.write_text("keep")
    with pytest.raises(DumpPathError, match="existing file"):
        write_compile_dump(f, object())
    with pytest.raises(DumpPathError, match="is a file"):
        write_compile_dump(f / "sub", object())
    assert f.read_text() == "keep" and sorted(tmp_path.iterdir()) == [f]


@pytest.fixture
def runtime_dump(tmp_path, monkeypatch):
    """A tiny hybrid engine in mode PIECEWISE (CPU graph stand-in), dumped."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dump = tmp_path / "dump"
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        cfg = cb.CompilationConfig(cudagraph_mode="piecewise", capture_sizes=CAPTURE_SIZES,
                                   piece_compiler="eager", debug_dump_path=str(dump))
        model = build_model("hybrid", preset("tiny", num_layers=2))
        # prefill_chunk=64: a 45-token first step, larger than every capture size
        engine = Engine(model, kv_config(), cfg, "cpu", prefill_chunk=64, progress=False)
        engine.runner.capture()
        update_manifest_runtime(dump, engine.runner)
        engine.generate(random_prompts([5, 40]), max_new_tokens=3)
        update_manifest_runtime(dump, engine.runner)
    return dump, engine


def test_runtime_captures_builds_and_fallbacks_merged(runtime_dump):
    dump, engine = runtime_dump
    m = check_schema(dump)
    assert m["runtime"]["mode"] == "piecewise"
    assert len(m["captures"]) == len(engine.runner.captures) == 6
    assert {c["graph"]["num_tokens"] for c in m["captures"]} == {1, 2, 4, 8, 16, 32}
    # Note [why PIECEWISE still builds metadata]: built at every capture, not for_capture
    assert all(c["for_capture"] and not any(c["for_capture"].values()) for c in m["captures"])
    assert len(m["metadata_builds"]) == len(engine.runner.model_state.build_log)
    assert m["counters"]["cudagraph_captures"] > 0
    eager = [f for f in m["fallbacks"] if f["kind"] == "eager_no_graph"]
    assert eager and eager[0]["count"] == m["counters"]["eager_no_graph"]  # 45-token prefill


def test_a_runners_dump_holds_depyfs_decompiled_code(runtime_dump):
    """The runner's step is AOT-compiled, which depyf's hook does not see:
    the dump still has depyf's full_code_for_* file, Dynamo's code decompiled
    (it calls the backend's compiled function), and the manifest names it."""
    dump, _ = runtime_dump
    files = sorted((dump / "depyf").glob("full_code_for_*.py"))
    assert [f.name for f in files] == ["full_code_for_forward_0.py"]
    text = files[0].read_text()
    assert "decompiled by depyf" in text and "__compiled_fn" in text
    compile(text, str(files[0]), "exec")  # it is Python
    m = check_schema(dump)
    assert m["depyf"]["written"] and m["depyf"]["files"] == ["full_code_for_forward_0.py"]


def test_inspect_summary_piece_and_svg(runtime_dump, capsys):
    dump, engine = runtime_dump
    assert main(["inspect", str(dump)]) == 0
    out = capsys.readouterr().out
    assert not (dump / "step.svg").exists() and "picture:" not in out  # only with --svg
    assert "runtime: ModelRunner: mode piecewise" in out
    assert f"replays: {read_manifest(dump)['counters']['cudagraph_replays']}" in out
    assert main(["inspect", str(dump), "--svg"]) == 0
    assert f"picture: {dump / 'step.svg'}" in capsys.readouterr().out
    m = read_manifest(dump)
    pieces = m["graphs"][0]["pieces"]
    for p in pieces:
        role = "captured" if p["captured"] else "eager"
        assert f"piece {p['index']:<3} {role}" in out
    graphs = m["counters"]["cudagraph_captures"]
    assert f"captures (6; {graphs} graphs):" in out and "piecewise  tokens=32" in out
    assert "eager_no_graph" in out

    root = ET.parse(dump / "step.svg").getroot()
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect")
             if r.get("class", "").startswith("segment")]
    assert len(rects) == len(pieces)
    assert [r.get("class") == "segment captured" for r in rects] == [p["captured"] for p in pieces]
    widths = {len(p["ops"]): float(r.get("width")) for p, r in zip(pieces, rects)}
    assert widths[max(widths)] > widths[min(widths)]  # sized by op count

    eager = next(p for p in pieces if not p["captured"])
    assert main(["inspect", str(dump), "--piece", str(eager["index"])]) == 0
    code = capsys.readouterr().out
    assert "def forward" in code and "unified_attention" in code
    # the ops as the model wrote them, not the direct calls eager pieces make
    assert "torch.ops.mrv2.unified_attention(" in code and "direct_" not in code

    out_svg = dump.parent / "picture.svg"
    assert main(["inspect", str(dump), "--svg", str(out_svg)]) == 0
    assert ET.parse(out_svg).getroot().tag.endswith("svg")


def test_inspect_bad_inputs(tmp_path, capsys):
    for argv in (["inspect", str(tmp_path / "missing")], ["inspect", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a debug dump" in err[0]
    dump = tmp_path / "dump"
    _compile_two_graphs(dump)
    assert main(["inspect", str(dump), "--piece", "99"]) == 2
    assert "no piece 99" in capsys.readouterr().err
    (dump / "manifest.json").write_text("{not json")
    assert main(["inspect", str(dump)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_inspect_names_ops_as_users_write_them_and_says_when_nothing_is_captured(tmp_path, capsys):
    from compile_backend.debug.inspector import display_name

    assert display_name("torch._VariableFunctionsClass.rsqrt") == "aten.rsqrt"
    assert display_name("torch._C._nn.linear") == "aten.linear"
    assert display_name("_operator.mul") == "mul"
    assert display_name("python::getitem") == "getitem"
    assert display_name("mrv2::unified_attention") == "mrv2.unified_attention"
    dump = tmp_path / "dump"
    model = TwoGraphs()
    compiled = torch.compile(model, backend="mrv2", options={
        **OPTIONS, "cudagraph_mode": "none", "debug_dump_path": str(dump)})
    with torch.no_grad():
        compiled(torch.randn(8, 32))
    assert main(["inspect", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "captured" not in out.replace("captures", "") and "eager (mode none)" in out
    assert "_VariableFunctionsClass" not in out and "_operator" not in out


class FullSDPA(torch.nn.Module):
    """Linear, SDPA, a state write: without a runner, one FULL graph in FULL."""

    def __init__(self, d=32):
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.register_buffer("state", torch.zeros(d))

    def forward(self, x):
        q = self.a(x)[None, None]
        h = F.scaled_dot_product_attention(q, q, q)[0, 0]
        self.state.add_(h.mean(0))
        return h.relu() + self.state


def _plain_run(dump, mode, calls=5):
    """A plain torch.compile run (no runner) with the stand-in, dumped."""
    model = FullSDPA()
    compiled = torch.compile(model, backend="mrv2", options={
        "piece_compiler": "eager", "cudagraph_mode": mode, "debug_dump_path": str(dump)})
    with cb.standin_graphs(), torch.no_grad():
        for _ in range(calls):
            compiled(torch.randn(8, 32))
    return compiled


def test_inspect_plain_full_run_shows_the_pieces_inside_one_full_graph(tmp_path, capsys):
    dump = tmp_path / "dump"
    compiled = _plain_run(dump, "full")
    m = check_schema(dump)
    (g,) = m["graphs"]
    assert g["full_graph_without_runner"] is True and g["full_blocker"] is None
    assert m["runtime"] is None  # written at compile time, before any call ran

    assert main(["inspect", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "runtime: not recorded" in out and "update_manifest_runtime(DIR)" in out
    assert "captures: not recorded" in out and "captures: none" not in out
    assert "the whole graph is one FULL graph" in out
    pieces = [line for line in out.splitlines() if line.lstrip().startswith("piece ")]
    assert len(pieces) == len(g["pieces"]) and all("in FULL graph" in p for p in pieces)
    assert not any(" eager " in p for p in pieces)  # the SDPA piece too: it is inside the graph

    m = update_manifest_runtime(dump)  # plain run: what it captured and replayed
    rt = m["runtime"]
    assert rt["runner"] is False and rt["mode"] == "full" and rt["recorded"] == "by update_manifest_runtime"
    assert rt["graphs_held"] == [{"graph": 0, "full": 1, "pieces": 0, "full_blocker": None}]
    assert m["counters"]["cudagraph_captures"] == 1 and m["counters"]["cudagraph_replays"] == 4
    assert main(["inspect", str(dump), "--svg"]) == 0
    out = capsys.readouterr().out
    assert "plain torch.compile, no runner (recorded by update_manifest_runtime)" in out
    assert "1 captured, 4 replays, 1 warm-up calls; graphs held" in out and "graph 0: 1 FULL" in out
    rects = [r for r in ET.parse(dump / "step.svg").getroot().iter("{http://www.w3.org/2000/svg}rect")
             if r.get("class", "").startswith("segment")]
    assert {r.get("class") for r in rects} == {"segment full"}
    del compiled


def test_plain_run_runtime_is_written_at_exit_and_never_over_a_runner(tmp_path, runtime_dump):
    from compile_backend.debug import dump as dump_module

    plain = tmp_path / "plain"
    _plain_run(plain, "piecewise")
    runner_dump, _ = runtime_dump
    before = read_manifest(runner_dump)["runtime"]
    dump_module._record_plain_runs_at_exit(os.getpid())  # what atexit calls
    rt = read_manifest(plain)["runtime"]
    assert rt["runner"] is False and rt["recorded"] == "at process exit"
    assert rt["graphs_held"][0]["pieces"] > 0  # the captured pieces' graphs
    assert read_manifest(runner_dump)["runtime"] == before  # a runner's report stays
    dump_module._record_plain_runs_at_exit(os.getpid() + 1)  # a forked child writes nothing
    with pytest.raises(ValueError, match="pass the runner"):
        update_manifest_runtime(runner_dump)


def test_inspect_mode_none_draws_every_piece_eager(tmp_path, capsys):
    dump = tmp_path / "dump"
    _compile_two_graphs(dump)  # mode none: pieces that would be captured run eagerly
    assert main(["inspect", str(dump), "--svg", str(tmp_path / "s.svg")]) == 0
    out = capsys.readouterr().out
    assert "(3 eager)" in out and "captured" not in out.replace("captures", "")
    root = ET.parse(tmp_path / "s.svg").getroot()
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text") if t.text and ":" in t.text
              and t.text.split(":")[0].isdigit()]
    assert labels and all(t.endswith(":E") for t in labels), labels  # never C in mode none
    assert {r.get("class") for r in root.iter("{http://www.w3.org/2000/svg}rect")
            if r.get("class", "").startswith("segment")} == {"segment eager"}


@pytest.mark.slow  # a subprocess
def test_plain_run_in_its_own_process_is_inspected_with_its_replays(tmp_path, capsys):
    """The newcomer's path: a script compiles and calls, exits; inspect then
    shows what was captured and replayed."""
    import subprocess
    import sys

    dump = tmp_path / "dump"
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\nimport torch\nimport torch.nn.functional as F\n\n"
        "model = torch.nn.Linear(32, 32)\n"
        "def step(x):\n"
        "    q = model(x)[None, None]\n"
        "    return F.scaled_dot_product_attention(q, q, q)[0, 0]\n\n"
        "compiled = torch.compile(step, backend='mrv2', options={'cudagraph_mode': 'full', "
        "'piece_compiler': 'eager', 'debug_dump_path': sys.argv[1]})\n"
        "import compile_backend\n"
        "with compile_backend.standin_graphs(), torch.no_grad():\n"
        "    for _ in range(7):\n"
        "        compiled(torch.randn(8, 32))\n")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(script), str(dump)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert main(["inspect", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "recorded at process exit" in out and "1 captured, 6 replays" in out
