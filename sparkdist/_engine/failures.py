"""Turning how an attempt ended into the error its caller gets: the caller's own stop, a failed
Spark stage or local agent, or failed ranks with the root cause first (by the ranks' own
timestamps, ``run_state.root_cause``).

Non-goals: deciding when an attempt ended (``supervisor``, ``_core.run_state``).
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Mapping

from sparkdist._core.errors import (
    ClusterError,
    ConfigError,
    RankFailure,
    RendezvousError,
    RunTimeoutError,
    WorkerFailedError,
)
from sparkdist._core.run.run_state import (
    CHANNEL_CLOSED,
    FailureTiming,
    RunState,
    StopCause,
    root_cause,
)
from sparkdist._wire.detached_failures import failures_in
from sparkdist._wire.payload import Outcome, loads

#: Spark's words for a task whose executor went away (``ExecutorLostFailure (executor 2
#: exited ...) Reason: ...``), and for the executor's JVM gone under a task.
_EXECUTOR_LOST = re.compile(
    r"ExecutorLostFailure.*|Executor heartbeat timed out.*|"
    r"Remote RPC client disassociated.*"
)


def caller_stop_error(cause: StopCause | None, reason: str) -> BaseException:
    """What the caller gets for a run it stopped, or that ran out of time."""
    if cause is StopCause.TIMED_OUT:
        return RunTimeoutError(reason)
    if cause is StopCause.START_TIMED_OUT:
        return RendezvousError(reason)
    return concurrent.futures.CancelledError("the run was cancelled; every rank was stopped")


def stage_failure(
    error: BaseException,
    state: RunState,
    failure_codes: Mapping[int, int],
    *,
    in_process: bool = False,
) -> BaseException:
    """The agents' side itself failed (an executor died, a task raised before its agent ran,
    a detached node reported its ranks' failures in its task error)."""
    if isinstance(error, (ClusterError, ConfigError, WorkerFailedError)):
        return error  # the stage's own verdict (an empty DataFrame: ``stage``)
    detached = {f.rank: f for f in failures_in(str(error))}
    if detached:
        failed = WorkerFailedError(detached, detached[root_of(detached, state, {})])
        failed.__cause__ = error
        return failed
    summary = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    failures = {
        rank: RankFailure(
            rank=rank,
            host="",
            exit_code=failure_codes.get(rank),
            exc_type="",
            message=f"failed; its details were lost with the Spark stage ({summary})",
        )
        for rank in state.failed_ranks
    }
    seats = state.seats_by_node()
    spark_saw = spark_view(str(error))
    for node, lost in state.lost.items():
        host = state.node_hosts.get(node, "")
        ranks = [seat.rank for seat in seats[node]]
        how = lost.how or CHANNEL_CLOSED
        for rank in ranks:
            failures.setdefault(
                rank,
                RankFailure(
                    rank=rank,
                    host=host,
                    exit_code=None,
                    exc_type="",
                    message=f"lost with its node {node} (host {host or '?'}, rank(s) "
                    f"{ranks[0]}-{ranks[-1]}): the driver saw that {how}; {spark_saw}",
                    # Its last word: it went wrong after that, and anything a healthy node's
                    # ranks did when it vanished (a peer's reset in gloo) comes later.
                    failed_at=lost.last_heard or None,
                ),
            )
    if failures:
        failed = WorkerFailedError(failures, failures[root_of(failures, state, {})])
        failed.__cause__ = error
        return failed
    if in_process:
        where, hint = "the local agent", "the traceback below has the cause"
    else:
        where, hint = "the Spark barrier stage", "see the executor logs for the cause"
    cluster = ClusterError(f"{where} failed before the ranks reported: {summary}; {hint}")
    cluster.__cause__ = error
    return cluster


def spark_view(stage_error: str) -> str:
    """What Spark's own error says of a lost node, in a clause: its executor lost too (with
    Spark's reason), or not (yet): a cut-off executor stays "running" for Spark until its
    heartbeat timeout, minutes later."""
    for line in stage_error.splitlines():
        found = _EXECUTOR_LOST.search(line)
        if found is not None:
            return f"Spark saw its executor lost too ({found.group(0)[:300]})"
    return "Spark had not yet seen its executor lost when sparkdist ended the stage"


def failure_error(
    failures: dict[int, RankFailure], state: RunState, by_rank: dict[int, Outcome]
) -> WorkerFailedError:
    """The error for ranks that failed (their own failures first), its cause the root's."""
    # Ranks sparkdist stopped because the run was ending are consequences, reported only
    # when nobody failed on their own.
    own = {r: f for r, f in failures.items() if not (r in by_rank and by_rank[r].aborted)}
    failures = own or failures
    error = WorkerFailedError(failures, failures[root_of(failures, state, by_rank)])
    original = error.root_cause.exception_bytes
    if original is not None:
        try:
            cause = loads(original)
        except Exception:  # noqa: BLE001 - the exception's class may not exist here
            cause = None
        if isinstance(cause, BaseException):
            error.__cause__ = cause
    return error


def root_of(
    failures: Mapping[int, RankFailure], state: RunState, by_rank: Mapping[int, Outcome]
) -> int:
    """The root cause among ``failures``, by the ranks' own timestamps (``root_cause``)."""
    timings = []
    for rank, failure in failures.items():
        outcome = by_rank.get(rank)
        ended_at = (outcome.ended_at if outcome is not None else 0.0) or state.failure_seen_at.get(
            rank, 0.0
        )
        failed_at = failure.failed_at
        if failed_at is None and state.lost and ended_at:
            # Against a lost node (its time: its last word), a rank's exit as its agent saw it
            # counts as it is, without the credit an abrupt death gets: a healthy node's rank
            # that died of the lost node's vanishing (a reset in gloo) exits after that word.
            failed_at = ended_at
        timings.append(
            FailureTiming(
                rank=rank,
                failed_at=failed_at,
                ended_at=ended_at,
                aborted=outcome.aborted if outcome is not None else False,
                hung_since=state.hung_since.get(rank),
            )
        )
    return root_cause(timings)
