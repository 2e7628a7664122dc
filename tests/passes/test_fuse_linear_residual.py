"""`residual + linear(x, w, b)` becomes one `mrv2::linear_add`
(compile_backend/passes/fuse_linear_residual.py): where the pass fires (on a Dynamo graph
directly and through the backend), where it must not, and compiled runs
against eager after every call, through torch.compile and through the
runner. fp32 on the CPU (the op runs `addmm` there); compared with eager at
atol=rtol=1e-5 (one rounding of the residual add moves)."""

import logging
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_backend as cb
import compile_backend.kernels  # noqa: F401  (registers mrv2::linear_add)
import pass_ops  # noqa: F401  (registers passtest::host_read)
from fx_helpers import calls, dynamo_graph
from compile_backend.compile.compiled_step import CompiledStep
from compile_backend.compile.step_artifacts import serialize_step
from compile_backend.core.op_registry import EAGER_REASON
from compile_backend.demo.engine import Engine
from compile_backend.demo.models import build_model, preset
from compile_backend.passes import FuseLinearResidualPass, PassManager
from compile_backend.passes import fuse_linear_residual
from compile_backend.passes.fuse_linear_residual import fused_pairs
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from compile_backend.testing import check_against_eager
from backend_models import small_hf_llama
from runtime_helpers import (  # noqa: F401  (_torch_reference_kernels: autouse fixture)
    CAPTURE_SIZES, _torch_reference_kernels, kv_config, random_prompts, random_schedule,
)

D = 16
LINEAR_ADD = torch.ops.mrv2.linear_add.default


