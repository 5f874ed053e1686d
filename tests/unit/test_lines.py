"""Splitting rank output into lines: undecodable bytes, \\r progress bars, very long lines; and
the one line of c10d noise the node drops."""

from __future__ import annotations

import collections
import os
from types import SimpleNamespace

import pytest

from sparkdist._core.env import SHOW_C10D_HOSTNAME_WARNING_VAR
from sparkdist._core.lines import (
    MAX_LINE_BYTES,
    is_c10d_hostname_warning,
    read_lines,
    shows_c10d_hostname_warning,
    split_lines,
)
from sparkdist._node.agent.output import pump_lines, stderr_noise
from sparkdist._wire import protocol


def test_complete_lines_and_the_rest():
    assert split_lines(b"a\nb\nrest") == (["a", "b"], b"rest")
    assert split_lines(b"") == ([], b"")
    assert split_lines(b"\n\n") == (["", ""], b"")


def test_carriage_returns_become_lines_and_crlf_is_one_break():
    assert split_lines(b"10%\r50%\r100%\n") == (["10%", "50%", "100%"], b"")
    assert split_lines(b"x\r\ny\n") == (["x", "y"], b"")


def test_a_trailing_cr_waits_for_a_possible_lf():
    lines, rest = split_lines(b"done\r")
    assert lines == [] and rest == b"done\r"
    lines, rest = split_lines(rest + b"\nnext\n")
    assert lines == ["done", "next"] and rest == b""


def test_undecodable_bytes_are_replaced():
    assert split_lines(b"bad \xff\xfe here\n") == (["bad \ufffd\ufffd here"], b"")


def test_long_lines_are_cut_into_pieces():
    data = b"x" * (2 * MAX_LINE_BYTES + 5) + b"\n"
    lines, rest = split_lines(data)
    assert [len(line) for line in lines] == [MAX_LINE_BYTES, MAX_LINE_BYTES, 5]
    lines, rest = split_lines(b"y" * (MAX_LINE_BYTES + 3))  # unfinished: cut, rest kept
    assert lines == ["y" * MAX_LINE_BYTES] and rest == b"yyy"


def test_read_lines_from_a_pipe_until_eof():
    read_end, write_end = os.pipe()
    os.write(write_end, b"one\ntwo\rthree")
    os.close(write_end)
    assert list(read_lines(os.fdopen(read_end, "rb"))) == ["one", "two", "three"]


# -- c10d's hostname warning: dropped from the ranks' stderr unless asked for -----------------

C10D_WARNING = (
    "[W1117 12:34:56.789012345 socket.cpp:768] [c10d] The hostname of the client socket "
    "cannot be retrieved. err=-3"
)


@pytest.mark.parametrize(
    ("line", "dropped"),
    [
        (C10D_WARNING, True),
        (
            "[W socket.cpp:697] [c10d] The hostname of the client socket cannot be retrieved. "
            "err=-2",
            True,
        ),
        # Any other c10d line, and the same words outside c10d's prefix, are the rank's.
        ("[W socket.cpp:697] [c10d] The client socket has failed to connect to [h]:1", False),
        ("The hostname of the client socket cannot be retrieved", False),
        ("[rank 0] loss 0.1", False),
        ("", False),
    ],
)
def test_the_c10d_hostname_warning_and_nothing_else(line, dropped):
    assert is_c10d_hostname_warning(line) is dropped


@pytest.mark.parametrize(
    ("environ", "shown"),
    [
        ({}, False),
        ({SHOW_C10D_HOSTNAME_WARNING_VAR: "1"}, True),
        ({SHOW_C10D_HOSTNAME_WARNING_VAR: " Yes "}, True),
        ({SHOW_C10D_HOSTNAME_WARNING_VAR: "0"}, False),
        ({SHOW_C10D_HOSTNAME_WARNING_VAR: ""}, False),
    ],
)
def test_the_setting_that_shows_it_again(environ, shown):
    assert shows_c10d_hostname_warning(environ) is shown
    assert (stderr_noise(environ) is None) is shown


def _pump(data: bytes, drop):
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    rank = SimpleNamespace(seat=SimpleNamespace(rank=3), last_lines=collections.deque())
    sent = []
    outbox = SimpleNamespace(line=sent.append)
    pump_lines(rank, os.fdopen(read_end, "rb"), protocol.Stream.STDERR, outbox, drop)
    return [m.line for m in sent], list(rank.last_lines)


def test_the_node_forwards_every_line_but_the_warning():
    data = f"before\n{C10D_WARNING}\n{C10D_WARNING}\nafter\n".encode()
    sent, kept = _pump(data, stderr_noise({}))
    assert sent == kept == ["before", "after"]
    sent, kept = _pump(data, stderr_noise({SHOW_C10D_HOSTNAME_WARNING_VAR: "1"}))
    assert sent == kept == ["before", C10D_WARNING, C10D_WARNING, "after"]
