"""The ranks' output on the driver: ``[rank N] line``, one whole line each, never glued to
Spark's console progress bar.

Spark's ``ConsoleProgressBar`` (on where ``spark.ui.showConsoleProgress`` is true: the default
of a session that pyspark's launcher starts from a script, a shell or a notebook's terminal)
draws ``\\r[Stage 3:>   (0 + 2) / 2]\\r`` on the JVM's stderr, the driver's terminal, and leaves
it there until the stage changes: no newline after it. A rank line written to the same terminal
then lands on top of the bar and keeps its tail (``[rank 0] step 1(0 + 2) / 2]``). Spark has no
job-local switch for the bar (it shows every active stage), so a rank line going to a terminal
while a bar may be up first clears the line (``\\r`` + erase to end of line); the bar comes back
on its next change. Nothing is added when the line goes to a file or a pipe.

Non-goals: which ranks' lines are forwarded (``_node``), the tqdm bar of ``runtime.report``
(``_tracking.progress`` steps it aside itself).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import IO, Any

from sparkdist._wire.protocol import Log, Stream

#: Back to the start of the line, and erase it (Spark's bar included).
CLEAR_LINE = "\r\x1b[K"
_CONSOLE_PROGRESS_KEY = "spark.ui.showConsoleProgress"

logger = logging.getLogger("sparkdist")

_lock = threading.Lock()
_read_for: list[Any] = [None, False]  # [the SparkContext read, its bar setting]


def rank_line_prefix(to_terminal: bool, spark_bar_on_terminal: bool) -> str:
    """What goes before a rank line: a line clear where Spark's bar may be on the terminal the
    line goes to, else nothing (files and pipes get plain lines)."""
    return CLEAR_LINE if to_terminal and spark_bar_on_terminal else ""


def shows_console_progress(conf_value: str | None) -> bool:
    """Whether ``spark.ui.showConsoleProgress`` (its value, None when unset) turns the bar on."""
    return (conf_value or "").strip().lower() == "true"


def print_rank_line(message: Log) -> None:
    """Write a rank's line to the driver's stdout or stderr (as the rank did), whole."""
    stream = sys.stderr if message.stream is Stream.STDERR else sys.stdout
    with _lock:
        try:
            terminal = _isatty(stream)
            prefix = rank_line_prefix(terminal, terminal and _spark_bar_on_terminal())
            stream.write(f"{prefix}[rank {message.rank}] {message.line}\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # the driver's own output is gone; training goes on


def warn_lines_dropped(count: int) -> None:
    """Say that ``count`` lines of the ranks never reached the driver (it fell behind)."""
    logger.warning(
        "sparkdist: %d output line(s) of the ranks were dropped because the driver fell behind",
        count,
    )


def warn_output_unconfirmed(nodes: list[int], waited_s: float) -> None:
    """Say that ``nodes`` never confirmed their ranks' output was complete (no bye)."""
    logger.warning(
        "sparkdist: node(s) %s did not confirm their ranks' output within %g s of the end; "
        "their last output lines may be missing",
        nodes,
        waited_s,
    )


def _spark_bar_on_terminal() -> bool:
    """Whether this process's SparkContext draws its console bar where a terminal shows it (the
    JVM writes it to the stderr it inherited). Read once per SparkContext; never imports
    pyspark (no session, no bar)."""
    if "pyspark" not in sys.modules or not _fd_is_terminal(2):
        return False
    try:
        from pyspark import SparkContext

        context = SparkContext._active_spark_context
        if context is None:
            return False
        if _read_for[0] is not context:
            value = context.getConf().get(_CONSOLE_PROGRESS_KEY, None)
            _read_for[:] = [context, shows_console_progress(value)]
        return bool(_read_for[1])
    except Exception:  # noqa: BLE001 - a stopping context: plain lines
        return False


def _isatty(stream: IO[str]) -> bool:
    try:
        return _fd_is_terminal(stream.fileno())
    except (AttributeError, ValueError, OSError):  # no descriptor (captured, a notebook's)
        return False


def _fd_is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False
