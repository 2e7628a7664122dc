"""Tensor parallelism: TP=2 computes TP=1's function (2 processes on gloo,
through the ModelRunner; fp32 logits within 1e-4 relative), a bad TP size
raises with the fix, the weights are TP=1's slices, and the all-reduce is a
node inside a piece to capture (never a split point), which falls back with a
counted reason only where it cannot be captured (a gloo group in a CUDA graph).

The multi-process checks run tests/runner/tp_worker.py under
`python -m torch.distributed.run` on localhost (a free port); the GPU one on
two GPUs with NCCL, in the modes that capture."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

import compile_backend as cb
import toy_ops  # noqa: F401  (registers toy::attn)
from compile_backend.core.op_registry import EAGER_REASON, OpRegistry, OpRole
from compile_backend.core.parallel import TensorParallel
from compile_backend.demo.models import build_model, preset
from compile_backend.passes import CaptureSafetyPass

ROOT = Path(__file__).resolve().parents[2]
# NVLink multicast stays off in every process these tests start.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], nproc: int = 2, timeout: int = 120, cpu: bool = True):
    """Run `args` on `nproc` local ranks; on timeout the launcher and its ranks
    (one process group of their own) are killed, so none is left holding a GPU."""
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH"))
                           if p)
    env = dict(os.environ, **NO_MULTICAST, PYTHONPATH=path, OMP_NUM_THREADS="1")
    if cpu:
        env["TRITON_INTERPRET"] = "0"  # the kernels' torch references (the interpreter is slow)
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} ran past {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _print_runs(result: dict) -> None:
    """The worker's rows, for the log of a GPU run (pytest -s)."""
    keys = ("model", "mode", "ran_as", "steps", "step_graphs", "max_rel_err", "steps_with_equal_argmax",
            "graphs_captured", "pieces", "collective_ops", "in_captured_pieces",
            "collective_fallbacks", "disagreement_raises", "seconds")
    print(f"\nTP={result['world']} on {result['device']} ({result['dtype']}) against TP=1 eager:")
    print(" | ".join(keys))
    for r in result["runs"]:
        print(" | ".join(f"{r[k]:.2e}" if k == "max_rel_err" else str(r[k]) for k in keys))


# ---- two processes -------------------------------------------------------------------


@pytest.mark.slow  # full tier: a subprocess (2 ranks, about 20 s on 2 cores)
def test_tp2_logits_equal_tp1_on_gloo(tmp_path):
    """Both reference models, tiny, fp32, mode none, eager pieces: a prefill,
    then prefills mixed with decodes, over fresh random token ids."""
    out = tmp_path / "tp.json"
    seed = random.randrange(1 << 30)
    proc = _torchrun(["tests/runner/tp_worker.py", "--device", "cpu", "--models", "llama,hybrid",
                      "--steps", "6", "--data-seed", str(seed), "--tol", "1e-4",
                      "--out", str(out)])
    assert proc.returncode == 0, f"data seed {seed}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["failures"] == []
    assert [r["model"] for r in result["runs"]] == ["llama", "hybrid"]
    for r in result["runs"]:
        assert r["max_rel_err"] <= 1e-4, (seed, r)
        # all_reduce + wait_tensor after attention and after the MLP of each layer
        assert r["collective_ops"] == r["expected_ops"] == 8, r
        assert r["in_captured_pieces"] and r["collective_fallbacks"] == 0, r
        assert r["disagreement_raises"] is True, r  # debug_checks: ranks compare each step


@pytest.mark.slow  # full tier: a subprocess (2 ranks, about 35 s on 2 cores)
def test_tp2_in_every_graph_mode_with_the_cpu_stand_in(tmp_path):
    """The hybrid model in piecewise, full and full_and_piecewise, graphs
    captured and replayed by the CPU stand-in: about 8 steps of prefills mixed
    with decodes, then uniform decodes (FULL decode graphs)."""
    out = tmp_path / "tp.json"
    seed = random.randrange(1 << 30)
    proc = _torchrun(["tests/runner/tp_worker.py", "--device", "cpu", "--standin", "--models", "hybrid",
                      "--modes", "piecewise,full,full_and_piecewise", "--steps", "16",
                      "--data-seed", str(seed), "--tol", "1e-4", "--out", str(out)])
    assert proc.returncode == 0, f"data seed {seed}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    # Note [graphs before the communicator]: the graphs are released, then the group destroyed
    assert result["graphs_released_at_end"] >= 25  # at least the last mode's (7 sizes)
    runs = result["runs"]
    assert [(r["mode"], r["ran_as"]) for r in runs] == [
        ("piecewise", "piecewise"), ("full", "full"), ("full_and_piecewise", "full_and_piecewise")]
    graphs = runs[2]["step_graphs"]  # mixed steps piecewise, uniform decodes FULL
    assert set(graphs) == {"piecewise", "full decode"} and sum(graphs.values()) == 16, graphs
    for r in runs:
        assert r["max_rel_err"] <= 1e-4 and r["graphs_captured"] > 0, (seed, r)
        assert r["in_captured_pieces"] and r["collective_fallbacks"] == 0, r


