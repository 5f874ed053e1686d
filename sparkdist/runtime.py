"""Helpers to call inside a rank: where am I in the world?

The names are those of Databricks' serverless GPU API, so code written for it runs unchanged.
They read torchrun's environment first (the launcher's variables take precedence), so they also
answer correctly under plain torchrun; without those variables the rank and world size come
from ``torch.distributed`` when a process group is up (``mp.spawn``-style code), and outside any
launcher they describe a world of one (rank 0, size 1, main process).

Example:
    >>> from sparkdist import runtime
    >>> runtime.get_world_size()  # outside a rank
    1
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any

# Defined with their machinery, documented there, and shown as this module's.
from sparkdist._checkpoint.public import (
    Checkpoint,
    checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from sparkdist._core.env import (
    DEEPSPEED_CONFIG_VAR,
    MODE_VAR,
    REQUESTED_WORLD_SIZE_VAR,
    device_index,
)
from sparkdist._core.world import global_rank, initialized_dist, int_env, uses_cuda, world_size
from sparkdist._node.rank.mesh import device_mesh, get_replica_rank
from sparkdist._node.rank.preemption import on_preemption, should_stop
from sparkdist._node.rank.replica_groups import (
    average_gradients,
    num_replica_groups,
    replica_group,
    torchft_manager_kwargs,
)

if TYPE_CHECKING:  # torch is only imported by the helpers that need it
    import torch
    from torch.distributed import ProcessGroup

__all__ = [
    "Checkpoint",
    "average_gradients",
    "backend",
    "checkpoint_dir",
    "deepspeed_config",
    "deepspeed_config_path",
    "device",
    "device_mesh",
    "get_global_rank",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_replica_rank",
    "get_world_size",
    "heartbeat",
    "is_main_process",
    "load_checkpoint",
    "mode",
    "num_replica_groups",
    "on_preemption",
    "replica_group",
    "report",
    "requested_world_size",
    "restart_count",
    "save_checkpoint",
    "should_stop",
    "torchft_manager_kwargs",
]

logger = logging.getLogger("sparkdist")


def get_global_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in the whole world, or in ``group``.

    Without a group: ``RANK`` (set by sparkdist and by torchrun) when it is set, else
    ``torch.distributed.get_rank()`` when a default process group is up, else 0.

    Args:
        group: a ``torch.distributed`` process group (``dist.new_group(...)``,
            ``mesh.get_group("shard")``): the rank within that group, in
            ``[0, group size - 1]``, or -1 when this process is not a member (as
            ``torch.distributed.get_rank`` answers).

    Returns:
        The rank.

    Raises:
        RuntimeError: a group was given but no process group is up in this process.
        TypeError: ``group`` is a ``DeviceMesh`` rather than one of its groups.

    Example:
        >>> runtime.get_global_rank()  # outside a rank
        0
        >>> pair = dist.new_group([2, 3])  # every rank calls it  # doctest: +SKIP
        >>> runtime.get_global_rank(pair)  # 0 on rank 2, 1 on 3, -1 elsewhere  # doctest: +SKIP
    """
    if group is None:
        return global_rank()
    if hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):
        raise TypeError(
            "runtime.get_global_rank(group=...) takes a process group, got a DeviceMesh; pass "
            'one of its dimensions\' groups, e.g. mesh.get_group("shard")'
        )
    dist = initialized_dist()
    if dist is None:
        raise RuntimeError(
            "runtime.get_global_rank(group=...) needs a torch.distributed process group, and "
            "none is up in this process: call torch.distributed.init_process_group() first, or "
            "call get_global_rank() without a group for the rank in the whole world"
        )
    return int(dist.get_rank(group))


def get_local_rank() -> int:
    """This process's rank on its node; also the index of its GPU (0 outside a rank)."""
    return int_env("LOCAL_RANK", 0)


def get_world_size() -> int:
    """Number of ranks in the run: ``WORLD_SIZE`` when it is set, else the default process
    group's size when one is up, else 1."""
    return world_size()


