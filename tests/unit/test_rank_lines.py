"""Rank lines on the driver: whole lines, cleared of Spark's console bar only on a terminal."""

from __future__ import annotations

import io
import os
import pty
import select
import time

import pytest

from sparkdist._engine import rank_lines
from sparkdist._engine.rank_lines import (
    CLEAR_LINE,
    print_rank_line,
    rank_line_prefix,
    shows_console_progress,
)
from sparkdist._wire.protocol import Log, Stream


@pytest.mark.parametrize(
    ("to_terminal", "bar", "prefix"),
    [(True, True, CLEAR_LINE), (True, False, ""), (False, True, ""), (False, False, "")],
)
def test_prefix(to_terminal, bar, prefix):
    assert rank_line_prefix(to_terminal, bar) == prefix


@pytest.mark.parametrize(
    ("value", "on"),
    [("true", True), (" TRUE ", True), ("false", False), (None, False), ("", False)],
)
def test_console_progress_conf(value, on):
    assert shows_console_progress(value) is on


@pytest.fixture
def terminal():
    """A real pseudo-terminal to write to, and what arrives on its other side: a whole line
    (a read may return the line before its end arrives; a loaded machine showed it)."""
    controller, follower = pty.openpty()
    stream = open(follower, "w", closefd=True)  # noqa: SIM115 - closed below

    def received() -> str:
        text, deadline = "", time.monotonic() + 10
        while not text.endswith("\n") and time.monotonic() < deadline:
            if select.select([controller], [], [], 0.1)[0]:
                text += os.read(controller, 4096).decode()
        return text

    yield stream, received
    stream.close()
    os.close(controller)


@pytest.mark.parametrize("bar", [True, False])
def test_a_line_to_a_terminal_clears_a_spark_bar_first(terminal, monkeypatch, bar):
    stream, received = terminal
    monkeypatch.setattr("sys.stdout", stream)
    monkeypatch.setattr(rank_lines, "_spark_bar_on_terminal", lambda: bar)
    print_rank_line(Log(1, Stream.STDOUT, "step 3"))
    # The terminal turns "\n" into "\r\n".
    assert received() == (CLEAR_LINE if bar else "") + "[rank 1] step 3\r\n"


def test_a_line_to_a_file_is_plain(monkeypatch):
    captured = io.StringIO()
    monkeypatch.setattr("sys.stderr", captured)
    monkeypatch.setattr(rank_lines, "_spark_bar_on_terminal", lambda: True)
    print_rank_line(Log(0, Stream.STDERR, "warning"))
    assert captured.getvalue() == "[rank 0] warning\n"


def test_no_spark_no_bar(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "pyspark", raising=False)
    assert rank_lines._spark_bar_on_terminal() is False
