"""Pumping a rank's pipes: its stdout/stderr lines to the driver (each also kept in the rank's
ring of last lines, for its failure report) and its notes (store port, joined, beats, progress
reports) to where they belong.

One thread per pipe, started by the agent; each ends at the pipe's end of file.

Non-goals: how messages travel (``outbox``); what a silent rank means (``watchdog``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

from sparkdist._core.lines import read_lines
from sparkdist._node.outbox import Outbox
from sparkdist._wire.channel import Message

if TYPE_CHECKING:
    from sparkdist._node.ranks import RankHandle

#: Lines kept per rank for the failure report.
LAST_LINES = 30
#: How long an exited rank's output may still be drained.
OUTPUT_DRAIN_S = 1.0


def pump_lines(rank: RankHandle, pipe: IO[bytes], stream: str, outbox: Outbox) -> None:
    """Forward every line of ``pipe`` (the rank's ``stream``) until its end of file."""
    number = rank.seat.rank
    for text in read_lines(pipe):
        rank.last_lines.append(text)
        outbox.line({"t": "log", "rank": number, "stream": stream, "line": text})


def pump_notes(rank: RankHandle, outbox: Outbox, send_control: Callable[[Message], None]) -> None:
    """Act on every note the rank sends until its end of file.

    ``send_control`` takes what the rendezvous needs (the store's port): to the driver, or
    to a detached node's own rendezvous.
    """
    notes = rank.notes
    number = rank.seat.rank
    for raw in notes:
        try:
            note = json.loads(raw)
        except ValueError:
            continue
        kind = note.get("t")
        if kind == "store":
            send_control({"t": "store", "port": int(note["port"])})
        elif kind in ("ready", "beat", "report"):
            rank.heard_from()
            if kind == "ready":
                outbox.control({"t": "ready", "rank": number})
            elif kind == "report":
                # Progress is droppable like output: it must never stall training.
                outbox.line({**note, "rank": number})
    notes.close()


def drain(rank: RankHandle) -> None:
    """Wait (briefly) for an exited rank's threads: its pumps reach end of file, its waiter
    ends its strays.

    Its pipes end unless something it started in another session still holds them: such a
    stray is never waited on past ``OUTPUT_DRAIN_S``.
    """
    deadline = time.monotonic() + OUTPUT_DRAIN_S
    for thread in rank.threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
