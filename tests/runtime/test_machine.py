"""runtime/machine.py: the device a runner is asked for, and what captures
graphs here."""

import pytest
import torch

import compile_backend as cb
from compile_backend.runtime.machine import check_device, graphs_here

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's errors")


def test_check_device_passes_what_this_machine_has():
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")


@CPU_ONLY
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_check_device_names_the_missing_gpu_and_the_fix(device):
    with pytest.raises(ValueError, match=r"no CUDA device.*Run on a GPU, or pass device='cpu'"):
        check_device(device)


@CPU_ONLY
def test_a_runner_on_a_missing_gpu_fails_at_once_with_the_fix():
    """Not deep inside its buffers with torch's pin_memory error."""
    from compile_backend.demo.engine import Engine
    from compile_backend.demo.models import build_model, preset

    model = build_model("llama", preset("tiny", num_layers=1))
    kv = cb.KVCacheConfig(num_blocks=8, block_size=16, max_model_len=64, max_num_reqs=2,
                          max_num_tokens=16)
    with pytest.raises(ValueError, match=r"device 'cuda': this machine has no CUDA device"):
        cb.ModelRunner(model, kv, cb.CompilationConfig(), "cuda")
    with pytest.raises(ValueError, match="no CUDA device"):  # before its caches are bound there
        Engine(model, kv, cb.CompilationConfig(), "cuda", progress=False)


def test_graphs_here_says_what_captures():
    from compile_backend.runtime.graph_standin import STANDIN_NOTE

    assert graphs_here("none") == "graphs: none (mode none)"
    with cb.standin_graphs():
        assert graphs_here("piecewise") == STANDIN_NOTE
    expected = "graphs: CUDA" if torch.cuda.is_available() else "stand-in"
    assert expected in graphs_here("piecewise")


def test_standin_graphs_is_public_and_lets_graph_modes_run_on_a_cpu():
    from compile_backend.core.graph_mode import CUDAGraphMode
    from compile_backend.runtime.machine import graph_mode_on_this_machine

    assert "standin_graphs" in cb.__all__ and cb.__all__ == sorted(cb.__all__)
    with cb.standin_graphs():
        assert graph_mode_on_this_machine(CUDAGraphMode.FULL) == (CUDAGraphMode.FULL, None)
