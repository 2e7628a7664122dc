"""Users' own attention-like ops with their own metadata kind
(`compile_backend.register_metadata_builder`), through ModelRunner in every
graph mode with the CPU graph stand-in, against an eager run. Regression: a
layer with its own `metadata_kind` was refused ("has no metadata builder")
unless the internal BUILDERS table was edited."""

import ast
import copy
import inspect
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import compile_backend as cb
from compile_backend.runner.block_tables import BlockTables
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.examples import running_state
from compile_backend.examples.running_state import RunningSum, RunningSumMetadata
from compile_backend.runtime.graph_standin import StandInGraphs
from compile_backend.runner.input_buffers import InputBuffers
from compile_backend.runner.metadata_builders import BUILDERS, AttentionMetadataBuilder
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.runner.model_state import attention_groups_for
from compile_backend.kernels.layers import PagedAttention
from runtime_helpers import CAPTURE_SIZES, kv_config
from runtime_helpers import _torch_reference_kernels, copy_batch as _copy, random_schedule as _random_schedule  # noqa: F401 (fixture)

Mode = cb.CUDAGraphMode
MODES = ["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]
OP = "running_state::running_sum"


@pytest.fixture(autouse=True)
def _restore_builders():
    """Registrations made by a test do not outlive it."""
    saved = dict(BUILDERS)
    yield
    BUILDERS.clear()
    BUILDERS.update(saved)


class UserModel(nn.Module):
    """embed -> running sum -> paged attention -> running sum -> logits:
    the user's op on both sides of a breakpoint."""

    def __init__(self, vocab: int = 256, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.sum0 = RunningSum(dim, "layers.0.sum")
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn = PagedAttention(heads, heads, dim // heads, "layers.0.attn")
        self.sum1 = RunningSum(dim, "layers.1.sum")
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + self.sum0(h) / 16
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + self.attn(q, k, v)
        h = h + self.sum1(h) / 16
        return self.head(h)

    def get_input_embeddings(self) -> nn.Embedding:  # the runner checks token ids against it
        return self.embed

    def states(self) -> dict[str, torch.Tensor]:
        return {"sum0": self.sum0.state, "sum1": self.sum1.state}


def _runner(model: UserModel, mode: str) -> ModelRunner:
    kv = kv_config()
    model.attn.bind_kv_cache(kv.num_blocks, kv.block_size, torch.float32, "cpu")
    for layer in (model.sum0, model.sum1):
        layer.bind_state(kv.max_num_reqs, torch.float32, "cpu")
    cfg = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=CAPTURE_SIZES,
                               piece_compiler="eager")
    return ModelRunner(model, kv, cfg, "cpu", progress=False)


def test_user_op_with_its_own_metadata_equals_eager_in_every_mode():
    """Fresh random mixed prefill/decode batches, requests starting over in
    used slots: logits and the op's state equal mode none's after every step."""
    torch.manual_seed(0)
    base = UserModel()
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runners = {m: _runner(copy.deepcopy(base), m) for m in MODES}
        for r in runners.values():
            r.capture()
        for step, batch in enumerate(_random_schedule(seed=5, steps=12)):
            ref = runners["none"].execute(_copy(batch)).clone()
            ref_states = runners["none"].model.states()
            assert any(s.abs().sum() > 0 for s in ref_states.values())
            for m in MODES[1:]:
                out = runners[m].execute(_copy(batch))
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                           msg=lambda s: f"{m}, step {step}: {s}")
                for name, state in runners[m].model.states().items():
                    torch.testing.assert_close(state, ref_states[name], atol=1e-5, rtol=1e-5,
                                               msg=lambda s: f"{m} {name}, step {step}: {s}")
    assert cb.counters["cudagraph_replays"] > 10
    piecewise = next(s for s in cb.compiled_steps() if s.graph_mode is Mode.PIECEWISE)
    assert [p.captured for p in piecewise.pieces] == [True, False, True]
    assert [p.attention_like.count(OP) for p in piecewise.pieces] == [1, 0, 1]
    for mode in MODES[1:]:  # built at every capture, with the mode's for_capture
        for rec in runners[mode].captures:
            assert rec.for_capture["running_sum"] == (rec.graph.mode is cb.CUDAGraphMode.FULL), (mode, rec)


def _reference(x, state, qsl, slots, has_init):
    """The op's definition, one request at a time; updates state in place."""
    out = torch.zeros_like(x)
    for b, slot in enumerate(slots):
        if slot < 0:
            continue
        prev = state[slot].clone() if has_init[b] else torch.zeros_like(state[slot])
        run = prev + x[qsl[b]: qsl[b + 1]].cumsum(0)
        out[qsl[b]: qsl[b + 1]] = run
        state[slot] = run[-1] if len(run) else prev
    return out


def test_running_sum_op_matches_its_definition():
    """Padding row and padding tokens read and write nothing; a new request
    starts from 0 whatever its slot held."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4, generator=g)
    state = torch.randn(4, 4, generator=g)
    qsl, slots, has_init = [0, 3, 4, 7, 7], [2, 0, 3, -1], [True, False, True, False]
    want_state = state.clone()
    want = _reference(x, want_state, qsl, slots, has_init)
    ctx = cb.ForwardContext(attn_metadata={"l": RunningSumMetadata(
        torch.tensor(qsl, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32),
        torch.tensor(has_init))})
    with cb.set_forward_context(ctx):
        out = torch.ops.running_state.running_sum(x, state, "l")
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(state, want_state)
    assert out[7:].abs().sum() == 0  # padding tokens


def _code(source: str) -> str:
    """The AST without docstrings and `from __future__` imports."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [n for n in body if not (
                isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                and isinstance(n.value.value, str))
                and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    return ast.dump(tree)


