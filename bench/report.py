"""What the bench scripts' reports share, so that each script's `main` reads
as parse, run, report:
  table(header, align, rows)      markdown lines: header row, alignment row, rows
  md_row(cells)                   one markdown row (a None cell reads `| |`)
  dash(value, spec)               a cell's number, "-" for None
  utc_now()                       the run's date: UTC, ISO 8601 to the second
  command_line(script, argv)      `python bench/<script>.py ARGS`, as run
  run_meta(script, argv, gpu)     date, gpu, torch, triton, python, command
  heading(title, meta)            `# title (gpu, torch X, triton Y, date)`
  run_line(gpu, command)          `date, gpu, torch X, command: `...``
  write_md_and_json(md_path, text, data)  <name>.md and <name>.json side by side
  add_out, add_dry_run            the --out and --dry-run flags
  comma_list(text, kind)          "1,8,32" -> [1, 8, 32] (empty items dropped)
  names(ap, flag, text, known)    a comma-separated flag's names, each known
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Any, Callable, Iterable, Sequence

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DRY_RUN_HELP = "CPU plumbing check (numbers mean nothing)"


def md_row(cells: Iterable[object]) -> str:
    """`| a | b |`; a None cell is a gap, `| |` (a failed row's filler), where
    an empty string reads `|  |`."""
    return "|" + "|".join(" " if c is None else f" {c} " for c in cells) + "|"


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """`align`: one letter a column, "l" (left, `---`) or "r" (right, `---:`)."""
    assert len(align) == len(header), (align, header)
    return [md_row(header), "|" + "".join("---:|" if a == "r" else "---|" for a in align),
            *(md_row(r) for r in rows)]


def dash(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`; "-" for None (not measured)."""
    return "-" if value is None else format(value, spec)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line(script: str, argv: Sequence[str] | None, env_prefix: str = "") -> str:
    """`python bench/<script>.py` and its arguments (sys.argv's when argv is
    None), after the environment variables whose names start with env_prefix
    (none when it is empty)."""
    given = sys.argv[1:] if argv is None else list(argv)
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if env_prefix and k.startswith(env_prefix)]
    return " ".join(env + ["python", f"bench/{script}.py"] + given)


def run_meta(script: str, argv: Sequence[str] | None, gpu: str, triton: bool = True,
             python: bool = True, env_prefix: str = "") -> dict[str, Any]:
    """The fields a results file's meta starts with (triton and python where
    that file has them); the script adds its own after them."""
    meta: dict[str, Any] = {"date": utc_now(), "gpu": gpu, "torch": torch.__version__}
    if triton:
        meta["triton"] = __import__("triton").__version__
    if python:
        meta["python"] = platform.python_version()
    meta["command"] = command_line(script, argv, env_prefix)
    return meta


def heading(title: str, meta: dict[str, Any]) -> str:
    """A results file's first line; triton where the meta has it."""
    triton = f", triton {meta['triton']}" if "triton" in meta else ""
    return f"# {title} ({meta['gpu']}, torch {meta['torch']}{triton}, {meta['date']})"


def run_line(gpu: str, command: str) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{stamp}, {gpu}, torch {torch.__version__}, command: `{command}`"


def print_and_write(lines: Sequence[str], out: str | None) -> None:
    """Print `lines`, and write them to `out` (markdown) when one is given."""
    print("\n".join(lines))
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def write_md_and_json(md_path: str, text: str, data: Any,
                      default: Callable[[Any], Any] | None = None) -> str:
    """`text` to md_path and `data` as JSON beside it (same name, .json);
    returns md_path."""
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    with open(os.path.splitext(md_path)[0] + ".json", "w") as f:
        json.dump(data, f, indent=1, default=default)
    with open(md_path, "w") as f:
        f.write(text)
    return md_path


def add_out(ap: argparse.ArgumentParser, default: str | None = "bench/results",
            flag: str = "--out", help: str | None = None) -> None:
    ap.add_argument(flag, default=default, help=help)


def add_dry_run(ap: argparse.ArgumentParser, help: str = DRY_RUN_HELP,
                flag: str = "--dry-run") -> None:
    ap.add_argument(flag, action="store_true", help=help)


def comma_list(text: str, kind: Callable[[str], Any] = str) -> list:
    return [kind(t) for t in text.split(",") if t]


def names(ap: argparse.ArgumentParser, flag: str, text: str, known: Iterable[str]) -> list[str]:
    """The names of a comma-separated flag; argparse's error (exit 2) for one
    not in `known`."""
    known = list(known)
    given = comma_list(text)
    unknown = [n for n in given if n not in known]
    if unknown:
        ap.error(f"{flag}: unknown {unknown}; choose from {known}")
    return given
