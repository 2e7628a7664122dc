"""Run a list of GPU steps in order, each under its own time cut, within one budget.

    python3 bench/gpu_steps.py bench/gpu_next.steps --out $OUT --budget 560

A machine's first minutes are scarce: a step that hangs must not eat the
ones after it. Each line of the steps file is `<name> <cut seconds>
<command>` (blank lines and `#` comments skipped); every step runs under
`timeout` at min(cut, what is left of the budget), its output goes to
<out>/<name>.log (commands see that folder as $OUT), and a table of name, exit status, seconds and last line
is printed at the end (124: cut). Steps are skipped once less than 10 s is
left. With --pack NAME, each finished step's files move into <out>/NAME.tar
(a device call returns 8 files at most; a cut call still returns the steps
done) and the table into <out>/steps_NAME.md; several runs in one call, each
with its own NAME, keep each other's files. Exit status: 0 when every step
ran and returned 0, else 1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path


def parse_steps(text: str) -> list[tuple[str, float, str]]:
    """(name, cut seconds, command) per step line; ValueError names a bad line."""
    steps = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3:
            raise ValueError(f"line {number}: want '<name> <cut seconds> <command>', got {line!r}")
        name, cut, command = parts
        try:
            seconds = float(cut)
        except ValueError:
            raise ValueError(f"line {number}: the cut {cut!r} is not a number of seconds") from None
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"line {number}: name {name!r} must be letters, digits, - or _ "
                             "(it names the log file)")
        steps.append((name, seconds, command))
    if len({n for n, _, _ in steps}) != len(steps):
        raise ValueError("two steps share a name (each names its log file)")
    return steps


def pack(out: Path, name: str, keep: frozenset[Path] = frozenset()) -> int:
    """Move every file under `out` but the pack, steps.md and `keep` (what
    was there before this run: an earlier run's pack and table, when one
    device call runs several) into <out>/<name>.tar (appended, paths
    relative to `out`); the count moved."""
    archive = out / f"{name}.tar"
    files = sorted(p for p in out.rglob("*") if p.is_file()
                   and p not in (archive, out / "steps.md") and p not in keep)
    with tarfile.open(archive, "a") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(out)))
            f.unlink()
    for d in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return len(files)


def run_steps(steps: list[tuple[str, float, str]], out: Path, budget: float,
              pack_name: str | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    before = frozenset(p for p in out.rglob("*") if p.is_file())
    end = time.monotonic() + budget
    rows = []
    for name, cut, command in steps:
        left = end - time.monotonic()
        if left < 10:
            rows.append({"name": name, "rc": None, "s": 0.0, "last": "skipped: budget spent"})
            continue
        limit = int(min(cut, left))
        log = out / f"{name}.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            f.write(f"$ {command}\n(cut {limit} s)\n")
            f.flush()
            rc = subprocess.call(["timeout", str(limit), "bash", "-c", command], stdout=f,
                                 stderr=subprocess.STDOUT, env={**os.environ, "OUT": str(out)})
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        rows.append({"name": name, "rc": rc, "s": time.monotonic() - t0,
                     "last": lines[-1][:160] if lines else ""})
        if pack_name:
            pack(out, pack_name, keep=before)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| step | rc | s | last line |", "|---|---:|---:|---|"]
    for r in rows:
        rc = "-" if r["rc"] is None else str(r["rc"])
        out.append(f"| {r['name']} | {rc} | {r['s']:.0f} | {r['last'].replace('|', '/')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", help="the steps file")
    ap.add_argument("--out", required=True, help="folder for the logs (on a device run: $OUT)")
    ap.add_argument("--budget", type=float, required=True, help="seconds for all steps together")
    ap.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    ap.add_argument("--pack", metavar="NAME", default=None,
                    help="move each finished step's files into <out>/NAME.tar")
    args = ap.parse_args(argv)
    steps = parse_steps(Path(args.steps).read_text())
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {n for n, _, _ in steps}
        if unknown:
            print(f"gpu_steps: no step named {', '.join(sorted(unknown))} in {args.steps}")
            return 2
        steps = [s for s in steps if s[0] in wanted]
    rows = run_steps(steps, Path(args.out), args.budget, args.pack)
    print(table(rows))
    # one table per run: a second run in the same call (another --pack) keeps the first's
    name = f"steps_{args.pack}.md" if args.pack else "steps.md"
    (Path(args.out) / name).write_text(table(rows) + "\n" + "\n".join(
        f"- {n}: {shlex.quote(c)}" for n, _, c in steps) + "\n")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