def test_readme_example_is_the_tested_module():
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("### Your own attention-like ops"):]
    start = section.index("```python\n") + len("```python\n")
    block = section[start: section.index("```\n", start)]
    assert _code(block) == _code(inspect.getsource(running_state))


# ---- registration -------------------------------------------------------------------


class _Builder(cb.BaseMetadataBuilder):
    kind = "mine"

    def persistent_tensors(self):
        return {}

    def build(self, batch, *, for_capture):
        return None


def _variant(**attrs):
    return type("Variant", (_Builder,), attrs)


class _NoBuild:
    kind, capture_support, attention_like = "mine", cb.CaptureSupport.ALWAYS, False

    def __init__(self, cfg, buffers, tables):
        pass

    def persistent_tensors(self):
        return {}


class _BadInit(_Builder):
    def __init__(self, cfg):
        pass


@pytest.mark.parametrize("kind, cls, error, message", [
    ("mine", _NoBuild, TypeError, r"lacks \['build'\].*BaseMetadataBuilder"),
    ("mine", _variant(kind="other"), ValueError, r"declares kind 'other'.*set `kind = 'mine'`"),
    ("mine", _variant(attention_like=True, capture_support=cb.CaptureSupport.UNIFORM_BATCH),
     ValueError, r"UNIFORM_BATCH; it must build capturable metadata always"),
    ("mine", _variant(capture_support=3), TypeError, "must be a CaptureSupport member"),
    ("mine", _BadInit, TypeError, r"builder_cls\(kv_cache_config, input_buffers, block_tables\)"),
    ("mine", _Builder(None, None, None), TypeError, "takes the builder class"),
    ("", _Builder, TypeError, "non-empty string"),
    ("attention", _variant(kind="attention"), ValueError,
     r"'attention' is already registered to .*AttentionMetadataBuilder; give .* another kind"),
])
def test_registration_refuses_what_does_not_follow_the_protocol(kind, cls, error, message):
    with pytest.raises(error, match=message):
        cb.register_metadata_builder(kind, cls)
    assert BUILDERS.get(kind) in (None, AttentionMetadataBuilder)


def test_registration_is_idempotent_for_the_same_class():
    assert cb.register_metadata_builder("mine", _Builder) is _Builder
    assert cb.register_metadata_builder("mine", _Builder) is _Builder
    assert BUILDERS["mine"] is _Builder


def test_registering_loads_neither_dynamo_nor_triton():
    """compile_backend loads its names lazily; registration keeps it so."""
    code = ("import sys, compile_backend as cb, compile_backend.examples.running_state; "
            "cb.register_metadata_builder; "
            "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parents[2])
    assert out.stdout.strip() == "[]"


def test_layer_kind_without_a_builder_names_register_metadata_builder():
    cfg = kv_config()

    class Layer(nn.Module):
        metadata_kind, layer_name = "nobody_registered", "layer0"

    bufs, tables = InputBuffers.allocate(cfg, "cpu"), BlockTables(cfg, "cpu")
    with pytest.raises(ValueError, match=r"register_metadata_builder\('nobody_registered', "):
        attention_groups_for(Layer(), cfg, bufs, tables)
    cb.register_metadata_builder("nobody_registered", _variant(kind="nobody_registered"))
    groups = attention_groups_for(Layer(), kv_config(), bufs, tables)
    assert [g.builder.kind for g in groups] == ["nobody_registered"]
    assert groups[0].layer_names == ["layer0"]