def requested_world_size() -> int:
    """The world size the launcher was asked for (``num_processes``).

    An elastic run (``min_processes``) restarted after losing a host may run with fewer ranks
    than it asked for: ``get_world_size()`` is what this attempt has, this is what was asked.
    A loop that keeps its global batch scales its gradient accumulation by the ratio.
    Outside a sparkdist rank it is ``get_world_size()``.

    Example:
        >>> accumulation = max(1, round(runtime.requested_world_size() / runtime.get_world_size()))
    """
    return int_env(REQUESTED_WORLD_SIZE_VAR, get_world_size())


def get_local_world_size() -> int:
    """Number of ranks on this node (1 outside a rank)."""
    return int_env("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node (Spark barrier task) in the run (0 outside a rank)."""
    return int_env("NODE_RANK", int_env("GROUP_RANK", 0))


def is_main_process() -> bool:
    """True on global rank 0 (and outside a rank): the process that should log and save."""
    return get_global_rank() == 0


def mode() -> str:
    """The launch mode of this run: "ddp", "fsdp" or "deepspeed" ("ddp" outside a rank)."""
    return os.environ.get(MODE_VAR, "ddp")


def backend() -> str:
    """The process-group backend for this rank: "nccl" with CUDA, "gloo" without.

    Example:
        >>> import torch.distributed as dist  # doctest: +SKIP
        >>> dist.init_process_group(runtime.backend())  # doctest: +SKIP
    """
    return "nccl" if uses_cuda() else "gloo"


def device() -> torch.device:
    """This rank's device: its GPU with CUDA, else the CPU. That is ``cuda:LOCAL_RANK``: every
    rank sees its host's GPUs in local-rank order, as under torchrun, unless the host's
    executors each see GPUs of their own (then the driver warns; docs/launching.md)."""
    import torch

    if uses_cuda():
        return torch.device("cuda", device_index(os.environ))
    return torch.device("cpu")


def deepspeed_config_path() -> str | None:
    """Path of the DeepSpeed config file shipped to this rank (mode "deepspeed"), or None."""
    return os.environ.get(DEEPSPEED_CONFIG_VAR) or None


def deepspeed_config() -> dict[str, Any] | None:
    """The DeepSpeed config of this run as a dict (mode "deepspeed"), or None.

    Example:
        >>> import deepspeed  # doctest: +SKIP
        >>> engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
        ...                                   config=runtime.deepspeed_config())  # doctest: +SKIP
    """
    path = deepspeed_config_path()
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    return config


def restart_count() -> int:
    """How many times this run was restarted before this attempt (0 on the first); in a
    replica-group run, how many times this rank's own group was relaunched."""
    return int_env("TORCHELASTIC_RESTART_COUNT", 0)


def heartbeat() -> None:
    """Tell the launcher this rank is alive (for ``heartbeat_timeout_s``); cheap, no-op
    outside a sparkdist rank."""
    from sparkdist._node.rank import agent_link as _agent_link
    from sparkdist._wire import protocol

    rank = _agent_link.own_rank()
    if rank is not None:
        _agent_link.send_to_agent(protocol.Beat(rank))


def report(step: int | None = None, total: int | None = None, **metrics: float) -> None:
    """Report progress (and metrics) to the driver; also counts as a heartbeat.

    Call it from the main process each step or every few steps. Non-finite or non-numeric
    metric values are dropped. Outside a sparkdist rank it does nothing.

    Raises:
        ValueError: the report cannot travel to the driver: more than 1000 metrics, a name
            longer than 250 characters, or a step beyond 64 bits (the message names which).

    Example:
        >>> runtime.report(step=10, total=100, loss=0.25)
    """
    from sparkdist._node.rank import agent_link as _agent_link
    from sparkdist._wire import protocol

    clean = {
        str(k): float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    rank = _agent_link.own_rank()
    message = protocol.Report(
        rank=rank or 0,  # checked even outside a rank, where nothing is sent
        step=int(step) if step is not None else None,
        total=int(total) if total is not None else None,
        metrics=clean,
    )
    try:
        protocol.encode(message)
    except protocol.ProtocolError as exc:
        # Said here, in the rank, at the call: dropped on the way, it would vanish unexplained.
        raise ValueError(
            f"runtime.report() cannot send this report to the driver: {exc}; report at most "
            f"{protocol.MAX_METRICS} metrics, named in at most {protocol.MAX_METRIC_NAME_CHARS} "
            "characters"
        ) from None
    if rank is not None:
        _agent_link.send_to_agent(message)
