"""bench/op_timer.py (startup.py --by-op): the ops a region calls are counted
with their self time (a caller's figure leaves out its timed callees), and
everything it swapped is back after the region."""

import torch

from bench_scripts import load_bench_script


def test_op_timer_counts_self_time_and_puts_the_ops_back(monkeypatch):
    op_timer = load_bench_script("op_timer", monkeypatch)
    import compile_backend.kernels  # noqa: F401  (registers mrv2's ops)
    from compile_backend.compile.compiled_step import CompiledStep
    from compile_backend.compile.step_artifacts import _Loaded
    from compile_backend.runner import model_runner
    from compile_backend.runtime.cuda_graph import CUDAGraphWrapper

    packet = torch.ops.mrv2.linear_add
    overload, piece_call, step_call = packet.default, _Loaded.__call__, CompiledStep.__call__
    replay, inputs = CUDAGraphWrapper._replay, model_runner.prepare_inputs_to_capture
    gen = torch.Generator().manual_seed(36)
    x, w, res = (torch.randn(*s, generator=gen) for s in ((3, 8), (5, 8), (3, 5)))
    with op_timer.OpTimer() as timer:
        out = torch.ops.mrv2.linear_add.default(x, w, None, res)
        torch.ops.mrv2.linear_add.default(x, w, None, res)
    torch.testing.assert_close(out, res + x @ w.T)  # the timed call is the op's
    rows = {name: (calls, s) for name, calls, s in timer.rows()}
    assert rows["linear_add"][0] == 2 and rows["linear_add"][1] > 0
    # its torch form's GEMM (cuBLAS's on a GPU) is its own row, out of linear_add's self time
    assert rows["cuBLAS: F.linear"][0] == 2
    assert torch.nn.functional.linear is torch._C._nn.linear  # swapped back
    # norm_linear's three-launch form's norm and gate are found (its module, not the op's function)
    names = {name for _, _, name in op_timer._inner_callees()}
    assert {"norm_linear: rms_norm", "norm_linear: silu_mul", "cuBLAS: F.linear"} <= names
    assert abs(sum(s for _, s in rows.values()) - timer.total_s) < 1e-9  # outside: the rest
    assert packet.default is overload  # swapped back
    assert _Loaded.__call__ is piece_call and CompiledStep.__call__ is step_call
    assert CUDAGraphWrapper._replay is replay and model_runner.prepare_inputs_to_capture is inputs


def test_nested_calls_count_only_their_own_time(monkeypatch):
    op_timer = load_bench_script("op_timer", monkeypatch)
    timer = op_timer.OpTimer()
    inner = timer._timed("inner", lambda: sum(range(20000)))
    outer = timer._timed("outer", lambda: inner() + inner())
    outer()
    assert timer.calls == {"inner": 2, "outer": 1}
    assert 0 < timer.self_s["outer"] and 0 < timer.self_s["inner"]


def test_a_cold_starts_callees_are_timed_on_the_regions_thread_only(monkeypatch):
    """gc.collect stands for the cold callees (Triton's in-line compiles, the
    precompiler's waits, Inductor's tuning): timed on the region's thread,
    passed through on another (a precompile worker's), keyword arguments
    kept, all put back after."""
    import gc
    import threading

    from compile_backend.runtime.kernel_precompile import KernelPrecompiler

    op_timer = load_bench_script("op_timer", monkeypatch)
    collect, wait = gc.collect, KernelPrecompiler.wait
    with op_timer.OpTimer() as timer:
        gc.collect(generation=0)
        KernelPrecompiler(threads=1).wait()
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
    rows = {name: calls for name, calls, _ in timer.rows()}
    assert rows["gc.collect"] == 1 and rows["precompile wait"] == 1
    assert gc.collect is collect and KernelPrecompiler.wait is wait


def test_an_ops_direct_calls_are_timed_under_its_name_and_put_back(monkeypatch):
    """Eager pieces call breakpoint ops (PIECEWISE's attention) without the
    dispatcher, through core/direct_calls.py's wrapper of the op's body: the
    body inside that wrapper is timed, as the op, and put back after."""
    from compile_backend.core import direct_calls

    op_timer = load_bench_script("op_timer", monkeypatch)
    calls = []
    monkeypatch.setitem(direct_calls._DIRECT_IMPLS, "timedtoy::body", None)  # removed after
    direct_calls.register_direct_impl("timedtoy::body", lambda x: calls.append(x) or x + 1)
    wrapper = direct_calls._DIRECT_IMPLS["timedtoy::body"]
    with op_timer.OpTimer(namespaces=("mrv2", "timedtoy")) as timer:
        assert wrapper(1) == 2 and wrapper(2) == 3
    assert calls == [1, 2]
    rows = {name: calls for name, calls, _ in timer.rows()}
    assert rows["body"] == 2
    assert wrapper(3) == 4 and timer.calls["body"] == 2  # the body is back: untimed
    assert calls == [1, 2, 3]
