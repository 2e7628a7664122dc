"""check_against_eager's report: what was captured and replayed, by what
(CUDA, the CPU stand-in, nothing), and a warning when a graph mode captured
nothing. On a runner, the graphs its capture() makes are counted."""

import warnings

import pytest
import torch

from compile_backend import CompilationConfig, InputBatch, ModelRunner
from compile_backend.demo.models import build_model, preset
from compile_backend.runtime.graph_standin import STANDIN_NOTE
from compile_backend.testing import NothingCapturedWarning, check_against_eager
from runtime_helpers import _torch_reference_kernels, kv_config  # noqa: F401  (autouse fixture)

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's reports")


def _runner(mode="piecewise"):
    model = build_model("llama", preset("tiny", num_layers=1))
    kv = kv_config(max_num_tokens=8)
    model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, "cpu")
    cfg = CompilationConfig(cudagraph_mode=mode, capture_sizes=[2, 4], piece_compiler="eager")
    return ModelRunner(model, kv, cfg, "cpu", progress=False)


def _batches():
    """A 3-token prefill of request 0, then decode steps of it and a new request."""
    return [InputBatch([1, 2, 3], [3], [3], [0], block_ids=[[1]]),
            InputBatch([4], [1], [4], [0], block_ids=[[1]]),
            InputBatch([5, 6], [1, 1], [5, 1], [0, 1], block_ids=[[1], [2]])]


def test_runner_report_counts_the_graphs_capture_made(recwarn):
    """The runner captures before the first call: those graphs are the
    report's captures (it said captures=0 beside replays=6 before)."""
    report = check_against_eager(_runner(), _batches(), modes=["piecewise"], standin=True)
    r = report["piecewise"]
    assert r.calls == 3 and r.replays > 0
    assert r.captures >= 2  # two capture sizes, a graph per captured piece each
    assert r.graphs == STANDIN_NOTE and STANDIN_NOTE in str(report)
    assert f"{r.captures} graphs captured, {r.replays} replays" in str(report)
    assert not [w for w in recwarn if w.category is NothingCapturedWarning]


@CPU_ONLY
def test_a_graph_mode_that_captured_nothing_warns_and_names_the_fix():
    with pytest.warns(NothingCapturedWarning, match=r"mode piecewise captured no graph.*"
                                                     r"no CUDA device.*standin=True"):
        report = check_against_eager(_runner(), _batches(), modes=["piecewise"])
    r = report["piecewise"]
    assert (r.captures, r.replays) == (0, 0)
    assert "no CUDA device" in r.graphs and "stand-in" in r.graphs


def test_mode_none_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingCapturedWarning)
        report = check_against_eager(_runner("none"), _batches(), modes=["none"])
    assert report["none"].graphs == "graphs: none (mode none)"


def test_a_builtin_module_is_compiled_and_captured():
    """Compiled in place, an nn.Sequential ran uncompiled (Dynamo skips
    torch.nn's frames): the check compared eager with eager, silently."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    calls = [(torch.randn(5, 16),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingCapturedWarning)
        report = check_against_eager(model, calls, modes=["piecewise"], standin=True,
                                     options={"piece_compiler": "eager"})
    r = report["piecewise"]
    assert r.dynamo_graphs == 1 and r.captures == 1 and r.replays == 2


def test_a_model_dynamo_never_hands_over_warns_so():
    class Eager(torch.nn.Module):
        @torch.compiler.disable
        def forward(self, x):
            return x * 2

    calls = [(torch.randn(4),) for _ in range(3)]
    with pytest.warns(NothingCapturedWarning, match="Dynamo handed mrv2 no graph"):
        report = check_against_eager(Eager(), calls, modes=["piecewise"], standin=True)
    assert report["piecewise"].dynamo_graphs == 0
