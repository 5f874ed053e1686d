"""What the next restart may do, given a run's attempts (``errors.Attempt``: the hosts each
ran on and how it ended) (pure).

``max_restarts`` counts restarts of the whole job, never per node. On top of that budget:

- a failure before every rank started (a bad image, an import error, a missing package on a
  node) is retried once, not blindly: a second attempt in a row that fails before starting
  would fail the same way a third time;
- the executors an attempt lost contact with, and its executors on a host where its root cause
  struck for the second time in the run, are given up before the next attempt
  (``Backend.give_up_nodes``): a cut-off host's executor stays listed by Spark for minutes,
  and a task placed there would never answer. Only the failed attempt's executors: one that
  joined later at the same address (the host came back, a new machine took its address) is new
  capacity, and the cluster manager may start one there at once (the target is kept);
- an attempt that drained to grow (``Attempt.grew``: an elastic run's capacity came back) is
  restarted at the larger world without using ``max_restarts``, and is no preemption;
- a preempted attempt (``Attempt.preempted``: a SIGTERM reached a rank or an agent; the ranks
  drained) is restarted without using ``max_restarts``: the cluster took the capacity back,
  the job did nothing wrong. Preemptions are counted apart, and ``PREEMPTIONS_IN_A_ROW`` of
  them in a row *without a newer checkpoint* end the run (a cluster that takes the capacity
  back before any progress would restart it forever); a run that checkpoints between
  preemptions goes on however often it is preempted.

- in a replica-group run (``replica_groups``), a group whose last two attempts failed with the
  same exception (type and message) is not relaunched again: a lost host fails with no
  exception of the user's, and a bug in the user's code fails the same way every time.

Non-goals: running the attempts (``_engine.launch``), finding the root cause (``run_state``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from sparkdist._core.errors import Attempt, ClusterError, RankFailure, WorkerFailedError
from sparkdist._core.run.growth import GROW_NOTICE
from sparkdist._core.run.run_state import RunState

#: A host where this many attempts' root causes struck has its executors given up (and again at
#: each later strike there).
HOST_FAILURES_TO_AVOID = 2
#: Attempts in a row that may fail before every rank started; then no more restarts.
START_FAILURES_IN_A_ROW = 2
#: Attempts in a row that may be preempted; the next preemption ends the run.
PREEMPTIONS_IN_A_ROW = 3


def start_failures_stop(attempts: Sequence[Attempt]) -> str | None:
    """Why no restart may follow ``attempts`` however many ``max_restarts`` allows: the last
    ones in a row all failed before every rank started; None otherwise."""
    recent = attempts[-START_FAILURES_IN_A_ROW:]
    if len(recent) == START_FAILURES_IN_A_ROW and all(a.before_start for a in recent):
        return (
            f"not restarted again: {START_FAILURES_IN_A_ROW} attempts in a row failed before "
            "every rank started (an import error, a bad environment or a missing package on "
            "a node fails the same way each time); fix the cause and launch again"
        )
    return None


def repeated_failure_stop(attempts: Sequence[Attempt]) -> str | None:
    """Why a replica group may not be relaunched after ``attempts``: its last two failed with
    the same exception of the user's code; None otherwise (a host lost raises none)."""
    if len(attempts) < 2:
        return None
    first, second = attempts[-2].failure, attempts[-1].failure
    if first is None or second is None:
        return None
    if not first.exc_type or (first.exc_type, first.message) != (second.exc_type, second.message):
        return None
    return (
        f"not relaunched again: its last two attempts failed with the same {second.exc_type} "
        "(a fault in the training code fails the same way each time, where a lost host "
        "raises nothing); every other replica group was stopped"
    )


def failed_attempts(attempts: Sequence[Attempt]) -> int:
    """How many of ``attempts`` failed: what ``max_restarts`` counts (preemptions and grows
    are not)."""
    return sum(1 for a in attempts if not a.preempted and not a.grew)


