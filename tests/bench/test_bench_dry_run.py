"""The decode benchmark's plumbing on the CPU (graph stand-in; timings mean nothing)."""

import json
import os
import sys

import pytest
import torch

from bench_scripts import ROOT, load_bench_script


@pytest.fixture
def bench(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # torch references: fast
    return load_bench_script("decode", monkeypatch)


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_dry_run_compares_every_variant_with_eager(bench, tmp_path):
    """Regression: the first step's logits were kept as a view of the graph's
    output and read after later replays had overwritten it; with per-request
    state (the hybrid model's sconv) every graph mode then looked wrong."""
    rc = bench.main(["--dry-run", "--model", "hybrid", "--batches", "1,2", "--mixed", "40",
                     "--variants", "eager,mrv2-none,mrv2-piecewise,mrv2-full_and_piecewise",
                     "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "decode.json").read_text())
    decode = results["decode"]
    assert {r["variant"] for r in decode} == {"eager", "mrv2-none", "mrv2-piecewise",
                                              "mrv2-full_and_piecewise"}
    assert all(r["match"] and r["rel_err"] < 1e-5 for r in decode), decode  # fp32, same kernels
    ran = {(r["variant"], r["batch"]): r["dispatched"] for r in decode}
    assert ran[("mrv2-piecewise", 2)] == "piecewise"
    assert ran[("mrv2-full_and_piecewise", 2)] == "full"
    assert all(r["rel_err"] < 1e-5 for r in results["mixed"])
    assert "| hybrid | mrv2-piecewise | 2 |" in (tmp_path / "decode.md").read_text()


@pytest.mark.slow  # full tier: a long run
def test_one_model_at_a_time(bench, tmp_path, monkeypatch):
    """Regression: each variant builds its model twice (its sizes, then the
    largest size alone for the pool's reading), and the FULL graph the
    replay timing held kept the first alive through the second: at llama8b,
    b256, two models and their KV caches ran an 80 GB card out of memory.
    Every model built is gone (collected) before the next is built."""
    import gc
    import weakref

    built = []
    real = bench.build_model

    def tracked(*args, **kwargs):
        gc.collect()
        alive = [name for name, ref in built if ref() is not None]
        assert not alive, f"building another model while {alive} is alive"
        model = real(*args, **kwargs)
        built.append((f"{args[0]} #{len(built)}", weakref.ref(model)))
        return model

    monkeypatch.setattr(bench, "build_model", tracked)
    assert bench.main(["--dry-run", "--model", "llama", "--batches", "1,2", "--mixed", "",
                       "--variants", "mrv2-full,mrv2-piecewise", "--out", str(tmp_path)]) == 0
    assert len(built) == 4  # two variants, each its sizes and then the largest alone


@pytest.mark.slow  # full tier: a long run
def test_config_sets_run_in_order_in_one_process_and_time_only_their_sizes(bench, tmp_path,
                                                                           monkeypatch):
    """--sets "A;B;A": the variant once per set, in that order, each row
    labelled with its set and compared with the first set's logits (the
    residual pass changes no value: fp32, the torch forms); --timing-only
    captures the timed sizes alone and builds no model for the pool."""
    seen = []
    real = bench.build

    def spy(model_name, variant, setup, capture_sizes, *args, **kwargs):
        seen.append((setup.options.get("fuse_residual_norm"), list(capture_sizes)))
        return real(model_name, variant, setup, capture_sizes, *args, **kwargs)

    monkeypatch.setattr(bench, "build", spy)
    sets = "fuse_residual_norm=false;fuse_residual_norm=true;fuse_residual_norm=false"
    assert bench.main(["--dry-run", "--model", "llama", "--batches", "1,3", "--mixed", "",
                       "--variants", "mrv2-full", "--sets", sets, "--timing-only",
                       "--config", "fuse_norm_linear=true", "--out", str(tmp_path)]) == 0
    assert seen == [(False, [1, 3]), (True, [1, 3]), (False, [1, 3])]
    decode = json.loads((tmp_path / "decode.json").read_text())["decode"]
    assert [(r["variant"], r["batch"]) for r in decode] == [
        (f"mrv2-full [fuse_residual_norm={v}]", b) for v in ("false", "true", "false")
        for b in (1, 3)]
    assert all(r["match"] and r["rel_err"] < 1e-5 for r in decode), decode
    text = (tmp_path / "decode.md").read_text()
    assert "| llama | mrv2-full [fuse_residual_norm=true] | 3 |" in text
    assert "0 / - |" in text  # no build of the largest size alone
    # the pair's own table: the three runs in order, the change and the first set's spread
    assert "| fuse_residual_norm=true vs fuse_residual_norm=false | spread of " \
        "fuse_residual_norm=false |" in text
    b2b = [r["b2b_ms"] for r in decode if r["batch"] == 3]
    assert f"| llama | mrv2-full | 3 | {b2b[0]:.3f} | {b2b[1]:.3f} | {b2b[2]:.3f} | " in text


def test_the_sets_table_takes_each_labels_mean_against_the_first(bench):
    rows = [{"model": "m", "variant": f"v [{lb}]", "set": lb, "batch": 8, "b2b_ms": ms}
            for lb, ms in (("off", 10.0), ("on", 9.7), ("off", 10.2))]
    text = "\n".join(bench.sets_table(rows))
    assert "| m | v | 8 | 10.000 | 9.700 | 10.200 | -4.0% | 2.0% |" in text
    assert bench.sets_table([{"model": "m", "variant": "v", "batch": 1, "b2b_ms": 1.0}]) == []


def test_a_config_set_with_an_unknown_field_is_refused_by_name(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--model", "llama", "--batches", "1", "--mixed", "",
                    "--sets", "fuse_residual_norm=true;no_such_field=1", "--out", str(tmp_path)])
    assert "no_such_field=1" in capsys.readouterr().err


def test_without_a_gpu_the_benchmark_says_how_to_dry_run(bench):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        bench.main(["--batches", "1"])


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_runs_of_one_model_each_merge_into_one_table(bench, tmp_path):
    for m in ("llama", "hybrid"):
        assert bench.main(["--dry-run", "--model", m, "--batches", "1,2", "--mixed", "",
                           "--variants", "eager,mrv2-full", "--out", str(tmp_path / m)]) == 0
    assert bench.main(["--merge", str(tmp_path / "llama" / "decode.json"),
                       str(tmp_path / "hybrid" / "decode.json"), "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "decode.json").read_text())
    assert {(r["model"], r["variant"], r["batch"]) for r in merged["decode"]} == {
        (m, v, b) for m in ("llama", "hybrid") for v in ("eager", "mrv2-full") for b in (1, 2)}
    assert all(r["b2b_ms"] > 0 and r["match"] for r in merged["decode"])
    assert len(merged["meta"]["runs"]) == 2
    text = (tmp_path / "decode.md").read_text()
    assert "| llama | mrv2-full | 2 |" in text and "| hybrid | mrv2-full | 2 |" in text
    assert "--model llama" in text and "--model hybrid" in text  # both commands recorded


@pytest.fixture
def startup(monkeypatch):
    return load_bench_script("startup", monkeypatch)


def _startup_row(phase, mode="piecewise", **changes):
    row = {"model": "llama", "preset": "llama8b", "mode": mode, "phase": phase,
           "compile_s": 30.0 if phase == "cold" else 6.0, "capture_s": 1.5, "graphs": 1155,
           "start_to_first_step_s": 40.0 if phase == "cold" else 12.0, "import_s": 4.0,
           "build_s": 3.0, "first_step_s": 0.01, "plan": 35, "first_step_finite": True,
           "import_torch_s": 3.0, "import_mrv2_s": 1.0, "model_s": 2.5, "runner_s": 0.5,
           "mrv2_share_s": 9.0 if phase == "warm" else 33.0, "capture_warmup": "on_demand",
           "capture_profile": {mode: {"graphs": 35, "warmups": 2, "total_s": 1.5, "warmup_s": 0.2,
                                      "record_s": 0.6, "instantiate_s": 0.5, "other_s": 0.2}},
           "first_step_ran_as": mode, "device_name": "GPU", "torch": "t", "triton": "3",
           "counters": {"piece_compiles": 3, "piece_compile_reuses": 62, "inductor_compiles": 3,
                        "compile_worker_compiles": 2, "dynamo_graphs": 1},
           "cache_bytes": {"TORCHINDUCTOR_CACHE_DIR": 2**21, "TRITON_CACHE_DIR": 0,
                           "MRV2_CACHE_DIR": 0}}
    return {**row, **changes}


def test_startup_tables_show_each_process_the_anchors_and_failures(startup):
    meta = {"date": "d", "command": "python bench/startup.py", "sizes_text": "35", "batch": 8,
            "context": 500}
    rows = [_startup_row("cold"), _startup_row("warm"),
            {"model": "llama", "preset": "llama8b", "mode": "full", "phase": "cold",
             "error": "exit code 1", "stderr_tail": "Traceback: boom"}]
    text = startup.tables(meta, rows)
    assert ("| llama | llama8b | piecewise | warm | 6.0 | 1.50 | 1155 | 12.0 | 9.0 | 3 | 62 | 3 "
            "| 2 | 1 | 3.0 | 1.00 | 2.5 | 0.50 |") in text
    assert "| llama | llama8b | full | cold | failed: exit code 1 |" in text and "Traceback: boom" in text
    assert "| cold compile s | ~19 (Dynamo 4.6 + Inductor 14.8) | <= 15 | 30.0 |" in text
    assert "| warm start to first step s | ~9 (warm start with Inductor's cache) | <= 5 | 12.0 |" in text
    assert "| mrv2's share of a warm start s | - | <= 3 (issue #36) | 9.0 |" in text
    assert "| capture s (whole plan), warm | ~2 | <= 1 per mode (issue #36) | 1.50 |" in text
    # the capture profile: warm-ups, record, instantiate per process
    assert ("| llama | llama8b | piecewise | warm | on_demand | piecewise | 35 | 2 | 1.50 | 0.20 "
            "| 0.60 | 0.50 | 0.20 | 42.9 |") in text
    assert "| 2.0 / 0.0 / 0.0 |" in text  # cache folders, MiB
    assert "not as expected" not in text and "by callee" not in text  # no --by-op rows
    timed = startup.tables(meta, [_startup_row("warm", capture_by_op=[
        ["norm_linear", 4550, 0.776], ["step", 70, 0.253], ["outside", 0, 0.628]])])
    assert "runner.capture() by callee, llama llama8b piecewise warm (1.50 s" in timed
    assert "| norm_linear | 4550 | 0.776 | 170.5 |" in timed and "| outside | - | 0.628 | - |" in timed
    fast = startup.tables(meta, [_startup_row("warm", host_speed={"python_us": 590.4,
                                                                   "dispatch_us": 0.764})])
    assert "| llama | llama8b | piecewise | warm | 590 | 0.76 |" in fast
    assert "The host's speed" not in text  # rows without it (older runs): no table
    odd = startup.tables(meta, [_startup_row("cold", first_step_ran_as="none")])
    assert "First step not as expected" in odd and "ran as none" in odd
    asked = startup.tables(meta, [_startup_row("cold", first_step_triton_requests=[
        "_decode_kernel", "_decode_kernel", "_rms_norm_kernel"]), _startup_row(
        "warm", first_step_triton_requests=[])])
    assert "| llama | llama8b | piecewise | cold | 3 | _decode_kernel, _rms_norm_kernel |" in asked
    assert "| llama | llama8b | piecewise | warm | 0 | - |" in asked
    assert "Triton kernel requests" not in text  # rows without it (older runs): no table
    prefill = startup.tables(meta, [_startup_row("cold", first_prefill_s=0.0123, first_prefill_tokens=253,
                                                 first_prefill_ran_as="piecewise",
                                                 first_prefill_triton_requests=["_prefill_kernel"])])
    assert "| llama | llama8b | piecewise | cold | 253 | piecewise | 0.012 | 1 | _prefill_kernel |" in prefill
    assert "The first prefill" not in text  # rows without it (older runs): no table
    procs = startup.tables(meta, [_startup_row("cold", capture_stats={
        "graphs_waited": 4, "kernels_recorded": 30, "compile_wait_s": 0.5}, counters={
        **_startup_row("cold")["counters"], "kernels_compiled_in_workers": 28,
        "kernel_worker_fallbacks": 2})])
    assert "| 4 | 30 | 0 | 28 +2 here | 0.50 |" in procs  # waited, ahead, preloaded, in processes
    named = startup.tables(meta, [_startup_row("cold", capture_stats={
        "kernels_by_name": {"_decode_kernel": 5, "_rms_norm_kernel": 1}})])
    assert "| llama | llama8b | piecewise | cold | _decode_kernel 5, _rms_norm_kernel 1 |" in named
    timed = startup.tables(meta, [_startup_row("cold", capture_stats={"kernel_timeline": [
        ["_rms_norm_kernel", -0.4, 0.1, "first step 256"], ["_skinny_linear_kernel", 0.2, 1.7, "full 16"],
        ["_decode_kernel", 0.3, None, "full decode 8"]]})])
    assert ("| llama | llama8b | piecewise | cold | 1 | 2 | 0.30 | 1.70 | 1.50 | _rms_norm_kernel "
            "(first step 256) -0.40 -> 0.10; _skinny_linear_kernel (full 16) 0.20 -> 1.70; "
            "_decode_kernel (full decode 8) 0.30 -> - |") in timed
    older = startup.tables(meta, [_startup_row("cold", capture_stats={"kernel_timeline": [
        ["_rms_norm_kernel", -0.4, 0.1]]})])  # a result written before the asker was kept
    assert "| 1 | 0 | -0.40 | 0.10 | 0.50 | _rms_norm_kernel -0.40 -> 0.10 |" in older
    assert "When the kernels were asked for" not in named  # rows without it: no table


def test_startup_counts_the_triton_requests_inside_and_restores_the_hook(startup, monkeypatch):
    """triton_requests chains to a hook already set, names what was asked for,
    and puts the earlier hook back."""
    knobs = pytest.importorskip("triton").knobs
    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **k: earlier.append(k) or None)
    before = knobs.runtime.jit_cache_hook
    with startup.triton_requests() as asked:
        assert knobs.runtime.jit_cache_hook(repr="_decode_kernel[grid](...)") is None
        knobs.runtime.jit_cache_hook(fn=None)
    assert asked == ["_decode_kernel", "a kernel"] and len(earlier) == 2
    assert knobs.runtime.jit_cache_hook is before


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_startup_smoke_measures_a_fresh_process_per_phase(startup, tmp_path):
    out = tmp_path / "startup.md"
    assert startup.main(["--smoke", "--modes", "piecewise", "--out", str(out)]) == 0
    rows = json.loads((tmp_path / "startup.json").read_text())["rows"]
    assert [(r["mode"], r["phase"]) for r in rows] == [("piecewise", "cold"), ("piecewise", "warm")]
    for r in rows:
        assert r["first_step_finite"] and r["first_step_ran_as"] == "piecewise"
        assert r["graphs"] > r["plan"] == 4  # a graph per piece and size
        assert r["start_to_first_step_s"] > r["import_s"] + r["compile_s"] + r["capture_s"]
    assert rows[0]["mrv2_cache_dir"] == rows[1]["mrv2_cache_dir"]  # warm shares cold's folders
    cold, warm = (r["counters"] for r in rows)
    assert cold["dynamo_graphs"] == 1 and cold["piece_compiles"] >= 1
    # the warm process loads cold's saved step: nothing traced, nothing compiled
    assert warm.get("dynamo_graphs", 0) == 0 and warm.get("piece_compiles", 0) == 0
    assert "| llama | tiny | piecewise | warm |" in out.read_text()


# ---- the shared module and the scripts' imports ---------------------------------


_load = load_bench_script


def _bench_imports():
    """Which bench modules each bench/*.py imports (as `x` or `bench.x`), anywhere in it."""
    import ast

    folder = os.path.join(ROOT, "bench")
    names = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
    edges = {}
    for name in names:
        with open(os.path.join(folder, f"{name}.py")) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for mod in mods:
                parts = mod.split(".")
                mod = parts[1] if parts[0] == "bench" and len(parts) > 1 else parts[0]
                if mod in names and mod != name:
                    found.add(mod)
        edges[name] = found
    return edges


def test_no_two_bench_scripts_import_each_other():
    """decode.py and tp.py share workload.py; decode.py hands --tp runs to tp.py
    by exec, not import. No import cycle among the bench scripts."""
    edges = _bench_imports()
    assert edges["workload"] == set()
    assert "tp" not in edges["decode"] and "decode" not in edges["tp"]
    assert {"decode", "tp"} <= {n for n, e in edges.items() if "workload" in e}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n)))
                   for n in edges[start])
    assert [n for n in edges if reaches(n, n)] == []


