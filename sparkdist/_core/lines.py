"""Splitting a rank's raw output into lines for the driver.

Robust to what training prints: undecodable bytes are replaced, ``\\r`` progress-bar updates
become lines of their own (a terminal would overwrite them; a log cannot), and a line longer
than ``MAX_LINE_BYTES`` is cut into pieces rather than buffered without bound.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import IO

#: A line longer than this is cut into pieces of this size.
MAX_LINE_BYTES = 64 * 1024


def read_lines(pipe: IO[bytes]) -> Iterator[str]:
    """Yield decoded lines from ``pipe`` as they arrive, until end of file; then close it."""
    pending = b""
    fd = pipe.fileno()
    try:
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            lines, pending = split_lines(pending + chunk)
            yield from lines
        if pending:
            yield from _decode(pending.rstrip(b"\r"))
    finally:
        pipe.close()


def split_lines(data: bytes) -> tuple[list[str], bytes]:
    """Complete lines of ``data`` (decoded) and the unfinished rest (raw).

    A trailing ``\\r`` stays pending: it may be the first half of a ``\\r\\n``.
    """
    keep_cr = data.endswith(b"\r")
    if keep_cr:
        data = data[:-1]
    *complete, rest = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    lines = [text for raw in complete for text in _decode(raw)]
    while len(rest) > MAX_LINE_BYTES:
        lines.extend(_decode(rest[:MAX_LINE_BYTES]))
        rest = rest[MAX_LINE_BYTES:]
    return lines, rest + (b"\r" if keep_cr else b"")


def _decode(raw: bytes) -> list[str]:
    if not raw:
        return [""]
    return [
        raw[start : start + MAX_LINE_BYTES].decode("utf-8", errors="replace")
        for start in range(0, len(raw), MAX_LINE_BYTES)
    ]
