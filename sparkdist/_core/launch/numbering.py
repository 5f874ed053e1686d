"""Ranks numbered host by host, as torchrun numbers them: a pure function of the task list.

A Spark barrier stage hands its tasks to the executors' offers one per offer per round, so
partition ids interleave over the hosts (``[h1, h2, h1, h2]`` with one executor per host). If
ranks followed partition ids, every "node" would be one task: ``LOCAL_RANK`` 0 and
``LOCAL_WORLD_SIZE`` 1 everywhere, and HSDP's shard groups of consecutive ranks would span the
network. So a node is a *host*: hosts are numbered in the order of their first task, the ranks
of a host are consecutive, and inside a host they go by partition id, then by the task's own
GPU order. Every task computes the same numbering from ``getTaskInfos()`` (every task's host,
no barrier sync), and so does the driver from the hosts its agents report.

The GPUs follow the same order: every rank of a host sees every GPU of the host's tasks, in
local-rank order (``host_visible_devices``), so ``cuda:LOCAL_RANK`` is the rank's own GPU and
NCCL sees its peers on the host (it needs them visible to use CUDA IPC between processes, its
NVLink path; see docs/launching.md).

Non-goals: spawning, reading Spark, choosing the GPUs (Spark does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sparkdist._core.env import RankSeat


def host_groups(task_hosts: Sequence[str]) -> list[list[int]]:
    """The tasks of each host: hosts in the order of their first task, tasks by partition id.

    >>> host_groups(["h1", "h2", "h1", "h2"])
    [[0, 2], [1, 3]]
    """
    groups: dict[str, list[int]] = {}
    for task, host in enumerate(task_hosts):
        groups.setdefault(host, []).append(task)
    return list(groups.values())


def seats_by_task(task_hosts: Sequence[str], processes_per_task: int) -> list[list[RankSeat]]:
    """Every task's seats (the list's index is the partition id), numbered host by host.

    Args:
        task_hosts: each barrier task's host, by partition id (as ``getTaskInfos()`` gives them).
        processes_per_task: ranks each task runs (one per GPU of the task).
    """
    groups = host_groups(task_hosts)
    host_sizes = tuple(len(tasks) * processes_per_task for tasks in groups)
    world_size = sum(host_sizes)
    seats: list[list[RankSeat]] = [[] for _ in task_hosts]
    first_rank = 0
    for node_rank, tasks in enumerate(groups):
        for position, task in enumerate(tasks):
            for index in range(processes_per_task):
                local_rank = position * processes_per_task + index
                seats[task].append(
                    RankSeat(
                        rank=first_rank + local_rank,
                        local_rank=local_rank,
                        node_rank=node_rank,
                        world_size=world_size,
                        local_world_size=host_sizes[node_rank],
                        num_nodes=len(groups),
                        task=task,
                        slot=index,
                        host_sizes=host_sizes,
                    )
                )
        first_rank += host_sizes[node_rank]
    return seats


def seats_of_task(task: int, task_hosts: Sequence[str], processes_per_task: int) -> list[RankSeat]:
    """The seats barrier task ``task`` runs (see ``seats_by_task``)."""
    return seats_by_task(task_hosts, processes_per_task)[task]


def task_of_rank(rank: int, task_hosts: Sequence[str], processes_per_task: int) -> tuple[int, int]:
    """The task that runs global rank ``rank``, and the rank's index among that task's ranks
    (its GPU's position in the task's own GPU list).

    Raises:
        ValueError: no task runs ``rank``.
    """
    for task, seats in enumerate(seats_by_task(task_hosts, processes_per_task)):
        for index, seat in enumerate(seats):
            if seat.rank == rank:
                return task, index
    raise ValueError(f"rank {rank} is outside a world of {len(task_hosts)} task(s)")


def host_visible_devices(
    task: int, task_hosts: Sequence[str], task_gpus: Sequence[str]
) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the ranks of ``task``: the GPUs of every task on its host,
    in local-rank order (tasks by partition id, each task's GPUs in Spark's order). None when
    two tasks of the host name the same GPU: their executors each see GPUs of their own (a
    container per executor numbers its GPUs from 0), so no list names them all; each rank
    then keeps its task's GPUs (``isolated_gpu_hosts``).

    Args:
        task: the barrier task (partition id).
        task_hosts: each task's host, by partition id.
        task_gpus: each task's GPUs as a comma list, by partition id.

    >>> host_visible_devices(1, ["h1", "h2", "h1", "h2"], ["0", "0", "1", "1"])
    '0,1'
    """
    (tasks,) = [tasks for tasks in host_groups(task_hosts) if task in tasks]
    gpus = [gpu for t in tasks for gpu in task_gpus[t].split(",") if gpu]
    return ",".join(gpus) if len(set(gpus)) == len(gpus) else None


