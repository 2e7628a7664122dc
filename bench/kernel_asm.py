"""What mrv2's Triton kernels compile to for the H200 (sm_90a), read without a GPU.

    python bench/kernel_asm.py [--kernels skinny,decode] [--dump DIR] [--out FILE.md]
    PYTHONPATH=DIR python bench/kernel_asm.py ...   (another Triton, e.g. the GPU machine's
                                                      3.6: pip install --target DIR triton==3.6.0)
Run it with TRITON_INTERPRET unset (the interpreter's kernels do not compile).

Each row is one kernel at one specialization of the llama-8B decode step
(the meta-parameters its launcher picks there), compiled by the installed
Triton for capability 9.0 (Triton targets sm_90a), and read back from its
TTGIR and, where the bundled ptxas takes the PTX, from `ptxas -v`:
    regs, spill B     registers per thread, bytes spilled (stores)
    mma               wgmma (operands in shared memory), mma v2 (registers) or none
    async copies      global -> shared copies the pipeliner issued
    loop loads        global loads inside a main loop (one with a dot) that are NOT
                      pipelined: each costs a memory round trip per iteration
    pre-wait loads    global loads before `griddepcontrol.wait` (Note
                      [programmatic dependent launch], compile_backend/kernels/_device.py)
    unswizzled        2-D shared-memory buffers without a swizzle (vec = 1): a dot
                      operand read from one has bank conflicts (Note [norm sums on
                      the tensor cores], docs/design.md)
    smem KiB          shared memory per program
Structure only: a row says how a loop is built, not how fast it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import triton  # noqa: E402

import report  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Spec:
    """One kernel specialization: `args` by parameter name (a pointer as its
    Triton type, "*bf16"; an int or float as its value, as the launcher would
    pass it) and the constexprs in `meta`; num_warps and num_stages apart."""

    name: str
    kernel: Callable
    args: dict[str, Any]
    meta: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3


def _signature(spec: Spec) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's launcher specializes a call:
    an int equal to 1 becomes a constant, one divisible by 16 (and every
    pointer: torch allocates 16-byte aligned) carries tt.divisibility 16;
    not an int the kernel leaves unspecialised (do_not_specialize)."""
    fn = getattr(spec.kernel, "fn", spec.kernel)
    names = list(spec.kernel.arg_names)
    plain = {p.name for p in getattr(spec.kernel, "params", ()) if getattr(p, "do_not_specialize", False)}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in spec.meta:
            sig[name] = "constexpr"
            consts[(i,)] = spec.meta[name]
            continue
        if name not in spec.args:
            raise KeyError(f"{spec.name}: no value for parameter {name!r} of {fn.__name__}")
        value = spec.args[name]
        if isinstance(value, str):
            sig[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{spec.name}: {name}={value!r}: give a pointer type, int or float")
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif name in plain:
            sig[name] = "i32"
        elif value == 1:
            sig[name] = "constexpr"
            consts[(i,)] = 1
        else:
            sig[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _loop_bodies(ttgir: str) -> list[str]:
    """The text of every scf.for region of a TTGIR module (nested ones inside
    their parent's text as well)."""
    bodies, lines = [], ttgir.splitlines()
    for start, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        depth, body = 0, []
        for inner in lines[start:]:
            depth += inner.count("{") - inner.count("}")
            body.append(inner)
            if depth <= 0 and len(body) > 1:
                break
        bodies.append("\n".join(body))
    return bodies


_GLOBAL_LOAD = re.compile(r"= tt\.load ")
# A 2-D shared layout with no swizzle, and the buffers allocated with it.
_UNSWIZZLED = re.compile(r"^(#shared\d*) = #ttg\.swizzled_shared<\{vec = 1, perPhase = 1, "
                         r"maxPhase = 1, order = \[\d+, \d+\]", re.M)


def read_ttgir(ttgir: str) -> dict[str, Any]:
    """The structural facts of one kernel's TTGIR (module docstring)."""
    # Triton 3.6 spells the wait as inline asm, 3.9 as an op of its own
    wait = max(ttgir.find("griddepcontrol.wait"), ttgir.find("tt.grid_dependency_wait"))
    pre_wait = len(_GLOBAL_LOAD.findall(ttgir[:wait])) + ttgir[:wait].count(
        "async_copy_global_to_local") if wait >= 0 else None
    loop_loads = 0
    for body in _loop_bodies(ttgir):
        inner = body.split("\n", 1)[1]
        if "scf.for" in inner or not ("tt.dot" in inner or "warp_group_dot" in inner):
            continue  # an outer loop (counted in its inner one), or no main loop (an epilogue's)
        loop_loads += len(_GLOBAL_LOAD.findall(body))
    mma = ("wgmma" if "warp_group_dot" in ttgir
           else "mma v2" if "versionMajor = 2" in ttgir else "none")
    flat = {f"{name}," for name in _UNSWIZZLED.findall(ttgir)}
    unswizzled = sum(1 for line in ttgir.splitlines()
                     if "ttg.local_alloc" in line and any(n in line for n in flat))
    return dict(mma=mma, async_copies=ttgir.count("async_copy_global_to_local"),
                tma=ttgir.count("async_tma_copy"), loop_loads=loop_loads, pre_wait_loads=pre_wait,
                unswizzled=unswizzled)


def _ptxas(ptx: str) -> dict[str, Any]:
    """Registers and spill bytes from a ptxas bundled with Triton (the first
    that takes this PTX's version: Triton 3.9 ships an older `ptxas` beside
    `ptxas-blackwell`), or why none did."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    exes = sorted(os.path.join(bin_dir, n) for n in os.listdir(bin_dir)
                  if n.startswith("ptxas")) if os.path.isdir(bin_dir) else []
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    why = "no bundled ptxas"
    try:
        for exe in exes:
            err = subprocess.run([exe, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                 capture_output=True, text=True, timeout=300).stderr
            regs = re.search(r"Used (\d+) registers", err)
            if regs is not None:
                spill = re.search(r"(\d+) bytes spill stores", err)
                return dict(regs=int(regs.group(1)), spill=int(spill.group(1)) if spill else 0,
                            ptxas=os.path.basename(exe))
            fatal = [ln for ln in err.splitlines() if "fatal" in ln]
            why = f"{os.path.basename(exe)}: " + (fatal[0].split("fatal", 1)[1].strip(" :")
                                                  if fatal else "no register count")
    finally:
        os.unlink(f.name)
    return dict(regs=None, spill=None, ptxas=why)


def compile_spec(spec: Spec, dump: str | None = None) -> dict[str, Any]:
    """Compile `spec` for capability 9.0; its row (module docstring)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = _signature(spec)
    src = ASTSource(fn=spec.kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ttgir", ttgir), ("ptx", ptx)):
            with open(os.path.join(dump, f"{spec.name}.{ext}"), "w") as f:
                f.write(text)
    shared = compiled.metadata.shared
    return dict(name=spec.name, **read_ttgir(ttgir), **_ptxas(ptx), smem_kib=shared / 1024,
                l2_prefetches=ptx.count("cp.async.bulk.prefetch.L2"))


# -- the specializations of a llama-8B decode step --------------------------------
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
BLOCK_SIZE, CONTEXT = 16, 512


def skinny_specs() -> list[Spec]:
    """The skinny GEMM as linear_add (o, down; also at 128 and 256 rows) and
    norm_linear (qkv, gate_up) launch it."""
    from compile_backend.kernels._device import cdiv
    from compile_backend.kernels.skinny_linear import MAX_ROWS, _skinny_linear_kernel, skinny_config

    out = []
    cases = [("o", HIDDEN, HIDDEN, False, False, True), ("down", HIDDEN, INTER, False, False, True),
             ("qkv+norm", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, True, False, False),
             ("gate_up+gate", 2 * INTER, HIDDEN, False, True, False),
             ("gate_up+norm+gate", 2 * INTER, HIDDEN, True, True, False)]
    for rows in (1, 16, 32, 64, 128, 256):
        for label, N, K, norm, gated, residual in cases:
            if rows > MAX_ROWS and (norm or gated):  # Note [wide rows]: the plain kernel only
                continue
            cfg = skinny_config(rows, N, K, gated=gated, norm=norm)
            split = 1 if gated else min(cfg.get("SPLIT_K", 1), cdiv(K, cfg["BLOCK_K"]))
            n_out = N // 2 if gated else N
            args = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", r_ptr="*bf16", nw_ptr="*bf16",
                        out_ptr="*bf16", part_ptr="*fp32", arrive_ptr="*i32",
                        M=rows, N=N, K=K, K_SPLIT=cdiv(cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"],
                        eps=1e-5,
                        stride_xm=K, stride_wn=K, stride_rm=n_out, stride_om=n_out)
            meta = dict(HAS_BIAS=False, HAS_RESIDUAL=residual, NORM=norm, GATED=gated,
                        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                        SPLIT_K=split, UPCAST=False, PDL=True)
            name = f"skinny_{label}_m{rows}"
            out.append(Spec(name, _skinny_linear_kernel, args, meta, cfg["num_warps"],
                            cfg["num_stages"]))
    return out


def decode_specs() -> list[Spec]:
    """Decode attention at one query token per request: split + reduce, and one launch."""
    import importlib

    ua = importlib.import_module("compile_backend.kernels.unified_attention")
    tiles = ua._tiles(HEAD_DIM, torch.bfloat16)
    qpk = HEADS // KV_HEADS
    common = dict(QUERIES_PER_KV=qpk, BLOCK_H=ua._dot_dim(qpk), HEAD_DIM=HEAD_DIM,
                  BLOCK_D=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, TILE_N=tiles["TILE_N"], UPCAST=False,
                  DOT_PRECISION="tf32", PDL=True)
    splits = 8
    ptrs = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16",
                part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", tickets_ptr="*i32",
                qsl_ptr="*i32", seq_lens_ptr="*i32", block_table_ptr="*i32")
    strides = dict(stride_q_t=(HEADS + 2 * KV_HEADS) * HEAD_DIM, stride_q_h=HEAD_DIM,
                   stride_o_t=HEADS * HEAD_DIM, stride_o_h=HEAD_DIM,
                   stride_c_blk=BLOCK_SIZE * KV_HEADS * HEAD_DIM, stride_c_off=KV_HEADS * HEAD_DIM,
                   stride_c_h=HEAD_DIM, stride_bt_b=CONTEXT // BLOCK_SIZE,
                   stride_pa_b=HEADS * splits * HEAD_DIM, stride_pa_h=splits * HEAD_DIM,
                   stride_pa_s=HEAD_DIM, stride_pm_b=HEADS * splits, stride_pm_h=splits)
    sizes = dict(scale_log2=0.1275, num_reqs=64, num_tokens=64, min_split_len=ua.MIN_SPLIT_LEN)
    # The rope kernels' extra arguments (Note [rotary inside decode attention]):
    # k, v column slices of one fused qkv output, int64 positions and slots.
    rope = dict(kn_ptr="*bf16", vn_ptr="*bf16", pos_ptr="*i64", inv_freq_ptr="*fp32",
                slot_ptr="*i64", stride_kn_t=(HEADS + 2 * KV_HEADS) * HEAD_DIM,
                stride_kn_h=HEAD_DIM, stride_vn_t=(HEADS + 2 * KV_HEADS) * HEAD_DIM,
                stride_vn_h=HEAD_DIM)
    allargs = {**ptrs, **strides, **sizes, **rope}
    pick = lambda kernel: {n: allargs[n] for n in kernel.arg_names if n in allargs}  # noqa: E731
    w, s = tiles["num_warps"], tiles["num_stages"]
    one = [
        Spec("decode_split", ua._decode_split_kernel, pick(ua._decode_split_kernel),
             dict(common, NUM_SPLITS=splits), w, s),
        Spec("decode_reduce", ua._decode_reduce_kernel, pick(ua._decode_reduce_kernel),
             dict(HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM, NUM_SPLITS=splits, BLOCK_S=splits,
                  SEARCH=ua.SEARCH, PDL=True), 4, s),
        Spec("decode_one_launch", ua._decode_kernel, pick(ua._decode_kernel),
             dict(common, BLOCK_HM=ua.next_pow2(qpk), NUM_SPLITS=splits, BLOCK_S=splits,
                  CHUNK=ua.merge_chunk(ua.next_pow2(qpk), HEAD_DIM, ua.next_pow2(splits)),
                  SEARCH=ua.SEARCH), w, s),
    ]
    return one + [Spec(f"{spec.name}_rope", rope_kernel, pick(rope_kernel),
                       dict(spec.meta, RNE_BF16=False), spec.num_warps, spec.num_stages)
                  for spec, rope_kernel in ((one[0], ua._decode_split_rope_kernel),
                                            (one[2], ua._decode_rope_kernel))]


def norm_specs() -> list[Spec]:
    """RMSNorm of a row as norm_linear's wide rows launch it, alone and with the
    residual's add (rms_norm.py: ADD, residual_norm_linear's wide form)."""
    from compile_backend.kernels.rms_norm import MAX_BLOCK_K, _rms_norm_kernel

    out = []
    for add in (False, True):
        args = dict(x_ptr="*bf16", r_ptr="*bf16", s_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                    K=HIDDEN, stride_xm=HIDDEN, stride_rm=HIDDEN, stride_sm=HIDDEN,
                    stride_om=HIDDEN, eps=1e-5)
        meta = dict(BLOCK_K=min(MAX_BLOCK_K, HIDDEN), ADD=add, RNE_BF16=False, PDL=True)
        out.append(Spec(f"rms_norm{'_add' if add else ''}_k{HIDDEN}", _rms_norm_kernel, args,
                        meta, 8, 3))
    return out


def prefetch_specs() -> list[Spec]:
    """The L2 prefetch of a weight (bench/l2_prefetch.py's kernel)."""
    from l2_prefetch import CHUNK, LANES, _l2_prefetch_kernel

    return [Spec("l2_prefetch", _l2_prefetch_kernel, dict(base_ptr="*u8", nbytes=HIDDEN * HIDDEN * 2),
                 dict(CHUNK=CHUNK, LANES=LANES, PDL=True), 4, 3)]


SPECS = {"skinny": skinny_specs, "decode": decode_specs, "norm": norm_specs,
         "prefetch": prefetch_specs}

COLUMNS = [("kernel", "name"), ("regs", "regs"), ("spill B", "spill"), ("mma", "mma"),
           ("async copies", "async_copies"), ("loop loads", "loop_loads"),
           ("pre-wait loads", "pre_wait_loads"), ("unswizzled", "unswizzled"),
           ("smem KiB", "smem_kib"), ("L2 prefetches", "l2_prefetches")]


def table(rows: list[dict]) -> list[str]:
    def cell(v):
        return report.dash(v, ".0f") if v is None or isinstance(v, float) else str(v)

    return report.table([c for c, _ in COLUMNS], "l" + "r" * (len(COLUMNS) - 1),
                        [[cell(r[k]) for _, k in COLUMNS] for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=",".join(SPECS), help=f"comma list of {sorted(SPECS)}")
    p.add_argument("--only", default="", help="a substring of the spec names to keep")
    p.add_argument("--dump", default=None, help="write each kernel's TTGIR and PTX here")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("TRITON_INTERPRET is set: the interpreter's kernels cannot be compiled; "
                "run with TRITON_INTERPRET unset (or 0)")
    unknown = set(a.kernels.split(",")) - set(SPECS)
    if unknown:
        p.error(f"unknown --kernels {sorted(unknown)}; choose from {sorted(SPECS)}")
    rows = []
    for family in a.kernels.split(","):
        for spec in SPECS[family]():
            if a.only in spec.name:
                rows.append(compile_spec(spec, a.dump))
    ptxas = sorted({r["ptxas"] for r in rows})
    lines = [f"Triton {triton.__version__}, capability 9.0 (sm_90a); registers from: "
             f"{'; '.join(ptxas)}", "", *table(rows)]
    report.print_and_write(lines, a.out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
