"""Tracebacks as the user reads them: a rank's traceback without sparkdist's own frames.

A rank's traceback reaches the driver as text (``traceback.format_exception`` ran in the rank),
so sparkdist's frames are dropped from that text when the driver builds its message: a frame is
a ``File "...", line N, in name`` line and the lines indented below it (source, carets).
What the user wrote stays, and so does the last line saying what was raised. When every frame is
sparkdist's (the error is sparkdist's own), nothing is hidden: an empty traceback says less.

``SPARKDIST_FULL_TRACEBACK=1`` shows everything, here and on the driver (the front doors drop
the driver's frames of sparkdist when they raise to the user).

Non-goals: formatting tracebacks (Python's), the failure message around it (``errors``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

#: Set to 1 to see sparkdist's own frames in tracebacks (the ranks' and the driver's).
FULL_TRACEBACK_VAR = "SPARKDIST_FULL_TRACEBACK"

E = TypeVar("E", bound=BaseException)

_TRUE = ("1", "true", "yes", "on")
_FRAME = re.compile(r'^(?P<prefix>[ |]*)File "(?P<path>[^"]*)", line \d+')
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HEADER = "Traceback (most recent call last):"
_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


def full_traceback_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether SPARKDIST_FULL_TRACEBACK asks for every frame."""
    value = (os.environ if environ is None else environ).get(FULL_TRACEBACK_VAR, "")
    return value.strip().lower() in _TRUE


@functools.cache
def _package_files() -> frozenset[str]:
    """The package's modules, relative to it ("runtime.py", "_core/errors.py"...)."""
    found = set()
    for folder, _, names in os.walk(_PACKAGE_DIR):
        relative = os.path.relpath(folder, _PACKAGE_DIR)
        for name in names:
            if name.endswith(".py"):
                path = name if relative == "." else os.path.join(relative, name)
                found.add(path.replace(os.sep, "/"))
    return frozenset(found)


def is_sparkdist_file(path: str) -> bool:
    """Whether ``path`` is one of sparkdist's modules: here, or where an executor installed it
    (a ``.../sparkdist/<module>`` path naming a module this package has)."""
    if os.path.abspath(path).startswith(_PACKAGE_DIR + os.sep):
        return True
    _, found, relative = path.replace("\\", "/").rpartition("/sparkdist/")
    return bool(found) and relative in _package_files()


def hide_frames(text: str, hidden: Callable[[str], bool] = is_sparkdist_file) -> tuple[str, int]:
    """``text`` without the frames whose file ``hidden`` says to hide; and how many went.

    Returns ``text`` itself (and 0) when every frame would go.
    """
    lines = text.splitlines()
    kept: list[str] = []
    frames = dropped = 0
    index = 0
    last_hidden = False
    while index < len(lines):
        line = lines[index]
        match = _FRAME.match(line)
        if match is None:
            # "[Previous line repeated N more times]" belongs to the frame before it.
            if not (last_hidden and line.strip().startswith("[Previous line repeated")):
                kept.append(line)
            last_hidden = False
            index += 1
            continue
        depth = _depth(line)
        end = index + 1
        while end < len(lines) and _depth(lines[end]) > depth and not _FRAME.match(lines[end]):
            end += 1
        frames += 1
        last_hidden = hidden(match.group("path"))
        if last_hidden:
            dropped += 1
        else:
            kept.extend(lines[index:end])
        index = end
    if dropped == 0 or dropped == frames:
        return text, 0
    return "\n".join(kept) + ("\n" if text.endswith("\n") else ""), dropped


def without_header(text: str) -> str:
    """A plain traceback without its "Traceback (most recent call last):" line (a chained one
    keeps it: its first frames are an earlier exception's, not the one named above them)."""
    if text.startswith(_HEADER + "\n") and not any(marker in text for marker in _CHAINED):
        return text[len(_HEADER) + 1 :]
    return text


def for_the_user(error: E) -> E:
    """``error`` without the driver's frames, for a front door to raise again: sparkdist's
    machinery (threads, the supervisor) says nothing about the user's code, and the message
    carries what does. Kept as is with SPARKDIST_FULL_TRACEBACK=1."""
    return error if full_traceback_wanted() else error.with_traceback(None)


def _depth(line: str) -> int:
    """Indentation, counting an exception group's "|" margins as indentation."""
    return len(line) - len(line.lstrip(" |")) if line.strip() else 0
