"""Helpers to call inside a rank: where am I in the world?

The names are those of Databricks' serverless GPU API, so code written for it runs unchanged.
They read torchrun's environment, so they also answer correctly under plain torchrun; outside
any launcher they describe a world of one (rank 0, size 1, main process).

Example:
    >>> from sparkdist import runtime
    >>> runtime.get_world_size()  # outside a rank
    1
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is only imported by the helpers that need it
    import torch
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
    "get_world_size",
    "heartbeat",
    "is_main_process",
    "load_checkpoint",
    "mode",
    "report",
    "restart_count",
    "save_checkpoint",
]


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def get_global_rank() -> int:
    """This process's rank in the whole world (0 outside a rank)."""
    return _int_env("RANK", 0)


def get_local_rank() -> int:
    """This process's rank on its node; also the index of its GPU (0 outside a rank)."""
    return _int_env("LOCAL_RANK", 0)


def get_world_size() -> int:
    """Number of ranks in the run (1 outside a rank)."""
    return _int_env("WORLD_SIZE", 1)


def get_local_world_size() -> int:
    """Number of ranks on this node (1 outside a rank)."""
    return _int_env("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """Index of this node (Spark barrier task) in the run (0 outside a rank)."""
    return _int_env("NODE_RANK", _int_env("GROUP_RANK", 0))


def is_main_process() -> bool:
    """True on global rank 0 (and outside a rank): the process that should log and save."""
    return get_global_rank() == 0


def mode() -> str:
    """The launch mode of this run: "ddp", "fsdp" or "deepspeed" ("ddp" outside a rank)."""
    return os.environ.get("SPARKDIST_MODE", "ddp")


def _uses_cuda() -> bool:
    if os.environ.get("SPARKDIST_USE_GPU") == "0":
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
    """A device mesh for FSDP2 (call after ``init_process_group``).

    ``replicas=1`` gives the 1-D mesh ("shard",) over all ranks: plain FSDP. ``replicas=r > 1``
    gives the 2-D mesh ("replicate", "shard") of shape (r, world_size // r) for HSDP:
    parameters are sharded within each group of world_size // r ranks (typically one node) and
    replicated across the r groups.

    Example:
        >>> from torch.distributed.fsdp import fully_shard  # doctest: +SKIP
        >>> fully_shard(model, mesh=runtime.device_mesh())  # doctest: +SKIP

    Raises:
        ValueError: ``replicas`` does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = get_world_size()
    if replicas < 1 or world % replicas:
        raise ValueError(
            f"replicas={replicas} must be a positive divisor of the world size ({world}); "
            "for HSDP use the number of nodes, e.g. replicas=get_world_size() // "
            "get_local_world_size()"
        )
    device_type = "cuda" if _uses_cuda() else "cpu"
    if replicas == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
    )


def deepspeed_config_path() -> str | None:
    """Path of the DeepSpeed config file shipped to this rank (mode "deepspeed"), or None."""
    return os.environ.get("SPARKDIST_DEEPSPEED_CONFIG") or None


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

    _worker.send_to_agent({"t": "beat"})


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
    message = protocol.Report(
        rank=0,  # the agent stamps the real rank
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
    wire = protocol.wire_dict(message)
    del wire["rank"]
    _worker.send_to_agent(wire)


# -- checkpoints ---------------------------------------------------------------------------

_CHECKPOINT_FILE = re.compile(r"^step-(\d{9})\.pt$")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: the step it was taken after, the saved state, and its file."""

    step: int
    state: Any
    path: str


def checkpoint_dir() -> str | None:
    """The run's checkpoint directory (``checkpoint_dir=`` of the launcher), or None."""
    return os.environ.get("SPARKDIST_CHECKPOINT_DIR") or None


def save_checkpoint(state: Any, step: int) -> str:
    """Save ``state`` as the checkpoint of ``step``, atomically, from the main process.

    Every rank must call it (it synchronises the ranks when a process group is up, so no
    rank runs ahead of a checkpoint that is not written yet); only global rank 0 writes.
    The file is ``<checkpoint_dir>/step-<step, 9 digits>.pt`` holding
    ``{"step": step, "state": state}`` (``torch.save``), written to a temporary name and
    renamed, so a crash never leaves a partial checkpoint behind. Gather sharded state
    (FSDP, ZeRO-3) into ``state`` first, or save per-rank state under your own names.

    Returns:
        The checkpoint's path.

    Raises:
        RuntimeError: the launcher was given no ``checkpoint_dir``.
    """
    import torch

    directory = _require_checkpoint_dir()
    path = os.path.join(directory, f"step-{int(step):09d}.pt")
    _barrier()
    if is_main_process():
        temporary = f"{path}.tmp-{os.getpid()}"
        torch.save({"step": int(step), "state": state}, temporary)
        os.replace(temporary, path)
    _barrier()
    return path


def load_checkpoint(map_location: Any = "cpu") -> Checkpoint | None:
    """The latest complete checkpoint of this run's ``checkpoint_dir``, or None.

    Example:
        >>> latest = runtime.load_checkpoint()  # doctest: +SKIP
        >>> start = 0 if latest is None else latest.step  # doctest: +SKIP
    """
    import torch

    directory = _require_checkpoint_dir()
    steps = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(directory)
        if (m := _CHECKPOINT_FILE.match(name))
    )
    if not steps:
        return None
    path = os.path.join(directory, steps[-1][1])
    saved = torch.load(path, map_location=map_location, weights_only=False)
    return Checkpoint(step=int(saved["step"]), state=saved["state"], path=path)


def _require_checkpoint_dir() -> str:
    directory = checkpoint_dir()
    if directory is None:
        raise RuntimeError(
            "no checkpoint directory: pass checkpoint_dir=... to the launcher (shared storage "
            "every rank can reach, on a cluster)"
        )
    return directory


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
