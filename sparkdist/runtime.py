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
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is only imported by the helpers that need it
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "backend",
    "deepspeed_config",
    "deepspeed_config_path",
    "device",
    "device_mesh",
    "get_global_rank",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_world_size",
    "is_main_process",
    "mode",
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
