"""FuseResidualNormPass (compile_backend/passes/fuse_residual_norm.py): a
linear_add whose sum the next norm_linear normalizes becomes one
mrv2::residual_norm_linear; where it must not fire the report says why.
Against eager after every call: the reference Llama runner (its pieces and
FULL graphs, stand-in graphs), an unmodified HF Llama, and the wide form
forced on the CPU (the add inside the interpreted norm kernel)."""

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_backend as cb
import compile_backend.kernels  # noqa: F401  (registers the mrv2 ops)
from fx_helpers import calls, dynamo_graph
from compile_backend.core.op_registry import EAGER_REASON
from compile_backend.demo.models import build_model, preset
from compile_backend.passes import FuseResidualNormPass, PassManager
from compile_backend.passes import fuse_residual_norm
from compile_backend.passes.fuse_residual_norm import fused_residual_norms
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.testing import check_against_eager
from backend_models import small_hf_llama
from runtime_helpers import (  # noqa: F401  (_torch_reference_kernels: autouse fixture)
    _torch_reference_kernels, kv_config, random_schedule,
)

D = 16
FUSED = torch.ops.mrv2.residual_norm_linear.default
LINEAR_ADD = torch.ops.mrv2.linear_add.default
NORM_LINEAR = torch.ops.mrv2.norm_linear.default


def _norm(x, w, eps=1e-5):
    a = x.to(torch.float32)
    return w * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Layers(nn.Module):
    """Two Llama-like residual steps: h = x + o(x); y = gate_up(norm(h)) ->
    SiLU·mul -> h + down(..); then the final norm and a head."""

    def __init__(self):
        super().__init__()
        self.o = nn.Linear(D, D, bias=True)
        self.n1, self.n2 = nn.Parameter(1 + torch.rand(D)), nn.Parameter(1 + torch.rand(D))
        self.gate_up = nn.Linear(D, 4 * D, bias=False)
        self.down = nn.Linear(2 * D, D, bias=False)
        self.head = nn.Linear(D, 24, bias=False)

    def forward(self, x):
        h = x + self.o(x)
        g, u = self.gate_up(_norm(h, self.n1)).chunk(2, dim=-1)
        h = h + self.down(F.silu(g) * u)
        return self.head(_norm(h, self.n2))


class SumReadBetween(Layers):
    """The sum is read (by a multiply) between the linear_add and the norm
    that follows it: the fused op, at the norm's place, would come too late."""

    def forward(self, x):
        h = x + self.o(x)
        s = h * 2
        return self.head(_norm(h, self.n1)) + s.sum()


class TwoNorms(Layers):
    """One sum normalized twice (a parallel block: attention and MLP read
    the same residual): the first norm_linear takes the pair; the second
    reads the sum after the first did."""

    def forward(self, x):
        h = x + self.o(x)
        g, u = self.gate_up(_norm(h, self.n1)).chunk(2, dim=-1)
        return self.head(_norm(h, self.n2)) + (F.silu(g) * u).sum()


class WriteBetween(Layers):
    """The linear_add's input is written between it and the norm."""

    def forward(self, x):
        x = x * 1
        h = x + self.o(x)
        x.mul_(3)
        return self.head(_norm(h, self.n1)) * x.sum()


def _passes(gm, **kw):
    config = cb.CompilationConfig(**{"fuse_residual_norm": True, **kw})
    manager = PassManager.from_config(config, cb.OpRegistry.from_config(config))
    manager(gm.graph)
    gm.recompile()
    (entry,) = [e for e in manager.log if e["pass"] == "FuseResidualNormPass"]
    return entry


