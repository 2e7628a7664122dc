"""What a warm start imports before its first step, module by module.

    python bench/import_cost.py [--runs 3] [--out FILE.md]

A warm start whose entry has a plan loads the step alone and imports none
of the rows after the runner (compile/direct_step.py: docs/design.md, "A
warm start without Dynamo"). One through Dynamo's saved code, or with
Inductor pieces, imports most of Dynamo, and the Inductor modules that a
compiled piece's code names (its header imports
`torch._inductor.select_algorithm`).
Each run is a fresh process that imports, in order, the modules below and
times each import on top of the ones before it. Bytecode comes from
PYTHONPYCACHEPREFIX (a first, untimed process writes it where the install
has none: bench/startup.py's priming), as bench/startup.py's children do. The sum of the rows after
`compile_backend` is the part of a warm start's load that is importing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import report  # noqa: E402

# In the order a runner's warm start reaches them: mrv2 and its runner, the
# Dynamo import its first step makes (mark_token_dim), torch.compile's wrap,
# Dynamo's AOT load, Inductor's artifact loader, what a piece's code imports.
MODULES = ("torch", "compile_backend", "compile_backend.runner.model_runner", "torch._dynamo",
           "torch._dynamo.aot_compile", "torch._inductor.standalone_compile",
           "torch._inductor.codecache", "torch._inductor.async_compile",
           "torch._inductor.select_algorithm", "torch._inductor.runtime.triton_heuristics")

CHILD = r"""
import importlib, json, sys, time
out = []
for name in sys.argv[1:]:
    t = time.perf_counter()
    importlib.import_module(name)
    out.append([name, time.perf_counter() - t])
print("ROWS" + json.dumps(out))
"""


def one_run(env: dict[str, str]) -> list[tuple[str, float]]:
    run = subprocess.run([sys.executable, "-c", CHILD, *MODULES], env=env, capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(_HERE))
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("ROWS"))
    return [tuple(r) for r in json.loads(line[4:])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    import startup  # noqa: E402 - its bytecode priming (imports torch)

    env = dict(os.environ)
    if startup.bytecode_missing():  # as startup.py: every child reads primed bytecode
        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="mrv2-pyc-")
        startup.prime_bytecode(env)
    one_run(env)  # untimed: the files in the page cache
    runs = [dict(one_run(env)) for _ in range(a.runs)]
    rows, after_mrv2 = [], []
    for i, name in enumerate(MODULES):
        secs = [r[name] for r in runs]
        rows.append([name, f"{statistics.median(secs):.3f}", " / ".join(f"{s:.3f}" for s in secs)])
        if i >= 2:
            after_mrv2.append(statistics.median(secs))
    lines = [f"python {sys.version.split()[0]}; {a.runs} fresh processes; seconds for each import "
             "on top of the ones above it", "",
             *report.table(["module", "median s", "runs"], "lrl", rows), "",
             f"After mrv2's runner (what a warm load imports): {sum(after_mrv2):.2f} s (sum of medians)"]
    report.print_and_write(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
