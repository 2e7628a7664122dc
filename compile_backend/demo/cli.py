"""`mrv2` (or `python -m compile_backend`): the demo, the dump inspector and
the warm-start cache.

    mrv2 demo [--model hybrid] [--preset tiny] [--mode all] [--dump DIR] ...
    mrv2 demo --standin                  (no GPU: capture with the CPU stand-in)
    torchrun --nproc-per-node 2 -m compile_backend demo --tp 2   (tensor parallel; rank 0 prints)
    mrv2 inspect DIR [--piece N] [--svg [OUT.svg]]
    mrv2 cache ls|clear [--dir DIR]      (the runner's warm-start cache)

Exit codes: 0 success; 1 a mode's tokens differ from eager; 2 bad input,
or a graph mode named on a machine without CUDA and without --standin (one
line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from compile_backend.core.config import PIECE_COMPILERS
from compile_backend.core.graph_mode import CUDAGraphMode
from compile_backend.demo.names import DTYPE_NAMES, MODEL_NAMES, PRESET_NAMES


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    modes = [m.value for m in CUDAGraphMode]
    p = _Parser(prog="mrv2", description="mrv2: CUDA-graph backend demo and debug-dump inspector")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="generate in every graph mode and compare with eager")
    d.add_argument("--model", choices=MODEL_NAMES, default="hybrid")
    d.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    d.add_argument("--mode", action="append", choices=modes + ["all"], dest="modes",
                   help="graph mode (repeatable); default all that this machine supports "
                        "(on a CPU: none, or every mode with --standin)")
    d.add_argument("--batch", type=int, default=4, help="number of prompts")
    d.add_argument("--steps", type=int, default=8, help="new tokens per prompt")
    d.add_argument("--prompt-len", type=int, default=16)
    d.add_argument("--dump", metavar="DIR", help="write a debug dump (see docs/manifest.md)")
    d.add_argument("--dtype", choices=DTYPE_NAMES, help="default: fp32 on CPU, bf16 on CUDA")
    d.add_argument("--piece-compiler", choices=PIECE_COMPILERS, default="inductor")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--standin", action="store_true",
                   help="capture and replay with a CPU stand-in for CUDA graphs: shows capture "
                        "on a machine without CUDA (not a CUDA graph, not a speed-up)")
    d.add_argument("--no-progress", action="store_true",
                   help="hide the progress bars (MRV2_PROGRESS=0 does too)")
    d.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks; start N processes: "
                        "torchrun --nproc-per-node N -m compile_backend demo --tp N")

    i = sub.add_parser("inspect", help="summarize a debug dump and draw its pieces")
    i.add_argument("dir", metavar="DIR")
    i.add_argument("--piece", type=int, metavar="N", help="print piece N's code")
    i.add_argument("--graph", type=int, default=0, metavar="K",
                   help="which Dynamo graph --piece refers to (default 0)")
    i.add_argument("--svg", metavar="OUT.svg", nargs="?", const="",
                   help="also draw the step as SVG, to OUT.svg (default DIR/step.svg)")

    c = sub.add_parser("cache", help="list or clear the warm-start cache of compiled steps")
    c.add_argument("action", choices=["ls", "clear"])
    c.add_argument("--dir", metavar="DIR",
                   help="cache folder (default: $MRV2_CACHE_DIR, else ~/.cache/mrv2)")
    return p


def _cache(args: argparse.Namespace) -> int:
    from compile_backend.compile.step_cache import clear_entries, list_entries, steps_dir
    from compile_backend.core.config import default_cache_dir

    folder = args.dir or default_cache_dir()
    if folder is None:
        return _fail("the cache is off (MRV2_CACHE_DIR=off); name a folder with --dir DIR")
    if args.action == "clear":
        print(f"removed {clear_entries(folder)} entries from {steps_dir(folder)}")
        return 0
    rows = list_entries(folder)
    print(f"{steps_dir(folder)}: {len(rows)} entries, "
          f"{sum(r['bytes'] for r in rows) / 2**20:.1f} MiB")
    for r in rows:
        if "error" in r:
            print(f"  {r['key']}  {r['bytes'] / 2**20:7.1f} MiB  unreadable: {r['error']}")
            continue
        import time

        saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["saved"])) if r["saved"] else "?"
        print(f"  {r['key']}  {r['bytes'] / 2**20:7.1f} MiB  {saved}  {r['model']}  "
              f"mode {r['mode']}  {r['device']}  torch {r['torch']}  "
              f"loads {'without Dynamo' if r.get('direct') else 'through Dynamo'}")
    return 0


def _fail(message: str) -> int:
    sys.stderr.write(f"mrv2: error: {message}\n")
    return 2


def _demo(args: argparse.Namespace) -> int:
    from compile_backend.debug.dump import DumpPathError, check_dump_path
    from compile_backend.demo.run import (DemoOptions, plan_modes, run_demo,
                                          start_tensor_parallel)

    try:
        opts = DemoOptions(model=args.model, preset=args.preset, modes=args.modes or ["all"],
                           batch=args.batch, steps=args.steps, prompt_len=args.prompt_len,
                           dump=args.dump, dtype=args.dtype, piece_compiler=args.piece_compiler,
                           seed=args.seed, progress=not args.no_progress, tp=args.tp,
                           standin=args.standin)
        plan_modes(opts)  # a graph mode this machine cannot run fails here, before anything runs
        if opts.dump:
            opts.dump = str(check_dump_path(opts.dump))
        tp = start_tensor_parallel(opts)
    except (ValueError, DumpPathError) as e:
        return _fail(str(e))
    if tp.rank != 0:  # every rank runs the same steps; rank 0 speaks for them
        opts.progress = False
    try:
        results = run_demo(opts, say=print if tp.rank == 0 else (lambda _: None))
    finally:
        if tp.size > 1:  # graphs first, then the process group (runner/parallel.py)
            from compile_backend.runner.parallel import end_tensor_parallel

            end_tensor_parallel()
    code = _report(results, opts, tp.rank)
    if tp.size > 1:  # the group destroyed, every line printed (Note [gloo teardown])
        from compile_backend.runner.parallel import exit_process

        exit_process(code)
    return code


def _report(results: list, opts, rank: int) -> int:
    """Rank 0's table and the exit status: 0 when every mode's tokens equal eager's."""
    from compile_backend.demo.run import format_table

    if rank != 0:
        return 0 if all(r.equal for r in results) else 1
    print(format_table(results))
    if opts.dump:
        print(f"debug dump: {opts.dump} (inspect with `mrv2 inspect DIR`)")
    bad = [r.mode for r in results if not r.equal]
    if bad:
        sys.stderr.write(f"mrv2: tokens differ from eager in mode(s): {', '.join(bad)}\n")
        return 1
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from compile_backend.debug.dump import DEFAULT_SVG
    from compile_backend.debug.inspector import DumpError, load_dump, piece_code, summary, write_svg

    try:
        manifest = load_dump(args.dir)
        if args.piece is not None:
            print(piece_code(args.dir, manifest, args.piece, args.graph), end="")
            return 0
        print(summary(manifest))
        if args.svg is None:  # drawn only when asked for
            return 0
        svg = write_svg(manifest, args.svg or os.path.join(args.dir, DEFAULT_SVG))
    except (DumpError, OSError) as e:
        return _fail(str(e))
    print(f"picture: {svg}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if not argv:  # bare `mrv2`: what it can do
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already reported)
        return int(e.code or 0)
    return {"demo": _demo, "inspect": _inspect, "cache": _cache}[args.verb](args)
