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
import warnings
from typing import TYPE_CHECKING, Any

from sparkdist._core.env import (
    DEEPSPEED_CONFIG_VAR,
    MODE_VAR,
    RANKS_PER_HOST_VAR,
    REQUESTED_WORLD_SIZE_VAR,
    USE_GPU_VAR,
    device_index,
)
from sparkdist._core.numbering import groups_across_hosts_warning
from sparkdist._node import checkpoints as _checkpoints
from sparkdist._node.checkpoints import Checkpoint

if TYPE_CHECKING:  # torch is only imported by the helpers that need it
    from collections.abc import Callable

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
    "on_preemption",
    "report",
    "requested_world_size",
    "restart_count",
    "save_checkpoint",
    "should_stop",
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


def requested_world_size() -> int:
    """The world size the launcher was asked for (``num_processes``).

    An elastic run (``min_processes``) restarted after losing a host may run with fewer ranks
    than it asked for: ``get_world_size()`` is what this attempt has, this is what was asked.
    A loop that keeps its global batch scales its gradient accumulation by the ratio.
    Outside a sparkdist rank it is ``get_world_size()``.

    Example:
        >>> accumulation = max(1, round(runtime.requested_world_size() / runtime.get_world_size()))
    """
    return _int_env(REQUESTED_WORLD_SIZE_VAR, get_world_size())


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
    """This rank's device: its GPU with CUDA, else the CPU. That is ``cuda:LOCAL_RANK``: every
    rank sees its host's GPUs in local-rank order, as under torchrun, unless the host's
    executors each see GPUs of their own (then the driver warns; docs/launching.md)."""
    import torch

    if _uses_cuda():
        return torch.device("cuda", device_index(os.environ))
    return torch.device("cpu")


def device_mesh(replicas: int = 1) -> DeviceMesh:
    """A device mesh for FSDP2 (call after ``init_process_group``), as ``init_device_mesh``.

    ``replicas=1`` gives the 1-D mesh ("shard",) over all ranks: plain FSDP. ``replicas=r > 1``
    gives the 2-D mesh ("replicate", "shard") of shape (r, world_size // r) for HSDP:
    parameters are sharded within each group of world_size // r consecutive ranks and
    replicated across the r groups. Ranks are numbered host by host, so with r = the number of
    hosts each group is one host (NVLink inside, the network only between replicas); where the
    hosts are unequal, rank 0 warns which groups cross hosts. ``get_replica_rank()`` then
    tells which of the r replicas this rank belongs to. Every rank must call it (it creates
    process groups).

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
    if replicas > 1:
        _warn_of_groups_across_hosts(world, replicas)
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


def _warn_of_groups_across_hosts(world_size: int, replicas: int) -> None:
    """Warn (rank 0, once per mesh) when some HSDP shard groups cross hosts (``numbering``)."""
    listed = os.environ.get(RANKS_PER_HOST_VAR, "")
    if not listed or get_global_rank() != 0:
        return
    host_sizes = [int(n) for n in listed.split(",")]
    if sum(host_sizes) != world_size:
        return  # not the launcher's world (a process group of the user's own)
    warning = groups_across_hosts_warning(host_sizes, replicas)
    if warning is not None:
        warnings.warn(warning, stacklevel=3)


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


def should_stop() -> bool:
    """Whether the run is being preempted: when True, save a checkpoint and return.

    True once a preemption notice reached the run: SIGTERM to any rank, to a node's agent (a
    Spark executor's Python worker; SIGHUP too, which PySpark sends when the executor shuts
    down), or to the driver while it waits in ``run()``. When a ``torch.distributed`` process
    group is up it is a collective (a MAX all-reduce of each rank's flag, on a gloo group made
    once, so it works under NCCL too): every rank gets the same answer at the same call, so
    **call it at the same point on every rank, e.g. once per step**, and the ranks stop at the
    same step with one consistent checkpoint. It costs one all-reduce of one integer (about
    0.1 ms on one host, a few round trips across hosts). Without a process group each rank
    answers for itself.

    Ranks still running ``preemption_grace_s`` (25 s) after the notice are stopped. The run
    then restarts from its last checkpoint without using ``max_restarts`` (unless the driver
    itself got the SIGTERM: then it ends). Outside a sparkdist rank it returns False.

    Example:
        >>> for step in range(start, steps):  # doctest: +SKIP
        ...     train_step()
        ...     if runtime.should_stop():
        ...         runtime.save_checkpoint(state, step + 1)
        ...         return
    """
    from sparkdist._node import agent_link as _agent_link
    from sparkdist._node import drain as _drain

    if _agent_link.own_rank() is None:
        return False
    if _drain.agreed():  # every rank answered True at the same call: no collective needed
        return True
    dist = _initialized_dist()
    if dist is None:
        return _drain.requested()
    import torch

    flag = torch.tensor([1 if _drain.requested() else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_stop_group(dist))
    if not flag.item():
        return False
    _drain.agree()
    return True


#: The default process group ``should_stop`` last reduced on, and the group it reduces on.
_stop_groups: tuple[object, Any] | None = None


def _stop_group(dist: Any) -> Any:
    """A group of every rank that reduces CPU tensors: the default one when it runs gloo, else
    a gloo group made once per default group (every rank makes it, at the same call)."""
    global _stop_groups
    world = dist.group.WORLD
    if _stop_groups is None or _stop_groups[0] is not world:
        gloo = "gloo" in str(dist.get_backend()).lower()
        _stop_groups = (world, None if gloo else dist.new_group(backend="gloo"))
    return _stop_groups[1]


def on_preemption(callback: Callable[[str], object]) -> None:
    """Call ``callback(reason)`` once, when a preemption notice reaches this rank.

    ``reason`` says what and where ("node 1 (host 10.0.0.3): rank 1 got SIGTERM"). The
    callback runs on a thread of its own (``sparkdist-preemption``), not on the thread that
    trains: keep it short and thread-safe (log, set a flag, flush a writer); the checkpoint
    itself belongs in the training loop, at ``should_stop()``. An exception it raises is
    logged and the rank goes on. Registered after a notice came, it runs at once, on the
    caller's thread. Outside a sparkdist rank it is never called.

    Example:
        >>> runtime.on_preemption(lambda why: print("preempted:", why, flush=True))
    """
    from sparkdist._node import agent_link as _agent_link
    from sparkdist._node import drain as _drain

    if _agent_link.own_rank() is not None:
        _drain.on_preemption(callback)


def heartbeat() -> None:
    """Tell the launcher this rank is alive (for ``heartbeat_timeout_s``); cheap, no-op
    outside a sparkdist rank."""
    from sparkdist._node import agent_link as _agent_link
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
    from sparkdist._node import agent_link as _agent_link
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


# -- checkpoints (the implementation: _node/checkpoints.py) ---------------------------------


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory (``checkpoint_dir=`` of the launcher), or None."""
    return _checkpoints.checkpoint_dir()


