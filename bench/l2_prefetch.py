"""Does prefetching the o projection's weight into L2 during decode attention pay?

    python bench/l2_prefetch.py [--batches 1,16,64] [--context 500] [--layers 8]
                                [--prefetch-mib 0,8,16,32] [--programs 8] [--chunk-kib 16]
                                [--out bench/results/l2_prefetch.md]
    python bench/l2_prefetch.py --dry-run    (CPU plumbing, tiny shapes; numbers mean nothing)

At decode a layer's attention reads a few MB of KV at batch 1 and waits on
latency, so HBM idles while it runs; the o projection right after it then
streams its 32 MB weight. Here `--layers` llama-8B layer tails (paged
`unified_attention`, 32 query and 8 KV heads of 128, `--context` tokens,
then `mrv2::linear_add` of the o projection with its residual), each with its
own weight and caches so no replay finds the last one's in L2, are captured
in one CUDA graph and timed (median replay / layers). Variants: no prefetch,
and `l2_prefetch` (below: Hopper's `cp.async.bulk.prefetch.L2.global`, which
reads nothing, so outputs must stay bit-equal: checked) of the first N MiB of
the layer's o weight just before its attention. Measured on an H100 it made
every layer slower (bench/results/l2_prefetch.md), so the kernel lives here.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import report  # noqa: E402
from timing import graph_us_per  # noqa: E402
from compile_backend.kernels._device import (_cuda_major, interpreting, pdl_meta,  # noqa: E402
                                             pdl_release, pdl_wait)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 32, 8, 128, 16

# -- the prefetch: Hopper's cp.async.bulk.prefetch.L2.global --------------------------
# Which reads into no register and changes no value. Here and in
# bench/persistent_chain.py's `persistent+l2` (each program asking L2 for its
# rows of the next weight once its K loop is done): both measured slower
# (docs/design.md, "Hiding the fixed cost between kernels"), so the kernels
# of a step do not use it.
PREFETCH_LANES = tl.constexpr(128)  # rows a program asks for at once: a lane each at 4 warps


def l2_prefetch_supported(device: torch.device) -> bool:
    """Does the bulk prefetch issue anything on `device` (a CUDA GPU of
    compute capability 9 or later, not the interpreter)?"""
    if device.type != "cuda" or interpreting() or torch.version.hip:
        return False
    return _cuda_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@triton.jit
def l2_bulk_prefetch(ptrs, nbytes):
    """Ask L2 for `nbytes` (int32, multiples of 16) from each of `ptrs`
    (16-byte aligned): one bulk prefetch per element, no mask (an asm takes
    none; point lanes with nothing to ask at a valid address, 16 bytes)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_rows(base_ptr, rows, row_stride, nbytes, q, P):
    """Program q of P asks L2 for the first `nbytes` (a multiple of 16, from a
    16-byte aligned row start) of its share of `rows` rows of `row_stride`
    elements from base_ptr: rows [q R, (q + 1) R), R = cdiv(rows, P). GPU
    only (l2_prefetch_supported)."""
    per = tl.cdiv(rows, P)
    lanes = tl.arange(0, PREFETCH_LANES)
    hi = tl.minimum(rows, (q + 1) * per)
    for r0 in range(q * per, hi, PREFETCH_LANES):
        ok = r0 + lanes < hi
        # lanes past the share ask for 16 bytes of its last row (no mask on an asm)
        r = tl.minimum(r0 + lanes, hi - 1)
        l2_bulk_prefetch(base_ptr + r.to(tl.int64) * row_stride, tl.where(ok, nbytes, 16).to(tl.int32))


