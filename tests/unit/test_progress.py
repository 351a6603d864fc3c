"""Progress output: a bar on a terminal, a few short lines in a log file or pipe."""

from __future__ import annotations

import io

import pytest

from roll.utils import tracking
from roll.utils.tracking import show_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_gets_a_few_short_lines_for_many_updates() -> None:
    log = io.StringIO()
    bar = show_progress(range(1000), desc="sft", stream=log)
    for step in bar:
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}")
    lines = log.getvalue().splitlines()
    assert len(lines) <= 3 and "\r" not in log.getvalue()
    assert lines[-1].startswith("sft: 1000/1000 in ") and lines[-1].endswith("loss=0.001"), lines
    assert all(len(line) < 120 for line in lines)


def test_log_gets_a_line_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(0, 10_000, 10))  # each step takes 10 s
    monkeypatch.setattr(tracking.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    for _ in show_progress(range(9), desc="rlvr", stream=log, interval_s=30):
        pass
    assert [line.split(" in ")[0] for line in log.getvalue().splitlines()] == ["rlvr: 3/9", "rlvr: 6/9", "rlvr: 9/9"]


def test_terminal_gets_a_bar() -> None:
    terminal = Terminal()
    bar = show_progress(range(5), desc="rlvr", stream=terminal)
    for _ in bar:
        bar.set_postfix(reward="0.50")
    assert "\r" in terminal.getvalue() and "5/5" in terminal.getvalue() and "reward=0.50" in terminal.getvalue()
