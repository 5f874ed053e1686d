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
import sys
from typing import TYPE_CHECKING, Any

from sparkdist._core.env import DEEPSPEED_CONFIG_VAR, MODE_VAR, USE_GPU_VAR
from sparkdist._node import checkpoints as _checkpoints
from sparkdist._node.checkpoints import Checkpoint

if TYPE_CHECKING:  # torch is only imported by the helpers that need it
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "Checkpoint",
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
    "report",
    "restart_count",
    "save_checkpoint",
]

logger = logging.getLogger("sparkdist")


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


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
        return _env_or_torch("RANK", "get_rank", 0)
    if hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):
        raise TypeError(
            "runtime.get_global_rank(group=...) takes a process group, got a DeviceMesh; pass "
            'one of its dimensions\' groups, e.g. mesh.get_group("shard")'
        )
    dist = _initialized_dist()
    if dist is None:
        raise RuntimeError(
            "runtime.get_global_rank(group=...) needs a torch.distributed process group, and "
            "none is up in this process: call torch.distributed.init_process_group() first, or "
            "call get_global_rank() without a group for the rank in the whole world"
        )
    return int(dist.get_rank(group))


def get_replica_rank() -> int:
    """Which data-parallel replica this rank belongs to.

    Under the 2-D mesh ``("replicate", "shard")`` that ``device_mesh(replicas=r)`` built, it is
    the rank's index along "replicate" (``0 .. r - 1``: the ranks of one replica shard one copy
    of the model between them); under the 1-D mesh ``device_mesh()`` built (plain FSDP: one
    replica, sharded over every rank), 0. Without such a mesh every rank holds a whole replica
    (DDP), so it equals ``get_global_rank()``. The latest mesh ``device_mesh`` built in this
    process counts, while the process group it was built on is up.

    Example:
        >>> runtime.get_replica_rank()  # outside a rank, no mesh
        0
        >>> mesh = runtime.device_mesh(replicas=2)  # 8 ranks: 0-3 and 4-7  # doctest: +SKIP
        >>> runtime.get_replica_rank()  # on rank 5  # doctest: +SKIP
        1
    """
    recorded = _mesh_replica_rank()
    return get_global_rank() if recorded is None else recorded


def get_local_rank() -> int:
    """This process's rank on its node; also the index of its GPU (0 outside a rank)."""
    return _int_env("LOCAL_RANK", 0)


def get_world_size() -> int:
    """Number of ranks in the run: ``WORLD_SIZE`` when it is set, else the default process
    group's size when one is up, else 1."""
    return _env_or_torch("WORLD_SIZE", "get_world_size", 1)