# A weight's bytes from a few programs, one chunk per lane:
CHUNK = 16 << 10  # bytes per prefetch instruction (a multiple of 16)
LANES = 128  # prefetch instructions a program issues at once (one per thread at 4 warps)


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr,
                        PDL: tl.constexpr):
    # base_ptr: uint8, 16-byte aligned; nbytes a multiple of 16. Program p
    # issues chunks p * LANES + lane, then every num_programs * LANES after.
    # Under PDL the prefetches go out before the wait (they read nothing:
    # Note [programmatic dependent launch] in compile_backend/kernels/_device.py),
    # and the release comes after it, so the kernel after this one still
    # starts only once every kernel before this one has completed.
    lanes = tl.arange(0, LANES)
    n_chunks = tl.cdiv(nbytes, CHUNK)
    step = tl.num_programs(0) * LANES
    for c0 in range(tl.program_id(0) * LANES, n_chunks, step):
        c = c0 + lanes
        ok = c < n_chunks
        off = tl.where(ok, c.to(tl.int64) * CHUNK, 0)  # lanes past the end: the first 16 bytes
        size = tl.where(ok, tl.minimum(nbytes - off, CHUNK), 16).to(tl.int32)
        l2_bulk_prefetch(base_ptr + off, size)
    pdl_wait(PDL)
    pdl_release(PDL)


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None, programs: int = 8,
                chunk: int = CHUNK) -> int:
    """Launcher: prefetch the first `nbytes` of contiguous `t` (all of it by
    default) into L2 on the current stream, from `programs` programs; the
    bytes asked for (rounded down to 16, from a 16-byte aligned start), or 0
    where nothing was issued (not supported here, or nothing to ask for)."""
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ValueError("l2_prefetch: give a contiguous tensor (its bytes are one range); got "
                         f"{type(t).__name__}" + (f" with strides {tuple(t.stride())}"
                                                  if isinstance(t, torch.Tensor) else ""))
    if chunk < 16 or chunk % 16:
        raise ValueError(f"l2_prefetch: chunk must be a multiple of 16 bytes, got {chunk}")
    if programs < 1:
        raise ValueError(f"l2_prefetch: programs must be >= 1, got {programs}")
    total = t.numel() * t.element_size()
    if nbytes is None:
        nbytes = total
    if not 0 <= nbytes <= total:
        raise ValueError(f"l2_prefetch: nbytes must be in [0, {total}] (the tensor's size), got {nbytes}")
    if not l2_prefetch_supported(t.device):
        return 0
    skip = (-t.data_ptr()) % 16  # to the first 16-byte boundary
    nbytes = max(0, nbytes - skip) // 16 * 16
    if nbytes == 0:
        return 0
    base = t.reshape(-1).view(torch.uint8)[skip:]
    grid = (max(1, min(programs, triton.cdiv(nbytes, chunk * LANES))),)
    _l2_prefetch_kernel[grid](base, nbytes, CHUNK=chunk, LANES=LANES, num_warps=4,
                              **pdl_meta(t.device))
    return nbytes

DRY = dict(HIDDEN=256, HEADS=4, KV_HEADS=2, HEAD_DIM=64)  # --dry-run's shapes


class Chain:
    """`layers` layer tails (attention, then the o projection with the
    residual) at batch B, each with its own caches, weight and buffers."""

    def __init__(self, B: int, ctx: int, layers: int, device: str, dims: dict, g: torch.Generator):
        self.dims = dims
        H, KVH, D, hid = dims["HEADS"], dims["KV_HEADS"], dims["HEAD_DIM"], dims["HIDDEN"]
        dtype = torch.bfloat16
        blocks = math.ceil(ctx / BLOCK)
        self.B, self.ctx, self.layers = B, ctx, []
        qsl = torch.arange(0, B + 1, dtype=torch.int32, device=device)
        seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        for _ in range(layers):
            nblk = B * blocks + 1
            table = (torch.randperm(nblk - 1, generator=g) + 1)[: B * blocks]
            self.layers.append(dict(
                q=torch.randn(B, H, D, generator=g).to(device, dtype),
                kc=torch.randn(nblk, BLOCK, KVH, D, generator=g).to(device, dtype),
                vc=torch.randn(nblk, BLOCK, KVH, D, generator=g).to(device, dtype),
                table=table.view(B, blocks).to(torch.int32).to(device),
                w=(torch.randn(hid, H * D, generator=g) / math.sqrt(H * D)).to(device, dtype),
                res=torch.randn(B, hid, generator=g).to(device, dtype),
                qsl=qsl, seq_lens=seq_lens))
        self.scale = D ** -0.5

    def attention(self, lay: dict) -> torch.Tensor:
        from compile_backend.kernels import unified_attention, unified_attention_ref

        args = (lay["q"], lay["kc"], lay["vc"], lay["qsl"], lay["seq_lens"], lay["table"], self.scale)
        if not lay["q"].is_cuda:  # a dry run: the torch reference
            return unified_attention_ref(*args)
        return unified_attention(*args, 1, self.ctx)

    def o_proj(self, lay: dict, attn: torch.Tensor) -> torch.Tensor:
        return torch.ops.mrv2.linear_add(attn.reshape(self.B, -1), lay["w"], None, lay["res"])

    def run(self, prefetch_bytes: int, programs: int = 8, chunk: int = CHUNK) -> list[torch.Tensor]:
        outs = []
        for lay in self.layers:
            if prefetch_bytes:
                l2_prefetch(lay["w"], min(prefetch_bytes, lay["w"].numel() * 2), programs,
                            chunk)
            outs.append(self.o_proj(lay, self.attention(lay)))
        return outs

    def attentions(self) -> list[torch.Tensor]:
        return [self.attention(lay) for lay in self.layers]

    def o_projs(self, attns: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.o_proj(lay, a) for lay, a in zip(self.layers, attns)]