def preemption_error(attempts: Sequence[Attempt]) -> ClusterError | None:
    """The error the run ends with after a preempted attempt (the last of ``attempts``): the
    last ``PREEMPTIONS_IN_A_ROW`` were all preempted; None: it restarts."""
    recent = attempts[-PREEMPTIONS_IN_A_ROW:]
    stuck = [a for a in recent if a.preempted and not a.progressed]
    if len(recent) < PREEMPTIONS_IN_A_ROW or len(stuck) < PREEMPTIONS_IN_A_ROW:
        return None
    lines = [
        f"the run was preempted {PREEMPTIONS_IN_A_ROW} times in a row without committing a "
        "newer checkpoint and is not restarted again (preemptions do not use max_restarts, "
        "and a run that checkpoints between them goes on however often it is preempted, but "
        "the cluster kept taking the capacity back before any progress); its last checkpoint "
        "is kept: launch it again once the cluster can hold it",
        *(a.summary() for a in attempts),
    ]
    return ClusterError("\n".join(lines))


def nodes_to_give_up(
    attempts: Sequence[Attempt], node_hosts: Mapping[int, str], lost: Collection[int]
) -> set[int]:
    """The nodes of the last of ``attempts`` whose executors the next attempt must not use:
    the ``lost`` ones (it lost contact with them: killed, or cut off), and those on the host of
    its root cause once ``HOST_FAILURES_TO_AVOID`` attempts' root causes struck there.
    ``node_hosts``: each node's host in that attempt."""
    nodes = set(lost)
    last = attempts[-1].failure if attempts else None
    if last is not None and last.host:
        struck = sum(1 for a in attempts if a.failure is not None and a.failure.host == last.host)
        if struck >= HOST_FAILURES_TO_AVOID:
            nodes |= {node for node, host in node_hosts.items() if host == last.host}
    return nodes


def attempt_of(
    state: RunState, number: int, failure: RankFailure | None = None, grow: str | None = None
) -> Attempt:
    """An attempt for the run's history, from its run state: its nodes' hosts and world size,
    its root cause, and whether that rank failed before it ever joined (an import error, a bad
    environment); or, when a drain ended it, why: a preemption notice (``preempted``), or the
    driver's own drain to grow (``grow``: that drain's notice; ``grew``)."""
    hosts = tuple(state.node_hosts.get(n, "?") for n in range(state.num_nodes))
    if state.was_preempted and grow is not None and state.preempted == grow:
        return Attempt(
            number, hosts, grew=grow.removeprefix(GROW_NOTICE), world_size=state.world_size
        )
    if state.was_preempted:
        return Attempt(number, hosts, preempted=state.preempted, world_size=state.world_size)
    before_start = failure is not None and failure.rank not in state.joined
    return Attempt(number, hosts, failure, before_start, world_size=state.world_size)


def final_error(
    history: Sequence[Attempt],
    failed: WorkerFailedError,
    max_restarts: int,
    *,
    replica_group: bool = False,
    no_restart: str | None = None,
) -> WorkerFailedError | None:
    """The error the run ends with after ``failed`` (the last attempt of ``history``), or None
    when it restarts: with every attempt and its hosts once there were several.
    ``replica_group``: ``history`` is one replica group's (``repeated_failure_stop``);
    ``no_restart``: why it restarts no more whatever its budget (a replica group whose peers
    finished)."""
    stop = start_failures_stop(history) or no_restart
    if stop is None and replica_group:
        stop = repeated_failure_stop(history)
    budget_left = failed_attempts(history) <= max_restarts
    if budget_left and stop is None:
        return None
    if len(history) == 1 and not replica_group:  # a group's error always carries its history
        return failed
    return WorkerFailedError(
        failed.failures,
        failed.root_cause,
        tuple(a.failure for a in history[:-1] if a.failure is not None),
        tuple(history),
        stop if budget_left and stop is not None else "",
    )
