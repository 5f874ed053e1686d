"""The failures of a detached node (one that rendezvoused through Spark, not the driver's
channel), carried in its barrier task's error message: the agent raises ``DetachedFailure``,
Spark carries its text to the driver, and the driver reads the failures back
(``failures_in``) to name the root cause with its traceback.

Non-goals: the detached rendezvous (``_node.agent.detached``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from sparkdist._core.errors import RankFailure

_MARKER = re.compile(r"SPARKDIST-FAILURES<<<(.*?)>>>", re.DOTALL)
#: How much of a traceback travels inside a task's error message.
MAX_TRACEBACK_CHARS = 20_000


class DetachedFailure(RuntimeError):
    """Raised from a barrier task whose ranks failed while detached from the driver."""

    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        payload = json.dumps([_failure_to_dict(f) for f in failures])
        summary = "; ".join(f.summary() for f in failures)
        super().__init__(f"{summary}\nSPARKDIST-FAILURES<<<{payload}>>>")


def failures_in(text: str) -> list[RankFailure]:
    """The failures a detached task encoded in its error message (``text``), if any."""
    found: list[RankFailure] = []
    for match in _MARKER.finditer(text):
        try:
            found.extend(_failure_from_dict(item) for item in json.loads(match.group(1)))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def _failure_to_dict(failure: RankFailure) -> dict[str, Any]:
    return {
        "rank": failure.rank,
        "host": failure.host,
        "exit_code": failure.exit_code,
        "exc_type": failure.exc_type,
        "message": failure.message,
        "traceback": failure.traceback[-MAX_TRACEBACK_CHARS:],
        "last_lines": list(failure.last_lines),
        "diagnosis": failure.diagnosis,
    }


def _failure_from_dict(item: dict[str, Any]) -> RankFailure:
    return RankFailure(
        rank=int(item["rank"]),
        host=str(item["host"]),
        exit_code=item["exit_code"],
        exc_type=str(item["exc_type"]),
        message=str(item["message"]),
        traceback=str(item["traceback"]),
        last_lines=tuple(item["last_lines"]),
        diagnosis=str(item.get("diagnosis", "")),
    )
