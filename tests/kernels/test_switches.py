"""The environment switches a launch reads at every call (TRITON_INTERPRET,
MRV2_PDL, MRV2_SKINNY_GEMM, MRV2_WIDE_GEMM) are read through `_device.env`,
which skips os.environ's own lookup: it must see every change os.environ
sees, between any two calls, and the kernel-or-cuBLAS rule's kept part must
not hide a switch flipped after it was kept."""

import os

import pytest
import torch

from compile_backend.kernels._device import env
from compile_backend.kernels._launch import LayoutMemo
from compile_backend.kernels.skinny_linear import skinny_fills

NAME = "MRV2_TEST_SWITCH"


def test_env_sees_every_write_os_environ_sees(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env(NAME) == "" and env(NAME, "0") == "0" and env(NAME, None) is None
    monkeypatch.setenv(NAME, "1")
    assert env(NAME) == "1" == os.environ.get(NAME)
    os.environ[NAME] = "wörd"  # non-ASCII values round-trip as os.environ gives them
    assert env(NAME) == os.environ[NAME] == "wörd"
    os.environ[NAME] = os.fsdecode(b"\xff\xfe")  # not UTF-8: decoded as os.environ does
    assert env(NAME) == os.environ[NAME]
    del os.environ[NAME]
    assert env(NAME, "gone") == "gone"
    os.environ.update({NAME: "0"})
    assert env(NAME) == "0"
    os.environ.pop(NAME)
    assert env(NAME) == ""


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_the_kept_rule_still_follows_the_skinny_switch(rows, monkeypatch):
    monkeypatch.delenv("MRV2_SKINNY_GEMM", raising=False)
    sms = 132
    by_rule = skinny_fills(rows, 4096, 4096, sms)
    assert skinny_fills(rows, 4096, 4096, sms) == by_rule  # kept: the same answer
    monkeypatch.setenv("MRV2_SKINNY_GEMM", "0")
    assert skinny_fills(rows, 4096, 4096, sms) is False
    monkeypatch.setenv("MRV2_SKINNY_GEMM", "1")
    assert skinny_fills(rows, 4096, 4096, sms) is True
    monkeypatch.delenv("MRV2_SKINNY_GEMM")
    assert skinny_fills(rows, 4096, 4096, sms) == by_rule


def test_wide_rows_follow_their_switch(monkeypatch):
    monkeypatch.delenv("MRV2_SKINNY_GEMM", raising=False)
    monkeypatch.delenv("MRV2_WIDE_GEMM", raising=False)
    assert skinny_fills(128, 4096, 4096, 132) is False
    monkeypatch.setenv("MRV2_WIDE_GEMM", "1")
    assert skinny_fills(128, 4096, 4096, 132) is True
    monkeypatch.setenv("MRV2_SKINNY_GEMM", "0")
    assert skinny_fills(128, 4096, 4096, 132) is False


def test_a_remembered_layout_is_keyed_by_the_switches_of_its_launch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("MRV2_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plain = LayoutMemo.key(cpu, ("layout",))
    monkeypatch.setenv("MRV2_PDL", "0")
    no_pdl = LayoutMemo.key(cpu, ("layout",))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = LayoutMemo.key(cpu, ("layout",))
    assert len({plain, no_pdl, interpreted}) == 3
    monkeypatch.delenv("MRV2_PDL")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert LayoutMemo.key(cpu, ("layout",)) == plain


def test_request_tile_kernels_compile_one_variant_for_every_batch_size():
    """Note [batch ints unspecialised] (kernels/_device.py): the request and
    token counts of the request-tile kernels are not specialised by Triton,
    so a plan's sizes (1, multiples of 16, the rest) share one compiled
    variant. Checked on the JITFunctions Triton builds where it compiles
    (TRITON_INTERPRET=0, a fresh interpreter; no GPU needed)."""
    import json
    import subprocess
    import sys

    code = (
        "import importlib, json\n"
        "m = lambda name: importlib.import_module('compile_backend.kernels.' + name)\n"
        "ua = m('unified_attention')\n"
        "kernels = [ua._prefill_kernel, ua._decode_kernel, ua._decode_reduce_kernel,\n"
        "           m('sconv')._sconv_kernel, m('kv_compress')._kv_compress_kernel]\n"
        "print(json.dumps({k.fn.__name__: [p.name for p in k.params if p.do_not_specialize]\n"
        "                  for k in kernels}))\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    unspecialised = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(unspecialised) == 5
    assert all(names == ["num_reqs", "num_tokens"] for names in unspecialised.values()), unspecialised
