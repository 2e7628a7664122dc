"""Benchmark of the mrv2 kernels on one GPU (run on the H200).

For each op: median time (triton.testing.do_bench, warm-up excluded), the
bytes it must move (each input read once, each output written once), the
achieved GB/s and its share of the copy bandwidth measured in the same run.
Decode attention is compared with torch SDPA on a padded dense cache and with
flex attention (where it compiles). Writes kernels.md and kernels.json.

    python bench/kernel_speed.py [--out-dir bench/results] [--quick] [--only sconv,kv_compress]

`--decode-compare` times only decode attention at llama-8B shapes (B = 1, 8,
64, 256; contexts 500 and 4000), the one-launch kernel (with MIN_SPLIT_LEN
64 .. 512) against the two-launch split + reduce path, each with the exact
max_seq_len and with a capture bound of 8192 (what a FULL graph holds:
splits fixed by the bound, used by the runtime length), and writes
decode_compare.md / .json:

    python bench/kernel_speed.py --decode-compare [--out-dir bench/results]

`--decode-split-sweep` times decode attention at B = 1, 4, 8, 16, 32 (where
the two-launch form runs) with the plan's default choice and the two-launch
form at MIN_SPLIT_LEN 32 .. 256, bounds ctx + 64 and 8192, and writes
decode_splits.md / .json.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import RESULTS_DIR, add_out, comma_list, run_meta, write_md_and_json  # noqa: E402
from report import table as md_table  # noqa: E402
from timing import copy_bandwidth, graph_ms, median_ms, spread_text  # noqa: E402

from compile_backend.kernels import kv_compress, reshape_and_cache, sconv, unified_attention  # noqa: E402
from compile_backend.kernels.unified_attention import (  # noqa: E402
    MIN_SPLIT_LEN, TWO_LAUNCH_MIN_SPLIT_LEN, decode_form, num_kv_splits)


def decode_splits(B, bound, config):
    """The grid's splits the plan takes for this decode (B requests, KVH kv
    heads, max_seq_len `bound`) and config."""
    two, min_split = decode_form(B, KVH, torch.device(DEV), config)
    return num_kv_splits(B, KVH, bound, torch.device(DEV), min_split)

DEV = "cuda"
BF16 = torch.bfloat16
H, KVH, D, BS = 32, 8, 128, 16
TARGETS = {"decode_b64_ctx4096": 0.70, "decode_b1_ctx32768": 0.50, "kv_write_t16384": 0.60}


def bench(fn) -> float:
    """Median milliseconds."""
    return median_ms(fn)


def bench_graph(fns, calls: int = 12) -> float:
    """Median ms per call with `calls` calls (cycling through `fns`) captured
    in one CUDA graph (bench/timing.py)."""
    return graph_ms(fns, calls)


def timed(fns):
    """(graph ms per call, eager ms per call)."""
    eager = bench(fns[0])
    try:
        return bench_graph(fns), eager
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return float("nan"), eager


def paged(B, ctx, q_len=1, g=None):
    blocks_per = math.ceil(ctx / BS)
    num_blocks = B * blocks_per + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    table = perm[: B * blocks_per].view(B, blocks_per).to(torch.int32).to(DEV)
    kc = torch.randn(num_blocks, BS, KVH, D, dtype=BF16, device=DEV)
    vc = torch.randn_like(kc)
    qsl = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device=DEV)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    return kc, vc, table, qsl, seq_lens


def row(name, times, nbytes, copy_bw, flops=None, extra=None):
    ms, eager_ms = times
    if ms != ms:  # graph capture failed: eager numbers
        ms = eager_ms
    gbs = nbytes / (ms * 1e-3) / 1e9
    r = dict(op=name, ms=ms, eager_ms=eager_ms, bytes=nbytes, gbps=gbs, pct_copy=100 * gbs / copy_bw)
    if flops:
        r["tflops"] = flops / (ms * 1e-3) / 1e12
    if name in TARGETS:
        r["target_pct"] = 100 * TARGETS[name]
        r["meets_target"] = r["pct_copy"] >= 100 * TARGETS[name]
    r.update(extra or {})
    return r


def decode_rows(B, ctx, copy_bw, g, sweep=()):
    n_sets = max(1, min(4, (512 << 20) // (2 * B * ctx * KVH * D * 2)))
    sets = [paged(B, ctx, 1, g) for _ in range(n_sets)]
    kc, vc, table, qsl, seq_lens = sets[0]
    q = torch.randn(B, H, D, dtype=BF16, device=DEV)
    scale = D ** -0.5
    nbytes = 2 * B * ctx * KVH * D * 2 + 2 * q.numel() * 2 + table.numel() * 4
    splits = num_kv_splits(B, KVH, ctx, torch.device(DEV))

    def fns(**kw):
        return [lambda s=s: unified_attention(q, s[0], s[1], s[3], s[4], s[2], scale, 1, ctx, **kw)
                for s in sets]

    name = f"decode_b{B}_ctx{ctx}"
    rows = [row(name, timed(fns()), nbytes, copy_bw, extra=dict(splits=splits))]
    for kw in sweep:
        rows.append(row(f"{name} {kw}", timed(fns(**kw)), nbytes, copy_bw,
                        extra=dict(splits=kw.get("num_splits", splits))))
    # Stock alternative: SDPA on a dense padded cache [B, KVH, ctx, D] (layout
    # prepared outside the timing; paging not included).
    kd = kc[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    vd = vc[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    qd = q[:, :, None, :]
    del kc, vc, sets
    try:
        f = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)  # noqa: E731
        rows.append(row(f"{name} [sdpa dense]", timed([f]), nbytes, copy_bw))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(op=f"{name} [sdpa dense]", error=repr(e)[:200]))
    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        f = lambda: flex(qd, kd, vd, scale=scale, enable_gqa=True)  # noqa: E731
        f()
        rows.append(row(f"{name} [flex dense]", (float("nan"), bench(f)), nbytes, copy_bw))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(op=f"{name} [flex dense]", error=repr(e)[:200]))
    return rows


def decode_compare_rows(B, ctx, copy_bw, g, bound=None, variants=None):
    """Decode attention at B x ctx keys: the two-launch path and the
    one-launch kernel (default MIN_SPLIT_LEN and a sweep), inside CUDA graphs,
    with max_seq_len = `bound` (default: ctx). `variants`: (label, config,
    min split) triples instead (the first is the speed-up's base)."""
    bound = bound or ctx
    n_sets = max(1, min(4, (512 << 20) // (2 * B * ctx * KVH * D * 2)))
    sets = [paged(B, ctx, 1, g) for _ in range(n_sets)]
    q = torch.randn(B, H, D, dtype=BF16, device=DEV)
    scale = D ** -0.5
    nbytes = 2 * B * ctx * KVH * D * 2 + 2 * q.numel() * 2 + sets[0][2].numel() * 4
    if variants is None:
        variants = [("two launches", dict(TWO_LAUNCH=True), MIN_SPLIT_LEN)]
        variants += [(f"one launch, min split {m}" + (" (default)" if m == MIN_SPLIT_LEN else ""),
                      dict(MIN_SPLIT_LEN=m), m) for m in (64, 128, 256, 512)]
    rows = []
    for label, config, min_split in variants:
        # The block table is as wide as the bound (a FULL graph's capture).
        fns = []
        for kc, vc, table, qsl, seq_lens in sets:
            if bound > ctx:
                table = torch.nn.functional.pad(table, (0, -(-bound // BS) - table.shape[1]))
            fns.append(lambda kc=kc, vc=vc, table=table, qsl=qsl, seq_lens=seq_lens, config=config:
                       unified_attention(q, kc, vc, qsl, seq_lens, table, scale, 1, bound,
                                         config=config))
        splits = decode_splits(B, bound, config)
        r = row(f"decode_b{B}_ctx{ctx}" + (f" [bound {bound}]" if bound != ctx else ""),
                timed(fns), nbytes, copy_bw, extra=dict(splits=splits, path=label, B=B, ctx=ctx,
                                                        bound=bound))
        rows.append(r)
    base = rows[0]["ms"]
    for r in rows:
        r["speedup"] = base / r["ms"]
    return rows


def bandwidth_line(meta) -> str:
    """The tables' first line: the copy bandwidth the % column divides by
    (the median of the run's rounds, min-max beside it; an older run's one figure)."""
    samples = meta.get("copy_gbps_samples")
    if not samples:
        return f"copy bandwidth (1 GiB D2D, read+write): {meta['copy_gbps']:.0f} GB/s"
    return (f"copy bandwidth (1 GiB D2D, read+write): {spread_text(samples)} over "
            f"{len(samples)} rounds of 20 copies (% copy BW divides by the median)")


def fmt_decode_compare(rows, bandwidth: str) -> str:
    """`bandwidth`: bandwidth_line's."""
    lines = [bandwidth, "",
             "Decode attention, llama-8B shapes (32 q heads, 8 kv heads, head dim 128, bf16, block 16).",
             "us: per call inside a CUDA graph (12 calls per graph); eager us: do_bench of the plain",
             "call; splits: the grid's splits (fixed by the bound; the one-launch kernel uses fewer",
             "for short contexts); speed-up: against the first row of the same shape.", ""]
    lines += md_table(["B", "ctx", "bound", "path", "splits", "us", "eager us", "GB/s", "% copy BW", "speed-up"],
                      "rrrl" + "r" * 6,
                      [[r["op"]] + [None] * 8 + [r["error"][:80]] if "error" in r else
                       [r["B"], r["ctx"], r["bound"], r["path"], r["splits"], f"{1e3 * r['ms']:.1f}",
                        f"{1e3 * r['eager_ms']:.1f}", f"{r['gbps']:.0f}", f"{r['pct_copy']:.1f}",
                        f"{r['speedup']:.2f}x"] for r in rows])
    return "\n".join(lines)


def split_sweep_variants():
    """--decode-split-sweep: the two-launch path's splits (MIN_SPLIT_LEN bounds
    them at capture) against the plan's default choice."""
    out = [("default plan", {}, None)]
    out += [(f"two launches, min split {m}" + (" (default)" if m == TWO_LAUNCH_MIN_SPLIT_LEN else ""),
             dict(TWO_LAUNCH=True, MIN_SPLIT_LEN=m), m) for m in (32, 64, 128, 256)]
    return out


def tile_sweep_variants():
    """--decode-tile-sweep: the one-launch kernel's tiles (key tile, stages,
    warps) and shorter splits, against the plan's default choice."""
    out = [("default plan", {}, None)]
    out += [(f"TILE_N {t}, {st} stages, {w} warps", dict(TILE_N=t, num_stages=st, num_warps=w), None)
            for t in (32, 64) for st in (1, 2, 3, 4) for w in (4, 8)]
    out += [(f"min split {m}", dict(MIN_SPLIT_LEN=m), m) for m in (64, 128)]
    return out


def gather(steps) -> list[dict]:
    """The rows of each (name, step): a step that raises is one row with its
    error, under `name` (None: "step <rows so far>"), and the next step runs."""
    rows = []
    for name, step in steps:
        try:
            rows += step()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(op=name or f"step {len(rows)}", error=traceback.format_exc(limit=1)[-200:]))
        torch.cuda.empty_cache()
    return rows


def decode_compare(out_dir, argv=None, sweep="compare") -> None:
    """Decode attention at llama-8B shapes, one table: `sweep` "compare" (one
    launch against two), "splits" (the two-launch form's splits) or "tiles"
    (the one-launch kernel's tiles)."""
    batches, variants, bounds, name = {
        "compare": ((1, 8, 64, 256), None, lambda ctx: (ctx, 8192), "decode_compare"),
        "splits": ((1, 4, 8, 16, 32), split_sweep_variants(), lambda ctx: (ctx + 64, 8192),
                   "decode_splits"),
        "tiles": ((64, 256), tile_sweep_variants(), lambda ctx: (ctx + 64,), "decode_tiles"),
    }[sweep]
    g = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    copy_bw = bw.median / 1e9
    rows = gather((f"decode_b{B}_ctx{ctx} bound {bound}",
                   lambda B=B, ctx=ctx, bound=bound: decode_compare_rows(B, ctx, copy_bw, g, bound, variants))
                  for B in batches for ctx in (500, 4000) for bound in bounds(ctx))
    print(write_kernel_results(out_dir, name, "Decode attention: one launch vs two",
                               kernels_meta(argv, bw), rows))


def prefill_rows(B, L, copy_bw, g):
    kc, vc, table, qsl, seq_lens = paged(B, L, L, g)
    q = torch.randn(B * L, H, D, dtype=BF16, device=DEV)
    scale = D ** -0.5
    nbytes = 2 * B * L * KVH * D * 2 + 2 * q.numel() * 2
    flops = 4 * B * H * D * L * L / 2  # causal
    name = f"prefill_b{B}_len{L}"
    rows = [row(name, timed([lambda: unified_attention(q, kc, vc, qsl, seq_lens, table, scale, L, L)]),
                nbytes, copy_bw, flops=flops)]
    for cfg in ({"BLOCK_M": 128, "num_warps": 8}, {"BLOCK_M": 128, "TILE_N": 64, "num_warps": 8, "num_stages": 2}):
        rows.append(row(f"{name} {cfg}", timed([lambda cfg=cfg: unified_attention(
            q, kc, vc, qsl, seq_lens, table, scale, L, L, config=cfg)]), nbytes, copy_bw, flops=flops))
    kd = kc[table.long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    vd = vc[table.long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    qd = q.view(B, L, H, D).transpose(1, 2).contiguous()
    try:
        f = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731,E501
        rows.append(row(f"{name} [sdpa dense]", timed([f]), nbytes, copy_bw, flops=flops))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(op=f"{name} [sdpa dense]", error=repr(e)[:200]))
    return rows


def kv_write_rows(T, copy_bw, g):
    num_blocks = T // BS + 8
    kc = torch.randn(num_blocks, BS, KVH, D, dtype=BF16, device=DEV)
    vc = torch.randn_like(kc)
    key = torch.randn(T, KVH, D, dtype=BF16, device=DEV)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * BS, generator=g)[:T].to(DEV)
    nbytes = 2 * 2 * key.numel() * 2 + T * 8
    f = lambda: reshape_and_cache(key, value, kc, vc, slots)  # noqa: E731
    return [row(f"kv_write_t{T}", timed([f]), nbytes, copy_bw)]


def _qsl(q_lens):
    return torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=DEV)


def _bound_name(fmt, q_lens, bound):
    """fmt with {shape}: b{B}_q{len} for uniform batches, else b{B}_t{T}. A
    bound other than the longest request (PIECEWISE passes the padded token
    count) is named."""
    B, T = len(q_lens), sum(q_lens)
    shape = f"b{B}_q{q_lens[0]}" if len(set(q_lens)) == 1 else f"b{B}_t{T}"
    return fmt.format(shape=shape) + ("" if bound == max(q_lens) else f" [max_query_len={bound}]")


def sconv_rows(B, q_len, C, K, copy_bw, g, sweep=(), q_lens=None, bound=None):
    q_lens = q_lens or [q_len] * B
    B, T = len(q_lens), sum(q_lens)
    bound = bound or max(q_lens)
    x = torch.randn(T, C, dtype=BF16, device=DEV)
    w = torch.randn(C, K, dtype=BF16, device=DEV)
    bias = torch.randn(C, dtype=BF16, device=DEV)
    state = torch.randn(B, C, K - 1, dtype=BF16, device=DEV)
    qsl = _qsl(q_lens)
    idx = torch.arange(B, dtype=torch.int32, device=DEV)
    init = torch.ones(B, dtype=torch.bool, device=DEV)
    nbytes = 2 * x.numel() * 2 + 2 * state.numel() * 2
    name = _bound_name(f"sconv_{{shape}}_c{C}", q_lens, bound)
    rows = [row(name, timed([lambda: sconv(x, w, bias, state, qsl, idx, init, bound)]), nbytes, copy_bw)]
    for cfg in sweep:
        rows.append(row(f"{name} {cfg}", timed([lambda cfg=cfg: sconv(x, w, bias, state, qsl, idx, init, bound,
                                                                      config=cfg)]), nbytes, copy_bw))
    return rows


def compress_rows(B, q_len, ctx, ratio, copy_bw, g, q_lens=None, bound=None):
    q_lens = q_lens or [q_len] * B
    B, T = len(q_lens), sum(q_lens)
    bound = bound or max(q_lens)
    key = torch.randn(T, KVH, D, dtype=BF16, device=DEV)
    score = torch.randn(T, KVH, dtype=BF16, device=DEV)
    groups = math.ceil(ctx / ratio)
    bpr = math.ceil(groups / BS)
    cache = torch.zeros(B * bpr + 1, BS, KVH, D, dtype=BF16, device=DEV)
    table = (torch.arange(B * bpr, dtype=torch.int32, device=DEV) + 1).view(B, bpr)
    sm = torch.zeros(B, KVH, device=DEV)
    ss = torch.ones(B, KVH, device=DEV)
    sa = torch.zeros(B, KVH, D, device=DEV)
    qsl = _qsl(q_lens)
    seq_lens = torch.tensor([max(ctx, n) for n in q_lens], dtype=torch.int32, device=DEV)
    idx = torch.arange(B, dtype=torch.int32, device=DEV)
    nbytes = 2 * key.numel() * 2 + score.numel() * 2 + key.numel() * 2 // ratio
    f = lambda: kv_compress(key, score, cache, sm, ss, sa, qsl, seq_lens, idx, table, ratio, bound)  # noqa: E731
    return [row(_bound_name(f"kv_compress_{{shape}}_r{ratio}", q_lens, bound), timed([f]), nbytes, copy_bw)]


def fmt_table(rows, bandwidth: str) -> str:
    """`bandwidth`: bandwidth_line's."""
    def cells(r):
        if "error" in r:
            return [r["op"]] + ["-"] * 7 + [r["error"][:80]]
        tgt = ""
        if "target_pct" in r:
            tgt = f">= {r['target_pct']:.0f}% {'met' if r['meets_target'] else 'MISSED'}"
        return [r["op"], f"{r['ms']:.4f}", f"{r['eager_ms']:.4f}", f"{r['bytes'] / 1e6:.1f}", f"{r['gbps']:.0f}",
                f"{r['pct_copy']:.1f}", f"{r['tflops']:.0f}" if "tflops" in r else "", tgt,
                f"splits={r['splits']}" if "splits" in r else ""]
    lines = [bandwidth, "",
             "ms: per call inside a CUDA graph (how mrv2 runs the ops); eager ms: do_bench of the",
             "plain call (adds host launch overhead where the GPU work is short).", ""]
    lines += md_table(["op", "ms", "eager ms", "MB moved", "GB/s", "% copy BW", "TFLOP/s", "target", "note"],
                      "l" + "r" * 6 + "ll", [cells(r) for r in rows])
    return "\n".join(lines)


def kernels_meta(argv, bw) -> dict:
    """`bw`: the run's copy bandwidth rounds (bench/timing.py)."""
    return {**run_meta("kernels", argv, torch.cuda.get_device_name(), python=False),
            "copy_gbps": bw.median / 1e9, "copy_gbps_samples": bw.gbps(),
            "shapes": dict(H=H, KVH=KVH, D=D, block_size=BS, dtype="bfloat16")}


def write_kernel_results(out_dir: str, name: str, title: str, meta: dict, rows: list[dict]) -> str:
    """<name>.md (title, date, GPU, versions, command, the table) and <name>.json; returns the table."""
    text = (fmt_table if name == "kernels" else fmt_decode_compare)(rows, bandwidth_line(meta))
    write_md_and_json(os.path.join(out_dir, f"{name}.md"),
                      f"# {title}\n\n{meta['date']} on {meta['gpu']}, torch {meta['torch']}, "
                      f"triton {meta['triton']}\n\n`{meta['command']}`\n\n{text}\n",
                      dict(meta=meta, rows=rows))
    return text


def kernel_steps(copy_bw, g, quick: bool) -> list[tuple[str, object]]:
    """(op kind, step): the main table's shapes, each step a list of rows."""
    # PIECEWISE passes attention-like ops max_query_len = the padded token count:
    # a decode batch of 256 and a mixed batch (one long prefill and decodes).
    mixed = [1985] + [1] * 63
    steps = [
        ("decode", lambda: decode_rows(64, 4096, copy_bw, g, sweep=[dict(num_splits=1), dict(num_splits=4)])),
        ("decode", lambda: decode_rows(1, 32768, copy_bw, g, sweep=[
            dict(num_splits=32), dict(num_splits=128),
            dict(config=dict(TILE_N=32, num_stages=4)), dict(config=dict(TILE_N=128, num_stages=2, num_warps=8))])),
        ("kv_write", lambda: kv_write_rows(16384, copy_bw, g)),
        ("kv_write", lambda: kv_write_rows(64, copy_bw, g)),
        ("prefill", lambda: prefill_rows(4, 2048, copy_bw, g)),
        ("sconv", lambda: sconv_rows(8, 2048, 4096, 4, copy_bw, g, sweep=[
            dict(block_t=32, block_c=256), dict(block_t=16, block_c=512), dict(block_t=64, block_c=64, num_warps=2)])),
        ("sconv", lambda: sconv_rows(64, 1, 4096, 4, copy_bw, g)),
        ("sconv", lambda: sconv_rows(256, 1, 4096, 4, copy_bw, g, bound=256)),
        ("sconv", lambda: sconv_rows(0, 0, 4096, 4, copy_bw, g, q_lens=mixed, bound=2048)),
        ("kv_compress", lambda: compress_rows(8, 2048, 2048, 4, copy_bw, g)),
        ("kv_compress", lambda: compress_rows(64, 1, 4096, 4, copy_bw, g)),
        ("kv_compress", lambda: compress_rows(256, 1, 4096, 4, copy_bw, g, bound=256)),
        ("kv_compress", lambda: compress_rows(0, 0, 4096, 4, copy_bw, g, q_lens=mixed, bound=2048)),
    ]
    if not quick:
        steps.insert(2, ("decode", lambda: decode_rows(16, 8192, copy_bw, g)))
    return steps


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_out(ap, RESULTS_DIR, flag="--out-dir")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--only", help="comma-separated ops: decode,kv_write,prefill,sconv,kv_compress")
    ap.add_argument("--decode-compare", action="store_true",
                    help="only decode attention: one launch vs two at llama-8B shapes (decode_compare.md)")
    ap.add_argument("--decode-split-sweep", action="store_true",
                    help="only decode attention at B <= 32: the two-launch path's splits (decode_splits.md)")
    ap.add_argument("--decode-tile-sweep", action="store_true",
                    help="only decode attention at B = 64 and 256: the one-launch kernel's tiles "
                         "(decode_tiles.md)")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.decode_compare or args.decode_split_sweep or args.decode_tile_sweep:
        decode_compare(args.out_dir, argv, "splits" if args.decode_split_sweep
                       else "tiles" if args.decode_tile_sweep else "compare")
        return
    g = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    steps = kernel_steps(bw.median / 1e9, g, args.quick)
    if args.only:
        steps = [s for s in steps if s[0] in comma_list(args.only)]
    rows = gather((None, step) for _, step in steps)
    print(write_kernel_results(args.out_dir, "kernels", "mrv2 kernel benchmark", kernels_meta(argv, bw), rows))


if __name__ == "__main__":
    main()
