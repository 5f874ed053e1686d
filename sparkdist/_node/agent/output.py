"""Pumping a rank's pipes: its stdout/stderr lines to the driver (each also kept in the rank's
ring of last lines, for its failure report) and its notes (store port, joined, beats, progress
reports, a preemption notice) to where they belong. One known line of c10d noise is dropped
(``stderr_noise``).

One thread per pipe, started by the agent; each ends at the pipe's end of file.

Non-goals: how messages travel (``outbox``); what a silent rank means (``watchdog``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from typing import IO, TYPE_CHECKING

from sparkdist._core.lines import is_c10d_hostname_warning, read_lines, shows_c10d_hostname_warning
from sparkdist._node.agent.outbox import Outbox
from sparkdist._wire import protocol
from sparkdist._wire.protocol import ProtocolError, Route

if TYPE_CHECKING:
    from sparkdist._node.agent.ranks import RankHandle

#: Lines kept per rank for the failure report.
LAST_LINES = 30
#: How long an exited rank's output may still be drained.
OUTPUT_DRAIN_S = 1.0
#: How long, after the last rank exited, its output may take to be read to the end.
OUTPUT_READ_TIMEOUT_S = 5.0


def pump_lines(
    rank: RankHandle,
    pipe: IO[bytes],
    stream: protocol.Stream,
    outbox: Outbox,
    drop: Callable[[str], bool] | None = None,
) -> None:
    """Forward every line of ``pipe`` (the rank's ``stream``) until its end of file, but those
    ``drop`` says are noise (neither forwarded nor kept for the failure report)."""
    number = rank.seat.rank
    for text in read_lines(pipe):
        if drop is not None and drop(text):
            continue
        rank.last_lines.append(text)
        outbox.line(protocol.Log(number, stream, text))


def stderr_noise(environ: Mapping[str, str]) -> Callable[[str], bool] | None:
    """What to drop from the ranks' stderr, given the environment they see.

    c10d warns "The hostname of the client socket cannot be retrieved" once per rank and
    connection on every cluster without reverse DNS for its hosts' addresses: the connection
    works, only the peer goes unnamed in c10d's own messages; on a multi-host run it is a
    screenful of lines that hide the real output and read like a failure. So it is dropped,
    unless ``SPARKDIST_SHOW_C10D_HOSTNAME_WARNING=1``.
    """
    return None if shows_c10d_hostname_warning(environ) else is_c10d_hostname_warning


def pump_notes(
    rank: RankHandle,
    outbox: Outbox,
    send_control: Callable[[protocol.Message], None],
    on_preempted: Callable[[str], None] | None = None,
    on_done: Callable[[], None] | None = None,
) -> None:
    """Act on every note the rank sends until its end of file.

    ``send_control`` takes what the rendezvous needs (the store's port): to the driver, or
    to a detached node's own rendezvous. ``on_preempted`` takes a preemption notice the rank
    got (its ``why``); ``on_done`` is called once the rank said its outcome is written.
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
            case protocol.Preempted(why=why):
                if on_preempted is not None:
                    on_preempted(why)
            case protocol.Done(exit_code=code):
                rank.done(code)
                if on_done is not None:
                    on_done()
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


def finish_reading(ranks: Collection[RankHandle]) -> None:
    """Wait until every rank's output is read to its end (the pipes close once the rank and
    its strays are gone): a rank's exit can be seen before its last lines are, and the bye
    that follows tells the driver the output is complete."""
    deadline = time.monotonic() + OUTPUT_READ_TIMEOUT_S
    for rank in ranks:
        for thread in rank.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
