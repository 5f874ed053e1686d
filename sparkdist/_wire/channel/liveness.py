"""Whether the other end of a control connection is still there: beats both ways, and a bound
on silence (pure).

A host that is cut off (its link down, a switch port dead, a partition) closes nothing: no FIN
or RST ever comes, and TCP alone notices only when it has something unacknowledged to send,
after minutes. So each end sends an ``Alive`` frame whenever it sent nothing for
``BEAT_INTERVAL_S``, and counts the other end as gone once it heard nothing, not even a beat,
for the silence limit. The driver then names the silent node (the first to lose contact: the
root cause) and the node ends its ranks, within the same bound, on both sides of the cut.

The beats come from each end's I/O thread, never from a rank: a rank busy in a 60 s C call
does not make its node silent.

Non-goals: sockets (``channel``, ``client``), what a lost node means for the run
(``_core.run_state``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Each end sends a beat when it sent nothing for this long.
BEAT_INTERVAL_S = 1.0
#: Heard nothing for this long (no frame, no beat): the other end is gone. Documented in
#: docs/restarts.md; ``heartbeat_timeout_s`` sets it.
SILENCE_LIMIT_S = 10.0
#: The shortest limit honoured: two beats may be late without a false alarm.
MIN_SILENCE_LIMIT_S = 2 * BEAT_INTERVAL_S


def silence_limit_s(heartbeat_timeout_s: float | None) -> float:
    """The run's silence limit: ``heartbeat_timeout_s`` when set (never under two beats),
    else ``SILENCE_LIMIT_S``."""
    if heartbeat_timeout_s is None:
        return SILENCE_LIMIT_S
    return max(MIN_SILENCE_LIMIT_S, heartbeat_timeout_s)


@dataclass
class Liveness:
    """One connection's clocks (monotonic seconds; ``heard_wall`` is wall-clock).

    Attributes:
        limit_s: silence after which the other end counts as gone (None: never).
        heard_at: when the last bytes came from the other end.
        heard_wall: the same moment on the wall clock (errors and root causes compare it
            with the ranks' own timestamps).
        sent_at: when the last bytes went to the other end.
    """

    limit_s: float | None
    heard_at: float
    heard_wall: float
    sent_at: float
    interval_s: float = BEAT_INTERVAL_S

    @classmethod
    def starting(cls, limit_s: float | None, now: float, wall: float) -> Liveness:
        """A connection that just finished its handshake (both ends heard each other)."""
        return cls(limit_s, now, wall, now)

    def heard(self, now: float, wall: float) -> None:
        self.heard_at, self.heard_wall = now, wall

    def excuse(self, now: float) -> None:
        """This end stopped reading for a while (its handlers fell behind): the other end's
        silence so far is not its own (the wall-clock time of its last word stays)."""
        self.heard_at = max(self.heard_at, now)

    def sent(self, now: float) -> None:
        self.sent_at = now

    def beat_due(self, now: float) -> bool:
        """Whether this end should send a beat now (it sent nothing for an interval)."""
        return now - self.sent_at >= self.interval_s

    def silent_for(self, now: float) -> float | None:
        """How long the other end has been silent, once that passes the limit; else None."""
        quiet = now - self.heard_at
        if self.limit_s is None or quiet < self.limit_s:
            return None
        return quiet

    def next_due(self, now: float) -> float:
        """The next monotonic time something is due: a beat, or the silence limit."""
        due = self.sent_at + self.interval_s
        if self.limit_s is not None:
            due = min(due, self.heard_at + self.limit_s)
        return max(now, due)