def test_fires_on_the_residual_stream_and_computes_the_same(caplog):
    torch.manual_seed(0)
    model = Layers().eval()
    x = torch.randn(5, D)
    gm, inputs = dynamo_graph(model, x)
    with caplog.at_level(logging.INFO, logger=fuse_residual_norm.__name__):
        entry = _passes(gm)
    details = entry["details"]
    assert entry["changed"] and details["num_fused"] == 2 and details["not_fused"] == []
    assert [f["weight"].split("_modules_")[-1] for f in details["fused"]] == \
        ["o_parameters_weight_", "down_parameters_weight_"]
    nodes = calls(gm, FUSED)
    assert len(nodes) == 2 and not calls(gm, LINEAR_ADD) and not calls(gm, NORM_LINEAR)
    assert all(isinstance(v, torch.Tensor) for n in nodes for v in n.meta["example_value"])
    assert "fused 2 linear_add + norm_linear pair(s)" in caplog.text
    assert cb.counters["pass_residual_norm_fused"] == 2
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls, reason", [
    (SumReadBetween, "the sum is read before the norm_linear (by s)"),
    (WriteBetween, "`Tensor.mul_` (mul_) between them"),
], ids=["sum_read_between", "write_between"])
def test_does_not_fire_and_says_why(cls, reason):
    torch.manual_seed(1)
    model = cls().eval()
    x = torch.randn(4, D)
    gm, inputs = dynamo_graph(model, x)
    entry = _passes(gm)
    (why,) = entry["details"]["not_fused"]
    assert reason in why["reason"], why
    assert not calls(gm, FUSED)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


def test_a_sum_normalized_twice_fuses_once():
    torch.manual_seed(5)
    model = TwoNorms().eval()
    x = torch.randn(3, D)
    gm, inputs = dynamo_graph(model, x)
    entry = _passes(gm)
    assert entry["details"]["num_fused"] == 1 and len(calls(gm, FUSED)) == 1
    (why,) = entry["details"]["not_fused"]
    assert "the sum is read before the norm_linear" in why["reason"], why
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs)[0], model(x), atol=1e-5, rtol=1e-5)


def test_a_pair_marked_eager_is_not_fused():
    torch.manual_seed(2)
    gm, _ = dynamo_graph(Layers().eval(), torch.randn(4, D))
    config = cb.CompilationConfig(fuse_residual_norm=False)
    PassManager.from_config(config, cb.OpRegistry.from_config(config))(gm.graph)
    add = calls(gm, LINEAR_ADD)[0]
    add.meta[EAGER_REASON] = "marked by the test"
    report = FuseResidualNormPass(cb.OpRegistry()).apply(gm.graph)
    reasons = [n["reason"] for n in report.details["not_fused"]]
    assert reasons == ["the linear_add runs eagerly"] and report.details["num_fused"] == 1


def test_switched_off_and_in_the_uuid():
    gm, _ = dynamo_graph(Layers().eval(), torch.randn(4, D))
    entry = _passes(gm, fuse_residual_norm=False)
    assert entry["details"] == {"enabled": False, "fused": [], "not_fused": []}
    assert len(calls(gm, LINEAR_ADD)) == 2 and not calls(gm, FUSED)
    with pytest.raises(ValueError, match="fuse_residual_norm must be True or False"):
        cb.CompilationConfig(fuse_residual_norm="yes")
    assert cb.CompilationConfig().fuse_residual_norm is True  # on since timed on a GPU
    roles = cb.OpRegistry()
    assert FuseResidualNormPass(roles).uuid() != FuseResidualNormPass(roles, enabled=False).uuid()


# ---- against eager after every call ----------------------------------------------------------


def _tiny_llama_runner(mode, sizes):
    """The reference Llama (2 layers) in a runner with the pass on, stand-in graphs."""
    model = build_model("llama", preset("tiny", num_layers=2))
    kv = kv_config(num_blocks=20, max_num_tokens=32)
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cpu")
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=sizes, piece_compiler="eager",
                               fuse_residual_norm=True)
    return ModelRunner(model, kv, cfg, "cpu", progress=False)


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_reference_llama_runner_equals_eager_after_every_step(mode):
    """Logits of every step of a random mixed schedule against an eager
    runner, stand-in graphs. Per layer: o with the norm and gate/up, down with
    the next layer's norm and qkv (the last one's: the final norm and lm_head)."""
    report = check_against_eager(_tiny_llama_runner(mode, [1, 2, 4, 8]), list(random_schedule(seed=11, steps=8)), modes=[mode],
                                 standin=True)
    assert report[mode].replays > 0
    assert len(fused_residual_norms(cb.compiled_steps()[-1].pass_log)) == 4


