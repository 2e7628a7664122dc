"""An RMSNorm, the linear(s) reading it and a SwiGLU gate become one
`mrv2::norm_linear` (compile_backend/passes/fuse_norm_linear.py): where the pass fires (on a
Dynamo graph directly and through the backend), where it must not, and
compiled runs against eager after every call, through torch.compile, the
runner and an unmodified HF Llama. fp32 on the CPU (the op runs the torch
reference there, op by op as eager does); compared with eager at
atol=rtol=1e-5."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_backend as cb
import compile_backend.kernels  # noqa: F401  (registers mrv2::norm_linear)
import pass_ops  # noqa: F401  (registers passtest::host_read)
from fx_helpers import calls, dynamo_graph
from compile_backend.core.op_registry import EAGER_REASON
from compile_backend.demo.models import build_model, preset
from compile_backend.passes import FuseNormLinearPass, PassManager
from compile_backend.passes import fuse_norm_linear
from compile_backend.passes.fuse_norm_linear import fused_norm_linears
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.testing import check_against_eager
from backend_models import small_hf_llama
from runtime_helpers import (  # noqa: F401  (_torch_reference_kernels: autouse fixture)
    _torch_reference_kernels, kv_config, random_schedule,
)

D = 16
NORM_LINEAR = torch.ops.mrv2.norm_linear.default


class HFNorm(nn.Module):
    """transformers' LlamaRMSNorm: `weight * (a * rsqrt(...)).to(dtype)`."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(D))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        a = x.to(torch.float32)
        v = a.pow(2).mean(-1, keepdim=True)
        return self.weight * (a * torch.rsqrt(v + self.eps)).to(dtype)


class RefNorm(HFNorm):
    """The reference models' RMSNorm: `x.float()`, weight on the right."""

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Block(nn.Module):
    """A Llama layer's projections: norm -> q/k/v, norm -> gate/up -> SiLU·mul
    -> down. `packed`: one gate_up linear split by chunk (the reference
    models); else gate_proj and up_proj apart (HF: the sibling pass packs
    them)."""

    def __init__(self, norm=HFNorm, packed=False, bias=False):
        super().__init__()
        self.packed = packed
        self.n1, self.n2 = norm(), norm(eps=1e-5)
        self.q_proj = nn.Linear(D, 2 * D, bias=bias)
        self.k_proj = nn.Linear(D, D, bias=bias)
        self.v_proj = nn.Linear(D, D, bias=bias)
        self.o_proj = nn.Linear(2 * D, D, bias=False)
        if packed:
            self.gate_up = nn.Linear(D, 6 * D, bias=bias)
        else:
            self.gate_proj = nn.Linear(D, 3 * D, bias=bias)
            self.up_proj = nn.Linear(D, 3 * D, bias=bias)
        self.down_proj = nn.Linear(3 * D, D, bias=False)

    def forward(self, x):  # [T, D]
        h = self.n1(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        T = x.shape[0]
        att = torch.softmax(q.view(T, 2, D) @ k.view(T, D, 1), dim=1)  # [T, 2, 1]
        x = x + self.o_proj((att * v.view(T, 1, D)).reshape(T, 2 * D))
        h = self.n2(x)
        if self.packed:
            g, u = self.gate_up(h).chunk(2, dim=-1)
        else:
            g, u = self.gate_proj(h), self.up_proj(h)
        return x + self.down_proj(F.silu(g) * u)


# ---- where it must not fire (or only in part): each returns what eager returns ------------


class NormUsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.n, self.o = HFNorm(), nn.Linear(D, D)

    def forward(self, x):
        h = self.n(x)
        return self.o(h) * h


class WriteBetween(NormUsedTwice):
    """The norm's input is written between the norm and the linear: the fused
    node, which reads it at the linear's place, would see the new values."""

    def forward(self, x):
        x = x * 2
        h = self.n(x)
        x.mul_(3)
        return self.o(h) * x  # not `+`: the residual pass would take that linear


class EagerBetween(NormUsedTwice):
    def forward(self, x):
        h = self.n(x)
        s = torch.ops.passtest.host_read(x)
        return self.o(h) * s


class CastElsewhere(nn.Module):
    """Casts the normalized fp32 value to float16, not back to x's dtype
    (float32): weight and linear in float16."""

    def __init__(self):
        super().__init__()
        self.n, self.o = HFNorm().half(), nn.Linear(D, D).half()

    def forward(self, x):
        a = x.to(torch.float32)
        h = self.n.weight * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
            torch.float16)
        return self.o(h).float()


class GeluGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(D, 2 * D)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return F.gelu(g) * u


class SiluGate(GeluGate):
    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return u * F.silu(g)  # the product's operands the other way round


class SiluUsedTwice(GeluGate):
    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        s = F.silu(g)
        return s * u + s


NOT_FIRING = [
    (NormUsedTwice, "norm", "the norm's output has 2 users"),
    (WriteBetween, "norm", "`Tensor.mul_` (mul_) between the norm and the linear"),
    (EagerBetween, "norm", "`passtest::host_read` (s) between the norm and the linear"),
    (CastElsewhere, "norm", "casts to torch.float16, not to its input's dtype torch.float32"),
    (GeluGate, "gate", "gelu`, not silu"),
    (SiluUsedTwice, "gate", "other users than their product"),
]


# ---- helpers -------------------------------------------------------------------------------


def _compile(model, **options):
    # fuse_norm_linear: the default, named for the tests that read it; the
    # residual pass after it would take the norm_linears that read a linear_add
    options = {"fuse_norm_linear": True, "fuse_residual_norm": False, **options}
    return torch.compile(model, backend=cb.backend(
        cudagraph_mode="none", piece_compiler="eager", **options))


def _entry(step):
    (entry,) = [e for e in step.pass_log if e["pass"] == "FuseNormLinearPass"]
    return entry


def _module(name):
    """`q_proj` of `L_self_modules_q_proj_parameters_weight_`."""
    return name.split("_modules_")[-1].split("_parameters")[0]


def _summary(fused):
    """(first weight's module, fused a norm, gated) per fused group."""
    return [(_module(f["weights"][0]), f["norm"] is not None, f["gated"]) for f in fused]


def _passes(gm, **kw):
    """The sibling pass (q/k/v, gate/up), then this one, as the manager runs them."""
    config = cb.CompilationConfig(fuse_linear_residual=False, fuse_norm_linear=True, **kw)
    roles = cb.OpRegistry.from_config(config)
    manager = PassManager.from_config(config, roles)
    manager(gm.graph)
    gm.recompile()
    (entry,) = [e for e in manager.log if e["pass"] == "FuseNormLinearPass"]
    return entry


