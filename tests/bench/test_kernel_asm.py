"""bench/kernel_asm.py reads what the kernels compile to for sm_90a without a
GPU. Its TTGIR reader on hand-written modules (both Tritons' spellings of
the PDL wait), and the decode step's kernels compiled by the installed
Triton in a process of their own (the tests' interpreter cannot compile):
every main-loop load pipelined, a tensor-core dot, nothing of the skinny
GEMM read before its wait, and no register spills where a bundled ptxas
takes the PTX. The last pins the fused tiles (FUSED_CONFIGS in
compile_backend/kernels/skinny_linear.py), which were picked for exactly that."""

import json
import os
import subprocess
import sys

from bench_scripts import BENCH, load_bench_script

LOOP = """\
#shared = #ttg.swizzled_shared<{vec = 8, perPhase = 1, maxPhase = 8, order = [1, 0]}>
#shared1 = #ttg.swizzled_shared<{vec = 1, perPhase = 1, maxPhase = 1, order = [0]}>
    %buf = ttg.local_alloc : () -> !ttg.memdesc<3x16x16xbf16, #shared, #smem, mutable>
    %vec = ttg.local_alloc : () -> !ttg.memdesc<3x16xbf16, #shared1, #smem, mutable>
    %a = tt.load %p : tensor<16x!tt.ptr<bf16>>
    tt.grid_dependency_wait
    %r:2 = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z) -> (tensor<16x16xf32>) : i32 {
      %w = tt.load %q : tensor<16x16x!tt.ptr<bf16>>
      %c = ttg.async_copy_global_to_local %x, %buf : tensor<16x16x!tt.ptr<bf16>>
      %d = ttng.warp_group_dot %u, %v, %acc : tensor<16x16xbf16>
      scf.yield %d : tensor<16x16xf32>
    }
    %e:1 = scf.for %j = %c0 to %s step %c1 iter_args(%t = %z) -> (tensor<16xf32>) : i32 {
      %part = tt.load %parts : tensor<16x!tt.ptr<f32>>
      scf.yield %part : tensor<16xf32>
    }
"""


def test_the_reader_counts_main_loop_loads_and_loads_before_the_wait(monkeypatch):
    asm = load_bench_script("kernel_asm", monkeypatch)
    facts = asm.read_ttgir(LOOP)
    # the load in the dot's loop counts, the epilogue loop's (no dot) does not
    assert facts == dict(mma="wgmma", async_copies=1, tma=0, loop_loads=1, pre_wait_loads=1,
                         unswizzled=0)  # a 1-D buffer without a swizzle does not count
    v2 = LOOP.replace("tt.grid_dependency_wait", 'tt.elementwise_inline_asm "griddepcontrol.wait"')
    v2 = v2.replace("ttng.warp_group_dot", "tt.dot").replace(
        "tensor<16x16xf32>) : i32", "tensor<16x16xf32, #ttg.nvidia_mma<{versionMajor = 2}>>) : i32")
    assert asm.read_ttgir(v2) == dict(mma="mma v2", async_copies=1, tma=0, loop_loads=1,
                                      pre_wait_loads=1, unswizzled=0)
    flat = LOOP.replace("{vec = 8, perPhase = 1, maxPhase = 8", "{vec = 1, perPhase = 1, maxPhase = 1")
    assert asm.read_ttgir(flat)["unswizzled"] == 1  # the 2-D tile's buffer
    no_pdl = asm.read_ttgir(LOOP.replace("tt.grid_dependency_wait", ""))
    assert no_pdl["pre_wait_loads"] is None


def _run(args, tmp_path, interpret="0"):
    env = dict(os.environ, TRITON_INTERPRET=interpret, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    return subprocess.run([sys.executable, os.path.join(BENCH, "kernel_asm.py"), *args],
                          env=env, capture_output=True, text=True, timeout=900)


def test_the_decode_steps_kernels_compile_pipelined(tmp_path):
    out = tmp_path / "asm.json"
    md = tmp_path / "asm.md"
    run = _run(["--json", str(out), "--out", str(md)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    skinny = [n for n in rows if n.startswith("skinny_")]
    # the L2 prefetch: its one instruction in the PTX (ptxas takes it where it runs)
    assert rows["l2_prefetch"]["l2_prefetches"] == 1 and rows["l2_prefetch"]["pre_wait_loads"] == 0
    # 5 linears x 4 decode row counts, o and down at 128 and 256 rows (none
    # asks L2 for anything); the one-launch decode, its two-launch form, both
    # with rotary inside
    decode = {"decode_split", "decode_reduce", "decode_one_launch", "decode_split_rope",
              "decode_one_launch_rope"}
    assert len(skinny) == 24 and decode <= set(rows)
    assert all(rows[n]["l2_prefetches"] == 0 for n in skinny)
    for name, r in rows.items():
        assert r["loop_loads"] == 0, (name, r)  # no memory round trip per iteration
        assert r["pre_wait_loads"] is not None, (name, r)  # PDL's wait is compiled in
        if r["regs"] is not None:
            assert r["spill"] == 0, (name, r)
    for name in skinny:
        r = rows[name]
        assert r["mma"] in ("wgmma", "mma v2") and r["async_copies"] > 0, (name, r)
        assert r["pre_wait_loads"] == 0, (name, r)  # nothing read before the wait
        assert r["smem_kib"] <= 227, (name, r)  # sm_90's shared memory per program
        assert r["unswizzled"] == 0, (name, r)  # no bank conflicts on a tile (the norm's x was)
    # the 64-row tiles take Hopper's wgmma, the 16-row tiles cannot (M >= 64)
    assert rows["skinny_o_m64"]["mma"] == "wgmma" and rows["skinny_o_m1"]["mma"] == "mma v2"
    assert rows["skinny_down_m256"]["mma"] == "wgmma"
    assert md.read_text().splitlines()[2].startswith("| kernel | regs |")
    assert f"| skinny_o_m1 | " in run.stdout


def test_refuses_to_run_under_the_interpreter(tmp_path):
    run = _run(["--only", "skinny_o_m1"], tmp_path, interpret="1")
    assert run.returncode == 2 and "TRITON_INTERPRET is set" in run.stderr
