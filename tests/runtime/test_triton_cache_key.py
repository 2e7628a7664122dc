"""runtime/triton_cache_key.py: Triton's cache key hashed on a thread. Each
case runs in a process of its own (the key is cached per process, and the
tests' process interprets Triton)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, threading
from triton.runtime.cache import triton_key
from compile_backend.runtime import triton_cache_key as tck

before = triton_key.cache_info().currsize
key = tck.start()
out = {"before": before, "started": key is not None}
if key is not None:
    key.join(120)
    out["stats"] = key.stats()
    out["cached"] = triton_key.cache_info().currsize
    out["misses"] = triton_key.cache_info().misses
    value = triton_key()  # the caller's call: a hit, the thread's value
    out["hit"] = triton_key.cache_info().hits >= 1 and triton_key.cache_info().misses == out["misses"]
    out["value_ok"] = isinstance(value, str) and len(value) > 64
    out["again"] = tck.start() is not None  # cached now: no second thread
    out["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("mrv2-")]
print("RESULT" + json.dumps(out))
"""


def _run(interpret: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET=interpret, PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_the_thread_computes_the_key_once_and_the_caller_gets_it_cached():
    out = _run("0")
    if not out["started"] and out["before"] == 0:
        pytest.skip("this Triton has no cached triton_key")
    assert out["before"] == 0 and out["started"]
    assert out["stats"]["triton_key_s"] > 0, out
    assert out["cached"] == 1 and out["misses"] == 1, out  # computed once, by the thread
    assert out["hit"] and out["value_ok"], out  # the caller's call hits the cache
    assert out["again"] is False and out["threads"] == [], out  # no second thread; the first ended


def test_nothing_starts_where_triton_interprets():
    out = _run("1")
    assert out == {"before": 0, "started": False}
