"""What importing mrv2 and building a runner cost: no Dynamo, no Inductor, no
sympy until a compile needs them (issue #36: a warm start should not pay for
what only a compile uses). Each case is a fresh interpreter, so that what
the test process already imported does not hide an import."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Modules a compile needs and a warm start's first steps should not pull in
# through mrv2 (`import torch` loads none of them).
HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "torch.fx.experimental.symbolic_shapes")

_PROLOGUE = """
import json, sys
import torch
HEAVY = %r
def loaded():
    return sorted(m for m in HEAVY if m in sys.modules)
before = loaded()
""" % (HEAVY,)


def _run(body: str) -> dict:
    code = _PROLOGUE + body + "\nprint('IMPORTS ' + json.dumps(out))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("IMPORTS ")][-1]
    return json.loads(line[len("IMPORTS "):])


def test_torch_alone_loads_none_of_the_heavy_modules():
    """The premise: what the other cases find is mrv2's doing, not torch's."""
    assert _run("out = {'torch': before}") == {"torch": []}


def test_importing_the_package_kernels_and_the_runner_loads_no_compiler():
    out = _run("""
out = {}
import compile_backend
out['compile_backend'] = loaded()
import compile_backend.kernels
out['kernels'] = loaded()
from compile_backend import ModelRunner, KVCacheConfig, CompilationConfig, InputBatch
out['runner classes'] = loaded()
import compile_backend.compile.step_cache, compile_backend.compile.guard_free
out['step cache'] = loaded()
""")
    assert out == {"compile_backend": [], "kernels": [], "runner classes": [], "step cache": []}


def test_what_loads_a_saved_step_without_dynamo_imports_no_compiler():
    """The modules a warm start's direct load runs (compile/direct_step.py,
    the step, its graphs' codec, how the split graph calls its pieces)
    import none of the heavy ones; tests/compile/test_warm_start.py checks
    a whole warm process."""
    out = _run("""
out = {}
import compile_backend.compile.direct_step, compile_backend.compile.graph_codec
import compile_backend.compile.step_artifacts, compile_backend.compile.compiled_step
import compile_backend.compile.piece_calls
out['direct load'] = loaded()
""")
    assert out == {"direct load": []}


@pytest.mark.slow  # full tier: a subprocess that compiles
def test_building_a_runner_loads_no_compiler_and_its_first_step_does():
    """Building a model and its runner imports nothing of the compiler; the
    first step (a compile) does: the check would notice an import."""
    out = _run("""
out = {}
from compile_backend import ModelRunner, KVCacheConfig, CompilationConfig
from compile_backend.demo.models import build_model, preset
model = build_model('llama', preset('tiny', dtype=torch.float32))
kv = KVCacheConfig(num_blocks=16, block_size=16, max_model_len=64, max_num_reqs=4,
                   max_num_tokens=8)
model.bind_caches(kv.num_blocks, kv.block_size, kv.max_num_reqs, 'cpu')
runner = ModelRunner(model, kv, CompilationConfig(cudagraph_mode='none', piece_compiler='eager',
                     capture_sizes=[1, 2, 4]), 'cpu', progress=False)
out['built'] = loaded()
runner.warmup(4)
out['after the first step'] = loaded()
""")
    assert out["built"] == []
    assert "torch._dynamo" in out["after the first step"]
