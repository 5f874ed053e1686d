"""What one node runs: the ``AgentSpec`` the driver builds and each agent receives.

It crosses a process boundary (pickled into the Spark task; passed as is in local mode), so it
is a frozen dataclass of plain values (DESIGN.md rule 3).

Non-goals: building it (``_engine.launch``), acting on it (``agent``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sparkdist._core.versions import Requirement


@dataclass(frozen=True)
class AgentSpec:
    """Everything one agent needs; pickled into the Spark task (or passed in local mode).

    Attributes:
        run_id: the run's id.
        job_bytes: the pickled Job.
        node_rank: this node's index; its ranks are node_rank * processes_per_node + i.
        num_nodes: nodes in the run.
        processes_per_node: ranks this node runs.
        master_addr: host of rank 0, where the store lives, as Spark reports it (a name is
            resolved on the node: ``interfaces``).
        host: this node's host, for messages.
        task_hosts: every barrier task's host as Spark reports it, in task order (empty in
            local mode): the peers this node routes toward to find its own address.
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
    system_metrics_interval_s: float = 0.0
    task_hosts: tuple[str, ...] = ()
