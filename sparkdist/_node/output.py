"""Pumping a rank's pipes: its stdout/stderr lines to the driver (each also kept in the rank's
ring of last lines, for its failure report) and its notes (store port, joined, beats, progress
reports) to where they belong.

One thread per pipe, started by the agent; each ends at the pipe's end of file.

Non-goals: how messages travel (``outbox``); what a silent rank means (``watchdog``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

from sparkdist._core.lines import read_lines
from sparkdist._node.outbox import Outbox
from sparkdist._wire import protocol
from sparkdist._wire.protocol import ProtocolError, Route

if TYPE_CHECKING:
    from sparkdist._node.ranks import RankHandle

#: Lines kept per rank for the failure report.
LAST_LINES = 30
#: How long an exited rank's output may still be drained.
OUTPUT_DRAIN_S = 1.0


def pump_lines(rank: RankHandle, pipe: IO[bytes], stream: protocol.Stream, outbox: Outbox) -> None:
    """Forward every line of ``pipe`` (the rank's ``stream``) until its end of file."""
    number = rank.seat.rank
    for text in read_lines(pipe):
        rank.last_lines.append(text)
        outbox.line(protocol.Log(number, stream, text))


def pump_notes(
    rank: RankHandle, outbox: Outbox, send_control: Callable[[protocol.Message], None]
) -> None:
    """Act on every note the rank sends until its end of file.

    ``send_control`` takes what the rendezvous needs (the store's port): to the driver, or
    to a detached node's own rendezvous.
    """
    notes = rank.notes
    number = rank.seat.rank
    for raw in notes:
        try:
            note = protocol.decode(raw.rstrip(b"\n"), Route.WORKER)
        except ProtocolError:
            continue
        match note:
            case protocol.Store():
                send_control(note)
            case protocol.Ready() | protocol.Beat() | protocol.Report():
                rank.heard_from()
                # The rank is the one this pipe belongs to, whatever the note says.
                if isinstance(note, protocol.Ready):
                    outbox.control(protocol.Ready(number))
                elif isinstance(note, protocol.Report):
                    # Progress is droppable like output: it must never stall training.
                    outbox.line(dataclasses.replace(note, rank=number))
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
