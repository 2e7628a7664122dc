"""tp_all_reduce (compile_backend/core/all_reduce.py): the algorithm per message
as a pure function; the pass that puts `mrv2::all_reduce` in place of the
functional collective, which stays a collective to the splitter and to the
capture-safety pass; the fallback to the functional collective where no
symmetric memory is set up (counted, logged once, the same sums); ranks that
disagree raising; and on 2 GPUs, the one-shot path against NCCL."""

import json
import logging
import random

import pytest
import torch
import torch.distributed as dist

import compile_backend as cb
import compile_backend.core.all_reduce as ar
import compile_backend.kernels  # noqa: F401  (mrv2::all_reduce)
import toy_ops  # noqa: F401  (registers toy::attn)
from compile_backend.core.config import CompilationConfig
from compile_backend.core.op_registry import EAGER_REASON, OpRegistry, OpRole, node_op_name
from compile_backend.passes import CaptureSafetyPass, PassManager, SymmetricAllReducePass
from test_parallel import _all_reduce_graph, _print_runs, _torchrun

KIB = 1024
BF16, F32 = torch.bfloat16, torch.float32


# ---- the choice -------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, dtype, mode, capable, threshold, want", [
    (8 * KIB, BF16, "auto", True, 512 * KIB, "one_shot"),
    (512 * KIB, BF16, "auto", True, 512 * KIB, "one_shot"),   # the threshold itself: one-shot
    (512 * KIB + 16, BF16, "auto", True, 512 * KIB, "nccl"),  # above it: NCCL
    (2048 * KIB, F32, "one_shot", True, 2048 * KIB, "one_shot"),
    (8 * KIB, BF16, "nccl", True, 512 * KIB, "nccl"),         # the mode says NCCL
    (8 * KIB, BF16, "auto", False, 512 * KIB, "nccl"),        # no symmetric memory
    (8 * KIB, torch.float16, "auto", True, 512 * KIB, "nccl"),  # the kernels: fp32, bf16 only
    (8 * KIB + 2, BF16, "auto", True, 512 * KIB, "nccl"),     # not a multiple of 16 bytes
    (0, BF16, "auto", True, 512 * KIB, "nccl"),
])
def test_the_algorithm_is_a_function_of_size_dtype_capability_threshold_and_mode(
        nbytes, dtype, mode, capable, threshold, want):
    assert ar.choose_all_reduce(nbytes, dtype, mode=mode, capable=capable,
                                threshold=threshold) == want


def test_the_config_checks_the_mode_and_threshold_and_enters_the_cache_keys():
    with pytest.raises(ValueError, match=r"tp_all_reduce must be one of 'nccl', 'auto', 'one_shot', "
                                         r"got 'two_shot'"):
        CompilationConfig(tp_all_reduce="two_shot")
    with pytest.raises(ValueError, match="tp_all_reduce_threshold must be an int"):
        CompilationConfig(tp_all_reduce_threshold=0)
    with pytest.raises(ValueError, match="tp_all_reduce must be one of"):
        ar.choose_all_reduce(16, BF16, mode="fast", capable=True, threshold=16)
    base = CompilationConfig()
    assert base.tp_all_reduce == "nccl" and base.tp_all_reduce_threshold == 512 * KIB
    assert {"tp_all_reduce", "tp_all_reduce_threshold"} <= set(base.summary())  # step cache key
    roles = OpRegistry()
    uuids = {PassManager.from_config(CompilationConfig(**kw), roles).uuid() for kw in (
        {}, {"tp_all_reduce": "auto"}, {"tp_all_reduce": "auto", "tp_all_reduce_threshold": 4096})}
    assert len(uuids) == 3


# ---- the pass ---------------------------------------------------------------------


@pytest.fixture
def one_rank_gloo():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    ar.free_symmetric_buffers()
    dist.destroy_process_group()


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(ar, "_LOGGED", set())


def _graph(device, group_name):
    """x -> all_reduce -> wait -> sin over [4, 8] (test_parallel's graph)."""
    return _all_reduce_graph(device, group_name, shape=(4, 8))[0]


def _ready(monkeypatch, group_name):
    """Pretend the group's symmetric buffers are set up (the op then still
    runs NCCL's place on CPU tensors)."""
    monkeypatch.setitem(ar._READY, group_name, ar.SymmetricAllReduce(group_name, 4096, {}))


