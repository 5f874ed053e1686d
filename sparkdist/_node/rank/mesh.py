"""HSDP and FSDP meshes for ``sparkdist.runtime``: ``device_mesh`` (shard groups of consecutive
ranks, which host-by-host numbering keeps on one host) and ``get_replica_rank``, defined here
and shown as ``sparkdist.runtime``'s.

Non-goals: numbering the ranks (``_core.numbering``).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from sparkdist._core.env import RANKS_PER_HOST_VAR
from sparkdist._core.launch.numbering import groups_across_hosts_warning
from sparkdist._core.world import global_rank, initialized_dist, uses_cuda, world_size

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_mesh", "get_replica_rank"]


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
        >>> nodes = runtime.world_size() // runtime.get_local_world_size()  # doctest: +SKIP
        >>> fully_shard(model, mesh=runtime.device_mesh(replicas=nodes))  # HSDP  # doctest: +SKIP
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    global _mesh_replicas
    world = world_size()
    shard = _shard_size(world, replicas)
    if replicas > 1:
        _warn_of_groups_across_hosts(world, replicas)
    device_type = "cuda" if uses_cuda() else "cpu"
    if replicas == 1:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(
            device_type, (replicas, shard), mesh_dim_names=("replicate", "shard")
        )
    # Remembered with the default group it was built on: a mesh of a group since destroyed (a
    # plain call of a decorated function ends its group) says nothing about the next one.
    _mesh_replicas = (dist.group.WORLD, _replica_rank_of(global_rank(), world, replicas))
    return mesh


def _warn_of_groups_across_hosts(world_size: int, replicas: int) -> None:
    """Warn (rank 0, once per mesh) when some HSDP shard groups cross hosts (``numbering``)."""
    listed = os.environ.get(RANKS_PER_HOST_VAR, "")
    if not listed or global_rank() != 0:
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
    dist = initialized_dist()
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
            "for HSDP use the number of nodes, e.g. replicas=world_size() // "
            "get_local_world_size()"
        )
    return world_size // replicas


def _replica_rank_of(rank: int, world_size: int, replicas: int) -> int:
    """The replica global rank ``rank`` belongs to under ``device_mesh(replicas)``: 0 for the
    1-D mesh, else its row of the (replicas, world_size // replicas) mesh (row-major, as
    ``init_device_mesh`` lays ranks out)."""
    return 0 if replicas == 1 else rank // _shard_size(world_size, replicas)


def get_replica_rank() -> int:
    """Which data-parallel replica this rank belongs to.

    Under the 2-D mesh ``("replicate", "shard")`` that ``device_mesh(replicas=r)`` built, it is
    the rank's index along "replicate" (``0 .. r - 1``: the ranks of one replica shard one copy
    of the model between them); under the 1-D mesh ``device_mesh()`` built (plain FSDP: one
    replica, sharded over every rank), 0. Without such a mesh every rank holds a whole replica
    (DDP), so it equals ``global_rank()``. The latest mesh ``device_mesh`` built in this
    process counts, while the process group it was built on is up.

    Example:
        >>> runtime.get_replica_rank()  # outside a rank, no mesh
        0
        >>> mesh = runtime.device_mesh(replicas=2)  # 8 ranks: 0-3 and 4-7  # doctest: +SKIP
        >>> runtime.get_replica_rank()  # on rank 5  # doctest: +SKIP
        1
    """
    recorded = _mesh_replica_rank()
    return global_rank() if recorded is None else recorded


for _public in (device_mesh, get_replica_rank):
    _public.__module__ = "sparkdist.runtime"
