"""Inside a rank of a replica-group run: torchft's wiring, and gradient averaging that keeps
the surviving groups alive when a peer dies mid-step.

``torchft_manager_kwargs`` is what torchft's ``Manager`` needs beyond the model (the group's
identity, the Lighthouse, this node's address, the group's store, rank and size), and, given
the replica process group, a checkpoint transport over that group: torchft's default transport
advertises ``socket.gethostname()``, which resolves to loopback on many hosts, so a relaunched
group could not heal from it.

``average_gradients`` averages every gradient over the groups in the quorum with
``manager.allreduce`` (one flat buffer, as DDP's buckets): a peer that dies mid-step makes the
step's ``should_commit`` say no (the step is not taken, the survivors go on). torchft's own
``DistributedDataParallel`` wrapper instead ends the survivors when a peer dies during its
allreduce (its comm hook asserts on a future that torchft's ``_ManagedWork.wait()`` left empty
after swallowing the error; torchft 0.2.0).

Non-goals: starting groups or the Lighthouse (``_engine.replica_groups``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sparkdist._core.env import NUM_REPLICA_GROUPS_VAR, REPLICA_GROUP_VAR, device_index
from sparkdist._core.launch.replica_groups import manager_kwargs
from sparkdist._core.world import int_env, uses_cuda

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

#: How long healing from a peer may take before torchft gives up on it.
HEAL_TIMEOUT = timedelta(seconds=60)


def replica_group() -> int:
    """This rank's replica group (0 outside a replica-group run)."""
    return int_env(REPLICA_GROUP_VAR, 0)


def num_replica_groups() -> int:
    """How many replica groups the run has (1 outside a replica-group run)."""
    return int_env(NUM_REPLICA_GROUPS_VAR, 1)


def torchft_manager_kwargs(pg: ProcessGroup | None = None) -> dict[str, Any]:
    """Keyword arguments for torchft's ``Manager`` beyond the model: ``replica_id``,
    ``lighthouse_addr``, ``hostname`` (this node's address), ``store_addr``, ``store_port``,
    ``rank`` and ``world_size`` (inside the group); with ``pg`` (the process group given to
    the ``Manager``), also a ``checkpoint_transport`` that heals over it.

    Raises:
        RuntimeError: not inside a rank of a run started with ``replica_groups``.

    Example:
        >>> pg = torchft.ProcessGroupGloo()  # doctest: +SKIP
        >>> manager = torchft.Manager(pg=pg, min_replica_size=1, load_state_dict=load,
        ...     state_dict=save, **runtime.torchft_manager_kwargs(pg))  # doctest: +SKIP
    """
    kwargs: dict[str, Any] = manager_kwargs(os.environ)
    if pg is not None:
        import torch
        from torchft.checkpointing.pg_transport import PGTransport

        device = (
            torch.device("cuda", device_index(os.environ)) if uses_cuda() else torch.device("cpu")
        )
        kwargs["checkpoint_transport"] = PGTransport(pg, timeout=HEAL_TIMEOUT, device=device)
    return kwargs


def average_gradients(manager: Any, module: torch.nn.Module) -> None:
    """Average every gradient of ``module`` over the replica groups in the step's quorum, in
    place, with torchft's ``manager.allreduce`` (sharded gradients: each rank's own shard,
    which the same rank of every other group holds too).

    The gradients travel as one flat buffer per dtype and device (one allreduce, as DDP's
    buckets, rather than one per parameter). Call it after ``backward()`` and before the
    optimizer step (torchft's ``Optimizer`` wrapper then commits the step only when every
    group's allreduce succeeded).
    """
    import torch

    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for parameter in module.parameters():
        grad = parameter.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's shard
        buckets.setdefault((local.dtype, local.device), []).append(local)
    works = []
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        works.append((manager.allreduce(flat), flat, grads))
    for work, flat, grads in works:
        work.wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


for _public in (replica_group, num_replica_groups, torchft_manager_kwargs, average_gradients):
    _public.__module__ = "sparkdist.runtime"  # documented, and shown, as runtime's helpers
