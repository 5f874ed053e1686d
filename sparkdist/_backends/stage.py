"""The barrier stage: the only module that touches ``BarrierTaskContext``.

A barrier task reads its partition id (its node rank), the address of task 0 (``MASTER_ADDR``,
from ``getTaskInfos()``, which costs no barrier sync) and its GPU addresses, then runs the same
agent as local mode and yields one pickled Outcome per rank; Spark's collect brings them back.

Shapes: a classic session without input data runs ``parallelize(range(n)).barrier()
.mapPartitions`` (the cheapest barrier job); a DataFrame input, or any Spark Connect session
(no RDD API there), runs ``mapInArrow(..., barrier=True)``. The agent also gets the task's
``allGather``, used only when the driver's control channel cannot be reached.

Non-goals: driver-side Spark queries (``_spark``); what an agent does (``_agent``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any

from sparkdist._backends import sharding
from sparkdist._backends.job_file import (
    drop_job_copies,
    ended_job_names,
    executor_path,
    holding_job_copy,
)
from sparkdist._backends.session import is_connect
from sparkdist._backends.sharding import ShardedFrame
from sparkdist._core.addresses import task_host
from sparkdist._core.errors import ClusterError, ConfigError
from sparkdist._core.launch.placement import cuda_visible_devices
from sparkdist._core.run.run_state import NO_ROWS
from sparkdist._node.agent.agent import run_agent
from sparkdist._node.agent.spec import AgentSpec


class BarrierStage:
    """One submitted barrier stage, cancellable from another thread.

    Without a DataFrame it is ``parallelize(range(num_tasks)).barrier().mapPartitions``; with
    one it is ``df.mapInArrow(..., barrier=True)`` over the DataFrame repartitioned to one
    partition per task (the shuffle is part of the same job), each task streaming its rows
    to its ranks' files.
    """

    def __init__(
        self,
        session: Any,
        template: AgentSpec,
        num_tasks: int,
        use_gpu: bool,
        dataframe: Any | None = None,
        data_position: tuple[Any, int | None] = (None, None),
    ) -> None:
        self._session = session
        self._data_position = data_position  # a ShardedFrame's: where the epoch stands
        self._template = template
        self._num_tasks = num_tasks
        self._use_gpu = use_gpu
        self._dataframe = dataframe
        self._connect = is_connect(session)
        self.job_group = f"sparkdist-{template.run_id}"
        self._cancelled = threading.Event()
        # Read on the driver now: the tasks remove the executors' copies of these jobs.
        self._ended_jobs = ended_job_names()

    def collect(self) -> list[bytes]:
        """Run the stage on this thread and return every rank's pickled Outcome."""
        if self._connect:
            return self._collect_connect()
        sc = self._session.sparkContext
        sc.setJobGroup(self.job_group, f"sparkdist run {self._template.run_id}", True)
        template, use_gpu, ended = self._template, self._use_gpu, self._ended_jobs

        def task(_: Iterator[Any]) -> Iterator[bytes]:
            return _barrier_task(template, use_gpu, ended)

        try:
            if self._dataframe is not None:
                return self._collect_arrow(self._dataframe)
            rdd = sc.parallelize(range(self._num_tasks), self._num_tasks)
            return list(rdd.barrier().mapPartitions(task).collect())
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)

    def _collect_connect(self) -> list[bytes]:
        # Tags are per thread on a Connect session: this thread tags its own job only.
        self._session.addTag(self.job_group)
        try:
            frame = self._dataframe
            if frame is None:
                frame = self._session.range(self._num_tasks, numPartitions=self._num_tasks)
            return self._collect_arrow(frame)
        finally:
            self._session.removeTag(self.job_group)

    def _collect_arrow(self, frame: Any) -> list[bytes]:
        template, use_gpu, ended = self._template, self._use_gpu, self._ended_jobs
        has_data = self._dataframe is not None  # a plain value: the closure must not hold self
        if isinstance(frame, ShardedFrame):
            frame, plan = sharding.route(
                frame, self._num_tasks, template.processes_per_node, self._data_position
            )
            template = dataclasses.replace(template, data_plan_json=plan.to_json())
        elif has_data:
            # Always repartition (round-robin, in the same job): the number of partitions the
            # optimizer ends up with can differ from what df.rdd reports, and the barrier
            # stage needs exactly one per task.
            frame = frame.repartition(self._num_tasks)
        if has_data:
            # Spark's own schema (ML vectors stay vectors): pyspark's loader reads it per rank.
            template = dataclasses.replace(template, dataframe_schema_json=frame.schema.json())

        def arrow_task(batches: Iterator[Any]) -> Iterator[Any]:
            import pyarrow as pa

            data = batches if has_data else None
            if data is None:
                for _ in batches:  # the placeholder range's rows: nothing to train on
                    pass
            for outcome in _barrier_task(template, use_gpu, ended, data):
                yield pa.RecordBatch.from_pydict({"outcome": [outcome]})

        rows = frame.mapInArrow(arrow_task, "outcome binary", barrier=True).collect()
        if not rows and has_data and frame.isEmpty():
            # Spark 3.5's adaptive execution drops the stage whose input turned out empty
            # (AQEPropagateEmptyRelation), barrier or not: no task ran, no agent could say why.
            raise ConfigError(NO_ROWS)
        return [bytes(row.outcome) for row in rows]

    def cancel(self) -> None:
        """Cancel the stage's tasks (their agents then end their workers)."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self._connect:
            self._session.interruptTag(self.job_group)
        else:
            self._session.sparkContext.cancelJobGroup(self.job_group)


def _barrier_task(
    template: AgentSpec,
    use_gpu: bool,
    ended_jobs: tuple[str, ...],
    batches: Iterator[Any] | None = None,
) -> Iterator[bytes]:
    import cloudpickle
    from pyspark import BarrierTaskContext

    drop_job_copies(ended_jobs)  # copies of ended runs no task of theirs could remove
    context = BarrierTaskContext.get()
    node_rank = context.partitionId()
    hosts = [task_host(info.address) for info in context.getTaskInfos()]
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
        template,
        node_rank=node_rank,
        master_addr=hosts[0],  # a name is resolved by the agent (``_node.host.interfaces``)
        host=hosts[node_rank],
        task_hosts=tuple(hosts),
        gpu_addresses=gpus,
        job_file=executor_path(template.job_file),
    )
    # The last attempt's copy goes as its tasks end, whichever way (none reads it again); an
    # earlier attempt's stays for a restart, and goes at a later task once the run has ended.
    # No barrier meeting decides it: a task killed inside ``allGather`` (a stage cancelled on
    # a timeout or a cancel) ends its whole executor (Spark's TaskKilledException escapes a
    # JVM thread), and the copy stayed anyway.
    with holding_job_copy(spec.job_file, remove=spec.restart_count >= spec.max_restarts):
        outcomes = run_agent(spec, batches, all_gather=context.allGather)
    for outcome in outcomes:
        yield cloudpickle.dumps(outcome)
