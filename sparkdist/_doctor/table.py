"""The doctor's verdicts, the table the CLI prints and its one-line verdict.

Non-goals: running checks (``checks``, ``spark``), printing (the CLI prints; ``progress``).
"""

from __future__ import annotations

import enum
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass


class Status(str, enum.Enum):
    """How a check came out."""

    OK = "OK"
    NOTE = "NOTE"  # something optional is missing; runs still work
    PROBLEM = "PROBLEM"  # runs fail until it is fixed


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table: what was checked, what was found, and the fix.

    ``table`` is printed below the doctor's table (the cluster network's per-node rows).
    """

    name: str
    status: Status
    detail: str
    fix: str = ""
    table: str = ""


def has_problem(checks: Sequence[Check]) -> bool:
    """True when a run would fail on this machine as it is."""
    return any(check.status is Status.PROBLEM for check in checks)


def format_checks(checks: Sequence[Check], width: int = 100) -> str:
    """The table the CLI prints: one row per check, its fix indented below, the checks' own
    tables, then a summary."""
    name_width = max(len("check"), *(len(c.name) for c in checks))
    status_width = max(len(s.value) for s in Status)
    indent = " " * (name_width + status_width + 4)
    wrap_at = max(40, width - len(indent))
    lines = [f"{'check':<{name_width}}  {'status':<{status_width}}  detail"]
    lines.append(f"{'-' * name_width}  {'-' * status_width}  {'-' * (wrap_at)}")
    for check in checks:
        detail = textwrap.wrap(check.detail, wrap_at) or [""]
        status = check.status.value
        lines.append(f"{check.name:<{name_width}}  {status:<{status_width}}  {detail[0]}")
        lines.extend(indent + more for more in detail[1:])
        if check.fix:
            fix = textwrap.wrap("fix: " + check.fix, wrap_at, subsequent_indent="     ")
            lines.extend(indent + part for part in fix)
    for check in checks:
        if check.table:
            lines.extend(["", check.table])
    lines.append("")
    lines.append(verdict(checks))
    return "\n".join(lines)


def verdict(checks: Sequence[Check]) -> str:
    """The doctor's last line: ready or not, the counts, and which rows need a look."""
    names = {status: [c.name for c in checks if c.status is status] for status in Status}
    problems, notes = names[Status.PROBLEM], names[Status.NOTE]
    counts = (
        f"{len(names[Status.OK])} OK, {len(notes)} note(s)"
        + (f" (optional: {', '.join(notes)})" if notes and not problems else "")
        + f", {len(problems)} problem(s)"
    )
    if problems:
        return f"doctor: not ready: {counts} ({', '.join(problems)}); fix the PROBLEM rows above"
    return f"doctor: ready: {counts}"
