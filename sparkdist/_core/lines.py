"""Splitting a rank's raw output into lines for the driver.

Robust to what training prints: undecodable bytes are replaced, ``\\r`` progress-bar updates
become lines of their own (a terminal would overwrite them; a log cannot), and a line longer
than ``MAX_LINE_BYTES`` is cut into pieces rather than buffered without bound.

One known line of noise is recognised here (``is_c10d_hostname_warning``) so the node can drop
it; nothing else a rank prints is ever judged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import IO

from sparkdist._core.env import SHOW_C10D_HOSTNAME_WARNING_VAR

#: A line longer than this is cut into pieces of this size.
MAX_LINE_BYTES = 64 * 1024

#: What c10d logs (``[W... socket.cpp:...] [c10d] The hostname of the client socket cannot be
#: retrieved. err=-3``) on stderr, once per rank and connection, where the peer's address has no
#: reverse DNS entry: the connection works, it only cannot name the peer in its own messages.
_C10D_HOSTNAME_WARNING = "The hostname of the client socket cannot be retrieved"
_TRUE = ("1", "true", "yes", "on")


def is_c10d_hostname_warning(line: str) -> bool:
    """Whether ``line`` (of a rank's stderr) is c10d's "hostname of the client socket cannot be
    retrieved" warning, and nothing else."""
    return "[c10d]" in line and _C10D_HOSTNAME_WARNING in line


def shows_c10d_hostname_warning(environ: Mapping[str, str]) -> bool:
    """Whether ``SPARKDIST_SHOW_C10D_HOSTNAME_WARNING`` in ``environ`` asks to keep that warning
    (read as ``SPARKDIST_FULL_TRACEBACK`` is: 1, true, yes, on)."""
    return environ.get(SHOW_C10D_HOSTNAME_WARNING_VAR, "").strip().lower() in _TRUE


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
