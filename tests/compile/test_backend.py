"""The backend: registration by name, options, splitting, piece compilation."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import compile_backend as cb
from backend_models import (
    MLP,
    TOY_OPTIONS,
    MultiSDPA,
    ToyHybrid,
    check_against_eager,
)

SIZES = [5, 2, 16, 9]
SDPA = "aten::scaled_dot_product_attention"


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # only the installed package may be found
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env=env, cwd="/",
    )


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_backend_found_by_name_without_import():
    """A fresh process finds "mrv2" through the entry point alone."""
    r = _run_python("""
        import sys, torch
        f = torch.compile(lambda x: torch.relu(x) * 2, backend="mrv2",
                          options={"piece_compiler": "eager"})
        x = torch.randn(4, 3)
        assert torch.equal(f(x), torch.relu(x) * 2)
        assert "compile_backend.compile.backend" in sys.modules  # loaded by the entry point
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_import_first_then_compile_has_no_duplicate_name():
    r = _run_python("""
        import compile_backend, torch
        from torch._dynamo import list_backends
        assert "mrv2" in list_backends(exclude_tags=())
        f = torch.compile(lambda x: x + 1, backend="mrv2", options={"piece_compiler": "eager"})
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# ---- configuration ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, mode",
    [("piecewise", "PIECEWISE"), ("FULL", "FULL"), ("Full_And_Piecewise", "FULL_AND_PIECEWISE"),
     ("full-decode-only", "FULL_DECODE_ONLY"), ("none", "NONE")],
)
def test_mode_parsing_is_case_insensitive(text, mode):
    assert cb.CUDAGraphMode.parse(text) is cb.CUDAGraphMode[mode]
    assert cb.CompilationConfig.from_options(mode=text).cudagraph_mode is cb.CUDAGraphMode[mode]


@pytest.mark.parametrize(
    "options, mode, message",
    [
        ({"cudagraph_mod": "full"}, None, "unknown mrv2 option"),
        ({"cudagraph_mode": "fastest"}, None, "valid modes: none, piecewise"),
        ({"piece_compiler": "tvm"}, None, "piece_compiler must be one of"),
        ({"capture_sizes": [0, 8]}, None, "positive ints"),
        ({"capture_sizes": 8}, None, "positive ints"),
        ({"splitting_ops": "toy::attn"}, None, "must be a list of op names"),
        ({"splitting_ops": ["toy::no_such_op"]}, None, "does not resolve"),
        ({"attention_like_ops": ["not_an_op_name"]}, None, "namespace::name"),
        ({"non_splitting_ops": ["toy::attn"]}, None, "no role to remove"),
        ({"strict_capture": "yes"}, None, "True or False"),
        (None, "reduce-overhead", "not an mrv2 graph mode"),
    ],
)
def test_bad_options_raise_naming_valid_choices(options, mode, message):
    with pytest.raises(ValueError, match=message):
        cfg = cb.CompilationConfig.from_options(options, mode)
        cb.OpRegistry.from_config(cfg)


def test_bad_option_raises_through_torch_compile():
    f = torch.compile(lambda x: x * 2, backend="mrv2", options={"nope": 1})
    with pytest.raises(Exception, match="unknown mrv2 option.*valid options: cudagraph_mode"):
        f(torch.randn(3))


def test_mode_shorthand_through_torch_compile():
    torch.compile(lambda x: x * 2, backend="mrv2", mode="NONE")(torch.randn(3))
    assert cb.compiled_steps()[-1].config.cudagraph_mode is cb.CUDAGraphMode.NONE


def test_config_adds_and_removes_roles():
    import compile_backend.kernels  # noqa: F401  (the mrv2 ops register their roles on import)

    cfg = cb.CompilationConfig(splitting_ops=["toy::attn"], attention_like_ops=["toy::state_mix"],
                               non_splitting_ops=[SDPA])
    reg = cb.OpRegistry.from_config(cfg)
    assert reg.role_of_name("toy::attn") is cb.OpRole.BREAKPOINT
    assert reg.role_of_name("toy::state_mix") is cb.OpRole.ATTENTION_LIKE
    assert reg.role_of_name(SDPA) is cb.OpRole.ORDINARY
    defaults = cb.OpRegistry()
    assert defaults.role_of_name(SDPA) is cb.OpRole.BREAKPOINT
    assert defaults.role_of_name("higher_order::flex_attention") is cb.OpRole.BREAKPOINT
    assert defaults.role_of_name("mrv2::unified_attention") is cb.OpRole.BREAKPOINT
    assert defaults.role_of_name("mrv2::sconv") is cb.OpRole.ATTENTION_LIKE


def test_attention_like_beats_a_breakpoint_wildcard():
    cfg = cb.CompilationConfig(splitting_ops=["toy::*"], attention_like_ops=["toy::state_mix"])
    reg = cb.OpRegistry.from_config(cfg)
    assert reg.role_of_name("toy::attn") is cb.OpRole.BREAKPOINT
    assert reg.role_of_name("toy::state_mix") is cb.OpRole.ATTENTION_LIKE
    assert reg.wildcard_conflicts(["toy::state_mix", "toy::attn"]) == ["toy::state_mix"]


def test_attention_like_op_named_among_splitting_ops_is_not_split():
    import compile_backend.kernels  # noqa: F401  (the mrv2 ops register their roles on import)

    cfg = cb.CompilationConfig(splitting_ops=["mrv2::sconv", "toy::attn"])
    reg = cb.OpRegistry.from_config(cfg)
    assert reg.role_of_name("mrv2::sconv") is cb.OpRole.ATTENTION_LIKE
    assert reg.wildcard_conflicts(["mrv2::sconv"]) == ["mrv2::sconv"]


# ---- numerics and split shape ------------------------------------------------


def _piece_table(step):
    return [(p.captured, p.breakpoints, p.attention_like) for p in step.pieces]


def test_mlp_is_one_captured_piece():
    step = check_against_eager(MLP(), {}, SIZES)
    assert _piece_table(step) == [(True, [], [])]
    # the second linear and the residual add are one op (compile_backend/passes/fuse_linear_residual.py)
    assert step.pieces[0].ops.count("torch._C._nn.linear") == 1
    assert step.pieces[0].ops.count("mrv2::linear_add") == 1


def test_sdpa_model_splits_at_every_attention():
    step = check_against_eager(MultiSDPA(3), {}, SIZES)
    kinds = [p.captured for p in step.pieces]
    assert kinds == [True, False, True, False, True, False, True]
    assert [p.breakpoints for p in step.pieces if not p.captured] == [[SDPA]] * 3
    assert all(p.ops.count("torch._C._nn.linear") == 1 for p in step.pieces[:-1:2])


def test_custom_breakpoint_and_attention_like_op():
    step = check_against_eager(ToyHybrid(), TOY_OPTIONS, SIZES)
    assert _piece_table(step) == [
        (True, [], []), (False, ["toy::attn"], []), (True, [], ["toy::state_mix"]),
    ]


# ---- one trace, one compile per distinct piece --------------------------------


def test_one_trace_serves_every_token_count_including_one():
    check_against_eager(ToyHybrid(), TOY_OPTIONS, [7, 1, 3, 64, 2])
    assert cb.counters["dynamo_graphs"] == 1
    assert cb.counters["piece_compiles"] == 2  # two captured pieces, compiled once
    # (identical pieces sharing one compile: tests/compile/test_piece_compiler.py)


def test_no_cuda_runs_mode_none_and_says_why(caplog, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    import compile_backend.runtime.machine as machine

    monkeypatch.setattr(machine, "_warned_no_cuda", False)
    with caplog.at_level(logging.WARNING, logger="compile_backend.runtime.machine"):
        check_against_eager(MLP(), {"cudagraph_mode": "full"}, [3])
        check_against_eager(MLP(), {"cudagraph_mode": "piecewise"}, [3])
    step = cb.compiled_steps()[-1]
    assert step.graph_mode is cb.CUDAGraphMode.NONE
    assert "torch.cuda.is_available() is False" in step.mode_reason
    said = [r for r in caplog.records if "CUDA graphs are off" in r.getMessage()]
    assert len(said) == 1  # once per process


def test_configured_backend_checks_options_when_called_and_combines_a_mode():
    with pytest.raises(ValueError, match="unknown cudagraph mode 'fastest'"):
        cb.backend(cudagraph_mode="fastest")
    with pytest.raises(ValueError, match="piece_compiler"):
        cb.backend(piece_compiler="tvm")
    with pytest.raises(Exception, match="nolib"):
        cb.backend(splitting_ops=["nolib::attn"])
    model = MLP()
    compiled = torch.compile(model, backend=cb.backend(cudagraph_mode="full", piece_compiler="eager"))
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    step = cb.compiled_steps()[-1]
    assert step.config.cudagraph_mode is cb.CUDAGraphMode.FULL
    assert step.config.piece_compiler == "eager"


def test_a_namespace_pattern_that_matches_no_op_is_refused():
    with pytest.raises(ValueError, match=r"op pattern 'nolib::\*' matches no op: no op of namespace 'nolib'"):
        cb.backend(splitting_ops=["nolib::*"])
    cb.backend(splitting_ops=["toy::*"], attention_like_ops=["toy::state_mix"])  # registered: fine
