"""bench/gpu_steps.py: steps run in order under their cuts and one budget,
each logged; a bad steps file is refused with the line that is wrong."""

import pytest

from bench_scripts import load_bench_script


def test_steps_run_in_order_each_cut_and_logged(tmp_path, monkeypatch):
    gs = load_bench_script("gpu_steps", monkeypatch)
    steps = tmp_path / "s.steps"
    steps.write_text("# a comment\n\n"
                     "first 5 echo one > $OUT/first.txt; echo done\n"
                     "slow 1 sleep 5\n"
                     "failing 5 echo no; exit 3\n")
    out = tmp_path / "out"
    rc = gs.main([str(steps), "--out", str(out), "--budget", "60"])
    assert rc == 1  # a step was cut, one failed
    assert (out / "first.txt").read_text() == "one\n"  # $OUT is the log folder
    assert "done" in (out / "first.log").read_text()
    table = (out / "steps.md").read_text()
    assert "| first | 0 |" in table and "| slow | 124 |" in table and "| failing | 3 |" in table


def test_pack_moves_each_steps_files_into_one_archive(tmp_path, monkeypatch):
    import tarfile

    gs = load_bench_script("gpu_steps", monkeypatch)
    steps = tmp_path / "s.steps"
    steps.write_text("a 5 mkdir -p $OUT/deep/er; echo x > $OUT/deep/er/f.txt\n"
                     "b 5 echo y > $OUT/g.txt\n")
    out = tmp_path / "out"
    assert gs.main([str(steps), "--out", str(out), "--budget", "60", "--pack", "all"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["all.tar", "steps_all.md"]
    with tarfile.open(out / "all.tar") as tar:
        assert sorted(tar.getnames()) == ["a.log", "b.log", "deep/er/f.txt", "g.txt"]
        assert tar.extractfile("deep/er/f.txt").read() == b"x\n"
    # a second run in the same folder (one device call, two budgets) packs only its own steps'
    # files and keeps the first run's pack and table as they were
    first = (out / "all.tar").read_bytes()
    assert gs.main([str(steps), "--out", str(out), "--budget", "60", "--pack", "two",
                    "--only", "b"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["all.tar", "steps_all.md", "steps_two.md",
                                                      "two.tar"]
    assert (out / "all.tar").read_bytes() == first
    with tarfile.open(out / "two.tar") as tar:
        assert sorted(tar.getnames()) == ["b.log", "g.txt"]


def test_a_spent_budget_skips_the_rest(tmp_path, monkeypatch):
    gs = load_bench_script("gpu_steps", monkeypatch)
    rows = gs.run_steps([("a", 5, "true"), ("b", 5, "true")], tmp_path, budget=5)
    assert [r["rc"] for r in rows] == [None, None]
    assert all("budget spent" in r["last"] for r in rows)


@pytest.mark.parametrize("text, said", [
    ("onlyname\n", "line 1: want"),
    ("a x echo\n", "not a number"),
    ("a/b 5 echo\n", "must be letters"),
    ("a 5 echo\na 5 echo\n", "share a name"),
])
def test_a_bad_steps_file_says_which_line(text, said, monkeypatch):
    gs = load_bench_script("gpu_steps", monkeypatch)
    with pytest.raises(ValueError, match=said):
        gs.parse_steps(text)


def test_the_committed_steps_file_parses(monkeypatch):
    import os

    from bench_scripts import BENCH

    gs = load_bench_script("gpu_steps", monkeypatch)
    with open(os.path.join(BENCH, "gpu_next.steps")) as f:
        steps = gs.parse_steps(f.read())
    assert steps and all(cut > 0 for _, cut, _ in steps)
