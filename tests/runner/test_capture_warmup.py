"""A runner's plan warms up per kernel configuration, not per size
(runtime/jit_guard.py): it captures first, and a capture that would make
Triton compile a kernel raises before any device call, is dropped, warmed up
and captured again. The kernel here is a stand-in for a Triton kernel: an op
that, like Triton's JIT, asks `triton.knobs.runtime.jit_cache_hook` before
it "compiles" a configuration it has not seen (here: T == 1, T % 4 == 0)."""

import pytest
import torch
from torch import nn

import compile_backend as cb
from compile_backend.core.forward_context import ForwardContext, set_forward_context
from compile_backend.runner.input_batch import InputBatch
from compile_backend.runner.model_runner import ModelRunner
from compile_backend.runtime import jit_guard
from compile_backend.runtime.graph_pool import use_graph_backend
from compile_backend.runtime.graph_standin import StandInGraphs
from runtime_helpers import kv_config

triton = pytest.importorskip("triton")
if not hasattr(getattr(triton, "knobs", None), "runtime"):
    pytest.skip("this Triton has no knobs.runtime.jit_cache_hook", allow_module_level=True)

SIZES = [1, 2, 4, 8, 16]
COMPILED: list[tuple[tuple[bool, bool], bool]] = []  # (configuration, capturing) per "compile"


def _config(t: int) -> tuple[bool, bool]:
    return t == 1, t % 4 == 0


@torch.library.custom_op("toy::jit_scale", mutates_args=())
def jit_scale(x: torch.Tensor) -> torch.Tensor:
    cfg = _config(x.shape[0])
    if cfg not in {c for c, _ in COMPILED}:
        hook = triton.knobs.runtime.jit_cache_hook  # what Triton's JIT asks before compiling
        if hook is not None:
            hook(key=cfg, repr=f"toy_jit_scale[{cfg}]", fn=None, compile={},
                 is_manual_warmup=False, already_compiled=False)
        COMPILED.append((cfg, jit_guard.capturing()))
    return x * 2 + 1


@jit_scale.register_fake
def _(x):
    return torch.empty_like(x)


cb.register_capture_safe("toy::jit_scale")  # a kernel launch: capturable


class JitModel(nn.Module):
    vocab_size = 64

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, input_ids, positions):
        h = self.embed(input_ids) + positions[:, None].float()
        return self.head(torch.ops.toy.jit_scale(self.proj(h)))


def _captured_runner(mode, capture_warmup):
    torch.manual_seed(0)
    COMPILED.clear()
    cb.reset_counters()
    model = JitModel()
    config = cb.CompilationConfig(cudagraph_mode=mode, capture_sizes=SIZES, piece_compiler="eager",
                                  capture_warmup=capture_warmup, cache_dir=None)
    runner = ModelRunner(model, kv_config(), config, "cpu", progress=False)
    runner.warmup(max(SIZES))  # the first call compiles, at the largest size
    compiled_at_warmup = {c for c, _ in COMPILED}
    runner.capture()
    return runner, model, compiled_at_warmup


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_plan_warms_up_once_per_new_kernel_configuration(mode):
    import triton  # noqa: F401  (the guard looks for Triton)

    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, model, at_warmup = _captured_runner(mode, "on_demand")
        plan = runner.capture_plan()
        new = {_config(s.num_tokens) for s in plan} - at_warmup
        assert cb.counters["capture_warmups"] == len(new) == 2  # T=2 and T=1
        assert cb.counters["capture_warmups_skipped"] == len(plan) - len(new)
        assert not any(capturing for _, capturing in COMPILED)  # never inside a capture
        assert len(COMPILED) == len({c for c, _ in COMPILED}) == 3
        assert cb.counters["triton_compiles"] == 2  # the warm-ups', counted by the guard
        assert sum(r.warmup_s > 0 for r in runner.captures) == 2
        # Every size replays what the model computes eagerly, the retried ones included.
        gen = torch.Generator().manual_seed(1)
        for t in (1, 2, 3, 4, 8, 16):
            ids = torch.randint(0, 64, (t,), generator=gen).tolist()
            batch = InputBatch(ids, [1] * t, [1 + i % 3 for i in range(t)], list(range(t))) \
                if t <= 4 else InputBatch(ids, [t], [t], [0])
            out = runner.execute(batch).clone()
            assert runner.dispatch(batch).mode is not cb.CUDAGraphMode.NONE
            ids_t = runner.input_buffers.input_ids[:t].clone()
            pos_t = runner.input_buffers.positions[:t].clone()
            torch.testing.assert_close(out, model(ids_t, pos_t), rtol=1e-6, atol=1e-6)


