"""Warm worker pools on the executors a restart may land on.

A restart goes to the executors Spark offers then. One where no rank of the run ran starts
cold: Spark's Python worker, the agent's imports, and a zygote importing torch (and, for a run
that checkpoints, what a restarted rank loads): seconds on the restart's path, most of what a
lost host costs once the rest is fast. So while an attempt of a run that may restart runs,
every ``WARM_EVERY_S`` one small non-barrier job puts a task on each executor that has a free
slot and none of the attempt's tasks (the scheduler hands a job's tasks out one per executor
in turn); each task starts, in the background, the zygote the run's ranks would fork from there
(``_node.agent.ranks.warm_pool``) and returns at once. Spark closes a Python worker idle for a
minute, its zygote with it: the period keeps them.

The first job waits until every task of the attempt runs (a warm task must never hold a slot
its barrier stage waits for). A job in flight is never cancelled (Spark kills the Python worker
of a killed task, its zygote with it) nor waited for: ``stop`` returns at once, and the job's
tasks, which return at once, end on their own.

Non-goals: the zygote and its key (``_node.pool``); Connect sessions (no executor list, no RDD).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from sparkdist._backends.capacity import executor_cores
from sparkdist._backends.spark_driver import task_executors
from sparkdist._core.env import CHECKPOINT_DIR_VAR
from sparkdist._node.agent.spec import AgentSpec

logger = logging.getLogger("sparkdist")

#: How often the executors without a rank are warmed again (Spark closes a Python worker that
#: was idle for a minute).
WARM_EVERY_S = 30.0
#: How often the warmer looks whether every task of the attempt runs yet.
POLL_S = 0.5


def may_restart(template: AgentSpec) -> bool:
    """Whether an attempt of this run may be followed by another: restarts allowed, or
    checkpoints to restart from after a preemption or a grow."""
    return template.max_restarts > 0 or bool(template.extra_env.get(CHECKPOINT_DIR_VAR))


def idle_executors(
    executors: Mapping[str, tuple[int, int]], busy: Collection[str], task_cpus: int
) -> list[str]:
    """The executors to warm: a free slot (``executors``: id -> cores, running tasks) and none
    of the attempt's tasks (``busy``), whose pools its ranks keep warm already."""
    need = max(1, task_cpus)
    return sorted(
        executor
        for executor, (cores, running) in executors.items()
        if executor not in busy and cores - running * need >= need
    )


class PoolWarmer:
    """Warms the pools of the executors without a task of one attempt, until ``stop``."""

    def __init__(
        self, session: Any, template: AgentSpec, stage_group: str, num_tasks: int, task_cpus: int
    ) -> None:
        self._session = session
        self._template = template
        self._stage_group = stage_group
        self._num_tasks = num_tasks
        self._task_cpus = task_cpus
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"sparkdist-warm-{template.run_id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Warm no more (a job in flight ends on its own)."""
        self._stopped.set()

    def _run(self) -> None:
        ran_on: dict[int, str] = {}
        while len(ran_on) < self._num_tasks:  # every task of the attempt runs first
            if self._stopped.wait(POLL_S):
                return
            try:
                ran_on = task_executors(self._session, self._stage_group)
            except Exception:  # noqa: BLE001 - a developer API: no warming without it
                logger.debug("sparkdist: cannot list the tasks' executors", exc_info=True)
                return
        busy = set(ran_on.values())
        while not self._stopped.is_set():
            try:
                self._warm(busy)
            except Exception:  # noqa: BLE001 - only a head start for a restart
                logger.debug("sparkdist: warming the executors' pools failed", exc_info=True)
            if self._stopped.wait(WARM_EVERY_S):
                return

    def _warm(self, busy: Collection[str]) -> None:
        executors = executor_cores(self._session)
        idle = [] if executors is None else idle_executors(executors, busy, self._task_cpus)
        if not idle:
            return
        sc = self._session.sparkContext
        # A group of its own: the stage's group names the attempt's newest job (the tasks'
        # executors are read from it), and cancelling the attempt must not kill these tasks.
        sc.setJobGroup(f"{self._stage_group}-warm", "sparkdist: warm pools for a restart", False)
        run_env = dict(self._template.extra_env)  # all a zygote's key needs (not the job)

        def task(_: Iterator[Any]) -> Iterator[int]:
            from sparkdist._node.agent.ranks import warm_pool

            warm_pool(run_env)
            return iter(())

        try:
            sc.parallelize(range(len(idle)), len(idle)).mapPartitions(task).collect()
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
