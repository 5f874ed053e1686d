"""Measuring launchers: launch time after a warm-up and failure latency, interleaved; a call on
a guarded thread; the torchrun reference; pyspark's by-value shipping; a process's peak memory
over a block.

Launchers are measured in turns (A, B, A, B, ...) rather than one after the other, so a change
in the machine's load (other users of a shared box) hits every launcher alike.

Non-goals: what a launcher is (``launch.py`` passes plain callables), printing (``_report``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import _jobs

if TYPE_CHECKING:
    from typing_extensions import Self

#: A launch that takes longer than this is treated as hung (the figures are seconds).
LAUNCH_TIMEOUT_S = 300.0
#: torchrun runs with this subdirectory of the scratch dir as TMPDIR, so what it leaves
#: (``torchelastic_*``) is told apart from what sparkdist leaves.
TORCHRUN_TMP = "torchrun-tmp"

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


def first_line(error: BaseException | None, limit: int = 300) -> str:
    """``Type: first non-blank line of the message``, for the JSON record ("" for no error)."""
    if error is None:
        return ""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:limit]


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def kill_tree(pid: int) -> None:
    """Kill process ``pid`` and every process under it (children first, then ``pid``)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.Error):
                proc.kill()


@contextlib.contextmanager
def pickled_by_value(module: ModuleType) -> Iterator[None]:
    """Make pyspark's cloudpickle ship ``module``'s functions by value.

    pyspark's torchrun workers cannot import the benchmark's modules; sparkdist ships them by
    value on its own (with its own cloudpickle), so it gets no such help.
    """
    from pyspark import cloudpickle as pyspark_cloudpickle

    pyspark_cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        pyspark_cloudpickle.unregister_pickle_by_value(module)  # type: ignore[no-untyped-call]


def torchrun_command(nproc: int, script: str, *script_args: str) -> list[str]:
    """``torchrun --standalone --nnodes=1 --nproc_per_node=nproc script args...``."""
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"),
        *(f"--nproc_per_node={nproc}", script, *script_args),
    ]


@dataclass
class TorchrunResult:
    """One finished ``torchrun`` call: exit status, merged output, wall time."""

    returncode: int | None  # None: it ran out of time and was killed with its workers
    output: str
    wall_s: float


def run_torchrun(
    nproc: int,
    script: str,
    *script_args: str,
    timeout_s: float = 300.0,
    cwd: str | os.PathLike[str] | None = None,
) -> TorchrunResult:
    """``torchrun_command(nproc, script, *script_args)``, waited for.

    torchrun starts its workers in sessions of their own, so a run that outlives ``timeout_s``
    is killed process tree first. Its TMPDIR is ``TORCHRUN_TMP`` under ``cwd`` (default: this
    process's cwd).
    """
    tmpdir = Path(cwd or os.getcwd()) / TORCHRUN_TMP
    tmpdir.mkdir(exist_ok=True)
    started = time.perf_counter()
    process = subprocess.Popen(
        torchrun_command(nproc, script, *script_args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        cwd=cwd,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        output, _ = process.communicate()
        returncode = None
    return TorchrunResult(returncode, output, time.perf_counter() - started)


class Sampler:
    """``sample()`` on a daemon thread every ``interval_s`` while a ``with`` block runs; a
    subclass keeps what it samples (a peak, say) and may read once more when the block ends."""

    def __init__(self, interval_s: float, name: str) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


class PeakSampler(Sampler):
    """A process's peak ``VmRSS`` and ``RssAnon`` (MB) over a ``with`` block.

    ``RssAnon`` is memory the process owns; ``VmRSS`` also counts resident pages of mapped files
    (page cache a memory-mapped Arrow file brings in, which the kernel can drop at will). The RSS
    peak is exact where the kernel lets us reset the process's high-water mark (``VmHWM``, by
    writing 5 to ``/proc/PID/clear_refs``); ``RssAnon`` has no high-water mark, so it is sampled
    on a daemon thread every ``interval_s`` (a spike shorter than that can be missed).

    Example::

        with PeakSampler() as peak:
            work()
        peak.rss_mb, peak.anon_mb, peak.start_rss_mb
    """

    def __init__(self, pid: int | None = None, interval_s: float = 0.005) -> None:
        super().__init__(interval_s, "peak-sampler")
        self._proc = f"/proc/{pid or os.getpid()}"
        self._hwm_reset = False
        self.start_rss_mb = self.start_anon_mb = 0.0
        self.rss_mb = self.anon_mb = 0.0

    def read(self) -> tuple[float, float]:
        """The current (VmRSS, RssAnon) in MB."""
        values = self._status()
        return values.get("VmRSS:", 0.0), values.get("RssAnon:", 0.0)

    def _status(self) -> dict[str, float]:
        values = {}
        with open(f"{self._proc}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(("VmRSS:", "RssAnon:", "VmHWM:")):
                    key, amount, _ = line.split()
                    values[key] = int(amount) / 1024
        return values

    def sample(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            rss, anon = self.read()
            self.rss_mb, self.anon_mb = max(self.rss_mb, rss), max(self.anon_mb, anon)

    def __enter__(self) -> Self:
        try:
            with open(f"{self._proc}/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")  # VmHWM := VmRSS
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        self.start_rss_mb, self.start_anon_mb = self.read()
        self.rss_mb, self.anon_mb = self.start_rss_mb, self.start_anon_mb
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        with contextlib.suppress(OSError, ValueError):
            values = self._status()
            peak = values.get("VmHWM:", 0.0) if self._hwm_reset else 0.0
            self.rss_mb = max(self.rss_mb, values.get("VmRSS:", 0.0), peak)
            self.anon_mb = max(self.anon_mb, values.get("RssAnon:", 0.0))