def isolated_gpu_hosts(task_hosts: Sequence[str], task_gpus: Sequence[str]) -> list[str]:
    """The hosts where two tasks name the same GPU (see ``host_visible_devices``): there a
    rank's ``LOCAL_RANK`` counts the host's ranks, but it sees only its own task's GPUs.

    >>> isolated_gpu_hosts(["h1", "h1", "h2"], ["0", "0", "0"])
    ['h1']
    """
    return [
        task_hosts[tasks[0]]
        for tasks in host_groups(task_hosts)
        if host_visible_devices(tasks[0], task_hosts, task_gpus) is None
    ]


def isolated_gpus_warning(task_hosts: Sequence[str], task_gpus: Sequence[str]) -> str | None:
    """What the driver warns of when some hosts' executors each see GPUs of their own (None:
    every rank sees its host's GPUs in local-rank order)."""
    isolated = isolated_gpu_hosts(task_hosts, task_gpus)
    if not isolated:
        return None
    return (
        f"on {', '.join(isolated)} the executors name the same GPUs (each sees GPUs of its own, "
        "as with a container per executor), so each rank sees only its own task's GPUs there "
        "while LOCAL_RANK counts every rank of the host: runtime.device() is right, "
        "torch.cuda.set_device(LOCAL_RANK) is not; let each executor see the host's GPUs "
        "under their own numbers (a discovery script that prints them), or use runtime.device()"
    )


def known_task_hosts(node_hosts: Mapping[int, str], num_tasks: int) -> list[str]:
    """Every task's host as far as the driver heard (its agent's hello), by partition id; a
    task not heard of counts as a host of its own (the numbering is then a best guess: every
    agent says hello before any rank runs)."""
    return [node_hosts.get(task, f"task {task}, not heard of") for task in range(num_tasks)]


def seats_of_placeholder_hosts(num_tasks: int, processes_per_task: int) -> list[list[RankSeat]]:
    """The numbering when the tasks' hosts are not known (local mode, a plan made before Spark
    placed the tasks): each task a host of its own, its ranks consecutive."""
    return seats_by_task([f"task {t}" for t in range(num_tasks)], processes_per_task)


def shard_groups_across_hosts(host_sizes: Sequence[int], shard_size: int) -> dict[int, list[int]]:
    """The shard groups (``shard_size`` consecutive ranks each: HSDP's "shard" dimension) that
    cross the network: group index to the node ranks (hosts) it spans.

    With equal hosts and a shard size that divides the ranks of a host or is a multiple of
    them, host-by-host numbering keeps every group inside one host, or makes it whole hosts
    (a replica larger than a host, as asked): nothing to say. Otherwise every group on more
    than one host is listed.

    >>> shard_groups_across_hosts([2, 2], 2)
    {}
    >>> shard_groups_across_hosts([2, 1, 1], 2)
    {1: [1, 2]}
    """
    sizes = set(host_sizes)
    if len(sizes) == 1:
        (size,) = sizes
        if size % shard_size == 0 or shard_size % size == 0:
            return {}
    host_of_rank = [host for host, size in enumerate(host_sizes) for _ in range(size)]
    spanning = {}
    for group, first in enumerate(range(0, len(host_of_rank), shard_size)):
        hosts = sorted(set(host_of_rank[first : first + shard_size]))
        if len(hosts) > 1:
            spanning[group] = hosts
    return spanning


def groups_across_hosts_warning(host_sizes: Sequence[int], replicas: int) -> str | None:
    """What ``runtime.device_mesh(replicas)`` warns of when some HSDP shard groups cross the
    network (None: every group is on one host, or whole hosts)."""
    shard_size = sum(host_sizes) // replicas
    spanning = shard_groups_across_hosts(host_sizes, shard_size)
    if not spanning:
        return None
    groups = "; ".join(
        f"group {group} (ranks {group * shard_size}-{(group + 1) * shard_size - 1}) spans "
        f"nodes {', '.join(map(str, hosts))}"
        for group, hosts in spanning.items()
    )
    return (
        f"device_mesh(replicas={replicas}): {len(spanning)} of {replicas} shard group(s) of "
        f"{shard_size} rank(s) cross hosts, so their all-gathers and reduce-scatters go over "
        f"the network: {groups} (ranks per node: {list(host_sizes)}); each group stays on one "
        "host when every host runs the same number of ranks and the group size divides it or "
        "is a multiple of it"
    )