def bench_batch(B: int, args, device: str, dims: dict, bw: float) -> list[dict]:
    g = torch.Generator().manual_seed(1000 + B)
    chain = Chain(B, args.context, args.layers, device, dims, g)
    ref = chain.run(0)
    attns = chain.attentions()
    w_bytes = chain.layers[0]["w"].numel() * 2
    rows = []
    alone_attn = graph_us_per(chain.attentions, device, args.layers)
    alone_o = graph_us_per(lambda: chain.o_projs(attns), device, args.layers)
    for mib in args.prefetch_mib:
        nbytes = min(mib << 20, w_bytes)

        def step(n=nbytes):  # the chain with this size's prefetches, the run timed below
            return chain.run(n, args.programs, args.chunk_kib << 10)

        out = step()
        equal = all(torch.equal(a, b) for a, b in zip(out, ref))
        if not equal:
            raise AssertionError(f"b{B} prefetch {mib} MiB: outputs differ from no prefetch "
                                 "(a prefetch must change no value)")
        rows.append(dict(batch=B, prefetch_mib=nbytes / (1 << 20),
                         layer_us=graph_us_per(step, device, args.layers),
                         attention_us=alone_attn, o_proj_us=alone_o, o_floor_us=w_bytes / bw * 1e6, equal=equal))
    return rows


def fmt(rows: list[dict], bw_text: str) -> list[str]:
    base = {r["batch"]: r["layer_us"] for r in rows if r["prefetch_mib"] == 0}
    out = [f"copy bandwidth {bw_text}; µs per layer (attention + o projection with its residual), "
           "median replay of one CUDA graph of the chain / layers", ""]
    out += report.table(
        ["batch", "prefetch MiB", "layer µs", "vs none", "attention alone µs", "o proj alone µs",
         "o weight floor µs", "outputs bit-equal"], "rrrrrrrl",
        [(r["batch"], f"{r['prefetch_mib']:.3g}", f"{r['layer_us']:.2f}",
          report.dash(r["layer_us"] / base[r["batch"]] if r["batch"] in base else None, ".3f"),
          f"{r['attention_us']:.2f}", f"{r['o_proj_us']:.2f}", f"{r['o_floor_us']:.2f}",
          "yes" if r["equal"] else "NO") for r in rows])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefetch-mib", default="0,8,16,32")
    ap.add_argument("--programs", type=int, default=8, help="programs of the prefetch kernel (at most)")
    ap.add_argument("--chunk-kib", type=int, default=CHUNK >> 10, help="KiB per prefetch instruction")
    report.add_out(ap, default=os.path.join(report.RESULTS_DIR, "l2_prefetch.md"))
    report.add_dry_run(ap)
    args = ap.parse_args(argv)
    args.batches = report.comma_list(args.batches, int)
    args.prefetch_mib = report.comma_list(args.prefetch_mib, int)
    if 0 not in args.prefetch_mib:
        args.prefetch_mib.insert(0, 0)  # the baseline every row is compared with
    if args.dry_run:
        device, dims, gpu = "cpu", dict(DRY), "CPU dry run"
        args.layers, args.context = min(args.layers, 2), min(args.context, 40)
        bw_samples = [1e9]
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (or --dry-run on a CPU)")
        from timing import copy_bandwidth

        device, dims, gpu = "cuda", dict(HIDDEN=HIDDEN, HEADS=HEADS, KV_HEADS=KV_HEADS,
                                         HEAD_DIM=HEAD_DIM), torch.cuda.get_device_name()
        bw_samples = list(copy_bandwidth().samples)
    import compile_backend.kernels  # noqa: F401  (registers mrv2's ops)

    bw = statistics.median(bw_samples)
    rows = []
    for B in args.batches:
        rows += bench_batch(B, args, device, dims, bw)
        print(f"b{B}: " + ", ".join(f"{r['prefetch_mib']:.3g} MiB {r['layer_us']:.2f} µs"
                                    for r in rows if r["batch"] == B), flush=True)
    meta = report.run_meta("l2_prefetch", argv, gpu)
    meta.update(copy_bandwidth_samples_GBps=[s / 1e9 for s in bw_samples], layers=args.layers,
                context=args.context, programs=args.programs,
                chunk_kib=args.chunk_kib)
    bw_text = f"{bw / 1e9:.0f} GB/s (median of {len(bw_samples)} rounds)"
    text = "\n".join([report.heading("o projection weight prefetched into L2 during attention",
                                     meta), "", f"Command: `{meta['command']}`", "",
                      *fmt(rows, bw_text)]) + "\n"
    print(text)
    if args.out:
        report.write_md_and_json(args.out, text, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
