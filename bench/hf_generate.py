"""An unmodified Hugging Face Llama's `generate` under `torch.compile(backend="mrv2")`:
milliseconds per new token with the linear passes on and off, against eager.

    python bench/hf_generate.py [--layers 8] [--hidden 2048] [--batches 1,8]
                                [--new-tokens 64] [--prompt 128] [--mode full]

The model: transformers' LlamaForCausalLM with random bf16 weights (seeded),
hidden 2048, 32 heads, 8 KV heads, intermediate 5632, vocab 32000 (the
bench preset's widths) unless told otherwise. Variants:
  eager             the model as is;
  mrv2 passes on    the defaults: fuse_sibling_linears (q/k/v and gate/up
                    one GEMM), fuse_linear_residual (o and down with the
                    residual in one kernel at decode) and fuse_norm_linear
                    (the RMSNorms and the SiLU·mul inside the q/k/v and
                    gate/up GEMMs at decode);
  mrv2 passes off   the three options False;
  mrv2 sibling only / mrv2 residual only
                    one linear pass on, to tell which one a change between
                    "off" and "on" comes from.
`--variants` picks some (eager, off, sibling, residual, on); `--profile`
adds, per variant and batch, the kernels of one generate call of
`--profile-tokens` new tokens (torch.profiler) and the device time per new
token beside the wall time (device ms / token: a call of
`--profile-tokens` new tokens minus a call of one, per decode token): a
step whose kernels take much less than its time waits on the host.
`--host-profile N` prints, per variant and batch, the N functions with the
most host time in one generate call (cProfile); the table's "of it GC"
column is the time garbage collection took inside the timed calls.
Each variant runs on its own copy of the model (compiled in place with
`Module.compile`, so generate's calls of the module run compiled; Dynamo
reset in between). `generate` runs greedy with a static cache (one per
batch size, reset before each call, so its tensors keep their addresses and
the graphs replay) and HF's own compile off. ms/token = (time of generate with N new tokens - time
with 1) / (N - 1), CUDA events, median of 5 after 2 warm-up calls. The
tokens of each variant are compared with eager's (bf16: identical greedy
tokens are expected for the first steps, not guaranteed for all).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import (  # noqa: E402
    RESULTS_DIR, add_dry_run, add_out, comma_list, command_line, run_line, table, write_md_and_json)
from timing import kernel_profile  # noqa: E402

import compile_backend as cb  # noqa: E402,F401  (registers the backend)
from compile_backend.core.counters import counters  # noqa: E402


def build(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int,
          device: str, dtype: torch.dtype):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


class GcPauses:
    """Milliseconds the interpreter spent in garbage collection while active
    (gc.callbacks): a host-bound step's time can hide there."""

    def __init__(self):
        self.ms = 0.0
        self._t0 = 0.0
        self.active = False

    def __call__(self, phase, info):
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def timed_ms(fn, device: str, warmup: int = 2, reps: int = 5) -> tuple[float, object, float]:
    """(median ms of `reps` calls after `warmup`, the last output, median ms
    of garbage collection inside a call)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times, gc_times = [], []
    with GcPauses() as pauses:
        for _ in range(reps):
            pauses.ms, pauses.active = 0.0, True
            if device == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                out = fn()
                times.append((time.perf_counter() - t0) * 1e3)
            pauses.active = False
            gc_times.append(pauses.ms)
    return statistics.median(times), out, statistics.median(gc_times)


def host_profile(fn, top: int) -> list[str]:
    """The functions that took most host time (cProfile, own time) in one
    call of `fn`: where a host-bound step goes."""
    import cProfile
    import io
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue().splitlines()


def run_variant(model, label, options, ids_by_batch, new_tokens, mode, device, profile_tokens=0,
                host_top=0, cache_kind="static"):
    torch._dynamo.reset()
    counters.clear()
    target = copy.deepcopy(model)
    if options == "reduce-overhead":  # Inductor's own CUDA graphs (cudagraph trees)
        target.compile(mode="reduce-overhead")
    elif options is not None:
        # In place (Module.compile): generate's calls of the module run compiled.
        target.compile(backend="mrv2", options={"cudagraph_mode": mode, **options})

    from transformers import StaticCache

    caches: dict[int, StaticCache] = {}

    def generate(ids, n):
        if cache_kind == "dynamic":  # HF's default: a new DynamicCache per call, grown per token
            return target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   disable_compile=True, pad_token_id=0)
        # One static cache per batch size, reset for every call: its tensors
        # keep their addresses, so the graphs replay (a new cache per call
        # would be captured again, and the time would be the capture's).
        cache = caches.get(ids.shape[0])
        if cache is None:
            cache = caches[ids.shape[0]] = StaticCache(config=model.config,
                                                       max_cache_len=ids.shape[1] + new_tokens)
        cache.reset()
        return target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               past_key_values=cache, disable_compile=True, pad_token_id=0)

    rows = []
    with torch.no_grad():
        for B, ids in ids_by_batch.items():
            t_one, _, gc_one = timed_ms(lambda: generate(ids, 1), device)
            t_all, out, gc_all = timed_ms(lambda: generate(ids, new_tokens), device)
            rows.append({"variant": label, "batch": B, "ms_per_token": (t_all - t_one) / (new_tokens - 1),
                         "gc_ms_per_token": (gc_all - gc_one) / (new_tokens - 1),
                         "generate_ms": t_all, "prefill_ms": t_one, "tokens": out[:, ids.shape[1]:].cpu()})
            print(f"{label} b{B}: {rows[-1]['ms_per_token']:.3f} ms/token, "
                  f"{rows[-1]['gc_ms_per_token']:.3f} of it in garbage collection", flush=True)
            if host_top:
                rows[-1]["host_profile"] = host_profile(lambda: generate(ids, new_tokens), host_top)
                print("\n".join(rows[-1]["host_profile"]), flush=True)
            if profile_tokens and device == "cuda":
                kernels = kernel_profile(lambda: generate(ids, profile_tokens))
                prefill = kernel_profile(lambda: generate(ids, 1))
                device_ms = sum(k[2] for k in kernels) / 1e3
                # The decode steps' device time alone: the call minus a call
                # that only prefills (and picks the first token).
                decode_ms = (device_ms - sum(k[2] for k in prefill) / 1e3) / (profile_tokens - 1)
                rows[-1]["profile"] = {"kernels": kernels, "launches": sum(k[1] for k in kernels),
                                       "device_ms": device_ms, "device_ms_per_token": decode_ms}
                rows[-1]["device_ms_per_token"] = decode_ms
                print(f"  {rows[-1]['profile']['launches']} launches, {device_ms:.3f} ms device "
                      f"time in one generate call of {profile_tokens} tokens, "
                      f"{decode_ms:.3f} ms per decode token", flush=True)
    # The backend's counters over the variant's calls (captures, replays,
    # eager pieces, fusions): two variants that differ in time but not here
    # differ inside the kernels.
    seen = {k: v for k, v in sorted(counters.items()) if v}
    print(f"  counters: {seen}", flush=True)
    for r in rows:
        r["counters"] = seen
    del target
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--mode", default="full", help="cudagraph_mode of the compiled variants; "
                    "comma-separated: each compiled variant once per mode")
    ap.add_argument("--cache", default="static", choices=["static", "dynamic"],
                    help="static: one StaticCache per batch, reset per call; dynamic: HF's "
                    "default (a new DynamicCache per call, grown by a token per step)")
    ap.add_argument("--variants", default="eager,off,sibling,residual,on",
                    help="comma-separated: eager, off, sibling, residual, on, reduce-overhead "
                    "(Inductor's mode)")
    ap.add_argument("--name", default="hf_generate", help="results file name (.md and .json)")
    ap.add_argument("--profile", action="store_true",
                    help="also the kernels of one generate call per variant and batch (CUDA)")
    ap.add_argument("--profile-tokens", type=int, default=8)
    ap.add_argument("--top", type=int, default=12, help="--profile: kernels listed")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="per variant and batch, the N functions with the most host time "
                         "(cProfile) in one generate call")
    ap.add_argument("--piece-compiler", default="inductor")
    add_out(ap, RESULTS_DIR)
    add_dry_run(ap, help="CPU plumbing check: fp32, eager pieces, graph stand-in (numbers mean nothing)")
    return ap


def variant_list(ap, args) -> list[tuple[str, object, str]]:
    """(label, options, mode) of each --variants name, a compiled one once per
    --mode; options: None (eager), "reduce-overhead" (Inductor's) or mrv2's."""
    base = {"piece_compiler": "eager" if args.dry_run else args.piece_compiler}
    off = {"fuse_sibling_linears": False, "fuse_linear_residual": False, "fuse_norm_linear": False}
    known = {"eager": ("eager", None),
             "off": ("mrv2 passes off", {**base, **off}),
             "sibling": ("mrv2 sibling only", {**base, **off, "fuse_sibling_linears": True}),
             "residual": ("mrv2 residual only", {**base, **off, "fuse_linear_residual": True}),
             "on": ("mrv2 passes on", base),
             "reduce-overhead": ("inductor reduce-overhead", "reduce-overhead")}
    names = comma_list(args.variants)
    unknown = [n for n in names if n not in known]
    if unknown or "eager" not in names:
        ap.error(f"--variants: names among {', '.join(known)}, with eager (the table's "
                 f"reference); got {args.variants!r}")
    modes = comma_list(args.mode)
    variants = []
    for n in names:
        label, options = known[n]
        if options is None or options == "reduce-overhead":
            variants.append((label, options, modes[0]))
        else:
            variants += [(label if len(modes) == 1 else f"{label} [{m}]", options, m) for m in modes]
    return variants


def graph_scope(dry_run: bool):
    """A dry run's graph stand-in (CUDA graphs otherwise)."""
    if not dry_run:
        return contextlib.nullcontext()
    from compile_backend.runtime.graph_pool import use_graph_backend
    from compile_backend.runtime.graph_standin import StandInGraphs

    return use_graph_backend(StandInGraphs())


def run_all(model, variants, ids_by_batch, args, argv, device: str) -> str:
    """Every variant's rows, the tables written after each (a crash keeps
    them); returns the tables."""
    rows: list[dict] = []
    with graph_scope(args.dry_run):
        for label, options, mode in variants:
            try:
                rows += run_variant(model, label, options, ids_by_batch, args.new_tokens, mode,
                                    device, profile_tokens=args.profile_tokens if args.profile else 0,
                                    host_top=args.host_profile, cache_kind=args.cache)
            except Exception as e:  # noqa: BLE001 - a peer that fails is a row, not the end
                if label == "eager":
                    raise
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                print(f"{label}: FAILED ({reason})", flush=True)
                rows += [{"variant": label, "batch": b, "error": reason} for b in ids_by_batch]
            text = write_tables(args, argv, device, rows)
    return text


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        ap.error("needs a CUDA GPU; --dry-run checks the plumbing on a CPU")
    variants = variant_list(ap, args)
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model = build(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab,
                  device, dtype)
    g = torch.Generator().manual_seed(5)
    ids_by_batch = {b: torch.randint(0, args.vocab, (b, args.prompt), generator=g).to(device)
                    for b in comma_list(args.batches, int)}
    print(run_all(model, variants, ids_by_batch, args, argv, device))
    return 0


def write_tables(args, argv, device: str, rows: list[dict]) -> str:
    """<name>.md and <name>.json (the rows less their tokens); returns the tables."""
    eager = {r["batch"]: r for r in rows if r["variant"] == "eager"}
    off = {r["batch"]: r for r in rows if r["variant"].startswith("mrv2 passes off")
           and "error" not in r}

    def cells(r):
        if "error" in r:
            return [r["variant"], r["batch"], f"failed: {r['error']}"] + [None] * 5
        e, o = eager[r["batch"]], off.get(r["batch"])
        same = (r["tokens"] == e["tokens"]).float().mean().item()
        r["tokens_equal_eager"] = same
        return [r["variant"], r["batch"], f"{r['ms_per_token']:.3f}", f"{r['gc_ms_per_token']:.3f}",
                f"{r['device_ms_per_token']:.3f}" if "device_ms_per_token" in r else "-",
                f"{r['ms_per_token'] / o['ms_per_token']:.3f}x" if o else "-",
                f"{r['ms_per_token'] / e['ms_per_token']:.3f}x", f"{100 * same:.1f}%"]
    lines = table(["variant", "batch", "ms / token", "of it GC", "device ms / token", "vs passes off",
                   "vs eager", "greedy tokens equal to eager"], "l" + "r" * 7, [cells(r) for r in rows])
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            lines += ["", f"{r['variant']}, batch {r['batch']}: one generate call of "
                      f"{args.profile_tokens} new tokens launched {p['launches']} kernels, "
                      f"{p['device_ms']:.3f} ms of device time "
                      f"({p['device_ms'] / args.profile_tokens:.3f} ms per new token, the prefill "
                      f"included; wall {r['ms_per_token']:.3f} ms per decode token)", ""]
            lines += table(["kernel", "calls", "total us"], "lrr",
                           [[k[:70], c, f"{t:.1f}"] for k, c, t in p["kernels"][:args.top]])
    text = "\n".join(lines)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU dry run (numbers mean nothing)"
    head = (f"# HF Llama generate: the linear passes on and off\n\n"
            f"{run_line(where, command_line('hf_generate', argv))}\n\nModel: {args.layers} layers, hidden "
            f"{args.hidden}, {args.heads} heads / {args.kv_heads} KV heads, intermediate "
            f"{args.intermediate}, vocab {args.vocab}, bf16; prompt {args.prompt} tokens, "
            f"{args.new_tokens} new tokens, greedy, {args.cache} cache; compiled variants: "
            f"cudagraph_mode={args.mode}, {args.piece_compiler} pieces.\n\n")
    write_md_and_json(os.path.join(args.out, f"{args.name}.md"), head + text + "\n",
                      [{k: v for k, v in r.items() if k != "tokens"} for r in rows], default=str)
    return text


if __name__ == "__main__":
    raise SystemExit(main())