@pytest.mark.slow  # full tier: a subprocess
def test_demo_tp2_under_torchrun_prints_once_and_matches_tp1():
    proc = _torchrun(["-m", "compile_backend", "demo", "--tp", "2", "--mode", "none",
                      "--model", "llama", "--preset", "tiny", "--batch", "2", "--steps", "3",
                      "--prompt-len", "8", "--piece-compiler", "eager", "--no-progress"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("none ")]
    assert len(rows) == 1 and rows[0].split()[-1] == "yes", proc.stdout  # rank 0 alone prints
    assert "tensor parallel: 2 ranks" in proc.stdout


@pytest.mark.gpu
def test_tp2_on_two_gpus_captures_the_all_reduce(tmp_path):
    """NCCL, bf16, Inductor pieces: TP=2 in piecewise, full and
    full_and_piecewise against TP=1 eager over 16 forced-token steps (prefills
    mixed with decodes, then decodes), no collective falling back. bf16:
    relative error of the logits under 5e-2, as bench/decode.py's match."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "tp_gpu.json"
    proc = _torchrun(["tests/runner/tp_worker.py", "--device", "cuda", "--dtype", "bfloat16",
                      "--compiler", "inductor", "--modes", "piecewise,full,full_and_piecewise",
                      "--steps", "16", "--data-seed", str(random.randrange(1 << 30)),
                      "--tol", "5e-2", "--out", str(out)], timeout=300, cpu=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    _print_runs(result)
    assert result["failures"] == [] and result["graphs_released_at_end"] > 0
    for r in result["runs"]:
        assert r["ran_as"] == r["mode"] and r["graphs_captured"] > 0, r
        assert r["collective_fallbacks"] == 0 and not r["fallback_reasons"], r


# ---- one process -----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_a_tp_size_that_does_not_divide_the_heads_raises_with_the_sizes_that_work(model):
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not divide num_heads, "
                                         r"num_kv_heads, intermediate_size.*among \[1, 2\]"):
        build_model(model, preset("tiny"), tp_size=3)
    with pytest.raises(ValueError, match="positive int"):
        build_model(model, preset("tiny"), tp_size=0)


def test_a_tp_size_without_its_processes_says_how_to_start_them():
    with pytest.raises(ValueError, match=r"needs 2 processes.*torchrun --nproc-per-node 2"):
        build_model("llama", preset("tiny"), tp_size=2)


def test_the_hybrid_model_splits_its_conv_channels_too():
    cfg = preset("tiny", hidden_size=96, num_heads=4, num_kv_heads=2, intermediate_size=256)
    with pytest.raises(ValueError, match="hidden_size"):
        build_model("hybrid", cfg.replace(hidden_size=132, num_heads=2, num_kv_heads=2), tp_size=4)
    build_model("llama", cfg, tp_size=1)  # TP=1 takes any sizes


def _shard_of(model_name, rank, monkeypatch):
    """Rank `rank` of a TP=2 model, built without processes (no collective runs)."""
    monkeypatch.setattr(TensorParallel, "current",
                        classmethod(lambda cls, size=None: cls(2, rank, "unused")))
    return build_model(model_name, preset("tiny"))


@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_each_rank_holds_its_slice_of_the_tp1_weights(model, monkeypatch):
    whole = build_model(model, preset("tiny"), tp_size=1).state_dict()
    ranks = [_shard_of(model, r, monkeypatch).state_dict() for r in range(2)]
    assert ranks[0].keys() == whole.keys()
    for name, full in whole.items():
        parts = [rk[name] for rk in ranks]
        if parts[0].shape == full.shape:  # replicated: norms, embedding, lm_head
            assert all(torch.equal(p, full) for p in parts), name
        elif name.endswith("gate_up.weight"):  # [gate_r | up_r] per rank
            gate, up = full.chunk(2)
            for r, p in enumerate(parts):
                assert torch.equal(p, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]])), name
        else:
            dim = next(d for d in range(full.dim()) if parts[0].shape[d] != full.shape[d])
            assert torch.equal(torch.cat(parts, dim), full), name
    # the KV cache is sized by this rank's KV heads
    m = _shard_of(model, 0, monkeypatch)
    m.bind_caches(4, 16, 2, "cpu")
    assert m.layers[0].attention.attn.k_cache.shape == (4, 16, preset("tiny").num_kv_heads // 2,
                                                        preset("tiny").head_dim)


def test_collective_role():
    import compile_backend.kernels  # noqa: F401  (mrv2::all_reduce: tp_all_reduce's op)

    reg = OpRegistry()
    assert reg.role_of_name("_c10d_functional::all_reduce") is OpRole.COLLECTIVE
    assert reg.role_of_name("_c10d_functional::wait_tensor") is OpRole.COLLECTIVE
    assert reg.role_of_name("mrv2::all_reduce") is OpRole.COLLECTIVE
    assert reg.summary()["collective"] == ["_c10d_functional::*", "mrv2::all_reduce"]


@pytest.fixture
def one_rank_gloo():
    """A 1-rank gloo default group in this process, removed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_all_reduce_is_inside_a_piece_not_a_split_point(one_rank_gloo, tmp_path):
    import torch.distributed._functional_collectives as funcol

    from compile_backend.debug.inspector import load_dump, summary

    group = one_rank_gloo.group_name

    def step(x, w):
        h = torch.ops.toy.attn(x, x, x)  # breakpoint
        y = funcol.all_reduce(h @ w, "sum", group)  # row-parallel output, summed
        return torch.ops.toy.attn(y, y, y) + y

    x, w = torch.randn(6, 8), torch.randn(8, 8)
    compiled = torch.compile(step, backend="mrv2", options={
        "splitting_ops": ["toy::attn"], "piece_compiler": "eager",
        "debug_dump_path": str(tmp_path)})
    torch.testing.assert_close(compiled(x, w), step(x, w), atol=1e-5, rtol=1e-5)
    pieces = cb.compiled_steps()[-1].pieces
    assert [(p.captured, p.breakpoints, p.collectives) for p in pieces] == [
        (False, ["toy::attn"], []),
        (True, [], ["_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"]),
        (False, ["toy::attn"], []),
        (True, [], []),
    ]
    assert cb.counters["collective_fallbacks"] == 0
    manifest = load_dump(tmp_path)
    assert manifest["op_roles"]["collective"] == ["_c10d_functional::*", "mrv2::all_reduce"]
    assert "collectives: _c10d_functional.all_reduce, _c10d_functional.wait_tensor" in summary(manifest)


def _all_reduce_graph(device, group_name, shape=(4,)):
    """x -> all_reduce -> wait -> sin, with fake example values of `shape` on `device`."""
    mode = FakeTensorMode()
    with mode:
        val = torch.empty(shape, device=device)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", group_name))
    wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    out = g.call_function(torch.sin, (wait,))
    for n in (x, ar, wait, out):
        n.meta["example_value"] = val
    g.output(out)
    return g, ar, wait, out


def test_a_gloo_collective_in_a_cuda_graph_falls_back_with_a_counted_reason(one_rank_gloo,
                                                                           monkeypatch):
    import compile_backend.passes.capture_safety as cs

    g, ar, wait, out = _all_reduce_graph("cuda", one_rank_gloo.group_name)
    report = CaptureSafetyPass(OpRegistry())(g)
    assert report.changed
    for node in (ar, wait):
        assert "backend 'gloo'" in node.meta[EAGER_REASON] and "NCCL" in node.meta[EAGER_REASON]
    assert EAGER_REASON not in out.meta
    assert cb.counters["collective_fallbacks"] == 2

    cb.reset_counters()
    g, ar, wait, out = _all_reduce_graph("cuda", one_rank_gloo.group_name)
    monkeypatch.setattr(cs, "group_backend", lambda name: "nccl")
    assert not CaptureSafetyPass(OpRegistry())(g).changed  # NCCL: captured
    monkeypatch.undo()
    g, *_ = _all_reduce_graph("cpu", one_rank_gloo.group_name)
    assert not CaptureSafetyPass(OpRegistry())(g).changed  # a CPU graph is never captured
    assert cb.counters["collective_fallbacks"] == 0


def test_exit_process_flushes_what_was_printed_and_exits_with_the_code():
    """Note [gloo teardown] (runner/parallel.py): a tensor-parallel process
    leaves with os._exit, so what it printed must be flushed first."""
    code = ("import sys\n"
            "from compile_backend.runner.parallel import exit_process\n"
            "print('a table', end='')\n"
            "sys.stderr.write('a warning')\n"
            "exit_process(3)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert (run.returncode, run.stdout, run.stderr) == (3, "a table", "a warning")
