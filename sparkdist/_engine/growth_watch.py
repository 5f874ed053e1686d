"""The driver's growth watch: while an elastic attempt runs below the world asked for, ask
the backend every ``GROWTH_POLL_S`` what world the cluster holds now, and drain the attempt
(as for a preemption) once a larger one has fitted for ``grow_after_s`` in a row
(``_core.run.growth`` decides). The supervisor then restarts it at the larger world.

Non-goals: the rule (``_core.run.growth``), the drain (``run_state``), the restart's
placement (``Backend.place_again``: what fits then, should the capacity vanish again).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from sparkdist._backends.base import Backend
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import Placement
from sparkdist._core.run.growth import GROW_NOTICE, GROWTH_POLL_S, GrowthWatch

logger = logging.getLogger("sparkdist")


class _Drainable(Protocol):
    """What the watch needs of an attempt (``_engine.launch._Attempt``)."""

    placement: Placement
    ended: threading.Event
    grow_notice: str | None

    def drain(self, why: str) -> None: ...


def start_growth_watch(
    config: LaunchConfig, backend: Backend, attempt: _Drainable, run_id: str
) -> threading.Thread:
    """Watch ``attempt`` on a daemon thread until it ends or drains to grow."""
    thread = threading.Thread(
        target=_watch, args=(config, backend, attempt), name=f"sparkdist-grow-{run_id}", daemon=True
    )
    thread.start()
    return thread


def _watch(config: LaunchConfig, backend: Backend, attempt: _Drainable) -> None:
    assert config.grow_after_s is not None
    watch = GrowthWatch(attempt.placement.world_size, config.grow_after_s)
    while not attempt.ended.wait(GROWTH_POLL_S):
        try:
            fits = backend.world_that_fits(config)
        except Exception:  # noqa: BLE001 - a look that failed: the next one may not
            logger.debug("sparkdist: cannot count the cluster's slots", exc_info=True)
            continue
        if fits is None:
            return  # a backend that cannot say: the run stays at its size
        grow_to = watch.observe(time.monotonic(), fits)
        if grow_to is not None:
            attempt.grow_notice = GROW_NOTICE + watch.why(grow_to, config.num_processes)
            attempt.drain(attempt.grow_notice)
            return
