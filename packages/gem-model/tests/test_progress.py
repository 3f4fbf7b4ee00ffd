"""Live progress: a rich display on a terminal, the plain lines elsewhere (CI), unchanged."""

from __future__ import annotations

import io

from rich.console import Console

from gem_model.train.progress import Progress, task_progress

METRICS = {"loss": 1.23456, "samples_per_s": 1000.4, "tokens_per_s": 20000.0, "mfu": 0.125}


def test_without_a_terminal_training_prints_the_plain_line_of_each_logged_step(capsys):
    progress = Progress(total=3, initial=0, enabled=True, name="run")
    progress.update(0, None)
    progress.update(1, METRICS)
    progress.close()
    captured = capsys.readouterr()
    assert captured.err == "[run] step 2/3  loss 1.2346  samples/s 1,000  tokens/s 20,000  MFU 12.50%\n"
    assert captured.out == ""


def test_on_a_terminal_a_live_display_shows_rate_eta_and_the_current_loss():
    screen = io.StringIO()
    progress = Progress(total=4, initial=1, enabled=True, name="run", console=Console(file=screen, force_terminal=True, width=200))
    progress.update(1, None)
    progress.update(2, METRICS)
    progress.close()
    text = screen.getvalue()
    assert "run" in text and "3/4" in text and "step/s" in text and "ETA" in text
    assert "loss 1.2346" in text and "tokens/s 20,000" in text


def test_disabled_progress_shows_nothing(capsys):
    progress = Progress(total=2, initial=0, enabled=False, name="run", console=None)
    progress.update(0, METRICS)
    progress.close()
    assert capsys.readouterr().err == ""


def test_other_long_work_shows_a_display_on_a_terminal_and_nothing_elsewhere(capsys):
    screen = io.StringIO()
    with task_progress(10, "convert", unit="row", console=Console(file=screen, force_terminal=True, width=200)) as advance:
        advance(4)
        advance(6)
    assert "convert" in screen.getvalue() and "10/10" in screen.getvalue() and "row/s" in screen.getvalue()
    with task_progress(10, "convert") as advance:
        advance(10)
    assert capsys.readouterr().err == ""
