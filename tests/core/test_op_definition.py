"""core/op_definition.py: an op defined with define_op runs its body through one
kernel (no autograd or ADInplaceOrView layer in front), gets its schema from
the annotations (written arguments marked), takes a fake as usual, and
compiles: a written argument is written by the compiled function as by eager."""

import pytest
import torch

import compile_backend.kernels  # noqa: F401  (defines the mrv2 ops)
from compile_backend.core.op_definition import define_op


@define_op("mrv2_test_def::scale_into")
def scale_into(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@torch.library.register_fake("mrv2_test_def::scale_into")
def _(x, factor):
    return torch.empty_like(x)


@define_op("mrv2_test_def::accumulate", mutates_args=("state",))
def accumulate(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    state.add_(x.sum(0))
    return x + state


@torch.library.register_fake("mrv2_test_def::accumulate")
def _(x, state):
    return torch.empty_like(x)


def test_schema_inferred_with_written_arguments():
    assert str(torch.ops.mrv2_test_def.scale_into.default._schema) == \
        "mrv2_test_def::scale_into(Tensor x, float factor) -> Tensor"
    args = torch.ops.mrv2_test_def.accumulate.default._schema.arguments
    assert [(a.name, a.alias_info is not None and a.alias_info.is_write) for a in args] == \
        [("x", False), ("state", True)]


def test_the_fake_gives_the_shape_without_running_the_body():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(4, 6)
        out = torch.ops.mrv2_test_def.accumulate(x, torch.empty(6))
    assert out.shape == (4, 6) and type(out).__name__ == "FakeTensor"


@pytest.mark.parametrize("op", ["sibling_linear", "norm_linear", "linear_add", "all_reduce", "sconv",
                                "kv_compress", "unified_attention", "rope_and_cache",
                                "reshape_and_cache"])
def test_every_kernel_op_has_only_its_body_kernel(op):
    name = f"mrv2::{op}"
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has(name, "CompositeExplicitAutograd")
    assert not has(name, "Autograd") and not has(name, "ADInplaceOrView")  # custom_op's layers


def test_compiled_writes_the_state_as_eager_does():
    torch.manual_seed(7)
    x = torch.randn(5, 3)
    state_eager, state_compiled = torch.randn(3), None
    state_compiled = state_eager.clone()

    def fn(x, state):
        return torch.ops.mrv2_test_def.accumulate(torch.ops.mrv2_test_def.scale_into(x, 2.0), state) * 3

    with torch.no_grad():
        want = fn(x, state_eager)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        got = compiled(x, state_compiled)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(state_compiled, state_eager, rtol=0, atol=0)
        got = compiled(x, state_compiled)  # the second call reads the written state
        want = fn(x, state_eager)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(state_compiled, state_eager, rtol=0, atol=0)