def test_without_symmetric_memory_the_functional_collective_stays_counted_and_logged_once(
        one_rank_gloo, fresh_log, caplog):
    name = one_rank_gloo.group_name
    with caplog.at_level(logging.WARNING, logger="compile_backend.core.all_reduce"):
        for _ in range(2):
            g = _graph("cpu", name)
            report = SymmetricAllReducePass(OpRegistry(), mode="auto")(g)
            assert not report.changed and len(report.details["left_on_nccl"]) == 1
            assert [node_op_name(n) for n in g.nodes if n.op == "call_function"][:2] == [
                "_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"]
    assert cb.counters["all_reduce_fallbacks"] == 2
    warnings = [r.getMessage() for r in caplog.records if "NCCL all-reduce" in r.getMessage()]
    assert len(warnings) == 1 and "no symmetric buffer" in warnings[0], warnings
    # "nccl" (the default) leaves the graph alone and counts nothing
    assert not SymmetricAllReducePass(OpRegistry())(_graph("cpu", name)).changed
    assert cb.counters["all_reduce_fallbacks"] == 2


def test_the_rewritten_all_reduce_is_still_a_collective_to_capture_safety(one_rank_gloo,
                                                                         monkeypatch):
    import compile_backend.passes.capture_safety as cs

    name = one_rank_gloo.group_name
    _ready(monkeypatch, name)
    g = _graph("cuda", name)
    assert SymmetricAllReducePass(OpRegistry(), mode="auto", threshold=4096)(g).changed
    calls = [n for n in g.nodes if n.op == "call_function"]
    assert [node_op_name(n) for n in calls][0] == "mrv2::all_reduce" and len(calls) == 2
    new = calls[0]
    assert new.args[1:] == (4096, name) and new.meta["example_value"].shape == (4, 8)
    assert OpRegistry().role(new) is OpRole.COLLECTIVE
    CaptureSafetyPass(OpRegistry())(g)  # gloo in a CUDA graph: kept out, as funcol's would be
    assert "backend 'gloo'" in new.meta[EAGER_REASON]
    assert cb.counters["collective_fallbacks"] == 1
    del new.meta[EAGER_REASON]
    monkeypatch.setattr(cs, "group_backend", lambda group: "nccl")
    assert not CaptureSafetyPass(OpRegistry())(g).changed  # NCCL: captured


def _compile_all_reduce_step(group_name, piece_compiler):
    """breakpoint -> matmul, all-reduce -> breakpoint, compiled and checked
    against eager once (one rank: the sum is the value); returns its pieces."""
    import torch.distributed._functional_collectives as funcol

    def step(x, w):
        h = torch.ops.toy.attn(x, x, x)  # breakpoint
        y = funcol.all_reduce(h @ w, "sum", group_name)
        return torch.ops.toy.attn(y, y, y) + y

    x, w = torch.randn(6, 8), torch.randn(8, 8)
    compiled = torch.compile(step, backend="mrv2", options={
        "splitting_ops": ["toy::attn"], "piece_compiler": piece_compiler, "tp_all_reduce": "auto",
        "inductor_min_fusible_ops": 0})  # the last piece's one add is Inductor's too
    torch.testing.assert_close(compiled(x, w), step(x, w), atol=1e-5, rtol=1e-5)
    return cb.compiled_steps()[-1].pieces


def test_compiled_the_op_sits_inside_a_captured_piece_and_sums(one_rank_gloo, monkeypatch):
    name = one_rank_gloo.group_name
    _ready(monkeypatch, name)
    x = torch.randn(6, 8)
    pieces = _compile_all_reduce_step(name, "eager")
    assert [(p.captured, p.collectives) for p in pieces] == [
        (False, []), (True, ["mrv2::all_reduce"]), (False, []), (True, [])]
    assert torch.equal(torch.ops.mrv2.all_reduce(x, 4096, name), x)  # 1 rank: the sum is x


def test_a_piece_with_a_collective_compiles_here_not_in_a_compile_worker(one_rank_gloo,
                                                                        monkeypatch):
    """A worker joins no process group: the piece holding the all-reduce is
    never sent; the other captured piece is (here its worker fails, so it
    compiles here too, counted)."""
    from concurrent.futures import Future

    from compile_backend.compile import backend, piece_compiler

    name = one_rank_gloo.group_name
    _ready(monkeypatch, name)
    sent = []

    class Workers:
        def submit(self, remote, job, local=None):
            sent.append(job)
            future = Future()
            future.set_exception(RuntimeError("no worker in this test"))
            return future

        def run_queued_here(self):
            return 0

        def close(self):
            pass

    monkeypatch.setattr(backend, "_start_workers", lambda config: Workers())
    real = piece_compiler.compile_piece
    monkeypatch.setattr(piece_compiler, "compile_piece",
                        lambda gm, args, compiler, serializable=False: real(gm, args, "eager"))
    pieces = _compile_all_reduce_step(name, "inductor")
    assert [(p.captured, bool(p.collectives)) for p in pieces] == [
        (False, False), (True, True), (False, False), (True, False)]
    assert len(sent) == 1 and cb.counters["compile_worker_fallbacks"] == 1


