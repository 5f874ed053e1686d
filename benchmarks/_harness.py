"""What the benchmark scripts share to run: loopback settings, the command line (``--quick``, and
the hidden ``--child KIND --results FILE``), a scratch directory, one child process per driver
(each in its own process group, checked for stragglers), leftovers, Spark sessions.

Every script follows one shape: the parent parses its options (``Options``), sets the
environment, creates a scratch directory (the children's cwd and ``TMPDIR``), runs each kind of
driver (a Spark master, a Connect session, a fresh local driver) as this script re-invoked with
``--child KIND --results FILE`` and the options it parsed (``Bench.child``), then prints one
JSON line per figure and a table (``_report.emit``). The children append JSON records to
``FILE``; their output goes to a log whose tail is shown when they fail.

Non-goals: what is measured (each script), timing, memory and the launchers' calls
(``_measure``), output (``_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _measure import TORCHRUN_TMP
from _report import machine_record

if TYPE_CHECKING:
    from typing_extensions import Self

#: Every process a benchmark starts inherits this marker (with a fresh value per benchmark run),
#: so processes that outlive a child are found by their environment, whichever session or
#: process group they moved to (sparkdist's zygote and ranks start sessions of their own).
MARKER_VAR = "SPARKDIST_BENCHMARK_RUN"


def set_loopback_env(tracking: bool = False) -> None:
    """Keep every byte on loopback and (unless ``tracking``) MLflow tracking off; executors
    use this interpreter."""
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not tracking:
        os.environ["SPARKDIST_MLFLOW"] = "0"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def progress(script: str, message: str) -> None:
    print(f"[{script}] {message}", file=sys.stderr, flush=True)


def append_records(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """A child's way to hand figures to its parent (appended as they are measured)."""
    with path.open("a", encoding="utf-8") as out:
        out.writelines(json.dumps(record) + "\n" for record in records)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


