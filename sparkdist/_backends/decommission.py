"""Spark's decommissioning as a preemption notice (``spark.decommission.enabled``).

A cluster manager that is about to take a node back can tell Spark first (standalone Workers
and executors on SIGPWR, Kubernetes through the pod's pre-stop hook, YARN on node
decommission). Spark then marks the executor decommissioning on the driver, within
milliseconds, and stops giving it new tasks; but a running barrier task hears nothing, and its
Python worker gets no signal (measured in the lab). So the driver watches: every second it asks
the scheduler which of the application's executors are decommissioning, and a node of the run
on such a host starts the same drain as a SIGTERM would (docs/restarts.md, preemption).

Non-goals: the drain itself (``_engine``, ``_node.rank.drain``); giving the executor up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("sparkdist")

#: The conf key that turns Spark's decommissioning on.
DECOMMISSION_KEY = "spark.decommission.enabled"
#: How often the driver asks which executors are decommissioning.
WATCH_INTERVAL_S = 1.0


def decommissioning_hosts(session: Any) -> set[str] | None:
    """Hosts of this application's executors that Spark is decommissioning; None where this
    Spark does not say (the internal APIs are missing)."""
    try:
        context = session.sparkContext._jsc.sc()
        scheduler = context.taskScheduler()
        summaries = context.statusStore().executorList(True)
        hosts = set()
        for i in range(summaries.size()):
            summary = summaries.apply(i)
            if summary.id() == "driver":
                continue
            if scheduler.getExecutorDecommissionState(summary.id()).isDefined():
                hosts.add(str(summary.hostPort()).rsplit(":", 1)[0])
    except Exception:
        logger.debug("sparkdist: cannot read executors' decommission state", exc_info=True)
        return None
    return hosts


class DecommissionWatch:
    """A thread that calls ``on_host(host)`` once for each host whose executor Spark starts
    decommissioning, until ``stop()``; it ends by itself where Spark does not say."""

    def __init__(self, session: Any, on_host: Callable[[str], None], name: str) -> None:
        self._session = session
        self._on_host = on_host
        self._stopped = threading.Event()
        self._seen: set[str] = set()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_INTERVAL_S):
            hosts = decommissioning_hosts(self._session)
            if hosts is None:
                return
            for host in sorted(hosts - self._seen):
                self._seen.add(host)
                try:
                    self._on_host(host)
                except Exception:  # noqa: BLE001 - the watch must outlive a failed notice
                    logger.warning("sparkdist: a decommission notice failed", exc_info=True)

    def stop(self) -> None:
        self._stopped.set()