def test_every_size_warms_up_before_every_capture():
    import triton  # noqa: F401

    with use_graph_backend(StandInGraphs()), torch.no_grad():
        runner, _, _ = _captured_runner("piecewise", "every_size")
        assert cb.counters["capture_warmups"] == len(runner.capture_plan())
        assert cb.counters["capture_warmups_skipped"] == 0
        assert all(r.warmup_s > 0 for r in runner.captures)
        # no guard then: the warm-ups' two new configurations asked no hook of ours
        assert len(COMPILED) == 3 and cb.counters["triton_compiles"] == 0


def test_the_guard_raises_only_inside_a_capture_and_restores_the_hook():
    import triton  # noqa: F401

    seen = []
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["repr"])
    try:
        cb.reset_counters()
        with jit_guard.no_compile_in_capture():
            hook = triton.knobs.runtime.jit_cache_hook
            hook(repr="k[num_warps=4](x)", fn=None)
            assert seen == ["k[num_warps=4](x)"] and cb.counters["triton_compiles"] == 1
            ctx = ForwardContext()
            ctx.capturing = True
            with set_forward_context(ctx), pytest.raises(jit_guard.CompileInCapture,
                                                         match="Triton would compile k during"):
                hook(repr="k[num_warps=4](x)", fn=None)
            assert len(seen) == 1  # refused: the chained hook is not asked either
        assert triton.knobs.runtime.jit_cache_hook is not hook
        assert triton.knobs.runtime.jit_cache_hook.__name__ == "<lambda>"
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


def test_on_demand_is_the_default():
    assert cb.CompilationConfig().capture_warmup == "on_demand"


def test_an_unknown_capture_warmup_is_refused():
    with pytest.raises(ValueError, match="capture_warmup must be one of 'every_size', 'on_demand'"):
        cb.CompilationConfig(capture_warmup="never")


def test_inductors_first_launch_compile_and_autotune_are_refused_inside_a_capture():
    """Inductor's kernels bypass Triton's JIT: their first launch compiles
    (precompile) or benchmarks its configurations (autotune_to_one_config),
    which a capture refuses (seen on the H200). Inside a capture the guard
    raises before either; outside, it calls them; after, they are torch's own."""
    import triton  # noqa: F401
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    before = {n: CachingAutotuner.__dict__[n] for n in jit_guard._INDUCTOR_FIRST_LAUNCH}
    with jit_guard.no_compile_in_capture():
        assert all(CachingAutotuner.__dict__[n] is not f for n, f in before.items())
        ctx = ForwardContext()
        ctx.capturing = True
        with set_forward_context(ctx):
            for name in jit_guard._INDUCTOR_FIRST_LAUNCH:
                with pytest.raises(jit_guard.CompileInCapture, match=name):
                    getattr(CachingAutotuner, name)(object())
        with pytest.raises(AttributeError):  # not capturing: torch's own method runs
            CachingAutotuner.autotune_to_one_config(object())
    assert {n: CachingAutotuner.__dict__[n] for n in before} == before


def test_a_plan_before_any_step_compiles_first_then_enters_the_guard(monkeypatch):
    """capture() on a runner that never stepped: the model compiles (and
    imports what its pieces need, Inductor's runtime among them) in one
    warm-up before the guard is entered, so the guard's Inductor patch sees
    that runtime (seen on the H200: compiled inside the plan, a first-launch
    autotune ran unguarded in a capture)."""
    import triton  # noqa: F401

    entered = []
    guard = jit_guard.no_compile_in_capture
    runner_box = []

    def recording_guard():
        entered.append(runner_box[0]._stepped)
        return guard()

    monkeypatch.setattr(jit_guard, "no_compile_in_capture", recording_guard)
    with use_graph_backend(StandInGraphs()), torch.no_grad():
        torch.manual_seed(0)
        COMPILED.clear()
        cb.reset_counters()
        model = JitModel()
        config = cb.CompilationConfig(cudagraph_mode="piecewise", capture_sizes=SIZES,
                                      piece_compiler="eager", capture_warmup="on_demand",
                                      cache_dir=None)
        runner = ModelRunner(model, kv_config(), config, "cpu", progress=False)
        runner_box.append(runner)
        runner.capture()
        assert entered == [True]  # compiled before the guard
        assert cb.counters["dynamo_graphs"] == 1
        assert not any(capturing for _, capturing in COMPILED)
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(0, 64, (8,), generator=gen).tolist()
        out = runner.execute(InputBatch(ids, [8], [8], [0])).clone()
        want = model(runner.input_buffers.input_ids[:8].clone(),
                     runner.input_buffers.positions[:8].clone())
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