def save_checkpoint(
    state: Any, step: int, *, async_: bool = False, keep_last: int | None = None
) -> str:
    """Save ``state`` as the checkpoint of ``step``: every rank writes its own shards.

    A collective call: every rank must call it, with its own ``state`` (a dict with str keys:
    DDP's ``model.state_dict()``, or FSDP2's sharded state from
    ``torch.distributed.checkpoint.state_dict.get_state_dict``). It writes through
    ``torch.distributed.checkpoint`` (DCP), all ranks in parallel, into
    ``<checkpoint_dir>/step-<step, 9 digits>/``: each rank's shards (``__<rank>_0.distcp``;
    tensors every rank holds alike, DDP's, are written once), DCP's ``.metadata``, and last a
    commit marker ``COMMITTED`` (JSON: format "dcp", step, world size, time) that global rank
    0 writes atomically (fsynced, renamed) once every rank's files are on disk. A directory
    without its marker is never loaded, and is cleared when that step is saved again; a
    committed checkpoint of the same step is replaced only once the new one is committed.
    Directories are 0700, files 0600, every file fsynced. Without a process group (a world of
    one, outside a launcher) the main process writes alone, and the others only return its
    path. The directory is DCP's format:
    ``torch.distributed.checkpoint.load`` reads it too. Keep ``state`` to tensors, numbers,
    strings and plain containers so that ``load_checkpoint`` reads it without
    ``weights_only=False``.

    DeepSpeed (``mode="deepspeed"``): pass the ``deepspeed.DeepSpeedEngine`` itself, or a dict
    holding the engine and your own entries (``{"engine": engine, "epoch": 3}``: DeepSpeed's
    ``client_state``, every rank holding the same). Every rank calls
    ``engine.save_checkpoint(<checkpoint_dir>, tag="step-<9 digits>")``, so the step directory
    holds DeepSpeed's own files (``zero_to_fp32.py`` reads it, given ``--tag step-<9 digits>``);
    DeepSpeed's ``latest`` file is not written. Then the same rule: made 0600/0700 and
    fsynced, and the marker (format "deepspeed", world sizes, ZeRO stage) written last by
    global rank 0; ``keep_last`` as above. ``async_`` is for state dicts only.

    Example:
        >>> state = {"model": model.state_dict(), "optim": optim.state_dict()}  # doctest: +SKIP
        >>> runtime.save_checkpoint(state, step, async_=True, keep_last=3)  # doctest: +SKIP
        >>> runtime.save_checkpoint({"engine": engine, "epoch": 3}, step)  # doctest: +SKIP

    Args:
        state: what to save, a dict with str keys (values with ``state_dict()``, such as a
            module, are saved as their state dict); or a DeepSpeed engine, alone or as one
            value of such a dict (the other values are its client state).
        step: the step it was taken after, 0 to 999999999.
        async_: return once the state is copied to host memory and write it while training
            goes on; its marker is written when the write finishes. The next
            ``save_checkpoint`` or ``load_checkpoint`` waits for it first, and so does the
            end of the rank's function; a failed write raises there, naming its step (that
            call does nothing else: call it again). One asynchronous save is in flight at a
            time.
        keep_last: after this checkpoint is committed, remove all but the newest
            ``keep_last`` committed checkpoints (never the one just written), and step
            directories left uncommitted before the newest one. Only sparkdist's own step
            directories are removed; old single-file checkpoints are kept. None keeps all.

    Returns:
        The checkpoint's directory.

    Raises:
        RuntimeError: no ``checkpoint_dir``; a writing rank failed (the message names it and
            its error); or something sparkdist did not write is in the way of the step's
            directory.
        TypeError: ``state`` is not a dict with str keys, holds more than one DeepSpeed
            engine, or ``step`` is not an int.
        ValueError: ``step`` or ``keep_last`` out of range; with an engine, ``async_=True``,
            a client state key DeepSpeed uses itself, or a decoupled DeepSpeed checkpoint
            engine.
    """
    return _checkpoints.save(
        state, step, writer=is_main_process(), async_=async_, keep_last=keep_last
    )


