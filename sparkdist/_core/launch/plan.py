"""A launch plan: everything a run will do, decided before any process starts.

``make_plan`` is a pure function of the validated config, the placement (the cluster's
description) and what the job weighs: which backend runs the agents, how ranks sit on nodes,
the environment each rank gets from sparkdist, where its GPUs come from, the deadlines and how
the job travels. ``LaunchPlan.describe`` prints it (``sparkdist run --dry-run``); the launcher
starts a run by executing a plan.

Non-goals: reading Spark conf or the driver's GPUs (the caller passes the placement), starting
anything.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sparkdist._core.addresses import is_loopback
from sparkdist._core.env import (
    CHECKPOINT_DIR_VAR,
    SOCKET_IFNAME_VARS,
    STORAGE_OPTIONS_VAR,
    RankSeat,
    worker_env,
)
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.numbering import seats_of_placeholder_hosts
from sparkdist._core.launch.placement import Placement
from sparkdist._core.object_store import encode_options

#: Stands for values only known once the run starts (rank 0's store port, the run id...).
LATER = "<at start>"
#: Stands for the interface a node decides at start (``_node.host.interfaces``).
NODE_INTERFACE = "<the interface holding the node's address>"


class BackendKind(str, enum.Enum):
    """Where the agents run."""

    LOCAL = "local"  # one agent on a thread of the driver process
    SPARK = "spark"  # one agent per task of a classic Spark barrier stage
    CONNECT = "connect"  # one agent per task of a Spark Connect barrier stage (mapInArrow)


@dataclass(frozen=True)
class RankPlan:
    """One rank: its seat, its GPUs, and the variables sparkdist sets for it."""

    seat: RankSeat
    gpus: str
    env: Mapping[str, str]


@dataclass(frozen=True)
class LaunchPlan:
    """What a run will do; printable, and equal for equal inputs.

    Attributes:
        backend: where the agents run.
        job_name: the function, script or module being run.
        placement: tasks, ranks per task, GPU use.
        ranks: every rank in global-rank order.
        mode_settings: the launch mode and its settings (ZeRO stage, offload).
        start_timeout_s / timeout_s / heartbeat_timeout_s / max_restarts: the run's limits.
        job_size_bytes: the pickled job's size.
        job_as_file: whether the job travels as a Spark file (large jobs) instead of inside
            each task.
        requirements: package versions every node must have, as "name==version".
        user_env: the user's variables, applied to every rank.
        network: what the ranks use to reach each other (loopback, or each node's interface).
    """

    backend: BackendKind
    job_name: str
    placement: Placement
    ranks: tuple[RankPlan, ...]
    mode_settings: Mapping[str, object]
    start_timeout_s: float
    timeout_s: float | None
    heartbeat_timeout_s: float | None
    max_restarts: int
    job_size_bytes: int
    job_as_file: bool
    requirements: tuple[str, ...] = ()
    user_env: Mapping[str, str] = field(default_factory=dict)
    network: str = ""

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    def describe(self) -> str:
        """The plan as a few lines of text, for people (``sparkdist run --dry-run``)."""
        p = self.placement
        settings = ", ".join(f"{k}={v}" for k, v in self.mode_settings.items())
        lines = [
            f"plan: {self.job_name} on {p.world_size} rank(s), {settings}",
            f"  backend: {self.backend.value}; {p.num_tasks} node(s) x "
            f"{p.processes_per_task} rank(s); {'GPU' if p.use_gpu else 'CPU (gloo)'}",
            f"  limits: start_timeout_s={self.start_timeout_s:g}, timeout_s="
            f"{'none' if self.timeout_s is None else f'{self.timeout_s:g}'}, "
            f"heartbeat_timeout_s={'off' if self.heartbeat_timeout_s is None else f'{self.heartbeat_timeout_s:g}'}"  # noqa: E501
            f", max_restarts={self.max_restarts}",
            f"  job: {_size(self.job_size_bytes)}"
            + (", shipped as a Spark file" if self.job_as_file else ", inside each task"),
        ]
        if self.network:
            lines.append(f"  network: {self.network}")
        if self.requirements:
            lines.append(f"  every node must have: {', '.join(self.requirements)}")
        if self.user_env:
            lines.append(f"  user env: {', '.join(sorted(self.user_env))}")
        lines.append(
            "  ranks:"
            if self.backend is BackendKind.LOCAL
            else "  ranks (as if each task had a host of its own; at launch they are numbered "
            "host by host, tasks on one host getting consecutive ranks):"
        )
        for rank in self.ranks:
            seat = rank.seat
            lines.append(
                f"    rank {seat.rank}: node {seat.node_rank}, local rank {seat.local_rank}, "
                f"GPUs {rank.gpus}"
            )
        return "\n".join(lines)


def make_plan(
    config: LaunchConfig,
    placement: Placement,
    *,
    backend: BackendKind,
    job_name: str,
    job_size_bytes: int,
    job_as_file: bool = False,
    requirements: Sequence[str] = (),
) -> LaunchPlan:
    """Decide the whole run from its inputs. Pure: no I/O, no clock, no randomness."""
    ranks = []
    master_addr = "127.0.0.1" if backend is BackendKind.LOCAL else "<task 0's address>"
    # Before Spark places the tasks their hosts are unknown: each task is shown as a host of its
    # own (the ranks are numbered host by host at launch; docs/launching.md).
    seats = seats_of_placeholder_hosts(placement.num_tasks, placement.processes_per_task)
    for node in range(placement.num_tasks):
        for seat in seats[node]:
            gpus = _gpus_of(placement, backend, node)
            env = worker_env(
                {},
                seat,
                master_addr=master_addr,
                run_id=LATER,
                restart_count=0,
                max_restarts=config.max_restarts,
                cuda_visible_devices=None if not placement.use_gpu else gpus,
                mode=config.mode.value,
                host=LATER,
                socket_ifname=NODE_INTERFACE,
            )
            for name in SOCKET_IFNAME_VARS:
                if name in config.env:
                    del env[name]  # the user's own value (shown in user_env), not sparkdist's
            if config.checkpoint_dir is not None:
                env[CHECKPOINT_DIR_VAR] = config.checkpoint_dir
            if config.storage_options:
                env[STORAGE_OPTIONS_VAR] = encode_options(config.storage_options)
            ranks.append(RankPlan(seat=seat, gpus=gpus, env=env))
    return LaunchPlan(
        backend=backend,
        job_name=job_name,
        placement=placement,
        ranks=tuple(ranks),
        mode_settings=config.mode_settings(),
        start_timeout_s=config.start_timeout_s,
        timeout_s=config.timeout_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        max_restarts=config.max_restarts,
        job_size_bytes=job_size_bytes,
        job_as_file=job_as_file,
        requirements=tuple(requirements),
        user_env=dict(config.env),
        network=_network_of(master_addr, config.env),
    )


def _network_of(master_addr: str, user_env: Mapping[str, str]) -> str:
    if is_loopback(master_addr):
        return "loopback (every rank on this host; no interface variables set)"
    parts = [
        f"{name}={user_env[name]!r} from env=" for name in SOCKET_IFNAME_VARS if name in user_env
    ]
    decided = [name for name in SOCKET_IFNAME_VARS if name not in user_env]
    if decided:
        parts.insert(
            0,
            f"{' and '.join(decided)} name the interface holding the address Spark reached each "
            "node at (decided on the node; a value in the executors' environment wins)",
        )
    return "; ".join(parts)


def _gpus_of(placement: Placement, backend: BackendKind, node: int) -> str:
    if not placement.use_gpu:
        return "none (CPU)"
    if backend is BackendKind.LOCAL:
        return ",".join(placement.driver_gpus)
    return f"{placement.processes_per_task} assigned by Spark to task {node}"


def _size(size: int) -> str:
    if size >= 1 << 20:
        return f"{size / (1 << 20):.1f} MB"
    if size >= 1 << 10:
        return f"{size / (1 << 10):.1f} KB"
    return f"{size} B"
