"""The barrier slots a restart can count on, for elastic runs (``min_processes``).

After a host is lost, Spark still lists its executor for a moment (a killed JVM is dropped
within about a second of its connection closing) or for minutes (a host cut off is dropped
only at ``spark.network.timeout``). A restart planned on those slots would submit a stage
Spark cannot run, or put a task on an executor that never answers, so the lost executors'
slots are left out of the count. The engine gives them up before the restart
(``give_up_executors``), so the scheduler stops offering them at once; where that failed, a
brief wait for Spark to drop them, then subtracting them if it still lists them. Executors,
not hosts: another executor on the same host (YARN, local-cluster) is healthy capacity. Below
``min_processes`` the restart waits for capacity up to ``start_timeout_s``, then fails with the
numbers it found.

Non-goals: choosing the world size from the slots (``_core.placement.shrink_to_slots``), the
first attempt's wait (``spark_driver.wait_for_barrier_slots``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from sparkdist._backends.spark_driver import count_barrier_slots
from sparkdist._core.errors import ClusterError

logger = logging.getLogger("sparkdist")

#: How long a restart waits for Spark to drop the executors the last attempt lost
#: (a killed executor goes within about a second; one cut off stays listed for minutes).
LOST_EXECUTORS_SETTLE_S = 5.0
#: How often the executor list is read again while waiting (Python sees no event for it).
POLL_S = 0.2


def executor_cores(session: Any) -> dict[str, tuple[int, int]] | None:
    """Cores and running tasks of this application's live executors, by executor id; None
    where this Spark does not say (the internal APIs are missing, or Connect).

    Only executors the scheduler still offers count, as in ``count_barrier_slots``: one given
    up (``give_up_executors``) is listed by the status store until its end is confirmed, which
    from a host cut off never comes."""
    try:
        jsc = session.sparkContext._jsc.sc()
        scheduler = jsc.schedulerBackend()
        summaries = jsc.statusStore().executorList(True)
        cores: dict[str, tuple[int, int]] = {}
        for i in range(summaries.size()):
            summary = summaries.apply(i)
            if summary.id() == "driver" or not scheduler.isExecutorActive(summary.id()):
                continue
            cores[str(summary.id())] = (int(summary.totalCores()), int(summary.activeTasks()))
    except Exception:
        logger.debug("sparkdist: cannot list the executors", exc_info=True)
        return None
    return cores


def executor_slots(session: Any, task_cpus: int) -> dict[str, int] | None:
    """Barrier slots of this application's live executors, by executor id (``executor_cores``);
    None where this Spark does not say."""
    cores = executor_cores(session)
    if cores is None:
        return None
    return {executor: total // max(1, task_cpus) for executor, (total, _) in cores.items()}


def usable_slots(total: int, by_executor: Mapping[str, int] | None, lost: Collection[str]) -> int:
    """The slots left once the lost executors' are taken out (pure)."""
    if not by_executor:
        return total
    return max(0, total - sum(n for executor, n in by_executor.items() if executor in lost))


def wait_for_capacity(
    session: Any,
    *,
    fewest_tasks: int,
    lost_executors: Collection[str],
    task_cpus: int,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """The barrier slots a restart can use, once there are at least ``fewest_tasks`` of them.

    Raises:
        ClusterError: fewer than ``fewest_tasks`` after ``wait_s``, with the numbers found.
    """
    started = clock()
    while lost_executors and clock() - started < LOST_EXECUTORS_SETTLE_S:
        listed = executor_slots(session, task_cpus)
        if listed is None or not set(listed) & set(lost_executors):
            break
        time.sleep(POLL_S)
    said_waiting = False
    while True:
        counted = count_barrier_slots(session)
        if counted is None:  # a Spark that does not say: let its own check decide
            return fewest_tasks
        found = usable_slots(counted[0], executor_slots(session, task_cpus), lost_executors)
        waited_s = clock() - started
        if found >= fewest_tasks:
            return found
        if waited_s >= wait_s:
            lost = f" (leaving out the lost executor(s) {', '.join(sorted(lost_executors))})"
            raise ClusterError(
                f"the restart needs at least {fewest_tasks} barrier task slot(s) (min_processes) "
                f"but found {found}{lost if lost_executors else ''} after waiting {waited_s:.1f} s "
                "(start_timeout_s); add executors, or lower min_processes"
            )
        if not said_waiting:
            said_waiting = True
            logger.warning(
                "sparkdist: the restart waits for capacity: %d of at least %d task slot(s) "
                "(up to start_timeout_s=%g s)",
                found,
                fewest_tasks,
                wait_s,
            )
        time.sleep(POLL_S)