def test_decode_hands_a_tp_run_to_tp_py(bench, monkeypatch):
    class Exec(Exception):
        pass

    def execv(path, argv):
        raise Exec(path, argv)

    monkeypatch.setattr(bench.os, "execv", execv)
    with pytest.raises(Exec) as e:
        bench.main(["--tp", "2", "--model", "llama", "--batches", "64"])
    path, argv = e.value.args
    assert path == sys.executable and argv[0] == sys.executable
    assert os.path.samefile(argv[1], os.path.join(ROOT, "bench", "tp.py"))
    assert argv[2:] == ["--tp", "2", "--model", "llama", "--batches", "64"]


def test_caches_are_random_and_each_rank_holds_its_slice_of_the_tp1_values(monkeypatch):
    from compile_backend.core.parallel import TensorParallel

    workload = _load("workload", monkeypatch)

    class Caches(torch.nn.Module):
        def __init__(self, tp):
            super().__init__()
            self.tp = tp
            heads, channels = 4 // tp.size, 6 // tp.size
            self.register_buffer("k_cache", torch.zeros(3, 2, heads, 5))  # KV heads: dim 2
            self.register_buffer("conv_state", torch.zeros(2, channels, 3))  # channels: dim 1
            self.register_buffer("table", torch.zeros(2, 3))  # not sharded: whole on every rank
            self.register_buffer("scale", torch.zeros(4))  # 1-d: left alone
            self.register_buffer("slots", torch.zeros(2, 3, dtype=torch.long))  # ints: left alone

    whole = Caches(TensorParallel())
    workload.fill_caches(whole, "cpu")
    assert all((getattr(whole, n) != 0).all() for n in ("k_cache", "conv_state", "table"))
    assert not whole.scale.any() and not whole.slots.any()
    for rank in range(2):
        part = Caches(TensorParallel(size=2, rank=rank, group_name="tp"))
        workload.fill_caches(part, "cpu")
        torch.testing.assert_close(part.k_cache, whole.k_cache.chunk(2, dim=2)[rank], rtol=0, atol=0)
        torch.testing.assert_close(part.conv_state, whole.conv_state.chunk(2, dim=1)[rank],
                                   rtol=0, atol=0)
        torch.testing.assert_close(part.table, whole.table, rtol=0, atol=0)
        assert not part.scale.any() and not part.slots.any()


