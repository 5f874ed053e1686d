"""Everything that talks to Spark: conf, slots, session creation, and the barrier stage itself.

This is the only module that touches ``BarrierTaskContext``. A barrier task reads its partition
id (its node rank), the address of task 0 (``MASTER_ADDR``, from ``getTaskInfos()``, which costs
no barrier sync) and its GPU addresses, then runs the same agent as local mode and yields one
pickled Outcome per rank; Spark's collect brings them back to the driver.

Non-goals: deciding placement (``_placement``); Spark Connect sessions (not yet supported).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from sparkdist._agent import AgentSpec, run_agent
from sparkdist._errors import ClusterError, ConfigError
from sparkdist._placement import check_barrier_slots, cuda_visible_devices

logger = logging.getLogger("sparkdist")

#: How long to wait for executors to register before declaring the cluster too small.
SLOT_WAIT_S = 20.0


def active_session() -> Any | None:
    """The active classic SparkSession, or None (pyspark not installed counts as None)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return None
    session = SparkSession.getActiveSession()
    _refuse_connect(session)
    return session


def get_or_create_session() -> Any:
    """The active session, or a new one that uses this interpreter on its executors."""
    session = active_session()
    if session is not None:
        return session
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ConfigError(
            "local_mode=False needs pyspark; install it (pip install 'sparkdist[spark]') or "
            "pass local_mode=True"
        ) from exc
    # Executors must run the driver's interpreter, or every import of the job fails there.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.appName("sparkdist")
        .config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    return session


def _refuse_connect(session: Any) -> None:
    if session is not None and not hasattr(session, "sparkContext"):
        raise ConfigError(
            "this is a Spark Connect session, which sparkdist cannot launch on yet; use a "
            "classic SparkSession, or local_mode=True to train on this machine"
        )
    if session is not None:
        try:
            session.sparkContext  # noqa: B018 - raises on Connect sessions of pyspark >= 4
        except Exception as exc:
            raise ConfigError(
                "this is a Spark Connect session, which sparkdist cannot launch on yet; use a "
                "classic SparkSession, or local_mode=True to train on this machine"
            ) from exc


def spark_conf(session: Any) -> dict[str, str]:
    """The session's Spark conf as plain strings."""
    return {str(k): str(v) for k, v in session.sparkContext.getConf().getAll()}


def driver_gpu_addresses(session: Any | None) -> list[str] | None:
    """GPU addresses Spark assigned to the driver, or None when Spark assigned none."""
    if session is None:
        return None
    resources = session.sparkContext.resources
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else None


def driver_host(session: Any) -> str:
    """The address executors reach the driver at."""
    return str(session.sparkContext.getConf().get("spark.driver.host", "127.0.0.1"))


def wait_for_barrier_slots(session: Any, needed: int, wait_s: float | None = None) -> int:
    """Return the cluster's barrier slots once there are enough, or raise ClusterError.

    Executors register after the session starts (local-cluster, standalone), so a too-small
    count is re-read for a few seconds before it is final; Spark's own check would wait minutes.
    """
    jsc = session.sparkContext._jsc.sc()
    deadline = time.monotonic() + (SLOT_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            profile = jsc.resourceProfileManager().defaultResourceProfile()
            found = int(jsc.maxNumConcurrentTasks(profile))
        except Exception:  # a Spark without this internal API: let Spark check at submission
            logger.debug("sparkdist: cannot count barrier slots", exc_info=True)
            return needed
        if found >= needed or time.monotonic() >= deadline:
            break
        time.sleep(0.1)  # executors register asynchronously; there is no event to wait on
    check_barrier_slots(needed, found, jsc.master())
    return found


class BarrierStage:
    """One submitted barrier stage, cancellable from another thread.

    Without a DataFrame it is ``parallelize(range(num_tasks)).barrier().mapPartitions``; with
    one it is ``df.mapInArrow(..., barrier=True)`` over the DataFrame repartitioned to one
    partition per task (the shuffle is part of the same job), each task streaming its rows
    to its ranks' files.
    """

    def __init__(
        self, session: Any, template: AgentSpec, num_tasks: int, use_gpu: bool,
        dataframe: Any | None = None,
    ) -> None:
        self._session = session
        self._template = template
        self._num_tasks = num_tasks
        self._use_gpu = use_gpu
        self._dataframe = dataframe
        self.job_group = f"sparkdist-{template.run_id}"
        self._cancelled = threading.Event()

    def collect(self) -> list[bytes]:
        """Run the stage on this thread and return every rank's pickled Outcome."""
        sc = self._session.sparkContext
        sc.setJobGroup(self.job_group, f"sparkdist run {self._template.run_id}", True)
        template, use_gpu = self._template, self._use_gpu

        def task(_: Iterator[Any]) -> Iterator[bytes]:
            return _barrier_task(template, use_gpu)

        def arrow_task(batches: Iterator[Any]) -> Iterator[Any]:
            import pyarrow as pa

            for outcome in _barrier_task(template, use_gpu, batches):
                yield pa.RecordBatch.from_pydict({"outcome": [outcome]})

        try:
            if self._dataframe is not None:
                # Always repartition (round-robin, in the same job): the number of partitions
                # the optimizer ends up with can differ from what df.rdd reports, and the
                # barrier stage needs exactly one per task.
                frame = self._dataframe.repartition(self._num_tasks)
                rows = frame.mapInArrow(arrow_task, "outcome binary", barrier=True).collect()
                return [bytes(row.outcome) for row in rows]
            rdd = sc.parallelize(range(self._num_tasks), self._num_tasks)
            return list(rdd.barrier().mapPartitions(task).collect())
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)

    def cancel(self) -> None:
        """Cancel the stage's tasks (their agents then end their workers)."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._session.sparkContext.cancelJobGroup(self.job_group)


def _barrier_task(
    template: AgentSpec, use_gpu: bool, batches: Iterator[Any] | None = None
) -> Iterator[bytes]:
    import cloudpickle
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    node_rank = context.partitionId()
    hosts = [info.address.rsplit(":", 1)[0] for info in context.getTaskInfos()]
    gpus = None
    if use_gpu:
        resource = context.resources().get("gpu")
        if resource is None or not resource.addresses:
            raise ClusterError(
                f"barrier task {node_rank} on {hosts[node_rank]} got no GPU from Spark; set "
                "spark.executor.resource.gpu.amount and a discovery script on the executors"
            )
        gpus = cuda_visible_devices(
            list(resource.addresses), os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    spec = dataclasses.replace(
        template, node_rank=node_rank, master_addr=hosts[0], host=hosts[node_rank],
        gpu_addresses=gpus,
    )
    for outcome in run_agent(spec, batches):
        yield cloudpickle.dumps(outcome)
