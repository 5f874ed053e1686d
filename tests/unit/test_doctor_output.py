"""What the doctor says while it checks, and its last line: pure formatting, table-driven."""

from __future__ import annotations

import io

import pytest

from sparkdist._doctor.progress import (
    MAX_DETAIL_CHARS,
    ProgressPrinter,
    end_line,
    start_line,
    waiting_line,
)
from sparkdist._doctor.table import Check, Status, format_checks, verdict

OK = Check("python", Status.OK, "3.11.7 (/usr/bin/python3)")
NOTE = Check("gpus", Status.NOTE, "no GPU visible", "nothing to do")
NOTE2 = Check("deepspeed", Status.NOTE, "not installed", "pip install deepspeed")
PROBLEM = Check("java", Status.PROBLEM, "no java on PATH", "install Java 17")
PROBLEM2 = Check("spark session", Status.PROBLEM, "not tried", "fix java")


@pytest.mark.parametrize(
    ("name", "note", "line"),
    [
        ("torch", "", "doctor: checking torch ..."),
        ("spark session", "up to 120 s", "doctor: checking spark session (up to 120 s) ..."),
    ],
)
def test_start_line(name, note, line):
    assert start_line(name, note) == line


def test_waiting_line():
    assert waiting_line("spark session", 12.4) == (
        "doctor: waiting for spark session (running for 12 s) ..."
    )


@pytest.mark.parametrize(
    ("check", "seconds", "line"),
    [
        (OK, 0.01, "doctor: python: OK, 3.11.7 (/usr/bin/python3)"),  # quick: no time
        (OK, 2.04, "doctor: python: OK, 3.11.7 (/usr/bin/python3) (2.0 s)"),
        (PROBLEM, 0.3, "doctor: java: PROBLEM, no java on PATH (0.3 s)"),
        (Check("gpus", Status.NOTE, "a\n  b"), 0, "doctor: gpus: NOTE, a b"),  # one line
        (Check("x", Status.OK, ""), 0, "doctor: x: OK"),
        (
            Check("x", Status.OK, "y" * 300),
            0,
            "doctor: x: OK, " + "y" * (MAX_DETAIL_CHARS - 3) + "...",
        ),
    ],
)
def test_end_line(check, seconds, line):
    assert end_line(check, seconds) == line


@pytest.mark.parametrize(
    ("checks", "line"),
    [
        ([OK, OK], "doctor: ready: 2 OK, 0 note(s), 0 problem(s)"),
        (
            [OK, NOTE, NOTE2],
            "doctor: ready: 1 OK, 2 note(s) (optional: gpus, deepspeed), 0 problem(s)",
        ),
        (
            [OK, PROBLEM],
            "doctor: not ready: 1 OK, 0 note(s), 1 problem(s) (java); fix the PROBLEM rows above",
        ),
        (
            [NOTE, PROBLEM, PROBLEM2],
            "doctor: not ready: 0 OK, 1 note(s), 2 problem(s) (java, "
            "spark session); fix the PROBLEM rows above",
        ),
    ],
)
def test_verdict(checks, line):
    assert verdict(checks) == line
    assert format_checks(checks).splitlines()[-2:] == ["", line]  # the table's last line


def test_printer_writes_each_line_as_it_comes():
    class Stream(io.StringIO):
        flushed: list[str] = []

        def flush(self):
            self.flushed.append(self.getvalue())

    stream = Stream()
    printer = ProgressPrinter(stream)
    printer.started("java")
    assert stream.flushed[-1] == "doctor: checking java ...\n"  # out before the check runs
    printer.finished(PROBLEM, 0.0)
    assert stream.getvalue().splitlines() == [
        "doctor: checking java ...",
        "doctor: java: PROBLEM, no java on PATH",
    ]


def test_printer_survives_a_closed_stream():
    stream = io.StringIO()
    stream.close()
    ProgressPrinter(stream).started("java")  # no error: the table still comes
