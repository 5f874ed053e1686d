"""The sparkdist exception tree.

::

    SparkdistError
    ├── ConfigError (also ValueError)        bad arguments, bad Spark conf, unpicklable function
    ├── ClusterError (also RuntimeError)     too few slots, no GPUs, SSL on, dynamic allocation on
    ├── RendezvousError                      a rank did not join in time
    ├── WorkerFailedError (also RuntimeError) one or more ranks failed
    └── RunTimeoutError (also TimeoutError)  the run exceeded timeout_s

``ClusterError`` and ``WorkerFailedError`` are also ``RuntimeError`` because that is what
pyspark's ``TorchDistributor`` raises in the same situations, so ``except RuntimeError`` in code
written for it keeps working after the import is swapped.

Every error pickles (its constructor arguments travel with it), so it survives a trip from an
executor or a worker process back to the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class SparkdistError(Exception):
    """Base class of every error sparkdist raises on purpose."""


class ConfigError(SparkdistError, ValueError):
    """An argument, a Spark conf value or the training object is not usable."""


class ClusterError(SparkdistError, RuntimeError):
    """The cluster (or the driver machine) cannot host the run as configured."""


class RendezvousError(SparkdistError):
    """A rank did not join the run before the start-up deadline."""


class RunTimeoutError(SparkdistError, TimeoutError):
    """The run took longer than ``timeout_s``; every rank was killed."""


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
    """

    rank: int
    host: str
    exit_code: int | None
    exc_type: str
    message: str
    traceback: str = ""
    last_lines: tuple[str, ...] = ()
    exception_bytes: bytes | None = None

    def summary(self) -> str:
        """One line: what failed, where."""
        what = f"{self.exc_type}: {self.message}" if self.exc_type else self.message
        return f"rank {self.rank} on {self.host}: {what}"


class WorkerFailedError(SparkdistError, RuntimeError):
    """One or more ranks failed.

    Attributes:
        failures: every rank that failed on its own, keyed by global rank.
        root_cause: the failure that happened first; its traceback is in the message.
        attempts: for runs with restarts, the root cause of each earlier attempt, oldest first.
    """

    def __init__(
        self,
        failures: dict[int, RankFailure],
        root_cause: RankFailure,
        attempts: tuple[RankFailure, ...] = (),
    ) -> None:
        self.failures = dict(failures)
        self.root_cause = root_cause
        self.attempts = tuple(attempts)
        super().__init__(_describe_failures(self.failures, root_cause, self.attempts))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.root_cause, self.attempts))


def _describe_failures(
    failures: dict[int, RankFailure],
    root: RankFailure,
    attempts: tuple[RankFailure, ...],
) -> str:
    others = sorted(rank for rank in failures if rank != root.rank)
    lines = [f"{root.summary()} (failed first)"]
    if others:
        lines.append(
            f"also failed (often in consequence, e.g. a peer lost in a collective): ranks "
            f"{', '.join(map(str, others))}"
        )
    for number, earlier in enumerate(attempts):
        lines.append(f"attempt {number} failed first at {earlier.summary()}")
    if root.exit_code is not None:
        lines.append(f"exit code: {root.exit_code}")
    if root.traceback:
        lines.append("traceback of the root cause:")
        lines.append(root.traceback.rstrip("\n"))
    if root.last_lines:
        lines.append(f"last output lines of rank {root.rank}:")
        lines.extend(f"  {line}" for line in root.last_lines)
    return "\n".join(lines)
