"""Replica groups (torchft): how a run of R groups is split, what each group's ranks are told,
and how the groups' results make the run's (pure).

A run with ``replica_groups=R`` is R groups of ``num_processes / R`` ranks. Each group is a run
of its own (its own barrier stage, store, channel and restarts: ``_engine.replica_groups``);
torchft's Lighthouse, on the driver, forms a quorum of the live groups at every step, and a
group that is lost and relaunched heals from a live peer. Here: the checks of the options, the
group's torchft variables and identity, and the merge of the groups' results.

Non-goals: starting anything (``_engine.replica_groups``, ``_engine.lighthouse``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sparkdist._core.env import (
    HOST_VAR,
    LIGHTHOUSE_VAR,
    NUM_REPLICA_GROUPS_VAR,
    REPLICA_GROUP_VAR,
)
from sparkdist._core.errors import Attempt, ClusterError, ConfigError, WorkerFailedError
from sparkdist._core.launch.checks import check_positive_int
from sparkdist._core.run.result import RankTimeline, RunResult

#: torchft numbers a rank across groups from the trailing digits of its group's replica id
#: (``Manager._global_rank``), so the id ends in the group's index.
REPLICA_ID_PREFIX = "replica_group_"


@dataclass(frozen=True)
class ReplicaGroup:
    """One group of a replica-group run.

    Attributes:
        index: the group's number, 0 first.
        count: how many groups the run has.
        lighthouse: the run's Lighthouse, as every rank reaches it (``http://ADDRESS:PORT``).
    """

    index: int
    count: int
    lighthouse: str

    @property
    def replica_id(self) -> str:
        """The group's replica id for torchft's ``Manager``."""
        return f"{REPLICA_ID_PREFIX}{self.index}"

    @property
    def name(self) -> str:
        """The group as logs and errors name it: ``replica group 1 of 3``."""
        return f"replica group {self.index} of {self.count}"

    def mlflow_tags(self) -> dict[str, str]:
        """The group's MLflow run's tags: its name in the MLflow UI, and its number."""
        return {"mlflow.runName": self.replica_id, "sparkdist.replica_group": str(self.index)}

    def env(self) -> dict[str, str]:
        """torchft's variables for every rank of the group."""
        return {
            LIGHTHOUSE_VAR: self.lighthouse,
            REPLICA_GROUP_VAR: str(self.index),
            NUM_REPLICA_GROUPS_VAR: str(self.count),
        }


def check_replica_groups(
    *,
    num_processes: int,
    replica_groups: int,
    min_replica_groups: int,
    min_processes: int | None,
    mode: str,
) -> None:
    """Refuse replica-group options that cannot work, naming the option and what works."""
    check_positive_int("replica_groups", replica_groups)
    check_positive_int("min_replica_groups", min_replica_groups)
    if min_replica_groups > replica_groups:
        raise ConfigError(
            f"min_replica_groups={min_replica_groups} is more than replica_groups="
            f"{replica_groups}; pass min_replica_groups between 1 and {replica_groups} (the "
            "fewest live groups a step may be taken with)"
        )
    if replica_groups == 1:
        return
    if num_processes % replica_groups:
        raise ConfigError(
            f"num_processes={num_processes} does not split into replica_groups="
            f"{replica_groups} groups of equal size; pass a num_processes that is a multiple "
            f"of {replica_groups} (each group runs num_processes / replica_groups ranks)"
        )
    if min_processes is not None:
        raise ConfigError(
            f"min_processes={min_processes} with replica_groups={replica_groups}: a replica "
            "group's size is fixed, and a lost group is relaunched while the others go on; "
            "drop min_processes (or replica_groups, for an elastic world restarted whole)"
        )
    if mode == "deepspeed":
        raise ConfigError(
            f"mode='deepspeed' with replica_groups={replica_groups}: torchft's replica groups "
            "average plain PyTorch gradients (DDP, or FSDP inside a group); use mode='ddp' or "
            "'fsdp', or drop replica_groups"
        )


