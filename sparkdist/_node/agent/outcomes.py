"""Turning an ended rank into its ``Outcome``: its exit code, the value or failure file it
wrote (``worker``), its last output lines, and whether the agent stopped it.

Failures are data here, never exceptions: the driver learns every rank's fate the same way.
The one exception is a detached node (``detached``), whose ranks' own failures are raised so
Spark stops the stage.

Non-goals: deciding the run's root cause (the driver); reading output (``output``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterable

from sparkdist._core.errors import RankFailure
from sparkdist._core.run_dir import failure_path, value_path
from sparkdist._node.agent.output import drain
from sparkdist._node.agent.ranks import RankHandle
from sparkdist._wire import protocol
from sparkdist._wire.detached_failures import DetachedFailure
from sparkdist._wire.payload import Outcome, ValueFile


def outcome_of(
    rank: RankHandle,
    run_dir: str,
    *,
    host: str,
    heartbeat_timeout_s: float | None,
    abort_reason: str | None,
) -> Outcome:
    """The Outcome of an exited ``rank`` whose files are in ``run_dir``.

    Args:
        rank: the rank, exited.
        run_dir: where it wrote its value or failure.
        host: this node's host, for the report.
        heartbeat_timeout_s: the node's hang limit, named when the rank hung.
        abort_reason: why the agent is ending its ranks, or None while it is not.
    """
    drain(rank)  # its last lines are complete only once its pumps are done
    seat, code = rank.seat, rank.exit_code()
    wall = (rank.ended or time.monotonic()) - rank.started
    value_file = value_path(run_dir, seat.rank)
    failure_file = failure_path(run_dir, seat.rank)
    # Our stop shows as SIGTERM or SIGKILL; a rank that died of something else (a segfault)
    # just before we reached it failed on its own.
    killed_by_us = rank.was_stopped(code) and rank.hung_for_s is None
    if code == 0 and os.path.exists(value_file):
        # Kept in its file (held open): the driver unpickles it from there, never holding
        # the value's bytes and the value at once.
        value = ValueFile(value_file)
        return Outcome(seat.rank, host, code, wall, value_bytes=value, ended_at=rank.ended_at)
    failure = _failure_of(rank, failure_file, code, host, heartbeat_timeout_s, abort_reason)
    return Outcome(
        seat.rank,
        host,
        code,
        wall,
        failure=failure,
        aborted=killed_by_us,
        ended_at=rank.ended_at,
    )


def _failure_of(
    rank: RankHandle,
    failure_file: str,
    code: int | None,
    host: str,
    heartbeat_timeout_s: float | None,
    abort_reason: str | None,
) -> RankFailure:
    last = tuple(rank.last_lines)
    if os.path.exists(failure_file):
        import cloudpickle

        with open(failure_file, "rb") as f:
            recorded: RankFailure = cloudpickle.load(f)
        return RankFailure(
            rank=recorded.rank,
            host=host,
            exit_code=code,
            exc_type=recorded.exc_type,
            message=recorded.message,
            traceback=recorded.traceback,
            last_lines=last,
            exception_bytes=recorded.exception_bytes,
            failed_at=getattr(recorded, "failed_at", None),  # None from an older worker
            diagnosis=getattr(recorded, "diagnosis", ""),
        )
    message = describe_exit(code)
    if rank.hung_for_s is not None:
        message = (
            f"hung: no heartbeat or report for {rank.hung_for_s:.1f} s "
            f"(heartbeat_timeout_s={heartbeat_timeout_s}); its stack is in its "
            "last output lines"
        )
    elif rank.was_stopped(code) and abort_reason is not None:
        # Our signal, not its own death (it may have exited just before we sent it).
        message = f"stopped by sparkdist: {abort_reason}"
    return RankFailure(
        rank=rank.seat.rank,
        host=host,
        exit_code=code,
        exc_type="",
        message=message,
        last_lines=last,
    )


def describe_exit(code: int | None) -> str:
    """What an exit code says about a rank that left no failure file."""
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process was killed by {name}"
    if code == 0:
        return "process exited with code 0 but wrote no result"
    return f"process exited with code {code} without raising a Python exception"


def detached_outcomes(outcomes: list[Outcome], kept: Iterable[protocol.Message]) -> list[Outcome]:
    """A detached node's result: ``outcomes`` with the ``kept`` output lines attached (what
    else was kept, progress reports, has no driver to go to).

    Raises:
        DetachedFailure: some ranks failed on their own (not stopped by us), in the order
            they ended, so Spark stops the stage and the driver names the root cause.
    """
    lines: dict[int, list[tuple[str, str]]] = {}
    for message in kept:
        if isinstance(message, protocol.Log):
            lines.setdefault(message.rank, []).append((message.stream.value, message.line))
    failures = sorted(
        (o for o in outcomes if o.failure is not None and not o.aborted),
        key=lambda o: o.ended_at,
    )
    if failures:
        raise DetachedFailure([o.failure for o in failures if o.failure is not None])
    return [dataclasses.replace(o, output=tuple(lines.get(o.rank, ()))) for o in outcomes]