def get_local_world_size() -> int:
    """Number of ranks on this node (1 outside a rank)."""
    return _int_env("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node (Spark barrier task) in the run (0 outside a rank)."""
    return _int_env("NODE_RANK", _int_env("GROUP_RANK", 0))


def _initialized_dist() -> Any:
    """``torch.distributed`` if this process already imported it and has a default process
    group up; else None (never imports torch: that costs seconds, and nothing can be up)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist


def _env_or_torch(name: str, question: str, default: int) -> int:
    """The launcher's variable ``name`` when it is set (an integer); else
    ``torch.distributed.<question>()`` when a default process group is up; else ``default``."""
    value = _int_env(name, -1)
    if value >= 0:
        return value
    dist = _initialized_dist()
    return default if dist is None else int(getattr(dist, question)())


def is_main_process() -> bool:
    """True on global rank 0 (and outside a rank): the process that should log and save."""
    return get_global_rank() == 0


def mode() -> str:
    """The launch mode of this run: "ddp", "fsdp" or "deepspeed" ("ddp" outside a rank)."""
    return os.environ.get(MODE_VAR, "ddp")


def _uses_cuda() -> bool:
    if os.environ.get(USE_GPU_VAR) == "0":
        return False
    import torch

    return bool(torch.cuda.is_available())


def backend() -> str:
    """The process-group backend for this rank: "nccl" with CUDA, "gloo" without.

    Example:
        >>> import torch.distributed as dist  # doctest: +SKIP
        >>> dist.init_process_group(runtime.backend())  # doctest: +SKIP
    """
    return "nccl" if _uses_cuda() else "gloo"


def device() -> torch.device:
    """This rank's device: its GPU (``cuda:LOCAL_RANK``) with CUDA, else the CPU."""
    import torch

    if _uses_cuda():
        return torch.device("cuda", get_local_rank())
    return torch.device("cpu")


def device_mesh(replicas: int = 1) -> DeviceMesh:
    """A device mesh for FSDP2 (call after ``init_process_group``), as ``init_device_mesh``.

    ``replicas=1`` gives the 1-D mesh ("shard",) over all ranks: plain FSDP. ``replicas=r > 1``
    gives the 2-D mesh ("replicate", "shard") of shape (r, world_size // r) for HSDP:
    parameters are sharded within each group of world_size // r consecutive ranks (typically
    one node) and replicated across the r groups. ``get_replica_rank()`` then tells which of
    the r replicas this rank belongs to. Every rank must call it (it creates process groups).

    Args:
        replicas: the number of model replicas; a divisor of the world size.

    Returns:
        The ``torch.distributed.device_mesh.DeviceMesh``.

    Raises:
        ValueError: ``replicas`` does not divide the world size.

    Example:
        >>> from torch.distributed.fsdp import fully_shard  # doctest: +SKIP
        >>> fully_shard(model, mesh=runtime.device_mesh())  # doctest: +SKIP
        >>> nodes = runtime.get_world_size() // runtime.get_local_world_size()  # doctest: +SKIP
        >>> fully_shard(model, mesh=runtime.device_mesh(replicas=nodes))  # HSDP  # doctest: +SKIP
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    global _mesh_replicas
    world = get_world_size()
    shard = _shard_size(world, replicas)
    device_type = "cuda" if _uses_cuda() else "cpu"
    if replicas == 1:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(
            device_type, (replicas, shard), mesh_dim_names=("replicate", "shard")
        )
    # Remembered with the default group it was built on: a mesh of a group since destroyed (a
    # plain call of a decorated function ends its group) says nothing about the next one.
    _mesh_replicas = (dist.group.WORLD, _replica_rank_of(get_global_rank(), world, replicas))
    return mesh


#: The default process group ``device_mesh`` last built a mesh on, and this rank's replica there.
_mesh_replicas: tuple[object, int] | None = None


def _mesh_replica_rank() -> int | None:
    recorded = _mesh_replicas
    if recorded is None:
        return None
    dist = _initialized_dist()
    if dist is None or dist.group.WORLD is not recorded[0]:
        return None
    return recorded[1]


def _shard_size(world_size: int, replicas: int) -> int:
    """Ranks per replica when ``world_size`` ranks hold ``replicas`` replicas of a model.

    Raises:
        ValueError: ``replicas`` is not a positive divisor of ``world_size``.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise ValueError(f"replicas must be an integer, got {type(replicas).__name__} {replicas!r}")
    if replicas < 1 or world_size % replicas:
        raise ValueError(
            f"replicas={replicas} must be a positive divisor of the world size ({world_size}); "
            "for HSDP use the number of nodes, e.g. replicas=get_world_size() // "
            "get_local_world_size()"
        )
    return world_size // replicas


def _replica_rank_of(rank: int, world_size: int, replicas: int) -> int:
    """The replica global rank ``rank`` belongs to under ``device_mesh(replicas)``: 0 for the
    1-D mesh, else its row of the (replicas, world_size // replicas) mesh (row-major, as
    ``init_device_mesh`` lays ranks out)."""
    return 0 if replicas == 1 else rank // _shard_size(world_size, replicas)


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
    """How many times this run was restarted before this attempt (0 on the first)."""
    return _int_env("TORCHELASTIC_RESTART_COUNT", 0)


def heartbeat() -> None:
    """Tell the launcher this rank is alive (for ``heartbeat_timeout_s``); cheap, no-op
    outside a sparkdist rank."""
    from sparkdist._node import worker as _worker
    from sparkdist._wire import protocol

    rank = _worker.own_rank()
    if rank is not None:
        _worker.send_to_agent(protocol.Beat(rank))


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
    from sparkdist._node import worker as _worker
    from sparkdist._wire import protocol

    clean = {
        str(k): float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    rank = _worker.own_rank()
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
        _worker.send_to_agent(message)


# -- checkpoints (the implementation: _node/checkpoints.py) ---------------------------------


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory (``checkpoint_dir=`` of the launcher), or None."""
    return _checkpoints.checkpoint_dir()


def save_checkpoint(state: Any, step: int) -> str:
    """Save ``state`` as the checkpoint of ``step``, atomically, from the main process.

    Every rank must call it (it synchronises the ranks when a process group is up, so no
    rank runs ahead of a checkpoint that is not written yet); only global rank 0 writes.
    The file is ``<checkpoint_dir>/step-<step, 9 digits>.pt`` holding
    ``{"step": step, "state": state}`` (``torch.save``), readable by its owner only (0600).
    It is written to a fresh temporary name in the same directory, fsynced, renamed, and the
    directory is fsynced, so a crash never leaves a partial checkpoint behind; earlier
    checkpoints are kept (``load_checkpoint`` falls back to them). Gather sharded state
    (FSDP, ZeRO-3) into ``state`` first, or save per-rank state under your own names. Keep
    ``state`` to tensors, numbers, strings and plain containers (state dicts are) so that
    ``load_checkpoint`` reads it without ``weights_only=False``.

    Example:
        >>> runtime.save_checkpoint({"model": model.state_dict()}, step)  # doctest: +SKIP

    Returns:
        The checkpoint's path.

    Raises:
        RuntimeError: the launcher was given no ``checkpoint_dir``.
    """
    return _checkpoints.save(state, step, writer=is_main_process())


def load_checkpoint(map_location: Any = "cpu", *, weights_only: bool = True) -> Checkpoint | None:
    """The latest readable checkpoint of this run's ``checkpoint_dir``, or None if it has none.

    By default only tensors, state dicts, numbers, strings and plain containers are loaded
    (``torch.load(weights_only=True)``): a checkpoint holding anything else is refused, because
    unpickling arbitrary objects can run arbitrary code, and anyone who can write the checkpoint
    directory could have put such a file there. ``weights_only=False`` loads full pickles
    (your own classes, say): pass it only if you trust the file and everyone who can write the
    directory. Allowing just your classes, with ``torch.serialization.add_safe_globals``, keeps
    the protection on.

    A newest checkpoint that cannot be read (truncated, damaged, not written by
    ``save_checkpoint``) is skipped with a warning naming the file, and the one before it is
    loaded.

    Example:
        >>> latest = runtime.load_checkpoint()  # doctest: +SKIP
        >>> start = 0 if latest is None else latest.step  # doctest: +SKIP

    Args:
        map_location: as for ``torch.load`` (default: every tensor on the CPU).
        weights_only: False to unpickle any object (runs whatever code the file names).

    Raises:
        pickle.UnpicklingError: with ``weights_only=True``, the newest readable checkpoint
            holds other objects; the message names them and the two ways to load it.
        RuntimeError: no ``checkpoint_dir``; or checkpoints are there but none can be read.
    """
    return _checkpoints.load(map_location, weights_only=weights_only)
