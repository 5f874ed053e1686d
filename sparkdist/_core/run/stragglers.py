"""Straggler detection: which rank trains slower than the others, while it does.

Every rank's ``runtime.report()`` steps go in (``observe``); ``check`` compares each rank's
steps per second over the last ``horizon_s`` with the median of all ranks. A rank whose rate
stays below ``fraction`` of the median for ``window_s`` is a straggler: ``check`` names it once
(``Straggling``) and again only after it caught up (``Recovered``) and fell behind anew, so a
warning line and an MLflow tag come once per episode, not once per check.

A rank that stops reporting decays towards 0 steps/s (its rate is measured up to now, not up to
its last report), so a rank stuck in a collective or a data loader is named too. A rank that
has not reported for ``horizon_s`` yet is not judged (it is still starting), and neither is
anyone while fewer than two ranks have a rate: a median of one says nothing.

Pure: times are arguments (monotonic seconds), nothing here reads a clock.

Non-goals: where reports come from and where the warning goes (``_tracking``).
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

#: A rank below this fraction of the median steps/s ...
DEFAULT_STRAGGLER_FRACTION = 0.7
#: ... for this many seconds is a straggler.
DEFAULT_STRAGGLER_WINDOW_S = 60.0
#: At most one check per this many seconds (``due``); a shorter window checks more often.
MAX_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Straggling:
    """``rank`` has trained at ``rate`` steps/s, below ``fraction`` of the ``median``, since
    ``since`` (monotonic seconds)."""

    rank: int
    rate: float
    median: float
    since: float


@dataclass(frozen=True)
class Recovered:
    """``rank``, named a straggler before, is back at or above the threshold."""

    rank: int
    rate: float
    median: float


StragglerEvent = Straggling | Recovered


@dataclass(frozen=True)
class RateSpread:
    """The slowest and the fastest rank's steps/s at one check."""

    slowest_rank: int
    slowest_rate: float
    fastest_rank: int
    fastest_rate: float


class StragglerWatch:
    """Per-rank step rates and straggler episodes (see the module docstring).

    Args:
        fraction: a rank below this fraction of the median rate is behind (0 turns detection
            off; the rates are still measured).
        window_s: how long a rank must stay behind to be named.
        horizon_s: the trailing span each rate is measured over (default: half the window).
    """

    def __init__(
        self,
        fraction: float = DEFAULT_STRAGGLER_FRACTION,
        window_s: float = DEFAULT_STRAGGLER_WINDOW_S,
        horizon_s: float | None = None,
    ) -> None:
        self.fraction = fraction
        self.window_s = window_s
        self.horizon_s = horizon_s if horizon_s is not None else window_s / 2
        self.check_every_s = min(MAX_CHECK_INTERVAL_S, window_s / 4)
        # Per rank: (time, step) points, oldest first; the oldest is the last one at or
        # before the horizon's start once there is one (the rate's base).
        self._points: dict[int, collections.deque[tuple[float, int]]] = {}
        self._behind_since: dict[int, float] = {}
        self._named: set[int] = set()
        self._checked_at: float | None = None
        self.spread: RateSpread | None = None

    def observe(self, rank: int, step: int, now: float) -> None:
        """``rank`` reported ``step`` at ``now``; a step lower than its last (a restart)
        starts its history afresh."""
        points = self._points.get(rank)
        if points is None or (points and step < points[-1][1]):
            points = self._points[rank] = collections.deque()
        points.append((now, step))
        # Keep one point at or before the horizon's start: the base of the rate.
        while len(points) > 1 and points[1][0] <= now - self.horizon_s:
            points.popleft()

    def rate(self, rank: int, now: float) -> float | None:
        """``rank``'s steps/s over the last ``horizon_s`` (None while it has reported for
        less than that, or never)."""
        points = self._points.get(rank)
        if not points:
            return None
        start = now - self.horizon_s
        while len(points) > 1 and points[1][0] <= start:
            points.popleft()
        base_at, base_step = points[0]
        if base_at > start or now <= base_at:
            return None  # not reporting for a whole horizon yet
        return (points[-1][1] - base_step) / (now - base_at)

    def rates(self, now: float) -> dict[int, float]:
        """Every judged rank's rate, by rank."""
        found = {rank: self.rate(rank, now) for rank in self._points}
        return {rank: rate for rank, rate in found.items() if rate is not None}

    def due(self, now: float) -> bool:
        """Whether a ``check`` is due (at most one per ``check_every_s``)."""
        return self._checked_at is None or now - self._checked_at >= self.check_every_s

    def check(self, now: float) -> list[StragglerEvent]:
        """Judge every rank now; the episodes that start (``Straggling``) or end
        (``Recovered``), in rank order. Also updates ``spread``."""
        self._checked_at = now
        rates = self.rates(now)
        if len(rates) < 2:
            self.spread = None
            return []
        slowest = min(rates, key=lambda r: (rates[r], r))
        fastest = max(rates, key=lambda r: (rates[r], -r))
        self.spread = RateSpread(slowest, rates[slowest], fastest, rates[fastest])
        median = statistics.median(rates.values())
        threshold = self.fraction * median
        events: list[StragglerEvent] = []
        for rank in sorted(rates):
            rate = rates[rank]
            if rate < threshold:
                since = self._behind_since.setdefault(rank, now)
                if now - since >= self.window_s and rank not in self._named:
                    self._named.add(rank)
                    events.append(Straggling(rank, rate, median, since))
                continue
            self._behind_since.pop(rank, None)
            if rank in self._named:
                self._named.discard(rank)
                events.append(Recovered(rank, rate, median))
        return events
