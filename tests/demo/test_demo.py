"""The demo end to end on the CPU (mode NONE, and every mode with the graph
stand-in; tiny preset), and its bad inputs: one line on stderr, exit code 2,
nothing written."""

import os
import subprocess
import sys

import pytest

from compile_backend.demo.cli import main
from compile_backend.demo.run import NO_CUDA, modes_to_run
from compile_backend.runtime.graph_standin import STANDIN_NOTE

CPU_ONLY = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU messages")

FAST = ["--preset", "tiny", "--batch", "2", "--steps", "3", "--prompt-len", "8",
        "--piece-compiler", "eager", "--no-progress"]


@pytest.fixture(autouse=True)
def _torch_reference_kernels(monkeypatch):
    """Kernels take their torch reference path (the interpreter is slow)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_demo_mode_none_matches_eager(capsys):
    assert main(["demo", "--mode", "none", *FAST]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("mode "))
    assert "equal to eager" in header and "tokens/s" in header
    row = next(line for line in out.splitlines() if line.startswith("none "))
    assert row.split()[-1] == "yes"


@CPU_ONLY
@pytest.mark.parametrize("modes", [[], ["--mode", "all"]], ids=["default", "all"])
def test_demo_on_cpu_runs_none_and_says_how_to_see_capture(modes, capsys):
    assert main(["demo", *modes, "--model", "llama", *FAST]) == 0
    out = capsys.readouterr().out
    assert NO_CUDA in out.splitlines()
    assert "eager" in NO_CUDA and "--standin" in NO_CUDA
    assert STANDIN_NOTE not in out
    rows = [line.split()[0] for line in out.splitlines()
            if line.split() and line.split()[0] in ("none", "piecewise", "full")]
    assert rows == ["none"]


@CPU_ONLY
@pytest.mark.parametrize("modes", [["piecewise"], ["none", "full"], ["all", "full_decode_only"]])
def test_demo_graph_mode_on_cpu_without_standin_is_an_error_naming_the_fix(modes, tmp_path, capsys):
    dump = tmp_path / "dump"
    argv = ["demo", *[a for m in modes for a in ("--mode", m)], *FAST, "--dump", str(dump)]
    line = _one_error_line(capsys, argv)
    refused = [m for m in modes if m not in ("none", "all")]
    assert f"mode {refused[0]} needs CUDA graphs" in line
    assert "run on a GPU" in line and "--standin" in line
    assert capsys.readouterr().out == "" and not dump.exists()  # nothing ran, nothing written


def test_demo_standin_captures_every_mode_and_says_so(capsys):
    """--standin: the graph modes capture and replay on the CPU, their tokens
    equal eager's, and the output says the graphs are the stand-in's."""
    assert main(["demo", "--standin", "--mode", "piecewise", "--mode", "full_and_piecewise",
                 "--model", "llama", *FAST]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert STANDIN_NOTE in lines and not any(line == NO_CUDA for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    rows = {line.split()[0]: line.split() for line in lines[header + 2:] if line.strip()}
    assert set(rows) == {"piecewise", "full_and_piecewise"}
    for mode, row in rows.items():
        assert int(row[2]) > 0, f"{mode} captured no graph: {row}"  # graphs captured
        assert row[-1] == "yes", row  # equal to eager


def test_modes_to_run():
    assert modes_to_run(["all"], graphs=True)[0] == [
        "none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]
    assert modes_to_run(["piecewise", "piecewise"], graphs=True) == (["piecewise"], None)
    assert modes_to_run(["all"], graphs=False) == (["none"], NO_CUDA)
    assert modes_to_run(["none"], graphs=False) == (["none"], None)
    with pytest.raises(ValueError, match="mode piecewise needs CUDA graphs.*--standin"):
        modes_to_run(["piecewise"], graphs=False)


def test_demo_waits_show_progress_by_phase(monkeypatch):
    """The demo's bar steps once per phase (compile + capture, generate, for
    the reference and each mode), naming the phase now running."""
    from compile_backend.demo import run

    notes: list[tuple[int, str | None]] = []

    class Bar:
        def update(self, n=1, note=None):
            notes.append((n, note))

        def close(self):
            notes.append((0, "closed"))

    monkeypatch.setattr(run, "progress_bar", lambda *a, **k: Bar())
    opts = run.DemoOptions(model="llama", preset="tiny", modes=["none"], batch=2, steps=2,
                           prompt_len=8, piece_compiler="eager", progress=True)
    run.run_demo(opts, say=lambda _: None)
    assert notes == [
        (0, "eager reference: building, compiling"),
        (1, "eager reference: generating 2 tokens per prompt"),
        (1, "none: building, compiling"),
        (1, "none: generating 2 tokens per prompt"),
        (1, None), (0, "closed")]


def _one_error_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_dump_path_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("x")
    line = _one_error_line(capsys, ["demo", *FAST, "--dump", str(f)])
    assert "existing file" in line
    assert f.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_dump_path_under_a_file(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("x")
    line = _one_error_line(capsys, ["demo", *FAST, "--dump", str(f / "dump")])
    assert "is a file" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_dump_path_not_writable(capsys):
    line = _one_error_line(capsys, ["demo", *FAST, "--dump", "/proc/mrv2-dump/x"])
    assert "not writable" in line
    assert not os.path.exists("/proc/mrv2-dump")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_dump_path_in_read_only_folder(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        line = _one_error_line(capsys, ["demo", *FAST, "--dump", str(ro / "dump")])
    finally:
        ro.chmod(0o700)
    assert "not writable" in line
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("argv, word", [
    (["demo", "--preset", "huge"], "huge"),
    (["demo", "--standin", "--preset", "huge"], "huge"),
    (["demo", "--mode", "sideways"], "sideways"),
    (["demo", "--model", "gpt"], "gpt"),
    (["demo", "--dtype", "fp8"], "fp8"),
    (["demo", "--batch", "0"], "--batch"),
])
def test_bad_arguments(argv, word, tmp_path, capsys):
    dump = tmp_path / "dump"
    line = _one_error_line(capsys, [*argv, "--dump", str(dump)])
    assert word in line
    assert not dump.exists()


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_python_dash_m_subprocess(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-m", "compile_backend", "demo", "--mode", "none", *FAST],
        capture_output=True, text=True, env=env, timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "equal to eager" in proc.stdout


@pytest.mark.slow  # full tier: a subprocess or a long run
def test_python_dash_m_unknown_preset_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "compile_backend", "demo", "--preset", "huge"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_help_imports_no_torch_and_bare_mrv2_prints_usage():
    """`mrv2 --help` stays under a second by importing nothing heavy."""
    code = ("import sys; from compile_backend.demo.cli import main; rc = main([]); "
            "print('torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("usage: mrv2")
    assert out.stdout.split()[-2:] == ["False", "0"]


def test_demo_choices_by_name_match_what_they_build():
    from compile_backend.demo.models import MODELS, PRESETS
    from compile_backend.demo.names import DTYPE_NAMES, MODEL_NAMES, PRESET_NAMES
    from compile_backend.demo.run import DTYPES

    assert (sorted(MODELS), sorted(PRESETS), sorted(DTYPES)) == (
        list(MODEL_NAMES), list(PRESET_NAMES), list(DTYPE_NAMES))
