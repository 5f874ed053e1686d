"""The environment of one rank: a pure function of where it sits in the world.

The names are torchrun's, so ``init_process_group("env://")``, PyTorch Lightning and Hugging Face
Accelerate all recognise the launch. ``MASTER_PORT`` is absent on purpose: the port is chosen by
the process that binds the store (rank 0) after the workers start, and reaches every worker over
its control pipe before the training function runs (see ``_worker``).

Non-goals: spawning, reading Spark, choosing GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sparkdist._core.addresses import is_loopback
from sparkdist._core.errors import ConfigError, ConfigTypeError
from sparkdist._core.tracebacks import FULL_TRACEBACK_VAR as FULL_TRACEBACK_VAR

#: Variables sparkdist sets for its own worker bootstrap; user code should use ``runtime``.
RUN_ID_VAR = "SPARKDIST_RUN_ID"
USE_GPU_VAR = "SPARKDIST_USE_GPU"
MODE_VAR = "SPARKDIST_MODE"
HOST_VAR = "SPARKDIST_HOST"
#: The barrier task (partition id) whose agent started the rank: with ranks numbered host by
#: host, two tasks of one run share a ``GROUP_RANK``, and an agent ends only its own ranks.
TASK_VAR = "SPARKDIST_TASK"
#: The rank's own GPU (an entry of its ``CUDA_VISIBLE_DEVICES``): its device index is where
#: this stands in that list (``device_index``), which is ``LOCAL_RANK`` wherever the host's
#: GPUs are all visible to its ranks (``_core.numbering``).
GPU_VAR = "SPARKDIST_GPU"
#: The ranks on every host, by node rank (a comma list): ``runtime.device_mesh`` tells from it
#: which HSDP shard groups cross the network.
RANKS_PER_HOST_VAR = "SPARKDIST_RANKS_PER_HOST"
#: A cold-started rank's parent (its agent's process): the rank asks the kernel to end it when
#: that parent goes (``_node.host.parent_death``).
PARENT_PID_VAR = "SPARKDIST_PARENT_PID"

DEEPSPEED_CONFIG_VAR = "SPARKDIST_DEEPSPEED_CONFIG"
#: A replica-group run's torchft variables (``replica_groups``), under torchft's own names: the
#: driver's Lighthouse, this rank's group, and how many groups the run has.
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_VAR = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_VAR = "NUM_REPLICA_GROUPS"
CHECKPOINT_DIR_VAR = "SPARKDIST_CHECKPOINT_DIR"
#: ``storage_options=`` for an object-store ``checkpoint_dir``, as JSON (never credentials).
STORAGE_OPTIONS_VAR = "SPARKDIST_STORAGE_OPTIONS"
#: The world size the launcher was asked for (``num_processes``): an elastic restart may run
#: fewer ranks (``WORLD_SIZE``), and the training loop keeps its global batch from the ratio.
REQUESTED_WORLD_SIZE_VAR = "SPARKDIST_REQUESTED_WORLD_SIZE"
#: DataFrame input: this rank's Arrow IPC file, and every rank's row count (a JSON list).
PARTITION_FILE_VAR = "SPARKDIST_PARTITION_FILE"
ROWS_PER_RANK_VAR = "SPARKDIST_ROWS_PER_RANK"
#: The same partition file, and the DataFrame's Spark schema (JSON), under the names pyspark's
#: ``_get_spark_partition_data_loader`` reads.
PYSPARK_PARTITION_FILE_VAR = "SPARK_PARTITION_ARROW_DATA_FILE"
PYSPARK_SCHEMA_FILE_VAR = "SPARK_DATAFRAME_SCHEMA_FILE"

#: Variables the launcher reads from the driver's (or the test session's) environment.
#: ``off``: barrier tasks rendezvous through Spark's allGather, not the driver's channel.
CONTROL_CHANNEL_VAR = "SPARKDIST_CONTROL_CHANNEL"
#: Spark Connect: the address executors reach this process at.
DRIVER_HOST_VAR = "SPARKDIST_DRIVER_HOST"
#: ``0`` spawns every rank cold (no warm pool of torch-imported processes).
WORKER_POOL_VAR = "SPARKDIST_WORKER_POOL"
#: Set in a warm pool's zygote process.
ZYGOTE_VAR = "SPARKDIST_ZYGOTE"
#: ``0`` turns MLflow tracking off where ``mlflow=`` is not given.
TRACKING_VAR = "SPARKDIST_MLFLOW"
#: Seconds between two plain progress lines.
PROGRESS_INTERVAL_VAR = "SPARKDIST_PROGRESS_INTERVAL_S"
#: ``1`` keeps every traceback frame (sparkdist's own included); defined where it is read
#: (``_core.tracebacks`` comes before this module: ``errors`` imports it).
#: The pytest session a run belongs to (the plugin's leak check counts only its own).
PYTEST_SESSION_VAR = "SPARKDIST_PYTEST_SESSION"

#: The network interface gloo and NCCL bind and advertise. sparkdist sets both to the interface
#: holding the node's address (``with_socket_ifname``), but they are not launcher-owned: a value
#: the user gives (``env=``, the driver's or the executors' environment) is kept as it is.
GLOO_SOCKET_IFNAME_VAR = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME_VAR = "NCCL_SOCKET_IFNAME"
SOCKET_IFNAME_VARS = (GLOO_SOCKET_IFNAME_VAR, NCCL_SOCKET_IFNAME_VAR)
#: ``1`` shows c10d's per-rank "The hostname of the client socket cannot be retrieved" warning,
#: which the node drops by default (``_core.lines.is_c10d_hostname_warning``); read, as a rank
#: would see it, from ``env=`` over the agent's environment.
SHOW_C10D_HOSTNAME_WARNING_VAR = "SPARKDIST_SHOW_C10D_HOSTNAME_WARNING"

#: MLflow's variables, set in every rank when the driver tracks the run.
MLFLOW_RUN_ID_VAR = "MLFLOW_RUN_ID"
MLFLOW_EXPERIMENT_ID_VAR = "MLFLOW_EXPERIMENT_ID"
MLFLOW_TRACKING_URI_VAR = "MLFLOW_TRACKING_URI"
#: Read on the driver only: the experiment a new MLflow run goes to.
MLFLOW_EXPERIMENT_NAME_VAR = "MLFLOW_EXPERIMENT_NAME"

#: The only variables the driver may add to the ranks' environment with the rendezvous (the
#: control channel refuses any other: a message can never set ``LD_PRELOAD`` or ``MASTER_ADDR``).
RENDEZVOUS_ENV_VARS = frozenset(
    {MLFLOW_RUN_ID_VAR, MLFLOW_EXPERIMENT_ID_VAR, MLFLOW_TRACKING_URI_VAR, ROWS_PER_RANK_VAR}
)

#: The worker's bootstrap variables (set by the agent, read by ``_node.rank.worker``; named here so
#: the launcher's own variables are listed in one place).
JOB_FILE_VAR = "SPARKDIST_JOB_FILE"
RESULT_DIR_VAR = "SPARKDIST_RESULT_DIR"
CTRL_IN_VAR = "SPARKDIST_CTRL_IN"
CTRL_OUT_VAR = "SPARKDIST_CTRL_OUT"
START_TIMEOUT_VAR = "SPARKDIST_START_TIMEOUT_S"

#: Every variable the launcher sets in a rank's environment, whatever the user asks: ``env=``
#: may not name one (it would be overwritten, or would describe the wrong world). Variables the
#: launcher only defaults (``OMP_NUM_THREADS``, ``DS_ACCELERATOR``) are the user's to set.
LAUNCHER_VARS = frozenset(
    {
        # torchrun's world description (torch.distributed.run sets the same names)
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_NAME",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        # the GPUs of a rank: chosen by placement (use_gpu, spark.task.resource.gpu.amount)
        "CUDA_VISIBLE_DEVICES",
        # output must reach the driver line by line
        "PYTHONUNBUFFERED",
        RUN_ID_VAR,
        USE_GPU_VAR,
        MODE_VAR,
        HOST_VAR,
        TASK_VAR,
        GPU_VAR,
        RANKS_PER_HOST_VAR,
        DEEPSPEED_CONFIG_VAR,
        LIGHTHOUSE_VAR,
        REPLICA_GROUP_VAR,
        NUM_REPLICA_GROUPS_VAR,
        CHECKPOINT_DIR_VAR,
        STORAGE_OPTIONS_VAR,
        REQUESTED_WORLD_SIZE_VAR,
        PARTITION_FILE_VAR,
        ROWS_PER_RANK_VAR,
        PYSPARK_PARTITION_FILE_VAR,
        PYSPARK_SCHEMA_FILE_VAR,
        JOB_FILE_VAR,
        RESULT_DIR_VAR,
        CTRL_IN_VAR,
        CTRL_OUT_VAR,
        START_TIMEOUT_VAR,
    }
)
#: Whole families the launcher owns: torchelastic's run id, restart count, agent store...
LAUNCHER_VAR_PREFIXES = ("TORCHELASTIC_",)

#: A POSIX environment variable name (what a shell can export).
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def launcher_owns(name: str) -> bool:
    """Whether the launcher sets ``name`` in every rank (so ``env=`` may not)."""
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_VAR_PREFIXES)


def check_user_env(env: object) -> dict[str, str]:
    """Check ``env=`` and return a plain copy: valid names mapped to strings, none of them ours.

    Raises:
        ConfigTypeError: ``env`` is not a mapping, or a name or a value is not a string.
        ConfigError: a name is not a valid variable name, or is one the launcher sets.
    """
    if not isinstance(env, Mapping):
        hint = (
            f"; write env={{{env.partition('=')[0]!r}: {env.partition('=')[2]!r}}}"
            if isinstance(env, str) and "=" in env
            else ""
        )
        raise ConfigTypeError(
            f"env must be a mapping of variable names to strings, e.g. env={{'NCCL_DEBUG': "
            f"'INFO'}}; got {type(env).__name__} {env!r}{hint}"
        )
    checked: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str):
            raise ConfigTypeError(
                f"env names must be strings, got {type(name).__name__} {name!r}; write "
                f"env={{{str(name)!r}: ...}}"
            )
        if not _VAR_NAME.fullmatch(name):
            raise ConfigError(
                f"env name {name!r} is not a valid environment variable name; use letters, "
                "digits and '_', not starting with a digit ([A-Za-z_][A-Za-z0-9_]*)"
            )
        if launcher_owns(name):
            raise ConfigError(
                f"env sets {name}, which sparkdist sets itself in every rank (as it does the "
                "rest of torchrun's variables, TORCHELASTIC_* and its own SPARKDIST_* bootstrap "
                f"variables); drop {name} from env: {_OWNED_HINTS.get(name, _OWNED_HINT)}"
            )
        if not isinstance(value, str):
            raise ConfigTypeError(
                f"env[{name!r}] must be a string, got {type(value).__name__} {value!r}; write "
                f"env={{{name!r}: {str(value)!r}}}"
            )
        checked[name] = value
    return checked


#: How to get what an owned variable would have given.
_OWNED_HINT = "inside a rank, sparkdist.runtime tells the rank, the world size and the rest"
_OWNED_HINTS = {
    "CUDA_VISIBLE_DEVICES": "each rank gets its own GPU (use_gpu=False for none); in local mode, "
    "set CUDA_VISIBLE_DEVICES in the driver's environment to choose the GPUs ranks may use",
    "MASTER_PORT": "the rank 0 store binds a port the OS picks and every rank is told it",
    "MASTER_ADDR": "rank 0's host is the rendezvous address",
    "PYTHONUNBUFFERED": "every rank already runs unbuffered",
    "WORLD_SIZE": "the world size is num_processes",
    LIGHTHOUSE_VAR: "replica_groups=R starts a Lighthouse for the run and tells every rank",
    REPLICA_GROUP_VAR: "replica_groups=R numbers the groups and tells every rank its own",
    NUM_REPLICA_GROUPS_VAR: "the number of replica groups is replica_groups",
}


#: Variables an enclosing launcher (an outer torchrun, a previous run) may have left behind and
#: which would describe the wrong world if inherited.
_STALE = ("MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "GROUP_WORLD_SIZE", "ROLE_NAME")


@dataclass(frozen=True)
class RankSeat:
    """Where one rank sits in the world (torchrun's numbering: a node is a host; see
    ``_core.numbering``).

    Attributes:
        rank: global rank.
        local_rank: rank within its node (host), across the host's tasks.
        node_rank: index of the node (host) that runs it, in the order of the hosts' first task.
        world_size: total ranks.
        local_world_size: ranks on this node (host).
        num_nodes: number of nodes (hosts).
        task: the barrier task (Spark partition id; 0 in local mode) whose agent runs it.
        slot: its place among its task's ranks: its GPU is the task's GPU of this index.
        host_sizes: the ranks on every node, by node rank (empty: not known).
    """

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int
    task: int = 0
    slot: int = 0
    host_sizes: tuple[int, ...] = ()


def worker_env(
    base: Mapping[str, str],
    seat: RankSeat,
    *,
    master_addr: str,
    run_id: str,
    restart_count: int,
    max_restarts: int,
    cuda_visible_devices: str | None,
    mode: str,
    host: str,
    extra: Mapping[str, str] = {},
    socket_ifname: str | None = None,
) -> dict[str, str]:
    """Build the full environment of one worker process.

    Args:
        base: the environment the worker inherits (the agent's).
        seat: the rank's place in the world.
        master_addr: host of the rendezvous store (rank 0's host).
        run_id: the run's id (TORCHELASTIC_RUN_ID).
        restart_count: how many times this run was restarted so far.
        max_restarts: how many restarts the run allows.
        cuda_visible_devices: the GPUs of this node, or None for a CPU run (every GPU is then
            hidden, so nothing picks CUDA or NCCL by accident).
        mode: the launch mode's name.
        host: the host name or address of this node, as the driver knows it.
        extra: user-supplied variables, applied last except over sparkdist's own.
        socket_ifname: the interface holding this node's address (``_node.host.interfaces``), or
            None when it is unknown; see ``with_socket_ifname``.
    """
    env = {k: v for k, v in base.items() if k not in _STALE}
    env.update(extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        {
            "RANK": str(seat.rank),
            "LOCAL_RANK": str(seat.local_rank),
            "WORLD_SIZE": str(seat.world_size),
            "LOCAL_WORLD_SIZE": str(seat.local_world_size),
            "GROUP_RANK": str(seat.node_rank),
            "NODE_RANK": str(seat.node_rank),
            "GROUP_WORLD_SIZE": str(seat.num_nodes),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(seat.rank),
            "ROLE_WORLD_SIZE": str(seat.world_size),
            "MASTER_ADDR": master_addr,
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            # Rank 0's worker hosts the store; every rank (rank 0 included) joins as a client.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            # Output must reach the driver line by line while training runs.
            "PYTHONUNBUFFERED": "1",
            RUN_ID_VAR: run_id,
            MODE_VAR: mode,
            HOST_VAR: host,
            USE_GPU_VAR: "0" if cuda_visible_devices is None else "1",
            "CUDA_VISIBLE_DEVICES": cuda_visible_devices or "",
            TASK_VAR: str(seat.task),
        }
    )
    devices = cuda_visible_devices.split(",") if cuda_visible_devices else []
    if seat.slot < len(devices):
        env[GPU_VAR] = devices[seat.slot]
    if seat.host_sizes:
        env[RANKS_PER_HOST_VAR] = ",".join(map(str, seat.host_sizes))
    if mode == "deepspeed" and cuda_visible_devices is None:
        # DeepSpeed picks its accelerator at import; without a GPU it must be told "cpu".
        env.setdefault("DS_ACCELERATOR", "cpu")
    return with_socket_ifname(
        env, socket_ifname, master_addr=master_addr, user_env=extra, inherited=base
    )


def with_socket_ifname(
    env: Mapping[str, str],
    interface: str | None,
    *,
    master_addr: str,
    user_env: Mapping[str, str],
    inherited: Mapping[str, str],
) -> dict[str, str]:
    """``env`` (a rank's environment being built) with gloo and NCCL told ``interface``.

    Without them, gloo and NCCL pick the address they advertise from the host's name, which on
    many hosts resolves to 127.0.1.1 (Debian's ``/etc/hosts``) or to a network the peers do not
    share: then every run fails in ``connectFullMesh``. So ``GLOO_SOCKET_IFNAME`` becomes
    ``interface`` and ``NCCL_SOCKET_IFNAME`` ``=interface`` (NCCL matches a bare name as a
    prefix, ``eth1`` would also take ``eth10``; ``=`` asks for exactly that one), each unless
    the user set it in ``user_env`` (``env=``) or ``inherited`` (the agent's environment): a
    value of theirs, a comma list or an empty string (gloo and NCCL then choose themselves),
    is kept as it is.

    Nothing is set when ``interface`` is None (not known) or ``master_addr`` is loopback: every
    rank is on this host (local mode), and loopback is what they reach each other at.
    """
    result = dict(env)
    if interface is None or is_loopback(master_addr):
        return result
    wanted = {GLOO_SOCKET_IFNAME_VAR: interface, NCCL_SOCKET_IFNAME_VAR: f"={interface}"}
    for name, value in wanted.items():
        if name not in user_env and name not in inherited:
            result[name] = value
    return result


def device_index(env: Mapping[str, str]) -> int:
    """The CUDA device index of a rank with environment ``env``: where its own GPU stands in
    its ``CUDA_VISIBLE_DEVICES``, else (no GPU named: a world of the user's own) its
    ``LOCAL_RANK``."""
    visible = [item.strip() for item in env.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    own = env.get(GPU_VAR)
    if own is not None and own in visible:
        return visible.index(own)
    return int(env.get("LOCAL_RANK", "0"))
