"""The hang watchdog: a joined rank that stays silent (no heartbeat, no report) for
``heartbeat_timeout_s`` is hung. Its Python stacks are dumped into its own output (the rank
handles ``run_dir.STACK_DUMP_SIGNAL``), the driver is told, and the agent ends the node.

A rank whose outcome is written (its ``Done``) but that has not exited ``EXIT_AFTER_DONE_S``
later (an atexit hook, or a library's thread, that never lets it end) is ended as well, its
stack dumped first; its outcome stands, so a finished run never waits on a process's exit.

Heartbeats themselves are recorded as the rank's notes arrive (``output.pump_notes``); a rank
that has not joined yet is never hung (the rendezvous has its own timeout).

Non-goals: ending ranks (``ranks``); deciding what the run does next (the driver).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection

from sparkdist._core.run_dir import STACK_DUMP_SIGNAL
from sparkdist._node.agent.outbox import Outbox
from sparkdist._node.agent.ranks import RankHandle, end_ranks
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._wire import protocol

logger = logging.getLogger("sparkdist")

#: How long a hung rank gets to print its stack dump before it is killed.
STACK_DUMP_GRACE_S = 0.5
#: How long a rank may take to exit once its outcome is written: its atexit hooks run then (a
#: tracker's last upload among them). Past it the process is ended; its outcome stands.
EXIT_AFTER_DONE_S = 120.0


def next_check_in_s(ranks: Collection[RankHandle], timeout_s: float | None) -> float | None:
    """How long until a live rank could first pass ``timeout_s`` in silence (None: never)."""
    if timeout_s is None:
        return None
    beats = [r.last_beat for r in ranks if r.last_beat is not None and r.ended is None]
    if not beats:
        return min(timeout_s, 1.0)  # nobody joined yet: look again soon
    return max(0.0, min(beats) + timeout_s - time.monotonic())


def check_heartbeats(
    ranks: Collection[RankHandle], timeout_s: float | None, outbox: Outbox
) -> str | None:
    """Declare silent ranks hung: dump their stacks into their output and report them.

    Returns:
        Why the node must stop (the agent then ends every rank), or None while all is well.
    """
    if timeout_s is None:
        return None
    now = time.monotonic()
    silent = [
        r
        for r in ranks
        if r.ended is None and r.last_beat is not None and now - r.last_beat >= timeout_s
    ]
    if not silent:
        return None
    for rank in silent:
        rank.hung_for_s = now - (rank.last_beat or now)
        try:
            os.kill(rank.proc.pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    # Give the dumps a moment to reach the output before the ranks are killed; the oldest
    # silence is the likeliest culprit (the others wait for it in a collective).
    time.sleep(STACK_DUMP_GRACE_S)
    for rank in sorted(silent, key=lambda r: r.last_beat_wall):
        outbox.control(
            protocol.Failed(
                rank.seat.rank,
                exit_code=None,
                time=time.time(),
                hung=True,
                last_beat=rank.last_beat_wall,
            )
        )
    names = ", ".join(str(r.seat.rank) for r in silent)
    return f"rank(s) {names} sent no heartbeat for {timeout_s} s"


def next_exit_bound_in_s(ranks: Collection[RankHandle]) -> float | None:
    """How long until a rank that wrote its outcome passes ``EXIT_AFTER_DONE_S`` (None: none)."""
    bounds = [r.done_at for r in ranks if r.done_at is not None and r.ended is None]
    if not bounds:
        return None
    return max(0.0, min(bounds) + EXIT_AFTER_DONE_S - time.monotonic())


def end_ranks_past_their_exit(
    ranks: Collection[RankHandle], spec: AgentSpec, outbox: Outbox
) -> None:
    """End the ranks whose outcome is written but whose process has not exited within
    ``EXIT_AFTER_DONE_S``: their stacks go to their output first, then a line that says why."""
    now = time.monotonic()
    late = [
        r
        for r in ranks
        if r.ended is None
        and not r.ended_after_done
        and r.done_at is not None
        and now - r.done_at >= EXIT_AFTER_DONE_S
    ]
    if not late:
        return
    for rank in late:
        rank.ended_after_done = True  # before any signal: its exit code is the one it announced
        try:
            os.kill(rank.proc.pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(STACK_DUMP_GRACE_S)
    for rank in late:
        line = (
            f"sparkdist: rank {rank.seat.rank} wrote its outcome {EXIT_AFTER_DONE_S:g} s ago but "
            "its process has not exited (an atexit hook or a thread holds it; its stack is "
            "above): it is ended, its outcome stands"
        )
        logger.warning("%s (run %s)", line, spec.run_id)
        outbox.line(protocol.Log(rank.seat.rank, protocol.Stream.STDERR, line))
    end_ranks(late, spec)
