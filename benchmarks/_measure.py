"""Timing launchers: launch time after a warm-up, and failure latency, interleaved.

Launchers are measured in turns (A, B, A, B, ...) rather than one after the other, so a change
in the machine's load (other users of a shared box) hits every launcher alike.

Non-goals: what a launcher is (``launch.py`` passes plain callables), printing (``_report``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import _jobs

#: A launch that takes longer than this is treated as hung (the figures are seconds).
LAUNCH_TIMEOUT_S = 300.0

_RECORD_FIELDS = (
    "figure",
    "mode",
    "launcher",
    "runs",
    "warmup",
    "outcomes",
    "cause_in_error",
    "first_error",
)


@dataclass
class Figure:
    """One measured figure: a launcher's times in one mode, and what the driver saw.

    ``runs`` holds the measured seconds (trials that did not yield a time are left out);
    ``outcomes`` counts how each failure trial ended on the driver: the exception type name,
    ``"returned"`` (the launcher reported success) or ``"timeout"``; ``cause_in_error`` counts
    the errors whose text names the failing rank's exception message, and ``first_error`` is
    the first line of the first error seen.
    """

    figure: str
    mode: str
    launcher: str
    runs: list[float] = field(default_factory=list)
    warmup: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)
    cause_in_error: int = 0
    first_error: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def to_record(self) -> dict[str, Any]:
        """The JSON line printed for this figure."""
        record: dict[str, Any] = {
            "figure": self.figure,
            "mode": self.mode,
            "launcher": self.launcher,
            "median": _round(self.median),
            "runs": [_round(r) for r in self.runs],
        }
        if self.figure == "launch_s":
            record["warmup"] = _round(self.warmup)
        else:
            record.update(
                outcomes=self.outcomes,
                cause_in_error=self.cause_in_error,
                first_error=self.first_error,
            )
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Figure:
        return cls(**{k: v for k, v in record.items() if k in _RECORD_FIELDS})


@dataclass
class Trial:
    """One call of a launcher: when it ended on the driver, and how."""

    ended_at: float  # time.time() when run() returned or raised
    error: BaseException | None = None
    timed_out: bool = False


class LaunchFailed(RuntimeError):
    """A launch that had to succeed (a launch-time trial) failed or hung."""


def call_with_timeout(call: Callable[[], Any], timeout_s: float) -> Trial:
    """Run ``call`` on a daemon thread; note the driver time at which it returned or raised.

    A call still running after ``timeout_s`` is abandoned (``timed_out``); the caller cleans
    up what it left running.
    """
    trials: list[Trial] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # every outcome is a measurement
            trials.append(Trial(ended_at=time.time(), error=exc))
        else:
            trials.append(Trial(ended_at=time.time()))

    thread = threading.Thread(target=target, name="benchmark-launch", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return trials[0] if trials else Trial(ended_at=time.time(), timed_out=True)


def measure_launches(
    mode: str,
    launches: Mapping[str, Callable[[], Any]],
    runs: int,
    on_timeout: Callable[[], None],
) -> list[Figure]:
    """Each launcher once to warm up, then ``runs`` timed rounds; any failure is fatal."""
    figures = {launcher: Figure("launch_s", mode, launcher) for launcher in launches}
    for index in range(runs + 1):
        for launcher, launch in launches.items():
            seconds = time_one_launch(f"{launcher} in {mode}", launch, on_timeout)
            if index == 0:
                figures[launcher].warmup = seconds
            else:
                figures[launcher].runs.append(seconds)
    return list(figures.values())


def time_one_launch(what: str, launch: Callable[[], Any], on_timeout: Callable[[], None]) -> float:
    """Seconds from calling ``launch`` to its return."""
    started = time.time()
    trial = call_with_timeout(launch, LAUNCH_TIMEOUT_S)
    if trial.timed_out:
        on_timeout()
        raise LaunchFailed(f"launch of {what} hung for {LAUNCH_TIMEOUT_S:.0f} s")
    if trial.error is not None:
        raise LaunchFailed(f"launch of {what} failed: {trial.error}") from trial.error
    return trial.ended_at - started


def measure_failures(
    mode: str,
    launches: Mapping[str, Callable[[str], Any]],
    runs: int,
    timeout_s: float,
    on_timeout: Callable[[], None],
) -> list[Figure]:
    """``runs`` rounds of: each launcher runs ``_jobs.fail_one_rank``; time stamp to error.

    Each launch callable takes the path the failing rank writes its time to. A launcher that
    times out is dropped from later rounds: its abandoned run could still hold the cores.
    """
    figures = {launcher: Figure("failure_s", mode, launcher) for launcher in launches}
    with tempfile.TemporaryDirectory(prefix="bench-failure-stamps-") as stamps:
        for _ in range(runs):
            for launcher, launch_failing in launches.items():
                figure = figures[launcher]
                if "timeout" in figure.outcomes:
                    continue
                stamp_path = os.path.join(stamps, uuid.uuid4().hex)
                trial = call_with_timeout(partial(launch_failing, stamp_path), timeout_s)
                if trial.timed_out:
                    on_timeout()
                record_failure(figure, trial, _jobs.read_stamp(stamp_path))
    return list(figures.values())


def record_failure(figure: Figure, trial: Trial, raised_at: float | None) -> None:
    """Add one failure trial to ``figure``: its outcome, and its latency when it has one."""
    if trial.timed_out:
        figure.count("timeout")
        return
    if trial.error is None:
        figure.count("returned")
        return
    figure.count(type(trial.error).__name__)
    figure.first_error = figure.first_error or first_line(trial.error)
    if _jobs.FAILURE_MARKER in str(trial.error):
        figure.cause_in_error += 1
    if raised_at is not None:
        figure.runs.append(trial.ended_at - raised_at)


def first_line(error: BaseException, limit: int = 300) -> str:
    """``Type: first non-blank line of the message``, for the JSON record."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:limit]


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