def test_decode_and_mixed_batches_give_each_request_its_own_blocks(monkeypatch):
    from compile_backend.runner.kv_cache_config import KVCacheConfig

    workload = _load("workload", monkeypatch)
    kv = KVCacheConfig(num_blocks=64, block_size=16, max_model_len=128)
    d = workload.decode_batch(3, 40, kv, vocab=100)
    assert d.query_lens == [1, 1, 1] and d.seq_lens == [41] * 3 and d.req_slots == [0, 1, 2]
    assert all(len(b) == 3 for b in d.block_ids)  # ceil(41 / 16)
    m = workload.mixed_batch(40, 3, 40, kv, vocab=100)
    assert m.query_lens == [1, 1, 1, 37] and len(m.token_ids) == 40
    assert m.block_ids[:3] == d.block_ids and len(m.block_ids[3]) == 3  # ceil(37 / 16)
    for batch in (d, m):
        for ids in (batch.block_ids, batch.compressed_block_ids):
            flat = [i for blocks in ids for i in blocks]
            assert len(set(flat)) == len(flat) and min(flat) >= 1  # block 0: the null block
        assert all(0 <= t < 100 for t in batch.token_ids)


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_tp_dry_run_on_one_process_writes_its_table(monkeypatch, tmp_path):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # torch references: fast
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tp = _load("tp", monkeypatch)
    assert tp._main(["--dry-run", "--batches", "1,2", "--reps", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_tp.json").read_text())["rows"]
    assert [(r["tp"], r["mode"], r["batch"], r["ran_as"]) for r in rows] == [
        (1, "none", 1, "none"), (1, "none", 2, "none")]
    assert all(r["rel_err"] == 0 and r["ms"] > 0 and r["b2b_ms"] > 0 for r in rows)
    assert "| llama | 1 | none | 2 |" in (tmp_path / "decode_tp.md").read_text()


def test_hf_generate_dry_run_bisects_the_passes_and_checks_its_variants(monkeypatch, tmp_path):
    """bench/hf_generate.py on the CPU (fp32, eager pieces, stand-in graphs):
    every variant, the one-pass ones too, gives eager's greedy tokens; an
    unknown variant, or a table without its references, is refused."""
    pytest.importorskip("transformers")
    hf = load_bench_script("hf_generate", monkeypatch)
    tiny = ["--dry-run", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
            "--intermediate", "128", "--vocab", "256", "--batches", "1", "--new-tokens", "3",
            "--prompt", "6", "--out", str(tmp_path)]
    assert hf.main(tiny + ["--variants", "eager,off,sibling,residual", "--host-profile", "5"]) == 0
    rows = json.loads((tmp_path / "hf_generate.json").read_text())
    assert [r["variant"] for r in rows] == ["eager", "mrv2 passes off", "mrv2 sibling only",
                                            "mrv2 residual only"]
    assert all(r["tokens_equal_eager"] == 1.0 for r in rows), rows
    assert all(r["gc_ms_per_token"] >= 0 and any("tottime" in line for line in r["host_profile"])
               for r in rows), rows
    # the backend's counters per variant: the one-pass variants fused what they name
    assert rows[0]["counters"] == {} and rows[1]["counters"]["cudagraph_replays"] > 0
    assert rows[2]["counters"]["pass_linears_fused"] > 0
    assert "pass_linears_fused" not in rows[3]["counters"]
    assert rows[3]["counters"]["pass_linear_residual_fused"] > 0
    assert "| mrv2 sibling only | 1 |" in (tmp_path / "hf_generate.md").read_text()
    for bad in ("eager,off,fast", "off,on"):
        with pytest.raises(SystemExit):
            hf.main(tiny + ["--variants", bad])
    # HF's default cache, each mode: eager's tokens
    assert hf.main(tiny + ["--variants", "eager,on", "--cache", "dynamic", "--mode",
                           "piecewise,full", "--name", "dynamic", "--new-tokens", "8"]) == 0
    rows = json.loads((tmp_path / "dynamic.json").read_text())
    assert [r["variant"] for r in rows] == ["eager", "mrv2 passes on [piecewise]",
                                            "mrv2 passes on [full]"]
    assert all(r["tokens_equal_eager"] == 1.0 for r in rows), rows
    # the growing-caches pass: what reads the cache runs with the attention, so
    # the pieces capture and replay and none runs without its graph (FULL: the
    # whole graph, which reads the cache, once, when it is given up)
    assert all(r["counters"]["pass_growing_cache_nodes"] > 0 and r["counters"]["cudagraph_replays"] > 0
               and r["counters"].get("captures_skipped", 0) <= ("[full]" in r["variant"])
               for r in rows[1:]), rows
    assert "dynamic cache" in (tmp_path / "dynamic.md").read_text()