def group_checkpoint_dir(checkpoint_dir: str, index: int) -> str:
    """Group ``index``'s own checkpoint directory under the run's ``checkpoint_dir``: every
    group saves the same weights, and two groups must never write one checkpoint."""
    return f"{checkpoint_dir.rstrip('/')}/{REPLICA_ID_PREFIX}{index}"


def merged_result(
    run_id: str, results: Sequence[RunResult], lost: Sequence[Attempt] = ()
) -> RunResult:
    """The result of run ``run_id`` from its finished groups' (in group order): every rank's
    value ordered by (group, rank), every group's attempts (``lost``: those of the groups lost
    for good), the first finished group's metrics (its MLflow run until the whole run's is
    set)."""
    first = results[0]
    offsets = _rank_offsets([len(r.values) for r in results])
    timeline: list[RankTimeline] = [
        dataclasses.replace(t, rank=t.rank + offset)
        for result, offset in zip(results, offsets, strict=True)
        for t in result.timeline
    ]
    return dataclasses.replace(
        first,
        run_id=run_id,
        values=[v for r in results for v in r.values],
        wall_times_s=[w for r in results for w in r.wall_times_s],
        hosts=[h for r in results for h in r.hosts],
        num_tasks=sum(r.num_tasks for r in results),
        dropped_lines=sum(r.dropped_lines for r in results),
        timeline=timeline,
        system_samples=[s for r in results for s in r.system_samples],
        attempts=sorted(
            [*(a for r in results for a in r.attempts), *lost],
            key=lambda a: (a.replica_group or 0, a.number),
        ),
    )


def lost_for_good(error: BaseException) -> bool:
    """Whether a group that ended with ``error`` is lost to faults of its hosts (its relaunches
    spent on ranks that died with no exception of the user's): the other groups go on without
    it. Anything else (an exception of the training code, a timeout, a start that cannot work)
    ends the run."""
    return isinstance(error, WorkerFailedError) and not error.root_cause.exc_type


def too_few_groups(
    lost: Mapping[int, WorkerFailedError], count: int, min_replica_groups: int
) -> ClusterError | None:
    """The run's error once fewer than ``min_replica_groups`` of its ``count`` groups are left
    (``lost``: each group lost for good, by number), naming each lost group and its hosts; None
    while enough are left."""
    left = count - len(lost)
    if left >= min_replica_groups:
        return None
    lines = [
        f"only {left} of {count} replica groups are left, fewer than min_replica_groups="
        f"{min_replica_groups}: every relaunch of these groups was spent on host faults, and "
        "every other group was stopped"
    ]
    for index, error in sorted(lost.items()):
        hosts = sorted({h for a in error.history for h in a.hosts} or {error.root_cause.host})
        lines.append(f"replica group {index} (on {', '.join(hosts)}): {error.root_cause.summary()}")
    return ClusterError("\n".join(lines))


def _rank_offsets(sizes: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def manager_kwargs(env: Mapping[str, str]) -> dict[str, object]:
    """What torchft's ``Manager`` needs beyond the model and its transport, from a rank's
    environment (``runtime.torchft_manager_kwargs``).

    Raises:
        RuntimeError: the rank is not in a replica-group run.
    """
    group = env.get(REPLICA_GROUP_VAR)
    if group is None or LIGHTHOUSE_VAR not in env:
        raise RuntimeError(
            "this rank is not in a replica-group run: torchft's variables are set for runs "
            "started with replica_groups=R (Distributor(..., replica_groups=R))"
        )
    return {
        "replica_id": ReplicaGroup(
            int(group), int(env.get(NUM_REPLICA_GROUPS_VAR, "1")), env[LIGHTHOUSE_VAR]
        ).replica_id,
        "lighthouse_addr": env[LIGHTHOUSE_VAR],
        # torchft advertises socket.gethostname() by default, loopback on many hosts: this
        # node's address, as the driver reached it, is what the other groups can reach.
        "hostname": env[HOST_VAR],
        "store_addr": env["MASTER_ADDR"],
        "store_port": int(env["MASTER_PORT"]),
        "rank": int(env["RANK"]),
        "world_size": int(env["WORLD_SIZE"]),
    }
