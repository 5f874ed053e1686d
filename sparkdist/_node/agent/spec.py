"""What one node runs: the ``AgentSpec`` the driver builds and each agent receives.

It crosses a process boundary (pickled into the Spark task; passed as is in local mode), so it
is a frozen dataclass of plain values (DESIGN.md rule 3).

Non-goals: building it (``_engine.launch``), acting on it (``agent``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from sparkdist._core.env import RankSeat
from sparkdist._core.launch.numbering import (
    host_groups,
    host_visible_devices,
    seats_of_placeholder_hosts,
    seats_of_task,
)
from sparkdist._core.versions import Requirement
from sparkdist._wire import protocol


@dataclass(frozen=True)
class AgentSpec:
    """Everything one agent needs; pickled into the Spark task (or passed in local mode).

    Attributes:
        run_id: the run's id.
        job_bytes: the pickled Job.
        node_rank: this agent's index: its barrier task's partition id (0 in local mode). The
            driver and the control channel call an agent a node; the ranks' ``NODE_RANK`` is
            their *host's* index instead (``seats``, ``_core.numbering``).
        num_nodes: agents (barrier tasks) in the run.
        processes_per_node: ranks this node runs.
        master_addr: host of rank 0, where the store lives, as Spark reports it (a name is
            resolved on the node: ``interfaces``).
        host: this node's host, for messages.
        task_hosts: every barrier task's host as Spark reports it, in task order (empty in
            local mode): the peers this node routes toward to find its own address, and what
            numbers the ranks host by host.
        channel_address: (host, port) of the driver's control channel.
        secret: the run's channel secret.
        gpu_addresses: CUDA_VISIBLE_DEVICES for the ranks, or None for CPU.
        mode: the launch mode's name.
        start_timeout_s: how long workers wait for the rendezvous.
        extra_env: variables to add to every rank's environment.
        restart_count: how many times the run restarted so far.
        max_restarts: how many restarts the run allows.
        gpu_type: when set, the GPUs of this node must be of this type, or no rank starts.
        deepspeed_config_json: the DeepSpeed config, written into the run directory for the
            ranks (and removed with it).
        heartbeat_timeout_s: a joined rank silent (no report, no beat) for this long is hung.
        requirements: package versions this node must have, or no rank starts (``_versions``).
        code_zip: the sources of the local modules the job uses (``_shipping``), unpacked into
            the run directory and put first on the ranks' ``PYTHONPATH``.
        job_file: a file on this node holding the pickled Job, used instead of ``job_bytes``
            (a large job, shipped with ``SparkContext.addFile``; see ``_captures``).
        system_metrics_interval_s: seconds between two system samples (``sampler``); 0: none.
        dataframe_schema_json: with DataFrame input, its Spark schema as JSON, written into the
            run directory for pyspark's partition loader (``SPARK_DATAFRAME_SCHEMA_FILE``).
        data_plan_json: with a sharded DataFrame (``sparkdist.data.sharded``), the attempt's
            ``DataPlan``: which shards each rank's file holds, written into those files.
    """

    run_id: str
    job_bytes: bytes
    node_rank: int
    num_nodes: int
    processes_per_node: int
    master_addr: str
    host: str
    channel_address: tuple[str, int]
    secret: str
    gpu_addresses: str | None
    mode: str
    start_timeout_s: float
    extra_env: Mapping[str, str] = field(default_factory=dict)
    restart_count: int = 0
    max_restarts: int = 0
    gpu_type: str | None = None
    deepspeed_config_json: str | None = None
    heartbeat_timeout_s: float | None = None
    requirements: tuple[Requirement, ...] = ()
    code_zip: bytes | None = None
    job_file: str | None = None
    dataframe_schema_json: str | None = None
    data_plan_json: str | None = None
    system_metrics_interval_s: float = 0.0
    task_hosts: tuple[str, ...] = ()

    def seats(self) -> list[RankSeat]:
        """The ranks this agent runs, numbered host by host over every task's host."""
        if self.task_hosts:
            return seats_of_task(self.node_rank, self.task_hosts, self.processes_per_node)
        placeholder = seats_of_placeholder_hosts(self.num_nodes, self.processes_per_node)
        return placeholder[self.node_rank]

    def rendezvous_for_ranks(self, message: protocol.Rendezvous) -> protocol.Rendezvous | str:
        """The rendezvous as this node's ranks get it: with every GPU of the tasks on its host
        in local-rank order (``CUDA_VISIBLE_DEVICES``: ``cuda:LOCAL_RANK`` is then the rank's
        own GPU, and NCCL sees its peers on the host, as under torchrun). A string instead
        says why that cannot be: a task on this host named no GPUs.
        """
        if self.gpu_addresses is None or not self.task_hosts:
            return message  # CPU, or local mode: one task, its GPUs already the host's
        (host_tasks,) = [t for t in host_groups(self.task_hosts) if self.node_rank in t]
        gpus = {**message.task_gpus, self.node_rank: self.gpu_addresses}
        missing = [t for t in host_tasks if not gpus.get(t)]
        if missing:
            return (
                f"task(s) {missing} on {self.host} named no GPUs, so the GPUs of this host "
                "cannot be made visible in local-rank order; every task of a GPU run needs "
                "spark.task.resource.gpu.amount GPUs"
            )
        every = [gpus.get(task, "") for task in range(len(self.task_hosts))]
        visible = host_visible_devices(self.node_rank, self.task_hosts, every)
        if visible is None:
            return message  # isolated executors: each rank keeps its task's GPUs (driver warns)
        return dataclasses.replace(message, visible_devices=visible)
