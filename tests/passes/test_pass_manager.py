"""The pass manager: fixed order from config, a JSON-friendly log, a combined
uuid for compile-cache keys; and misuse through torch.compile."""

import json

import pytest
import torch

import compile_backend as cb
import toy_ops  # noqa: F401
from compile_backend.passes import (
    CaptureSafetyPass, FuseLinearResidualPass, FuseNormLinearPass, FuseResidualNormPass,
    FuseRopeAttentionPass, FuseSiblingLinearsPass, GrowingCachesPass, PassManager, SegmentAttentionLikePass,
    SymmetricAllReducePass,
)

OPTIONS = {"splitting_ops": ["toy::attn"], "attention_like_ops": ["toy::state_mix"],
           "piece_compiler": "eager"}


def manager(**options):
    config = cb.CompilationConfig(**{**OPTIONS, **options})
    return PassManager.from_config(config, cb.OpRegistry.from_config(config))


def fn(x, state):
    a = torch.ops.toy.attn(x, x, x)
    s = torch.ops.toy.state_mix(x + 1, state)
    return torch.ops.toy.attn(a, a, a) + s


def test_order_is_capture_safety_then_all_reduce_then_fusions_then_segments():
    m = manager()
    assert [type(p) for p in m.passes] == [
        CaptureSafetyPass, SymmetricAllReducePass, FuseSiblingLinearsPass, FuseLinearResidualPass,
        FuseNormLinearPass, FuseResidualNormPass, FuseRopeAttentionPass, GrowingCachesPass,
        SegmentAttentionLikePass]
    assert m.passes[0].strict is False and m.passes[8].reorder is True
    assert m.passes[7].enabled is True  # growing_caches_eager
    assert m.passes[5].enabled is True  # fuse_residual_norm: on by default
    assert m.passes[1].mode == "nccl" and m.passes[2].enabled is True and m.passes[3].enabled is True
    assert m.passes[4].enabled is True  # fuse_norm_linear: on by default
    assert m.passes[6].enabled is False  # fuse_rope_attention: off by default
    m = manager(strict_capture=True, reorder_for_fewer_pieces=False, fuse_sibling_linears=False,
                fuse_linear_residual=False, fuse_norm_linear=False, fuse_residual_norm=False,
                tp_all_reduce="auto", tp_all_reduce_threshold=4096, growing_caches_eager=False)
    assert m.passes[0].strict is True and m.passes[8].reorder is False
    assert all(m.passes[i].enabled is False for i in (2, 3, 4, 5, 6, 7))
    assert (m.passes[1].mode, m.passes[1].threshold) == ("auto", 4096)
    # the rope fusion: on only with its option and a FULL graph
    assert manager(fuse_rope_attention=True, cudagraph_mode="full").passes[6].enabled is True
    for mode in ("piecewise", "full_and_piecewise"):
        assert manager(fuse_rope_attention=True, cudagraph_mode=mode).passes[6].enabled is False


def test_uuid_is_stable_and_follows_settings():
    assert manager().uuid() == manager().uuid()
    assert manager().uuid() != manager(reorder_for_fewer_pieces=False).uuid()
    assert manager().uuid() != manager(strict_capture=True).uuid()
    assert manager().uuid() != manager(fuse_sibling_linears=False).uuid()
    assert manager().uuid() != manager(fuse_linear_residual=False).uuid()
    assert manager().uuid() != manager(fuse_norm_linear=False).uuid()
    assert manager().uuid() != manager(fuse_residual_norm=False).uuid()
    on = manager(fuse_rope_attention=True, cudagraph_mode="full").uuid()
    assert on != manager(cudagraph_mode="full").uuid()
    assert on != manager(fuse_rope_attention=True, cudagraph_mode="piecewise").uuid()
    assert manager().uuid() != manager(tp_all_reduce="auto").uuid()
    assert manager().uuid() != manager(growing_caches_eager=False).uuid()
    assert manager().uuid() != manager(attention_like_ops=[]).uuid()
    assert len(manager().uuid()) == 64


def test_backend_runs_passes_and_records_log_and_uuid():
    x, state = torch.randn(4, 8), torch.randn(8)
    torch.compile(fn, backend="mrv2", options=OPTIONS)(x, state)
    step = cb.compiled_steps()[-1]
    assert step.passes_uuid == manager().uuid()
    assert [e["pass"] for e in step.pass_log] == [
        "CaptureSafetyPass", "SymmetricAllReducePass", "FuseSiblingLinearsPass",
        "FuseLinearResidualPass", "FuseNormLinearPass", "FuseResidualNormPass",
        "FuseRopeAttentionPass", "GrowingCachesPass", "SegmentAttentionLikePass"]
    for entry in step.pass_log:
        assert set(entry) == {"pass", "uuid", "changed", "details"}
    json.dumps(step.pass_log)  # JSON-friendly
    seg = step.pass_log[8]
    assert seg["changed"] and seg["details"]["moved"]
    assert step.passed_code != step.original_code


def test_passes_off():
    x, state = torch.randn(4, 8), torch.randn(8)
    torch.compile(fn, backend="mrv2", options={**OPTIONS, "enable_passes": False})(x, state)
    step = cb.compiled_steps()[-1]
    assert step.pass_log == [] and step.passes_uuid is None
    assert len(step.pieces) == 4  # traced order: E C E C


def test_manager_leaves_a_linted_graph_on_a_traced_module():
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.toy.attn(x, x, x) * 2)
    m = manager()
    m(gm.graph)
    gm.graph.lint()
    assert len(m.log) == 9


@pytest.mark.parametrize("options, message", [
    ({"splitting_ops": ["toy::no_such_op"]}, "does not resolve.*torch.ops.toy.no_such_op"),
    ({"attention_like_ops": ["state_mix"]}, "not of the form 'namespace::name'"),
    ({"attention_like_ops": ["nowhere::sconv"]}, "does not resolve.*Register the op"),
])
def test_unresolvable_op_names_raise_with_the_fix(options, message):
    compiled = torch.compile(lambda x: x * 2, backend="mrv2", options={**OPTIONS, **options})
    with pytest.raises(Exception, match=message):
        compiled(torch.randn(4, 8))