# ---- where it fires ------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [HFNorm, RefNorm], ids=["hf_norm", "ref_norm"])
@pytest.mark.parametrize("packed", [False, True], ids=["gate_up_apart", "gate_up_packed"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fires_on_a_dynamo_graph_and_computes_the_same(norm, packed, bias, caplog):
    torch.manual_seed(0)
    model = Block(norm, packed, bias).eval()
    x = torch.randn(5, D)
    gm, inputs = dynamo_graph(model, x)
    with caplog.at_level(logging.INFO, logger=fuse_norm_linear.__name__):
        entry = _passes(gm)
    details = entry["details"]
    assert entry["changed"] and details["num_fused"] == 2 and details["not_fused"] == []
    first_up = "gate_up" if packed else "gate_proj"
    assert _summary(details["fused"]) == [("q_proj", True, False), (first_up, True, True)]
    assert all(f["source"].startswith("test_fuse_norm_linear.py:") for f in details["fused"])
    nodes = calls(gm, NORM_LINEAR)
    assert len(nodes) == 2
    # eps travels as a constant; the norm weights are graph inputs
    assert [n.args[2] for n in nodes] == [1e-6, 1e-5]
    assert all(n.args[1].op == "placeholder" for n in nodes)
    assert [n.args[5] for n in nodes] == [False, True]
    # no rsqrt, silu or sibling_linear is left; o_proj and down_proj stay linears
    assert not calls(gm, torch.rsqrt) and not calls(gm, F.silu)
    assert len(calls(gm, torch._C._nn.linear)) == 2
    assert all(isinstance(n.meta["example_value"], torch.Tensor) for n in nodes)
    assert "fused 2 norm/linear/gate group(s)" in caplog.text
    assert cb.counters["pass_norm_linear_fused"] == 2
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


def test_a_gate_without_a_norm_and_a_norm_without_a_gate_fuse_alone():
    """`silu(g) * u` after a plain packed linear: the gate alone;
    q/k/v after a norm: the norm alone."""
    torch.manual_seed(1)
    model = nn.Sequential(HFNorm(), nn.Linear(D, D), SiluGate()).eval()
    x = torch.randn(3, D)
    gm, inputs = dynamo_graph(model, x)
    details = _passes(gm)["details"]
    assert [(f["norm"] is not None, f["gated"]) for f in details["fused"]] == \
        [(True, False), (False, True)]
    (_, gated) = calls(gm, NORM_LINEAR)
    assert gated.args[1] is None  # no norm weight
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


def test_a_norm_of_a_fused_gate_reads_the_fused_node():
    """gate -> norm -> linear: fusing the gate first replaces its product,
    which is the norm's input; the second fused node must read the first."""
    torch.manual_seed(9)
    model = nn.Sequential(SiluGate(), HFNorm(), nn.Linear(D, D)).eval()
    x = torch.randn(3, D)
    gm, inputs = dynamo_graph(model, x)
    details = _passes(gm)["details"]
    assert [(f["norm"] is not None, f["gated"]) for f in details["fused"]] == \
        [(False, True), (True, False)]
    first, second = calls(gm, NORM_LINEAR)
    assert second.args[0] is first
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


def test_fires_through_the_backend_and_not_without_sibling_packing():
    """Through the backend q/k/v and gate/up (packed by the sibling pass) take
    their norms; with the sibling pass off, three linears read one norm, so
    the norm stays and the report says why."""
    torch.manual_seed(2)
    model = Block().eval()
    with torch.no_grad():
        for options in ({}, {"fuse_sibling_linears": False}):
            torch._dynamo.reset()
            compiled = _compile(model, **options)
            for t in (3, 1, 5):
                x = torch.randn(t, D)
                torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
            step = cb.compiled_steps()[-1]
            fused = fused_norm_linears(step.pass_log)
            if not options:
                assert _summary(fused) == [("q_proj", True, False), ("gate_proj", True, True)]
                assert step.passed_code.count("torch.ops.mrv2.norm_linear.default(") == 2
                assert "mrv2.norm_linear" not in step.original_code
            else:
                assert fused == []
                reasons = {n["reason"] for n in _entry(step)["details"]["not_fused"]}
                assert reasons == {f"the norm's output has {n} users (fusing needs the linear only)"
                                   for n in (3, 2)}  # q/k/v; gate/up


@pytest.mark.parametrize("marked", ["norm", "linear", "gate"])
def test_nodes_marked_eager_are_not_fused(marked):
    torch.manual_seed(3)
    model = nn.Sequential(HFNorm(), SiluGate()).eval()
    x = torch.randn(4, D)
    gm, inputs = dynamo_graph(model, x)
    node = {"norm": calls(gm, torch.rsqrt)[0], "linear": calls(gm, torch._C._nn.linear)[0],
            "gate": calls(gm, F.silu)[0]}[marked]
    node.meta[EAGER_REASON] = "marked by the test"
    report = FuseNormLinearPass(cb.OpRegistry())(gm.graph)
    gm.graph.lint()
    gm.recompile()
    fused = report.details["fused"]
    if marked == "linear":
        assert not report.changed and fused == []
    else:  # the other part still fuses
        assert [(f["norm"] is not None, f["gated"]) for f in fused] == \
            [(marked == "gate", marked == "norm")]
        (why,) = report.details["not_fused"]
        assert why["part"] == marked and "eager" in why["reason"]
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


def test_without_the_op_the_graph_is_unchanged_and_the_report_says_why(monkeypatch):
    gm, _ = dynamo_graph(nn.Sequential(HFNorm(), nn.Linear(D, D)).eval(), torch.randn(4, D))
    monkeypatch.setattr(FuseNormLinearPass, "fused_op", lambda self: None)
    before = str(gm.graph)
    report = FuseNormLinearPass(cb.OpRegistry())(gm.graph)
    assert not report.changed and str(gm.graph) == before
    (why,) = report.details["not_fused"]
    assert "mrv2::norm_linear is not registered" in why["reason"]
    assert cb.counters["pass_norm_linear_fused"] == 0


# ---- where it must not fire ------------------------------------------------------------


@pytest.mark.parametrize("cls, part, reason", NOT_FIRING, ids=[c.__name__ for c, _, _ in NOT_FIRING])
def test_does_not_fire(cls, part, reason):
    torch.manual_seed(4)
    model = cls().eval()
    compiled = _compile(model)
    with torch.no_grad():
        for t in (3, 5):
            x = torch.randn(t, D)
            torch.testing.assert_close(compiled(x.clone()), model(x.clone()), atol=1e-5,
                                       rtol=1e-5)
    step = cb.compiled_steps()[-1]
    entry = _entry(step)
    assert not entry["changed"] and entry["details"]["fused"] == []
    assert "norm_linear" not in step.passed_code
    not_fused = entry["details"]["not_fused"]
    assert len(not_fused) == 1 and not_fused[0]["part"] == part, not_fused
    assert reason in not_fused[0]["reason"], not_fused


def test_switched_off_and_the_option_validates():
    torch.manual_seed(5)
    model = Block().eval()
    compiled = _compile(model, fuse_norm_linear=False)
    with torch.no_grad():
        x = torch.randn(3, D)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    step = cb.compiled_steps()[-1]
    assert _entry(step)["details"] == {"enabled": False, "fused": [], "not_fused": []}
    assert "norm_linear" not in step.passed_code and cb.counters["pass_norm_linear_fused"] == 0
    with pytest.raises(ValueError, match="fuse_norm_linear must be True or False"):
        cb.CompilationConfig(fuse_norm_linear="yes")
    assert cb.CompilationConfig().fuse_norm_linear is True  # on by default (docs/design.md)
    off = cb.CompilationConfig.from_options({"fuse_norm_linear": False})
    assert off.summary()["fuse_norm_linear"] is False  # in the compile cache's key
    roles = cb.OpRegistry()
    assert FuseNormLinearPass(roles).uuid() != FuseNormLinearPass(roles, enabled=False).uuid()


# ---- against eager after every call ----------------------------------------------------------


@pytest.mark.filterwarnings("error::compile_backend.testing.NothingCapturedWarning")
@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_torch_compile_with_standin_graphs_equals_eager_after_every_call(mode):
    torch.manual_seed(6)
    model = Block(RefNorm, packed=True, bias=True).eval()
    calls = [(torch.randn(t, D),) for t in (4, 4, 4, 2, 2, 2, 1, 1, 1, 4)]
    check_against_eager(model, calls, modes=(mode,), sessions=2, standin=True,
                        options={"piece_compiler": "eager", "fuse_norm_linear": True})
    steps = cb.compiled_steps()
    assert steps and all(_summary(fused_norm_linears(s.pass_log))
                         == [("q_proj", True, False), ("gate_up", True, True)] for s in steps)


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_reference_llama_runner_equals_eager_after_every_step(mode):
    """Logits of every step of a random mixed prefill/decode schedule, against
    an eager runner (no passes), with the stand-in graphs. Per layer: the
    input norm with qkv, the post-attention norm with gate_up and its gate."""
    model = build_model("llama", preset("tiny", num_layers=2))
    kv = kv_config(num_blocks=20, max_num_tokens=32)  # blocks 1..16: random_schedule's
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cpu")
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[1, 2, 4, 8],
                               piece_compiler="eager", fuse_norm_linear=True)
    runner = ModelRunner(model, kv, cfg, "cpu", progress=False)
    report = check_against_eager(runner, list(random_schedule(seed=7, steps=8)), modes=[mode],
                                 standin=True)
    assert report[mode].replays > 0
    fused = fused_norm_linears(cb.compiled_steps()[-1].pass_log)
    # and the final norm with lm_head
    assert [(f["norm"] is not None, f["gated"]) for f in fused] == \
        [(True, False), (True, True)] * 2 + [(True, False)]


def test_unmodified_hf_llama_on_the_cpu_fuses_and_equals_eager():
    """An unmodified transformers LlamaForCausalLM (fp32, eager pieces, stand-in
    graphs): per layer the input norm with q/k/v and the post-attention norm
    with gate/up and the SiLU·mul; the final norm with lm_head through the
    slice of every row HF's forward takes between them."""
    model = small_hf_llama(2, hidden=64, heads=4, kv_heads=2, vocab=128)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (1, t), generator=g) for t in (6, 6, 6, 1, 1, 1)]
    calls = [lambda m, i=i: m(i, use_cache=False).logits for i in ids]
    check_against_eager(model, calls, modes=("piecewise",), standin=True,
                        options={"piece_compiler": "eager", "fuse_norm_linear": True})
    for step in cb.compiled_steps():
        fused = fused_norm_linears(step.pass_log)
        assert _summary(fused) == [("q_proj", True, False), ("gate_proj", True, True)] * 2 \
            + [("lm_head", True, False)]
        assert [f["rows"] for f in fused] == [None] * 4 + ["all"]


