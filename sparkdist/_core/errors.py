"""The sparkdist exception tree.

::

    SparkdistError
    ├── ConfigError (also ValueError)        bad arguments, bad Spark conf, unpicklable function
    │   └── ConfigTypeError (also TypeError) an argument of the wrong type
    ├── ClusterError (also RuntimeError)     too few slots, no GPUs, SSL on, dynamic allocation on
    ├── RendezvousError                      a rank did not join in time
    ├── WorkerFailedError (also RuntimeError) one or more ranks failed
    └── RunTimeoutError (also TimeoutError)  the run exceeded timeout_s

``ClusterError`` and ``WorkerFailedError`` are also ``RuntimeError`` because that is what
pyspark's ``TorchDistributor`` raises in the same situations, so ``except RuntimeError`` in code
written for it keeps working after the import is swapped.

Every error pickles (its constructor arguments travel with it), so it survives a trip from an
executor or a worker process back to the driver. The classes present themselves as
``sparkdist.X`` (``__module__``), where users import them from; pickles name them so too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparkdist._core.tracebacks import (
    FULL_TRACEBACK_VAR,
    full_traceback_wanted,
    hide_frames,
    without_header,
)

#: A failure's message shows at most this many characters of an error message in its first line.
_MAX_HEADLINE_CHARS = 300
#: A failure's message shows at most this many distinct rendezvous diagnoses.
_MAX_DIAGNOSES = 3


class SparkdistError(Exception):
    """Base class of every error sparkdist raises on purpose."""

    __module__ = "sparkdist"


class ConfigError(SparkdistError, ValueError):
    """An argument, a Spark conf value or the training object is not usable."""

    __module__ = "sparkdist"


class ConfigTypeError(ConfigError, TypeError):
    """An argument of the wrong type (``env='X=1'``, ``checkpoint_dir=123``, an ``async def``
    training function): a ``ConfigError`` that ``except TypeError`` catches too."""

    __module__ = "sparkdist"


class ClusterError(SparkdistError, RuntimeError):
    """The cluster (or the driver machine) cannot host the run as configured."""

    __module__ = "sparkdist"


class RendezvousError(SparkdistError):
    """A rank did not join the run before the start-up deadline."""

    __module__ = "sparkdist"


class RunTimeoutError(SparkdistError, TimeoutError):
    """The run took longer than ``timeout_s``; every rank was killed."""

    __module__ = "sparkdist"


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed.

    Attributes:
        rank: global rank of the failed process.
        host: host the process ran on.
        exit_code: the process exit code (negative: killed by that signal), or None if unknown.
        exc_type: qualified name of the exception type, or "" when the process died without one.
        message: the exception message, or a description of how the process died.
        traceback: the formatted traceback text ("" when there is none).
        last_lines: the last lines the rank printed, oldest first.
        exception_bytes: the exception pickled with cloudpickle, when it could be.
        failed_at: wall-clock time taken inside the rank when its exception reached the top
            (None when it died without one); orders failures to find the root cause.
        diagnosis: for a failed rendezvous, which node could not reach which address and the
            fix, as the rank's own environment told it (``_core.rendezvous``); else "".
    """

    rank: int
    host: str
    exit_code: int | None
    exc_type: str
    message: str
    traceback: str = ""
    last_lines: tuple[str, ...] = ()
    exception_bytes: bytes | None = None
    failed_at: float | None = None
    diagnosis: str = ""

    def summary(self) -> str:
        """One line: what failed, where."""
        what = f"{self.exc_type}: {self.message}" if self.exc_type else self.message
        return f"rank {self.rank} on {self.host}: {what}"


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run.

    Attributes:
        number: 0 for the first, then each restart's count.
        hosts: each node's host, by node ("?" for a node that never reached the driver).
        failure: its root cause; None for the attempt that succeeded, or was preempted.
        before_start: it failed before every rank had joined the rendezvous.
        preempted: why and where it was preempted ("node 1 (host 10.0.0.3) got SIGTERM",
            "the driver got SIGTERM"); "" when it was not. A preempted attempt drained (its
            ranks saved and returned, or were stopped at ``preemption_grace_s``) and is
            restarted without using ``max_restarts``.
        progressed: it committed a newer checkpoint than the one it started from (what keeps
            a run that is preempted again and again going: ``attempts.preemption_error``).
        grew: why it drained to restart at a larger world (an elastic run's capacity came
            back: ``grow_after_s``); "" when it did not. Grows use no ``max_restarts`` and are
            no preemptions.
        world_size: how many ranks it ran (0 where not known).
        replica_group: in a replica-group run (``replica_groups``), the group it was an
            attempt of (its ``number`` counts that group's attempts); None otherwise.
    """

    number: int
    hosts: tuple[str, ...]
    failure: RankFailure | None = None
    before_start: bool = False
    preempted: str = ""
    progressed: bool = False
    grew: str = ""
    world_size: int = 0
    replica_group: int | None = None

    def summary(self) -> str:
        """One line: ``attempt 1 (on 10.0.0.2, 10.0.0.3) failed first at rank 1 on ...``."""
        group = "" if self.replica_group is None else f"replica group {self.replica_group} "
        head = f"{group}attempt {self.number} (on {', '.join(self.hosts) or 'no host'})"
        if self.grew:
            return f"{head} drained to grow: {self.grew}"
        if self.preempted:
            return f"{head} was preempted: {self.preempted}"
        if self.failure is None:
            return f"{head} succeeded"
        when = " before every rank started," if self.before_start else ""
        return f"{head} failed{when} first at {self.failure.summary()}"


class WorkerFailedError(SparkdistError, RuntimeError):
    """One or more ranks failed.

    Attributes:
        failures: every rank that failed on its own, keyed by global rank.
        root_cause: the failure that happened first; its traceback is in the message.
        attempts: for runs with restarts, the root cause of each earlier attempt, oldest first.
        history: every attempt (this one last) with the hosts it ran on, when known.
        note: why the run was not restarted again, when restarts were left ("" otherwise).
    """

    __module__ = "sparkdist"

    def __init__(
        self,
        failures: dict[int, RankFailure],
        root_cause: RankFailure,
        attempts: tuple[RankFailure, ...] = (),
        history: tuple[Attempt, ...] = (),
        note: str = "",
    ) -> None:
        self.failures = dict(failures)
        self.root_cause = root_cause
        self.attempts = tuple(attempts)
        self.history = tuple(history)
        self.note = note
        super().__init__(
            _describe_failures(self.failures, root_cause, self.attempts, self.history, note)
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.failures, self.root_cause, self.attempts, self.history, self.note),
        )


def _describe_failures(
    failures: dict[int, RankFailure],
    root: RankFailure,
    attempts: tuple[RankFailure, ...],
    history: tuple[Attempt, ...] = (),
    note: str = "",
) -> str:
    """The message: which ranks failed and how (identical errors grouped, the root cause's
    first), the root cause's traceback without sparkdist's frames, where, then the rest."""
    groups = _group_by_error(failures, root)
    first_ranks, first_error = groups[0]
    lines = [f"{_rank_list(first_ranks)} failed: {first_error}"]
    if root.traceback:
        shown, hidden = (
            (root.traceback, 0) if full_traceback_wanted() else hide_frames(root.traceback)
        )
        lines.append(without_header(shown).rstrip("\n"))
        if hidden:
            lines.append(
                f"({hidden} frame(s) of sparkdist hidden; set {FULL_TRACEBACK_VAR}=1 to see them)"
            )
    where = f"rank {root.rank}" + (f" on {root.host}" if root.host else "")
    if len(first_ranks) > 1:
        where += ", the first to fail"
    if root.exit_code is not None:
        where += f", exit code {root.exit_code}"
    lines.append(f"where: {where}")
    lines.extend(_diagnoses(failures, root))
    for ranks, error in groups[1:]:
        lines.append(
            f"{_rank_list(ranks)} failed too (often in consequence, e.g. a peer lost in a "
            f"collective): {error}"
        )
    if history:
        lines.extend(attempt.summary() for attempt in history[:-1])
    else:
        for number, earlier in enumerate(attempts):
            lines.append(f"attempt {number} failed first at {earlier.summary()}")
    if note:
        lines.append(note)
    if root.last_lines:
        lines.append(f"last output lines of rank {root.rank}:")
        lines.extend(f"  {line}" for line in root.last_lines)
    return "\n".join(lines)


def _diagnoses(failures: dict[int, RankFailure], root: RankFailure) -> list[str]:
    """Each distinct rendezvous diagnosis once, the root cause's first: the rank that could
    not reach an address says more than the peers that waited for it."""
    texts = dict.fromkeys(
        f.diagnosis for f in (root, *(failures[r] for r in sorted(failures))) if f.diagnosis
    )
    lines = []
    for text in list(texts)[:_MAX_DIAGNOSES]:
        first, *rest = text.splitlines()
        lines.append(first)
        lines.extend(f"  {line}" for line in rest)
    return lines


def _error_line(failure: RankFailure) -> str:
    """One line saying what a rank died of: "ValueError: boom", "killed by SIGKILL"."""
    text = failure.message.strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > _MAX_HEADLINE_CHARS:
        first = first[: _MAX_HEADLINE_CHARS - 3] + "..."
    if not failure.exc_type:
        return first or "failed"
    return f"{failure.exc_type}: {first}" if first else failure.exc_type


def _group_by_error(
    failures: dict[int, RankFailure], root: RankFailure
) -> list[tuple[list[int], str]]:
    """Ranks that failed with the same error, together (as Ray's "[Rank 0, 2]"): the root
    cause's group first, then by lowest rank."""
    by_error: dict[str, list[int]] = {}
    for rank in sorted({*failures, root.rank}):
        failure = failures.get(rank, root)
        by_error.setdefault(_error_line(failure), []).append(rank)
    first = _error_line(root)
    ordered = sorted(by_error.items(), key=lambda item: (item[0] != first, item[1][0]))
    return [(ranks, error) for error, ranks in ordered]


def _rank_list(ranks: list[int]) -> str:
    """Say "rank 1" or "ranks 0, 2"."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