def load_checkpoint(
    into: Any = None, *, map_location: Any = "cpu", weights_only: bool = True
) -> Checkpoint | None:
    """The latest committed, readable checkpoint of this run's ``checkpoint_dir``, or None.

    With ``into``, the state dict to fill (the template DCP loads into, with the keys and
    shapes saved: ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)``'s,
    FSDP2's shards included, then ``set_state_dict``; an optimizer's own ``state_dict()``
    holds no state to fill before its first step), it is loaded in place, resharded to the
    current world size (a checkpoint written by 4 ranks loads on 2), and the returned
    ``Checkpoint.state`` is ``into``. This is a collective call when a process group is up:
    every rank calls it, and they load the same checkpoint. Without ``into``, this rank reads
    the whole state into memory on its own (sharded tensors whole, on the CPU, then moved by
    ``map_location``), as it was saved; fine for DDP-sized state.

    Only directories with their commit marker count; the newest step wins. A checkpoint that
    cannot be read (damaged, cut short, not sparkdist's) is skipped with a warning naming it,
    and the one before it is tried. Single-file checkpoints of earlier versions
    (``step-<9 digits>.pt``) are read too, the newest step of either kind winning.

    By default only tensors, state dicts, numbers, strings and plain containers are loaded
    (``torch.load(weights_only=True)`` for each saved object, DCP's metadata built from its
    own classes only): a checkpoint holding anything else is refused, because unpickling
    arbitrary objects can run arbitrary code, and anyone who can write the checkpoint
    directory could have put such a file there. ``weights_only=False`` loads full pickles
    (your own classes, say): pass it only if you trust the files and everyone who can write
    the directory. Allowing just your classes, with ``torch.serialization.add_safe_globals``,
    keeps the protection on.

    DeepSpeed: pass the engine (or the dict of the engine and client-state keys it was saved
    with) as ``into``; every rank calls it. The newest committed checkpoint must be DeepSpeed's
    (one saved from state dicts is refused, and a DeepSpeed one given to a state dict too), and
    ``engine.load_checkpoint`` loads it with its optimizer and scheduler state; the client
    state fills the dict's other keys, and ``Checkpoint.state`` is ``into``. At another world
    size (ZeRO stage 1 to 3), global rank 0 first converts it, once, to DeepSpeed's universal
    checkpoint (``step-<9 digits>.universal/`` beside it) and the engine loads that, resharded;
    what DeepSpeed cannot load (another ZeRO stage, tensor or pipeline parallelism at another
    size) is refused before the engine is touched, saying what would load it. With
    ``weights_only``, DeepSpeed's files may hold its own data classes too (its loss scaler, its
    ZeRO stage), nothing else.

    Example:
        >>> from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        >>> model_state, optim_state = get_state_dict(model, optim)  # doctest: +SKIP
        >>> state = {"model": model_state, "optim": optim_state}  # doctest: +SKIP
        >>> latest = runtime.load_checkpoint(state)  # in place, resharded  # doctest: +SKIP
        >>> if latest is not None:  # doctest: +SKIP
        ...     set_state_dict(model, optim, model_state_dict=state["model"],
        ...                    optim_state_dict=state["optim"])
        >>> start = 0 if latest is None else latest.step  # doctest: +SKIP
        >>> latest = runtime.load_checkpoint({"engine": engine, "epoch": 0})  # doctest: +SKIP

    Args:
        into: the state dict to load into, in place; None to read the whole state; a
            DeepSpeed engine, alone or in a dict with its client-state keys. A str,
            ``torch.device`` or callable here is taken as ``map_location`` (the first
            parameter of earlier versions).
        map_location: as for ``torch.load``; with ``into``, for the saved objects that are not
            tensors (tensors go where ``into``'s are).
        weights_only: False to unpickle any object (runs whatever code the files name).

    Raises:
        pickle.UnpicklingError: with ``weights_only=True``, the newest readable checkpoint
            holds other objects; the message names them and the ways to load it.
        RuntimeError: no ``checkpoint_dir``; checkpoints are there but none can be read; an
            asynchronous save failed (naming its step); or the newest checkpoint is of the
            other format (DeepSpeed's, state dicts'), or cannot load into this engine.
        TypeError: ``into`` is neither a dict, an engine nor a ``map_location``; or
            ``map_location`` with an engine.
    """
    return _checkpoints.load(into, map_location=map_location, weights_only=weights_only)