def test_hf_llama_keeping_the_last_logits_picks_the_row_before_the_norm():
    """`generate`'s `logits_to_keep=1`: at a prompt the last row is picked
    from the final norm's input (Note [rows before the norm]); at a decode
    step (one token, a static size) the pick keeps every row and goes. Logits
    against eager after every call, batches of 1-3, prompts and decode steps."""
    model = small_hf_llama(2, hidden=64, heads=4, kv_heads=2, vocab=128)
    g = torch.Generator().manual_seed(2)
    shapes = [(1, 7), (2, 7), (1, 1), (3, 1), (2, 5), (2, 1)]
    ids = [torch.randint(0, 128, s, generator=g) for s in shapes]
    calls = [lambda m, i=i: m(i, use_cache=False, logits_to_keep=1).logits for i in ids]
    check_against_eager(model, calls, modes=("piecewise", "full"), standin=True,
                        options={"piece_compiler": "eager", "fuse_norm_linear": True})
    rows = {f["rows"] for step in cb.compiled_steps()
            for f in fused_norm_linears(step.pass_log) if _module(f["weights"][0]) == "lm_head"}
    last = repr((slice(None), slice(-1, None), slice(None)))
    assert rows == {last, "all"}, rows


class _PickThenLinear(nn.Module):
    """RMSNorm over [B, S, D], then `index` of its output, then a linear
    (and the picked rows returned too when `keep_pick`)."""

    def __init__(self, index, dim: int = 32, keep_pick: bool = False) -> None:
        super().__init__()
        self.index, self.keep_pick = index, keep_pick
        self.nw = nn.Parameter(torch.rand(dim) + 0.5)
        rows = len(index) < 3 or index[-1] == slice(None)
        self.proj = nn.Linear(dim if rows else 16, 24, bias=False)

    def forward(self, x):
        a = x.to(torch.float32)
        h = (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.nw
        picked = h[self.index]
        return (self.proj(picked), picked) if self.keep_pick else self.proj(picked)


@pytest.mark.parametrize("index, fused", [
    ((slice(None), slice(-2, None), slice(None)), True),
    ((slice(1, 3),), True),
    ((slice(None), -1), True),  # an int drops the token dimension
    ((slice(None), 2, slice(None)), True),
    ((slice(None), slice(None, None, 2), slice(None)), False),  # a step: not taken
    ((slice(None), slice(None), slice(0, 16)), False),  # features, not rows
])
def test_a_pick_of_rows_between_norm_and_linear(index, fused):
    """A pick of rows (ints and plain slices of the leading dimensions)
    moves before the norm; a strided pick or a pick of features leaves the norm apart.
    Outputs against eager over three inputs."""
    torch.manual_seed(5)
    mod = _PickThenLinear(index).eval()
    x0 = torch.randn(3, 5, 32)
    gm, inputs = dynamo_graph(mod, x0)
    entry = _passes(gm)
    assert len(calls(gm, NORM_LINEAR)) == int(fused)
    if fused:
        assert entry["details"]["fused"][0]["rows"] == repr(index)
    else:
        (why,) = [n["reason"] for n in entry["details"]["not_fused"] if n["part"] == "norm"]
        assert "indexes more than rows" in why
    for seed in (1, 2, 3):
        x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = gm(*[x if t is x0 else t for t in inputs])[0]
            torch.testing.assert_close(out, mod(x), atol=1e-5, rtol=1e-5)


def test_picked_rows_read_elsewhere_keep_the_norm_apart():
    """The picked rows returned beside the projection: the norm has another
    reader through them, so it is not taken; outputs against eager."""
    torch.manual_seed(6)
    index = (slice(None), slice(-1, None), slice(None))
    mod = _PickThenLinear(index, keep_pick=True).eval()
    x0 = torch.randn(2, 4, 32)
    gm, inputs = dynamo_graph(mod, x0)
    entry = _passes(gm)
    assert not calls(gm, NORM_LINEAR)
    assert any("read elsewhere" in n["reason"] for n in entry["details"]["not_fused"])
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got = gm(*[x if t is x0 else t for t in inputs])
        for a, b in zip(got, mod(x)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["piecewise", "full"])
@pytest.mark.parametrize("forced", [True, False], ids=["kernel-forced", "by-rows"])
def test_hf_llama_bf16_inductor_norm_linear_equals_eager_on_the_gpu(mode, forced, monkeypatch):
    """FULL and PIECEWISE replays of an unmodified HF Llama in bf16 (Inductor
    pieces), its norms, q/k/v, gate/up and SiLU·mul in mrv2::norm_linear,
    against eager over several calls. kernel-forced (MRV2_SKINNY_GEMM=1): the
    fused kernel runs at every row count, even where it would not fill the
    GPU; by-rows: the op's own rule, with prompts of 20-24 tokens too, which
    take the three launches (norm kernel, cuBLAS, gate kernel) above 16 rows."""
    if forced:
        monkeypatch.setenv("MRV2_SKINNY_GEMM", "1")
    else:
        monkeypatch.delenv("MRV2_SKINNY_GEMM", raising=False)
    model = small_hf_llama(2, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 256, (1, t), generator=g).cuda() for t in (8, 8, 8, 1, 1, 1, 1)]
    ids += [torch.randint(0, 256, (3, 1), generator=g).cuda() for _ in range(3)]
    if not forced:
        ids += [torch.randint(0, 256, shape, generator=g).cuda() for shape in ((1, 24), (2, 20), (1, 24))]
    calls = [lambda m, i=i: m(i, use_cache=False).logits for i in ids]
    check_against_eager(model, calls, modes=(mode,), atol=3e-2, rtol=3e-2,
                        options={"piece_compiler": "inductor", "fuse_norm_linear": True})
    for step in cb.compiled_steps():
        assert _summary(fused_norm_linears(step.pass_log)) == \
            [("q_proj", True, False), ("gate_proj", True, True)] * 2 + [("lm_head", True, False)]
        assert "mrv2.norm_linear" in step.passed_code


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_hf_llama_bf16_last_logits_equal_eager_on_the_gpu(mode, monkeypatch):
    """`logits_to_keep=1` as `generate` passes it, bf16, the skinny kernel
    forced: at prompts the final norm and lm_head read the last row of each
    sequence, a strided view of the residual stream (Note [rows before the
    norm]); at decode steps the residual stream itself. Against eager after
    every call."""
    monkeypatch.setenv("MRV2_SKINNY_GEMM", "1")
    model = small_hf_llama(2, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(8)
    shapes = [(1, 9), (3, 9), (3, 1), (3, 1), (2, 12), (1, 1), (2, 1)]
    ids = [torch.randint(0, 256, s, generator=g).cuda() for s in shapes]
    calls = [lambda m, i=i: m(i, use_cache=False, logits_to_keep=1).logits for i in ids]
    check_against_eager(model, calls, modes=(mode,), atol=3e-2, rtol=3e-2,
                        options={"piece_compiler": "inductor", "fuse_norm_linear": True})
    rows = {f["rows"] for step in cb.compiled_steps()
            for f in fused_norm_linears(step.pass_log) if _module(f["weights"][0]) == "lm_head"}
    assert repr((slice(None), slice(-1, None), slice(None))) in rows, rows