class HFLikeBlock(nn.Module):
    """Hugging Face Llama's residual adds: `x + o_proj(...)`, `h + down_proj(...)`.
    `linear_first`: `o_proj(...) + x` and `torch.add(down_proj(...), h)`."""

    def __init__(self, bias=False, linear_first=False):
        super().__init__()
        self.linear_first = linear_first
        self.q_proj = nn.Linear(D, 2 * D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(2 * D, D, bias=bias)
        self.gate_proj = nn.Linear(D, 3 * D, bias=False)
        self.up_proj = nn.Linear(D, 3 * D, bias=False)
        self.down_proj = nn.Linear(3 * D, D, bias=bias)

    def forward(self, x):  # [T, D]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        T = x.shape[0]
        att = torch.softmax(q.view(T, 2, D) @ k.view(T, D, 1), dim=1)  # [T, 2, 1]
        o = self.o_proj((att * v.view(T, 1, D)).reshape(T, 2 * D))
        h = o + x if self.linear_first else x + o
        d = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return torch.add(d, h) if self.linear_first else h + d


class Residual(nn.Module):
    """The smallest pattern: `x + o(x)`, with a sin between the two."""

    def __init__(self):
        super().__init__()
        self.o = nn.Linear(D, D)

    def forward(self, x):
        y = self.o(x)
        s = torch.sin(x)
        return (x + y) * s


# ---- where it must not fire: each returns what eager returns ----------------------


class _One(nn.Module):
    def __init__(self):
        super().__init__()
        self.o = nn.Linear(D, D)


class UsedTwice(_One):
    def forward(self, x):
        y = self.o(x)
        return (x + y) * y


class Broadcast(_One):
    def __init__(self):
        super().__init__()
        self.r = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return self.r + self.o(x)  # [D] + [T, D]


class Scalar(_One):
    def forward(self, x):
        return self.o(x) + 1.5


class DtypeMismatch(_One):
    def forward(self, x):
        return x.double() + self.o(x)  # float64 + float32


class Alpha(_One):
    def forward(self, x):
        return torch.add(x, self.o(x), alpha=2)


class WriteBetween(_One):
    """The linear's input is written between the linear and the add: moving
    the linear to the add would read the new values."""

    def forward(self, x):
        h = x * 2
        y = self.o(h)
        h.mul_(3)
        return h + y


class EagerBetween(_One):
    """An op the capture-safety pass marks eager sits between them."""

    def forward(self, x):
        y = self.o(x)
        s = torch.ops.passtest.host_read(x)
        return s + y


class ComputedWeight(_One):
    def forward(self, x):
        return x + F.linear(x, self.o.weight * 2)


NOT_FIRING = [
    (UsedTwice, "2 users"),
    (Broadcast, "broadcasts"),
    (Scalar, "not a tensor (float)"),
    (DtypeMismatch, "dtypes differ"),
    (Alpha, "keyword arguments (alpha)"),
    (WriteBetween, "`Tensor.mul_` (mul_) between"),
    (EagerBetween, "`passtest::host_read` (s) between"),
    (ComputedWeight, "not a 2-D graph input"),
]


# ---- helpers -------------------------------------------------------------------------


def _compile(model, **options):
    # the residual-norm pass would take the linear_adds a norm_linear reads
    options = {"fuse_residual_norm": False, **options}
    return torch.compile(model, backend=cb.backend(
        cudagraph_mode="none", piece_compiler="eager", **options))


def _entry(step):
    (entry,) = [e for e in step.pass_log if e["pass"] == "FuseLinearResidualPass"]
    return entry


def _weights(pairs):
    """Module names of the fused linears' weights (`o_proj`, `down_proj`)."""
    return [p["weight"].split("_modules_")[-1].split("_parameters")[0] for p in pairs]


def _run_and_compare(model, compiled, sizes=(3, 1, 5, 8)):
    for t in sizes:
        x = torch.randn(t, D)
        torch.testing.assert_close(compiled(x.clone()), model(x.clone()), atol=1e-5, rtol=1e-5)


def _apply(gm, **kw):
    report = FuseLinearResidualPass(cb.OpRegistry(), **kw)(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return report


# ---- where it fires ---------------------------------------------------------------------


@pytest.mark.parametrize("linear_first", [False, True], ids=["residual_first", "linear_first"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fires_on_a_dynamo_graph_and_computes_the_same(bias, linear_first, caplog):
    torch.manual_seed(0)
    model = HFLikeBlock(bias=bias, linear_first=linear_first).eval()
    x = torch.randn(5, D)
    gm, inputs = dynamo_graph(model, x)
    with caplog.at_level(logging.INFO, logger=fuse_linear_residual.__name__):
        report = _apply(gm)
    assert report.changed and report.details["enabled"] and report.details["num_fused"] == 2
    fused = report.details["fused"]
    assert _weights(fused) == ["o_proj", "down_proj"]
    assert all((f["bias"] is not None) == bias for f in fused)
    assert all(f["source"].startswith("test_fuse_linear_residual.py:") for f in fused)
    assert report.details["not_fused"] == []
    # Two linear_adds with the weights as graph inputs; q/k/v and gate/up stay linears.
    adds = calls(gm, LINEAR_ADD)
    assert [n.args[1].name for n in adds] == [f["weight"] for f in fused]
    linears = [n.args[1].name for n in calls(gm, torch._C._nn.linear)]
    assert len(linears) == 5 and not {f["weight"] for f in fused} & set(linears)
    assert all(isinstance(n.meta["example_value"], torch.Tensor) for n in adds)
    assert "fused 2 linear + residual add(s)" in caplog.text
    assert cb.counters["pass_linear_residual_fused"] == 2
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fires_through_the_backend(bias):
    torch.manual_seed(1)
    model = HFLikeBlock(bias=bias).eval()
    compiled = _compile(model)
    with torch.no_grad():
        _run_and_compare(model, compiled)
    step = cb.compiled_steps()[-1]
    assert _weights(fused_pairs(step.pass_log)) == ["o_proj", "down_proj"]
    assert step.passed_code.count("torch.ops.mrv2.linear_add.default(") == 2
    assert "mrv2.linear_add" not in step.original_code
    assert "mrv2.sibling_linear" in step.passed_code  # q/k/v, gate/up: the sibling pass's


def test_a_saved_step_with_linear_add_loads_and_runs():
    torch.manual_seed(7)
    model = HFLikeBlock(bias=True).eval()
    compiled = _compile(model)
    x = torch.randn(4, D)
    with torch.no_grad():
        compiled(x)
        step = cb.compiled_steps()[-1]
        assert fused_pairs(step.pass_log)
        loaded = CompiledStep.deserialize_compile_artifacts(serialize_step(step))
        names = [n.target for n in step.split_gm.graph.nodes if n.op == "placeholder"]
        by_name = {"L_self_modules_{}_parameters_{}_".format(*n.rsplit(".", 1)): p
                   for n, p in model.named_parameters()}
        out = loaded(*[x if n == "L_x_" else by_name[n] for n in names])
        torch.testing.assert_close(out[0], model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("marked", ["linear", "add", "between"])
def test_nodes_marked_eager_are_not_fused(marked):
    torch.manual_seed(2)
    model = Residual().eval()
    x = torch.randn(4, D)
    gm, inputs = dynamo_graph(model, x)
    (linear,) = calls(gm, torch._C._nn.linear)
    (add,) = calls(gm, operator.add)
    (sin,) = calls(gm, torch.sin)
    node = {"linear": linear, "add": add, "between": sin}[marked]
    node.meta[EAGER_REASON] = "marked by the test"
    before = str(gm.graph)
    report = _apply(gm)
    assert not report.changed and str(gm.graph) == before
    (why,) = report.details["not_fused"]
    want = {"linear": "the linear runs eagerly", "add": "the add runs eagerly",
            "between": f"`torch.sin` ({sin.name}) between the linear and the add"}[marked]
    assert (why["linear"], why["add"]) == (linear.name, add.name) and want in why["reason"]
    # Unmarked, the same graph fuses.
    del node.meta[EAGER_REASON]
    assert _apply(gm).changed and calls(gm, LINEAR_ADD)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


def test_without_the_op_the_graph_is_unchanged_and_the_report_says_why(monkeypatch):
    gm, _ = dynamo_graph(Residual().eval(), torch.randn(4, D))
    monkeypatch.setattr(FuseLinearResidualPass, "fused_op", lambda self: None)
    before = str(gm.graph)
    report = _apply(gm)
    assert not report.changed and str(gm.graph) == before
    (why,) = report.details["not_fused"]
    assert "mrv2::linear_add is not registered" in why["reason"]
    assert cb.counters["pass_linear_residual_fused"] == 0


# ---- where it must not fire ---------------------------------------------------------------


@pytest.mark.parametrize("cls, reason", NOT_FIRING, ids=[c.__name__ for c, _ in NOT_FIRING])
def test_does_not_fire(cls, reason):
    torch.manual_seed(3)
    model = cls().eval()
    compiled = _compile(model)
    with torch.no_grad():
        _run_and_compare(model, compiled, sizes=(3, 5))
    step = cb.compiled_steps()[-1]
    entry = _entry(step)
    assert not entry["changed"] and entry["details"]["fused"] == []
    assert "linear_add" not in step.passed_code
    reasons = [n["reason"] for n in entry["details"]["not_fused"]]
    assert len(reasons) == 1 and reason in reasons[0], reasons


def test_switched_off():
    torch.manual_seed(4)
    model = HFLikeBlock(bias=True).eval()
    compiled = _compile(model, fuse_linear_residual=False)
    with torch.no_grad():
        _run_and_compare(model, compiled, sizes=(3, 2))
    step = cb.compiled_steps()[-1]
    assert _entry(step)["details"] == {"enabled": False, "fused": [], "not_fused": []}
    assert "linear_add" not in step.passed_code
    assert cb.counters["pass_linear_residual_fused"] == 0


def test_the_option_validates_and_changes_the_uuid():
    with pytest.raises(ValueError, match="fuse_linear_residual must be True or False"):
        cb.CompilationConfig(fuse_linear_residual=1)
    with pytest.raises(ValueError, match="fuse_linear_residual must be True or False"):
        cb.CompilationConfig.from_options({"fuse_linear_residual": "no"})
    assert cb.CompilationConfig().fuse_linear_residual is True
    off = cb.CompilationConfig.from_options({"fuse_linear_residual": False})
    assert off.summary()["fuse_linear_residual"] is False  # in the compile cache's key
    roles = cb.OpRegistry()
    on_pass, off_pass = FuseLinearResidualPass(roles), FuseLinearResidualPass(roles, enabled=False)
    assert on_pass.settings() == {"enabled": True} and off_pass.settings() == {"enabled": False}
    assert on_pass.uuid() == FuseLinearResidualPass(roles).uuid() != off_pass.uuid()
    managers = [PassManager.from_config(c, cb.OpRegistry.from_config(c))
                for c in (cb.CompilationConfig(), off)]
    assert managers[0].uuid() != managers[1].uuid()


# ---- against eager after every call ---------------------------------------------------------


@pytest.mark.filterwarnings("error::compile_backend.testing.NothingCapturedWarning")
@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_torch_compile_with_standin_graphs_equals_eager_after_every_call(mode):
    torch.manual_seed(5)
    model = HFLikeBlock(bias=True).eval()
    calls = [(torch.randn(t, D),) for t in (4, 4, 4, 2, 2, 2, 1, 1, 1, 4)]
    check_against_eager(model, calls, modes=(mode,), sessions=2, standin=True,
                        options={"piece_compiler": "eager"})
    steps = cb.compiled_steps()
    assert steps and all(_weights(fused_pairs(s.pass_log)) == ["o_proj", "down_proj"]
                         for s in steps)


def _llama_tokens(mode, sessions, fuse, layers=4):
    """Tokens of each session (one generate call each, on one engine) over the
    reference llama (CPU stand-in graphs), and the counters of its compile."""
    torch._dynamo.reset()
    cb.reset_counters()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        model = build_model("llama", preset("tiny", num_layers=layers))
        cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=CAPTURE_SIZES,
                                   piece_compiler="eager", fuse_linear_residual=fuse)
        engine = Engine(model, kv_config(), cfg, "cpu", prefill_chunk=8, progress=False)
        engine.runner.capture()
        return [engine.generate(prompts, 6) for prompts in sessions], dict(cb.counters)


@pytest.mark.slow  # four engines, each compiled and captured
def test_reference_llama_through_the_engine_fuses_o_and_down_and_matches_unfused():
    """The reference llama's residual adds (`x + o_proj(...)`, `h + down(...)`):
    two per layer fused, identical layers still share one compiled piece,
    and every session's tokens equal those of an eager engine without fusion."""
    sessions = [random_prompts([5, 9, 3], seed=0), random_prompts([2, 7], seed=1),
                random_prompts([4, 4, 6, 1], seed=2)]
    want, _ = _llama_tokens("none", sessions, fuse=False)
    _, unfused = _llama_tokens("piecewise", sessions, fuse=False)
    assert unfused.get("pass_linear_residual_fused", 0) == 0
    for mode in ("piecewise", "full_and_piecewise"):
        got, counters = _llama_tokens(mode, sessions, fuse=True)
        assert got == want, mode
        pairs = fused_pairs(cb.compiled_steps()[-1].pass_log)
        assert _weights(pairs) == ["o_proj", "down"] * 4  # per layer
        assert counters["pass_linear_residual_fused"] >= 8
        assert counters["piece_compile_reuses"] == unfused["piece_compile_reuses"] > 0


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_reference_llama_runner_equals_eager_after_every_step(mode):
    """Logits of every step of a random mixed prefill/decode schedule, against
    an eager runner (no passes), with the stand-in graphs."""
    model = build_model("llama", preset("tiny", num_layers=2))
    kv = kv_config(num_blocks=20, max_num_tokens=32)  # blocks 1..16: random_schedule's
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cpu")
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[1, 2, 4, 8],
                               piece_compiler="eager")
    runner = ModelRunner(model, kv, cfg, "cpu", progress=False)
    report = check_against_eager(runner, list(random_schedule(seed=6, steps=8)), modes=[mode],
                                 standin=True)
    assert report[mode].replays > 0
    assert _weights(fused_pairs(cb.compiled_steps()[-1].pass_log)) == ["o_proj", "down"] * 2


def test_unmodified_hf_llama_on_the_cpu_fuses_and_equals_eager():
    """An unmodified transformers LlamaForCausalLM (fp32, eager pieces, stand-in
    graphs): o_proj and down_proj of every layer fused."""
    model = small_hf_llama(2, hidden=64, heads=4, kv_heads=2, vocab=128)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (1, t), generator=g) for t in (6, 6, 6, 1, 1, 1)]
    calls = [lambda m, i=i: m(i, use_cache=False).logits for i in ids]
    check_against_eager(model, calls, modes=("piecewise",), standin=True,
                        options={"piece_compiler": "eager"})
    pairs = [p for s in cb.compiled_steps() for p in fused_pairs(s.pass_log)]
    assert len(pairs) >= 4 and {"o_proj", "down_proj"} <= set(_weights(pairs))


# ---- GPU --------------------------------------------------------------------------------------


def _hf_llama_bf16(layers=2):
    return small_hf_llama(layers, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_hf_llama_bf16_inductor_linear_add_equals_eager_on_the_gpu(mode, monkeypatch, caplog):
    """FULL and PIECEWISE replays of an unmodified HF Llama, its o_proj and
    down_proj fused with their residual adds into mrv2::linear_add, against
    eager in bf16 (Inductor pieces). MRV2_SKINNY_GEMM=1: the Triton kernel
    runs at decode even where it would not fill the GPU."""
    monkeypatch.setenv("MRV2_SKINNY_GEMM", "1")
    model = _hf_llama_bf16()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 256, (1, t), generator=g).cuda() for t in (8, 8, 8, 1, 1, 1, 1)]
    calls = [lambda m, i=i: m(i, use_cache=False).logits for i in ids]
    with caplog.at_level(logging.INFO):
        check_against_eager(model, calls, modes=(mode,), atol=2e-2, rtol=2e-2,
                            options={"piece_compiler": "inductor"})
    pairs = [p for s in cb.compiled_steps() for p in fused_pairs(s.pass_log)]
    assert len(pairs) >= 4  # o_proj and down_proj per layer
    assert {"o_proj", "down_proj"} <= set(_weights(pairs))
    assert any("mrv2.linear_add" in s.passed_code for s in cb.compiled_steps())
