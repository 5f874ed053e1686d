"""``DistributedRun``: the handle of a run started without waiting, for both front doors.

``DistributedFunction.distributed_async`` and ``Distributor.run_async`` hand back this one class,
so a sweep reads the same with either. ``result`` returns what the front door's blocking call
returns (every rank's value for ``distributed``, rank 0's for ``Distributor.run``: the handle
is told which when it is made); ``run_result`` returns the whole ``RunResult`` (every rank's
value, hosts, wall times, the MLflow run) whichever front door made it.

Non-goals: starting the run (``launch``), deciding how it ends (``supervisor``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sparkdist._core.errors import SparkdistError
from sparkdist._core.run.result import RunResult
from sparkdist._core.tracebacks import for_the_user
from sparkdist._engine.start import StartedRun

__all__ = ["DistributedRun", "every_value", "rank0_value"]

T = TypeVar("T")


def every_value(result: RunResult) -> list[Any]:
    """What ``DistributedFunction.distributed`` returns: every rank's value, by global rank."""
    return list(result.values)


def rank0_value(result: RunResult) -> Any:
    """What ``Distributor.run`` returns: rank 0's value (None for a script)."""
    return result.values[0]


class DistributedRun(Generic[T]):
    """A run started with ``distributed_async`` or ``Distributor.run_async``: poll it, wait for
    it, or cancel it.

    ``result()`` returns what the blocking call of the same front door returns: the list of
    every rank's value for ``fn.distributed_async(...)``, rank 0's value for
    ``Distributor(...).run_async(...)``. ``run_result()`` returns the whole ``RunResult``
    (every rank's value) for either.

    Example:
        >>> run = train.distributed_async(lr=0.1)  # doctest: +SKIP
        >>> run.done()  # doctest: +SKIP
        False
        >>> run.cancel()  # stops every rank and waits until they are gone  # doctest: +SKIP
        True
    """

    def __init__(self, launch: StartedRun, pick: Callable[[RunResult], T]) -> None:
        self._launch = launch
        self._pick = pick

    @property
    def run_id(self) -> str:
        """The run's id (each rank's ``TORCHELASTIC_RUN_ID``)."""
        return self._launch.run_id

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run this run logs to; None while MLflow is still setting it up (no rank
        has started the function yet: their rendezvous waits for it) and when tracking is
        off. The same id as ``run_result().mlflow_run_id`` and each rank's ``MLFLOW_RUN_ID``.
        """
        return self._launch.mlflow_run_id

    def result(self, timeout: float | None = None) -> T:
        """Wait for the run and return what the front door's blocking call would have.

        Args:
            timeout: seconds to wait, or None to wait for the end of the run.

        Returns:
            For ``distributed_async``, every rank's value, indexed by global rank; for
            ``Distributor.run_async``, rank 0's value.

        Raises:
            TimeoutError: ``timeout`` passed and the run goes on (``RunTimeoutError``, a
                subclass, means the run itself exceeded ``timeout_s`` and was stopped).
            concurrent.futures.CancelledError: the run was cancelled.
            WorkerFailedError, RendezvousError, RunTimeoutError: as the blocking call raises.
        """
        return self._pick(self.run_result(timeout))

    def run_result(self, timeout: float | None = None) -> RunResult:
        """Wait for the run and return its ``RunResult``: every rank's value, wall time and
        host, the MLflow run id, the last metrics. Waits and raises as ``result`` does."""
        try:
            return self._launch.result(timeout)
        except SparkdistError as error:
            # As the blocking call raises it: the message says what failed, the cause stays.
            raise for_the_user(error) from error.__cause__

    def done(self) -> bool:
        """True once the run has ended (every rank has exited), however it ended."""
        return self._launch.done()

    def cancel(self) -> bool:
        """Stop every rank, and everything the ranks started, and wait until they are gone.

        Returns:
            True if this stopped the run, False if it had already ended.
        """
        return self._launch.cancel("the run was cancelled from its DistributedRun handle")

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<DistributedRun {self.run_id} {state}>"