def test_one_rank_sets_up_nothing_and_freeing_clears_every_group(monkeypatch):
    from compile_backend.core.parallel import TensorParallel

    assert ar.setup_all_reduce(TensorParallel(), "one_shot", 4096) is None
    _ready(monkeypatch, "g")
    assert ar.ready_groups() == ["g"] and ar.free_symmetric_buffers() == 1
    assert ar.symmetric_all_reduce("g") is None


# ---- two processes ----------------------------------------------------------------------


@pytest.mark.slow  # full tier: a subprocess (2 ranks, about 10 s on 2 cores)
def test_two_gloo_ranks_fall_back_sum_equally_and_raise_when_they_disagree(tmp_path):
    proc = _torchrun(["tests/runner/all_reduce_worker.py", "--device", "cpu",
                      "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["auto_states"] == [True, True]
        assert "backend 'gloo'" in r["fallback_reason"]
        assert all(r["sums_equal"]), r["sums_equal"]
        assert r["compiled_fallbacks"] == 1  # the compiled step's one all-reduce
        assert len(r["fallback_warnings"]) == 1, r["fallback_warnings"]  # logged once
        assert "cannot run" in r["one_shot_raises"] and "'auto'" in r["one_shot_raises"]
        assert "rank 0: tp_all_reduce='auto', tp_all_reduce_threshold=4096" in r["threshold_disagree"]
        assert "rank 1: tp_all_reduce='auto', tp_all_reduce_threshold=8192" in r["threshold_disagree"]
        assert "rank 0: tp_all_reduce='nccl'" in r["mode_disagree"]
        assert "rank 1: capable" in r["capability_disagree"]
        assert "rank 0: process group" in r["capability_disagree"]
        assert "tp_all_reduce 'nccl'" in r["plan_disagree"] and "tp_all_reduce 'auto'" in r["plan_disagree"]
        assert r["ready_after_end"] == []


@pytest.mark.gpu
def test_one_shot_equals_nccl_eager_and_in_a_cuda_graph_on_two_gpus(tmp_path):
    """bf16, 8 KiB - 2 MiB: every size one-shot (threshold 2 MiB); 2 ranks add
    two bf16 values once, as NCCL does, so the sums should be equal (the bound
    allows one bf16 rounding step of values of magnitude ~4)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    proc = _torchrun(["tests/runner/all_reduce_worker.py", "--device", "cuda",
                      "--out", str(tmp_path)], timeout=300, cpu=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"\nrank {rank}: " + "; ".join(
            f"{row['kib']} KiB {row['algorithm']} eager {row['eager_vs_nccl']:.1e} graph "
            f"{row['graph_vs_2x_nccl']:.1e}" for row in r["rows"]))
        assert [row["kib"] for row in r["rows"]] == [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
        for row in r["rows"]:
            assert row["algorithm"] == "one_shot", row
            assert row["eager_vs_nccl"] <= 0.05 and row["graph_vs_2x_nccl"] <= 0.1, row
            assert row["nccl_vs_sum"] <= 0.1, row
        assert r["ready_after_end"] == []


@pytest.mark.gpu
def test_tp2_runner_with_one_shot_all_reduces_equals_tp1_on_two_gpus(tmp_path):
    """tests/runner/tp_worker.py with tp_all_reduce="auto": every all-reduce is one
    mrv2::all_reduce inside a captured piece, and TP=2 replays match TP=1 eager."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "tp_gpu.json"
    proc = _torchrun(["tests/runner/tp_worker.py", "--device", "cuda", "--dtype", "bfloat16",
                      "--compiler", "inductor", "--modes", "piecewise,full,full_and_piecewise",
                      "--steps", "16", "--data-seed", str(random.randrange(1 << 30)),
                      "--tp-all-reduce", "auto", "--tol", "5e-2", "--out", str(out)],
                     timeout=400, cpu=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    _print_runs(result)
    assert result["failures"] == [] and result["graphs_released_at_end"] > 0
    for r in result["runs"]:
        assert r["ran_as"] == r["mode"] and r["graphs_captured"] > 0, r
        assert r["all_reduce_ops"] == ["mrv2::all_reduce"], r
        assert r["all_reduce_fallbacks"] == 0 and r["collective_fallbacks"] == 0, r
