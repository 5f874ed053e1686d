"""When an elastic run below its world grows back (pure).

An elastic run (``min_processes``) that lost capacity goes on with fewer ranks. While it runs
below ``num_processes``, the driver asks the cluster every ``GROWTH_POLL_S`` which world its
slots would hold now; once a larger world has fitted for ``grow_after_s`` in a row, the run
drains exactly as for a preemption (every rank stops at the same step and commits a checkpoint
of it) and restarts at that world. "In a row" keeps a host that flaps back for a moment from
costing a drain; the world grown to is the smallest that fitted all along.

Non-goals: counting the slots (the backend's ``world_that_fits``), draining (``run_state``),
placing the restart (which falls back to what fits then, should the capacity vanish again).
"""

from __future__ import annotations

#: How often the driver asks the cluster for its capacity while a run could grow.
GROWTH_POLL_S = 1.0
#: How a drain to grow introduces itself (the drain's why: ``runtime.should_stop()``'s reason).
GROW_NOTICE = "drain to grow: "


class GrowthWatch:
    """Decides, from the worlds that fitted over time, when a run at ``current`` ranks grows.

    ``observe(now, fits)`` after every look: the world to grow to once a world larger than
    ``current`` has fitted for ``grow_after_s`` in a row, else None.
    """

    def __init__(self, current: int, grow_after_s: float) -> None:
        self.current = current
        self.grow_after_s = grow_after_s
        self._since: float | None = None  # when a larger world first fitted, this streak
        self._smallest_fit = 0  # the smallest world that fitted during the streak

    def observe(self, now: float, fits: int) -> int | None:
        if fits <= self.current:
            self._since = None
            return None
        if self._since is None:
            self._since, self._smallest_fit = now, fits
        self._smallest_fit = min(self._smallest_fit, fits)
        if now - self._since >= self.grow_after_s:
            return self._smallest_fit
        return None

    def why(self, grow_to: int, requested: int) -> str:
        """What the run's log and its attempts say about a grow to ``grow_to`` ranks."""
        return (
            f"the cluster has held {grow_to} of the {requested} ranks asked for (this attempt "
            f"runs {self.current}) for {self.grow_after_s:g} s in a row"
        )
