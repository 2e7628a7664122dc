"""Eager pieces call registered ops without the dispatcher while grad is off
(compile_backend/core/direct_calls.py), and compute the same as through it."""

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.core.direct_calls import direct_call, register_direct_impl
from compile_backend.runtime.graph_standin import StandInGraphs
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.demo.models import build_model, preset
from runtime_helpers import kv_config

CALLS: list[str] = []


@torch.library.custom_op("toy_direct::scale", mutates_args=())
def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    CALLS.append("dispatcher")
    return x * factor


@scale.register_fake
def _(x, factor):
    return torch.empty_like(x)


def _scale_direct(x, factor):
    CALLS.append("direct")
    return x * factor


register_direct_impl("toy_direct::scale", _scale_direct)


def test_direct_call_skips_the_dispatcher_only_with_grad_off():
    fn = direct_call(torch.ops.toy_direct.scale.default)
    assert fn.__name__ == "direct_toy_direct_scale"
    x = torch.randn(5)
    CALLS.clear()
    with torch.no_grad():
        torch.testing.assert_close(fn(x, 3.0), x * 3.0)
    torch.testing.assert_close(fn(x, 2.0), x * 2.0)  # grad on: through the dispatcher
    assert CALLS == ["direct", "dispatcher"]
    assert direct_call(torch.ops.aten.add.Tensor) is None  # registered none


def test_register_direct_impl_rejects_a_bad_name():
    with pytest.raises(ValueError, match="namespace::name"):
        register_direct_impl("scale", _scale_direct)


@pytest.mark.parametrize("mode", ["none", "piecewise"])
def test_attention_ops_of_eager_pieces_run_direct_and_equal_the_dispatcher(mode, monkeypatch):
    """The tiny Llama through the runner, with and without direct calls, on
    fresh random prompts: same logits (bit for bit: same kernels), and each
    layer's breakpoint (attention; its KV write runs inside the piece before)
    rewritten."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU: the ops' torch references
    outs = {}
    for direct in (True, False):
        torch._dynamo.reset()
        cb.reset_counters()
        model = build_model("llama", preset("tiny", num_layers=2))
        kv = kv_config()
        model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cpu")
        cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[1, 2, 4, 8, 16],
                                   piece_compiler="eager", direct_op_calls=direct)
        with use_graph_backend(StandInGraphs()), torch.no_grad():
            runner = ModelRunner(model, kv, cfg, "cpu", progress=False)
            runner.capture()
            batch = InputBatch(
                token_ids=torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(3)).tolist(),
                query_lens=[5, 2], seq_lens=[5, 2], req_slots=[0, 1],
                block_ids=[[1], [2]], compressed_block_ids=[[1], [2]])
            outs[direct] = runner.execute(batch).clone()
        assert cb.counters["direct_calls"] == (2 if direct else 0)
    assert outs[True].abs().sum() > 0 and torch.equal(outs[True], outs[False])
