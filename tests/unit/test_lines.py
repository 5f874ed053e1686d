"""Splitting rank output into lines: undecodable bytes, \\r progress bars, very long lines."""

from __future__ import annotations

import os

from sparkdist._core.lines import MAX_LINE_BYTES, read_lines, split_lines


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
