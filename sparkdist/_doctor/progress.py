"""What ``sparkdist doctor`` says while it checks (a cold JVM takes a minute on a busy box).

Each check's name goes out as it starts and its verdict as it ends, one line each, on stderr
(stdout keeps the table and the verdict, for whoever parses them). The Spark session check runs
in a child process alongside the others, so its start and its end are lines apart.

Non-goals: running checks (``checks``), the table (``table``).
"""

from __future__ import annotations

from typing import IO, Protocol

from sparkdist._doctor.table import Check

#: A check's detail is cut to this many characters in its progress line (the table has it all).
MAX_DETAIL_CHARS = 100
#: Durations under this are not worth a mention.
_SHOWN_FROM_S = 0.1


class Progress(Protocol):
    """Told as each check starts and ends."""

    def started(self, name: str, note: str = "") -> None: ...

    def waiting(self, name: str, seconds: float) -> None: ...

    def finished(self, check: Check, seconds: float) -> None: ...


def start_line(name: str, note: str = "") -> str:
    """``doctor: checking torch ...``, with what to expect when it is slow."""
    return f"doctor: checking {name}{f' ({note})' if note else ''} ..."


def waiting_line(name: str, seconds: float) -> str:
    """``doctor: waiting for spark session (running for 12 s) ...``: the last check is slow."""
    return f"doctor: waiting for {name} (running for {seconds:.0f} s) ..."


def end_line(check: Check, seconds: float) -> str:
    """``doctor: torch: OK, 2.13.0, CPU build (1.9 s)``: the verdict, its detail's start."""
    detail = " ".join(check.detail.split())
    if len(detail) > MAX_DETAIL_CHARS:
        detail = detail[: MAX_DETAIL_CHARS - 3] + "..."
    took = f" ({seconds:.1f} s)" if seconds >= _SHOWN_FROM_S else ""
    return f"doctor: {check.name}: {check.status.value}{', ' + detail if detail else ''}{took}"


class ProgressPrinter:
    """Writes the progress lines to ``stream``, flushed as they come."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def started(self, name: str, note: str = "") -> None:
        self._write(start_line(name, note))

    def waiting(self, name: str, seconds: float) -> None:
        self._write(waiting_line(name, seconds))

    def finished(self, check: Check, seconds: float) -> None:
        self._write(end_line(check, seconds))

    def _write(self, line: str) -> None:
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            pass  # nobody reads the progress: the table still comes


class Silent:
    """No progress (library callers, tests)."""

    def started(self, name: str, note: str = "") -> None:
        pass

    def waiting(self, name: str, seconds: float) -> None:
        pass

    def finished(self, check: Check, seconds: float) -> None:
        pass
