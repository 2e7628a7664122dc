"""Progress lines on long waits only (core/progress.py)."""

import time

from compile_backend.core.progress import progress


def test_a_short_wait_prints_nothing(capsys, monkeypatch):
    monkeypatch.delenv("MRV2_PROGRESS", raising=False)
    with progress("quick", total=2, delay=5) as bar:
        bar.update()
        bar.update()
    assert capsys.readouterr().err == ""


def test_a_wait_past_the_delay_shows_even_without_steps(capsys, monkeypatch):
    monkeypatch.delenv("MRV2_PROGRESS", raising=False)
    with progress("tracing the model", delay=0.05):
        time.sleep(0.4)
    assert "mrv2: tracing the model" in capsys.readouterr().err


def test_the_switch_turns_it_on_for_short_waits_and_off_for_long_ones(capsys, monkeypatch):
    monkeypatch.setenv("MRV2_PROGRESS", "1")
    with progress("pieces", total=2, unit="piece") as bar:
        bar.update(note="piece_0 compiled")
        bar.update(note="piece_1 shared")
    err = capsys.readouterr().err
    assert "mrv2: pieces" in err and "2/2" in err
    monkeypatch.setenv("MRV2_PROGRESS", "0")
    with progress("off", delay=0.0):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""