class Options:
    """A benchmark's command line: its own options, ``--quick`` (a smoke test) and the hidden
    ``--child KIND --results FILE`` of a child run.

    ``add(..., quick=(default, quick_default))`` gives an option a second default that
    ``--quick`` picks (its help names both); ``forward`` rebuilds the command line from the
    values the parent parsed, so a child runs with exactly those (quick defaults, paths made
    absolute, derived values).
    """

    def __init__(self, doc: str | None, quick_help: str) -> None:
        self.parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
        self._quick_help = quick_help
        self._quick: dict[str, tuple[Any, Any]] = {}

    def add(self, *flags: str, quick: tuple[Any, Any] | None = None, **kwargs: Any) -> None:
        if quick is not None:
            kwargs["default"] = None
            default, fast = (" ".join(map(_shown, _listed(value))) for value in quick)
            kwargs["help"] = f"{kwargs.get('help', '')} (default {default}; {fast} with --quick)"
        action = self.parser.add_argument(*flags, **kwargs)
        if quick is not None:
            self._quick[action.dest] = quick

    def parse(self, argv: Sequence[str], positive: Sequence[str] = ("runs",)) -> argparse.Namespace:
        """The options, each quick-dependent one set; those named in ``positive`` (numbers or
        lists of them) must be above 0."""
        self.parser.add_argument("--quick", action="store_true", help=self._quick_help)
        self.parser.add_argument("--child", help=argparse.SUPPRESS)
        self.parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
        args = self.parser.parse_args(argv)
        for dest, (default, quick) in self._quick.items():
            if getattr(args, dest) is None:
                value = quick if args.quick else default
                setattr(args, dest, list(value) if isinstance(value, list) else value)
        low = [name for name in positive if min(_listed(getattr(args, name)), default=1) <= 0]
        if low:
            names = ", ".join("--" + name.replace("_", "-") for name in positive)
            self.parser.error(f"{names} must be positive")
        return args

    def forward(self, args: argparse.Namespace) -> list[str]:
        """The options in ``args`` as a command line (``--child`` and ``--results`` left out)."""
        argv: list[str] = []
        for action in self.parser._actions:
            if not action.option_strings or action.dest in ("help", "child", "results"):
                continue
            flag, value = action.option_strings[0], getattr(args, action.dest)
            if action.nargs == 0:  # a switch: given when it holds the value it stores
                argv += [flag] if value == action.const else []
            elif isinstance(value, list | tuple):
                argv += [flag, *map(str, value)]
            elif value is not None:
                argv += [flag, str(value)]
        return argv


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass
class Bench:
    """One benchmark run in the parent: its scratch directory, children and final report.

    Use as a context manager; ``scratch`` is every child's cwd and ``TMPDIR``. ``tracking``
    leaves sparkdist's MLflow tracking as the user gets it (on); ``keep_logs`` is where each
    child's output is copied, if anywhere.
    """

    script: str
    tracking: bool = False
    keep_logs: Path | None = None
    workdir: Path = field(init=False)
    scratch: Path = field(init=False)
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    load_before: tuple[float, float, float] = field(default_factory=os.getloadavg)
    started: float = field(default_factory=time.monotonic)
    stragglers: dict[str, int] = field(default_factory=dict)
    leftovers: dict[str, int] = field(default_factory=dict)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> Self:
        set_loopback_env(self.tracking)
        # Not "sparkdist-*": the test suite counts such temp names as leaked run dirs.
        self.workdir = Path(
            self._stack.enter_context(tempfile.TemporaryDirectory(prefix=f"bench-{self.script}-"))
        )
        # Whatever the launchers write (run dirs, Spark's local dirs, an MLflow store in the
        # cwd) lands here: nothing reaches the checkout, and what is left over is reported.
        self.scratch = self.workdir / "scratch"
        self.scratch.mkdir()
        os.environ["TMPDIR"] = str(self.scratch)
        tempfile.tempdir = None
        os.environ[MARKER_VAR] = self.marker
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.leftovers = report_leftovers(self.script, self.scratch)
        finally:
            self._stack.close()

    def note(self, message: str) -> None:
        progress(self.script, message)

    def child(
        self,
        kind: str,
        argv: Sequence[str],
        budget_s: float,
        env: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Run this script again as ``--child kind argv...``; return the records it wrote.

        The child runs in its own process group with ``scratch`` as cwd and TMPDIR. Once it
        exits (or runs out of ``budget_s``), every process still carrying this run's marker
        gets 10 s to exit (the JVM exits on its own once its Python driver is gone) and is
        then reported and killed.
        """
        name = re.sub(r"\W+", "-", kind).strip("-")
        tag = f"{name}-{time.monotonic_ns()}"
        results, log = self.workdir / f"{tag}.jsonl", self.workdir / f"{tag}.log"
        command = [sys.executable, os.path.abspath(sys.argv[0]), "--child", kind]
        command += ["--results", str(results), *argv]
        self.note(f"{kind}: child started")
        started = time.monotonic()
        with log.open("wb") as out:
            child = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.scratch,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
            try:
                returncode: int | None = child.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                returncode = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        survivors = kill_stragglers(self.marker)
        if survivors:
            self.note(
                f"{kind}: {len(survivors)} process(es) outlived the child by 10 s, "
                "killed:\n" + "\n".join(survivors)
            )
            self.stragglers[kind] = self.stragglers.get(kind, 0) + len(survivors)
        if returncode != 0:
            why = "ran out of time" if returncode is None else f"exited with {returncode}"
            self.note(f"{kind}: child {why}; the end of its output:\n{tail(log)}")
        else:
            self.note(f"{kind}: child done in {time.monotonic() - started:.1f} s")
        if self.keep_logs is not None:
            self.keep_logs.mkdir(parents=True, exist_ok=True)
            kept = self.keep_logs / f"{name}.log"
            kept.write_bytes(log.read_bytes())
            self.note(f"{kind}: output kept in {kept}")
        return read_records(results)

    def machine(self, **extra: Any) -> dict[str, Any]:
        """``_report.machine_record`` plus the stragglers, the 1/5/15-minute loads and extras."""
        record = machine_record(self.load_before, time.monotonic() - self.started, self.leftovers)
        record["loadavg_before"] = [round(x, 2) for x in self.load_before]
        record["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        record["stragglers"] = dict(self.stragglers)
        record.update(extra)
        return record


def kill_stragglers(marker: str, grace_s: float = 10.0) -> list[str]:
    """Processes (not this one) carrying ``marker``: wait ``grace_s``, kill, describe them."""
    import psutil

    own = {os.getpid()}
    marked = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in own:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARKER_VAR) == marker:
                marked.append(proc)
    _, alive = psutil.wait_procs(marked, timeout=grace_s)
    described = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            described.append(f"  {proc.pid} {proc.name()}: {' '.join(proc.cmdline())[:160]}")
            proc.kill()
    return described


def report_leftovers(script: str, scratch: Path) -> dict[str, int]:
    """What the children left in their cwd/TMPDIR, by name pattern (random tails as ``*``)."""
    leftovers: dict[str, int] = {}
    names = sorted(os.listdir(scratch))
    if TORCHRUN_TMP in names:  # torchrun's own TMPDIR: its contents are listed, not the dir
        names.remove(TORCHRUN_TMP)
        names += [f"{TORCHRUN_TMP}/{n}" for n in sorted(os.listdir(scratch / TORCHRUN_TMP))]
    for name in names:
        # tempfile names end in 8 random characters: "torchelastic_*", "tmp*".
        # Spark's directories end in a UUID: "blockmgr-*".
        pattern = re.sub(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "*", name)
        pattern = re.sub(r"^(tmp|.*[_-])[a-z0-9_]{8}$", r"\1*", pattern)
        leftovers[pattern] = leftovers.get(pattern, 0) + 1
    if leftovers:
        listed = ", ".join(f"{pattern} x{count}" for pattern, count in leftovers.items())
        progress(script, f"left behind in the children's cwd/TMPDIR: {listed}")
    return leftovers


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def classic_session(
    master: str,
    app: str,
    scratch: Path | None = None,
    conf: Mapping[str, str] | None = None,
    tracking: bool = False,
) -> Any:
    """A quiet classic SparkSession on loopback (executors use this interpreter).

    With ``scratch``, Spark's local dirs (shuffle files, block manager) and the JVM's temp dir
    go there, so whatever Spark leaves behind is seen by the leftover report. Unless
    ``tracking``, the executors' ranks run with MLflow tracking off.
    """
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.pyspark.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "lo")
    )
    if not tracking:
        builder = builder.config("spark.executorEnv.SPARKDIST_MLFLOW", "0")
    if scratch is not None:
        builder = builder.config("spark.local.dir", str(scratch)).config(
            "spark.driver.extraJavaOptions", f"-Djava.io.tmpdir={scratch}"
        )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def wait_for_executors(session: Any, count: int, timeout_s: float = 120.0) -> None:
    """Block until ``count`` executors registered, so no launcher pays for their start."""
    tracker = session.sparkContext._jsc.sc()
    deadline = time.monotonic() + timeout_s
    # The list includes the driver. Executors register with no event a Python caller can
    # wait on, hence the poll.
    while tracker.getExecutorMemoryStatus().size() < count + 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} executors did not register in {timeout_s:.0f} s")
        time.sleep(0.1)
