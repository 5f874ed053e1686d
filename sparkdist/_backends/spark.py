"""Spark mode: one agent per task of a barrier stage, on a classic session or Spark Connect.

The session's conf decides the placement (one task per rank, or k ranks per task with k GPUs
per task); the executors' slots are waited for (up to ``start_timeout_s``); the driver's host
is where agents reach the control channel. A Spark Connect session differs only in how the
conf is read and how the stage is shaped (``stage``); ``ConnectBackend`` names it.

Non-goals: the barrier task (``stage``), the driver's Spark queries (``spark_driver``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

from sparkdist._backends import capacity, sharding, spark_driver
from sparkdist._backends.base import RunningAgents
from sparkdist._backends.decommission import DECOMMISSION_KEY, DecommissionWatch
from sparkdist._backends.pool_warmer import PoolWarmer, may_restart
from sparkdist._backends.stage import BarrierStage
from sparkdist._core.env import CONTROL_CHANNEL_VAR
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.placement import (
    TORCH_IGNORE_SSL_KEY,
    Placement,
    check_cluster_conf,
    place_on_cluster,
    shrink_to_slots,
)
from sparkdist._core.launch.plan import BackendKind
from sparkdist._core.object_store import encode_options
from sparkdist._core.versions import Requirement
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._wire.payload import loads

logger = logging.getLogger("sparkdist")

_warned: set[str] = set()
#: Values of SPARKDIST_CONTROL_CHANNEL that turn the channel off.
_OFF = ("0", "off", "false")


class SparkBackend:
    """Ranks as the tasks of one Spark barrier stage on a classic session."""

    kind = BackendKind.SPARK
    ships_large_jobs = True

    def __init__(
        self,
        session: Any,
        *,
        ignore_ssl_key: str = TORCH_IGNORE_SSL_KEY,
        dataframe: Any | None = None,
    ) -> None:
        self.session = session  # chosen by ``choose.select_backend``
        self.dataframe = dataframe
        self._ignore_ssl_key = ignore_ssl_key
        self.driver_host = ""
        # SPARKDIST_CONTROL_CHANNEL=off says the executors cannot reach this process.
        self.detached = os.environ.get(CONTROL_CHANNEL_VAR, "").strip().lower() in _OFF
        self._watches_decommission = False  # spark.decommission.enabled, read by ``place``
        self._task_cpus = 1  # spark.task.cpus, read by ``place``
        self._last_stage: BarrierStage | None = None  # the attempt ``give_up_nodes`` is about
        self._checkpoints: tuple[str | None, str] = (None, "")  # where a data position is kept

    def place(self, config: LaunchConfig) -> Placement:
        self._checkpoints = (config.checkpoint_dir, encode_options(config.storage_options))
        conf = spark_driver.spark_conf(self.session, (self._ignore_ssl_key, DECOMMISSION_KEY))
        for warning in check_cluster_conf(conf, self._ignore_ssl_key):
            _warn_once(warning)
        placement = place_on_cluster(config, conf)
        found = spark_driver.wait_for_barrier_slots(
            self.session,
            placement.num_tasks,
            config.start_timeout_s,
            conf,
            fewest=_fewest_tasks(config, placement),
        )
        self.driver_host = spark_driver.driver_host(self.session, conf)
        task_cpus = conf.get("spark.task.cpus", "1")
        self._task_cpus = int(task_cpus) if task_cpus.isdigit() else 1
        # Connect reaches no scheduler: its decommissioned executors' Python workers are
        # shut down in the end, which the agents hear (SIGHUP) as a notice.
        self._watches_decommission = self.kind is BackendKind.SPARK and _is_true(
            conf.get(DECOMMISSION_KEY)
        )
        return _shrunk(config, placement, found)

    def place_again(self, config: LaunchConfig, lost_nodes: Collection[int]) -> Placement:
        conf = spark_driver.spark_conf(self.session, (self._ignore_ssl_key,))
        full = place_on_cluster(config, conf)
        if config.min_processes is None or self.kind is BackendKind.CONNECT:
            return full  # a fixed world (or a Connect session, which lists no executors)
        found = capacity.wait_for_capacity(
            self.session,
            fewest_tasks=_fewest_tasks(config, full),
            lost_executors=self._executors_of(lost_nodes),
            task_cpus=self._task_cpus,
            wait_s=config.start_timeout_s,
        )
        return _shrunk(config, full, found)

    def requirements(
        self, config: LaunchConfig, wanted: Sequence[Requirement]
    ) -> tuple[Requirement, ...]:
        return tuple(wanted)  # every agent checks its own interpreter before it spawns

    def rank_env(self, config: LaunchConfig) -> dict[str, str]:
        return {}

    def visible_code_dirs(self) -> Sequence[str]:
        return ()

    def start(
        self,
        template: AgentSpec,
        placement: Placement,
        on_done: Callable[[], None],
        on_decommission: Callable[[str], None],
    ) -> RunningAgents:
        position = (
            sharding.data_position(*self._checkpoints)
            if isinstance(self.dataframe, sharding.ShardedFrame)
            else (None, None)
        )
        stage = BarrierStage(
            self.session, template, placement.num_tasks, placement.use_gpu, self.dataframe, position
        )
        self._last_stage = stage
        watch = (
            DecommissionWatch(
                self.session, on_decommission, f"sparkdist-decommission-{template.run_id}"
            )
            if self._watches_decommission
            else None
        )

        warmer = (
            PoolWarmer(
                self.session, template, stage.job_group, placement.num_tasks, self._task_cpus
            )
            if self.kind is BackendKind.SPARK and may_restart(template)
            else None
        )

        def done() -> None:
            if watch is not None:
                watch.stop()
            if warmer is not None:
                warmer.stop()
            on_done()

        return RunningAgents(
            f"sparkdist-run-{template.run_id}",
            lambda: [loads(row) for row in stage.collect()],
            done,
            cancel=stage.cancel,
            goodbye_before_cancel=True,
        )

    def world_that_fits(self, config: LaunchConfig) -> int | None:
        counted = spark_driver.count_barrier_slots(self.session)
        if counted is None:
            return None
        conf = spark_driver.spark_conf(self.session, (self._ignore_ssl_key,))
        placement = shrink_to_slots(config, place_on_cluster(config, conf), counted[0])
        return 0 if placement is None else placement.world_size

    def _executors_of(self, nodes: Collection[int]) -> set[str]:
        """The executors the last attempt's ``nodes`` ran on, as far as Spark says: none where
        its status store does not (a developer API), and the restart counts what is offered."""
        if self._last_stage is None or not nodes:
            return set()
        try:
            ran_on = spark_driver.task_executors(self.session, self._last_stage.job_group)
        except Exception:  # noqa: BLE001 - a restart must not fail for want of this listing
            logger.debug("sparkdist: cannot list the tasks' executors", exc_info=True)
            return set()
        return {ran_on[n] for n in nodes if n in ran_on}

    def give_up_nodes(self, nodes: set[int]) -> None:
        if self._last_stage is None:
            return
        try:
            given_up = spark_driver.give_up_executors(self.session, self._executors_of(nodes))
        except Exception as exc:  # noqa: BLE001 - a developer API: the run goes on without it
            logger.warning(
                "sparkdist: could not give up the executors of node(s) %s: %s", nodes, exc
            )
            return
        if given_up:
            logger.warning(
                "sparkdist: executor(s) %s given up: the next attempt does not use them (the "
                "cluster manager may start new ones, on the same hosts too)",
                ", ".join(given_up),
            )


class ConnectBackend(SparkBackend):
    """The same stage through a Spark Connect session (``mapInArrow``; conf read key by key;
    slots estimated from the conf; ``allGather`` when the driver's channel is unreachable)."""

    kind = BackendKind.CONNECT

    def world_that_fits(self, config: LaunchConfig) -> int | None:
        """A Connect client lists no executors: the run stays at its size."""
        return None

    def give_up_nodes(self, nodes: set[int]) -> None:
        # A Connect client reaches no SparkContext: the server's scheduler decides alone.
        logger.warning(
            "sparkdist: a Spark Connect session cannot give up the executors of node(s) %s, "
            "so the next attempt may run there again",
            ", ".join(map(str, sorted(nodes))),
        )


def _fewest_tasks(config: LaunchConfig, full: Placement) -> int:
    """The fewest tasks an attempt of ``config`` may run as (its whole world unless elastic)."""
    return -(-config.smallest_world // full.processes_per_task)  # ceiling


def _shrunk(config: LaunchConfig, full: Placement, slots: int) -> Placement:
    """``full``, or the elastic world ``slots`` hold (logged when it is smaller)."""
    placement = shrink_to_slots(config, full, slots)
    if placement is None:  # the waits above raise first; a Spark that counts no slots lands here
        return full
    if placement.world_size < full.world_size:
        logger.warning(
            "sparkdist: the cluster has %d barrier task slot(s): running %d of the %d "
            "process(es) asked for (min_processes=%d)",
            slots,
            placement.world_size,
            full.world_size,
            config.smallest_world,
        )
    return placement


def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def _warn_once(message: str) -> None:
    """Cluster-wide concerns are said once per driver process, not on every run."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("sparkdist: %s", message)
