"""The op registry (compile_backend/core/op_registry.py): every fact about an
op (role, layer-keyed, capture-safe) lives there, with its precedence rules
and its misuse errors; the kernels register their own ops' facts when
imported, and core names none of them."""

import subprocess
import sys
import textwrap

import pytest
import torch

import compile_backend as cb
from compile_backend import passes
from compile_backend.core.config import CompilationConfig
from compile_backend.core.op_registry import (
    OpRegistry, OpRole, capture_safe_ops, layer_name_position, register_capture_safe,
    register_layer_keyed_op, register_op, register_op_role, unregister_capture_safe,
    unregister_op,
)

B, A, C = OpRole.BREAKPOINT, OpRole.ATTENTION_LIKE, OpRole.COLLECTIVE


# x [T, D] -> [T, D]; `layer_name` only names the layer (a layer-keyed op).
@torch.library.custom_op("regtest::keyed", mutates_args=())
def keyed(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    return x.clone()


@keyed.register_fake
def _(x, layer_name):
    return torch.empty_like(x)


# x [T, D] -> [T, D]; no layer argument.
@torch.library.custom_op("regtest::plain", mutates_args=())
def plain(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@plain.register_fake
def _(x):
    return torch.empty_like(x)


NAMES = ("regtest::keyed", "regtest::plain", "regtest::*")


@pytest.fixture(autouse=True)
def _forget_regtest_facts():
    yield
    for name in NAMES:
        unregister_op(name)


# ---- roles and their precedence ----------------------------------------------


def test_attention_like_beats_breakpoint():
    # a namespace wildcard says breakpoint, the exact name attention-like
    reg = OpRegistry({"regtest::*": B, "regtest::keyed": A})
    assert reg.role_of_name("regtest::keyed") is A
    assert reg.role_of_name("regtest::plain") is B
    # but an exact name beats a wildcard: an attention-like namespace may hold a breakpoint
    reg = OpRegistry({"regtest::*": A, "regtest::keyed": B})
    assert reg.role_of_name("regtest::keyed") is B and reg.role_of_name("regtest::plain") is A
    # a config naming an attention-like op among splitting ops changes nothing
    register_op("regtest::keyed", role="attention_like")
    reg = OpRegistry.from_config(CompilationConfig(splitting_ops=["regtest::keyed", "regtest::plain"]))
    assert reg.role_of_name("regtest::keyed") is A and reg.role_of_name("regtest::plain") is B
    assert reg.wildcard_conflicts(["regtest::keyed", "regtest::plain"]) == ["regtest::keyed"]


def test_exact_name_beats_wildcard():
    reg = OpRegistry({"regtest::*": B, "regtest::plain": OpRole.ORDINARY, "regtest::keyed": C})
    assert reg.role_of_name("regtest::plain") is OpRole.ORDINARY
    assert reg.role_of_name("regtest::keyed") is C
    assert reg.role_of_name("regtest::other") is B
    assert reg.role_of_name("othertest::plain") is OpRole.ORDINARY
    assert reg.role_of_name(None) is OpRole.ORDINARY and reg.role_of_name("torch.sin") is OpRole.ORDINARY


def test_registered_roles_are_copied_into_each_registry_and_config_edits_one():
    before = OpRegistry()
    register_op("regtest::plain", role="breakpoint")
    after = OpRegistry()
    assert before.role_of_name("regtest::plain") is OpRole.ORDINARY  # its own copy
    assert after.role_of_name("regtest::plain") is B
    assert "regtest::plain" in after.summary()["breakpoint"]
    removed = OpRegistry.from_config(CompilationConfig(non_splitting_ops=["regtest::plain"]))
    assert removed.role_of_name("regtest::plain") is OpRole.ORDINARY
    assert OpRegistry().role_of_name("regtest::plain") is B  # the default stays
    register_op_role("regtest::plain", "attention-like")  # the older name, same fact
    assert OpRegistry().role_of_name("regtest::plain") is A
    unregister_op("regtest::plain")
    assert OpRegistry().role_of_name("regtest::plain") is OpRole.ORDINARY


def test_summary_keys():
    assert sorted(OpRegistry().summary()) == ["attention_like", "breakpoint", "collective"]


# ---- collectives ---------------------------------------------------------------


def test_functional_collectives_are_collectives_by_default():
    import compile_backend.kernels  # noqa: F401  (mrv2::all_reduce, tp_all_reduce's op, declares its own)

    reg = OpRegistry()
    assert reg.role_of_name("_c10d_functional::all_reduce") is C
    assert reg.role_of_name("_c10d_functional::wait_tensor") is C
    assert reg.names(C) == ["_c10d_functional::*", "mrv2::all_reduce"] == reg.summary()["collective"]
    assert reg.is_capture_safe("_c10d_functional::all_reduce")  # the pass checks the backend
    assert reg.is_capture_safe("mrv2::all_reduce")
    register_op("regtest::plain", role=OpRole.COLLECTIVE)
    assert OpRegistry().names(C) == ["_c10d_functional::*", "mrv2::all_reduce", "regtest::plain"]


# ---- layer-keyed ops -------------------------------------------------------------


def test_layer_keyed_ops():
    reg = OpRegistry()
    assert not reg.is_layer_keyed("regtest::keyed")
    assert layer_name_position(torch.ops.regtest.keyed) is None
    register_op("regtest::keyed", layer_keyed=True)
    assert reg.is_layer_keyed("regtest::keyed")  # process-wide: seen by a registry made before
    assert "regtest::keyed" in reg.layer_keyed_ops()
    assert layer_name_position(torch.ops.regtest.keyed) == 1  # the packet (Dynamo's graphs)
    assert layer_name_position(torch.ops.regtest.keyed.default) == 1
    assert layer_name_position(torch.ops.regtest.plain) is None
    assert layer_name_position(torch.sin) is None
    unregister_op("regtest::keyed")
    assert layer_name_position(torch.ops.regtest.keyed) is None
    register_layer_keyed_op("regtest::keyed")  # the older name, same fact
    assert reg.is_layer_keyed("regtest::keyed")


def test_layer_keyed_needs_a_layer_name_argument_and_one_op():
    with pytest.raises(ValueError, match="no argument named 'layer_name'"):
        register_op("regtest::plain", layer_keyed=True)
    with pytest.raises(ValueError, match="needs one op, not the pattern"):
        register_op("regtest::*", layer_keyed=True)


# ---- capture safety ---------------------------------------------------------------


def test_trusted_namespaces_and_declared_capture_safe_ops():
    reg = OpRegistry()
    assert reg.trusted_namespaces == ("aten", "prims", "_c10d_functional")
    assert reg.is_capture_safe("aten::mm") and reg.is_capture_safe("prims::add")
    assert not reg.is_capture_safe("regtest::plain")
    assert not reg.is_capture_safe(None) and not reg.is_capture_safe("torch.sin")
    register_op("regtest::plain", capture_safe=True)
    assert reg.is_capture_safe("regtest::plain") and not reg.is_capture_safe("regtest::keyed")
    assert "regtest::plain" in capture_safe_ops() == reg.capture_safe_ops()
    unregister_capture_safe("regtest::plain")
    assert not reg.is_capture_safe("regtest::plain")
    register_capture_safe("regtest::*")  # a whole namespace
    assert reg.is_capture_safe("regtest::plain") and reg.is_capture_safe("regtest::keyed")


def test_capture_safe_registration_is_one_function_under_every_name():
    assert passes.register_capture_safe is register_capture_safe is cb.register_capture_safe
    assert passes.unregister_capture_safe is unregister_capture_safe
    assert passes.capture_safe_ops is capture_safe_ops
    assert cb.register_op is register_op and cb.unregister_op is unregister_op


def test_the_capture_safety_pass_reports_the_registrys_facts():
    register_op("regtest::plain", capture_safe=True)
    settings = passes.CaptureSafetyPass(OpRegistry()).settings()
    assert settings["trusted_namespaces"] == ["aten", "prims", "_c10d_functional"]
    assert "regtest::plain" in settings["capture_safe"]
    assert sorted(settings["roles"]) == ["attention_like", "breakpoint", "collective"]


def test_one_call_declares_every_fact():
    register_op("regtest::keyed", role="attention_like", layer_keyed=True, capture_safe=True)
    reg = OpRegistry()
    assert reg.role_of_name("regtest::keyed") is A
    assert reg.is_layer_keyed("regtest::keyed") and reg.is_capture_safe("regtest::keyed")
    unregister_op("regtest::keyed")
    reg = OpRegistry()
    assert reg.role_of_name("regtest::keyed") is OpRole.ORDINARY
    assert not reg.is_layer_keyed("regtest::keyed") and not reg.is_capture_safe("regtest::keyed")


# ---- misuse -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "regtest::plain::x", "::plain", "regtest::", 3])
def test_bad_names_raise(name):
    with pytest.raises(ValueError, match="namespace::name"):
        register_op(name, role="breakpoint")
    with pytest.raises(ValueError, match="namespace::name"):
        register_capture_safe(name)


def test_unresolvable_names_raise():
    with pytest.raises(ValueError, match="does not resolve"):
        register_op("regtest::no_such_op", role="breakpoint")
    with pytest.raises(ValueError, match="does not resolve"):
        register_layer_keyed_op("regtest::no_such_op")
    with pytest.raises(ValueError, match="matches no op"):
        register_capture_safe("no_such_namespace::*")
    with pytest.raises(ValueError, match="does not resolve"):
        OpRegistry.from_config(CompilationConfig(attention_like_ops=["regtest::no_such_op"]))
    with pytest.raises(ValueError, match="has no role to remove"):
        OpRegistry.from_config(CompilationConfig(non_splitting_ops=["regtest::plain"]))


def test_unknown_roles_and_empty_declarations_raise():
    with pytest.raises(ValueError, match=r"unknown op role 'splitter'; valid roles: \['breakpoint'"):
        register_op("regtest::plain", role="splitter")
    with pytest.raises(ValueError, match="declares nothing"):
        register_op("regtest::plain")


def test_a_refused_declaration_records_nothing():
    with pytest.raises(ValueError, match="no argument named 'layer_name'"):
        register_op("regtest::plain", role="breakpoint", layer_keyed=True, capture_safe=True)
    with pytest.raises(ValueError, match="unknown op role"):
        register_op("regtest::keyed", role="nope", layer_keyed=True)
    reg = OpRegistry()
    for name in ("regtest::plain", "regtest::keyed"):
        assert reg.role_of_name(name) is OpRole.ORDINARY
        assert not reg.is_layer_keyed(name) and not reg.is_capture_safe(name)


# ---- who names the kernels' ops -------------------------------------------------------


def test_core_names_no_kernel_op_and_the_kernels_register_their_own():
    """In a fresh process, core alone (every core module) holds no `mrv2::`
    fact and loads no kernel; importing compile_backend.kernels registers each
    kernel's role, layer key and capture safety."""
    code = textwrap.dedent("""
        import pkgutil, sys, importlib
        import compile_backend.core as core
        for m in pkgutil.iter_modules(core.__path__):
            importlib.import_module(f"compile_backend.core.{m.name}")
        from compile_backend.core.op_registry import OpRegistry, OpRole
        reg = OpRegistry()
        facts = [*reg.summary().values(), reg.capture_safe_ops(), reg.layer_keyed_ops()]
        assert not any(n.startswith("mrv2::") for names in facts for n in names), facts
        assert "compile_backend.kernels" not in sys.modules

        import compile_backend.kernels
        reg = OpRegistry()
        ops = ["mrv2::unified_attention", "mrv2::rope_attention", "mrv2::reshape_and_cache",
               "mrv2::rope_and_cache", "mrv2::sconv", "mrv2::kv_compress"]
        assert all(reg.role_of_name(n) is OpRole.BREAKPOINT for n in ops[:2])
        assert all(reg.role_of_name(n) is OpRole.ATTENTION_LIKE for n in ops[2:])
        assert reg.layer_keyed_ops() == sorted(ops)
        # sibling_linear, linear_add, norm_linear, residual_norm_linear: ordinary
        # ops (no role, no layer name), capture-safe; all_reduce: a collective
        ordinary = ["mrv2::sibling_linear", "mrv2::linear_add", "mrv2::norm_linear",
                    "mrv2::residual_norm_linear"]
        assert reg.capture_safe_ops() == sorted(ops + ordinary + ["mrv2::all_reduce"])
        assert all(reg.role_of_name(n) is OpRole.ORDINARY for n in ordinary)
        assert reg.role_of_name("mrv2::all_reduce") is OpRole.COLLECTIVE
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stderr


def test_core_sources_hold_no_kernel_op_name():
    """No string in core's code (docstrings aside) is an `mrv2::` op name or
    the kernels' module path: core can neither name nor import them."""
    import ast
    import pathlib

    import compile_backend.core as core

    found = []
    for path in pathlib.Path(core.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings
                    and ("mrv2::" in node.value or "compile_backend.kernels" in node.value)):
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert found == []