@pytest.mark.interpreted_kernels
def test_the_wide_form_forced_in_a_runner_equals_eager_after_every_step(monkeypatch):
    """The wide form (the add inside the interpreted norm kernel, as above 64
    rows on a GPU) at every size of a FULL and piecewise runner, fp32."""
    rnl = importlib.import_module("compile_backend.kernels.residual_norm_linear")
    ran = []
    monkeypatch.setattr(rnl, "wide_here", lambda *a: ran.append(1) or True)
    report = check_against_eager(_tiny_llama_runner("full_and_piecewise", [1, 2, 4]), list(random_schedule(seed=12, steps=5)),
                                 modes=["full_and_piecewise"], standin=True, atol=1e-4, rtol=1e-4)
    assert report["full_and_piecewise"].replays > 0 and ran


def test_unmodified_hf_llama_on_the_cpu_fuses_and_equals_eager():
    model = small_hf_llama(2, hidden=64, heads=4, kv_heads=2, vocab=128)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 128, (1, t), generator=g) for t in (6, 6, 6, 1, 1, 1)]
    calls_ = [lambda m, i=i: m(i, use_cache=False).logits for i in ids]
    check_against_eager(model, calls_, modes=("piecewise",), standin=True,
                        options={"piece_compiler": "eager", "fuse_residual_norm": True})
    for step in cb.compiled_steps():
        # o with the post-attention norm, each down with the next norm (the
        # last one's: the final norm and lm_head, HF's slice of every row gone)
        assert len(fused_residual_norms(step.pass_log)) == 4


@pytest.mark.interpreted_kernels
def test_the_wide_form_forced_in_hf_llama_equals_eager_after_every_call(monkeypatch):
    """The same, forced, in an unmodified HF Llama (PIECEWISE and FULL with
    stand-in graphs): every call's logits against eager."""
    rnl = importlib.import_module("compile_backend.kernels.residual_norm_linear")
    ran = []
    monkeypatch.setattr(rnl, "wide_here", lambda *a: ran.append(1) or True)
    model = small_hf_llama(2, hidden=64, heads=4, kv_heads=2, vocab=128)
    g = torch.Generator().manual_seed(6)
    ids = [torch.randint(0, 128, (1, t), generator=g) for t in (5, 5, 1, 1, 3)]
    calls_ = [lambda m, i=i: m(i, use_cache=False).logits for i in ids]
    check_against_eager(model, calls_, modes=("piecewise", "full"), standin=True, atol=1e-4,
                        rtol=1e-4, options={"piece_compiler": "eager", "fuse_residual_norm": True})
    assert ran


# ---- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_hf_llama_bf16_wide_rows_equal_eager_on_the_gpu(mode):
    """An unmodified HF Llama in bf16 (Inductor pieces), prompts of 1-80
    tokens: above 64 rows the add runs inside the norm's launch. Against
    eager after every call."""
    model = small_hf_llama(2, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    shapes = [(1, 80), (1, 80), (2, 40), (1, 8), (4, 1), (1, 72), (1, 80)]
    ids = [torch.randint(0, 256, s, generator=g).cuda() for s in shapes]
    calls_ = [lambda m, i=i: m(i, use_cache=False).logits for i in ids]
    check_against_eager(model, calls_, modes=(mode,), atol=3e-2, rtol=3e-2,
                        options={"piece_compiler": "inductor", "fuse_residual_norm": True})
    for step in cb.compiled_steps():
        assert len(fused_residual_norms(step.pass_log)) == 4
        assert "mrv2.residual_norm_linear" in step.passed_code
