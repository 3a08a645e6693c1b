"""Progress of long phases: a live bar on a terminal, plain periodic lines with rate and ETA elsewhere, never both."""

import io
import logging
import sys

from marin_rl.progress import StepProgress, format_duration


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "marin_rl"]


def test_plain_lines_come_every_interval_and_at_the_end_with_rate_and_eta(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="marin_rl"):
        with StepProgress("RL", 100, live=False, interval_s=10, clock=clock) as p:
            for step in range(1, 101):
                clock.t += 0.5  # 2 steps/s
                p.advance_to(step, "addition reward 0.500" if step == 20 else "")
    lines = _lines(caplog)
    assert len(lines) == 5  # every 10 s (20 steps); the last one at step 100 is also the end
    assert lines[0] == "RL: step 20/100 (20%) | 2.00 steps/s | ETA 40s | addition reward 0.500"
    assert lines[-1] == "RL: step 100/100 (100%) | 2.00 steps/s | ETA 0s"


def test_a_resumed_phase_counts_its_rate_from_where_it_started_and_every_adds_lines(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="marin_rl"):
        with StepProgress("warm start", 300, start=200, live=False, every=50, interval_s=1e9, clock=clock) as p:
            for step in range(201, 301):
                clock.t += 1.0
                p.advance_to(step)
    assert _lines(caplog) == [
        "warm start: step 250/300 (83%) | 1.00 steps/s | ETA 50s",
        "warm start: step 300/300 (100%) | 1.00 steps/s | ETA 0s",
    ]


def test_a_live_bar_logs_no_progress_lines_and_log_lines_go_above_it(caplog, monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with caplog.at_level(logging.INFO, logger="marin_rl"):
        with StepProgress("sft", 5, live=True) as p:
            for step in range(1, 6):
                p.advance_to(step, f"loss {1 / step:.3f}")
    assert _lines(caplog) == []  # never both: the bar replaces the plain lines
    shown = err.getvalue()
    assert "sft" in shown and "5/5" in shown and "loss 0.200" in shown
    assert sys.stderr is err  # the bar gave stderr back


def test_the_default_is_plain_when_stderr_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert StepProgress("x", 3).live is False


def test_durations_read_naturally():
    assert [format_duration(s) for s in (0, 12.4, 187, 3725)] == ["0s", "12s", "3m07s", "1h02m"]
